/* A small harness for memguard's C tests. CHECK macros print file:line and
 * count failures instead of stopping, so one run shows every broken
 * expectation; main returns mgt_result(), nonzero when any check failed. */
#ifndef MEMGUARD_MGTEST_H
#define MEMGUARD_MGTEST_H

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "memguard/memguard.h"

/* Counters of the running test binary (single-threaded checks only; a
 * forked child counts its own and reports through its exit status). */
static int mgt_failures, mgt_checks;

static inline int mgt_fail(const char *file, int line)
{
    mgt_failures++;
    printf("FAIL %s:%d: ", file, line);
    return 0;
}

#define CHECK(cond)                                                                   \
    do {                                                                              \
        mgt_checks++;                                                                 \
        if (!(cond)) {                                                                \
            mgt_fail(__FILE__, __LINE__);                                             \
            printf("%s\n", #cond);                                                    \
        }                                                                             \
    } while (0)

/* Integers of any width and signedness: both sides are compared and printed
 * as unsigned long long (and as signed, for negative values). */
#define CHECK_EQ(a, b)                                                                \
    do {                                                                              \
        unsigned long long mgt_a_ = (unsigned long long)(a);                          \
        unsigned long long mgt_b_ = (unsigned long long)(b);                          \
        mgt_checks++;                                                                 \
        if (mgt_a_ != mgt_b_) {                                                       \
            mgt_fail(__FILE__, __LINE__);                                             \
            printf("%s == %s: %llu (%lld) != %llu (%lld)\n", #a, #b, mgt_a_,          \
                   (long long)mgt_a_, mgt_b_, (long long)mgt_b_);                     \
        }                                                                             \
    } while (0)

/* Doubles within an absolute tolerance; NaN never passes. */
#define CHECK_NEAR(a, b, tol)                                                         \
    do {                                                                              \
        double mgt_a_ = (a), mgt_b_ = (b);                                            \
        mgt_checks++;                                                                 \
        if (!(fabs(mgt_a_ - mgt_b_) <= (tol))) {                                      \
            mgt_fail(__FILE__, __LINE__);                                             \
            printf("%s ~= %s: %.17g != %.17g\n", #a, #b, mgt_a_, mgt_b_);            \
        }                                                                             \
    } while (0)

#define CHECK_STR(a, b)                                                               \
    do {                                                                              \
        const char *mgt_a_ = (a), *mgt_b_ = (b);                                      \
        mgt_checks++;                                                                 \
        if (!mgt_a_ || !mgt_b_ || strcmp(mgt_a_, mgt_b_) != 0) {                      \
            mgt_fail(__FILE__, __LINE__);                                             \
            printf("%s == %s: \"%s\" != \"%s\"\n", #a, #b, mgt_a_ ? mgt_a_ : "(null)", \
                   mgt_b_ ? mgt_b_ : "(null)");                                       \
        }                                                                             \
    } while (0)

/* Run one test function, naming it so failures can be placed. */
#define RUN(fn)                                                                       \
    do {                                                                              \
        int mgt_before_ = mgt_failures;                                               \
        fn();                                                                         \
        printf("%s %s\n", mgt_failures == mgt_before_ ? "ok  " : "FAIL", #fn);       \
    } while (0)

/* Sanitizer reports end the process without flushing stdio: keep stdout
 * unbuffered so the lines before a report are not lost. */
static inline void mgt_begin(void)
{
    setvbuf(stdout, NULL, _IONBF, 0);
}

static inline int mgt_result(void)
{
    printf("%d checks, %d failed\n", mgt_checks, mgt_failures);
    return mgt_failures ? 1 : 0;
}

/* The fixture tree (tests/fixtures/proc): argv[1], else $MGTEST_FIXTURES,
 * else the path relative to the repository root. */
static inline const char *mgt_fixtures(int argc, char **argv)
{
    const char *env = getenv("MGTEST_FIXTURES");
    if (argc > 1)
        return argv[1];
    return env && *env ? env : "tests/fixtures/proc";
}

/* Read a whole file into an exactly-sized malloc buffer, not NUL-terminated,
 * so AddressSanitizer catches a parser reading one byte past the end. NULL
 * when the file cannot be read. A zero-length file gives a 1-byte buffer
 * with *len = 0. */
static inline char *mgt_slurp(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        return NULL;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return NULL;
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n ? n : 1);
    size_t got = 0;
    while (buf && got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            free(buf);
            buf = NULL;
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    *len = n;
    return buf;
}

/* A copy of buf[0, len) in its own exactly-sized allocation. */
static inline char *mgt_copy(const char *buf, size_t len)
{
    char *c = malloc(len ? len : 1);
    if (c && len)
        memcpy(c, buf, len);
    return c;
}

/* Deterministic pseudo-random numbers (xorshift64*), so a failing mutation
 * is the same on the next run. */
static unsigned long long mgt_rng_state = 0x9E3779B97F4A7C15ULL;

static inline unsigned long long mgt_rand(void)
{
    unsigned long long x = mgt_rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    mgt_rng_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* The documented pressure defaults with calm_samples = calm, spelled out so
 * a MEMGUARD_* variable in the environment cannot change what tests mean. */
static inline void mgt_sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A thread waiting on a sampler with no timeout (mg_sampler_wait's result). */
typedef struct mgt_waiter {
    mg_sampler_t *s;
    int wake, rc;
} mgt_waiter_t;

static inline void *mgt_wait_forever(void *arg)
{
    mgt_waiter_t *w = arg;
    w->rc = mg_sampler_wait(w->s, -1, &w->wake);
    return NULL;
}

/* The wake contract of a stopped sampler, whatever its notifiers: nothing
 * pending is a timeout with no bits; wakes before a wait are not lost and
 * are consumed once (two make one); a wake from another thread ends a wait
 * without a timeout. */
static inline void mgt_check_wakes(mg_sampler_t *s)
{
    int w = -1;
    CHECK_EQ(mg_sampler_wait(s, 0, &w), 0);
    CHECK_EQ(w, 0);
    CHECK_EQ(mg_sampler_wait(s, 30, &w), 0);
    CHECK_EQ(w, 0);
    CHECK_EQ(mg_sampler_wake(s), 0);
    CHECK_EQ(mg_sampler_wake(s), 0);
    CHECK_EQ(mg_sampler_wait(s, 1000, &w), 0);
    CHECK_EQ(w, MG_WAKE_USER);
    CHECK_EQ(mg_sampler_wait(s, 0, &w), 0);
    CHECK_EQ(w, 0);
    mgt_waiter_t wt = {s, -1, -1};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, mgt_wait_forever, &wt), 0);
    mgt_sleep_ms(20);
    CHECK_EQ(mg_sampler_wake(s), 0);
    pthread_join(th, NULL);
    CHECK_EQ(wt.rc, 0);
    CHECK_EQ(wt.wake, MG_WAKE_USER);
}

static inline mg_pressure_opts_t mgt_pressure_opts(uint32_t calm)
{
    mg_pressure_opts_t o = {
        .budget = {0.80, 0.90, 0.97},
        .headroom = {0.15, 0.08, 0.03},
        .psi = {0.05, 0.15, 0.40},
        .swap_in = {256, 2560, 25600},
        .major_faults = {500, 5000, 50000},
        .calm_samples = calm,
    };
    return o;
}

#endif /* MEMGUARD_MGTEST_H */
