/* The pressure model: the level each signal gives at its thresholds, the
 * reasons behind a raw level, and hysteresis (up at once, down only after
 * calm_samples calm samples, to the highest raw level seen among them). */
#include "mgi.h"
#include "mgtest.h"

static mg_pressure_opts_t opts(uint32_t calm)
{
    return mgt_pressure_opts(calm);
}

/* A sample with nothing known: every rate NaN, every have bit clear. */
static mg_sample_t blank(void)
{
    mg_sample_t s;
    mgi_sample_init(&s);
    return s;
}

/* Raw level of one sample through a fresh model. */
static int raw_of(mg_sample_t s, uint32_t *reasons)
{
    mg_pressure_t p;
    mg_pressure_opts_t o = opts(10);
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    if (reasons)
        *reasons = s.reasons;
    return s.raw_level;
}

static mg_sample_t with_budget(uint64_t rss, uint64_t budget)
{
    mg_sample_t s = blank();
    s.have |= MG_HAVE_STATUS;
    s.rss_bytes = rss;
    s.budget_bytes = budget;
    return s;
}

static mg_sample_t with_memavail(uint64_t avail, uint64_t total)
{
    mg_sample_t s = blank();
    s.have |= MG_HAVE_MEMINFO | MG_HAVE_MEMAVAIL;
    s.mem_total_bytes = total;
    s.mem_available_bytes = avail;
    return s;
}

static mg_sample_t with_psi(double stall)
{
    mg_sample_t s = blank();
    s.psi_some_stall = stall;
    return s;
}

static mg_sample_t with_swap_in(double per_s)
{
    mg_sample_t s = blank();
    s.swap_in_pages_per_s = per_s;
    return s;
}

static mg_sample_t with_faults(double per_s)
{
    mg_sample_t s = blank();
    s.major_faults_per_s = per_s;
    return s;
}

static void test_defaults_and_checks(void)
{
    mg_pressure_opts_t d, o = opts(10);
    mg_pressure_opts_default(&d); /* the driver runs without MEMGUARD_* variables */
    for (int i = 0; i < 3; i++) {
        CHECK_NEAR(d.budget[i], o.budget[i], 0);
        CHECK_NEAR(d.headroom[i], o.headroom[i], 0);
        CHECK_NEAR(d.psi[i], o.psi[i], 0);
        CHECK_NEAR(d.swap_in[i], o.swap_in[i], 0);
        CHECK_NEAR(d.major_faults[i], o.major_faults[i], 0);
    }
    CHECK_EQ(d.calm_samples, 10);
    CHECK_EQ(mg_pressure_opts_check(&o), 0);

    mg_pressure_t p;
    o = opts(0);
    CHECK_EQ(mg_pressure_init(&p, &o), EINVAL);
    o = opts(1);
    o.budget[1] = 0.7; /* below budget[0] */
    CHECK_EQ(mg_pressure_opts_check(&o), EINVAL);
    o = opts(1);
    o.headroom[2] = 0.2; /* headroom thresholds must fall */
    CHECK_EQ(mg_pressure_opts_check(&o), EINVAL);
    o = opts(1);
    o.headroom[0] = 1.5;
    CHECK_EQ(mg_pressure_opts_check(&o), EINVAL);
    o = opts(1);
    o.psi[0] = -0.1;
    CHECK_EQ(mg_pressure_opts_check(&o), EINVAL);
    o = opts(1);
    o.swap_in[2] = NAN;
    CHECK_EQ(mg_pressure_opts_check(&o), EINVAL);
    o = opts(1);
    o.major_faults[0] = 1e9;
    CHECK_EQ(mg_pressure_opts_check(&o), EINVAL);
}

