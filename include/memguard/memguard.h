/**
 * @file memguard.h
 * @brief memguard's public C API: telemetry sampler, pressure model, options.
 *
 * Functions return 0 on success or an errno value (ENOENT, EINVAL, EBUSY,
 * ENOMEM, EBADMSG for a malformed input) and write results through
 * out-parameters. Struct layouts other than the versioned sample
 * (memguard-sample.h) stay internal.
 */
#ifndef MEMGUARD_H
#define MEMGUARD_H

#include <stddef.h>
#include <stdint.h>

#include "memguard-sample.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MG_BUILDING) && defined(__GNUC__)
#define MG_API __attribute__((visibility("default")))
#else
#define MG_API
#endif

/** Pressure levels, ordered. */
typedef enum mg_level {
    MG_LEVEL_OK = 0,
    MG_LEVEL_ELEVATED = 1,
    MG_LEVEL_HIGH = 2,
    MG_LEVEL_CRITICAL = 3,
} mg_level_t;

/** Bits of mg_sample_t.reasons: which signals set the raw level. */
enum {
    MG_REASON_BUDGET = 1u << 0,   /**< process memory against the budget */
    MG_REASON_HEADROOM = 1u << 1, /**< MemAvailable or cgroup headroom */
    MG_REASON_PSI = 1u << 2,      /**< PSI memory stall time */
    MG_REASON_SWAP = 1u << 3,     /**< swap-in rate */
    MG_REASON_FAULTS = 1u << 4,   /**< major page-fault rate */
    MG_REASON_CUDA_RETRIES = 1u << 5, /**< CUDA allocations retried after freeing cache */
    MG_REASON_OS = 1u << 6,       /**< the kernel's own level (macOS: warn, critical) */
    MG_REASON_COMPRESSOR = 1u << 7, /**< pages compressed or swapped out per second (macOS) */
};

/* ---- sizes and budgets -------------------------------------------------- */

/**
 * Parse a byte size: a plain integer, or a number with a unit among
 * B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (case-insensitive). Decimal
 * units (KB, MB, ...) are powers of 1000, binary ones (K, KiB, ...) of 1024.
 * @return 0, EINVAL for text that is not a size, ERANGE on overflow.
 */
MG_API int mg_parse_size(const char *text, uint64_t *out);

/**
 * Parse a budget: "auto", a size (see mg_parse_size) or a percentage
 * ("75%") of @p total. "auto" is 90 % of min(@p total, @p available) where
 * @p available is nonzero, else 90 % of @p total.
 * @return 0, EINVAL for a malformed or zero budget, ERANGE for a percentage
 *         outside (0, 100] or a size above MG_BUDGET_MAX.
 */
/** The largest budget memguard takes as a size: 4 EiB, beyond any machine,
 * and far enough below 2^64 that sums and margins of budgets cannot wrap.
 * ("auto" and percentages are shares of the @p total they are given.) */
#define MG_BUDGET_MAX (UINT64_C(1) << 62)

MG_API int mg_parse_budget(const char *text, uint64_t total, uint64_t available,
                           uint64_t *out);

/**
 * The live budget: what the process can have now, from one sample. The
 * least of @p user_bytes (0: none), the cgroup's limit (memory.high where
 * lower) less what others in the cgroup use, and the process's resident
 * bytes (its tree's) plus MemAvailable; each less @p reserve (a fraction of
 * the limit, of MemTotal: room for page cache and code, and for others).
 * The process's swapped-out bytes are part of its footprint, which is what
 * the budget bounds, so they count against it. @p source (may be NULL)
 * receives the MG_BUDGET_SRC_* that bound it.
 * @return 0, or ENODATA when there is neither a user budget nor a reading.
 */
MG_API int mg_budget_live(const mg_sample_t *s, uint64_t user_bytes, double reserve,
                          uint64_t *out, int *source);

/* ---- pressure model ----------------------------------------------------- */

/** Thresholds of the pressure model; one value per level above OK. */
typedef struct mg_pressure_opts {
    double budget[3];    /**< used fraction of the budget (=.80 .90 .97) */
    double headroom[3];  /**< free fraction of memory, below which (=.15 .08 .03) */
    double psi[3];       /**< stall fraction of the interval (=.05 .15 .40) */
    double swap_in[3];   /**< swap-in pages per second (=256 2560 25600) */
    double major_faults[3]; /**< major faults per second (=500 5000 50000) */
    uint32_t calm_samples;  /**< calm samples before stepping down (=10) */
} mg_pressure_opts_t;

