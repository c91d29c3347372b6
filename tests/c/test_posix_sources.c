/* The POSIX fallback layer (csrc/platform/posix/), built and run here as a
 * macOS or BSD machine without its own layer would run it: getrusage and
 * sysconf are all it reads, its notifiers are pipes, and there is no
 * in-process allocator. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "memguard/memguard-arena.h"
#include "mgi.h"
#include "mgtest.h"

static const uint64_t SEEN = MG_HAVE_FAULTS | MG_HAVE_RSS_PEAK | MG_HAVE_MEMINFO;

/* Exactly what the layer can see, and nothing it cannot, even where /proc
 * is there to be read. */
static void test_sources_see_what_posix_shows(void)
{
    mgi_sources_t src;
    CHECK_EQ(mgi_sources_open(&src, "/proc", "/sys/fs/cgroup"), 0);
    mg_sample_t s;
    mgi_sample_init(&s);
    mgi_sources_read(&src, &s, 1);
    mgi_sources_close(&src);
    CHECK_EQ(s.have, SEEN);
    CHECK_EQ(s.mem_total_bytes, (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE));
    CHECK(s.rss_peak_bytes > 0);
    CHECK(s.minor_faults > 0);
    CHECK_EQ(s.rss_bytes, 0);        /* absent: no portable current RSS */
    CHECK_EQ(s.mem_available_bytes, 0);
    CHECK(!(s.have & (MG_HAVE_STATUS | MG_HAVE_FOOTPRINT | MG_HAVE_SWAP | MG_HAVE_PSI |
                      MG_HAVE_CGROUP | MG_HAVE_VMSTAT | MG_HAVE_MEMAVAIL)));
    /* a sample with no footprint is never judged against a budget */
    mg_pressure_t p;
    mg_pressure_opts_t o = mgt_pressure_opts(3);
    mg_pressure_init(&p, &o);
    s.budget_bytes = 1;
    mg_pressure_update(&p, &s);
    CHECK_EQ(s.level, MG_LEVEL_OK);
    CHECK(isnan(s.budget_used_fraction));
    CHECK(!(s.have & MG_HAVE_BUDGET));
}

static void test_no_inprocess_allocator(void)
{
    int slots = -1;
    CHECK_EQ(mg_install("libc10.so", &slots), ENOTSUP);
    CHECK_EQ(slots, 0);
    CHECK_EQ(mg_installed(), 0);
    CHECK_EQ(mg_uninstall(), 0);
    uint64_t swapped = 1;
    CHECK_EQ(mgi_swap_in("/proc", &swapped), ENOSYS);
    CHECK_EQ(swapped, 0);
}

/* The sampler on pipes: the wake contract, its thread samples and stops,
 * and rates come from getrusage's counters. */
static void test_sampler_on_pipes(void)
{
    mg_pressure_opts_t o = mgt_pressure_opts(3);
    mg_sampler_config_t cfg = {.interval_us = 5000, .ring_size = 64, .pressure = &o,
                               .proc_root = "/proc", .cgroup_root = "/sys/fs/cgroup"};
    mg_sampler_t *s = NULL;
    CHECK_EQ(mg_sampler_create(&cfg, &s), 0);
    if (!s)
        return;
    mgt_check_wakes(s);

    CHECK_EQ(mg_sampler_start(s), 0);
    mg_sample_t l = {0};
    for (int i = 0; i < 3000 && (mg_sampler_latest(s, &l) != 0 || l.seq < 3); i++)
        mgt_sleep_ms(1);
    CHECK(l.seq >= 3);
    CHECK_EQ(l.have & ~(uint64_t)MG_HAVE_RATES, SEEN);
    CHECK(l.have & MG_HAVE_RATES);
    CHECK(l.minor_faults_per_s >= 0);
    CHECK(isnan(l.swap_in_pages_per_s));
    int64_t t0 = (int64_t)time(NULL);
    CHECK_EQ(mg_sampler_stop(s), 0); /* the stop pipe ends the thread's wait */
    CHECK((int64_t)time(NULL) - t0 <= 1);
    CHECK_EQ(mg_sampler_running(s), 0);
    mg_sampler_destroy(s);
}

int main(void)
{
    mgt_begin();
    RUN(test_sources_see_what_posix_shows);
    RUN(test_no_inprocess_allocator);
    RUN(test_sampler_on_pipes);
    return mgt_result();
}
