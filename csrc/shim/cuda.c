/* memguard's CUDA allocator as PyTorch's CUDAPluggableAllocator sees it:
 * two C functions with its exact ABI over the device cache (devcache.c),
 * and the backends the cache draws on. The CUDA runtime is reached through
 * dlopen, so nothing here needs CUDA headers or a CUDA toolkit to build.
 *
 * An out-of-memory answer cannot be a NULL pointer: PyTorch wraps whatever
 * the function returns in a tensor, and a kernel writing through NULL kills
 * the CUDA context. PyTorch expects a C++ exception instead, which it turns
 * into a Python RuntimeError. C cannot write `throw`, but it can call the
 * C++ runtime's own entry points (Itanium C++ ABI): allocate the exception,
 * construct a std::runtime_error in it, throw it. The symbols come from the
 * libstdc++ that PyTorch already loaded; unwinding passes through this
 * file's frames, which hold no lock by then (built with -fexceptions). */
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memguard/memguard-cuda.h"
#include "shim.h"

/* ---- the CUDA runtime, by dlopen ---------------------------------------- */

typedef int (*cuda_malloc_fn)(void **, size_t);
typedef int (*cuda_free_fn)(void *);
typedef int (*cuda_get_device_fn)(int *);
typedef int (*cuda_set_device_fn)(int);
typedef int (*cuda_get_last_error_fn)(void);
typedef int (*cuda_mem_get_info_fn)(size_t *, size_t *);

#define CUDA_SUCCESS 0
#define CUDA_ERROR_MEMORY_ALLOCATION 2

static struct {
    void *lib;
    cuda_malloc_fn malloc_;
    cuda_free_fn free_;
    cuda_get_device_fn get_device;
    cuda_set_device_fn set_device;
    cuda_get_last_error_fn get_last_error;
    cuda_mem_get_info_fn mem_get_info;
    char path[512];
} R;

/* Run with the calling thread on device: PyTorch passes the ordinal the
 * block belongs to, which a freeing thread may not have current. */
static int switch_device(int device, int *prev)
{
    *prev = -1;
    if (R.get_device(prev) != CUDA_SUCCESS) {
        *prev = -1;
        return 0;
    }
    if (*prev != device && R.set_device(device) != CUDA_SUCCESS) {
        (void)R.get_last_error();
        return EIO;
    }
    return 0;
}

static void restore_device(int device, int prev)
{
    if (prev >= 0 && prev != device)
        (void)R.set_device(prev);
}

static int cuda_alloc(void *ctx, int device, size_t size, void **out)
{
    (void)ctx;
    int prev;
    if (switch_device(device, &prev))
        return EIO;
    int rc = R.malloc_(out, size);
    if (rc != CUDA_SUCCESS)
        (void)R.get_last_error(); /* not sticky: clear it, or the next kernel
                                   * launch check would report it */
    restore_device(device, prev);
    return rc == CUDA_SUCCESS ? 0 : rc == CUDA_ERROR_MEMORY_ALLOCATION ? ENOMEM : EIO;
}

static void cuda_free(void *ctx, int device, void *p)
{
    (void)ctx;
    int prev;
    if (switch_device(device, &prev))
        return;
    if (R.free_(p) != CUDA_SUCCESS)
        (void)R.get_last_error();
    restore_device(device, prev);
}

static const char *const CUDART_NAMES[] = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so", NULL,
};

/* Open the CUDA runtime: path when given (the copy PyTorch loaded, found by
 * the caller in /proc/self/maps), else the usual sonames, loaded ones first. */
int mgi_cuda_runtime_open(const char *path, char *err, size_t cap)
{
    if (R.lib)
        return 0;
    void *lib = NULL;
    if (path && *path) {
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (lib)
            snprintf(R.path, sizeof(R.path), "%s", path);
    }
    for (int pass = 0; !lib && pass < 2; pass++) {
        for (const char *const *n = CUDART_NAMES; !lib && *n; n++) {
            lib = dlopen(*n, RTLD_NOW | RTLD_LOCAL | (pass ? 0 : RTLD_NOLOAD));
            if (lib)
                snprintf(R.path, sizeof(R.path), "%s", *n);
        }
    }
    if (!lib) {
        snprintf(err, cap, "the CUDA runtime (libcudart) could not be loaded: %s", dlerror());
        return ENOENT;
    }
    struct {
        const char *name;
        void **slot;
    } syms[] = {
        {"cudaMalloc", (void **)&R.malloc_},
        {"cudaFree", (void **)&R.free_},
        {"cudaGetDevice", (void **)&R.get_device},
        {"cudaSetDevice", (void **)&R.set_device},
        {"cudaGetLastError", (void **)&R.get_last_error},
        {"cudaMemGetInfo", (void **)&R.mem_get_info},
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        *syms[i].slot = dlsym(lib, syms[i].name);
        if (!*syms[i].slot) {
            snprintf(err, cap, "%s has no %s", R.path, syms[i].name);
            dlclose(lib);
            memset(&R, 0, sizeof(R));
            return ENOENT;
        }
    }
    R.lib = lib;
    return 0;
}

