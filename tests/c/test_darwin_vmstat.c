/* The macOS layer's pure part (csrc/platform/darwin/vmstat.c): raw Mach and
 * sysctl readings into a sample, and what the pressure model makes of them.
 *
 * Where each value comes from:
 * - field meanings and units: <mach/vm_statistics.h> (vm_statistics64: page
 *   counts; compressions, pageins, swapins, swapouts cumulative),
 *   <mach/task_info.h> (task_vm_info: phys_footprint, resident_size in
 *   bytes), <sys/sysctl.h> (struct xsw_usage, bytes);
 * - the page size, 16384: vm_kernel_page_size on Apple silicon, the unit of
 *   host_statistics64's counts (vm_stat's header prints it);
 * - the levels 1, 2, 4: DISPATCH_MEMORYPRESSURE_NORMAL, _WARN, _CRITICAL in
 *   <dispatch/source.h>, which kern.memorystatus_vm_pressure_level reports;
 * - "green24": a 24 GB Apple-silicon Mac read in Activity Monitor as App
 *   7.67 + Wired 2.95 + Compressed 8.38 = 19.00 GB with 1.77 GB of swap in
 *   use while macOS's memory pressure graph was green (a reading published
 *   in a public pull request that verified the App + Wired + Compressed
 *   formula on that Mac); GB there is GiB, so pages = GiB * 65536;
 * - "wired36": a 36 GB Apple-silicon Mac's vm_stat (active 779226, wired
 *   182113 pages of 16384 bytes), published in another;
 * - "story": the user story behind memguard, a 36 GB MacBook whose top
 *   showed 14 GB compressed. Its counter movements are not recorded: the
 *   rates below are scenario values chosen at the thresholds, and say so. */
#include <math.h>

#include "mgtest.h"
#include "vmstat.h"

#define PAGE 16384ULL
#define GIB (1ULL << 30)

static mg_sample_t fill(const mgi_darwin_raw_t *now, const mgi_darwin_raw_t *prev)
{
    mg_sample_t s;
    mgi_sample_init(&s);
    mgi_darwin_fill(now, prev, &s);
    return s;
}

static mgi_darwin_raw_t green24(void)
{
    mgi_darwin_raw_t r = {0};
    r.have_vm = r.have_memsize = r.have_swap = r.have_level = 1;
    r.page_size = PAGE;
    r.internal_page_count = 502661;   /* App 7.67 GiB, no purgeable pages */
    r.wire_count = 193331;            /* Wired 2.95 GiB */
    r.compressor_page_count = 549192; /* Compressed 8.38 GiB */
    r.memsize = 24 * GIB;
    r.xsu_total = 2 * GIB;
    r.xsu_avail = 2 * GIB - (uint64_t)(1.77 * (double)GIB);
    r.pressure_level = MG_OS_LEVEL_NORMAL;
    return r;
}

static int level_of(mg_sample_t *s, uint32_t *reasons)
{
    mg_pressure_t p;
    mg_pressure_opts_t o = mgt_pressure_opts(3);
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, s);
    *reasons = s->reasons;
    return s->raw_level;
}

/* Activity Monitor's used memory, and the headroom it leaves: green is OK. */
static void test_green_is_ok(void)
{
    mgi_darwin_raw_t r = green24();
    uint64_t used = mgi_darwin_used_bytes(&r);
    CHECK_NEAR((double)used / (double)GIB, 19.00, 0.005);
    mg_sample_t s = fill(&r, NULL);
    CHECK(s.have & MG_HAVE_MEMINFO);
    CHECK(s.have & MG_HAVE_MEMAVAIL);
    CHECK_EQ(s.mem_total_bytes, 24 * GIB);
    CHECK_EQ(s.mem_available_bytes, 24 * GIB - used);
    CHECK_EQ(s.compressed_bytes, 549192 * PAGE);
    CHECK_EQ(s.swap_total_bytes, 2 * GIB);
    CHECK_NEAR((double)(s.swap_total_bytes - s.swap_free_bytes) / (double)GIB, 1.77, 0.001);
    CHECK_EQ(s.os_pressure_level, MG_OS_LEVEL_NORMAL);
    CHECK(isnan(s.compressions_per_s)); /* one reading: no rate yet */
    uint32_t why;
    CHECK_EQ(level_of(&s, &why), MG_LEVEL_OK); /* 5 GiB of 24 free: 21 % headroom */
    CHECK_NEAR(s.headroom_fraction, 5.0 / 24.0, 0.001);
    CHECK_EQ(why, 0);
}

