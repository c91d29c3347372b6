/* The device-memory cache behind memguard's CUDA allocator. Device memory
 * cannot hold headers (the host cannot touch it), so every block has a host
 * descriptor, found from its pointer through a hash table per device. One
 * mutex per device guards its pools, table and counters, as in PyTorch's own
 * caching allocator; backend calls (cudaMalloc, cudaFree) run under it.
 *
 * A pool per (device, stream) holds free lists per size class. Small and
 * medium blocks are carved from chunks and stay with their chunk: a chunk
 * goes back to the backend only once none of its blocks is in use. Large
 * blocks are backend allocations of their own and go back one by one,
 * biggest class first, when the budget needs room or on a trim.
 *
 * Budget: reserved bytes (chunks and large blocks held from the backend)
 * never pass it. An allocation that would needs room released from the
 * cache first (a "retry" in PyTorch's words), and fails if that is not
 * enough; a backend failure under the budget (the device is full) is retried
 * once after releasing the whole cache. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "memguard/memguard-cuda.h"
#include "mgi.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define SMALL_MAX (1 * MIB)
#define SMALL_CHUNK (2 * MIB)
#define MEDIUM_MAX (8 * MIB)
#define MEDIUM_CHUNK (20 * MIB)
#define LARGE_ROUND (2 * MIB)
#define N_CLASSES 320 /* up to 2^51 bytes */
#define DESC_BATCH 256
#define TABLE_MIN 1024

typedef struct chunk chunk_t;

typedef struct blk {
    char *ptr;
    size_t size;          /* class size: what counts as allocated */
    size_t requested;
    struct blk *next;     /* free list (cached) or descriptor spare list */
    struct blk *hnext;    /* hash chain */
    chunk_t *chunk;       /* NULL: a large block, or an uncached one */
    uint16_t cls;
    int16_t pool;         /* -1: uncached (past MG_DEV_MAX_STREAMS streams) */
    uint8_t live;
} blk_t;

struct chunk {
    char *ptr;
    size_t size;
    size_t live;          /* blocks of it in use */
    int dying;            /* being released (release()) */
    chunk_t *next;
};

typedef struct pool {
    void *stream;
    blk_t *free[N_CLASSES];
    char *bump[2], *bump_end[2]; /* carving: [0] small, [1] medium */
    chunk_t *cur[2];             /* the chunks being carved */
    chunk_t *chunks;
} pool_t;

typedef struct dev {
    pthread_mutex_t lock;
    pool_t pools[MG_DEV_MAX_STREAMS];
    int n_pools, last_pool;
    blk_t **table;        /* ptr -> descriptor, chained */
    size_t table_cap, table_count;
    blk_t *spare;         /* unused descriptors */
    uint64_t budget;
    mg_dev_stats_t st;
} mgdev_t;

static struct {
    pthread_mutex_t lock; /* guards dev[] creation and the backend switch */
    mgdev_t *dev[MG_DEV_MAX_DEVICES];
    mg_dev_backend_t backend;
    int have_backend;
} G = {.lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* Fork (DataLoader workers): take every lock so that none is held
 * mid-update in the child; the child re-makes them. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&G.lock);
    for (int i = 0; i < MG_DEV_MAX_DEVICES; i++)
        if (G.dev[i])
            pthread_mutex_lock(&G.dev[i]->lock);
}

static void fork_parent(void)
{
    for (int i = MG_DEV_MAX_DEVICES - 1; i >= 0; i--)
        if (G.dev[i])
            pthread_mutex_unlock(&G.dev[i]->lock);
    pthread_mutex_unlock(&G.lock);
}

static void fork_child(void)
{
    for (int i = 0; i < MG_DEV_MAX_DEVICES; i++)
        if (G.dev[i])
            pthread_mutex_init(&G.dev[i]->lock, NULL);
    pthread_mutex_init(&G.lock, NULL);
}

