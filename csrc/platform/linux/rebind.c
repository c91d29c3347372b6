/* Import-slot rebinding: rewrite the GOT entries through which one loaded
 * shared object calls a function, so that object (libc10.so, which torch
 * loads privately) calls ours instead. Both JUMP_SLOT (PLT calls) and
 * GLOB_DAT (taken addresses) slots are rewritten. A slot in RELRO or another
 * read-only page is made writable only while it is written; the page's
 * protection comes from the program headers, not from /proc/self/maps. */
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rebind.h"

#if defined(__x86_64__)
#define R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define R_GLOB_DAT R_X86_64_GLOB_DAT
#define R_ABS64 R_X86_64_64
#elif defined(__aarch64__)
#define R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define R_GLOB_DAT R_AARCH64_GLOB_DAT
#define R_ABS64 R_AARCH64_ABS64
#endif

struct find_ctx {
    const char *prefix;
    mgi_object_t *out;
    int found;
};

/* Pointers in the dynamic section are relocated by glibc on most targets but
 * not all: relocate those that still look like offsets. */
static uintptr_t dyn_ptr(uintptr_t bias, uintptr_t v)
{
    return v < bias ? v + bias : v;
}

static int find_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct find_ctx *ctx = arg;
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (strncmp(base, ctx->prefix, strlen(ctx->prefix)) != 0)
        return 0;
    mgi_object_t *o = ctx->out;
    memset(o, 0, sizeof(*o));
    o->bias = (uintptr_t)info->dlpi_addr;
    o->phdr = info->dlpi_phdr;
    o->phnum = info->dlpi_phnum;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *ph = &o->phdr[i];
        if (ph->p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(o->bias + ph->p_vaddr);
        else if (ph->p_type == PT_GNU_RELRO) {
            o->relro_start = o->bias + ph->p_vaddr;
            o->relro_end = o->relro_start + ph->p_memsz;
        } else if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
            o->text_start = o->bias + ph->p_vaddr;
            o->text_end = o->text_start + ph->p_memsz;
        }
    }
    if (!dyn)
        return 0;
    size_t relasz = 0, pltsz = 0;
    long pltrel = DT_RELA;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: o->symtab = (const ElfW(Sym) *)dyn_ptr(o->bias, dyn->d_un.d_ptr); break;
        case DT_STRTAB: o->strtab = (const char *)dyn_ptr(o->bias, dyn->d_un.d_ptr); break;
        case DT_RELA: o->rela = (const ElfW(Rela) *)dyn_ptr(o->bias, dyn->d_un.d_ptr); break;
        case DT_RELASZ: relasz = dyn->d_un.d_val; break;
        case DT_JMPREL: o->jmprel = (const ElfW(Rela) *)dyn_ptr(o->bias, dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: pltsz = dyn->d_un.d_val; break;
        case DT_PLTREL: pltrel = (long)dyn->d_un.d_val; break;
        default: break;
        }
    }
    if (!o->symtab || !o->strtab || pltrel != DT_RELA)
        return 0;
    o->rela_n = relasz / sizeof(ElfW(Rela));
    o->jmprel_n = pltsz / sizeof(ElfW(Rela));
    strncpy(o->name, name, sizeof(o->name) - 1);
    ctx->found = 1;
    return 1;
}

int mgi_object_find(const char *prefix, mgi_object_t *out)
{
#ifndef R_JUMP_SLOT
    (void)prefix;
    (void)out;
    return ENOTSUP;
#else
    struct find_ctx ctx = {prefix, out, 0};
    dl_iterate_phdr(find_cb, &ctx);
    return ctx.found ? 0 : ENOENT;
#endif
}

/* The protection a page of the object has when nobody is writing it. */
static int page_prot(const mgi_object_t *o, uintptr_t addr)
{
    if (addr >= o->relro_start && addr < o->relro_end)
        return PROT_READ;
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *ph = &o->phdr[i];
        uintptr_t s = o->bias + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && addr >= s && addr < s + ph->p_memsz)
            return ((ph->p_flags & PF_R) ? PROT_READ : 0) |
                   ((ph->p_flags & PF_W) ? PROT_WRITE : 0) |
                   ((ph->p_flags & PF_X) ? PROT_EXEC : 0);
    }
    return PROT_READ;
}