const char *mgi_cuda_runtime_path(void)
{
    return R.lib ? R.path : NULL;
}

const mg_dev_backend_t *mgi_cuda_backend(void)
{
    static const mg_dev_backend_t b = {cuda_alloc, cuda_free, NULL, "cuda"};
    return R.lib ? &b : NULL;
}

/* ---- host memory standing in for a device (tests) ----------------------- */

static _Atomic uint64_t host_used, host_capacity;

static int host_alloc(void *ctx, int device, size_t size, void **out)
{
    (void)ctx;
    (void)device;
    uint64_t cap = atomic_load(&host_capacity);
    uint64_t now = atomic_fetch_add(&host_used, size) + size;
    if (cap && now > cap) {
        atomic_fetch_sub(&host_used, size);
        return ENOMEM;
    }
    /* a header in front keeps the size for the free; the pointer handed
     * out stays 512-byte aligned like cudaMalloc's */
    char *p = aligned_alloc(512, size + 512);
    if (!p) {
        atomic_fetch_sub(&host_used, size);
        return ENOMEM;
    }
    *(size_t *)p = size;
    *out = p + 512;
    return 0;
}

static void host_free(void *ctx, int device, void *p)
{
    (void)ctx;
    (void)device;
    char *q = (char *)p - 512;
    atomic_fetch_sub(&host_used, *(size_t *)q);
    free(q);
}

const mg_dev_backend_t *mgi_host_backend(uint64_t capacity)
{
    static const mg_dev_backend_t b = {host_alloc, host_free, NULL, "host"};
    atomic_store(&host_capacity, capacity);
    return &b;
}

uint64_t mgi_host_backend_used(void)
{
    return atomic_load(&host_used);
}

/* ---- out of memory: a C++ exception ------------------------------------- */

typedef void *(*cxa_allocate_exception_fn)(size_t);
typedef void (*cxa_throw_fn)(void *, void *, void (*)(void *));
typedef void (*runtime_error_ctor_fn)(void *, const char *);

static struct {
    cxa_allocate_exception_fn allocate;
    cxa_throw_fn throw_;
    runtime_error_ctor_fn ctor;
    void (*dtor)(void *);
    void *typeinfo;
} X;

static _Atomic int oom_mode = MGI_OOM_NULL;

int mgi_cuda_set_oom_mode(int mode)
{
    if (mode == MGI_OOM_THROW && !X.throw_) {
        void *lib = dlopen("libstdc++.so.6", RTLD_NOW | RTLD_NOLOAD);
        if (!lib)
            lib = dlopen("libstdc++.so.6", RTLD_NOW);
        if (!lib)
            return ENOENT;
        X.allocate = (cxa_allocate_exception_fn)dlsym(lib, "__cxa_allocate_exception");
        X.ctor = (runtime_error_ctor_fn)dlsym(lib, "_ZNSt13runtime_errorC1EPKc");
        X.dtor = (void (*)(void *))dlsym(lib, "_ZNSt13runtime_errorD1Ev");
        X.typeinfo = dlsym(lib, "_ZTISt13runtime_error");
        cxa_throw_fn t = (cxa_throw_fn)dlsym(lib, "__cxa_throw");
        if (!X.allocate || !X.ctor || !X.dtor || !X.typeinfo || !t)
            return ENOENT;
        X.throw_ = t;
    }
    if (mode != MGI_OOM_THROW && mode != MGI_OOM_NULL)
        return EINVAL;
    atomic_store(&oom_mode, mode);
    return 0;
}

static void oom(size_t size, int device, int rc)
{
    if (atomic_load(&oom_mode) != MGI_OOM_THROW || !X.throw_)
        return;
    mg_dev_stats_t st;
    mg_dev_stats(device, &st);
    char msg[384];
    const double mib = 1048576.0;
    if (rc == ENOMEM)
        snprintf(msg, sizeof(msg),
                 "CUDA out of memory: memguard's allocator could not allocate %.2f MiB on "
                 "device %d (budget %.0f MiB, reserved %.2f MiB, allocated %.2f MiB)",
                 (double)size / mib, device, (double)st.budget_bytes / mib,
                 (double)st.reserved_current / mib, (double)st.allocated_current / mib);
    else
        snprintf(msg, sizeof(msg),
                 "memguard's CUDA allocator failed to allocate %zu bytes on device %d: %s",
                 size, device, strerror(rc));
    /* a std::runtime_error is a vtable pointer and a string handle; the
     * exception object is given room to spare */
    void *exc = X.allocate(64);
    X.ctor(exc, msg);
    X.throw_(exc, X.typeinfo, X.dtor);
}

void *mg_cuda_alloc(size_t size, int device, void *stream)
{
    void *p;
    int rc = mg_dev_alloc(device, stream, size, &p);
    if (rc) {
        oom(size, device, rc); /* does not return in throw mode */
        errno = rc;
        return NULL;
    }
    return p;
}

void mg_cuda_free(void *p, size_t size, int device, void *stream)
{
    (void)size;
    (void)stream; /* the block remembers the stream it was allocated on */
    mg_dev_free(device, p);
}