/* Purgeable pages are app memory the system may drop: not used. */
static void test_purgeable_is_not_used(void)
{
    mgi_darwin_raw_t r = green24();
    r.purgeable_count = 65536; /* 1 GiB */
    CHECK_EQ(mgi_darwin_used_bytes(&r), mgi_darwin_used_bytes(&(mgi_darwin_raw_t){
                                            .page_size = PAGE, .internal_page_count = 437125,
                                            .wire_count = 193331,
                                            .compressor_page_count = 549192}));
    r.purgeable_count = r.internal_page_count + 1; /* never below nothing */
    CHECK_EQ(mgi_darwin_used_bytes(&r), (193331ULL + 549192ULL) * PAGE);
}

/* Counts are of the kernel's 16 KiB pages, not 4 KiB ones. */
static void test_pages_are_kernel_pages(void)
{
    mgi_darwin_raw_t r = {.have_vm = 1, .page_size = PAGE, .wire_count = 182113};
    CHECK_EQ(mgi_darwin_used_bytes(&r), 182113ULL * 16384ULL); /* 2.78 GiB wired, not 0.69 */
    r.have_memsize = 1;
    r.memsize = 36 * GIB;
    mg_sample_t s = fill(&r, NULL);
    CHECK_EQ(s.mem_available_bytes, 36 * GIB - 182113ULL * 16384ULL);
}

/* The footprint, not RSS, is what the budget is judged on: compressed
 * pages leave RSS but stay in the footprint. */
static void test_footprint_is_judged(void)
{
    mgi_darwin_raw_t r = {.have_task = 1, .phys_footprint = 20 * GIB, .resident_size = 6 * GIB,
                          .resident_size_peak = 9 * GIB};
    mg_sample_t s = fill(&r, NULL);
    CHECK(s.have & MG_HAVE_FOOTPRINT);
    CHECK_EQ(s.footprint_bytes, 20 * GIB);
    CHECK_EQ(s.rss_bytes, 6 * GIB);
    CHECK_EQ(s.rss_peak_bytes, 9 * GIB);
    CHECK(!(s.have & MG_HAVE_SWAP)); /* macOS has no per-process swap figure */
    s.budget_bytes = 16 * GIB;
    uint32_t why;
    CHECK_EQ(level_of(&s, &why), MG_LEVEL_CRITICAL); /* 20 of 16: over, though RSS is 6 */
    CHECK_EQ(why, MG_REASON_BUDGET);
    CHECK_NEAR(s.budget_used_fraction, 1.25, 1e-9);
}

/* The kernel's own level, as dispatch names it: warn is HIGH, critical
 * CRITICAL, normal nothing. */
static void test_os_levels(void)
{
    const int os[] = {MG_OS_LEVEL_NORMAL, MG_OS_LEVEL_WARN, MG_OS_LEVEL_CRITICAL};
    const int want[] = {MG_LEVEL_OK, MG_LEVEL_HIGH, MG_LEVEL_CRITICAL};
    for (int i = 0; i < 3; i++) {
        mgi_darwin_raw_t r = {.have_level = 1, .pressure_level = os[i]};
        mg_sample_t s = fill(&r, NULL);
        uint32_t why;
        CHECK_EQ(level_of(&s, &why), want[i]);
        CHECK_EQ(why, i ? MG_REASON_OS : 0u);
    }
    CHECK_EQ(MG_OS_LEVEL_NORMAL, 1);
    CHECK_EQ(MG_OS_LEVEL_WARN, 2);
    CHECK_EQ(MG_OS_LEVEL_CRITICAL, 4);
}

