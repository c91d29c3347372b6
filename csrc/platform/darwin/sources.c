/* Telemetry sources on macOS: this task's footprint from task_info, the
 * system's pages from host_statistics64, memory size, swap and the kernel's
 * pressure level from sysctl. Each reading is copied into plain numbers and
 * converted by vmstat.c, which is pure and tested on every platform; this
 * file only calls Apple's documented interfaces. A sample allocates nothing
 * (the state below is made once, when the sources open). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/sysctl.h>

#include <mach/mach.h>
#include <mach/vm_page_size.h>

#include "vmstat.h"

typedef struct darwin_state {
    mgi_darwin_raw_t prev; /* the last reading, for rates */
    int have_prev;
} darwin_state_t;

int mgi_sources_open(mgi_sources_t *src, const char *proc_root, const char *cgroup_root)
{
    if (mgi_sources_begin(src, proc_root, cgroup_root))
        return EINVAL;
    /* host_statistics64 counts kernel pages, which a Rosetta process's
     * getpagesize() does not give */
    src->page_size = (uint64_t)vm_kernel_page_size;
    src->layer = calloc(1, sizeof(darwin_state_t));
    return src->layer ? 0 : ENOMEM;
}

static void read_task(mgi_darwin_raw_t *r)
{
    task_vm_info_data_t info;
    mach_msg_type_number_t count = TASK_VM_INFO_COUNT;
    if (task_info(mach_task_self(), TASK_VM_INFO, (task_info_t)&info, &count) != KERN_SUCCESS ||
        count < TASK_VM_INFO_REV1_COUNT) /* phys_footprint arrived with revision 1 */
        return;
    r->have_task = 1;
    r->phys_footprint = info.phys_footprint;
    r->resident_size = info.resident_size;
    r->resident_size_peak = info.resident_size_peak;
}

static void read_rusage(mgi_darwin_raw_t *r)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return;
    r->have_rusage = 1;
    r->minor_faults = (uint64_t)ru.ru_minflt;
    r->major_faults = (uint64_t)ru.ru_majflt;
}

/* The host port is asked for at every reading and given back: a port name
 * does not survive fork, and DataLoader workers fork. */
static void read_host(uint64_t page_size, mgi_darwin_raw_t *r)
{
    vm_statistics64_data_t vm;
    mach_msg_type_number_t count = HOST_VM_INFO64_COUNT;
    mach_port_t host = mach_host_self();
    kern_return_t kr = host_statistics64(host, HOST_VM_INFO64, (host_info64_t)&vm, &count);
    mach_port_deallocate(mach_task_self(), host);
    if (kr != KERN_SUCCESS)
        return;
    r->have_vm = 1;
    r->page_size = page_size;
    r->free_count = vm.free_count;
    r->wire_count = vm.wire_count;
    r->purgeable_count = vm.purgeable_count;
    r->internal_page_count = vm.internal_page_count;
    r->compressor_page_count = vm.compressor_page_count;
    r->compressions = vm.compressions;
    r->pageins = vm.pageins;
    r->swapins = vm.swapins;
    r->swapouts = vm.swapouts;
}

static void read_sysctls(mgi_darwin_raw_t *r)
{
    uint64_t memsize;
    size_t len = sizeof(memsize);
    if (sysctlbyname("hw.memsize", &memsize, &len, NULL, 0) == 0 && len == sizeof(memsize)) {
        r->have_memsize = 1;
        r->memsize = memsize;
    }
    struct xsw_usage xsw;
    len = sizeof(xsw);
    if (sysctlbyname("vm.swapusage", &xsw, &len, NULL, 0) == 0 && len == sizeof(xsw)) {
        r->have_swap = 1;
        r->xsu_total = xsw.xsu_total;
        r->xsu_avail = xsw.xsu_avail;
    }
    int level;
    len = sizeof(level);
    if (sysctlbyname("kern.memorystatus_vm_pressure_level", &level, &len, NULL, 0) == 0 &&
        len == sizeof(level)) {
        r->have_level = 1;
        r->pressure_level = level;
    }
}

void mgi_sources_read(mgi_sources_t *src, mg_sample_t *s, int urgent)
{
    (void)urgent; /* every source is read every sample */
    darwin_state_t *st = src->layer;
    mgi_darwin_raw_t r;
    memset(&r, 0, sizeof(r));
    r.mono_ns = s->mono_ns;
    read_task(&r);
    read_rusage(&r);
    read_host(src->page_size, &r);
    read_sysctls(&r);
    mgi_darwin_fill(&r, st && st->have_prev ? &st->prev : NULL, s);
    if (st) {
        st->prev = r;
        st->have_prev = 1;
    }
}

void mgi_sources_forget(mgi_sources_t *src)
{
    /* no descriptors; the last reading is the parent's, and the next open
     * (after a fork) makes a fresh state, so this one goes */
    free(src->layer);
    src->layer = NULL;
}

void mgi_sources_close(mgi_sources_t *src)
{
    free(src->layer);
    src->layer = NULL;
}