/** Pressure model state; plain data, one per sampler. */
typedef struct mg_pressure {
    mg_pressure_opts_t opts;
    int level;          /* current level, after hysteresis */
    uint32_t calm;      /* consecutive samples whose raw level was below level */
    int calm_max;       /* highest raw level among those calm samples */
} mg_pressure_t;

/** Fill @p opts from the option table (defaults or MEMGUARD_* values). */
MG_API void mg_pressure_opts_default(mg_pressure_opts_t *opts);

/** Check thresholds: each row ascending (headroom descending), calm >= 1. */
MG_API int mg_pressure_opts_check(const mg_pressure_opts_t *opts);

/** Reset @p p to level OK with @p opts. @return EINVAL for bad thresholds. */
MG_API int mg_pressure_init(mg_pressure_t *p, const mg_pressure_opts_t *opts);

/**
 * Feed one sample: sets s->raw_level, s->reasons, s->level,
 * s->budget_used_fraction and s->headroom_fraction. Pure; no I/O.
 * @return 1 when the level changed, else 0.
 */
MG_API int mg_pressure_update(mg_pressure_t *p, mg_sample_t *s);

/* ---- sampler ------------------------------------------------------------ */

typedef struct mg_sampler mg_sampler_t;

/** Sampler configuration. Zero fields take the option table's values. */
typedef struct mg_sampler_config {
    uint32_t interval_us;     /**< sampling period (=100000, at least 5000) */
    uint32_t ring_size;       /**< samples kept (=4096) */
    uint64_t budget_bytes;    /**< the budget asked for (0: none) */
    int live;                 /**< judge against mg_budget_live(), capped by budget_bytes */
    const char *proc_root;    /**< procfs mount (="/proc") */
    const char *cgroup_root;  /**< cgroup mount (="/sys/fs/cgroup") */
    const mg_pressure_opts_t *pressure; /**< NULL: defaults */
} mg_sampler_config_t;

/** Wake reasons returned by mg_sampler_wait(). */
enum { MG_WAKE_LEVEL = 1, MG_WAKE_SAMPLE = 2, MG_WAKE_USER = 4 };

MG_API int mg_sampler_create(const mg_sampler_config_t *cfg, mg_sampler_t **out);
MG_API void mg_sampler_destroy(mg_sampler_t *s);
/** Start the background thread (signals blocked). EALREADY if running. */
MG_API int mg_sampler_start(mg_sampler_t *s);
/** Stop and join the thread; a no-op when not running. */
MG_API int mg_sampler_stop(mg_sampler_t *s);
MG_API int mg_sampler_running(const mg_sampler_t *s);
/** Take one sample on the calling thread. EBUSY while the thread runs. */
MG_API int mg_sampler_sample_now(mg_sampler_t *s, mg_sample_t *out);
/** Copy the newest sample. ENOENT before the first one. */
MG_API int mg_sampler_latest(mg_sampler_t *s, mg_sample_t *out);
/**
 * Copy up to @p cap samples with seq > @p after_seq, oldest first, into
 * @p out; @p n receives the count. Samples overwritten in the ring are
 * skipped (their count goes to @p dropped when non-NULL).
 */
MG_API int mg_sampler_since(mg_sampler_t *s, uint64_t after_seq, mg_sample_t *out,
                            size_t cap, size_t *n, uint64_t *dropped);
/** Ask for a MG_WAKE_SAMPLE notification after every sample (or not). */
MG_API void mg_sampler_notify_samples(mg_sampler_t *s, int on);
/**
 * Block until the level changes, a sample is taken (when notifications are
 * on), mg_sampler_wake() is called, or @p timeout_ms passes (-1: forever).
 * @p wake receives MG_WAKE_* bits, 0 on timeout.
 */
