/* Internal declarations of the allocator shims (import-slot rebinding and
 * the hooks it installs). */
#ifndef MEMGUARD_SHIM_H
#define MEMGUARD_SHIM_H

#include <link.h>
#include <stddef.h>
#include <stdint.h>

/* A loaded shared object's dynamic linking tables. */
typedef struct mgi_object {
    uintptr_t bias;
    const ElfW(Phdr) *phdr;
    int phnum;
    uintptr_t relro_start, relro_end, text_start, text_end;
    const ElfW(Sym) *symtab;
    const char *strtab;
    const ElfW(Rela) *rela, *jmprel;
    size_t rela_n, jmprel_n;
    char name[512];
} mgi_object_t;

/* Find the loaded object whose file name starts with prefix ("libc10.so").
 * ENOENT when none is loaded, ENOTSUP on targets without support. */
int mgi_object_find(const char *prefix, mgi_object_t *out);
/* What o's slots for sym lead to now, ignoring slots that already hold skip
 * and lazy slots not yet bound (then: what ld.so would bind). ESRCH: nothing. */
int mgi_resolve(const mgi_object_t *o, const char *sym, void *skip, void **orig);
/* Point every import slot of sym in o at fn; *count gets the slots written. */
int mgi_rebind(const mgi_object_t *o, const char *sym, void *fn, int *count);
/* Does o import sym at all? */
int mgi_imports(const mgi_object_t *o, const char *sym);

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
