/* The budgeted caching arena, through its public API and exact counters:
 * size classes (usable size, alignment, no write past a block), ownership,
 * reuse of cached blocks in a training-loop pattern, byte-exact accounting
 * and peaks, the budget (ENOMEM, cache released first, never passed, also
 * under four racing threads), halves split from cached blocks under it and
 * merged back, trim (counters and RSS), requests too large to ever fit,
 * fork while other threads allocate, and a budget shared by a process tree
 * (through a file; forked children charged, the parent's cache not reused;
 * slots taken back or refused; racing threads).
 *
 * The arena is one per process, so the tests run in order and each leaves
 * nothing allocated and no budget behind. Under valgrind (seen in
 * LD_PRELOAD) or with MGTEST_SLOW set, loops are shorter; there and under
 * ThreadSanitizer, blocks past 256 KiB are written only at their ends and
 * once per 8 MiB (see next_word()). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>

#include "memguard/memguard-arena.h"
#include "mgi.h"
#include "mgtest.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)
#define SMALL_MAX (256 * KiB) /* largest class served from slabs */
#define HDR 64                /* header in front of a large block */

static size_t page;
static int slow;

static mg_arena_stats_t st(void)
{
    mg_arena_stats_t s;
    mg_arena_stats(&s);
    return s;
}

static size_t round_up(size_t n, size_t to)
{
    return (n + to - 1) / to * to;
}

/* The documented classes, computed independently of arena.c: multiples of
 * 64 up to 512, then four per doubling (2^e + k * 2^e / 4). */
static size_t class_up(size_t n)
{
    if (n <= 512)
        return n ? round_up(n, 64) : 64;
    size_t p = 512;
    while (p * 2 < n)
        p *= 2;
    return round_up(n, p / 4);
}

/* Whether (size, align) is served from a slab (no header, no page rounding). */
static int is_small(size_t size, size_t align)
{
    return align <= 64 && size <= SMALL_MAX;
}

/* Bytes a block of (size, align) takes: what allocated_current counts. */
static size_t block_bytes(size_t size, size_t align)
{
    if (is_small(size, align))
        return class_up(size ? size : 1);
    size_t off = align > HDR ? align : HDR;
    return round_up(class_up(size + off), page);
}

/* Usable size the arena must report for (size, align). */
static size_t usable_bytes(size_t size, size_t align)
{
    if (is_small(size, align))
        return block_bytes(size, align);
    return block_bytes(size, align) - (align > HDR ? align : HDR);
}

/* Word i of block `seed`: unlike any other block's, and unlike its own
 * other words, so a write past the end or a shifted copy shows. */
static uint64_t pat(uint64_t seed, size_t i)
{
    return (seed * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)i;
}

/* Which words of an n-byte block are written and checked: all of them up
 * to full_max bytes; past that the first and last 64 KiB and one word per
 * 8 MiB between, which still shows a short or misplaced mapping (the arena
 * maps whole blocks) at a fraction of the page faults, which cost up to
 * 8 ms per fresh huge page in some VMs. The next covered word after i. */
static size_t full_max;

static size_t next_word(size_t n, size_t i)
{
    size_t words = n / 8, edge = 8 * KiB, stride = MiB;
    if (n <= full_max || i + 1 < edge || i + 1 >= words - edge)
        return i + 1;
    size_t next = (i + 1 + stride - 1) / stride * stride;
    return next < words - edge ? next : words - edge;
}

/* Write a block's usable bytes with its pattern. */
static void fill(void *p, size_t n, uint64_t seed)
{
    uint64_t *w = p;
    for (size_t i = 0; i < n / 8; i = next_word(n, i))
        w[i] = pat(seed, i);
    for (size_t i = n / 8 * 8; i < n; i++)
        ((unsigned char *)p)[i] = (unsigned char)seed;
}

/* Whether the block still holds what fill wrote. */
static int intact(const void *p, size_t n, uint64_t seed)
{
    const uint64_t *w = p;
    for (size_t i = 0; i < n / 8; i = next_word(n, i))
        if (w[i] != pat(seed, i))
            return 0;
    for (size_t i = n / 8 * 8; i < n; i++)
        if (((const unsigned char *)p)[i] != (unsigned char)seed)
            return 0;
    return 1;
}

static uint64_t rss_bytes(void)
{
    char buf[256];
    size_t len = 0;
    uint64_t rss = 0;
    const char *why = NULL;
    CHECK_EQ(mgi_read_path("/proc/self/statm", buf, sizeof(buf), &len), 0);
    CHECK_EQ(mgi_parse_statm(buf, len, page, &rss, &why), 0);
    return rss;
}

/* Every test starts and ends here: nothing allocated, no budget. */
static void check_idle(void)
{
    mg_arena_stats_t s = st();
    CHECK_EQ(s.allocated_current, 0);
    CHECK_EQ(s.requested_current, 0);
    CHECK_EQ(s.active_current, 0);
    CHECK_EQ(s.budget_bytes, 0);
    CHECK_EQ(s.num_allocs, s.num_frees);
}

static void test_init_and_errors(void)
{
    CHECK_EQ(mg_arena_init(), 0);
    CHECK_EQ(mg_arena_init(), 0); /* idempotent */
    mg_arena_stats_t s = st();
    CHECK_EQ(s.size, sizeof(mg_arena_stats_t));
    CHECK_EQ(s.version, MG_ARENA_STATS_VERSION);
    CHECK(s.reserve_bytes >= ((uint64_t)8 << 30));
    CHECK_EQ(s.reserved_current, 0);
    CHECK_EQ(s.cached_bytes, 0);
    CHECK_EQ(s.num_allocs, 0);
    check_idle();
    /* alignment must be a power of two up to 2 MiB; nothing is counted */
    void *p = (void *)&p;
    size_t bad[] = {0, 3, 96, 4 * MiB, (size_t)1 << 63};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK_EQ(mg_arena_alloc(100, bad[i], &p), EINVAL);
    CHECK(p == (void *)&p); /* untouched on failure */
    CHECK_EQ(st().num_ooms, 0);
    CHECK_EQ(st().num_allocs, 0);
    /* size 0 gives a real, distinct block */
    void *a = NULL, *b = NULL;
    CHECK_EQ(mg_arena_alloc(0, 1, &a), 0);
    CHECK_EQ(mg_arena_alloc(0, 1, &b), 0);
    CHECK(a && b && a != b);
    CHECK(mg_arena_usable_size(a) >= 1);
    mg_arena_free(a);
    mg_arena_free(b);
    check_idle();
}

static int stack_probe(void)
{
    char local[64];
    volatile char *v = local;
    v[0] = 1;
    return mg_arena_owns(local);
}

static void test_ownership(void)
{
    static char in_data[64];
    void *small = NULL, *large = NULL, *aligned = NULL;
    CHECK_EQ(mg_arena_alloc(24, 8, &small), 0);
    CHECK_EQ(mg_arena_alloc(3 * MiB, 64, &large), 0);
    CHECK_EQ(mg_arena_alloc(10, 2 * MiB, &aligned), 0);
    void *arena[] = {small, large, aligned};
    for (int i = 0; i < 3; i++) {
        CHECK(mg_arena_owns(arena[i]));
        /* every byte of the block, not only its start */
        CHECK(mg_arena_owns((char *)arena[i] + mg_arena_usable_size(arena[i]) - 1));
    }
    void *heap = malloc(100), *big_heap = malloc(8 * MiB);
    CHECK(heap && big_heap);
    CHECK(!mg_arena_owns(heap));
    CHECK(!mg_arena_owns(big_heap));
    CHECK(!mg_arena_owns(in_data));
    CHECK(!stack_probe());
    CHECK(!mg_arena_owns(NULL));
    CHECK(!mg_arena_owns((void *)(uintptr_t)page));
    CHECK(!mg_arena_owns((void *)UINTPTR_MAX));
    free(heap);
    free(big_heap);
    for (int i = 0; i < 3; i++)
        mg_arena_free(arena[i]);
    check_idle();
}

/* Allocate nb (2 or 3) blocks of (size, align), side by side when fresh,
 * fill each to its usable size (see next_word), and check that none
 * overwrote another, that usable size and alignment are as documented and
 * that the counters moved by exactly these blocks. Returns the number of
 * failed checks. */
