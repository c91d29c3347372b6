/* The budgeted caching arena. One reserved address range holds everything,
 * so ownership is a range check: [base, mid) is carved into 2 MiB slab
 * chunks for small blocks (size classes up to 256 KiB, found on free through
 * a chunk map), [mid, end) into large blocks with a 64-byte header in front.
 * Small blocks have no header: what their callers asked for is kept beside
 * the slabs, one uint16_t per 64-byte granule, so requested bytes are exact.
 * Freed blocks stay cached in per-class free lists; cached large blocks can
 * be given back to the kernel (MADV_DONTNEED) and keep their address range.
 * Under a budget, a large class with nothing cached splits a cached block of
 * twice its size (four classes up) into two halves, and freed halves merge
 * back with their buddy: a smaller batch after a larger one reuses the
 * larger one's warm pages instead of releasing them and faulting in new
 * ones, and the other way round.
 *
 * The budget bounds reserved bytes (allocated + cached blocks; a slab counts
 * the blocks carved from it, not its untouched tail) by an
 * atomic reserve, compare, roll back. An allocation with no room under it
 * releases the largest cached blocks, as many as make room, else fails
 * (releasing nothing when the whole cache would not make room): under a
 * tight budget, what stays cached is reused warm instead of being released
 * and faulted in again. Nothing here calls Python or blocks on anything but
 * short mutexes: a class's lock, the next class up's while a freed half
 * merges (always waited for in ascending class order), and the leaf-level
 * grow lock; the allocation path only try-locks other classes. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memguard/memguard-arena.h"
#include "mgi.h"

#define CHUNK_SHIFT 21
#define CHUNK ((size_t)1 << CHUNK_SHIFT)
#define SMALL_MAX ((size_t)256 << 10)
#define HDR 64
#define N_SMALL 48      /* classes up to SMALL_MAX: 8 + 4 per doubling from 512 */
#define N_CLASSES 256
#define GRANULE_SHIFT 6 /* every small class size is a multiple of 64 */
#define SLACK_PER_CHUNK (CHUNK >> GRANULE_SHIFT)
#define LARGE_MAGIC 0x6d676c6172676521ULL /* "mglarge!" */

/* Lives in the first bytes of every large block, HDR bytes before the
 * pointer handed out. */
typedef struct large_hdr {
    uint64_t magic;
    char *block;               /* start of the block */
    size_t block_size;         /* its class size */
    size_t requested;          /* what the caller asked for */
    struct large_hdr *next;    /* free-list link while cached */
    uint32_t cls;
    uint32_t released;         /* pages past the first were given back */
    /* Halves (see split_cached): depth counts the splits that made a block,
     * bit d-1 of sides says which half it was at split d. A half keeps its
     * header at its start, so its buddy's header is found from its address;
     * tag = cls << 8 | TAG_FREE while listed | depth is what a freeing buddy
     * reads, holding the class lock but not the block's. */
    _Atomic uint32_t tag;
    uint32_t sides;
    uint32_t epoch;            /* step boundary at which it was last listed */
} large_hdr_t;

#define TAG_FREE 0x80u
#define TAG_DEPTH 0x7fu
#define MAX_DEPTH 24u

_Static_assert(sizeof(large_hdr_t) <= HDR, "large header must fit before the pointer");

typedef struct small_free {
    struct small_free *next;
} small_free_t;

typedef struct cls {
    pthread_mutex_t lock;      /* guards everything below */
    void *free;                /* small_free_t* or large_hdr_t* */
    char *bump, *bump_end;     /* small: the slab chunk being carved */
} cls_t;

static struct {
    char *base, *mid, *end;    /* immutable after init */
    size_t page;
    uint16_t *chunk_cls;       /* slab chunk -> class + 1; written under grow_lock */
    /* Granule of a live small block -> class size less requested (< 32 KiB,
     * the widest class step). Written by the block's owner: the allocating
     * thread, before it hands the pointer on. PROT_NONE until its chunk is
     * carved, so only slabs in use cost memory. */
    uint16_t *slack;
    pthread_mutex_t grow_lock; /* guards slab_next, large_next; a leaf lock */
    char *slab_next, *large_next;
    cls_t small[N_SMALL];      /* free lists of small_free_t */
    cls_t large[N_CLASSES];    /* free lists of large_hdr_t */
    _Atomic uint64_t allocated, allocated_peak, reserved, reserved_peak;
    _Atomic uint64_t requested, requested_peak, cached, budget, cache_limit;
    _Atomic uint64_t n_alloc, n_free, n_hit, n_oom, n_trim, trimmed, last_oom, decayed;
    _Atomic uint32_t epoch;    /* step boundaries counted by mg_arena_decay */
    /* Soft budget (mg_arena_set_soft): outside strict sections, a request
     * the budget refuses is served and counted instead. */
    _Atomic int soft, strict;
    _Atomic uint64_t n_over, last_over;
} A;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int init_rc = EAGAIN;

/* One budget for the processes of a run (`memguard run --budget`): a
 * MAP_SHARED segment (mgi_tree_t), anonymous and inherited by the children
 * a process forks (DataLoader workers), or a file that processes started
 * by exec map too. Its total is taken by a compare-exchange, so the tree
 * never passes the budget; each process has a slot holding its pid and
 * what it reserved beyond what it inherited at its fork (inherited live
 * blocks are its parent's, shared copy-on-write; the parent's cache is not
 * inherited: drop_inherited_cache). A slot whose process is gone (workers
 * leave by _exit, with no hook to run) is taken back, its charge with it,
 * when the budget would be passed or no slot is free. */