static void test_budget_signal(void)
{
    uint32_t r;
    CHECK_EQ(raw_of(with_budget(79, 100), &r), MG_LEVEL_OK);
    CHECK_EQ(r, 0);
    CHECK_EQ(raw_of(with_budget(80, 100), &r), MG_LEVEL_ELEVATED);
    CHECK_EQ(r, MG_REASON_BUDGET);
    CHECK_EQ(raw_of(with_budget(90, 100), &r), MG_LEVEL_HIGH);
    CHECK_EQ(raw_of(with_budget(97, 100), &r), MG_LEVEL_CRITICAL);
    CHECK_EQ(raw_of(with_budget(250, 100), &r), MG_LEVEL_CRITICAL);
    CHECK_EQ(r, MG_REASON_BUDGET);

    mg_sample_t s = with_budget(45, 100);
    mg_pressure_t p;
    mg_pressure_opts_t o = opts(10);
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK(s.have & MG_HAVE_BUDGET);
    CHECK_NEAR(s.budget_used_fraction, 0.45, 1e-12);

    /* without a budget, or without RSS, there is no budget signal */
    s = with_budget(99, 0);
    CHECK_EQ(raw_of(s, NULL), MG_LEVEL_OK);
    s = with_budget(99, 100);
    s.have &= ~(uint64_t)MG_HAVE_STATUS;
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK_EQ(s.raw_level, MG_LEVEL_OK);
    CHECK(!(s.have & MG_HAVE_BUDGET));
    CHECK(isnan(s.budget_used_fraction));

    /* the footprint counts where known (swapped-out bytes are use), and
     * memguard's cached blocks do not (they are room) */
    s = with_budget(70, 100);
    s.have |= MG_HAVE_FOOTPRINT;
    s.footprint_bytes = 95; /* 25 in swap */
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_HIGH);
    s.have |= MG_HAVE_ARENA;
    s.arena_cached_bytes = 20;
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_OK);
    s.arena_cached_bytes = 500; /* more cached than used: none used */
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK_NEAR(s.budget_used_fraction, 0.0, 0);
}

static void test_headroom_signal(void)
{
    uint32_t r;
    CHECK_EQ(raw_of(with_memavail(16, 100), &r), MG_LEVEL_OK);
    CHECK_EQ(raw_of(with_memavail(15, 100), &r), MG_LEVEL_ELEVATED);
    CHECK_EQ(r, MG_REASON_HEADROOM);
    CHECK_EQ(raw_of(with_memavail(8, 100), &r), MG_LEVEL_HIGH);
    CHECK_EQ(raw_of(with_memavail(3, 100), &r), MG_LEVEL_CRITICAL);
    CHECK_EQ(raw_of(with_memavail(0, 100), &r), MG_LEVEL_CRITICAL);

    /* the cgroup: working set (not usage) against the limit */
    mg_sample_t s = with_memavail(50, 100);
    s.have |= MG_HAVE_CGROUP | MG_HAVE_CGROUP_LIMIT | MG_HAVE_CGROUP_WS;
    s.cgroup_limit_bytes = 1000;
    s.cgroup_usage_bytes = 990;
    s.cgroup_working_set_bytes = 900;
    mg_pressure_t p;
    mg_pressure_opts_t o = opts(10);
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK(s.have & MG_HAVE_HEADROOM);
    CHECK_NEAR(s.headroom_fraction, 0.10, 1e-12); /* min(0.5, 0.1) */
    CHECK_EQ(s.raw_level, MG_LEVEL_ELEVATED);
    CHECK_EQ(s.reasons, MG_REASON_HEADROOM);

    /* without a working set, usage counts; usage past the limit is 0 headroom */
    s = blank();
    s.have |= MG_HAVE_CGROUP | MG_HAVE_CGROUP_LIMIT;
    s.cgroup_limit_bytes = 1000;
    s.cgroup_usage_bytes = 1200;
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK_NEAR(s.headroom_fraction, 0.0, 0);
    CHECK_EQ(s.raw_level, MG_LEVEL_CRITICAL);

    /* memguard's cached blocks are headroom, on the host and in the cgroup */
    s = with_memavail(5, 100);
    s.have |= MG_HAVE_ARENA;
    s.arena_cached_bytes = 11;
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_OK); /* 16 % */
    s.have |= MG_HAVE_CGROUP | MG_HAVE_CGROUP_LIMIT | MG_HAVE_CGROUP_WS;
    s.cgroup_limit_bytes = 100;
    s.cgroup_working_set_bytes = 99;
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_ELEVATED); /* (100 - 99 + 11) / 100 */
    CHECK_EQ(r, MG_REASON_HEADROOM);
    s.arena_cached_bytes = 200; /* never more than all of it */
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK_NEAR(s.headroom_fraction, 1.0, 0);

    /* MemAvailable without MemTotal, or nothing at all: no headroom */
    s = blank();
    s.have |= MG_HAVE_MEMAVAIL;
    s.mem_available_bytes = 1;
    mg_pressure_init(&p, &o);
    mg_pressure_update(&p, &s);
    CHECK(!(s.have & MG_HAVE_HEADROOM));
    CHECK(isnan(s.headroom_fraction));
    CHECK_EQ(s.raw_level, MG_LEVEL_OK);
}

