/* Import-slot rebinding in loaded ELF objects (rebind.c), which the
 * in-process install (install.c) uses to route libc10's allocations. */
#ifndef MEMGUARD_REBIND_H
#define MEMGUARD_REBIND_H

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

#endif /* MEMGUARD_REBIND_H */
