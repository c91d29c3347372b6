/* The device cache behind memguard's CUDA allocator, over a host-memory
 * backend that stands in for a device: it counts its calls, can be made to
 * run out of memory at a capacity, and poisons what it gives back so a
 * block still in use after the cache released it would show. */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>

#include "memguard/memguard-cuda.h"
#include "mgtest.h"

#define MIB ((size_t)1 << 20)

static _Atomic uint64_t dev_used, dev_capacity;
static _Atomic long n_alloc, n_free;

static int fake_alloc(void *ctx, int device, size_t size, void **out)
{
    (void)ctx;
    (void)device;
    uint64_t cap = atomic_load(&dev_capacity);
    uint64_t now = atomic_fetch_add(&dev_used, size) + size;
    if (cap && now > cap) {
        atomic_fetch_sub(&dev_used, size);
        return ENOMEM;
    }
    char *p = aligned_alloc(512, size + 512);
    if (!p) {
        atomic_fetch_sub(&dev_used, size);
        return ENOMEM;
    }
    *(size_t *)p = size;
    atomic_fetch_add(&n_alloc, 1);
    *out = p + 512;
    return 0;
}

static void fake_free(void *ctx, int device, void *p)
{
    (void)ctx;
    (void)device;
    char *q = (char *)p - 512;
    atomic_fetch_sub(&dev_used, *(size_t *)q);
    atomic_fetch_add(&n_free, 1);
    free(q);
}

static const mg_dev_backend_t FAKE = {fake_alloc, fake_free, NULL, "fake"};

static mg_dev_stats_t stats(int device)
{
    mg_dev_stats_t s;
    CHECK_EQ(mg_dev_stats(device, &s), 0);
    return s;
}

/* Every block freed and trimmed: the backend holds nothing. */
static void check_empty(int device)
{
    uint64_t freed;
    mg_dev_trim(-1, &freed);
    mg_dev_stats_t s = stats(device);
    CHECK_EQ(s.allocated_current, 0);
    CHECK_EQ(s.requested_current, 0);
    CHECK_EQ(s.reserved_current, 0);
    CHECK_EQ(s.cached_bytes, 0);
    CHECK_EQ(atomic_load(&dev_used), 0);
}

static void test_errors(void)
{
    void *p = (void *)1;
    CHECK_EQ(mg_dev_alloc(0, NULL, 64, &p), ENODEV); /* no backend yet */
    CHECK(p == NULL);
    CHECK_EQ(mg_dev_init(NULL), EINVAL);
    CHECK_EQ(mg_dev_init(&FAKE), 0);
    CHECK(strcmp(mg_dev_backend_name(), "fake") == 0);
    CHECK_EQ(mg_dev_alloc(-1, NULL, 64, &p), EINVAL);
    CHECK_EQ(mg_dev_alloc(MG_DEV_MAX_DEVICES, NULL, 64, &p), EINVAL);
    CHECK_EQ(mg_dev_set_budget(-1, 1), EINVAL);
    CHECK_EQ(mg_dev_trim(MG_DEV_MAX_DEVICES, NULL), EINVAL);
    CHECK_EQ(mg_dev_alloc(0, NULL, 0, &p), 0); /* size 0: NULL, like cudaMalloc */
    CHECK(p == NULL);
    mg_dev_free(0, NULL);
    int x;
    mg_dev_free(0, &x); /* not ours: ignored */
    CHECK_EQ(stats(0).num_frees, 0);
    CHECK_EQ(SIZE_MAX > 0, 1);
    CHECK_EQ(mg_dev_alloc(0, NULL, SIZE_MAX, &p), ENOMEM);
    CHECK_EQ(stats(0).num_ooms, 1);
    check_empty(0);
    /* detached: as before any backend, until the next init */
    CHECK_EQ(mg_dev_alloc(0, NULL, 64, &p), 0);
    CHECK_EQ(mg_dev_detach(), EBUSY); /* a block is alive */
    mg_dev_free(0, p);
    CHECK_EQ(mg_dev_detach(), 0);
    CHECK(mg_dev_backend_name() == NULL);
    CHECK_EQ(mg_dev_alloc(0, NULL, 64, &p), ENODEV);
    CHECK_EQ(mg_dev_init(&FAKE), 0);
    check_empty(0);
}

/* Class sizes: 512-byte steps to 4 KiB, then at most 12.5 % rounding; large
 * blocks in 2 MiB units. */
