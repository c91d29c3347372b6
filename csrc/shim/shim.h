/* Internal declarations of the CUDA allocator shim (the ELF import-slot
 * rebinding is the Linux layer's: csrc/platform/linux/rebind.h). */
#ifndef MEMGUARD_SHIM_H
#define MEMGUARD_SHIM_H

#include <stddef.h>
#include <stdint.h>

/* cuda.c: the backends of the device cache and the out-of-memory mode of
 * mg_cuda_alloc. */
#include "memguard/memguard-cuda.h"

enum { MGI_OOM_NULL = 0, MGI_OOM_THROW = 1 };
/* Load the CUDA runtime (path, or the usual sonames). err gets why not. */
int mgi_cuda_runtime_open(const char *path, char *err, size_t cap);
const char *mgi_cuda_runtime_path(void);
/* The CUDA runtime backend; NULL before mgi_cuda_runtime_open. */
const mg_dev_backend_t *mgi_cuda_backend(void);
/* Host memory as a device of capacity bytes (0: unbounded), for tests. */
const mg_dev_backend_t *mgi_host_backend(uint64_t capacity);
uint64_t mgi_host_backend_used(void);
/* MGI_OOM_THROW (a C++ std::runtime_error; ENOENT without libstdc++) or
 * MGI_OOM_NULL (NULL and errno). */
int mgi_cuda_set_oom_mode(int mode);

#endif