static int check_blocks(size_t size, size_t align, uint64_t seed, int nb)
{
    int before = mgt_failures;
    mg_arena_stats_t s0 = st();
    void *b[3] = {NULL, NULL, NULL};
    size_t want = usable_bytes(size, align);
    for (int i = 0; i < nb; i++) {
        CHECK_EQ(mg_arena_alloc(size, align, &b[i]), 0);
        if (!b[i])
            return mgt_failures - before;
        size_t u = mg_arena_usable_size(b[i]);
        CHECK_EQ(u, want);
        CHECK(u >= size);
        size_t al = align > 64 ? align : 64;
        if (size <= 512 && align <= 64)
            CHECK(u < size + 64);
        else if (size <= 300 * KiB && align <= 64)
            CHECK(u <= size + size / 4);
        else /* 25 % of size and header (the alignment), rounded to pages */
            CHECK(u <= size + (size + al) / 4 + page);
        CHECK_EQ((uintptr_t)b[i] % al, 0);
        CHECK(mg_arena_owns(b[i]));
    }
    mg_arena_stats_t s1 = st();
    CHECK_EQ(s1.allocated_current - s0.allocated_current, (size_t)nb * block_bytes(size, align));
    CHECK_EQ(s1.requested_current - s0.requested_current, (size_t)nb * (size ? size : 1));
    CHECK_EQ(s1.num_allocs - s0.num_allocs, nb);
    for (int i = 0; i < nb; i++)
        fill(b[i], want, seed + (uint64_t)i);
    for (int i = 0; i < nb; i++)
        CHECK(intact(b[i], want, seed + (uint64_t)i));
    /* free in a varying order, so reuse does not always see the same list */
    int order = (int)(seed % (uint64_t)nb);
    for (int i = 0; i < nb; i++)
        mg_arena_free(b[(i + order) % nb]);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(s2.allocated_current, s0.allocated_current);
    CHECK_EQ(s2.requested_current, s0.requested_current);
    CHECK_EQ(s2.num_frees - s0.num_frees, nb);
    return mgt_failures - before;
}

static int check_size(size_t size, size_t align, uint64_t seed)
{
    return check_blocks(size, align, seed, 3);
}

static void test_small_sizes(void)
{
    static const size_t aligns[] = {1, 8, 16, 32, 64};
    uint64_t seed = 1;
    int bad = 0;
    size_t tried = 0;
    /* every size up to 4 KiB (every third when slow), then steps of 1/128 */
    for (size_t n = 1; n <= 300 * KiB && bad < 5; tried++) {
        if (check_size(n, aligns[tried % 5], seed++)) {
            printf("  size %zu failed\n", n);
            bad++;
        }
        size_t step = n < 4 * KiB ? (slow ? 3 : 1) : n / (slow ? 32 : 128);
        n += step;
    }
    /* each class boundary, one either side, and the small/large switch */
    for (size_t c = 64; c <= 512 * KiB && bad < 5; c = class_up(c + 1))
        for (size_t n = c - 1; n <= c + 1; n++, tried++)
            if (check_size(n, aligns[tried % 5], seed++)) {
                printf("  size %zu failed\n", n);
                bad++;
            }
    printf("  %zu sizes\n", tried);
    /* blocks of every class at once: slabs of different classes do not mix */
    void *all[64];
    size_t sizes[64], k = 0;
    for (size_t c = 64; c <= SMALL_MAX && k < 64; c = class_up(c + 1), k++) {
        sizes[k] = c;
        all[k] = NULL;
        CHECK_EQ(mg_arena_alloc(c, 64, &all[k]), 0);
        if (all[k])
            fill(all[k], c, 1000 + k);
    }
    CHECK_EQ(k, 44); /* 8 up to 512 B, then 4 per doubling to 256 KiB */
    for (size_t i = 0; i < k; i++)
        if (all[i]) {
            CHECK_EQ(mg_arena_usable_size(all[i]), sizes[i]);
            CHECK(intact(all[i], sizes[i], 1000 + i));
            mg_arena_free(all[i]);
        }
    check_idle();
}

static void test_large_sizes(void)
{
    static const size_t sizes[] = {
        MiB - 1, MiB, MiB + 1, 3 * MiB / 2, 2 * MiB - 64, 2 * MiB, 3 * MiB + 17, 4 * MiB,
        5 * MiB + 1, 7 * MiB, 8 * MiB, 12 * MiB + 3, 16 * MiB, 30 * MiB, 32 * MiB + 1,
        64 * MiB, 100 * MiB, 256 * MiB,
    };
    uint64_t seed = 7;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        if (slow && i % 3 != 0 && sizes[i] != 256 * MiB)
            continue;
        if (check_blocks(sizes[i], 64, seed++, sizes[i] < 16 * MiB ? 3 : 2))
            printf("  size %zu failed\n", sizes[i]);
        /* give the touched pages back so the run stays small */
        mg_arena_trim(0, NULL);
        CHECK_EQ(st().cached_bytes, 0);
    }
    check_idle();
}

static void test_alignment(void)
{
    static const size_t sizes[] = {1, 1000, 100 * KiB, 3 * MiB + 5};
    uint64_t seed = 100;
    for (size_t a = 128; a <= 2 * MiB; a *= 2)
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
            if (check_size(sizes[i], a, seed++))
                printf("  size %zu align %zu failed\n", sizes[i], a);
    /* fresh blocks land aligned wherever the carving point stands */
    void *odd = NULL, *p[4] = {NULL};
    CHECK_EQ(mg_arena_alloc(5 * MiB + 4096 * 3, 64, &odd), 0);
    for (int i = 0; i < 4; i++) {
        size_t a = (size_t)8192 << (i * 2);
        CHECK_EQ(mg_arena_alloc(7 * MiB + 3, a, &p[i]), 0);
        CHECK_EQ((uintptr_t)p[i] % a, 0);
    }
    for (int i = 0; i < 4; i++)
        mg_arena_free(p[i]);
    mg_arena_free(odd);
    mg_arena_trim(0, NULL);

    /* a cached block reused under another alignment: the header moves */
    void *b = NULL, *c = NULL;
    CHECK_EQ(mg_arena_alloc(MiB, 64, &b), 0);
    mg_arena_stats_t s0 = st();
    mg_arena_free(b);
    size_t other = MiB + HDR - 4096; /* same class with a 4096-byte offset */
    CHECK_EQ(block_bytes(other, 4096), block_bytes(MiB, 64));
    CHECK_EQ(mg_arena_alloc(other, 4096, &c), 0);
    CHECK_EQ(st().num_cache_hits - s0.num_cache_hits, 1);
    CHECK_EQ((uintptr_t)c % 4096, 0);
    CHECK_EQ((char *)c - (char *)b, 4096 - HDR); /* the same block */
    CHECK_EQ(mg_arena_usable_size(c), usable_bytes(other, 4096));
    CHECK_EQ(st().reserved_current, s0.reserved_current);
    CHECK_EQ(st().allocated_current, s0.allocated_current);
    CHECK_EQ(st().requested_current, s0.requested_current - MiB + other);
    fill(c, mg_arena_usable_size(c), 3);
    CHECK(intact(c, mg_arena_usable_size(c), 3));
    mg_arena_free(c);
    check_idle();

    /* a 2 MiB-aligned block keeps its header past the first page: trimming
     * must keep that page, and the released block must come back whole */
    mg_arena_trim(0, NULL);
    s0 = st();
    size_t bs = block_bytes(MiB, 2 * MiB);
    CHECK_EQ(mg_arena_alloc(MiB, 2 * MiB, &b), 0);
    CHECK_EQ(st().reserved_current - s0.reserved_current, bs);
    uint64_t hits0 = st().num_cache_hits; /* b itself may have been a hit */
    fill(b, MiB, 5);
    mg_arena_free(b);
    CHECK_EQ(st().cached_bytes, bs);
    uint64_t freed = 0;
    CHECK_EQ(mg_arena_trim(0, &freed), 0);
    CHECK_EQ(freed, bs);
    CHECK_EQ(st().cached_bytes, 0);
    CHECK_EQ(st().reserved_current, s0.reserved_current);
    for (int round = 0; round < 2; round++) {
        CHECK_EQ(mg_arena_alloc(MiB, 2 * MiB, &c), 0);
        CHECK(c == b); /* the released block, reused */
        CHECK_EQ(mg_arena_usable_size(c), usable_bytes(MiB, 2 * MiB));
        CHECK_EQ(st().reserved_current - s0.reserved_current, bs);
        CHECK_EQ(st().allocated_current - s0.allocated_current, bs);
        mg_arena_free(c);
        CHECK_EQ(mg_arena_trim(0, &freed), 0);
        CHECK_EQ(freed, bs);
    }
    CHECK_EQ(st().num_cache_hits - hits0, 2);
    mg_arena_trim(0, NULL);
    check_idle();
}