static void test_sizes(void)
{
    size_t sizes[] = {1, 511, 512, 513, 4096, 4097, 70000, MIB, MIB + 1, 3 * MIB + 7,
                      8 * MIB, 8 * MIB + 1, 100 * MIB + 3};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        size_t n = sizes[i];
        void *p;
        mg_dev_stats_t before = stats(0);
        CHECK_EQ(mg_dev_alloc(0, NULL, n, &p), 0);
        CHECK_EQ((uintptr_t)p % 512, 0);
        mg_dev_stats_t s = stats(0);
        uint64_t block = s.allocated_current - before.allocated_current;
        CHECK(block >= n);
        if (n <= 4096)
            CHECK(block - n < 512);
        else if (n <= 8 * MIB)
            CHECK(block <= n + n / 8);
        else
            CHECK(block % (2 * MIB) == 0 && block <= n + n / 8 + 2 * MIB);
        CHECK_EQ(s.requested_current - before.requested_current, n);
        memset(p, 0xab, n); /* host backend: writable */
        mg_dev_free(0, p);
    }
    check_empty(0);
}

/* A training loop's allocations come back from the cache: after the first
 * step, no backend call at all. */
static void test_caching(void)
{
    size_t shapes[] = {3072, 200000, 2 * MIB + 5, 12 * MIB, 40 * MIB};
    long calls_after_first = 0;
    for (int step = 0; step < 5; step++) {
        void *p[5];
        long before = atomic_load(&n_alloc);
        for (int i = 0; i < 5; i++)
            CHECK_EQ(mg_dev_alloc(8, NULL, shapes[i], &p[i]), 0);
        for (int i = 4; i >= 0; i--)
            mg_dev_free(8, p[i]);
        if (step > 0)
            calls_after_first += atomic_load(&n_alloc) - before;
    }
    CHECK_EQ(calls_after_first, 0);
    mg_dev_stats_t s = stats(8);
    CHECK_EQ(s.num_allocs, 25);
    CHECK_EQ(s.num_cache_hits, 20);
    CHECK_EQ(s.allocated_current, 0);
    CHECK(s.cached_bytes > 0);
    CHECK(s.reserved_peak == s.reserved_current); /* it plateaued */
    check_empty(8);
}

/* A block freed on one stream is reused by that stream only. */
static void test_streams(void)
{
    void *s1 = (void *)0x1000, *s2 = (void *)0x2000;
    void *a, *b, *c, *d;
    CHECK_EQ(mg_dev_alloc(9, s1, 16 * MIB, &a), 0);
    mg_dev_free(9, a);
    CHECK_EQ(mg_dev_alloc(9, s2, 16 * MIB, &b), 0);
    CHECK(b != a); /* s1's cached block is not s2's */
    CHECK_EQ(mg_dev_alloc(9, s1, 16 * MIB, &c), 0);
    CHECK(c == a); /* s1 gets its own back */
    /* small blocks too: carved from each stream's own chunk */
    CHECK_EQ(mg_dev_alloc(9, s1, 1000, &d), 0);
    mg_dev_free(9, d);
    void *e;
    CHECK_EQ(mg_dev_alloc(9, s2, 1000, &e), 0);
    CHECK(e != d);
    void *f;
    CHECK_EQ(mg_dev_alloc(9, s1, 1000, &f), 0);
    CHECK(f == d);
    CHECK_EQ(stats(9).streams, 2);
    mg_dev_free(9, b);
    mg_dev_free(9, c);
    mg_dev_free(9, e);
    mg_dev_free(9, f);
    /* devices are apart too: the same stream on device 1 has its own pool */
    void *g;
    CHECK_EQ(mg_dev_alloc(1, s1, 16 * MIB, &g), 0);
    CHECK(g != a);
    CHECK_EQ(stats(1).allocated_current, 16 * MIB);
    mg_dev_free(7, g); /* a wrong ordinal still finds the owner */
    CHECK_EQ(stats(1).allocated_current, 0);
    check_empty(9);
    check_empty(1);
}

/* Past MG_DEV_MAX_STREAMS streams, blocks go straight to the backend and
 * back, and still count. */
static void test_many_streams(void)
{
    void *p[MG_DEV_MAX_STREAMS + 3];
    for (int i = 0; i < MG_DEV_MAX_STREAMS + 3; i++)
        CHECK_EQ(mg_dev_alloc(2, (void *)(uintptr_t)(0x100 * (i + 1)), 10 * MIB, &p[i]), 0);
    mg_dev_stats_t s = stats(2);
    CHECK_EQ(s.streams, MG_DEV_MAX_STREAMS);
    CHECK_EQ(s.num_uncached, 3);
    long frees = atomic_load(&n_free);
    for (int i = MG_DEV_MAX_STREAMS; i < MG_DEV_MAX_STREAMS + 3; i++)
        mg_dev_free(2, p[i]);
    CHECK_EQ(atomic_load(&n_free) - frees, 3); /* returned at once */
    for (int i = 0; i < MG_DEV_MAX_STREAMS; i++)
        mg_dev_free(2, p[i]);
    check_empty(2);
}

