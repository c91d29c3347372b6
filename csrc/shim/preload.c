/* libmemguard_preload.so: the whole malloc family for a process started by
 * `memguard run` (LD_PRELOAD), forked DataLoader workers included.
 *
 * Tensor-sized requests (MG_PRELOAD_MIN bytes and up) go to the arena, with
 * its budget; smaller ones to jemalloc when it is preloaded after this
 * library (through mallocx/dallocx/sallocx/rallocx), else to glibc with its
 * heap trimming turned off, so a training loop neither munmaps and refaults
 * its tensors nor grows and trims the brk heap every step.
 *
 * The first call resolves jemalloc with dlsym, which may allocate: calls made
 * by the resolving thread meanwhile are served from a static bootstrap
 * buffer that is never freed. Only the arena's entry points, the malloc
 * family and two markers are exported; everything else stays hidden. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memguard/memguard-arena.h"
#include "mgi.h"

#define EXPORT __attribute__((visibility("default")))
#define MG_PRELOAD_MIN ((size_t)64 << 10)

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

typedef void *(*mallocx_fn)(size_t, int);
typedef void (*dallocx_fn)(void *, int);
typedef size_t (*sallocx_fn)(const void *, int);
typedef void *(*rallocx_fn)(void *, size_t, int);
typedef size_t (*usable_fn)(void *);

/* Written once by the initialising thread before `state` becomes READY. */
static mallocx_fn je_mallocx;
static dallocx_fn je_dallocx;
static sallocx_fn je_sallocx;
static rallocx_fn je_rallocx;
static usable_fn libc_usable;

enum { UNINIT, INITIALISING, READY };
static _Atomic int state = UNINIT;
static _Atomic(pthread_t) initialiser;

/* Bootstrap buffer for allocations made while resolving; 16-byte size
 * headers so realloc and malloc_usable_size work on its blocks. */
static _Alignas(64) char boot[256 << 10];
static _Atomic size_t boot_used;

/* Markers: `memguard` (the Python package) looks for these. */
EXPORT int mg_preload_active = 1;
EXPORT int mg_preload_jemalloc;

/* jemalloc reads this when the application (here, the preloaded shim)
 * defines it: keep freed small pages a while instead of purging them every
 * step; MALLOC_CONF in the environment still overrides. */
EXPORT const char *malloc_conf = "dirty_decay_ms:30000,muzzy_decay_ms:30000";

static int in_boot(const void *p)
{
    return (const char *)p >= boot && (const char *)p < boot + sizeof(boot);
}

static void *boot_alloc(size_t n, size_t align)
{
    if (align < 16)
        align = 16;
    size_t off = atomic_load(&boot_used), start, end;
    do {
        start = (off + 16 + align - 1) & ~(align - 1);
        end = start + n;
        if (end > sizeof(boot))
            return NULL;
    } while (!atomic_compare_exchange_weak(&boot_used, &off, end));
    *(size_t *)(boot + start - 16) = n;
    return boot + start;
}

static size_t boot_size(const void *p)
{
    return *(const size_t *)((const char *)p - 16);
}

/* Write a message of parts (NULL-terminated) to stderr in one write. */
static void say(const char *first, ...)
{
    char line[512];
    size_t n = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *part = first; part; part = va_arg(ap, const char *))
        for (; *part && n < sizeof(line) - 1; part++)
            line[n++] = *part;
    va_end(ap);
    line[n++] = '\n';
    (void)!write(2, line, n);
}

/* A decimal at *t, ending in end, stepped over; 0 or EINVAL. */
static int field(const char **t, char end, unsigned long long *out)
{
    const char *p = *t;
    unsigned long long v = 0;
    for (; *p >= '0' && *p <= '9' && p - *t < 19; p++)
        v = v * 10 + (unsigned long long)(*p - '0');
    if (p == *t || *p != end)
        return EINVAL;
    *t = p + (end != '\0');
    *out = v;
    return 0;
}

/* The segment of the run's tree budget named by MEMGUARD_TREE ("PID:FD:INODE":
 * a memfd that `memguard run` made and holds open, reached through
 * /proc/PID/fd/FD), opened; -1 with *why set when it cannot be. */