static void test_rate_signals(void)
{
    uint32_t r;
    CHECK_EQ(raw_of(with_psi(0.049), &r), MG_LEVEL_OK);
    CHECK_EQ(raw_of(with_psi(0.05), &r), MG_LEVEL_ELEVATED);
    CHECK_EQ(r, MG_REASON_PSI);
    CHECK_EQ(raw_of(with_psi(0.15), &r), MG_LEVEL_HIGH);
    CHECK_EQ(raw_of(with_psi(1.0), &r), MG_LEVEL_CRITICAL);
    /* the cgroup's stall counts too: the worse of the two */
    mg_sample_t s = with_psi(0.01);
    s.cgroup_psi_some_stall = 0.5;
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_CRITICAL);
    CHECK_EQ(r, MG_REASON_PSI);
    s = blank();
    s.cgroup_psi_some_stall = 0.2;
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_HIGH);

    CHECK_EQ(raw_of(with_swap_in(255), &r), MG_LEVEL_OK);
    CHECK_EQ(raw_of(with_swap_in(256), &r), MG_LEVEL_ELEVATED);
    CHECK_EQ(r, MG_REASON_SWAP);
    CHECK_EQ(raw_of(with_swap_in(2560), &r), MG_LEVEL_HIGH);
    CHECK_EQ(raw_of(with_swap_in(1e6), &r), MG_LEVEL_CRITICAL);

    CHECK_EQ(raw_of(with_faults(499), &r), MG_LEVEL_OK);
    CHECK_EQ(raw_of(with_faults(500), &r), MG_LEVEL_ELEVATED);
    CHECK_EQ(r, MG_REASON_FAULTS);
    CHECK_EQ(raw_of(with_faults(5000), &r), MG_LEVEL_HIGH);
    CHECK_EQ(raw_of(with_faults(50000), &r), MG_LEVEL_CRITICAL);

    /* absent signals (NaN) are calm */
    CHECK_EQ(raw_of(blank(), &r), MG_LEVEL_OK);
    CHECK_EQ(r, 0);
}

static void test_reasons(void)
{
    uint32_t r;
    /* every signal at the top level is named */
    mg_sample_t s = with_budget(95, 100);        /* HIGH */
    s.psi_some_stall = 0.2;                       /* HIGH */
    s.swap_in_pages_per_s = 300;                  /* ELEVATED */
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_HIGH);
    CHECK_EQ(r, MG_REASON_BUDGET | MG_REASON_PSI);
    /* a worse signal replaces the reasons of milder ones */
    s.major_faults_per_s = 60000;                 /* CRITICAL */
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_CRITICAL);
    CHECK_EQ(r, MG_REASON_FAULTS);
    /* all five at once */
    s = with_budget(99, 100);
    s.have |= MG_HAVE_MEMINFO | MG_HAVE_MEMAVAIL;
    s.mem_total_bytes = 100;
    s.mem_available_bytes = 1;
    s.psi_some_stall = 0.9;
    s.swap_in_pages_per_s = 1e5;
    s.major_faults_per_s = 1e5;
    CHECK_EQ(raw_of(s, &r), MG_LEVEL_CRITICAL);
    CHECK_EQ(r, MG_REASON_BUDGET | MG_REASON_HEADROOM | MG_REASON_PSI | MG_REASON_SWAP |
                    MG_REASON_FAULTS);
}

