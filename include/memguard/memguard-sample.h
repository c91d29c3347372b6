/**
 * @file memguard-sample.h
 * @brief The versioned telemetry sample. Fields carry their unit in their
 * name; a field whose MG_HAVE_* bit is clear was not available (the source is
 * absent or unreadable) and holds 0, never a reading.
 */
#ifndef MEMGUARD_SAMPLE_H
#define MEMGUARD_SAMPLE_H

#include <stdint.h>

#define MG_SAMPLE_VERSION 5

/** Bits of mg_sample_t.have. */
enum {
    MG_HAVE_STATUS = 1u << 0,        /**< rss_bytes (and rss_peak_bytes, before version 5) */
    MG_HAVE_SWAP = 1u << 1,          /**< swap_bytes (VmSwap) */
    MG_HAVE_FAULTS = 1u << 2,        /**< minor_faults, major_faults */
    MG_HAVE_MEMINFO = 1u << 3,       /**< mem_total_bytes (and swap_total/free, before version 5) */
    MG_HAVE_MEMAVAIL = 1u << 4,      /**< mem_available_bytes */
    MG_HAVE_VMSTAT = 1u << 5,        /**< swap_in/out_pages, system_major_faults */
    MG_HAVE_PSI = 1u << 6,           /**< psi_some_* */
    MG_HAVE_PSI_FULL = 1u << 7,      /**< psi_full_* */
    MG_HAVE_CGROUP = 1u << 8,        /**< cgroup_version, cgroup_usage_bytes */
    MG_HAVE_CGROUP_LIMIT = 1u << 9,  /**< cgroup_limit_bytes (a limit is set) */
    MG_HAVE_CGROUP_HIGH = 1u << 10,  /**< cgroup_high_bytes (v2, set) */
    MG_HAVE_CGROUP_WS = 1u << 11,    /**< cgroup_working_set_bytes */
    MG_HAVE_CGROUP_EVENTS = 1u << 12,/**< cgroup_oom_events, cgroup_oom_kill_events */
    MG_HAVE_CGROUP_PSI = 1u << 13,   /**< cgroup_psi_* (v2 memory.pressure) */
    MG_HAVE_RATES = 1u << 14,        /**< *_per_s and *_stall (needs a previous sample) */
    MG_HAVE_BUDGET = 1u << 15,       /**< budget_bytes, budget_used_fraction */
    MG_HAVE_HEADROOM = 1u << 16,     /**< headroom_fraction */
    MG_HAVE_ARENA = 1u << 17,        /**< arena_* (memguard's allocator is in use) */
    MG_HAVE_CUDA = 1u << 18,         /**< cuda_* (pushed by mg_sampler_push_cuda) */
    MG_HAVE_CUDA_BUDGET = 1u << 19,  /**< cuda_budget_used_fraction (a CUDA budget is set) */
    MG_HAVE_FOOTPRINT = 1u << 20,    /**< footprint_bytes (version 4) */
    MG_HAVE_CHILDREN = 1u << 21,     /**< children, children_bytes (the process tree was read) */
    MG_HAVE_RSS_PEAK = 1u << 22,     /**< rss_peak_bytes (version 5) */
    MG_HAVE_SWAP_TOTAL = 1u << 23,   /**< swap_total_bytes, swap_free_bytes (version 5) */
    MG_HAVE_COMPRESSED = 1u << 24,   /**< compressed_bytes, compressions (version 5; macOS) */
    MG_HAVE_OS_LEVEL = 1u << 25,     /**< os_pressure_level (version 5; macOS) */
};

/** The kernel's own memory pressure levels (macOS's
 * kern.memorystatus_vm_pressure_level, the values of dispatch's
 * DISPATCH_MEMORYPRESSURE_NORMAL, _WARN and _CRITICAL). */
enum {
    MG_OS_LEVEL_NORMAL = 1,
    MG_OS_LEVEL_WARN = 2,
    MG_OS_LEVEL_CRITICAL = 4,
};

/** What set mg_sample_t.budget_bytes (version 4). */
enum {
    MG_BUDGET_SRC_NONE = 0,
    MG_BUDGET_SRC_USER = 1,   /**< the budget asked for */
    MG_BUDGET_SRC_CGROUP = 2, /**< the cgroup's limit less what others in it use */
    MG_BUDGET_SRC_HOST = 3,   /**< the footprint plus MemAvailable less a reserve */
};

