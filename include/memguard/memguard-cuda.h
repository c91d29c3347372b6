/**
 * @file memguard-cuda.h
 * @brief memguard's caching allocator for device memory, and the entry
 * points PyTorch's CUDAPluggableAllocator calls.
 *
 * The cache (mg_dev_*) knows nothing of CUDA: it asks a backend for device
 * memory and gives it back, so it runs the same over the CUDA runtime and
 * over host memory (tests). Blocks are cached per device and per stream: a
 * block freed on a stream is only reused by allocations on that stream, so
 * work already queued on the stream is ordered before the new user's. Sizes
 * come in classes (512 B steps up to 4 KiB, then eight per doubling);
 * requests up to 1 MiB are carved from 2 MiB chunks, up to 8 MiB from
 * 20 MiB chunks, larger ones get a backend allocation of their own rounded
 * to 2 MiB. A budget per device bounds reserved bytes (what the backend
 * handed out): an allocation that would pass it first releases cached
 * memory, then fails.
 */
#ifndef MEMGUARD_CUDA_H
#define MEMGUARD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "memguard.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Device ordinals accepted: 0 .. MG_DEV_MAX_DEVICES - 1. */
#define MG_DEV_MAX_DEVICES 64
/** Streams cached apart per device; allocations on further streams go
 * straight to the backend and back (still within the budget). */
#define MG_DEV_MAX_STREAMS 32

#define MG_DEV_STATS_VERSION 1

/** Where device memory comes from. */
typedef struct mg_dev_backend {
    /** Allocate @p size bytes on @p device: 0, ENOMEM when the device is
     * full, or another errno for any other failure. */
    int (*alloc)(void *ctx, int device, size_t size, void **out);
    /** Give back what alloc returned. */
    void (*free)(void *ctx, int device, void *p);
    void *ctx;
    const char *name; /**< "cuda", "host", ... */
} mg_dev_backend_t;

/** Counters of one device, in PyTorch's vocabulary. */
typedef struct mg_dev_stats {
    uint32_t size;    /**< sizeof(mg_dev_stats_t) of the writer */
    uint32_t version; /**< MG_DEV_STATS_VERSION */
    uint64_t allocated_current, allocated_peak; /**< block (class) sizes handed out */
    uint64_t reserved_current, reserved_peak;   /**< bytes held from the backend */
    uint64_t active_current, active_peak;       /**< = allocated */
    uint64_t requested_current, requested_peak; /**< sizes callers asked for */
    uint64_t cached_bytes;      /**< freed blocks kept for reuse */
    uint64_t budget_bytes;      /**< 0: none */
    uint64_t num_allocs, num_frees, num_cache_hits, num_ooms, num_trims;
    uint64_t num_alloc_retries; /**< allocations that released cache to fit */
    uint64_t num_device_allocs, num_device_frees; /**< backend calls */
    uint64_t num_uncached;      /**< allocations past MG_DEV_MAX_STREAMS streams */
    uint64_t trimmed_bytes;     /**< released to the backend by trims and retries */
    uint64_t streams;           /**< streams with a cache */
    uint64_t last_oom_bytes;    /**< size of the last refused request */
} mg_dev_stats_t;

/** Use @p backend from now on (copied). EBUSY while blocks are alive under
 * another backend; the cache of the old one is released first. */
MG_API int mg_dev_init(const mg_dev_backend_t *backend);
/** Use no backend again (as before mg_dev_init): the cache is released
 * first; EBUSY while blocks are alive. */
MG_API int mg_dev_detach(void);
/** Name of the backend in use, or NULL before mg_dev_init. */
MG_API const char *mg_dev_backend_name(void);
/** Allocate @p size bytes on @p device for use on @p stream (opaque; NULL
 * is the default stream). Size 0 gives NULL and 0.
 * @return 0, ENOMEM (budget or device full, after releasing the cache),
 *         EINVAL (bad device), ENODEV (no backend). */
MG_API int mg_dev_alloc(int device, void *stream, size_t size, void **out);
/** Free a block of mg_dev_alloc; NULL and unknown pointers are ignored
 * (counted as neither a free nor an error). @p device is a hint only. */
MG_API void mg_dev_free(int device, void *p);
/** Set @p device's budget in bytes (0: none); cached memory above a smaller
 * budget is released at once. EINVAL for a bad device. */
MG_API int mg_dev_set_budget(int device, uint64_t bytes);
/** Release cached memory of @p device (-1: every device) to the backend;
 * @p freed (may be NULL) receives the bytes. */
MG_API int mg_dev_trim(int device, uint64_t *freed);
/** Copy @p device's counters (zeros for a device never used). */
MG_API int mg_dev_stats(int device, mg_dev_stats_t *out);
/** Set @p device's peaks to the current values. */
MG_API void mg_dev_reset_peaks(int device);

/* ---- CUDAPluggableAllocator entry points (csrc/shim/cuda.c) ------------- */

/** The allocation function: `void *alloc(size_t, int device, cudaStream_t)`.
 * On failure it throws a C++ std::runtime_error ("CUDA out of memory: ...")
 * through PyTorch (which turns it into a RuntimeError), or returns NULL
 * where no C++ runtime was found or the mode says so (tests). */
MG_API void *mg_cuda_alloc(size_t size, int device, void *stream);
/** The free function: `void free(void *, size_t, int device, cudaStream_t)`. */
MG_API void mg_cuda_free(void *p, size_t size, int device, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MEMGUARD_CUDA_H */