static void test_accounting(void)
{
    static const struct {
        size_t size, align;
    } req[] = {
        {1, 1}, {63, 8}, {64, 64}, {65, 16}, {513, 64}, {4000, 64}, {70000, 64},
        {SMALL_MAX, 64}, {SMALL_MAX + 1, 64}, {100, 128}, {5000, 4096},
        {MiB + 7, 64}, {9 * MiB, 64}, {300 * KiB, 2 * MiB},
    };
    enum { N = sizeof(req) / sizeof(req[0]) };
    void *p[N];
    mg_arena_reset_peaks();
    mg_arena_stats_t s0 = st();
    CHECK_EQ(s0.allocated_peak, s0.allocated_current);
    CHECK_EQ(s0.requested_peak, s0.requested_current);
    CHECK_EQ(s0.reserved_peak, s0.reserved_current);
    uint64_t blocks = 0, asked = 0, peak_blocks = 0, peak_asked = 0;
    for (int i = 0; i < N; i++) {
        CHECK_EQ(mg_arena_alloc(req[i].size, req[i].align, &p[i]), 0);
        blocks += block_bytes(req[i].size, req[i].align);
        asked += req[i].size;
        mg_arena_stats_t s = st();
        CHECK_EQ(s.allocated_current, s0.allocated_current + blocks);
        CHECK_EQ(s.active_current, s.allocated_current);
        CHECK_EQ(s.requested_current, s0.requested_current + asked);
        CHECK_EQ(s.allocated_peak, s.allocated_current);
        CHECK_EQ(s.requested_peak, s.requested_current);
        CHECK(s.reserved_current >= s.allocated_current + s.cached_bytes);
        CHECK(s.reserved_peak >= s.reserved_current);
    }
    peak_blocks = blocks;
    peak_asked = asked;
    CHECK_EQ(st().num_allocs - s0.num_allocs, N);
    /* free every other one: current drops, the peaks stay */
    for (int i = 0; i < N; i += 2) {
        mg_arena_free(p[i]);
        blocks -= block_bytes(req[i].size, req[i].align);
        asked -= req[i].size;
    }
    mg_arena_stats_t s1 = st();
    CHECK_EQ(s1.allocated_current, s0.allocated_current + blocks);
    CHECK_EQ(s1.requested_current, s0.requested_current + asked);
    CHECK_EQ(s1.allocated_peak, s0.allocated_current + peak_blocks);
    CHECK_EQ(s1.requested_peak, s0.requested_current + peak_asked);
    CHECK_EQ(s1.active_peak, s1.allocated_peak);
    CHECK_EQ(s1.num_frees - s0.num_frees, (N + 1) / 2);
    /* a reset brings the peaks down to now; a new high raises them again */
    mg_arena_reset_peaks();
    CHECK_EQ(st().allocated_peak, s1.allocated_current);
    CHECK_EQ(st().requested_peak, s1.requested_current);
    CHECK_EQ(st().reserved_peak, s1.reserved_current);
    void *extra = NULL;
    CHECK_EQ(mg_arena_alloc(2000, 64, &extra), 0);
    CHECK_EQ(st().allocated_peak, s1.allocated_current + 2048);
    CHECK_EQ(st().requested_peak, s1.requested_current + 2000);
    mg_arena_free(extra);
    CHECK_EQ(st().allocated_peak, s1.allocated_current + 2048);
    for (int i = 1; i < N; i += 2)
        mg_arena_free(p[i]);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(s2.allocated_current, s0.allocated_current);
    CHECK_EQ(s2.requested_current, s0.requested_current);
    CHECK_EQ(s2.num_allocs - s0.num_allocs, N + 1);
    CHECK_EQ(s2.num_frees - s0.num_frees, N + 1);
    CHECK_EQ(s2.num_ooms, s0.num_ooms);
    check_idle();
}

/* Forward allocates activations in order, backward frees them in reverse,
 * the optimizer step makes and drops a temporary: the same sizes every
 * step, as in training. */
static void test_caching(void)
{
    static const size_t sizes[] = {
        64, 1000, 4096, 70000, SMALL_MAX, 300 * KiB, MiB, 4 * MiB + 123, 16 * MiB - 7, MiB,
        2 * MiB + 1,
    };
    enum { N = sizeof(sizes) / sizeof(sizes[0]) };
    void *p[N];
    mg_arena_trim(0, NULL);
    /* alloc, free, alloc: the second comes from the cache, same block */
    mg_arena_stats_t s0 = st();
    void *a = NULL, *b = NULL;
    CHECK_EQ(mg_arena_alloc(3 * MiB, 64, &a), 0);
    mg_arena_stats_t sa = st(); /* a may itself be a released block, reused */
    CHECK_EQ(sa.reserved_current - s0.reserved_current, block_bytes(3 * MiB, 64));
    mg_arena_free(a);
    CHECK_EQ(st().cached_bytes, block_bytes(3 * MiB, 64));
    CHECK_EQ(mg_arena_alloc(3 * MiB, 64, &b), 0);
    CHECK(a == b);
    CHECK_EQ(st().num_cache_hits - sa.num_cache_hits, 1);
    CHECK_EQ(st().cached_bytes, 0);
    CHECK_EQ(st().reserved_current, sa.reserved_current);
    mg_arena_free(b);

    int steps = slow ? 50 : 1000;
    uint64_t reserved = 0, cached = 0;
    for (int step = 0; step <= steps; step++) {
        mg_arena_stats_t before = st();
        for (int i = 0; i < N; i++) {
            CHECK_EQ(mg_arena_alloc(sizes[i], 64, &p[i]), 0);
            *(volatile char *)p[i] = (char)step;
        }
        void *tmp = NULL;
        CHECK_EQ(mg_arena_alloc(8 * MiB, 64, &tmp), 0);
        mg_arena_free(tmp);
        for (int i = N - 1; i >= 0; i--)
            mg_arena_free(p[i]);
        mg_arena_stats_t after = st();
        CHECK_EQ(after.num_allocs - before.num_allocs, N + 1);
        CHECK_EQ(after.num_frees - before.num_frees, N + 1);
        CHECK_EQ(after.allocated_current, 0);
        if (step == 0) { /* warm-up: what the steady state holds */
            reserved = after.reserved_current;
            cached = after.cached_bytes;
            continue;
        }
        CHECK_EQ(after.num_cache_hits - before.num_cache_hits, N + 1);
        CHECK_EQ(after.reserved_current, reserved);
        CHECK_EQ(after.reserved_peak, before.reserved_peak);
        CHECK_EQ(after.cached_bytes, cached);
        if (mgt_failures)
            break;
    }
    check_idle();
}

static void test_trim(void)
{
    mg_arena_trim(0, NULL);
    mg_arena_stats_t s0 = st();
    CHECK_EQ(s0.cached_bytes, 0);
    static const struct {
        size_t size, align;
    } req[] = {{64 * MiB, 64}, {5 * MiB, 64}, {300 * KiB, 64}, {MiB, 2 * MiB}, {100, 4096}};
    enum { N = sizeof(req) / sizeof(req[0]) };
    void *p[N];
    uint64_t blocks = 0;
    uint64_t rss0 = rss_bytes();
    for (int i = 0; i < N; i++) {
        CHECK_EQ(mg_arena_alloc(req[i].size, req[i].align, &p[i]), 0);
        blocks += block_bytes(req[i].size, req[i].align);
    }
    memset(p[0], 0x5a, 64 * MiB); /* resident now */
    uint64_t rss1 = rss_bytes();
    CHECK(rss1 >= rss0 + 60 * MiB);
    for (int i = 0; i < N; i++)
        mg_arena_free(p[i]);
    mg_arena_stats_t s1 = st();
    CHECK_EQ(s1.cached_bytes, blocks);
    CHECK_EQ(s1.reserved_current, s0.reserved_current + blocks);
    CHECK(rss_bytes() >= rss0 + 60 * MiB); /* cached blocks stay resident */
    uint64_t freed = 0;
    CHECK_EQ(mg_arena_trim(0, &freed), 0);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(freed, s1.cached_bytes);
    CHECK_EQ(s2.cached_bytes, 0);
    CHECK_EQ(s2.reserved_current, s0.reserved_current);
    CHECK_EQ(s2.num_trims - s1.num_trims, 1);
    CHECK_EQ(s2.trimmed_bytes - s1.trimmed_bytes, freed);
    uint64_t rss2 = rss_bytes();
    printf("  rss %llu -> %llu -> %llu KiB\n", (unsigned long long)(rss0 >> 10),
           (unsigned long long)(rss1 >> 10), (unsigned long long)(rss2 >> 10));
    CHECK(rss2 + 60 * MiB <= rss1);
    /* nothing left to give back: no trim counted */
    CHECK_EQ(mg_arena_trim(0, &freed), 0);
    CHECK_EQ(freed, 0);
    CHECK_EQ(st().num_trims, s2.num_trims);
    /* a released block is reused and counted as reserved again */
    void *again = NULL;
    CHECK_EQ(mg_arena_alloc(64 * MiB, 64, &again), 0);
    CHECK(again == p[0]);
    CHECK_EQ(st().num_cache_hits - s2.num_cache_hits, 1);
    CHECK_EQ(st().reserved_current, s0.reserved_current + block_bytes(64 * MiB, 64));
    mg_arena_free(again);

    /* trim to a size: what stays cached is at most keep; the rest is freed */
    mg_arena_trim(0, NULL);
    static const size_t three[] = {4 * MiB, 8 * MiB, 16 * MiB};
    for (int i = 0; i < 3; i++)
        CHECK_EQ(mg_arena_alloc(three[i], 64, &p[i]), 0);
    for (int i = 0; i < 3; i++)
        mg_arena_free(p[i]);
    mg_arena_stats_t s3 = st();
    CHECK_EQ(s3.cached_bytes, block_bytes(4 * MiB, 64) + block_bytes(8 * MiB, 64) +
                                  block_bytes(16 * MiB, 64));
    CHECK_EQ(mg_arena_trim(10 * MiB, &freed), 0);
    mg_arena_stats_t s4 = st();
    CHECK(s4.cached_bytes <= 10 * MiB);
    CHECK(s4.cached_bytes > 0);
    CHECK_EQ(s4.cached_bytes + freed, s3.cached_bytes);
    CHECK_EQ(s4.reserved_current + freed, s3.reserved_current);
    CHECK_EQ(s4.trimmed_bytes - s3.trimmed_bytes, freed);
    mg_arena_trim(0, NULL);
    CHECK_EQ(st().cached_bytes, 0);
    CHECK_EQ(st().reserved_current, s0.reserved_current);
    check_idle();
}