/* Feed raw levels (made from the PSI signal) through one model; return the
 * published levels and change flags. */
static const double psi_for_level[4] = {0.0, 0.05, 0.15, 0.40};

static int feed(mg_pressure_t *p, int raw, int *changed)
{
    mg_sample_t s = with_psi(psi_for_level[raw]);
    *changed = mg_pressure_update(p, &s);
    return s.level;
}

static void test_hysteresis(void)
{
    mg_pressure_t p;
    mg_pressure_opts_t o = opts(3);
    int ch;
    CHECK_EQ(mg_pressure_init(&p, &o), 0);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_OK);
    CHECK_EQ(ch, 0);
    /* up at once, even straight to CRITICAL */
    CHECK_EQ(feed(&p, MG_LEVEL_CRITICAL, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(ch, 1);
    /* two calm samples are not enough */
    CHECK_EQ(feed(&p, MG_LEVEL_HIGH, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(ch, 0);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(ch, 0);
    /* a sample back at the level restarts the count */
    CHECK_EQ(feed(&p, MG_LEVEL_CRITICAL, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(ch, 0);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(feed(&p, MG_LEVEL_ELEVATED, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(ch, 0);
    /* the third calm sample steps down to the highest level among the three */
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_ELEVATED);
    CHECK_EQ(ch, 1);
    /* from ELEVATED: three OK samples step down to OK */
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_ELEVATED);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_ELEVATED);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_OK);
    CHECK_EQ(ch, 1);
    /* raw level equal to the level is not calm */
    CHECK_EQ(feed(&p, MG_LEVEL_HIGH, &ch), MG_LEVEL_HIGH);
    for (int i = 0; i < 10; i++)
        CHECK_EQ(feed(&p, MG_LEVEL_HIGH, &ch), MG_LEVEL_HIGH);
    CHECK_EQ(ch, 0);
    /* rising during the calm count goes up at once */
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_HIGH);
    CHECK_EQ(feed(&p, MG_LEVEL_CRITICAL, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(ch, 1);
    /* and the calm count after it starts from zero */
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_OK);
    CHECK_EQ(ch, 1);

    /* calm_samples 1: down on the first calm sample, to that sample's level */
    o = opts(1);
    mg_pressure_init(&p, &o);
    CHECK_EQ(feed(&p, MG_LEVEL_CRITICAL, &ch), MG_LEVEL_CRITICAL);
    CHECK_EQ(feed(&p, MG_LEVEL_ELEVATED, &ch), MG_LEVEL_ELEVATED);
    CHECK_EQ(ch, 1);
    CHECK_EQ(feed(&p, MG_LEVEL_OK, &ch), MG_LEVEL_OK);
}

/* A long pseudo-random walk against a direct model of the rule. */
static void test_hysteresis_random(void)
{
    for (uint32_t calm = 1; calm <= 6; calm++) {
        mg_pressure_t p;
        mg_pressure_opts_t o = opts(calm);
        mg_pressure_init(&p, &o);
        int level = 0, bad = 0;
        int window[8], nwin = 0;
        for (int i = 0; i < 20000; i++) {
            int raw = (int)(mgt_rand() % 4);
            int ch, before = level;
            if (raw >= level) {
                level = raw;
                nwin = 0;
            } else {
                window[nwin++] = raw;
                if ((uint32_t)nwin == calm) {
                    int hi = 0;
                    for (int j = 0; j < nwin; j++)
                        hi = window[j] > hi ? window[j] : hi;
                    level = hi;
                    nwin = 0;
                }
            }
            int got = feed(&p, raw, &ch);
            if (got != level || ch != (level != before))
                bad++;
        }
        CHECK_EQ(bad, 0);
    }
}

int main(void)
{
    mgt_begin();
    RUN(test_defaults_and_checks);
    RUN(test_budget_signal);
    RUN(test_headroom_signal);
    RUN(test_rate_signals);
    RUN(test_reasons);
    RUN(test_hysteresis);
    RUN(test_hysteresis_random);
    return mgt_result();
}