static int open_tree(const char *name, const char **why)
{
    unsigned long long pid, fd, ino;
    char path[64], link[64];
    if (field(&name, ':', &pid) || field(&name, ':', &fd) || field(&name, '\0', &ino) ||
        pid > INT32_MAX || fd > INT32_MAX) {
        *why = "not PID:FD:INODE";
        return -1;
    }
    snprintf(path, sizeof(path), "/proc/%llu/fd/%llu", pid, fd);
    int t = open(path, O_RDWR | O_CLOEXEC);
    if (t < 0) {
        *why = "the run's first process is gone, or its files cannot be opened";
        return -1;
    }
    struct stat sb;
    snprintf(path, sizeof(path), "/proc/self/fd/%d", t);
    ssize_t len = readlink(path, link, sizeof(link) - 1);
    static const char memfd[] = "/memfd:memguard-tree";
    if (fstat(t, &sb) != 0 || (unsigned long long)sb.st_ino != ino || len < 0 ||
        strncmp(link, memfd, sizeof(memfd) - 1) != 0) {
        close(t);
        *why = "that file is not the run's budget segment";
        return -1;
    }
    return t;
}

/* The budget for `memguard run --budget`: MEMGUARD_BUDGET, against the
 * machine's memory read with raw syscalls (malloc is not ours to call yet),
 * shared by the run's processes: those it forks (DataLoader workers) and,
 * through the segment MEMGUARD_TREE names, those started by exec. It bounds
 * the tree, not each process; the first process's budget is the tree's. */
static void apply_budget(void)
{
    const char *text = getenv("MEMGUARD_BUDGET"), *tree = getenv("MEMGUARD_TREE");
    char buf[4096];
    size_t len;
    const char *why;
    mgi_meminfo_t mi;
    uint64_t total = 0, avail = 0, budget;
    if (!text || !*text)
        return;
    if (mgi_read_path("/proc/meminfo", buf, sizeof(buf), &len) == 0 &&
        mgi_parse_meminfo(buf, len, &mi, &why) == 0) {
        total = mi.total_bytes;
        avail = mi.have_available ? mi.available_bytes : 0;
    }
    if (mg_parse_budget(text, total, avail, &budget) != 0) {
        say("memguard: MEMGUARD_BUDGET is not a valid budget; running without one", NULL);
        return;
    }
    int rc = EBADF;
    if (tree && *tree) {
        int fd = open_tree(tree, &why);
        if (fd >= 0) {
            rc = mg_arena_share_budget(fd, budget);
            why = rc == EPROTO ? "a segment of another memguard version"
                               : "it could not be mapped";
            close(fd); /* the mapping stays */
        }
        if (rc != 0)
            say("memguard: cannot join the budget of the run's other processes (MEMGUARD_TREE=",
                tree, ": ", why, "): this process and its forks share one of their own", NULL);
    }
    if (rc != 0 && mg_arena_share_budget(-1, budget) != 0) {
        say("memguard: the budget cannot be shared with forked children; each process gets "
            "it whole", NULL);
        mg_arena_set_budget(budget);
    }
}

static void init(void)
{
    int expected = UNINIT;
    if (!atomic_compare_exchange_strong(&state, &expected, INITIALISING)) {
        /* another thread initialises: wait for it (start-up only) */
        while (atomic_load(&state) != READY)
            sched_yield();
        return;
    }
    atomic_store(&initialiser, pthread_self());
    je_mallocx = (mallocx_fn)dlsym(RTLD_NEXT, "mallocx");
    je_dallocx = (dallocx_fn)dlsym(RTLD_NEXT, "dallocx");
    je_sallocx = (sallocx_fn)dlsym(RTLD_NEXT, "sallocx");
    je_rallocx = (rallocx_fn)dlsym(RTLD_NEXT, "rallocx");
    if (!je_mallocx || !je_dallocx || !je_sallocx || !je_rallocx) {
        je_mallocx = NULL;
        libc_usable = (usable_fn)dlsym(RTLD_NEXT, "malloc_usable_size");
        /* glibc: stop trimming the brk heap after every step's frees */
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        mallopt(M_TOP_PAD, 64 << 20);
    }
    mg_preload_jemalloc = je_mallocx != NULL;
    (void)mg_arena_init();
    apply_budget();
    atomic_store(&state, READY);
}

/* Bytes as "256.0 MiB" or "1.5 GiB" into buf. */
static void fmt_size(char *buf, size_t cap, uint64_t n)
{
    double v = (double)n / (1 << 20);
    if (v >= 1024)
        snprintf(buf, cap, "%.1f GiB", v / 1024);
    else
        snprintf(buf, cap, "%.1f MiB", v);
}

/* At exit: one line when memguard's budget refused allocations in this
 * process, so that the refusal (torch's "can't allocate memory", a bare
 * MemoryError) is not taken for the machine running out of memory. */