/* Decay counted in step boundaries: a block freed again at every boundary
 * (a training step's reuse) stays cached and resident; one not freed again
 * for `age` boundaries is given back; age 0 only counts; halves merged back
 * age like any block. */
static void test_decay(void)
{
    mg_arena_trim(0, NULL);
    mg_arena_stats_t s0 = st();
    uint64_t freed = 12345;
    CHECK_EQ(mg_arena_decay(0, &freed), 0);
    CHECK_EQ(freed, 0);
    CHECK_EQ(st().epoch, s0.epoch + 1);
    void *hot = NULL, *cold = NULL;
    CHECK_EQ(mg_arena_alloc(8 * MiB, 64, &hot), 0);
    CHECK_EQ(mg_arena_alloc(16 * MiB, 64, &cold), 0);
    memset(hot, 1, 8 * MiB);
    memset(cold, 2, 16 * MiB);
    mg_arena_free(cold); /* its size is not used again */
    mg_arena_free(hot);
    uint64_t hot_b = block_bytes(8 * MiB, 64), cold_b = block_bytes(16 * MiB, 64);
    CHECK_EQ(st().cached_bytes, hot_b + cold_b);
    /* two boundaries: both younger than age 3 */
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(mg_arena_alloc(8 * MiB, 64, &hot), 0); /* the step reuses it */
        mg_arena_free(hot);
        CHECK_EQ(mg_arena_decay(3, &freed), 0);
        CHECK_EQ(freed, 0);
    }
    uint64_t rss_before = rss_bytes();
    /* the third: the cold block was listed three boundaries ago */
    CHECK_EQ(mg_arena_alloc(8 * MiB, 64, &hot), 0);
    mg_arena_free(hot);
    mg_arena_stats_t s1 = st();
    CHECK_EQ(mg_arena_decay(3, &freed), 0);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(freed, cold_b);
    CHECK_EQ(s2.cached_bytes, hot_b);
    CHECK_EQ(s2.reserved_current, s1.reserved_current - cold_b);
    CHECK_EQ(s2.decayed_bytes - s1.decayed_bytes, cold_b);
    CHECK_EQ(s2.trimmed_bytes - s1.trimmed_bytes, cold_b);
    CHECK(rss_bytes() + 15 * MiB <= rss_before); /* its pages went back */
    /* the hot one stays while reused, and goes at the third boundary after
     * the steps stop using it (the first was the one above) */
    CHECK_EQ(mg_arena_decay(3, &freed), 0);
    CHECK_EQ(freed, 0);
    CHECK_EQ(mg_arena_decay(3, &freed), 0);
    CHECK_EQ(freed, hot_b);
    CHECK_EQ(st().cached_bytes, 0);
    /* a released block is not released twice; reused, it is young again */
    CHECK_EQ(mg_arena_decay(1, &freed), 0);
    CHECK_EQ(freed, 0);
    CHECK_EQ(mg_arena_alloc(16 * MiB, 64, &cold), 0);
    CHECK(cold != NULL);
    mg_arena_free(cold);
    CHECK_EQ(st().cached_bytes, cold_b);
    CHECK_EQ(mg_arena_decay(1, &freed), 0);
    CHECK_EQ(freed, cold_b);
    /* halves: split under a budget, merged on free, then aged as one */
    void *big = NULL, *half = NULL;
    CHECK_EQ(mg_arena_alloc(32 * MiB - HDR, 64, &big), 0);
    mg_arena_free(big);
    mg_arena_stats_t s3 = st();
    mg_arena_set_budget(s3.reserved_current); /* nothing new fits: halves */
    CHECK_EQ(mg_arena_alloc(16 * MiB - HDR, 64, &half), 0);
    CHECK_EQ(st().reserved_current, s3.reserved_current);
    mg_arena_free(half); /* merges back with its listed buddy */
    CHECK_EQ(st().cached_bytes, s3.cached_bytes);
    CHECK_EQ(mg_arena_decay(1, &freed), 0);
    CHECK_EQ(freed, block_bytes(32 * MiB - HDR, 64));
    mg_arena_set_budget(0);
    CHECK_EQ(st().cached_bytes, 0);
    check_idle();
}

/* Under a budget, a large class with nothing cached takes half of a cached
 * block of twice its size (no release, no new pages); halves merge back
 * with their buddy when both are free, also two levels down; a released
 * half does not merge; with no budget, classes keep to their own blocks. */
static void test_split_merge(void)
{
    mg_arena_trim(0, NULL);
    const size_t big = 8 * MiB - HDR, half = 4 * MiB - HDR, quarter = 2 * MiB - HDR;
    CHECK_EQ(block_bytes(big, 64), 8 * MiB);
    CHECK_EQ(block_bytes(half, 64), 4 * MiB);
    CHECK_EQ(block_bytes(quarter, 64), 2 * MiB);

    /* no budget: a half is a block of its own */
    void *b = NULL, *h1 = NULL, *h2 = NULL, *q1 = NULL, *q2 = NULL, *x = NULL;
    CHECK_EQ(mg_arena_alloc(big, 64, &b), 0);
    mg_arena_free(b);
    CHECK_EQ(mg_arena_alloc(half, 64, &h1), 0);
    CHECK(h1 != b);
    CHECK_EQ(st().cached_bytes, 8 * MiB);
    mg_arena_free(h1);
    mg_arena_trim(0, NULL);
    /* (the trim released both; b's block is the one reused below) */
    CHECK_EQ(mg_arena_alloc(big, 64, &b), 0);
    mg_arena_free(b);
    mg_arena_stats_t s0 = st();
    CHECK_EQ(s0.cached_bytes, 8 * MiB);
    mg_arena_set_budget(s0.reserved_current); /* nothing new fits */

    CHECK_EQ(mg_arena_alloc(half, 64, &h1), 0);
    CHECK_EQ(mg_arena_alloc(half, 64, &h2), 0);
    CHECK(h1 == b);
    CHECK((char *)h2 == (char *)b + 4 * MiB);
    mg_arena_stats_t s1 = st();
    CHECK_EQ(s1.num_cache_hits - s0.num_cache_hits, 2);
    CHECK_EQ(s1.num_trims, s0.num_trims);
    CHECK_EQ(s1.reserved_current, s0.reserved_current);
    CHECK_EQ(s1.allocated_current - s0.allocated_current, 8 * MiB);
    CHECK_EQ(s1.requested_current - s0.requested_current, 2 * half);
    CHECK_EQ(s1.cached_bytes, 0);
    CHECK_EQ(mg_arena_usable_size(h1), half);
    fill(h1, half, 11);
    fill(h2, half, 12);
    CHECK(intact(h1, half, 11));
    CHECK(intact(h2, half, 12));

    /* one half free: no merge, and the whole size does not fit */
    mg_arena_free(h1);
    CHECK_EQ(st().cached_bytes, 4 * MiB);
    CHECK_EQ(mg_arena_alloc(big, 64, &x), ENOMEM);
    CHECK(intact(h2, half, 12));
    CHECK_EQ(st().num_trims, s0.num_trims);

    /* a quarter splits the cached half; freed in any order, all merges */
    CHECK_EQ(mg_arena_alloc(quarter, 64, &q1), 0);
    CHECK_EQ(mg_arena_alloc(quarter, 64, &q2), 0);
    CHECK(q1 == b);
    CHECK((char *)q2 == (char *)b + 2 * MiB);
    fill(q1, quarter, 13);
    fill(q2, quarter, 14);
    CHECK(intact(h2, half, 12));
    CHECK_EQ(st().reserved_current, s0.reserved_current);
    mg_arena_free(q2);
    mg_arena_free(h2);
    CHECK_EQ(st().cached_bytes, 6 * MiB);
    CHECK(intact(q1, quarter, 13));
    mg_arena_free(q1);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(s2.cached_bytes, 8 * MiB);
    CHECK_EQ(s2.allocated_current, s0.allocated_current);
    CHECK_EQ(s2.requested_current, s0.requested_current);
    CHECK_EQ(mg_arena_alloc(big, 64, &x), 0);
    CHECK(x == b);
    CHECK_EQ(st().num_cache_hits - s2.num_cache_hits, 1);
    CHECK_EQ(st().num_trims, s0.num_trims);
    CHECK_EQ(mg_arena_usable_size(x), big);
    mg_arena_free(x);

    /* a half given back to the kernel does not merge */
    CHECK_EQ(mg_arena_alloc(half, 64, &h1), 0);
    CHECK_EQ(mg_arena_alloc(half, 64, &h2), 0);
    mg_arena_free(h2);
    mg_arena_trim(0, NULL);
    mg_arena_free(h1);
    mg_arena_stats_t s3 = st();
    CHECK_EQ(s3.cached_bytes, 4 * MiB);
    CHECK_EQ(s3.reserved_current, s0.reserved_current - 4 * MiB);
    /* the whole size now takes the room of both: h1 released, a new block */
    CHECK_EQ(mg_arena_alloc(big, 64, &x), 0);
    CHECK(x != b);
    CHECK_EQ(st().cached_bytes, 0);
    CHECK_EQ(st().reserved_current, s0.reserved_current);
    mg_arena_free(x);
    mg_arena_set_budget(0);
    mg_arena_trim(0, NULL);
    check_idle();
}