MG_API int mg_sampler_wait(mg_sampler_t *s, int timeout_ms, int *wake);
/** Interrupt one mg_sampler_wait(). */
MG_API int mg_sampler_wake(mg_sampler_t *s);
/** Level-change eventfd (readable after a change), or -1 when none yet. */
MG_API int mg_sampler_level_fd(const mg_sampler_t *s);
/** CPU time used by the sampling thread so far, in nanoseconds. */
MG_API int mg_sampler_cpu_ns(const mg_sampler_t *s, uint64_t *out);
/** Change the budget used by the pressure model (takes effect next sample). */
MG_API void mg_sampler_set_budget(mg_sampler_t *s, uint64_t budget_bytes);
/** Judge against the live budget (capped by the budget set) from the next sample, or not. */
MG_API void mg_sampler_set_live(mg_sampler_t *s, int live);
/**
 * Note this process's LOCAL_RANK and RANK as its environment names them
 * now. Samples leave out of the process tree (children, children_bytes)
 * every descendant whose environment (/proc/PID/environ) names another
 * value of either, with its own descendants: a rank of the same
 * distributed job that this process started (Lightning's subprocess
 * launcher), not a DataLoader worker. The sampling thread never reads the
 * environment (setenv may move it under a reader): mg_sampler_create()
 * notes it, and an embedding calls this again wherever it may read the
 * environment, since a launcher may name the rank after the start.
 */
MG_API void mg_ranks_note(void);

/** A CUDA device's allocator counters, as pushed from a step boundary. */
typedef struct mg_cuda_counters {
    int32_t device;
    uint64_t allocated_bytes, reserved_bytes, active_bytes;
    uint64_t allocated_peak_bytes, reserved_peak_bytes;
    uint64_t alloc_retries, ooms;    /**< cumulative */
    uint64_t free_bytes, total_bytes; /**< the device's (0: unknown) */
    uint64_t budget_bytes;           /**< 0: none */
} mg_cuda_counters_t;

/**
 * Hand the sampler a CUDA device's counters: every later sample carries
 * them (MG_HAVE_CUDA) until the next push, and the pressure model judges
 * them. Retries that rose since the previous push count once, in the next
 * sample. @p raw_level (may be NULL) receives the level of the CUDA signals
 * alone, at once, so a step boundary need not wait for a sample.
 */
MG_API int mg_sampler_push_cuda(mg_sampler_t *s, const mg_cuda_counters_t *c, int *raw_level);

/**
 * The CUDA part of the pressure model, pure: allocated bytes against the
 * CUDA budget (thresholds of the budget signal), and any new allocation
 * retry (the caching allocator freeing its cache to satisfy a request:
 * thrashing) as HIGH. Sets s->cuda_budget_used_fraction.
 * @p reasons receives MG_REASON_* bits. @return the level.
 */
MG_API int mg_pressure_cuda_level(const mg_pressure_opts_t *o, mg_sample_t *s, uint32_t *reasons);

/* ---- options ------------------------------------------------------------ */

/**
 * Options live in one table, each read lazily from MEMGUARD_<NAME> on first
 * use. Bad environment values are recorded as warnings and the default kept.
 */
/** Read option @p name as text into @p buf. ENOENT for an unknown name. */
MG_API int mg_option_get(const char *name, char *buf, size_t cap);
/** Set option @p name from text. ENOENT unknown name, EINVAL bad value. */
MG_API int mg_option_set(const char *name, const char *value);
/** Whether each signal's thresholds keep their order (ELEVATED <= HIGH <=
 * CRITICAL; headroom: >=). 0, or EINVAL with the first bad signal described
 * in @p why. */
MG_API int mg_option_check(char *why, size_t cap);
/** Name of option @p i (NULL past the end), for listings. */
MG_API const char *mg_option_name(size_t i);
/** Pop the next warning about a bad environment value into @p buf; ENOENT if none. */
MG_API int mg_option_next_warning(char *buf, size_t cap);

/* ---- system allocator --------------------------------------------------- */

/**
 * Give the system allocator's free memory back to the kernel: jemalloc
 * purges every arena when it is in the process (preloaded, alone or under
 * the shim), glibc trims its heaps (malloc_trim(0)) otherwise. @p how
 * receives "jemalloc", "glibc", "darwin" (malloc_zone_pressure_relief) or "none".
 * Not for the allocation path.
 * @return 0, ENOTSUP when neither is found, or jemalloc's error.
 */
MG_API int mg_system_trim(const char **how);

#ifdef __cplusplus
}
#endif
#endif /* MEMGUARD_H */