__attribute__((destructor)) static void report_refusals(void)
{
    mg_arena_stats_t st = {.size = sizeof(st)};
    if (atomic_load(&state) != READY || mg_arena_stats(&st) != 0 || st.num_ooms == 0 ||
        st.budget_bytes == 0)
        return;
    char budget[32], last[32], held[32], line[400];
    fmt_size(budget, sizeof(budget), st.budget_bytes);
    fmt_size(last, sizeof(last), st.last_oom_bytes);
    fmt_size(held, sizeof(held),
             st.tree_reserved_bytes ? st.tree_reserved_bytes : st.reserved_current);
    int n = snprintf(line, sizeof(line),
                     "memguard: the budget of %s (memguard run --budget, MEMGUARD_BUDGET) "
                     "refused %llu allocation(s) in process %d, the last of %s while %s "
                     "was held: raise the budget, or run without one\n",
                     budget, (unsigned long long)st.num_ooms, (int)getpid(), last, held);
    if (n > 0)
        (void)!write(2, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
}

/* 1: serve from the bootstrap buffer (this thread is resolving). */
static int booting(void)
{
    if (atomic_load_explicit(&state, memory_order_acquire) == READY)
        return 0;
    if (atomic_load(&state) == INITIALISING &&
        pthread_equal(atomic_load(&initialiser), pthread_self()))
        return 1;
    init();
    return atomic_load(&state) != READY;
}

static int lg(size_t align)
{
    return __builtin_ctzll((unsigned long long)align);
}

/* Allocate n bytes aligned to align (a power of two). NULL with errno ENOMEM. */
static void *alloc(size_t n, size_t align)
{
    int saved = errno;
    void *p = NULL;
    if (booting()) {
        p = boot_alloc(n, align);
    } else if (n >= MG_PRELOAD_MIN) {
        if (mg_arena_alloc(n, align, &p) != 0)
            p = NULL;
    } else if (je_mallocx) {
        p = je_mallocx(n ? n : 1, align > 16 ? lg(align) : 0);
    } else {
        p = align > 16 ? __libc_memalign(align, n) : __libc_malloc(n);
    }
    errno = p ? saved : ENOMEM;
    return p;
}

static size_t usable(void *p)
{
    if (in_boot(p))
        return boot_size(p);
    if (mg_arena_owns(p))
        return mg_arena_usable_size(p);
    if (je_mallocx)
        return je_sallocx(p, 0);
    return libc_usable ? libc_usable(p) : 0;
}

EXPORT void *malloc(size_t n)
{
    return alloc(n, 16);
}

EXPORT void free(void *p)
{
    if (!p || in_boot(p))
        return;
    if (mg_arena_owns(p))
        mg_arena_free(p);
    else if (je_mallocx)
        je_dallocx(p, 0);
    else
        __libc_free(p);
}

EXPORT void *calloc(size_t n, size_t m)
{
    size_t total;
    if (__builtin_mul_overflow(n, m, &total)) {
        errno = ENOMEM;
        return NULL;
    }
    if (!booting() && total < MG_PRELOAD_MIN && !je_mallocx)
        return __libc_calloc(n, m);
    void *p = alloc(total, 16);
    /* arena blocks may come from the cache, jemalloc's from a dirty page */
    if (p && !in_boot(p))
        memset(p, 0, total);
    return p;
}

EXPORT void *realloc(void *p, size_t n)
{
    if (!p)
        return malloc(n);
    if (n == 0) {
        free(p);
        return NULL;
    }
    int small_to_small = !in_boot(p) && !mg_arena_owns(p) && n < MG_PRELOAD_MIN;
    if (small_to_small && !booting()) {
        int saved = errno;
        void *q = je_mallocx ? je_rallocx(p, n, 0) : __libc_realloc(p, n);
        errno = q ? saved : ENOMEM;
        return q;
    }
    size_t have = usable(p);
    if (mg_arena_owns(p) && n <= have && n >= MG_PRELOAD_MIN / 2)
        return p;
    void *q = alloc(n, 16);
    if (!q)
        return NULL;
    memcpy(q, p, have < n ? have : n);
    free(p);
    return q;
}

EXPORT int posix_memalign(void **out, size_t align, size_t n)
{
    if (align < sizeof(void *) || (align & (align - 1)))
        return EINVAL;
    int saved = errno;
    void *p = alloc(n, align);
    errno = saved;
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}

EXPORT void *aligned_alloc(size_t align, size_t n)
{
    if (align == 0 || (align & (align - 1))) {
        errno = EINVAL;
        return NULL;
    }
    return alloc(n, align);
}

EXPORT void *memalign(size_t align, size_t n)
{
    return aligned_alloc(align < 16 ? 16 : align, n);
}

EXPORT void *valloc(size_t n)
{
    return alloc(n, (size_t)sysconf(_SC_PAGESIZE));
}

EXPORT void *pvalloc(size_t n)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return alloc((n + pg - 1) & ~(pg - 1), pg);
}

EXPORT size_t malloc_usable_size(void *p)
{
    return p ? usable(p) : 0;
}