static void test_budget(void)
{
    mg_arena_trim(0, NULL);
    mg_arena_stats_t s0 = st();
    uint64_t r0 = s0.reserved_current; /* slab chunks only */
    uint64_t budget = r0 + 64 * MiB;
    const size_t m40 = 40 * MiB - HDR, m16 = 16 * MiB - HDR, m48 = 48 * MiB - HDR;
    CHECK_EQ(block_bytes(m40, 64), 40 * MiB);
    CHECK_EQ(block_bytes(m16, 64), 16 * MiB);
    CHECK_EQ(block_bytes(m48, 64), 48 * MiB);
    mg_arena_set_budget(budget);
    CHECK_EQ(st().budget_bytes, budget);
    mg_arena_reset_peaks();

    void *a = NULL, *b = NULL, *c = NULL, *d = NULL, *x = NULL;
    CHECK_EQ(mg_arena_alloc(m40, 64, &a), 0);
    CHECK_EQ(st().reserved_current, r0 + 40 * MiB);
    /* a second one would pass the budget: refused, nothing reserved */
    CHECK_EQ(mg_arena_alloc(m40, 64, &b), ENOMEM);
    CHECK(b == NULL);
    mg_arena_stats_t s1 = st();
    CHECK_EQ(s1.num_ooms - s0.num_ooms, 1);
    CHECK_EQ(s1.last_oom_bytes, m40); /* the request that crossed the budget */
    CHECK_EQ(s1.reserved_current, r0 + 40 * MiB);
    CHECK_EQ(s1.allocated_current, 40 * MiB);
    CHECK_EQ(s1.num_trims, s0.num_trims); /* there was no cache to release */
    /* a smaller one that fits still does */
    CHECK_EQ(mg_arena_alloc(m16, 64, &c), 0);
    CHECK_EQ(st().reserved_current, r0 + 56 * MiB);
    CHECK_EQ(mg_arena_alloc(m16, 64, &d), ENOMEM);
    CHECK_EQ(st().num_ooms - s0.num_ooms, 2);
    /* up to the budget exactly is allowed */
    CHECK_EQ(mg_arena_alloc(8 * MiB - HDR, 64, &d), 0);
    CHECK_EQ(st().reserved_current, budget);
    mg_arena_free(d);
    mg_arena_free(c);
    mg_arena_free(a);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(s2.cached_bytes, 64 * MiB);
    CHECK_EQ(s2.reserved_current, budget);

    /* larger than the whole budget: refused, and the cache stays */
    CHECK_EQ(mg_arena_alloc(budget + MiB, 64, &x), ENOMEM);
    CHECK_EQ(st().cached_bytes, 64 * MiB);
    CHECK_EQ(st().num_trims, s2.num_trims);

    /* a new size does not fit beside the cache: the largest cached blocks
     * go first, only as many as make room (40 MiB, then 16: 48 needed) */
    CHECK_EQ(mg_arena_alloc(m48, 64, &x), 0);
    mg_arena_stats_t s3 = st();
    CHECK_EQ(s3.num_trims - s2.num_trims, 1);
    CHECK_EQ(s3.trimmed_bytes - s2.trimmed_bytes, 56 * MiB);
    CHECK_EQ(s3.cached_bytes, 8 * MiB);
    CHECK_EQ(s3.reserved_current, r0 + 56 * MiB);
    CHECK_EQ(s3.num_ooms, s2.num_ooms + 1); /* the one refused above */
    CHECK(s3.reserved_peak <= budget);
    /* more than the allocated blocks leave room for, even with the cache
     * released (32 MiB needed, 8 cached): refused without releasing it */
    CHECK_EQ(mg_arena_alloc(m40, 64, &c), ENOMEM);
    CHECK_EQ(st().cached_bytes, 8 * MiB);
    CHECK_EQ(st().num_trims, s3.num_trims);
    mg_arena_free(x);

    /* a lower budget releases the cache past it at once, the largest first */
    budget = r0 + 16 * MiB;
    mg_arena_set_budget(budget);
    mg_arena_stats_t s4 = st();
    CHECK_EQ(s4.cached_bytes, 8 * MiB);
    CHECK_EQ(s4.reserved_current, r0 + 8 * MiB);
    CHECK_EQ(s4.num_trims - s3.num_trims, 1);
    /* the released 48 MiB block cannot come back under it */
    CHECK_EQ(mg_arena_alloc(m48, 64, &x), ENOMEM);
    CHECK_EQ(st().reserved_current, r0 + 8 * MiB);
    /* a 16 MiB one can, once the 8 MiB left cached makes room */
    CHECK_EQ(mg_arena_alloc(m16, 64, &c), 0);
    CHECK_EQ(st().cached_bytes, 0);
    CHECK_EQ(st().reserved_current, budget);
    CHECK_EQ(mg_arena_alloc(MiB, 64, &d), ENOMEM);
    /* small blocks in a slab chunk that has room need no new reservation */
    void *s = NULL;
    CHECK_EQ(mg_arena_alloc(100, 64, &s), 0);
    CHECK_EQ(st().reserved_current, budget);
    mg_arena_free(s);
    mg_arena_free(c);
    CHECK_EQ(st().num_ooms - s0.num_ooms, 6);

    /* a budget below what is reserved and not cached: nothing new fits */
    mg_arena_set_budget(r0 / 2 ? r0 / 2 : 1);
    mg_arena_stats_t s5 = st();
    CHECK_EQ(mg_arena_alloc(m16, 64, &c), ENOMEM);
    CHECK_EQ(st().reserved_current, s5.reserved_current);
    CHECK(st().reserved_current <= r0 + 16 * MiB);

    /* small blocks: a class out of room takes a whole 2 MiB slab chunk,
     * which the budget counts like any other reservation */
    mg_arena_trim(0, NULL);
    uint64_t r = st().reserved_current;
    mg_arena_set_budget(r);
    enum { MAXB = 80 };
    void *sb[MAXB];
    int got = 0, rc = 0;
    while (got < MAXB && (rc = mg_arena_alloc(SMALL_MAX, 64, &sb[got])) == 0)
        got++; /* cached blocks of the class, then the rest of its chunk */
    CHECK_EQ(rc, ENOMEM);
    CHECK_EQ(st().reserved_current, r);
    mg_arena_set_budget(r + 2 * MiB);
    int more = 0;
    while (got < MAXB && (rc = mg_arena_alloc(SMALL_MAX, 64, &sb[got])) == 0) {
        got++;
        more++;
    }
    CHECK_EQ(rc, ENOMEM);
    CHECK_EQ(more, 2 * MiB / SMALL_MAX); /* one new chunk, filled exactly */
    CHECK_EQ(st().reserved_current, r + 2 * MiB);
    for (int i = 0; i < got; i++)
        mg_arena_free(sb[i]);
    CHECK_EQ(st().reserved_current, r + 2 * MiB); /* slab chunks are kept */

    mg_arena_set_budget(0);
    CHECK_EQ(st().budget_bytes, 0);
    CHECK_EQ(mg_arena_alloc(m48, 64, &x), 0); /* no budget: fine again */
    mg_arena_free(x);
    mg_arena_trim(0, NULL);
    check_idle();
}

