/* Telemetry sources anywhere POSIX (the fallback layer): getrusage for this
 * process's faults and peak RSS, sysconf for the machine's memory. Portable
 * POSIX shows nothing else: the current RSS, swap, available memory, PSI and
 * cgroups stay absent (None in Python), never zeros. */
#include <errno.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "mgi.h"

int mgi_sources_open(mgi_sources_t *src, const char *proc_root, const char *cgroup_root)
{
    if (mgi_sources_begin(src, proc_root, cgroup_root))
        return EINVAL;
    long page = sysconf(_SC_PAGESIZE);
    src->page_size = page > 0 ? (uint64_t)page : 0;
    return 0;
}

void mgi_sources_read(mgi_sources_t *src, mg_sample_t *s, int urgent)
{
    (void)urgent;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        s->have |= MG_HAVE_FAULTS | MG_HAVE_RSS_PEAK;
        s->minor_faults = (uint64_t)ru.ru_minflt;
        s->major_faults = (uint64_t)ru.ru_majflt;
        s->rss_peak_bytes = (uint64_t)ru.ru_maxrss * 1024; /* KiB on Linux and the BSDs */
    }
#ifdef _SC_PHYS_PAGES
    long pages = sysconf(_SC_PHYS_PAGES);
    if (pages > 0 && src->page_size) {
        s->have |= MG_HAVE_MEMINFO;
        s->mem_total_bytes = (uint64_t)pages * src->page_size;
    }
#endif
}

void mgi_sources_forget(mgi_sources_t *src)
{
    (void)src; /* nothing is kept open */
}

void mgi_sources_close(mgi_sources_t *src)
{
    (void)src;
}