/** One telemetry sample. */
typedef struct mg_sample {
    uint32_t size;     /**< sizeof(mg_sample_t) of the writer */
    uint32_t version;  /**< MG_SAMPLE_VERSION */
    uint64_t seq;      /**< 1 for the first sample of a sampler */
    uint64_t have;     /**< MG_HAVE_* bits */
    int64_t t_ns;      /**< wall clock (CLOCK_REALTIME) */
    int64_t mono_ns;   /**< CLOCK_MONOTONIC */
    int64_t interval_ns; /**< since the previous sample; 0 for the first */
    int64_t cost_ns;   /**< time spent taking this sample */

    /* the process */
    uint64_t rss_bytes, rss_peak_bytes, swap_bytes;
    uint64_t minor_faults, major_faults;
    double minor_faults_per_s, major_faults_per_s;

    /* the system */
    uint64_t mem_total_bytes, mem_available_bytes;
    uint64_t swap_total_bytes, swap_free_bytes;
    uint64_t swap_in_pages, swap_out_pages, system_major_faults;
    double swap_in_pages_per_s, swap_out_pages_per_s;

    /* PSI, /proc/pressure/memory: avg in percent, totals in microseconds */
    double psi_some_avg10, psi_some_avg60, psi_full_avg10, psi_full_avg60;
    uint64_t psi_some_total_us, psi_full_total_us;
    double psi_some_stall, psi_full_stall; /**< fraction of the last interval */

    /* the memory cgroup */
    int32_t cgroup_version;  /**< 1 or 2 */
    int32_t pad0;
    uint64_t cgroup_usage_bytes, cgroup_limit_bytes, cgroup_high_bytes;
    uint64_t cgroup_working_set_bytes; /**< usage less inactive file pages */
    uint64_t cgroup_oom_events, cgroup_oom_kill_events;
    double cgroup_psi_some_avg10, cgroup_psi_full_avg10;
    uint64_t cgroup_psi_some_total_us, cgroup_psi_full_total_us;
    double cgroup_psi_some_stall, cgroup_psi_full_stall;

    /* pressure */
    uint64_t budget_bytes;       /**< judged against: the live budget when the sampler is live */
    double budget_used_fraction; /**< (footprint - arena cached) / budget_bytes */
    double headroom_fraction;    /**< min free fraction: system, cgroup */
    int32_t raw_level;           /**< level of this sample alone */
    int32_t level;               /**< after hysteresis */
    uint32_t reasons;            /**< MG_REASON_* behind raw_level */
    uint32_t pad1;

    /* memguard's arena (version 2) */
    uint64_t arena_allocated_bytes, arena_reserved_bytes, arena_cached_bytes;
    uint64_t arena_budget_bytes;     /**< 0: the arena has no budget */
    uint64_t arena_ooms;             /**< allocations refused by the arena's budget */
    double arena_budget_used_fraction; /**< (reserved - cached) / budget; NaN without one */

    /* a CUDA device's allocator (version 3): the newest counters pushed at
     * a step boundary (mg_sampler_push_cuda), never read from the device
     * by the sampler thread */
    int32_t cuda_device;
    uint32_t pad2;
    uint64_t cuda_allocated_bytes, cuda_reserved_bytes, cuda_active_bytes;
    uint64_t cuda_allocated_peak_bytes, cuda_reserved_peak_bytes;
    uint64_t cuda_alloc_retries;     /**< cache released to retry an allocation, in all */
    uint64_t cuda_ooms;              /**< allocations refused, in all */
    uint64_t cuda_new_retries;       /**< rise of cuda_alloc_retries since the last sample */
    uint64_t cuda_free_bytes, cuda_total_bytes; /**< the device's, cudaMemGetInfo */
    uint64_t cuda_budget_bytes;      /**< 0: none */
    int64_t cuda_age_ns;             /**< since the push */
    double cuda_budget_used_fraction; /**< allocated / budget; NaN without one */

    /* the process tree and the live budget (version 4) */
    uint64_t footprint_bytes;  /**< rss + swap, plus the children's private and swapped bytes */
    uint64_t children_bytes;   /**< the children's part of footprint_bytes */
    uint32_t children;         /**< processes below this one (workers; see mg_ranks_note) */
    int32_t budget_source;     /**< MG_BUDGET_SRC_* behind budget_bytes */
    uint64_t user_budget_bytes; /**< the budget asked for (0: none, or "auto") */

    /* the operating system's own signals (version 5; macOS) */
    uint64_t compressed_bytes;   /**< memory the compressor occupies */
    uint64_t compressions;       /**< pages compressed since boot */
    double compressions_per_s;   /**< NaN without a previous reading */
    int32_t os_pressure_level;   /**< MG_OS_LEVEL_* */
    uint32_t pad3;
} mg_sample_t;

#endif /* MEMGUARD_SAMPLE_H */