static int write_slot(const mgi_object_t *o, void **slot, void *value)
{
    int prot = page_prot(o, (uintptr_t)slot);
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    void *page = (void *)((uintptr_t)slot & ~(uintptr_t)(pg - 1));
    if (!(prot & PROT_WRITE) && mprotect(page, pg, prot | PROT_WRITE) != 0)
        return errno;
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    if (!(prot & PROT_WRITE))
        (void)mprotect(page, pg, prot);
    return 0;
}

#ifdef R_JUMP_SLOT
/* Visit every import slot of sym in o: resolve (write == NULL) reads the
 * first resolved value that is not skip; otherwise the slots get *write. */
static int each_slot(const mgi_object_t *o, const char *sym, void *skip, void **found,
                     void *write, int *count)
{
    /* GLOB_DAT slots are resolved at load time: they come first */
    const ElfW(Rela) *tabs[2] = {o->rela, o->jmprel};
    size_t ns[2] = {o->rela_n, o->jmprel_n};
    for (int t = 0; t < 2; t++) {
        for (size_t i = 0; i < ns[t]; i++) {
            const ElfW(Rela) *rel = &tabs[t][i];
            unsigned long type = ELF64_R_TYPE(rel->r_info);
            if (type != R_JUMP_SLOT && type != R_GLOB_DAT && type != R_ABS64)
                continue;
            const ElfW(Sym) *s = &o->symtab[ELF64_R_SYM(rel->r_info)];
            if (s->st_name == 0 || strcmp(o->strtab + s->st_name, sym) != 0)
                continue;
            void **slot = (void **)(o->bias + rel->r_offset);
            void *old = __atomic_load_n(slot, __ATOMIC_SEQ_CST);
            if (!write) {
                /* a lazy PLT slot not yet resolved points back into the object */
                int lazy = (uintptr_t)old >= o->text_start && (uintptr_t)old < o->text_end;
                if (!lazy && old != skip && old) {
                    *found = old;
                    return 0;
                }
                continue;
            }
            if (old == write)
                continue;
            int rc = write_slot(o, slot, write);
            if (rc)
                return rc;
            (*count)++;
        }
    }
    return 0;
}
#endif

int mgi_resolve(const mgi_object_t *o, const char *sym, void *skip, void **orig)
{
#ifndef R_JUMP_SLOT
    (void)o; (void)sym; (void)skip; (void)orig;
    return ENOTSUP;
#else
    *orig = NULL;
    each_slot(o, sym, skip, orig, NULL, NULL);
    if (!*orig)
        *orig = dlsym(RTLD_DEFAULT, sym); /* every slot is lazy: bind as ld.so would */
    return *orig ? 0 : ESRCH;
#endif
}

int mgi_rebind(const mgi_object_t *o, const char *sym, void *fn, int *count)
{
#ifndef R_JUMP_SLOT
    (void)o; (void)sym; (void)fn; (void)count;
    return ENOTSUP;
#else
    *count = 0;
    return each_slot(o, sym, NULL, NULL, fn, count);
#endif
}

int mgi_imports(const mgi_object_t *o, const char *sym)
{
#ifndef R_JUMP_SLOT
    (void)o; (void)sym;
    return 0;
#else
    const ElfW(Rela) *tabs[2] = {o->rela, o->jmprel};
    size_t ns[2] = {o->rela_n, o->jmprel_n};
    for (int t = 0; t < 2; t++)
        for (size_t i = 0; i < ns[t]; i++) {
            const ElfW(Sym) *s = &o->symtab[ELF64_R_SYM(tabs[t][i].r_info)];
            if (s->st_name && strcmp(o->strtab + s->st_name, sym) == 0)
                return 1;
        }
    return 0;
#endif
}