static void register_atfork(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* Class of n bytes (n >= 1) and its size: 512 B steps up to 4 KiB, then
 * eight classes per doubling (at most 12.5 % rounding). */
static unsigned class_of(size_t n, size_t *csize)
{
    if (n <= 4 * KIB) {
        unsigned c = (unsigned)((n + 511) / 512) - 1;
        *csize = (size_t)(c + 1) * 512;
        return c;
    }
    unsigned e = 63u - (unsigned)__builtin_clzll((unsigned long long)(n - 1)); /* >= 12 */
    size_t step = (size_t)1 << (e - 3);
    size_t k = (n + step - 1) / step; /* 9..16 */
    *csize = k * step;
    return 8 + (e - 12) * 8 + (unsigned)(k - 9);
}

static uint64_t max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

static mgdev_t *get_dev(int device, int create)
{
    if (device < 0 || device >= MG_DEV_MAX_DEVICES)
        return NULL;
    mgdev_t *d = __atomic_load_n(&G.dev[device], __ATOMIC_ACQUIRE);
    if (d || !create)
        return d;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&G.lock);
    d = G.dev[device];
    if (!d) {
        d = calloc(1, sizeof(*d));
        if (d) {
            pthread_mutex_init(&d->lock, NULL);
            d->last_pool = -1;
            d->st.size = sizeof(d->st);
            d->st.version = MG_DEV_STATS_VERSION;
            __atomic_store_n(&G.dev[device], d, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&G.lock);
    return d;
}

/* ---- descriptors and the pointer table ---------------------------------- */

static size_t hash_ptr(const void *p, size_t cap)
{
    uint64_t x = (uint64_t)(uintptr_t)p >> 9; /* blocks are 512-byte aligned */
    x *= 0x9e3779b97f4a7c15ULL;
    return (size_t)(x >> 32) & (cap - 1);
}

static int table_grow(mgdev_t *d)
{
    size_t cap = d->table_cap ? d->table_cap * 2 : TABLE_MIN;
    blk_t **t = calloc(cap, sizeof(*t));
    if (!t)
        return ENOMEM;
    for (size_t i = 0; i < d->table_cap; i++) {
        for (blk_t *b = d->table[i], *n; b; b = n) {
            n = b->hnext;
            size_t h = hash_ptr(b->ptr, cap);
            b->hnext = t[h];
            t[h] = b;
        }
    }
    free(d->table);
    d->table = t;
    d->table_cap = cap;
    return 0;
}

static blk_t *table_find(mgdev_t *d, const void *p)
{
    if (!d->table_cap)
        return NULL;
    for (blk_t *b = d->table[hash_ptr(p, d->table_cap)]; b; b = b->hnext)
        if (b->ptr == p)
            return b;
    return NULL;
}

static void table_remove(mgdev_t *d, blk_t *x)
{
    for (blk_t **pp = &d->table[hash_ptr(x->ptr, d->table_cap)]; *pp; pp = &(*pp)->hnext) {
        if (*pp == x) {
            *pp = x->hnext;
            d->table_count--;
            return;
        }
    }
}

/* A descriptor entered in the table for ptr. NULL when out of host memory. */
static blk_t *desc_new(mgdev_t *d, char *ptr)
{
    if (d->table_count + 1 > d->table_cap && table_grow(d) != 0)
        return NULL;
    if (!d->spare) {
        blk_t *batch = calloc(DESC_BATCH, sizeof(*batch));
        if (!batch)
            return NULL;
        for (int i = 0; i < DESC_BATCH; i++) {
            batch[i].next = d->spare;
            d->spare = &batch[i];
        }
    }
    blk_t *b = d->spare;
    d->spare = b->next;
    memset(b, 0, sizeof(*b));
    b->ptr = ptr;
    size_t h = hash_ptr(ptr, d->table_cap);
    b->hnext = d->table[h];
    d->table[h] = b;
    d->table_count++;
    return b;
}

static void desc_drop(mgdev_t *d, blk_t *b)
{
    table_remove(d, b);
    b->next = d->spare;
    d->spare = b;
}

/* ---- the backend -------------------------------------------------------- */

static void backend_free(mgdev_t *d, int device, void *p, size_t size)
{
    G.backend.free(G.backend.ctx, device, p);
    d->st.num_device_frees++;
    d->st.reserved_current -= size;
}

/* Give cached large blocks, then chunks with no block in use, back to the
 * backend until at least want bytes were released (UINT64_MAX: all). */
static uint64_t release(mgdev_t *d, int device, uint64_t want)
{
    uint64_t freed = 0;
    size_t ignored;
    /* classes up to MEDIUM_MAX's hold carved blocks only, the others large
     * blocks only */
    const int carved_max = (int)class_of(MEDIUM_MAX, &ignored);
    for (int c = N_CLASSES - 1; c > carved_max && freed < want; c--) {
        for (int i = 0; i < d->n_pools && freed < want; i++) {
            pool_t *pl = &d->pools[i];
            while (pl->free[c] && freed < want) {
                blk_t *b = pl->free[c];
                pl->free[c] = b->next;
                d->st.cached_bytes -= b->size;
                backend_free(d, device, b->ptr, b->size);
                freed += b->size;
                desc_drop(d, b);
            }
        }
    }
    for (int i = 0; i < d->n_pools && freed < want; i++) {
        pool_t *pl = &d->pools[i];
        /* the chunks to release, marked first: then one pass over the
         * carved classes unlists all their (cached) blocks */
        chunk_t *dead = NULL;
        for (chunk_t **cp = &pl->chunks; *cp && freed < want;) {
            chunk_t *ch = *cp;
            if (ch->live) {
                cp = &ch->next;
                continue;
            }
            *cp = ch->next;
            ch->dying = 1;
            ch->next = dead;
            dead = ch;
            freed += ch->size;
            for (int k = 0; k < 2; k++) {
                if (pl->cur[k] == ch) {
                    pl->cur[k] = NULL;
                    pl->bump[k] = pl->bump_end[k] = NULL;
                }
            }
        }
        if (!dead)
            continue;
        for (int c = 0; c <= carved_max; c++) {
            for (blk_t **pp = &pl->free[c]; *pp;) {
                blk_t *b = *pp;
                if (!b->chunk || !b->chunk->dying) {
                    pp = &b->next;
                    continue;
                }
                *pp = b->next;
                d->st.cached_bytes -= b->size;
                desc_drop(d, b);
            }
        }
        while (dead) {
            chunk_t *ch = dead;
            dead = ch->next;
            backend_free(d, device, ch->ptr, ch->size);
            free(ch);
        }
    }
    if (freed) {
        d->st.num_trims++;
        d->st.trimmed_bytes += freed;
    }
    return freed;
}

/* Take bytes from the backend within the budget: release cache to make
 * room, and once more after a backend failure. 0, ENOMEM or the backend's
 * error. */
static int backend_alloc(mgdev_t *d, int device, size_t bytes, void **out)
{
    int retried = 0;
    if (d->budget) {
        uint64_t room = d->budget > d->st.reserved_current ? d->budget - d->st.reserved_current : 0;
        if (bytes > room) {
            retried = 1;
            d->st.num_alloc_retries++;
            release(d, device, bytes - room);
            room = d->budget > d->st.reserved_current ? d->budget - d->st.reserved_current : 0;
            if (bytes > room)
                return ENOMEM;
        }
    }
    int rc = G.backend.alloc(G.backend.ctx, device, bytes, out);
    if (rc == ENOMEM && release(d, device, UINT64_MAX) > 0) {
        if (!retried)
            d->st.num_alloc_retries++;
        rc = G.backend.alloc(G.backend.ctx, device, bytes, out);
    }
    if (rc)
        return rc;
    d->st.num_device_allocs++;
    d->st.reserved_current += bytes;
    d->st.reserved_peak = max_u64(d->st.reserved_peak, d->st.reserved_current);
    return 0;
}

/* ---- pools -------------------------------------------------------------- */

static int find_pool(mgdev_t *d, void *stream)
{
    if (d->last_pool >= 0 && d->pools[d->last_pool].stream == stream)
        return d->last_pool;
    for (int i = 0; i < d->n_pools; i++) {
        if (d->pools[i].stream == stream)
            return d->last_pool = i;
    }
    if (d->n_pools == MG_DEV_MAX_STREAMS)
        return -1;
    pool_t *pl = &d->pools[d->n_pools];
    memset(pl, 0, sizeof(*pl));
    pl->stream = stream;
    d->st.streams = (uint64_t)d->n_pools + 1;
    return d->last_pool = d->n_pools++;
}

/* Carve csize bytes for a small (k=0) or medium (k=1) class. */
static int carve(mgdev_t *d, int device, pool_t *pl, int k, size_t csize, char **p, chunk_t **chp)
{
    if (!pl->bump[k] || (size_t)(pl->bump_end[k] - pl->bump[k]) < csize) {
        size_t chunk_size = k ? MEDIUM_CHUNK : SMALL_CHUNK;
        chunk_t *ch = malloc(sizeof(*ch));
        if (!ch)
            return ENOMEM;
        void *mem;
        int rc = backend_alloc(d, device, chunk_size, &mem);
        if (rc) {
            free(ch);
            return rc;
        }
        ch->ptr = mem;
        ch->size = chunk_size;
        ch->live = 0;
        ch->dying = 0;
        ch->next = pl->chunks;
        pl->chunks = ch;
        pl->cur[k] = ch;
        pl->bump[k] = mem;
        pl->bump_end[k] = (char *)mem + chunk_size;
    }
    *p = pl->bump[k];
    *chp = pl->cur[k];
    pl->bump[k] += csize;
    return 0;
}

static void count_alloc(mgdev_t *d, blk_t *b, int hit)
{
    d->st.allocated_current += b->size;
    d->st.active_current += b->size;
    d->st.requested_current += b->requested;
    d->st.allocated_peak = max_u64(d->st.allocated_peak, d->st.allocated_current);
    d->st.active_peak = max_u64(d->st.active_peak, d->st.active_current);
    d->st.requested_peak = max_u64(d->st.requested_peak, d->st.requested_current);
    d->st.num_allocs++;
    if (hit)
        d->st.num_cache_hits++;
}

static int alloc_locked(mgdev_t *d, int device, void *stream, size_t size, void **out)
{
    size_t csize;
    unsigned c = class_of(size, &csize);
    if (c >= N_CLASSES)
        return ENOMEM;
    int k = size <= SMALL_MAX ? 0 : size <= MEDIUM_MAX ? 1 : 2;
    if (k == 2)
        csize = (csize + LARGE_ROUND - 1) & ~(LARGE_ROUND - 1);
    int ip = find_pool(d, stream);
    blk_t *b = NULL;
    if (ip >= 0 && (b = d->pools[ip].free[c]) != NULL) {
        d->pools[ip].free[c] = b->next;
        d->st.cached_bytes -= b->size;
        if (b->chunk)
            b->chunk->live++;
        b->live = 1;
        b->next = NULL;
        b->requested = size;
        count_alloc(d, b, 1);
        *out = b->ptr;
        return 0;
    }
    char *p = NULL;
    chunk_t *ch = NULL;
    int rc;
    if (ip >= 0 && k < 2) {
        rc = carve(d, device, &d->pools[ip], k, csize, &p, &ch);
    } else {
        void *mem;
        rc = backend_alloc(d, device, csize, &mem);
        p = mem;
        if (ip < 0)
            d->st.num_uncached++;
    }
    if (rc)
        return rc;
    b = desc_new(d, p);
    if (!b) {
        if (ch) { /* give the carved bytes back to the bump pointer */
            d->pools[ip].bump[k] -= csize;
        } else {
            backend_free(d, device, p, csize);
        }
        return ENOMEM;
    }
    b->size = csize;
    b->requested = size;
    b->cls = (uint16_t)c;
    b->pool = (int16_t)ip;
    b->chunk = ch;
    b->live = 1;
    if (ch)
        ch->live++;
    count_alloc(d, b, 0);
    *out = p;
    return 0;
}

/* ---- the API ------------------------------------------------------------ */

/* Release every device's cache under the backend in use; EBUSY (and
 * nothing released past that device) while a block is alive. G.lock held. */
static int release_all_locked(void)
{
    int rc = 0;
    for (int i = 0; i < MG_DEV_MAX_DEVICES && !rc; i++) {
        mgdev_t *d = G.dev[i];
        if (!d)
            continue;
        pthread_mutex_lock(&d->lock);
        if (d->st.allocated_current)
            rc = EBUSY;
        else if (G.have_backend)
            release(d, i, UINT64_MAX);
        pthread_mutex_unlock(&d->lock);
    }
    return rc;
}

int mg_dev_init(const mg_dev_backend_t *backend)
{
    if (!backend || !backend->alloc || !backend->free)
        return EINVAL;
    pthread_mutex_lock(&G.lock);
    int rc = release_all_locked();
    if (!rc) {
        G.backend = *backend;
        G.have_backend = 1;
    }
    pthread_mutex_unlock(&G.lock);
    return rc;
}

int mg_dev_detach(void)
{
    pthread_mutex_lock(&G.lock);
    int rc = release_all_locked();
    if (!rc)
        G.have_backend = 0;
    pthread_mutex_unlock(&G.lock);
    return rc;
}

const char *mg_dev_backend_name(void)
{
    return G.have_backend ? (G.backend.name ? G.backend.name : "?") : NULL;
}

int mg_dev_alloc(int device, void *stream, size_t size, void **out)
{
    *out = NULL;
    if (device < 0 || device >= MG_DEV_MAX_DEVICES)
        return EINVAL;
    if (!G.have_backend)
        return ENODEV;
    if (size == 0)
        return 0;
    mgdev_t *d = get_dev(device, 1);
    if (!d)
        return ENOMEM;
    pthread_mutex_lock(&d->lock);
    int rc = alloc_locked(d, device, stream, size, out);
    if (rc) {
        d->st.num_ooms++;
        d->st.last_oom_bytes = size;
    }
    pthread_mutex_unlock(&d->lock);
    return rc;
}

static void free_locked(mgdev_t *d, int device, blk_t *b)
{
    b->live = 0;
    d->st.allocated_current -= b->size;
    d->st.active_current -= b->size;
    d->st.requested_current -= b->requested;
    d->st.num_frees++;
    if (b->pool < 0) { /* uncached */
        backend_free(d, device, b->ptr, b->size);
        desc_drop(d, b);
        return;
    }
    if (b->chunk)
        b->chunk->live--;
    pool_t *pl = &d->pools[b->pool];
    b->next = pl->free[b->cls];
    pl->free[b->cls] = b;
    d->st.cached_bytes += b->size;
}

/* Free p if device d holds it: 1 found (freed, or cached already: a double
 * free, ignored), 0 not d's. */
static int free_on(int device, void *p)
{
    mgdev_t *d = get_dev(device, 0);
    if (!d)
        return 0;
    pthread_mutex_lock(&d->lock);
    blk_t *b = table_find(d, p);
    if (b && b->live)
        free_locked(d, device, b);
    pthread_mutex_unlock(&d->lock);
    return b != NULL;
}

void mg_dev_free(int device, void *p)
{
    if (!p)
        return;
    /* the ordinal given first; then every device, so that a pointer freed
     * with the wrong one still finds its owner */
    int hint = device >= 0 && device < MG_DEV_MAX_DEVICES;
    if (hint && free_on(device, p))
        return;
    for (int i = 0; i < MG_DEV_MAX_DEVICES; i++)
        if (!(hint && i == device) && free_on(i, p))
            return;
}

int mg_dev_set_budget(int device, uint64_t bytes)
{
    mgdev_t *d = get_dev(device, 1);
    if (!d)
        return device < 0 || device >= MG_DEV_MAX_DEVICES ? EINVAL : ENOMEM;
    pthread_mutex_lock(&d->lock);
    d->budget = bytes;
    d->st.budget_bytes = bytes;
    if (bytes && d->st.reserved_current > bytes && G.have_backend)
        release(d, device, d->st.reserved_current - bytes);
    pthread_mutex_unlock(&d->lock);
    return 0;
}

int mg_dev_trim(int device, uint64_t *freed)
{
    uint64_t total = 0;
    if (device != -1 && (device < 0 || device >= MG_DEV_MAX_DEVICES))
        return EINVAL;
    for (int i = 0; i < MG_DEV_MAX_DEVICES; i++) {
        if (device != -1 && i != device)
            continue;
        mgdev_t *d = get_dev(i, 0);
        if (!d || !G.have_backend)
            continue;
        pthread_mutex_lock(&d->lock);
        total += release(d, i, UINT64_MAX);
        pthread_mutex_unlock(&d->lock);
    }
    if (freed)
        *freed = total;
    return 0;
}

int mg_dev_stats(int device, mg_dev_stats_t *out)
{
    if (device < 0 || device >= MG_DEV_MAX_DEVICES)
        return EINVAL;
    mgdev_t *d = get_dev(device, 0);
    if (!d) {
        memset(out, 0, sizeof(*out));
        out->size = sizeof(*out);
        out->version = MG_DEV_STATS_VERSION;
        return 0;
    }
    pthread_mutex_lock(&d->lock);
    *out = d->st;
    pthread_mutex_unlock(&d->lock);
    return 0;
}

void mg_dev_reset_peaks(int device)
{
    mgdev_t *d = get_dev(device, 0);
    if (!d)
        return;
    pthread_mutex_lock(&d->lock);
    d->st.allocated_peak = d->st.allocated_current;
    d->st.active_peak = d->st.active_current;
    d->st.reserved_peak = d->st.reserved_current;
    d->st.requested_peak = d->st.requested_current;
    pthread_mutex_unlock(&d->lock);
}