/* The story's machine: 14 GB in the compressor. Compressions and swap-outs
 * per second are the compressor signal, judged at the swap-in thresholds
 * (256, 2560, 25600 pages a second; scenario rates at each). */
static void test_compressor_signal(void)
{
    mgi_darwin_raw_t a = {.have_vm = 1, .page_size = PAGE, .mono_ns = 1000000000,
                          .compressor_page_count = 14 * GIB / PAGE, .compressions = 5000000,
                          .swapins = 100, .swapouts = 200, .pageins = 42};
    mg_sample_t first = fill(&a, NULL);
    CHECK_EQ(first.compressed_bytes, 14 * GIB);
    CHECK_EQ(first.compressions, 5000000);
    CHECK_EQ(first.swap_in_pages, 100);
    CHECK_EQ(first.swap_out_pages, 200);
    CHECK_EQ(first.system_major_faults, 42);
    CHECK(isnan(first.swap_out_pages_per_s));
    const uint64_t out_per_s[] = {100, 256, 2560, 25600};
    const int want[] = {MG_LEVEL_OK, MG_LEVEL_ELEVATED, MG_LEVEL_HIGH, MG_LEVEL_CRITICAL};
    for (int i = 0; i < 4; i++) {
        mgi_darwin_raw_t b = a;
        b.mono_ns += 2000000000; /* two seconds later */
        b.compressions += out_per_s[i];        /* half compressed ... */
        b.swapouts += out_per_s[i];            /* ... half swapped out */
        mg_sample_t s = fill(&b, &a);
        CHECK_NEAR(s.compressions_per_s, (double)out_per_s[i] / 2, 1e-9);
        CHECK_NEAR(s.swap_out_pages_per_s, (double)out_per_s[i] / 2, 1e-9);
        CHECK_NEAR(s.swap_in_pages_per_s, 0.0, 1e-12);
        uint32_t why;
        CHECK_EQ(level_of(&s, &why), want[i]);
        CHECK_EQ(why, i ? MG_REASON_COMPRESSOR : 0u);
    }
    /* a counter that went back (a reboot between readings) reads 0, and a
     * reading no later than the last gives no rate */
    mgi_darwin_raw_t back = a;
    back.mono_ns += 1000000000;
    back.compressions = 10;
    CHECK_NEAR(fill(&back, &a).compressions_per_s, 0.0, 1e-12);
    CHECK(isnan(fill(&a, &a).compressions_per_s));
}

/* What was not read stays absent: no made-up zeros. */
static void test_absent_stays_absent(void)
{
    mgi_darwin_raw_t r = {0};
    mg_sample_t s = fill(&r, NULL);
    CHECK_EQ(s.have, 0);
    CHECK(isnan(s.compressions_per_s) && isnan(s.swap_in_pages_per_s));
    r.have_vm = 1; /* pages without a page size mean nothing */
    CHECK_EQ(fill(&r, NULL).have, 0);
    r.page_size = PAGE; /* pages without hw.memsize: no available figure */
    s = fill(&r, NULL);
    CHECK(s.have & MG_HAVE_COMPRESSED);
    CHECK(!(s.have & MG_HAVE_MEMAVAIL));
}

int main(void)
{
    mgt_begin();
    RUN(test_green_is_ok);
    RUN(test_purgeable_is_not_used);
    RUN(test_pages_are_kernel_pages);
    RUN(test_footprint_is_judged);
    RUN(test_os_levels);
    RUN(test_compressor_signal);
    RUN(test_absent_stays_absent);
    return mgt_result();
}
