/* The macOS layer's readings as plain numbers, and their conversion into a
 * sample. sources.c copies Apple's structs (task_vm_info, vm_statistics64,
 * xsw_usage) into mgi_darwin_raw_t; the conversion is pure, so it builds and
 * is tested on any platform. */
#ifndef MEMGUARD_DARWIN_VMSTAT_H
#define MEMGUARD_DARWIN_VMSTAT_H

#include <stdint.h>

#include "mgi.h"

typedef struct mgi_darwin_raw {
    int64_t mono_ns;
    /* task_info(TASK_VM_INFO): this process, in bytes */
    int have_task;
    uint64_t phys_footprint, resident_size, resident_size_peak;
    /* getrusage: this process's faults */
    int have_rusage;
    uint64_t minor_faults, major_faults;
    /* host_statistics64(HOST_VM_INFO64): the system, in pages of page_size
     * (vm_kernel_page_size: 16 KiB on Apple silicon, 4 KiB on Intel) */
    int have_vm;
    uint64_t page_size;
    uint64_t free_count, wire_count, purgeable_count, internal_page_count;
    uint64_t compressor_page_count, compressions, pageins, swapins, swapouts;
    /* sysctl hw.memsize, vm.swapusage (xsw_usage), in bytes */
    int have_memsize, have_swap;
    uint64_t memsize, xsu_total, xsu_avail;
    /* sysctl kern.memorystatus_vm_pressure_level: MG_OS_LEVEL_* */
    int have_level;
    int pressure_level;
} mgi_darwin_raw_t;

/* Bytes in use as Activity Monitor counts them: app memory (internal pages
 * less purgeable ones), wired, and what the compressor occupies. */
uint64_t mgi_darwin_used_bytes(const mgi_darwin_raw_t *r);

/* Fill *s (after mgi_sample_init) from *now; rates from *prev when it is not
 * NULL and earlier. Fields the raw reading lacks stay absent. */
void mgi_darwin_fill(const mgi_darwin_raw_t *now, const mgi_darwin_raw_t *prev, mg_sample_t *s);

#endif /* MEMGUARD_DARWIN_VMSTAT_H */