static mgi_tree_t *T;      /* set once, before any fork or thread; NULL: no shared budget */
static int tree_slot = -1; /* this process's slot; -1: none, and the arena refuses */
/* Blocks below these addresses are inherited from the parent (NULL: none);
 * written by the fork handler only. */
static char *inherited_small, *inherited_large;

/* Size class of n bytes: multiples of 64 up to 512, then four per doubling
 * (so at most 25 % rounding); every class size is a multiple of 64. */
static unsigned class_of(size_t n, size_t *csize)
{
    if (n <= 512) {
        unsigned c = n ? (unsigned)((n + 63) / 64) - 1 : 0;
        *csize = (size_t)(c + 1) * 64;
        return c;
    }
    unsigned e = 63u - (unsigned)__builtin_clzll((unsigned long long)(n - 1));
    size_t step = (size_t)1 << (e - 2);
    size_t k = (n + step - 1) / step; /* 5..8 */
    *csize = k * step;
    return 8 + (e - 9) * 4 + (unsigned)(k - 5);
}

/* Size of small class c, the inverse of class_of. */
static size_t class_size(unsigned c)
{
    if (c < 8)
        return (size_t)(c + 1) * 64;
    unsigned e = (c - 8) / 4 + 9, k = (c - 8) % 4 + 5;
    return (size_t)k << (e - 2);
}

