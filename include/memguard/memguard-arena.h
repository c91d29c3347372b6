/**
 * @file memguard-arena.h
 * @brief memguard's budgeted caching arena for tensor memory.
 *
 * One process-wide arena inside one reserved address range, so "is this
 * pointer ours" is a range check. Blocks come in size classes (four per
 * doubling) and freed blocks stay cached for reuse; cached large blocks are
 * given back to the kernel (MADV_DONTNEED) on request or before an
 * allocation would pass the budget (the largest first, as many as make room;
 * none when the whole cache would not); under a budget, a large class with
 * nothing cached splits a cached block of twice its size, and freed halves
 * merge back with their buddy. The budget bounds reserved memory:
 * allocated blocks plus cached ones plus the slabs small blocks live in.
 */
#ifndef MEMGUARD_ARENA_H
#define MEMGUARD_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "memguard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The arena's entry points are always exported: when the preload shim is
 * in the process, its copies interpose on the extension's, so the process
 * has one arena whichever library calls it. */
#if defined(__GNUC__)
#define MG_ARENA_API __attribute__((visibility("default")))
#else
#define MG_ARENA_API
#endif

#define MG_ARENA_STATS_VERSION 4

/** Counters in PyTorch's vocabulary; bytes are block sizes except requested. */
typedef struct mg_arena_stats {
    uint32_t size;    /**< sizeof(mg_arena_stats_t) of the writer */
    uint32_t version; /**< MG_ARENA_STATS_VERSION */
    uint64_t allocated_current, allocated_peak; /**< blocks handed out */
    uint64_t reserved_current, reserved_peak;   /**< allocated + cached blocks */
    uint64_t active_current, active_peak;       /**< = allocated on the CPU */
    uint64_t requested_current, requested_peak; /**< sizes callers asked for */
    uint64_t cached_bytes;    /**< freed large blocks kept resident for reuse */
    uint64_t budget_bytes;    /**< 0: none */
    uint64_t cache_limit_bytes; /**< 0: none */
    uint64_t reserve_bytes;   /**< address space reserved */
    uint64_t num_allocs, num_frees, num_cache_hits, num_ooms, num_trims;
    uint64_t trimmed_bytes;   /**< given back to the kernel by trims, in all */
    uint64_t last_oom_bytes;  /**< size of the last request refused (version 2) */
    uint64_t decayed_bytes;   /**< given back by mg_arena_decay, in all (version 3) */
    uint64_t epoch;           /**< step boundaries counted by mg_arena_decay (version 3) */
    uint64_t tree_reserved_bytes; /**< held against a shared budget by the tree (version 3; 0: none) */
    uint64_t num_overruns;    /**< requests served past a soft budget (version 4) */
    uint64_t last_overrun_bytes; /**< size of the last of them (version 4) */
} mg_arena_stats_t;

/** Create the arena (idempotent). ENOMEM when no address range could be reserved. */
MG_ARENA_API int mg_arena_init(void);
/** Allocate @p size bytes aligned to @p align (a power of two, at most 2 MiB).
 * ENOMEM when the budget would be passed even after releasing the cache. */
MG_ARENA_API int mg_arena_alloc(size_t size, size_t align, void **out);
/** Free a block of the arena. @p p must be owned (mg_arena_owns). */
MG_ARENA_API void mg_arena_free(void *p);
/** O(1): does @p p lie in the arena's range? */
MG_ARENA_API int mg_arena_owns(const void *p);
/** Usable size of an arena block (its class size less any header). */
MG_ARENA_API size_t mg_arena_usable_size(const void *p);
/** Set the budget in bytes (0: none). Takes effect for the next allocation;
 * cached blocks past it are released at once. */
MG_ARENA_API void mg_arena_set_budget(uint64_t bytes);
/**
 * Share a budget with the other processes of a tree (`memguard run
 * --budget`): the children this process forks from now on (DataLoader
 * workers) and, through a file, processes started by exec. The budget then
 * bounds what the tree reserves, each process counting what it reserved
 * beyond what it inherited at its fork; a forked child does not reuse its
 * parent's cache. A process that finds no free slot of the tree's 4096
 * (all held by live processes) is refused every allocation, and says so
 * on stderr. Call before the first fork and before other threads allocate;
 * idempotent (a second call changes nothing).
 * @param fd -1: a segment of its own, for this process and its forks; else
 *        a file (a memfd) holding a tree's segment, which this process
 *        joins; it is grown to the segment's size if shorter. It may be
 *        closed after the call.
 * @param budget the tree's budget if it has none yet (the first process's
 *        holds); 0: the budget already set on this arena.
 * @return 0; EPROTO the file holds another layout; or mmap's, fstat's or
 *         ftruncate's errno.
 */
MG_ARENA_API int mg_arena_share_budget(int fd, uint64_t budget);
/** Keep at most @p bytes of freed large blocks cached (0: no limit beyond
 * the budget); past it, a free releases the oldest cached blocks at once. */
MG_ARENA_API void mg_arena_set_cache_limit(uint64_t bytes);
/**
 * A step boundary: count it, and give back cached blocks not reused (not
 * freed again) at any of the last @p age boundaries, like jemalloc's dirty
 * decay counted in steps: what a training step reuses stays warm, sizes a
 * step no longer uses leave within @p age steps. @p age 0 only counts.
 * @p freed (may be NULL) gets the bytes released.
 */
MG_ARENA_API int mg_arena_decay(uint32_t age, uint64_t *freed);
/** Release cached blocks until at most @p keep_bytes stay cached; @p freed gets the bytes. */
MG_ARENA_API int mg_arena_trim(uint64_t keep_bytes, uint64_t *freed);
/** Copy the counters. */
MG_ARENA_API int mg_arena_stats(mg_arena_stats_t *out);
/**
 * Make the budget soft (@p soft 1) or hard (0, the default). A hard budget
 * refuses a request it cannot hold (ENOMEM); a soft one refuses only inside
 * a strict section (mg_arena_strict), where the caller recovers from the
 * refusal (a guarded step), and elsewhere releases the whole cache and
 * serves the request past the budget, counting it (num_overruns). A shared
 * tree budget (mg_arena_share_budget) is always hard.
 */
MG_ARENA_API void mg_arena_set_soft(int soft);
/** Open (@p on 1) or close (0) the strict section: a soft budget refuses
 * while it is open, in any thread. One at a time (a process has one
 * guard, stepping one loop); closing is idempotent. */
MG_ARENA_API void mg_arena_strict(int on);
/** Reset the peaks to the current values. */
MG_ARENA_API void mg_arena_reset_peaks(void);

/**
 * Route the tensor allocations of the loaded shared object whose file name
 * starts with @p prefix (="libc10.so") to the arena by rewriting its import
 * slots for posix_memalign, free and realloc. Idempotent.
 * @param slots receives the number of slots rewritten (may be NULL).
 * @return 0; ENOENT the object is not loaded; ESRCH it does not import
 *         posix_memalign and free; ENOTSUP not an ELF target memguard knows;
 *         ENOMEM no address range for the arena; or mprotect's errno.
 */
MG_API int mg_install(const char *prefix, int *slots);
/** Give posix_memalign back; free and realloc stay hooked (blocks may live on). */
MG_API int mg_uninstall(void);
/** Whether mg_install is in effect. */
MG_API int mg_installed(void);

#ifdef __cplusplus
}
#endif
#endif /* MEMGUARD_ARENA_H */