/* Requests that can never fit fail cleanly, leaving every counter but
 * num_ooms where it was. */
static void test_huge_requests(void)
{
    mg_arena_stats_t s0 = st();
    /* a live large block, so the large range is not empty */
    void *live = NULL;
    CHECK_EQ(mg_arena_alloc(MiB, 64, &live), 0);
    mg_arena_stats_t s1 = st();
    uint64_t range = s0.reserve_bytes / 4 * 3; /* what large blocks may take */
    static const size_t aligns[] = {1, 64, 4096, 2 * MiB};
    size_t huge[] = {
        SIZE_MAX, SIZE_MAX - 4096, SIZE_MAX / 2, (size_t)1 << 62, (size_t)s0.reserve_bytes,
        (size_t)range, (size_t)range - HDR, (size_t)range - 2 * MiB,
    };
    int n = 0;
    for (size_t i = 0; i < sizeof(huge) / sizeof(huge[0]); i++)
        for (size_t j = 0; j < sizeof(aligns) / sizeof(aligns[0]); j++) {
            void *p = NULL;
            int rc = mg_arena_alloc(huge[i], aligns[j], &p);
            CHECK_EQ(rc, ENOMEM);
            if (rc == 0) {
                printf("  size %zu align %zu: got a block\n", huge[i], aligns[j]);
                mg_arena_free(p);
            }
            n++;
            mg_arena_stats_t s = st();
            CHECK_EQ(s.reserved_current, s1.reserved_current);
            CHECK_EQ(s.allocated_current, s1.allocated_current);
            CHECK_EQ(s.requested_current, s1.requested_current);
        }
    CHECK_EQ(st().num_ooms - s1.num_ooms, n);
    CHECK_EQ(st().num_allocs, s1.num_allocs);
    /* the arena still works afterwards */
    void *p = NULL;
    CHECK_EQ(mg_arena_alloc(2 * MiB, 64, &p), 0);
    mg_arena_free(p);
    mg_arena_free(live);
    mg_arena_trim(0, NULL);
    check_idle();
}

/* ---- threads ------------------------------------------------------------ */

typedef size_t size_fn(uint64_t *rng, size_t *align);

/* A churning thread: it holds up to `slots` blocks of sizes drawn by `size`
 * (random_size when NULL), freeing or allocating one at a time. */
typedef struct worker {
    pthread_t tid;
    uint64_t rng;
    size_fn *size;
    unsigned slots;
    uint64_t allocs, ooms, errors, corrupt;
    atomic_int *stop;
} worker_t;

static uint64_t next_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* Mostly small blocks, some medium and a few large, at mixed alignments. */
static size_t random_size(uint64_t *rng, size_t *align)
{
    uint64_t r = next_rand(rng);
    static const size_t aligns[] = {1, 16, 64, 64, 64, 256, 4096, 64};
    *align = aligns[(r >> 8) % 8];
    switch (r % 20) {
    case 0: return 2 * MiB + (size_t)(r >> 20) % (10 * MiB);
    case 1: case 2: case 3: case 4: return SMALL_MAX + (size_t)(r >> 20) % (2 * MiB);
    default: return 1 + (size_t)(r >> 20) % (64 * KiB);
    }
}

/* A tag at both ends of a block, unique to its owner and allocation. */
static void tag(void *p, size_t n, uint64_t t)
{
    memcpy(p, &t, 8);
    memcpy((char *)p + n - 8, &t, 8);
}

static int tagged(const void *p, size_t n, uint64_t t)
{
    uint64_t a, b;
    memcpy(&a, p, 8);
    memcpy(&b, (const char *)p + n - 8, 8);
    return a == t && b == t;
}

enum { SLOTS = 24 };

static void *churn(void *arg)
{
    worker_t *w = arg;
    void *slot[SLOTS] = {NULL};
    uint64_t tags[SLOTS] = {0};
    size_fn *size = w->size ? w->size : random_size;
    unsigned slots = w->slots && w->slots < SLOTS ? w->slots : SLOTS;
    while (!atomic_load_explicit(w->stop, memory_order_relaxed)) {
        unsigned i = (unsigned)(next_rand(&w->rng) % slots);
        if (slot[i]) {
            size_t u = mg_arena_usable_size(slot[i]);
            if (!tagged(slot[i], u, tags[i]))
                w->corrupt++;
            mg_arena_free(slot[i]);
            slot[i] = NULL;
            continue;
        }
        size_t align, n = size(&w->rng, &align);
        int rc = mg_arena_alloc(n, align, &slot[i]);
        if (rc == ENOMEM) {
            w->ooms++;
            slot[i] = NULL;
        } else if (rc != 0 || !slot[i] || (uintptr_t)slot[i] % align ||
                   mg_arena_usable_size(slot[i]) < n) {
            w->errors++;
            slot[i] = NULL;
        } else {
            w->allocs++;
            tags[i] = next_rand(&w->rng) | 1;
            tag(slot[i], mg_arena_usable_size(slot[i]), tags[i]);
        }
    }
    for (unsigned i = 0; i < slots; i++)
        if (slot[i]) {
            if (!tagged(slot[i], mg_arena_usable_size(slot[i]), tags[i]))
                w->corrupt++;
            mg_arena_free(slot[i]);
        }
    return NULL;
}

/* Join n workers; their counts, summed. */
static worker_t join_workers(worker_t *w, int n)
{
    worker_t sum = {0};
    for (int i = 0; i < n; i++) {
        pthread_join(w[i].tid, NULL);
        sum.allocs += w[i].allocs;
        sum.ooms += w[i].ooms;
        sum.errors += w[i].errors;
        sum.corrupt += w[i].corrupt;
    }
    return sum;
}

typedef struct watcher {
    pthread_t tid;
    uint64_t budget, max_seen, over, reads;
    int tree; /* watch the tree's total, not the process's reserved bytes */
    atomic_int *stop;
} watcher_t;

/* What the budget bounds: the tree's total, or this process's reserved bytes. */
static uint64_t held(const mg_arena_stats_t *s, int tree)
{
    return tree ? s->tree_reserved_bytes : s->reserved_current;
}

static void *watch(void *arg)
{
    watcher_t *w = arg;
    while (!atomic_load_explicit(w->stop, memory_order_relaxed)) {
        mg_arena_stats_t s;
        mg_arena_stats(&s);
        w->reads++;
        if (held(&s, w->tree) > w->max_seen)
            w->max_seen = held(&s, w->tree);
        if (held(&s, w->tree) > w->budget)
            w->over++;
        if (slow) /* valgrind runs one thread at a time: let the workers have it */
            sched_yield();
    }
    return NULL;
}

/* Four threads churning under a budget (the tree's with tree set) and a
 * reader watching that it is never passed. */
static void budget_race(int tree)
{
    enum { THREADS = 4 };
    mg_arena_trim(0, NULL);
    mg_arena_stats_t s0 = st();
    uint64_t budget = held(&s0, tree) + 48 * MiB;
    mg_arena_set_budget(budget);
    mg_arena_reset_peaks();
    atomic_int stop = 0;
    worker_t w[THREADS];
    watcher_t wt = {.budget = budget, .tree = tree, .stop = &stop};
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker_t){.rng = 0x1234567ULL * (uint64_t)(i + 1) + 99, .stop = &stop};
        CHECK_EQ(pthread_create(&w[i].tid, NULL, churn, &w[i]), 0);
    }
    CHECK_EQ(pthread_create(&wt.tid, NULL, watch, &wt), 0);
    int64_t t0 = mgi_clock_ns(CLOCK_MONOTONIC), run_ns = slow ? 500000000 : 1000000000;
    /* run the planned time, and on (up to 10 s) until the budget has refused
     * something: under valgrind the threads may be too slow to reach it */
    while (mgi_clock_ns(CLOCK_MONOTONIC) - t0 < run_ns ||
           (st().num_ooms == s0.num_ooms &&
            mgi_clock_ns(CLOCK_MONOTONIC) - t0 < 10 * (int64_t)1000000000)) {
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
        mg_arena_stats_t now = st();
        CHECK(held(&now, tree) <= budget);
    }
    atomic_store(&stop, 1);
    worker_t sum = join_workers(w, THREADS);
    pthread_join(wt.tid, NULL);
    mg_arena_stats_t s1 = st();
    printf("  %llu allocs, %llu refused, %llu reads, reserved up to %llu of %llu\n",
           (unsigned long long)sum.allocs, (unsigned long long)sum.ooms,
           (unsigned long long)wt.reads,
           (unsigned long long)wt.max_seen, (unsigned long long)budget);
    CHECK_EQ(sum.errors, 0);
    CHECK_EQ(sum.corrupt, 0);
    /* the budget was reached, so the test means something; valgrind runs the
     * threads one at a time, too slowly to promise it, and checks memory only */
    if (!slow) {
        CHECK(sum.allocs > 100);
        CHECK(sum.ooms > 0);
    }
    CHECK_EQ(wt.over, 0);
    CHECK(wt.max_seen <= budget);
    CHECK(s1.reserved_peak <= budget);
    CHECK(s1.reserved_current <= budget);
    CHECK_EQ(s1.allocated_current, s0.allocated_current);
    CHECK_EQ(s1.requested_current, s0.requested_current);
    CHECK_EQ(s1.num_allocs - s0.num_allocs, sum.allocs);
    CHECK_EQ(s1.num_frees - s0.num_frees, sum.allocs);
    CHECK_EQ(s1.num_ooms - s0.num_ooms, sum.ooms);
    /* everything is cache or free small blocks now: releasing the cache
     * leaves the small blocks carved, whole ones, within the budget */
    mg_arena_trim(0, NULL);
    mg_arena_stats_t s2 = st();
    CHECK_EQ(s2.cached_bytes, 0);
    CHECK_EQ((s2.reserved_current - s0.reserved_current) % 64, 0);
    CHECK(held(&s2, tree) <= budget);
    mg_arena_set_budget(0);
    check_idle();
}