/* The budget bounds reserved bytes: cache is released to make room, then
 * the allocation fails cleanly, and the next one that fits succeeds. */
static void test_budget(void)
{
    CHECK_EQ(mg_dev_set_budget(3, 100 * MIB), 0);
    void *a, *b, *c;
    CHECK_EQ(mg_dev_alloc(3, NULL, 40 * MIB, &a), 0);
    CHECK_EQ(mg_dev_alloc(3, NULL, 48 * MIB, &b), 0);
    mg_dev_free(3, a); /* 40 MiB cached */
    mg_dev_stats_t s = stats(3);
    CHECK_EQ(s.reserved_current, 88 * MIB);
    CHECK_EQ(s.cached_bytes, 40 * MIB);
    /* 46 MiB (a 48 MiB block) does not fit beside 88 MiB reserved: the
     * cached block goes */
    CHECK_EQ(mg_dev_alloc(3, NULL, 46 * MIB, &c), 0);
    s = stats(3);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.cached_bytes, 0);
    CHECK(s.reserved_current <= 100 * MIB);
    CHECK(s.reserved_peak <= 100 * MIB);
    /* over budget with nothing left to release: ENOMEM, counters exact */
    void *d = (void *)1;
    CHECK_EQ(mg_dev_alloc(3, NULL, 20 * MIB, &d), ENOMEM);
    CHECK(d == NULL);
    mg_dev_stats_t after = stats(3);
    CHECK_EQ(after.num_ooms, 1);
    CHECK_EQ(after.last_oom_bytes, 20 * MIB);
    CHECK_EQ(after.allocated_current, s.allocated_current);
    CHECK_EQ(after.reserved_current, s.reserved_current);
    CHECK_EQ(after.reserved_current, atomic_load(&dev_used));
    /* one that fits still succeeds */
    CHECK_EQ(mg_dev_alloc(3, NULL, 1000, &d), 0);
    mg_dev_free(3, d);
    mg_dev_free(3, b);
    mg_dev_free(3, c);
    /* a smaller budget releases the cache above it at once */
    CHECK_EQ(mg_dev_set_budget(3, 10 * MIB), 0);
    CHECK(stats(3).reserved_current <= 10 * MIB);
    CHECK_EQ(mg_dev_set_budget(3, 0), 0);
    check_empty(3);
}

/* The device itself runs out under the budget (another process took it):
 * the whole cache is released and the allocation tried once more. */
static void test_device_full(void)
{
    atomic_store(&dev_capacity, 64 * MIB);
    void *a, *b;
    CHECK_EQ(mg_dev_alloc(4, NULL, 48 * MIB, &a), 0);
    mg_dev_free(4, a);
    CHECK_EQ(mg_dev_alloc(4, NULL, 30 * MIB, &b), 0); /* 48 cached + 30 > 64 */
    mg_dev_stats_t s = stats(4);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.cached_bytes, 0);
    void *c;
    CHECK_EQ(mg_dev_alloc(4, NULL, 60 * MIB, &c), ENOMEM);
    mg_dev_free(4, b);
    atomic_store(&dev_capacity, 0);
    check_empty(4);
}

/* Chunks go back only once none of their blocks is in use. */
static void test_chunk_release(void)
{
    void *p[8];
    for (int i = 0; i < 8; i++)
        CHECK_EQ(mg_dev_alloc(5, NULL, 100000, &p[i]), 0);
    CHECK_EQ(stats(5).reserved_current, 2 * MIB); /* one small chunk */
    for (int i = 1; i < 8; i++)
        mg_dev_free(5, p[i]);
    uint64_t freed;
    mg_dev_trim(5, &freed);
    CHECK_EQ(freed, 0); /* p[0] pins the chunk */
    CHECK_EQ(stats(5).reserved_current, 2 * MIB);
    void *q;
    CHECK_EQ(mg_dev_alloc(5, NULL, 100000, &q), 0); /* from the cache */
    CHECK_EQ(stats(5).num_cache_hits, 1);
    mg_dev_free(5, q);
    mg_dev_free(5, p[0]);
    mg_dev_free(5, p[0]); /* a double free is ignored */
    CHECK_EQ(stats(5).num_frees, 9);
    mg_dev_trim(5, &freed);
    CHECK_EQ(freed, 2 * MIB);
    /* carving starts afresh after the chunk went */
    CHECK_EQ(mg_dev_alloc(5, NULL, 100000, &q), 0);
    mg_dev_free(5, q);
    check_empty(5);
}

