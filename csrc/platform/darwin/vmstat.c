/* macOS readings into a sample: pure, no Apple headers. Field meanings are
 * those of <mach/vm_statistics.h>, <mach/task_info.h> and <sys/sysctl.h>. */
#include "vmstat.h"

uint64_t mgi_darwin_used_bytes(const mgi_darwin_raw_t *r)
{
    uint64_t app = r->internal_page_count > r->purgeable_count
                       ? r->internal_page_count - r->purgeable_count : 0;
    return (app + r->wire_count + r->compressor_page_count) * r->page_size;
}

static void fill_process(const mgi_darwin_raw_t *r, mg_sample_t *s)
{
    if (r->have_task) {
        /* the footprint counts compressed and swapped pages, which RSS drops:
         * it is what Activity Monitor shows and what a budget bounds */
        s->have |= MG_HAVE_STATUS | MG_HAVE_RSS_PEAK | MG_HAVE_FOOTPRINT;
        s->rss_bytes = r->resident_size;
        s->rss_peak_bytes = r->resident_size_peak > r->resident_size ? r->resident_size_peak
                                                                     : r->resident_size;
        s->footprint_bytes = r->phys_footprint;
    }
    if (r->have_rusage) {
        s->have |= MG_HAVE_FAULTS;
        s->minor_faults = r->minor_faults;
        s->major_faults = r->major_faults;
    }
}

static void fill_system(const mgi_darwin_raw_t *r, mg_sample_t *s)
{
    if (r->have_memsize) {
        s->have |= MG_HAVE_MEMINFO;
        s->mem_total_bytes = r->memsize;
    }
    if (r->have_vm && r->page_size) {
        uint64_t used = mgi_darwin_used_bytes(r);
        if (r->have_memsize) {
            s->have |= MG_HAVE_MEMAVAIL;
            s->mem_available_bytes = used < r->memsize ? r->memsize - used : 0;
        }
        s->have |= MG_HAVE_VMSTAT | MG_HAVE_COMPRESSED;
        s->swap_in_pages = r->swapins;
        s->swap_out_pages = r->swapouts;
        s->system_major_faults = r->pageins; /* pages read in from a pager */
        s->compressed_bytes = r->compressor_page_count * r->page_size;
        s->compressions = r->compressions;
    }
    if (r->have_swap) {
        s->have |= MG_HAVE_SWAP_TOTAL;
        s->swap_total_bytes = r->xsu_total;
        s->swap_free_bytes = r->xsu_avail;
    }
    if (r->have_level) {
        s->have |= MG_HAVE_OS_LEVEL;
        s->os_pressure_level = r->pressure_level;
    }
}

static void fill_rates(const mgi_darwin_raw_t *now, const mgi_darwin_raw_t *prev,
                       mg_sample_t *s)
{
    if (!prev || !prev->have_vm || !now->have_vm || now->mono_ns <= prev->mono_ns)
        return;
    double sec = (double)(now->mono_ns - prev->mono_ns) / 1e9;
    s->swap_in_pages_per_s = mgi_rate(prev->swapins, now->swapins, sec);
    s->swap_out_pages_per_s = mgi_rate(prev->swapouts, now->swapouts, sec);
    s->compressions_per_s = mgi_rate(prev->compressions, now->compressions, sec);
}

void mgi_darwin_fill(const mgi_darwin_raw_t *now, const mgi_darwin_raw_t *prev, mg_sample_t *s)
{
    fill_process(now, s);
    fill_system(now, s);
    fill_rates(now, prev, s);
}