static void peak(_Atomic uint64_t *peak_v, uint64_t now)
{
    uint64_t p = atomic_load_explicit(peak_v, memory_order_relaxed);
    while (now > p && !atomic_compare_exchange_weak_explicit(peak_v, &p, now,
                                                             memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}

/* Fork: take every lock (classes before grow_lock, the allocation order). */
static void lock_all(void)
{
    for (int i = 0; i < N_SMALL; i++)
        pthread_mutex_lock(&A.small[i].lock);
    for (int i = 0; i < N_CLASSES; i++)
        pthread_mutex_lock(&A.large[i].lock);
    pthread_mutex_lock(&A.grow_lock);
}

static void unlock_all(void)
{
    pthread_mutex_unlock(&A.grow_lock);
    for (int i = N_CLASSES - 1; i >= 0; i--)
        pthread_mutex_unlock(&A.large[i].lock);
    for (int i = N_SMALL - 1; i >= 0; i--)
        pthread_mutex_unlock(&A.small[i].lock);
}

static void tree_join(uint64_t charge);
static void reinit_locks(void);
static void drop_inherited_cache(void);

/* A forked child (a DataLoader worker) inherits the arena whole; the locks
 * need re-making, as their holders did not come along. Under a tree budget
 * it leaves the parent's cache alone and takes a slot of its own. */
static void fork_child(void)
{
    reinit_locks();
    if (T) {
        drop_inherited_cache();
        tree_slot = -1;
        tree_join(0);
    }
}

static void reinit_locks(void)
{
    for (int i = 0; i < N_SMALL; i++)
        pthread_mutex_init(&A.small[i].lock, NULL);
    for (int i = 0; i < N_CLASSES; i++)
        pthread_mutex_init(&A.large[i].lock, NULL);
    pthread_mutex_init(&A.grow_lock, NULL);
}

static void do_init(void)
{
    A.page = (size_t)sysconf(_SC_PAGESIZE);
    /* Reserve address space only (PROT_NONE costs no commit charge); the
     * largest that the system allows, from 1 TiB down to 8 GiB. */
    size_t want = (size_t)1 << 40;
    char *raw = MAP_FAILED;
    for (; want >= ((size_t)8 << 30); want >>= 1) {
        raw = mmap(NULL, want + CHUNK, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
        if (raw != MAP_FAILED)
            break;
    }
    if (raw == MAP_FAILED) {
        init_rc = ENOMEM;
        return;
    }
    char *base = (char *)(((uintptr_t)raw + CHUNK - 1) & ~(uintptr_t)(CHUNK - 1));
    if (base > raw)
        munmap(raw, (size_t)(base - raw));
    munmap(base + want, (size_t)(raw + want + CHUNK - base - want));
    size_t n_chunks = want / 4 / CHUNK; /* a quarter for slabs */
    void *map = mmap(NULL, n_chunks * sizeof(uint16_t), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) {
        munmap(base, want);
        init_rc = ENOMEM;
        return;
    }
    /* the slack table is reserved only; carving a chunk commits its part */
    void *slack = mmap(NULL, n_chunks * SLACK_PER_CHUNK * sizeof(uint16_t), PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (slack == MAP_FAILED) {
        munmap(map, n_chunks * sizeof(uint16_t));
        munmap(base, want);
        init_rc = ENOMEM;
        return;
    }
    A.chunk_cls = map;
    A.slack = slack;
    A.base = A.slab_next = base;
    A.mid = A.large_next = base + n_chunks * CHUNK;
    A.end = base + want;
    reinit_locks();
    pthread_atfork(lock_all, unlock_all, fork_child);
    init_rc = 0;
}

int mg_arena_init(void)
{
    pthread_once(&init_once, do_init);
    return init_rc;
}

int mg_arena_owns(const void *p)
{
    return (const char *)p >= A.base && (const char *)p < A.end;
}

/* Make [p, p+n) usable; huge pages where the kernel allows (THP "madvise"). */
static int commit(char *p, size_t n)
{
    if (mprotect(p, n, PROT_READ | PROT_WRITE) != 0)
        return errno;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, n, MADV_HUGEPAGE);
#endif
    return 0;
}

/* Give back bytes this process reserved, and its charge to the tree with
 * them. */
static void sub_reserved(uint64_t bytes)
{
    atomic_fetch_sub(&A.reserved, bytes);
    if (T && tree_slot >= 0) {
        atomic_fetch_sub(&T->slot[tree_slot].charge, bytes);
        atomic_fetch_sub(&T->total, bytes);
    }
}

/* Hand slot i, held as owner, to pid next (0: free) in the next
 * generation; the charge of the holder leaves the total. 1 when this
 * thread did it: of racing callers, one does. */
static int clear_slot(int i, uint64_t owner, int32_t next)
{
    uint64_t gen = owner >> 32;
    if (!atomic_compare_exchange_strong(&T->slot[i].owner, &owner, gen << 32 | UINT32_MAX))
        return 0;
    atomic_fetch_sub(&T->total, atomic_exchange(&T->slot[i].charge, 0));
    atomic_store(&T->slot[i].owner, (gen + 1) << 32 | (uint32_t)next);
    return 1;
}

/* Take back the slots of processes that are gone (kill(pid, 0): one system
 * call a slot in use; only when the budget would be passed or no slot is
 * free). */
static void tree_reap(void)
{
    int saved = errno; /* kill's ESRCH is no business of the allocation's caller */
    for (int i = 0; i < MGI_TREE_SLOTS; i++) {
        uint64_t owner = atomic_load(&T->slot[i].owner);
        int32_t pid = MGI_SLOT_PID(owner);
        if (pid > 0 && i != tree_slot && kill(pid, 0) != 0 && errno == ESRCH)
            (void)clear_slot(i, owner, 0);
    }
    errno = saved;
}

/* A slot for this process: a slot holding its pid already is stale (the
 * process it was before an exec, or a gone one whose pid came back) and is
 * emptied, the first reused; else a free one, else one taken back from a
 * process that is gone. -1 when live processes hold every slot. */
static int tree_claim(void)
{
    int32_t me = (int32_t)getpid();
    int got = -1;
    for (int i = 0; i < MGI_TREE_SLOTS; i++) {
        uint64_t owner = atomic_load(&T->slot[i].owner);
        if (MGI_SLOT_PID(owner) == me && clear_slot(i, owner, got < 0 ? me : 0) && got < 0)
            got = i;
    }
    for (int pass = 0; pass < 2 && got < 0; pass++) {
        if (pass)
            tree_reap();
        for (int i = 0; i < MGI_TREE_SLOTS && got < 0; i++) {
            uint64_t owner = atomic_load(&T->slot[i].owner);
            if (MGI_SLOT_PID(owner) == 0 &&
                atomic_compare_exchange_strong(&T->slot[i].owner, &owner,
                                               ((owner >> 32) + 1) << 32 | (uint32_t)me))
                got = i;
        }
    }
    return got;
}

/* Take a slot of T, charged with @p charge bytes. With none to take, the
 * arena refuses this process every allocation (never an uncharged one),
 * and says so once, here. */
static void tree_join(uint64_t charge)
{
    tree_slot = tree_claim();
    if (tree_slot >= 0) {
        atomic_fetch_add(&T->slot[tree_slot].charge, charge);
        atomic_fetch_add(&T->total, charge);
        return;
    }
    char line[200];
    int n = snprintf(line, sizeof(line),
                     "memguard: process %d is refused memory: live processes hold all %d "
                     "slots of the budget it shares (memguard run --budget)\n",
                     (int)getpid(), MGI_TREE_SLOTS);
    if (n > 0)
        (void)!write(2, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
}

/* Let go of this process's pages in [p, p + n), whole pages only: what was
 * shared with the parent costs no copy, and stops holding the parent's old
 * pages alive once the parent writes its own. */
static void forget(void *p, size_t n)
{
    uintptr_t a = ((uintptr_t)p + A.page - 1) & ~(uintptr_t)(A.page - 1);
    uintptr_t b = ((uintptr_t)p + n) & ~(uintptr_t)(A.page - 1);
    if (a < b)
        (void)madvise((void *)a, (size_t)(b - a), MADV_DONTNEED);
}

/* In a forked child of a tree (every lock held by no one): the parent's
 * cached blocks are not reused here. Reused, they would be this process's
 * pages as soon as it wrote them, yet charged to no one (the parent's
 * charge counts them, and the parent still has them); left mapped, they
 * keep the old pages alive while the parent reuses its own copies. So the
 * child lets go of them and forgets its free lists, and of the tails of
 * its slab chunks too, so that what it carves from now on lies above the
 * frontiers recorded here: below them, a block is inherited. */
static void drop_inherited_cache(void)
{
    for (unsigned c = 0; c < N_SMALL; c++) {
        for (small_free_t *f = A.small[c].free, *next; f; f = next) {
            next = f->next;
            forget(f, class_size(c));
        }
        A.small[c].free = NULL;
        A.small[c].bump = A.small[c].bump_end = NULL;
    }
    for (int c = 0; c < N_CLASSES; c++) {
        for (large_hdr_t *h = A.large[c].free, *next; h; h = next) {
            next = h->next;
            forget(h->block, h->block_size);
        }
        A.large[c].free = NULL;
    }
    atomic_store(&A.cached, 0);
    atomic_store(&A.reserved, atomic_load(&A.allocated)); /* no cache, no slab free lists */
    inherited_small = A.slab_next;
    inherited_large = A.large_next;
}

/* Whether block q was inherited live at a fork under a tree budget. */
static int inherited(const char *q)
{
    return q < A.mid ? q < inherited_small : q < inherited_large;
}

/* Free an inherited block: not cached (as drop_inherited_cache says), but
 * let go of; it leaves this process's reserved bytes and never was in its
 * charge. */
static void free_inherited(char *q)
{
    char *start = q;
    size_t bs, req;
    if (q < A.mid) {
        bs = class_size((unsigned)A.chunk_cls[(size_t)(q - A.base) >> CHUNK_SHIFT] - 1);
        req = bs - A.slack[(size_t)(q - A.base) >> GRANULE_SHIFT];
    } else {
        const large_hdr_t *h = (const large_hdr_t *)(q - HDR);
        start = h->block;
        bs = h->block_size;
        req = h->requested;
    }
    forget(start, bs);
    atomic_fetch_sub(&A.allocated, bs);
    atomic_fetch_sub(&A.requested, req);
    atomic_fetch_sub(&A.reserved, bs);
    atomic_fetch_add_explicit(&A.n_free, 1, memory_order_relaxed);
}

/* Give a cached, resident large block's pages back to the kernel (its
 * class lock held); returns its size. The header's page stays: the free
 * list runs through it. It is not always the first: a pointer aligned to
 * 2 MiB puts the header 2 MiB into its block. */
static uint64_t release_block(large_hdr_t *h)
{
    char *hp = (char *)((uintptr_t)h & ~(uintptr_t)(A.page - 1));
    char *end = h->block + h->block_size;
    if (hp > h->block)
        (void)madvise(h->block, (size_t)(hp - h->block), MADV_DONTNEED);
    if (hp + A.page < end)
        (void)madvise(hp + A.page, (size_t)(end - hp - A.page), MADV_DONTNEED);
    h->released = 1;
    atomic_fetch_sub(&A.cached, h->block_size);
    sub_reserved(h->block_size);
    return h->block_size;
}

static void count_trim(uint64_t freed)
{
    if (freed) {
        atomic_fetch_add(&A.n_trim, 1);
        atomic_fetch_add(&A.trimmed, freed);
    }
}

/* Give cached large blocks back to the kernel until at most keep bytes stay
 * cached. try=1 skips classes whose lock is busy (the allocation path may
 * hold one already). */
static uint64_t release_cache(uint64_t keep, int try)
{
    uint64_t freed = 0;
    for (int i = N_CLASSES - 1; i >= 0 && atomic_load(&A.cached) > keep; i--) {
        cls_t *k = &A.large[i];
        if (try ? pthread_mutex_trylock(&k->lock) != 0 : pthread_mutex_lock(&k->lock) != 0)
            continue;
        for (large_hdr_t *h = k->free; h && atomic_load(&A.cached) > keep; h = h->next)
            if (!h->released)
                freed += release_block(h);
        pthread_mutex_unlock(&k->lock);
    }
    count_trim(freed);
    return freed;
}

/* Count bytes as reserved if the budget allows, releasing cache first when
 * it does not: the largest cached blocks, only as many as make room (what
 * stays cached is what the next allocations reuse without faulting it in),
 * then, if racing threads took that room, all of them. When even the whole
 * cache would not make room, nothing is released: the allocation fails and
 * the cache stays warm for the smaller retry that follows an out-of-memory
 * error. 0 or ENOMEM. Under a budget this is a compare-exchange, not
 * add-then-roll-back: a transient overshoot would be seen by stats readers
 * and would make a racing allocation fail although both fit. */
static int reserve_tree(uint64_t bytes);
static int reserve_own(uint64_t bytes);
static int overrun(uint64_t bytes);

static int reserve(uint64_t bytes)
{
    if (T)
        return reserve_tree(bytes);
    return reserve_own(bytes) == 0 ? 0 : overrun(bytes);
}

/* A request the budget refused: ENOMEM, or under a soft budget outside a
 * strict section, the whole cache released and the request served past the
 * budget, counted for the Python side to report. */
static int overrun(uint64_t bytes)
{
    if (!atomic_load_explicit(&A.soft, memory_order_relaxed) || atomic_load(&A.strict))
        return ENOMEM;
    release_cache(0, 1);
    peak(&A.reserved_peak, atomic_fetch_add(&A.reserved, bytes) + bytes);
    atomic_fetch_add_explicit(&A.n_over, 1, memory_order_relaxed);
    atomic_store_explicit(&A.last_over, bytes, memory_order_relaxed);
    return 0;
}

static int reserve_own(uint64_t bytes)
{
    for (int attempt = 0;; attempt++) {
        uint64_t budget = atomic_load_explicit(&A.budget, memory_order_relaxed);
        if (!budget) {
            peak(&A.reserved_peak, atomic_fetch_add(&A.reserved, bytes) + bytes);
            return 0;
        }
        uint64_t cur = atomic_load(&A.reserved);
        while (cur <= budget && bytes <= budget - cur) {
            if (atomic_compare_exchange_weak(&A.reserved, &cur, cur + bytes)) {
                peak(&A.reserved_peak, cur + bytes);
                return 0;
            }
        }
        if (attempt == 2 || bytes > budget)
            return ENOMEM;
        /* cur + bytes > budget here (cur itself may be above a lowered budget) */
        uint64_t need = cur + bytes - budget;
        uint64_t cached = atomic_load(&A.cached);
        if (need > cached)
            return ENOMEM;
        release_cache(attempt == 0 ? cached - need : 0, 1);
    }
}

/* Take bytes of the tree's budget: a compare-exchange on its total, as
 * reserve() does on a process's. 0 or ENOMEM. */
static int take_room(uint64_t bytes)
{
    uint64_t budget = atomic_load(&T->budget);
    if (!budget) {
        atomic_fetch_add(&T->total, bytes);
        return 0;
    }
    uint64_t cur = atomic_load(&T->total);
    while (cur <= budget && bytes <= budget - cur)
        if (atomic_compare_exchange_weak(&T->total, &cur, cur + bytes))
            return 0;
    return ENOMEM;
}

/* reserve() under a budget the tree shares. Short of room, it takes back
 * what processes that are gone held, then releases this process's cache
 * as reserve() does (another process's cache is not its to release). */
static int reserve_tree(uint64_t bytes)
{
    if (tree_slot < 0)
        return ENOMEM; /* no slot: refused, as said when it joined */
    for (int attempt = 0;; attempt++) {
        if (take_room(bytes) == 0) {
            atomic_fetch_add(&T->slot[tree_slot].charge, bytes);
            peak(&A.reserved_peak, atomic_fetch_add(&A.reserved, bytes) + bytes);
            return 0;
        }
        uint64_t budget = atomic_load(&T->budget), used = atomic_load(&T->total);
        if (attempt == 3 || bytes > budget)
            return ENOMEM;
        if (attempt == 0) {
            tree_reap();
            continue;
        }
        uint64_t need = used + bytes > budget ? used + bytes - budget : 0;
        uint64_t cached = atomic_load(&A.cached);
        if (need > cached)
            return ENOMEM;
        release_cache(attempt == 1 ? cached - need : 0, 1);
    }
}

/* Undo a reserve whose allocation failed after all. */
static void unreserve(uint64_t bytes)
{
    sub_reserved(bytes);
}

static char *carve_slab_chunk(unsigned c)
{
    char *p = NULL;
    pthread_mutex_lock(&A.grow_lock);
    size_t i = (size_t)(A.slab_next - A.base) >> CHUNK_SHIFT;
    if (A.slab_next + CHUNK <= A.mid && commit(A.slab_next, CHUNK) == 0 &&
        mprotect(A.slack + i * SLACK_PER_CHUNK, SLACK_PER_CHUNK * sizeof(uint16_t),
                 PROT_READ | PROT_WRITE) == 0) {
        p = A.slab_next;
        A.slab_next += CHUNK;
        A.chunk_cls[i] = (uint16_t)(c + 1);
    }
    pthread_mutex_unlock(&A.grow_lock);
    return p;
}

/* A fresh large block. Its pointer sits max(align, HDR) bytes in, so past a
 * page of alignment the block itself must start aligned; the gap this
 * leaves stays PROT_NONE and costs no memory. */
static char *carve_large(size_t n, size_t align)
{
    uintptr_t to = align > A.page ? align : A.page;
    char *p = NULL;
    pthread_mutex_lock(&A.grow_lock);
    char *at = (char *)(((uintptr_t)A.large_next + to - 1) & ~(to - 1));
    if (at <= A.end && (size_t)(A.end - at) >= n && commit(at, n) == 0) {
        p = at;
        A.large_next = at + n;
    }
    pthread_mutex_unlock(&A.grow_lock);
    return p;
}

static void count_alloc(size_t block, size_t requested, int hit)
{
    peak(&A.allocated_peak, atomic_fetch_add(&A.allocated, block) + block);
    peak(&A.requested_peak, atomic_fetch_add(&A.requested, requested) + requested);
    atomic_fetch_add_explicit(&A.n_alloc, 1, memory_order_relaxed);
    if (hit)
        atomic_fetch_add_explicit(&A.n_hit, 1, memory_order_relaxed);
}

static int small_alloc(size_t size, void **out)
{
    size_t csize;
    unsigned c = class_of(size, &csize);
    cls_t *k = &A.small[c];
    void *p = NULL;
    int hit = 0;
    pthread_mutex_lock(&k->lock);
    if (k->free) {
        small_free_t *f = k->free;
        k->free = f->next;
        p = f;
        hit = 1;
    } else {
        /* Only carved blocks count as reserved, not whole chunks: with one
         * chunk per class in use, counting chunks would charge a budget up
         * to 48 x 2 MiB for pages never touched. */
        if (reserve(csize) != 0) {
            pthread_mutex_unlock(&k->lock);
            return ENOMEM;
        }
        if (!k->bump || k->bump + csize > k->bump_end) { /* (NULL + n is undefined) */
            char *chunk = carve_slab_chunk(c);
            if (!chunk) { /* the slab range is used up */
                unreserve(csize);
                pthread_mutex_unlock(&k->lock);
                return ENOMEM;
            }
            /* blocks never straddle chunks; the tail of the old one is lost */
            k->bump = chunk;
            k->bump_end = chunk + CHUNK;
        }
        p = k->bump;
        k->bump += csize;
    }
    pthread_mutex_unlock(&k->lock);
    A.slack[(size_t)((char *)p - A.base) >> GRANULE_SHIFT] = (uint16_t)(csize - size);
    count_alloc(csize, size, hit);
    *out = p;
    return 0;
}

static uint32_t tag_of(unsigned cls, uint32_t depth, int is_free)
{
    return (uint32_t)cls << 8 | (is_free ? TAG_FREE : 0) | depth;
}

static void list_large(cls_t *k, large_hdr_t *h)
{
    h->epoch = atomic_load_explicit(&A.epoch, memory_order_relaxed);
    h->next = k->free;
    k->free = h;
    atomic_store_explicit(&h->tag, tag_of(h->cls, atomic_load_explicit(&h->tag,
                          memory_order_relaxed) & TAG_DEPTH, 1), memory_order_relaxed);
}

/* Writes the header of a half at its start field by field: the tag, which
 * a thread freeing the buddy of the block it lies in may read at any time,
 * only atomically. */
static void set_half(large_hdr_t *h, size_t size, unsigned cls, uint32_t sides, uint32_t tag)
{
    h->magic = LARGE_MAGIC;
    h->block = (char *)h;
    h->block_size = size;
    h->requested = 0;
    h->next = NULL;
    h->cls = cls;
    h->released = 0;
    h->sides = sides;
    atomic_store_explicit(&h->tag, tag, memory_order_relaxed);
}

/* Under a budget with no cached block of class c (held: k): take a resident
 * cached block of class c + 4, twice the size, list its second half in
 * class c and return the first, both with their headers at their start.
 * The larger class is only try-locked, as the allocation path does with
 * every class but its own. NULL when there is none. */
static large_hdr_t *split_cached(cls_t *k, unsigned c, size_t csize)
{
    if (c + 4 >= N_CLASSES || class_size(c + 4) != 2 * csize)
        return NULL;
    cls_t *up = &A.large[c + 4];
    if (pthread_mutex_trylock(&up->lock) != 0)
        return NULL;
    large_hdr_t *b = NULL;
    uint32_t d = 0;
    for (large_hdr_t **pp = (large_hdr_t **)&up->free; *pp; pp = &(*pp)->next) {
        d = atomic_load_explicit(&(*pp)->tag, memory_order_relaxed) & TAG_DEPTH;
        if (!(*pp)->released && d < MAX_DEPTH) {
            b = *pp;
            *pp = b->next;
            /* unlisted: its buddy, freed under up's lock, must not read
             * the header this thread is about to rewrite */
            atomic_store_explicit(&b->tag, tag_of(c + 4, d, 0), memory_order_relaxed);
            break;
        }
    }
    pthread_mutex_unlock(&up->lock);
    if (!b)
        return NULL;
    /* private now; its header may sit past the block's start (an alignment
     * above 64 moved it), so read it before writing the halves' */
    char *block = b->block;
    uint32_t depth = d + 1, side = 1u << d, sides = b->sides & ~side;
    large_hdr_t *lo = (large_hdr_t *)block, *hi = (large_hdr_t *)(block + csize);
    set_half(hi, csize, c, sides | side, tag_of(c, depth, 0));
    list_large(k, hi);
    set_half(lo, csize, c, sides, tag_of(c, depth, 0));
    atomic_fetch_sub(&A.cached, csize); /* the other half stays cached */
    return lo;
}

/* h, a resident block of bs bytes just freed: list it, first merging it
 * with its buddy half while that is listed and resident, and the merged
 * block with its own, and so on. Returns the bytes cached after. A merge
 * takes the larger class's lock before it lets go of the smaller's (class
 * locks are only ever waited for in ascending order): a fork never sees a
 * block that is counted as cached but in no list. */
static uint64_t free_large(large_hdr_t *h, size_t bs)
{
    cls_t *k = &A.large[h->cls];
    pthread_mutex_lock(&k->lock);
    uint64_t cached = atomic_fetch_add(&A.cached, bs) + bs;
    for (;;) {
        uint32_t depth = atomic_load_explicit(&h->tag, memory_order_relaxed) & TAG_DEPTH;
        large_hdr_t *b = NULL;
        if (depth && h->block == (char *)h) {
            size_t hs = h->block_size;
            char *at = (h->sides >> (depth - 1)) & 1 ? h->block - hs : h->block + hs;
            large_hdr_t *cand = (large_hdr_t *)at;
            /* a listed half of this class and depth is the buddy: that tag
             * is only written under this lock */
            if (atomic_load_explicit(&cand->tag, memory_order_relaxed) ==
                    tag_of(h->cls, depth, 1) && !cand->released) {
                for (large_hdr_t **pp = (large_hdr_t **)&k->free; *pp; pp = &(*pp)->next) {
                    if (*pp == cand) {
                        *pp = cand->next;
                        b = cand;
                        break;
                    }
                }
            }
        }
        if (!b) {
            list_large(k, h);
            pthread_mutex_unlock(&k->lock);
            return cached;
        }
        large_hdr_t *upper = b < h ? h : b;
        atomic_store_explicit(&upper->tag, 0, memory_order_relaxed); /* a header no more */
        upper->magic = 0;
        h = b < h ? b : h;
        h->magic = LARGE_MAGIC;
        h->block_size *= 2;
        h->cls += 4;
        h->released = 0;
        h->sides &= ~(1u << (depth - 1));
        atomic_store_explicit(&h->tag, tag_of(h->cls, depth - 1, 0), memory_order_relaxed);
        cls_t *up = &A.large[h->cls];
        pthread_mutex_lock(&up->lock);
        pthread_mutex_unlock(&k->lock);
        k = up;
    }
}

/* Whether reserving bytes more would pass the budget (the tree's, where
 * one is shared). */
static int short_of_room(uint64_t bytes)
{
    if (T) {
        uint64_t budget = atomic_load(&T->budget);
        return budget && atomic_load(&T->total) + bytes > budget;
    }
    uint64_t budget = atomic_load_explicit(&A.budget, memory_order_relaxed);
    return budget && atomic_load(&A.reserved) + bytes > budget;
}

static int large_alloc(size_t size, size_t align, void **out)
{
    size_t off = align > HDR ? align : HDR;
    if (size > (size_t)(A.end - A.mid) - off)
        return ENOMEM;
    size_t csize;
    unsigned c = class_of(size + off, &csize);
    csize = (csize + A.page - 1) & ~(A.page - 1);
    cls_t *k = &A.large[c];
    large_hdr_t *h = NULL;
    int hit = 0;
    pthread_mutex_lock(&k->lock);
    /* a cached block whose pointer offset fits this alignment (halves only
     * at the default one: their header stays at their start): a resident
     * one, else one given back to the kernel (reused, it faults in again) */
    large_hdr_t **rel = NULL;
    for (large_hdr_t **pp = (large_hdr_t **)&k->free; *pp; pp = &(*pp)->next) {
        large_hdr_t *b = *pp;
        if (((uintptr_t)(b->block + off) & (align - 1)) != 0 ||
            (off != HDR && (atomic_load_explicit(&b->tag, memory_order_relaxed) & TAG_DEPTH)))
            continue;
        if (!b->released) {
            *pp = b->next;
            atomic_fetch_sub(&A.cached, b->block_size);
            h = b;
            hit = 1;
            break;
        }
        if (!rel)
            rel = pp;
    }
    if (!h && off == HDR) {
        /* short of room under the budget: half of a larger cached block */
        if (short_of_room(csize) && (h = split_cached(k, c, csize)) != NULL)
            hit = 1;
    }
    if (!h) {
        /* new memory, releasing cache for it if need be */
        if (reserve(csize) != 0) {
            pthread_mutex_unlock(&k->lock);
            return ENOMEM;
        }
        if (rel) { /* reserved above: the released block takes it */
            h = *rel;
            *rel = h->next;
            hit = 1;
        }
    }
    if (!h) {
        char *block = carve_large(csize, align);
        if (!block) { /* the large range is used up */
            unreserve(csize);
            pthread_mutex_unlock(&k->lock);
            return ENOMEM;
        }
        h = (large_hdr_t *)(block + off - HDR);
        h->block = block;
        h->block_size = csize;
        h->cls = c;
        h->sides = 0;
        atomic_init(&h->tag, tag_of(c, 0, 0));
    } else if (h != (large_hdr_t *)(h->block + off - HDR)) {
        /* same block, another alignment (never a half): move the header */
        large_hdr_t copy = *h;
        h = (large_hdr_t *)(copy.block + off - HDR);
        memcpy(h, &copy, sizeof(copy));
    }
    atomic_store_explicit(&h->tag, tag_of(c, atomic_load_explicit(&h->tag,
                          memory_order_relaxed) & TAG_DEPTH, 0), memory_order_relaxed);
    h->magic = LARGE_MAGIC;
    h->released = 0;
    h->next = NULL;
    h->requested = size;
    pthread_mutex_unlock(&k->lock);
    count_alloc(h->block_size, size, hit);
    *out = (char *)h + HDR;
    return 0;
}

int mg_arena_alloc(size_t size, size_t align, void **out)
{
    if (align == 0 || (align & (align - 1)) || align > CHUNK)
        return EINVAL;
    int rc = mg_arena_init();
    if (rc)
        return rc;
    if (size == 0)
        size = 1;
    /* by size, not class: class_of would wrap for sizes near SIZE_MAX, and
     * SMALL_MAX being a class size, the two agree */
    if (align <= 64 && size <= SMALL_MAX)
        rc = small_alloc(size, out);
    else
        rc = large_alloc(size, align, out);
    if (rc) {
        atomic_fetch_add_explicit(&A.n_oom, 1, memory_order_relaxed);
        atomic_store_explicit(&A.last_oom, size, memory_order_relaxed);
    }
    return rc;
}

void mg_arena_free(void *p)
{
    char *q = p;
    if (T && inherited(q)) {
        free_inherited(q);
        return;
    }
    if (q < A.mid) {
        unsigned c = (unsigned)A.chunk_cls[(size_t)(q - A.base) >> CHUNK_SHIFT] - 1;
        size_t csize = class_size(c);
        /* read before the block is listed: a new owner rewrites it */
        size_t req = csize - A.slack[(size_t)(q - A.base) >> GRANULE_SHIFT];
        cls_t *k = &A.small[c];
        pthread_mutex_lock(&k->lock);
        ((small_free_t *)q)->next = k->free;
        k->free = q;
        pthread_mutex_unlock(&k->lock);
        atomic_fetch_sub(&A.allocated, csize);
        atomic_fetch_sub(&A.requested, req);
    } else {
        large_hdr_t *h = (large_hdr_t *)(q - HDR);
        size_t bs = h->block_size, req = h->requested;
        uint64_t cached = free_large(h, bs);
        atomic_fetch_sub(&A.allocated, bs);
        atomic_fetch_sub(&A.requested, req);
        uint64_t limit = atomic_load_explicit(&A.cache_limit, memory_order_relaxed);
        if (limit && cached > limit)
            release_cache(limit, 1); /* no lock held here; busy classes are skipped */
    }
    atomic_fetch_add_explicit(&A.n_free, 1, memory_order_relaxed);
}

size_t mg_arena_usable_size(const void *p)
{
    const char *q = p;
    if (q < A.mid)
        return class_size((unsigned)A.chunk_cls[(size_t)(q - A.base) >> CHUNK_SHIFT] - 1);
    const large_hdr_t *h = (const large_hdr_t *)(q - HDR);
    return (size_t)(h->block + h->block_size - q);
}

void mg_arena_set_budget(uint64_t bytes)
{
    uint64_t r;
    if (T) {
        atomic_store(&T->budget, bytes);
        tree_reap();
        r = atomic_load(&T->total);
    } else {
        atomic_store(&A.budget, bytes);
        r = atomic_load(&A.reserved);
    }
    uint64_t c = atomic_load(&A.cached);
    if (bytes && init_rc == 0 && r > bytes) /* release the excess, if the cache holds it */
        release_cache(r - bytes < c ? c - (r - bytes) : 0, 0);
}

/* The tree's segment: an anonymous one (fd -1), else fd's file, grown to
 * the segment's size if shorter. MAP_FAILED with errno. */
static mgi_tree_t *map_tree(int fd)
{
    if (fd < 0)
        return mmap(NULL, sizeof(mgi_tree_t), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return MAP_FAILED;
    if ((uint64_t)sb.st_size < sizeof(mgi_tree_t) && ftruncate(fd, sizeof(mgi_tree_t)) != 0)
        return MAP_FAILED;
    return mmap(NULL, sizeof(mgi_tree_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
}

int mg_arena_share_budget(int fd, uint64_t budget)
{
    int rc = mg_arena_init();
    if (rc || T)
        return rc;
    mgi_tree_t *t = map_tree(fd);
    if (t == MAP_FAILED)
        return errno;
    uint64_t magic = 0;
    if (!atomic_compare_exchange_strong(&t->magic, &magic, MGI_TREE_MAGIC) &&
        magic != MGI_TREE_MAGIC) {
        munmap(t, sizeof(*t));
        return EPROTO;
    }
    uint64_t none = 0;
    (void)atomic_compare_exchange_strong(&t->budget, &none,
                                         budget ? budget : atomic_load(&A.budget));
    atomic_store(&A.budget, 0);
    T = t;
    tree_join(atomic_load(&A.reserved));
    return 0;
}

void mg_arena_set_cache_limit(uint64_t bytes)
{
    atomic_store(&A.cache_limit, bytes);
    if (bytes && init_rc == 0 && atomic_load(&A.cached) > bytes)
        release_cache(bytes, 0);
}

int mg_arena_decay(uint32_t age, uint64_t *freed)
{
    uint64_t f = 0;
    if (init_rc == 0) {
        uint32_t now = atomic_fetch_add(&A.epoch, 1) + 1;
        for (int i = N_CLASSES - 1; age && i >= 0; i--) {
            cls_t *k = &A.large[i];
            pthread_mutex_lock(&k->lock);
            for (large_hdr_t *h = k->free; h; h = h->next)
                if (!h->released && now - h->epoch >= age) /* wraps correctly */
                    f += release_block(h);
            pthread_mutex_unlock(&k->lock);
        }
        count_trim(f);
        atomic_fetch_add(&A.decayed, f);
    }
    if (freed)
        *freed = f;
    return 0;
}

int mg_arena_trim(uint64_t keep_bytes, uint64_t *freed)
{
    uint64_t f = init_rc == 0 ? release_cache(keep_bytes, 0) : 0;
    if (freed)
        *freed = f;
    return 0;
}

int mg_arena_stats(mg_arena_stats_t *o)
{
    memset(o, 0, sizeof(*o));
    o->size = sizeof(*o);
    o->version = MG_ARENA_STATS_VERSION;
    o->allocated_current = o->active_current = atomic_load(&A.allocated);
    o->allocated_peak = o->active_peak = atomic_load(&A.allocated_peak);
    o->reserved_current = atomic_load(&A.reserved);
    o->reserved_peak = atomic_load(&A.reserved_peak);
    o->requested_current = atomic_load(&A.requested);
    o->requested_peak = atomic_load(&A.requested_peak);
    o->cached_bytes = atomic_load(&A.cached);
    o->budget_bytes = T ? atomic_load(&T->budget) : atomic_load(&A.budget);
    o->tree_reserved_bytes = T ? atomic_load(&T->total) : 0;
    o->cache_limit_bytes = atomic_load(&A.cache_limit);
    o->reserve_bytes = (uint64_t)(A.end - A.base);
    o->num_allocs = atomic_load(&A.n_alloc);
    o->num_frees = atomic_load(&A.n_free);
    o->num_cache_hits = atomic_load(&A.n_hit);
    o->num_ooms = atomic_load(&A.n_oom);
    o->num_trims = atomic_load(&A.n_trim);
    o->trimmed_bytes = atomic_load(&A.trimmed);
    o->last_oom_bytes = atomic_load(&A.last_oom);
    o->decayed_bytes = atomic_load(&A.decayed);
    o->epoch = atomic_load(&A.epoch);
    o->num_overruns = atomic_load(&A.n_over);
    o->last_overrun_bytes = atomic_load(&A.last_over);
    return 0;
}

void mg_arena_set_soft(int soft)
{
    atomic_store(&A.soft, soft != 0);
}

void mg_arena_strict(int on)
{
    atomic_store(&A.strict, on != 0);
}

void mg_arena_reset_peaks(void)
{
    atomic_store(&A.allocated_peak, atomic_load(&A.allocated));
    atomic_store(&A.reserved_peak, atomic_load(&A.reserved));
    atomic_store(&A.requested_peak, atomic_load(&A.requested));
}