static void test_budget_race(void)
{
    budget_race(0);
}

/* The pieces of an 8 MiB block: its halves, quarters and eighths. */
static size_t split_size(uint64_t *rng, size_t *align)
{
    static const size_t sizes[] = {4 * MiB - HDR, 2 * MiB - HDR, 1 * MiB - HDR};
    *align = 64;
    return sizes[next_rand(rng) % 3];
}

/* Threads splitting and merging the halves of one cached block: nothing new
 * fits under the budget, so every allocation is a half (or a half's half) of
 * it, split while other threads free the buddies of the blocks being split.
 * Under ThreadSanitizer this is where a header written under one class's
 * lock and read under another's shows up. */
static void test_split_race(void)
{
    enum { THREADS = 4 };
    const size_t big = 8 * MiB - HDR;
    mg_arena_trim(0, NULL);
    void *b = NULL;
    CHECK_EQ(mg_arena_alloc(big, 64, &b), 0);
    mg_arena_free(b);
    mg_arena_reset_peaks();
    mg_arena_stats_t s0 = st();
    CHECK_EQ(s0.cached_bytes, 8 * MiB);
    mg_arena_set_budget(s0.reserved_current); /* nothing new fits */
    atomic_int stop = 0;
    worker_t w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker_t){.rng = 0x9e3779b9ULL * (uint64_t)(i + 1) + 7, .size = split_size,
                          .slots = 3, .stop = &stop};
        CHECK_EQ(pthread_create(&w[i].tid, NULL, churn, &w[i]), 0);
    }
    struct timespec ts = {0, slow ? 200 * 1000 * 1000 : 400 * 1000 * 1000};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    worker_t sum = join_workers(w, THREADS);
    mg_arena_stats_t s1 = st();
    printf("  %llu halves, %llu refused\n", (unsigned long long)sum.allocs,
           (unsigned long long)sum.ooms);
    CHECK_EQ(sum.errors, 0);
    CHECK_EQ(sum.corrupt, 0);
    if (!slow)
        CHECK(sum.allocs > 100);
    printf("  %llu cache hits, %llu trims\n",
           (unsigned long long)(s1.num_cache_hits - s0.num_cache_hits),
           (unsigned long long)(s1.num_trims - s0.num_trims));
    /* no piece is lost or counted twice, and the budget held (a class with
     * nothing to split may release other classes' cache to make room) */
    CHECK(s1.reserved_peak <= s0.reserved_current);
    CHECK(s1.reserved_current <= s0.reserved_current);
    CHECK(s1.cached_bytes <= s1.reserved_current - s0.allocated_current);
    CHECK_EQ(s1.num_allocs - s0.num_allocs, sum.allocs);
    CHECK_EQ(s1.num_frees - s0.num_frees, sum.allocs);
    CHECK_EQ(s1.num_ooms - s0.num_ooms, sum.ooms);
    CHECK_EQ(s1.allocated_current, s0.allocated_current);
    CHECK_EQ(s1.requested_current, s0.requested_current);
    mg_arena_set_budget(0);
    mg_arena_trim(0, NULL);
    check_idle();
}

/* ---- fork --------------------------------------------------------------- */

/* In the child: the arena works, counters move exactly. 0 when all is well. */
static int child_main(void)
{
    int fails = 0;
    alarm(20); /* a lock left held would hang here: die instead */
    mg_arena_stats_t s0 = st();
    static const size_t sizes[] = {1, 100, 5000, 200 * KiB, 3 * MiB, 700 * KiB};
    void *p[6];
    uint64_t blocks = 0;
    for (int i = 0; i < 6; i++) {
        if (mg_arena_alloc(sizes[i], i == 5 ? 8192 : 64, &p[i]) != 0)
            return 1;
        blocks += block_bytes(sizes[i], i == 5 ? 8192 : 64);
        memset(p[i], i, sizes[i]);
    }
    mg_arena_stats_t s1 = st();
    fails += s1.allocated_current - s0.allocated_current != blocks;
    for (int i = 0; i < 6; i++)
        mg_arena_free(p[i]);
    fails += st().allocated_current != s0.allocated_current;
    fails += mg_arena_trim(0, NULL) != 0;
    fails += st().cached_bytes != 0;
    return fails;
}

static void test_fork(void)
{
    /* ThreadSanitizer cannot follow it: the prepare handler holds every
     * class lock at once, past the 64 its deadlock detector can track */
    if (getenv("MGTEST_SKIP_FORK")) {
        printf("skip test_fork: MGTEST_SKIP_FORK is set\n");
        return;
    }
    enum { THREADS = 2 };
    mg_arena_stats_t s0 = st();
    atomic_int stop = 0;
    worker_t w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker_t){.rng = 0xABCDEFULL * (uint64_t)(i + 3), .stop = &stop};
        CHECK_EQ(pthread_create(&w[i].tid, NULL, churn, &w[i]), 0);
    }
    int forks = slow ? 4 : 40;
    for (int k = 0; k < forks; k++) {
        fflush(stdout);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0)
            _exit(child_main() ? 1 : 0); /* no atexit handlers: the parent owns them */
        int status = 0;
        CHECK_EQ(waitpid(pid, &status, 0), pid);
        CHECK(WIFEXITED(status));
        if (WIFSIGNALED(status))
            printf("  child %d died of signal %d\n", k, WTERMSIG(status));
        CHECK_EQ(WEXITSTATUS(status), 0);
        if (mgt_failures)
            break;
    }
    atomic_store(&stop, 1);
    worker_t sum = join_workers(w, THREADS);
    CHECK_EQ(sum.errors, 0);
    CHECK_EQ(sum.corrupt, 0);
    CHECK(sum.allocs > 0);
    CHECK_EQ(st().num_allocs - s0.num_allocs, sum.allocs);
    mg_arena_trim(0, NULL);
    check_idle();
}

/* A forked child of a tree, told go[0]/done[1]: the parent's cached
 * block is not reused uncharged, nor is a block inherited live and freed
 * here; what is left of the budget fits. Returns a bit per failed check. */
static int tree_child(void *inherited_live, uint64_t blk, uint64_t small_blk)
{
    void *a = NULL, *b = NULL, *c = NULL;
    mg_arena_stats_t s0 = st();
    int rc = 0;
    rc |= s0.cached_bytes == 0 ? 0 : 1;                              /* no inherited cache */
    rc |= mg_arena_alloc(24 * MiB, 64, &a) == ENOMEM ? 0 : 2;        /* its size: charged */
    mg_arena_free(inherited_live);
    rc |= st().reserved_current == s0.reserved_current - blk ? 0 : 4;
    rc |= st().cached_bytes == 0 ? 0 : 8;                            /* let go of, not cached */
    rc |= mg_arena_alloc(24 * MiB, 64, &b) == ENOMEM ? 0 : 16;       /* charged as well */
    rc |= st().tree_reserved_bytes == s0.tree_reserved_bytes ? 0 : 32;
    if (mg_arena_alloc(8 * MiB, 64, &c) == 0)
        memset(c, 3, 8 * MiB);
    else
        rc |= 64;
    rc |= st().tree_reserved_bytes == s0.tree_reserved_bytes + small_blk ? 0 : 128;
    return rc;
}

/* Fork a child running fn, wait for its one-byte verdict, and return it;
 * the child stays (holding what it took) until *go is written. */