/* Threads racing on one budget: reserved never passes it, nothing leaks,
 * every block is distinct while in use. */
#define RACE_THREADS 4
#define RACE_ITERS 3000

static void *race_main(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    void *held[4] = {0};
    long fails = 0;
    for (int i = 0; i < RACE_ITERS; i++) {
        int k = (int)(rand_r(&seed) % 4);
        if (held[k]) {
            /* still ours: nobody else was handed it */
            if (*(volatile uint32_t *)held[k] != (uint32_t)(uintptr_t)arg + (uint32_t)k)
                return (void *)1;
            mg_dev_free(6, held[k]);
            held[k] = NULL;
            continue;
        }
        size_t sizes[] = {700, 300000, 3 * MIB, 18 * MIB};
        size_t n = sizes[rand_r(&seed) % 4];
        void *stream = (void *)(uintptr_t)(1 + (uintptr_t)arg % 2);
        if (mg_dev_alloc(6, stream, n, &held[k]) != 0) {
            fails++;
            held[k] = NULL;
            continue;
        }
        *(volatile uint32_t *)held[k] = (uint32_t)(uintptr_t)arg + (uint32_t)k;
        mg_dev_stats_t s;
        mg_dev_stats(6, &s);
        if (s.reserved_current > 64 * MIB)
            return (void *)2;
    }
    for (int k = 0; k < 4; k++)
        mg_dev_free(6, held[k]);
    (void)fails; /* refusals are expected: the test counts them in the stats */
    return NULL;
}

static void test_race(void)
{
    CHECK_EQ(mg_dev_set_budget(6, 64 * MIB), 0);
    pthread_t t[RACE_THREADS];
    for (int i = 0; i < RACE_THREADS; i++)
        pthread_create(&t[i], NULL, race_main, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < RACE_THREADS; i++) {
        void *rc;
        pthread_join(t[i], &rc);
        CHECK(rc == NULL);
    }
    mg_dev_stats_t s = stats(6);
    CHECK(s.reserved_peak <= 64 * MIB);
    CHECK(s.num_ooms > 0); /* four threads of up to 4 x 18 MiB do not fit in 64 */
    CHECK_EQ(s.allocated_current, 0);
    CHECK_EQ(s.num_allocs, s.num_frees);
    mg_dev_set_budget(6, 0);
    check_empty(6);
}

/* A forked child (a DataLoader worker) can use the cache: no lock is left
 * held by a thread that did not come along. */
static void *holder_main(void *arg)
{
    (void)arg;
    for (int i = 0; i < 2000; i++) {
        void *p;
        if (mg_dev_alloc(7, NULL, 5000, &p) == 0)
            mg_dev_free(7, p);
    }
    return NULL;
}

static void test_fork(void)
{
    /* ThreadSanitizer reports the worker as leaked in every child */
    if (getenv("MGTEST_SKIP_FORK")) {
        printf("skip test_fork: MGTEST_SKIP_FORK is set\n");
        return;
    }
    pthread_t t;
    pthread_create(&t, NULL, holder_main, NULL);
    for (int i = 0; i < 5; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            void *p;
            int ok = mg_dev_alloc(7, NULL, 5000, &p) == 0;
            if (ok)
                mg_dev_free(7, p);
            _exit(ok ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    pthread_join(t, NULL);
    check_empty(7);
}

static void test_backend_switch(void)
{
    void *p;
    CHECK_EQ(mg_dev_alloc(0, NULL, 5000, &p), 0);
    CHECK_EQ(mg_dev_init(&FAKE), EBUSY); /* a block is alive */
    mg_dev_free(0, p);
    CHECK_EQ(mg_dev_init(&FAKE), 0); /* its cache went back to the old backend */
    CHECK_EQ(atomic_load(&dev_used), 0);
    CHECK_EQ(atomic_load(&n_alloc), atomic_load(&n_free));
}

int main(void)
{
    RUN(test_errors);
    RUN(test_sizes);
    RUN(test_caching);
    RUN(test_streams);
    RUN(test_many_streams);
    RUN(test_budget);
    RUN(test_device_full);
    RUN(test_chunk_release);
    RUN(test_race);
    RUN(test_fork);
    RUN(test_backend_switch);
    return mgt_result();
}