static int forked(int (*fn)(void *), void *arg, int go[2], pid_t *pid)
{
    int done[2];
    CHECK_EQ(pipe(done), 0);
    fflush(stdout);
    fflush(stderr);
    *pid = fork();
    CHECK(*pid >= 0);
    if (*pid == 0) {
        char c = (char)fn(arg);
        (void)!write(done[1], &c, 1);
        (void)!read(go[0], &c, 1);
        _exit(0); /* as a DataLoader worker leaves: nothing released, nothing run */
    }
    char c = 99;
    CHECK_EQ(read(done[0], &c, 1), 1);
    close(done[0]), close(done[1]);
    return c;
}

static void release(int go[2], pid_t pid)
{
    char c = 'x';
    CHECK_EQ(write(go[1], &c, 1), 1);
    int status = 0;
    CHECK_EQ(waitpid(pid, &status, 0), pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

typedef struct {
    void *live;
    uint64_t blk, small_blk;
} tree_args_t;

static int run_tree_child(void *arg)
{
    tree_args_t *t = arg;
    return tree_child(t->live, t->blk, t->small_blk);
}

/* A forked child's 1 MiB: 0 or the error. */
static int run_small_child(void *arg)
{
    (void)arg;
    void *p = NULL;
    return mg_arena_alloc(1 * MiB, 64, &p);
}

/* A budget shared by a tree (memguard run --budget) through a file, as
 * processes started by exec share it: a file of another layout is refused;
 * a slot holding this process's pid is stale (the process it was before
 * an exec) and reused; what each process reserves beyond what it inherited
 * counts against one budget, a forked child reusing none of its parent's
 * cache; a child that is gone (left by _exit, nothing run) stops counting
 * when the budget would be passed; a child that finds every slot held by
 * a live process is refused. Runs last: the arena stays shared after it. */
static void test_shared_budget(void)
{
    if (getenv("MGTEST_SKIP_FORK")) {
        printf("skip test_shared_budget: MGTEST_SKIP_FORK is set\n");
        return;
    }
    mg_arena_trim(0, NULL);
    /* a bare descriptor, not tmpfile()'s FILE: a heap block alive in the
     * children makes valgrind scan all their mapped memory (1.5 GB, 4 s)
     * for pointers to it as each one exits */
    char path[] = "/tmp/mgtest-tree-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK_EQ(unlink(path), 0);
    uint64_t other = 42;
    CHECK_EQ(pwrite(fd, &other, sizeof(other), 0), (ssize_t)sizeof(other));
    CHECK_EQ(mg_arena_share_budget(fd, 1), EPROTO);
    CHECK_EQ(st().budget_bytes, 0); /* nothing shared */
    CHECK_EQ(ftruncate(fd, 0), 0);
    CHECK_EQ(ftruncate(fd, sizeof(mgi_tree_t)), 0);
    mgi_tree_t *view = mmap(NULL, sizeof(mgi_tree_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(view != MAP_FAILED);
    atomic_store(&view->slot[5].owner, (uint64_t)7 << 32 | (uint32_t)getpid());
    atomic_store(&view->slot[5].charge, 77);
    atomic_store(&view->total, 77);

    mg_arena_stats_t s0 = st();
    uint64_t blk = block_bytes(24 * MiB, 64), small_blk = block_bytes(8 * MiB, 64);
    uint64_t budget = s0.reserved_current + 2 * blk + small_blk; /* room for two and a small one */
    CHECK_EQ(mg_arena_share_budget(fd, budget), 0);
    CHECK_EQ(mg_arena_share_budget(-1, 1), 0); /* idempotent: nothing changes */
    CHECK_EQ(atomic_load(&view->magic), MGI_TREE_MAGIC);
    CHECK_EQ(atomic_load(&view->slot[5].owner), (uint64_t)8 << 32 | (uint32_t)getpid());
    CHECK_EQ(atomic_load(&view->slot[5].charge), s0.reserved_current);
    CHECK_EQ(atomic_load(&view->slot[0].owner), 0);
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current);
    CHECK_EQ(st().budget_bytes, budget);

    void *mine = NULL, *spare = NULL, *more = NULL, *extra = NULL;
    CHECK_EQ(mg_arena_alloc(24 * MiB, 64, &mine), 0);
    memset(mine, 1, 24 * MiB);
    CHECK_EQ(mg_arena_alloc(24 * MiB, 64, &spare), 0);
    memset(spare, 1, 24 * MiB);
    mg_arena_free(spare); /* cached here: the child's first allocation would reuse it */
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current + 2 * blk);
    int go[2];
    CHECK_EQ(pipe(go), 0);
    pid_t pid;
    tree_args_t args = {mine, blk, small_blk};
    CHECK_EQ(forked(run_tree_child, &args, go, &pid), 0);
    /* the child's small block counts here too; this process's cache makes
     * room for its own 24 MiB, and then nothing more fits */
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current + 2 * blk + small_blk);
    CHECK_EQ(mg_arena_alloc(24 * MiB, 64, &more), 0);
    CHECK_EQ(st().cached_bytes, 0);
    CHECK_EQ(mg_arena_alloc(8 * MiB, 64, &extra), ENOMEM);
    release(go, pid);
    /* the child is gone: its slot is taken back, and the allocation fits */
    CHECK_EQ(mg_arena_alloc(8 * MiB, 64, &extra), 0);
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current + 2 * blk + small_blk);

    /* with room in the budget, a child's 1 MiB fits; with every slot held
     * by a live process not of the tree, it is refused */
    mg_arena_free(extra);
    mg_arena_trim(0, NULL);
    CHECK_EQ(forked(run_small_child, NULL, go, &pid), 0);
    release(go, pid);
    mg_arena_set_budget(budget); /* takes back the slot of the child that is gone */
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current + 2 * blk);
    uint32_t stranger = (uint32_t)getppid();
    for (int i = 0; i < MGI_TREE_SLOTS; i++) {
        uint64_t owner = atomic_load(&view->slot[i].owner);
        if (MGI_SLOT_PID(owner) == 0)
            CHECK(atomic_compare_exchange_strong(&view->slot[i].owner, &owner,
                                                 (owner & ~(uint64_t)UINT32_MAX) | stranger));
    }
    printf("  (a line saying a process is refused memory is expected next)\n");
    CHECK_EQ(forked(run_small_child, NULL, go, &pid), ENOMEM);
    release(go, pid);
    for (int i = 0; i < MGI_TREE_SLOTS; i++) {
        uint64_t owner = atomic_load(&view->slot[i].owner);
        if (MGI_SLOT_PID(owner) == (int32_t)stranger)
            atomic_store(&view->slot[i].owner, owner & ~(uint64_t)UINT32_MAX);
    }
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current + 2 * blk);

    mg_arena_free(more);
    mg_arena_free(mine);
    close(go[0]), close(go[1]);
    munmap(view, sizeof(*view));
    close(fd);
    mg_arena_set_budget(0);
    mg_arena_trim(0, NULL);
    CHECK_EQ(st().tree_reserved_bytes, s0.reserved_current);
    check_idle();
}

/* The tree's budget under racing threads: its total, taken by a
 * compare-exchange, is never passed, and this process, alone in the tree
 * (its children gone), is charged exactly what it reserved. Runs after
 * test_shared_budget, or shares the budget itself where forks are skipped. */
static void test_tree_race(void)
{
    CHECK_EQ(mg_arena_share_budget(-1, 0), 0); /* a no-op after test_shared_budget */
    budget_race(1);
    CHECK_EQ(st().tree_reserved_bytes, st().reserved_current);
}

int main(void)
{
    mgt_begin();
    page = (size_t)sysconf(_SC_PAGESIZE);
    const char *pre = getenv("LD_PRELOAD"), *env = getenv("MGTEST_SLOW");
    slow = (env && *env && strcmp(env, "0") != 0) || (pre && strstr(pre, "vgpreload"));
    full_max = slow ? 256 * KiB : 64 * MiB;
#ifdef __SANITIZE_THREAD__
    full_max = 256 * KiB; /* every byte written costs shadow memory; races are what counts here */
#endif
    if (slow)
        printf("slow mode: shorter loops, large blocks written at their ends\n");
    RUN(test_init_and_errors);
    RUN(test_ownership);
    RUN(test_small_sizes);
    RUN(test_large_sizes);
    RUN(test_alignment);
    RUN(test_accounting);
    RUN(test_caching);
    RUN(test_trim);
    RUN(test_decay);
    RUN(test_budget);
    RUN(test_split_merge);
    RUN(test_huge_requests);
    RUN(test_budget_race);
    RUN(test_split_race);
    RUN(test_fork);
    RUN(test_shared_budget); /* last but one: the arena stays shared */
    RUN(test_tree_race);
    return mgt_result();
}
