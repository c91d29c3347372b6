/* The micro-batch planner: option checks, fit() under the constraints, the
 * starting size, shrinking on pressure and OOM, growth after calm steps to
 * balanced sizes, failed sizes and the model, fixed mode, small batches,
 * and the constraints on every decision of a long pseudo-random run. */
#include <stdint.h>

#include "memguard/memguard-planner.h"
#include "mgtest.h"

enum { OK = MG_LEVEL_OK, ELEV = MG_LEVEL_ELEVATED, HIGH = MG_LEVEL_HIGH, CRIT = MG_LEVEL_CRITICAL };

static mg_planner_opts_t opts(void)
{
    mg_planner_opts_t o;
    mg_planner_opts_default(&o);
    return o;
}

/* A planner that must initialise. */
static mg_planner_t planner(mg_planner_opts_t o, uint64_t micro)
{
    mg_planner_t p;
    memset(&p, 0xA5, sizeof(p)); /* init must set every field */
    CHECK_EQ(mg_planner_init(&p, &o, micro), 0);
    return p;
}

/* One step boundary that must succeed; the micro-batch size it gives. */
static uint64_t begin(mg_planner_t *p, uint64_t batch, int level)
{
    uint64_t m = 0xDEADBEEF;
    CHECK_EQ(mg_planner_begin(p, batch, level, &m), 0);
    return m;
}

/* @p n calm boundaries at @p batch; the last size. */
static uint64_t calm(mg_planner_t *p, uint64_t batch, int n)
{
    uint64_t m = 0;
    for (int i = 0; i < n; i++)
        m = begin(p, batch, OK);
    return m;
}

/* OOM at @p micro; the size to retry at, or 0 for ENOMEM (checked). */
static uint64_t oom(mg_planner_t *p, uint64_t micro)
{
    uint64_t next = 0xDEADBEEF;
    int rc = mg_planner_oom(p, micro, &next);
    if (rc) {
        CHECK_EQ(rc, ENOMEM);
        CHECK_EQ(next, 0xDEADBEEF); /* untouched on ENOMEM */
        return 0;
    }
    return next;
}

static uint64_t fit(const mg_planner_t *p, uint64_t x)
{
    uint64_t s = 0xDEADBEEF;
    int rc = mg_planner_fit(p, x, &s);
    if (rc) {
        CHECK_EQ(rc, ENOENT);
        CHECK_EQ(s, 0xDEADBEEF);
        return 0;
    }
    return s;
}

/* The constraints, written out independently of planner.c. */
static int allowed(const mg_planner_opts_t *o, uint64_t s)
{
    if (s < o->min_micro || s % o->multiple_of)
        return 0;
    return o->divisor_of == 0 || o->divisor_of % s == 0;
}

#define CHECK_LAST(p, act, why, f, t)                                                 \
    do {                                                                              \
        CHECK_STR(mg_plan_action_name((p)->last.action), act);                        \
        CHECK_STR(mg_plan_reason_name((p)->last.reason), why);                        \
        CHECK_EQ((p)->last.from, f);                                                  \
        CHECK_EQ((p)->last.to, t);                                                    \
    } while (0)

static void test_options(void)
{
    mg_planner_opts_t o = opts(), d;
    CHECK_EQ(o.min_micro, 1);
    CHECK_EQ(o.multiple_of, 1);
    CHECK_EQ(o.divisor_of, 0);
    CHECK_EQ(o.budget_bytes, 0);
    CHECK_NEAR(o.margin, 0.03, 0);
    CHECK_EQ(o.align, 1);
    CHECK_NEAR(o.decay, 0.98, 0);
    CHECK_EQ(o.grow_after, 8);
    CHECK_EQ(o.retry_after, 64);
    CHECK_EQ(o.fixed, 0);
    CHECK_EQ(mg_planner_opts_check(&o), 0);

    mg_planner_t p;
    d = o;
    d.min_micro = 0;
    CHECK_EQ(mg_planner_opts_check(&d), EINVAL);
    CHECK_EQ(mg_planner_init(&p, &d, 0), EINVAL);
    d = o;
    d.multiple_of = 0;
    CHECK_EQ(mg_planner_opts_check(&d), EINVAL);
    double bad_margin[] = {-0.01, 1.0, 1.5, NAN};
    for (size_t i = 0; i < sizeof(bad_margin) / sizeof(*bad_margin); i++) {
        d = o;
        d.margin = bad_margin[i];
        CHECK_EQ(mg_planner_opts_check(&d), EINVAL);
    }
    d = o;
    d.margin = 0.0;
    CHECK_EQ(mg_planner_opts_check(&d), 0);
    d.margin = 0.99;
    CHECK_EQ(mg_planner_opts_check(&d), 0);
    double bad_decay[] = {0.0, -0.5, 1.01, NAN};
    for (size_t i = 0; i < sizeof(bad_decay) / sizeof(*bad_decay); i++) {
        d = o;
        d.decay = bad_decay[i];
        CHECK_EQ(mg_planner_opts_check(&d), EINVAL);
    }
    d = o;
    d.decay = 1.0;
    CHECK_EQ(mg_planner_opts_check(&d), 0);
    d = o;
    d.grow_after = 0;
    CHECK_EQ(mg_planner_opts_check(&d), EINVAL);

    /* no divisor of 64 is a multiple of 3 */
    d = o;
    d.multiple_of = 3;
    d.divisor_of = 64;
    CHECK_EQ(mg_planner_opts_check(&d), EINVAL);
    CHECK_EQ(mg_planner_init(&p, &d, 0), EINVAL);
    /* no divisor of 64 is at least 100 */
    d = o;
    d.min_micro = 100;
    d.divisor_of = 64;
    CHECK_EQ(mg_planner_opts_check(&d), EINVAL);
    /* 48 divides 48 and is a multiple of 3 and 16 */
    d = o;
    d.multiple_of = 48;
    d.divisor_of = 48;
    CHECK_EQ(mg_planner_opts_check(&d), 0);
    /* min 5, multiple of 4, divides 64: 8 */
    d = o;
    d.min_micro = 5;
    d.multiple_of = 4;
    d.divisor_of = 64;
    CHECK_EQ(mg_planner_opts_check(&d), 0);
    /* without a divisor any min/multiple can be met */
    d = o;
    d.min_micro = 7;
    d.multiple_of = 3;
    CHECK_EQ(mg_planner_opts_check(&d), 0);

    CHECK_STR(mg_plan_action_name(MG_PLAN_HOLD), "hold");
    CHECK_STR(mg_plan_action_name(MG_PLAN_SHRINK), "shrink");
    CHECK_STR(mg_plan_action_name(MG_PLAN_GROW), "grow");
    CHECK_STR(mg_plan_action_name(3), "?");
    CHECK_STR(mg_plan_action_name(-1), "?");
    const char *reasons[] = {"start", "calm", "elevated", "high", "critical", "oom",
                             "at_min", "at_full", "grow", "model", "failed", "fixed",
                             "peer", "room", "fits", "room_back"};
    CHECK_EQ(sizeof(reasons) / sizeof(*reasons), MG_PLAN_R_COUNT);
    for (int r = 0; r < MG_PLAN_R_COUNT; r++)
        CHECK_STR(mg_plan_reason_name(r), reasons[r]);
    CHECK_STR(mg_plan_reason_name(MG_PLAN_R_COUNT), "?");
    CHECK_STR(mg_plan_reason_name(-1), "?");
}

static void test_fit(void)
{
    mg_planner_opts_t o = opts();
    o.multiple_of = 4;
    mg_planner_t p = planner(o, 0);
    CHECK_EQ(fit(&p, 10), 8);
    CHECK_EQ(fit(&p, 8), 8);
    CHECK_EQ(fit(&p, 4), 4);
    CHECK_EQ(fit(&p, 3), 0); /* ENOENT */
    CHECK_EQ(fit(&p, 0), 0);

    o = opts();
    o.min_micro = 6;
    o.multiple_of = 4;
    p = planner(o, 0);
    CHECK_EQ(fit(&p, 7), 0); /* 4 is below the minimum */
    CHECK_EQ(fit(&p, 9), 8);
    CHECK_EQ(fit(&p, 100), 100);

    o = opts();
    o.multiple_of = 4;
    o.divisor_of = 48; /* 4, 8, 12, 16, 24, 48 */
    p = planner(o, 0);
    CHECK_EQ(fit(&p, 3), 0);
    CHECK_EQ(fit(&p, 4), 4);
    CHECK_EQ(fit(&p, 11), 8);
    CHECK_EQ(fit(&p, 20), 16);
    CHECK_EQ(fit(&p, 47), 24);
    CHECK_EQ(fit(&p, 48), 48);
    CHECK_EQ(fit(&p, 1000), 48);

    /* once a batch is seen, the full batch counts as allowed */
    CHECK_EQ(begin(&p, 30, OK), 30);
    CHECK_EQ(p.full, 30);
    CHECK_EQ(fit(&p, 30), 30);
    CHECK_EQ(fit(&p, 1000), 30);
    CHECK_EQ(fit(&p, 29), 24);
    CHECK_EQ(fit(&p, 3), 0);

    o = opts();
    o.min_micro = 3;
    o.divisor_of = 64; /* 4, 8, 16, 32, 64 */
    p = planner(o, 0);
    CHECK_EQ(fit(&p, 3), 0);
    CHECK_EQ(fit(&p, 7), 4);
    CHECK_EQ(fit(&p, 63), 32);
}

static void test_start(void)
{
    mg_planner_t p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(p.step, 1);
    CHECK_EQ(p.full, 32);
    CHECK_LAST(&p, "hold", "start", 32, 32);
    CHECK_EQ(p.last.step, 0);

    /* a given starting size */
    p = planner(opts(), 8);
    CHECK_EQ(begin(&p, 32, OK), 8);
    CHECK_LAST(&p, "hold", "start", 8, 8);
    /* pressure at the first boundary: a run started under pressure shrinks
     * at once (HIGH halves, CRITICAL quarters); ELEVATED holds the start */
    p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, CRIT), 8);
    CHECK_LAST(&p, "shrink", "critical", 32, 8);
    p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, HIGH), 16);
    CHECK_LAST(&p, "shrink", "high", 32, 16);
    p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, ELEV), 32);
    CHECK_LAST(&p, "hold", "start", 32, 32);
    /* a fixed size starts as given whatever the pressure */
    mg_planner_opts_t fo = opts();
    fo.fixed = 1;
    p = planner(fo, 8);
    CHECK_EQ(begin(&p, 32, CRIT), 8);
    CHECK_LAST(&p, "hold", "start", 8, 8);
    /* a start above the batch is the batch */
    p = planner(opts(), 64);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(p.micro, 32);

    /* a start the constraints do not allow is brought to an allowed size */
    mg_planner_opts_t o = opts();
    o.multiple_of = 4;
    p = planner(o, 7);
    CHECK_EQ(begin(&p, 32, OK), 4);
    o.min_micro = 4;
    o.divisor_of = 64;
    p = planner(o, 3); /* nothing allowed below: the smallest allowed */
    CHECK_EQ(begin(&p, 32, OK), 4);

    /* begin with an empty batch is EINVAL and changes nothing */
    p = planner(opts(), 0);
    uint64_t m = 0xDEADBEEF;
    CHECK_EQ(mg_planner_begin(&p, 0, OK, &m), EINVAL);
    CHECK_EQ(m, 0xDEADBEEF);
    CHECK_EQ(p.step, 0);
    CHECK_EQ(p.full, 0);
    CHECK_EQ(begin(&p, 16, OK), 16);
    CHECK_EQ(mg_planner_begin(&p, 0, HIGH, &m), EINVAL);
    CHECK_EQ(p.step, 1);
    CHECK_EQ(p.micro, 16);
}

static void test_pressure_shrinks(void)
{
    mg_planner_t p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(begin(&p, 32, ELEV), 32);
    CHECK_LAST(&p, "hold", "elevated", 32, 32);
    CHECK_EQ(begin(&p, 32, HIGH), 16); /* half */
    CHECK_LAST(&p, "shrink", "high", 32, 16);
    CHECK_EQ(p.last.step, 2);
    CHECK_EQ(begin(&p, 32, ELEV), 16);
    CHECK_LAST(&p, "hold", "elevated", 16, 16);
    CHECK_EQ(begin(&p, 32, CRIT), 4); /* a quarter */
    CHECK_LAST(&p, "shrink", "critical", 16, 4);
    CHECK_EQ(begin(&p, 32, CRIT), 1);
    CHECK_EQ(begin(&p, 32, HIGH), 1);
    CHECK_LAST(&p, "hold", "at_min", 1, 1);
    CHECK_EQ(begin(&p, 32, CRIT), 1);
    CHECK_LAST(&p, "hold", "at_min", 1, 1);

    /* a level above CRITICAL counts as CRITICAL */
    p = planner(opts(), 0);
    begin(&p, 64, OK);
    CHECK_EQ(begin(&p, 64, 7), 16);

    /* balanced: a quarter of 30 is 7.5, and 7 takes five micro-batches as 6 does */
    p = planner(opts(), 0);
    begin(&p, 30, OK);
    CHECK_EQ(begin(&p, 30, CRIT), 6);
    CHECK_LAST(&p, "shrink", "critical", 30, 6);

    /* under the minimum: the minimum, not one less than before */
    mg_planner_opts_t o = opts();
    o.min_micro = 4;
    p = planner(o, 12);
    begin(&p, 32, OK);
    CHECK_EQ(begin(&p, 32, CRIT), 4);
    CHECK_LAST(&p, "shrink", "critical", 12, 4);
    CHECK_EQ(begin(&p, 32, HIGH), 4);
    CHECK_LAST(&p, "hold", "at_min", 4, 4);

    /* multiples of 3: half of 32 is 16, 15 takes three micro-batches, and
     * so does 12, more evenly (12+12+8, not 15+15+2) */
    o = opts();
    o.multiple_of = 3;
    p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(begin(&p, 32, HIGH), 12);
    CHECK_EQ(begin(&p, 32, HIGH), 6);
    CHECK_EQ(begin(&p, 32, HIGH), 3);
    CHECK_EQ(begin(&p, 32, HIGH), 3);
    CHECK_LAST(&p, "hold", "at_min", 3, 3);
}

static void test_oom(void)
{
    mg_planner_t p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_LAST(&p, "shrink", "oom", 32, 16);
    CHECK_EQ(p.last.step, 1); /* the step being redone */
    CHECK_EQ(p.failed, 32);
    CHECK_EQ(p.ooms, 1);
    CHECK_EQ(p.micro, 16);
    CHECK_EQ(oom(&p, 16), 8);
    CHECK_EQ(p.failed, 16); /* the smallest size that failed */
    CHECK_EQ(oom(&p, 8), 4);
    CHECK_EQ(oom(&p, 4), 2);
    CHECK_EQ(oom(&p, 2), 1);
    CHECK_EQ(oom(&p, 1), 0); /* ENOMEM: nothing smaller */
    CHECK_EQ(p.micro, 1);    /* unchanged */
    CHECK_EQ(p.ooms, 6);
    CHECK_EQ(p.failed, 1);
    CHECK_LAST(&p, "shrink", "oom", 2, 1); /* the decision before stays */
    CHECK_EQ(begin(&p, 32, OK), 1);

    /* down to a minimum and multiple */
    mg_planner_opts_t o = opts();
    o.min_micro = 4;
    o.multiple_of = 4;
    p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_EQ(oom(&p, 16), 8);
    CHECK_EQ(oom(&p, 8), 4);
    CHECK_EQ(oom(&p, 4), 0);
    CHECK_EQ(p.micro, 4);

    /* half of 4 is under the minimum 3: the minimum */
    o = opts();
    o.min_micro = 3;
    p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_EQ(oom(&p, 16), 8);
    CHECK_EQ(oom(&p, 8), 4);
    CHECK_EQ(oom(&p, 4), 3);
    CHECK_EQ(oom(&p, 3), 0);
    CHECK_EQ(p.micro, 3);

    /* an OOM at a batch smaller than the plan shrinks from that batch */
    p = planner(opts(), 0);
    begin(&p, 32, OK);
    CHECK_EQ(begin(&p, 10, OK), 10);
    CHECK_EQ(oom(&p, 10), 5);
    CHECK_EQ(p.failed, 10);
    CHECK_EQ(begin(&p, 32, OK), 5);

    /* an OOM before any step: the constraints alone */
    o = opts();
    o.min_micro = 3;
    o.multiple_of = 4;
    p = planner(o, 0);
    CHECK_EQ(oom(&p, 5), 4); /* half is 2, under the minimum: the smallest allowed */
    CHECK_EQ(oom(&p, 4), 0);
    CHECK_EQ(p.micro, 4);
    CHECK_EQ(begin(&p, 32, OK), 4);

    /* an OOM at 0 (nothing known) cannot shrink */
    p = planner(opts(), 0);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 0), 0);
    CHECK_EQ(p.micro, 32);
    CHECK_EQ(p.failed, 0);
}

static void test_grow_after_calm(void)
{
    mg_planner_opts_t o = opts();
    o.grow_after = 4;
    mg_planner_t p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(begin(&p, 32, CRIT), 8);
    for (int i = 1; i < 4; i++) {
        CHECK_EQ(begin(&p, 32, OK), 8);
        CHECK_LAST(&p, "hold", "calm", 8, 8);
        CHECK_EQ(p.calm, i);
    }
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_LAST(&p, "grow", "grow", 8, 16);
    CHECK_EQ(p.calm, 0);
    /* ELEVATED restarts the count */
    CHECK_EQ(calm(&p, 32, 3), 16);
    CHECK_EQ(begin(&p, 32, ELEV), 16);
    CHECK_EQ(p.calm, 0);
    CHECK_EQ(calm(&p, 32, 3), 16);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_LAST(&p, "grow", "grow", 16, 32);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_LAST(&p, "hold", "at_full", 32, 32);
    CHECK_EQ(calm(&p, 32, 20), 32);

    /* the default: 8 calm boundaries */
    p = planner(opts(), 0);
    begin(&p, 32, OK);
    begin(&p, 32, HIGH);
    CHECK_EQ(calm(&p, 32, 7), 16);
    CHECK_EQ(begin(&p, 32, OK), 32);
}

static void test_balanced_growth(void)
{
    /* full 33 at 16 takes three micro-batches; 17 takes two */
    mg_planner_opts_t o = opts();
    o.grow_after = 1;
    mg_planner_t p = planner(o, 16);
    begin(&p, 33, OK);
    CHECK_EQ(begin(&p, 33, OK), 17);
    CHECK_LAST(&p, "grow", "grow", 16, 17);
    CHECK_EQ(begin(&p, 33, OK), 33);

    /* full 32 with 32 failed: 31 would still need two, so 16 holds */
    p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 32), 16);
    for (int i = 0; i < 10; i++) {
        CHECK_EQ(begin(&p, 32, OK), 16);
        CHECK_LAST(&p, "hold", "failed", 16, 16);
    }

    /* full 48 at 16 with 48 failed: two micro-batches of 24 */
    p = planner(o, 0);
    begin(&p, 48, OK);
    CHECK_EQ(oom(&p, 48), 24);
    CHECK_EQ(oom(&p, 24), 12);
    p.failed = 48; /* as if only 48 had failed */
    CHECK_EQ(begin(&p, 48, OK), 24);
    CHECK_LAST(&p, "grow", "grow", 12, 24);
    CHECK_EQ(begin(&p, 48, OK), 24);
    CHECK_LAST(&p, "hold", "failed", 24, 24);

    /* sizes that divide 9 lie three times apart: growth still reaches 9 */
    o.divisor_of = 9;
    p = planner(o, 0);
    begin(&p, 9, OK);
    CHECK_EQ(begin(&p, 9, HIGH), 3);
    CHECK_EQ(begin(&p, 9, CRIT), 1);
    CHECK_EQ(begin(&p, 9, OK), 3);
    CHECK_LAST(&p, "grow", "grow", 1, 3);
    CHECK_EQ(begin(&p, 9, OK), 9);
    CHECK_LAST(&p, "grow", "grow", 3, 9);
    /* and from 3 of a full 20 to 9 */
    p = planner(o, 3);
    begin(&p, 20, OK);
    CHECK_EQ(begin(&p, 20, OK), 9);
    CHECK_EQ(begin(&p, 20, OK), 20);
}

static void test_failed_size_waits(void)
{
    mg_planner_opts_t o = opts();
    o.grow_after = 2;
    o.retry_after = 10;
    mg_planner_t p = planner(o, 0);
    begin(&p, 32, OK);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_LAST(&p, "hold", "calm", 16, 16);
    for (int i = 2; i < 10; i++) {
        CHECK_EQ(begin(&p, 32, OK), 16);
        CHECK_LAST(&p, "hold", "failed", 16, 16);
        CHECK_EQ(p.calm_since_fail, i);
        CHECK_EQ(p.failed, 32);
    }
    CHECK_EQ(begin(&p, 32, OK), 32); /* the tenth calm boundary */
    CHECK_LAST(&p, "grow", "grow", 16, 32);
    CHECK_EQ(p.failed, 0);

    /* pressure does not count towards the retry, nor restart it */
    p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_EQ(calm(&p, 32, 5), 16);
    CHECK_EQ(begin(&p, 32, ELEV), 16);
    CHECK_EQ(p.calm_since_fail, 5);
    CHECK_EQ(calm(&p, 32, 4), 16);
    CHECK_EQ(p.failed, 32);
    CHECK_EQ(begin(&p, 32, OK), 32);

    /* another OOM restarts the wait and keeps the smallest failed size */
    p = planner(o, 0);
    begin(&p, 32, OK);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_EQ(calm(&p, 32, 9), 16);
    CHECK_EQ(oom(&p, 16), 8);
    CHECK_EQ(p.calm_since_fail, 0);
    CHECK_EQ(p.failed, 16);
    CHECK_EQ(calm(&p, 32, 2), 11); /* under 16, balanced: 11+11+10 */
    CHECK_LAST(&p, "grow", "grow", 8, 11);
    CHECK_EQ(calm(&p, 32, 7), 11);
    CHECK_LAST(&p, "hold", "failed", 11, 11);
    CHECK_EQ(p.failed, 16);
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_LAST(&p, "grow", "grow", 11, 16);
    CHECK_EQ(p.failed, 0);
}

static void test_model(void)
{
    const double a = 1e9, b = 1e8; /* peak = 1 GB + 100 MB per sample */
    mg_planner_opts_t o = opts();
    o.grow_after = 2;
    o.margin = 0.1; /* exact peaks: the margin stays at its least */
    mg_planner_t p = planner(o, 0);
    uint64_t bytes = 0xDEADBEEF;
    CHECK_EQ(mg_planner_predict(&p, 8, &bytes), ENODATA);
    CHECK_EQ(bytes, 0xDEADBEEF);
    mg_planner_end(&p, 8, 0, 0); /* unknown peaks are not data */
    mg_planner_end(&p, 0, 5000, 0);
    CHECK_EQ(mg_planner_predict(&p, 8, &bytes), ENODATA);

    /* one size only: proportional (a line through the origin) */
    mg_planner_end(&p, 10, 2000000000, 0);
    CHECK_EQ(mg_planner_predict(&p, 10, &bytes), 0);
    CHECK_NEAR((double)bytes, 2e9, 2);
    CHECK_EQ(mg_planner_predict(&p, 20, &bytes), 0);
    CHECK_NEAR((double)bytes, 4e9, 4);
    /* ... or, with the floors known, the line through the mean floor */
    mg_planner_end(&p, 10, 2000000000, 1000000000);
    mg_planner_end(&p, 10, 2000000000, 0); /* an unknown floor is no information */
    CHECK_EQ(mg_planner_predict(&p, 0, &bytes), 0);
    CHECK_NEAR((double)bytes, 1e9, 2);
    CHECK_EQ(mg_planner_predict(&p, 20, &bytes), 0);
    CHECK_NEAR((double)bytes, 3e9, 4);
    /* a floor at or above the peak is not one */
    p = planner(o, 0);
    mg_planner_end(&p, 10, 2000000000, 2000000000);
    CHECK_EQ(mg_planner_predict(&p, 20, &bytes), 0);
    CHECK_NEAR((double)bytes, 4e9, 4);

    /* the line through sizes 64, 32, 16 */
    p = planner(o, 0);
    uint64_t m = begin(&p, 64, OK);
    CHECK_EQ(m, 64);
    mg_planner_end(&p, m, (uint64_t)(a + b * (double)m), 0);
    m = begin(&p, 64, HIGH);
    CHECK_EQ(m, 32);
    mg_planner_end(&p, m, (uint64_t)(a + b * (double)m), 0);
    m = begin(&p, 64, HIGH);
    CHECK_EQ(m, 16);
    mg_planner_end(&p, m, (uint64_t)(a + b * (double)m), 0);
    for (uint64_t x = 1; x <= 128; x *= 2) {
        CHECK_EQ(mg_planner_predict(&p, x, &bytes), 0);
        CHECK_NEAR((double)bytes, a + b * (double)x, 1e3);
    }

    /* budget: (0.9 B - a) / b = 22.5, so 22 is the largest size under it.
     * A full batch of 1000 makes 22 balanced (46 micro-batches) and 26,
     * where budget B itself would stop, balanced too. */
    const double lim = 22.5;
    p = planner(o, 16);
    CHECK_EQ(begin(&p, 1000, OK), 16);
    for (uint64_t x = 8; x <= 16; x += 4)
        mg_planner_end(&p, x, (uint64_t)(a + b * (double)x), 0);
    p.opts.budget_bytes = (uint64_t)((a + b * lim) / 0.9);
    CHECK_EQ(begin(&p, 1000, OK), 16);
    CHECK_LAST(&p, "hold", "calm", 16, 16);
    m = begin(&p, 1000, OK);
    CHECK_EQ(m, 22);
    CHECK_LAST(&p, "grow", "grow", 16, 22);
    mg_planner_end(&p, m, (uint64_t)(a + b * (double)m), 0);
    for (int i = 0; i < 10; i++) {
        m = begin(&p, 1000, OK);
        CHECK_EQ(m, 22);
        CHECK_EQ(p.calm, i + 1);
        mg_planner_end(&p, m, (uint64_t)(a + b * (double)m), 0);
    }
    CHECK_LAST(&p, "hold", "model", 22, 22);
    uint64_t y22, y23;
    CHECK_EQ(mg_planner_predict(&p, 22, &y22), 0);
    CHECK_EQ(mg_planner_predict(&p, 23, &y23), 0);
    double room = (double)p.opts.budget_bytes * (1.0 - p.opts.margin);
    CHECK((double)y22 <= room);
    CHECK((double)y23 > room);

    /* a larger budget: the whole batch fits, and growth goes there at once */
    p.opts.budget_bytes = (uint64_t)((a + b * 1000.0) / 0.9) + 1000;
    CHECK_EQ(begin(&p, 1000, OK), 1000);
    CHECK_LAST(&p, "grow", "grow", 22, 1000);

    /* a budget under the fixed part: down to the smallest size */
    p = planner(o, 0);
    begin(&p, 64, OK);
    begin(&p, 64, HIGH);
    mg_planner_end(&p, 32, (uint64_t)(a + b * 32), 0);
    mg_planner_end(&p, 64, (uint64_t)(a + b * 64), 0);
    p.opts.budget_bytes = (uint64_t)(a / 2);
    CHECK_EQ(begin(&p, 64, OK), 1);
    CHECK_LAST(&p, "shrink", "room", 32, 1);
    CHECK_EQ(calm(&p, 64, 5), 1);
    CHECK_LAST(&p, "hold", "at_min", 1, 1);

    /* decay: after the peaks double, the prediction follows the new data */
    p = planner(o, 0);
    for (int i = 0; i < 50; i++) {
        mg_planner_end(&p, 8, (uint64_t)(a + b * 8), 0);
        mg_planner_end(&p, 16, (uint64_t)(a + b * 16), 0);
    }
    for (int i = 0; i < 400; i++) {
        mg_planner_end(&p, 8, (uint64_t)(2 * (a + b * 8)), 0);
        mg_planner_end(&p, 16, (uint64_t)(2 * (a + b * 16)), 0);
    }
    CHECK_EQ(mg_planner_predict(&p, 32, &bytes), 0);
    CHECK_NEAR((double)bytes / (2 * (a + b * 32)), 1.0, 1e-3);
}

/* The live room: the planner jumps to the largest size that fits, in one
 * decision, when the room falls or pressure rises, and grows back to it
 * when the room returns; it halves where it has no model. */
static void test_room_jumps(void)
{
    const double a = 100e6, b = 75e6; /* 100 MB + 75 MB per sample */
    mg_planner_opts_t o = opts();
    o.grow_after = 3;
    o.margin = 0.1;
    mg_planner_t p = planner(o, 0);
    uint64_t fits = 0xDEADBEEF;
    CHECK_EQ(mg_planner_room_fit(&p, &fits), ENODATA); /* no budget, no model */
    CHECK_EQ(fits, 0xDEADBEEF);
    mg_planner_set_budget(&p, 5000000000ULL);
    CHECK_EQ(mg_planner_room_fit(&p, &fits), ENODATA); /* no model yet */

    /* at the whole batch, floors known: one size is enough to jump */
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(begin(&p, 32, OK), 32);
        mg_planner_end(&p, 32, (uint64_t)(a + b * 32), (uint64_t)a);
    }
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 32);
    /* the room falls to 1.3 GB: (0.9 * 1.3e9 - 1e8) / 7.5e7 = 14.3: 14
     * fits, 11 balances 32 (three micro-batches either way) */
    mg_planner_set_budget(&p, 1300000000ULL);
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 11);
    CHECK_EQ(begin(&p, 32, OK), 11);
    CHECK_LAST(&p, "shrink", "room", 32, 11);
    mg_planner_end(&p, 11, (uint64_t)(a + b * 11), (uint64_t)a);
    /* HIGH where the size fits: held, not halved */
    CHECK_EQ(begin(&p, 32, HIGH), 11);
    CHECK_LAST(&p, "hold", "fits", 11, 11);
    CHECK_EQ(begin(&p, 32, CRIT), 11);
    CHECK_LAST(&p, "hold", "fits", 11, 11);
    /* HIGH with less room: the size that fits, in one decision */
    mg_planner_set_budget(&p, 500000000ULL);
    CHECK_EQ(begin(&p, 32, HIGH), 4); /* 4.7: 4 fits; 4 takes 8 micro-batches */
    CHECK_LAST(&p, "shrink", "high", 11, 4);
    /* an OOM: half at least (the model was wrong), less where the room
     * says; the margin widens by what the model under-predicted, 1e8 of
     * 5e8 */
    CHECK_EQ(oom(&p, 4), 2);
    CHECK_LAST(&p, "shrink", "oom", 4, 2);
    CHECK_NEAR(p.margin, 0.1 + 0.2, 1e-9);
    mg_planner_set_budget(&p, 150000000ULL);
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 0); /* not even 1 fits: 0.135e9 - 0.1e9 < 0.75e8 */
    CHECK_EQ(oom(&p, 2), 1);
    CHECK_EQ(begin(&p, 32, OK), 1);
    CHECK_LAST(&p, "hold", "at_min", 1, 1);
    /* the room comes back by a quarter and more since the last shrink
     * (and since the size 2 failed): straight to what fits, without
     * waiting for calm steps */
    mg_planner_set_budget(&p, 180000000ULL); /* +20 %: not back */
    CHECK_EQ(begin(&p, 32, OK), 1);
    CHECK_EQ(p.failed, 2);
    mg_planner_set_budget(&p, 5000000000ULL);
    CHECK_EQ(begin(&p, 32, ELEV), 32);
    CHECK_LAST(&p, "grow", "room_back", 1, 32);
    CHECK_EQ(p.shrunk_room, 0);
    CHECK_EQ(p.failed, 0);
    /* steady steps narrow the margin back to its least */
    for (int i = 0; i < 60; i++)
        mg_planner_end(&p, 32, (uint64_t)(a + b * 32), (uint64_t)a);
    CHECK_NEAR(p.margin, 0.1, 1e-3);
    /* after calm steps, growth goes to what fits too */
    mg_planner_set_budget(&p, 1300000000ULL);
    CHECK_EQ(begin(&p, 32, OK), 11);
    CHECK_EQ(p.shrunk_room, 1300000000ULL);
    mg_planner_set_budget(&p, 1500000000ULL); /* 17 fits, 16 balances; +15 % */
    CHECK_EQ(calm(&p, 32, 2), 11);
    CHECK_LAST(&p, "hold", "calm", 11, 11);
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_LAST(&p, "grow", "grow", 11, 16);

    /* without a budget: halving and doubling, as before the model */
    p = planner(o, 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    mg_planner_end(&p, 32, (uint64_t)(a + b * 32), (uint64_t)a);
    CHECK_EQ(begin(&p, 32, HIGH), 16);
    CHECK_LAST(&p, "shrink", "high", 32, 16);
    CHECK_EQ(begin(&p, 32, CRIT), 4);
    CHECK_EQ(calm(&p, 32, 3), 8);
    CHECK_LAST(&p, "grow", "grow", 4, 8);
    /* a budget but no model: the same */
    p = planner(o, 0);
    mg_planner_set_budget(&p, 1000);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(begin(&p, 32, HIGH), 16);
    CHECK_LAST(&p, "shrink", "high", 32, 16);
}

/* A first batch smaller than the ones after it: the steps that ran whole
 * run whole again at the larger batch, even after the small one ran out
 * of memory (it gave up: nothing smaller), instead of growing back from
 * its size one doubling at a time. */
static void test_larger_batch_starts_whole(void)
{
    mg_planner_t p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 1, OK), 1);
    CHECK_EQ(begin(&p, 64, OK), 64);
    CHECK_EQ(begin(&p, 64, OK), 64);
    /* the first batch of 1 ran out of memory: no smaller size, given up */
    p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 1, OK), 1);
    CHECK_EQ(oom(&p, 1), 0);
    CHECK_EQ(begin(&p, 64, OK), 64);
    CHECK_EQ(p.failed, 0);
    /* a split plan is kept (what ran split still needs splitting) */
    p = planner(opts(), 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(begin(&p, 32, HIGH), 16);
    CHECK_EQ(begin(&p, 64, ELEV), 16);
    /* and a fixed size stays fixed */
    mg_planner_opts_t o = opts();
    o.fixed = 1;
    p = planner(o, 4);
    CHECK_EQ(begin(&p, 4, OK), 4);
    CHECK_EQ(begin(&p, 64, OK), 4);
}

static void test_fixed(void)
{
    mg_planner_opts_t o = opts();
    o.fixed = 1;
    o.grow_after = 1;
    o.retry_after = 1;
    mg_planner_t p = planner(o, 16);
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_LAST(&p, "hold", "start", 16, 16);
    int levels[] = {HIGH, CRIT, ELEV, OK, OK, CRIT, OK};
    for (size_t i = 0; i < sizeof(levels) / sizeof(*levels); i++) {
        CHECK_EQ(begin(&p, 32, levels[i]), 16);
        CHECK_LAST(&p, "hold", "fixed", 16, 16);
    }
    CHECK_EQ(oom(&p, 16), 8);
    CHECK_LAST(&p, "shrink", "oom", 16, 8);
    CHECK_EQ(calm(&p, 32, 20), 8); /* no growth back */
    CHECK_LAST(&p, "hold", "fixed", 8, 8);
}

static void test_small_batches(void)
{
    mg_planner_t p = planner(opts(), 0);
    begin(&p, 32, OK);
    CHECK_EQ(begin(&p, 32, HIGH), 16);
    CHECK_EQ(begin(&p, 10, OK), 10); /* a short last batch: in one piece */
    CHECK_EQ(p.micro, 16);
    CHECK_EQ(p.full, 32);
    CHECK_EQ(begin(&p, 20, OK), 16);
    CHECK_EQ(begin(&p, 1, CRIT), 1);
    CHECK_EQ(p.micro, 4); /* the plan still shrank */

    /* a batch larger than any before, after whole steps: whole again (the
     * full batch counts as allowed) */
    mg_planner_opts_t o = opts();
    o.multiple_of = 4;
    p = planner(o, 0);
    CHECK_EQ(begin(&p, 10, OK), 10);
    CHECK_EQ(begin(&p, 16, OK), 16);
    CHECK_EQ(p.full, 16);
    /* split steps keep to allowed sizes */
    CHECK_EQ(begin(&p, 16, HIGH), 8);
    CHECK_EQ(begin(&p, 30, ELEV), 8);
    o.min_micro = 8;
    p = planner(o, 0);
    CHECK_EQ(begin(&p, 6, OK), 6);
    CHECK_EQ(begin(&p, 32, OK), 32);
    /* a start under the minimum, and a batch under it too: the batch */
    o = opts();
    o.min_micro = 3;
    o.multiple_of = 2;
    p = planner(o, 1);
    CHECK_EQ(begin(&p, 2, OK), 2);
    CHECK_EQ(p.micro, 2); /* the plan never exceeds the full batch */
    CHECK_EQ(begin(&p, 9, OK), 9);
}

/* Numerical Recipes' 64-bit LCG; the high bits. */
static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

/* One long run under @p o: batches mostly full, some short, a few larger;
 * random levels, OOMs and peaks. Every size honours the constraints. */
static void run_random(mg_planner_opts_t o, int id, uint64_t seed, int steps)
{
    mg_planner_t p = planner(o, lcg(&seed) % 3 ? 0 : 1 + lcg(&seed) % 80 / (1 + id % 3 * 20));
    int bad = 0;
    for (int i = 0; i < steps && bad < 5; i++) {
        int before = mgt_failures;
        uint64_t r = lcg(&seed) % 100;
        uint64_t batch = r < 80 ? 64 : r < 95 ? 1 + lcg(&seed) % 64 : 1 + lcg(&seed) % 96;
        if (i == 0 && id % 2)
            batch = 1 + lcg(&seed) % 8; /* a small first batch, larger ones later */
        r = lcg(&seed) % 100;
        int level = r < 60 ? OK : r < 75 ? ELEV : r < 92 ? HIGH : CRIT;
        uint64_t m = begin(&p, batch, level);
        CHECK(m >= 1 && m <= batch);
        CHECK(m == batch || allowed(&o, m));
        CHECK(p.micro <= p.full);
        CHECK(p.micro == p.full || allowed(&o, p.micro));
        if (p.last.action == MG_PLAN_GROW)
            CHECK(p.failed == 0 || p.last.to < p.failed);
        if (p.last.reason == MG_PLAN_R_AT_MIN)
            CHECK_EQ(fit(&p, p.micro - 1), 0); /* nothing smaller allowed */
        if (o.fixed)
            CHECK(p.last.action == MG_PLAN_HOLD);
        while (lcg(&seed) % 100 < 7) {
            uint64_t next = 0xDEADBEEF;
            int rc = mg_planner_oom(&p, m, &next);
            if (rc) {
                CHECK_EQ(rc, ENOMEM);
                CHECK_EQ(next, 0xDEADBEEF);
                CHECK_EQ(fit(&p, m - 1), 0); /* nothing smaller was allowed */
                break;
            }
            CHECK(next < m);
            CHECK(allowed(&o, next) || next == p.full);
            CHECK_EQ(next, p.micro);
            m = next;
        }
        if (lcg(&seed) % 4)
            mg_planner_end(&p, m, 1000000 + m * 50000 + lcg(&seed) % 100000, 0);
        if (mgt_failures != before) {
            bad++;
            printf("  case %d step %d: batch %llu level %d -> %llu\n", id,
                   i, (unsigned long long)batch, level,
                   (unsigned long long)m);
        }
    }
}

/* The same inputs twice, and a copy taken midway replaying the rest: the
 * same decisions (the planner is plain data with no hidden state). */
/* The room of a replayed run: 4 MB, and 6 MB every other 50 steps. */
static uint64_t room(int i)
{
    return i / 50 % 2 ? 6000000 : 4000000;
}

static void test_replay_and_copy(void)
{
    mg_planner_opts_t o = opts();
    o.multiple_of = 2;
    o.grow_after = 3;
    o.retry_after = 20;
    enum { N = 2000 };
    static uint64_t sizes[3][N];
    static int levels[N];
    static uint64_t batches[N];
    uint64_t seed = 42;
    for (int i = 0; i < N; i++) {
        batches[i] = lcg(&seed) % 10 ? 48 : 1 + lcg(&seed) % 48;
        uint64_t r = lcg(&seed) % 10;
        levels[i] = r < 7 ? OK : r < 8 ? ELEV : r < 9 ? HIGH : CRIT;
    }
    mg_planner_t p[2], mid;
    p[0] = planner(o, 0);
    p[1] = planner(o, 0);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < N; i++) {
            if (k == 0 && i == N / 2)
                mid = p[0];
            mg_planner_set_budget(&p[k], room(i));
            uint64_t m = begin(&p[k], batches[i], levels[i]);
            if (i % 97 == 5) {
                uint64_t n;
                if (mg_planner_oom(&p[k], m, &n) == 0)
                    m = n;
            }
            mg_planner_end(&p[k], m, 1000000 + 60000 * m, 0);
            sizes[k][i] = m;
        }
    }
    for (int i = N / 2; i < N; i++) {
        mg_planner_set_budget(&mid, room(i));
        uint64_t m = begin(&mid, batches[i], levels[i]);
        if (i % 97 == 5) {
            uint64_t n;
            if (mg_planner_oom(&mid, m, &n) == 0)
                m = n;
        }
        mg_planner_end(&mid, m, 1000000 + 60000 * m, 0);
        sizes[2][i] = m;
    }
    int same = 1, same_mid = 1, changes = 0;
    for (int i = 0; i < N; i++) {
        same &= sizes[0][i] == sizes[1][i];
        if (i >= N / 2)
            same_mid &= sizes[0][i] == sizes[2][i];
        changes += i && sizes[0][i] != sizes[0][i - 1];
    }
    CHECK(same);
    CHECK(same_mid);
    CHECK(changes > 100); /* the run did exercise the planner */
    printf("  %d changes of size in %d steps\n", changes, N);
    CHECK_EQ(p[0].micro, p[1].micro);
    CHECK_EQ(p[0].ooms, p[1].ooms);
    CHECK_NEAR(p[0].sxy, p[1].sxy, 0);
    CHECK_EQ(mid.micro, p[0].micro);
    CHECK_EQ(mid.step, p[0].step);
    CHECK_NEAR(mid.sxy, p[0].sxy, 0);
}

static void test_random_constraints(void)
{
    struct {
        uint64_t min, mult, div;
        int fixed;
    } cases[] = {
        {1, 1, 0, 0},  {1, 4, 0, 0},  {3, 1, 0, 0},  {5, 4, 0, 0},   {1, 1, 64, 0},
        {3, 1, 64, 0}, {1, 3, 48, 0}, {2, 1, 9, 0},  {1, 1, 27, 0},  {4, 4, 96, 0},
        {6, 1, 0, 0},  {1, 8, 0, 1},  {1, 1, 7, 0},  {10, 5, 100, 0}, {1, 1, 0, 1},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(*cases); c++) {
        mg_planner_opts_t o = opts();
        o.min_micro = cases[c].min;
        o.multiple_of = cases[c].mult;
        o.divisor_of = cases[c].div;
        o.fixed = cases[c].fixed;
        o.grow_after = 1 + (uint32_t)(c % 4);
        o.retry_after = 5 + 7 * (uint32_t)(c % 3);
        o.budget_bytes = c % 2 ? 3000000 : 0;
        CHECK_EQ(mg_planner_opts_check(&o), 0);
        run_random(o, (int)c, 1000 + c, 3000);
    }
}

/* Ranks agree on the smallest proposal: a planner adopts it, and a peer's
 * OOM size holds growth back as its own would. */
static void test_agree(void)
{
    mg_planner_opts_t o = opts();
    o.grow_after = 2;
    o.retry_after = 6;
    mg_planner_t p = planner(o, 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(mg_planner_agree(&p, 0, 0), EINVAL);
    CHECK_EQ(mg_planner_agree(&p, 32, 0), 0); /* its own size: nothing changes */
    CHECK_LAST(&p, "hold", "start", 32, 32);
    CHECK_EQ(mg_planner_agree(&p, 8, 32), 0); /* a peer ran out of memory at 32 */
    CHECK_LAST(&p, "shrink", "peer", 32, 8);
    CHECK_EQ(p.last.step, 0);
    CHECK_EQ(p.micro, 8);
    CHECK_EQ(p.failed, 32);
    CHECK_EQ(p.ooms, 0); /* not this rank's */
    CHECK_EQ(begin(&p, 32, OK), 8);
    CHECK_EQ(begin(&p, 32, OK), 16); /* grows, but not back to the failed 32 */
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_LAST(&p, "hold", "failed", 16, 16);
    CHECK_EQ(begin(&p, 32, OK), 16);
    CHECK_EQ(begin(&p, 32, OK), 32); /* retry_after calm steps later */
    /* a larger agreement than the plan (not from a MIN reduction) is taken too */
    CHECK_EQ(mg_planner_agree(&p, 4, 0), 0);
    CHECK_EQ(mg_planner_agree(&p, 16, 0), 0);
    CHECK_LAST(&p, "grow", "peer", 4, 16);
}

/* The margin is learnt: at its least while the model predicts exactly,
 * twice the model's root-mean-square error (a share of the room) when peaks
 * scatter, widened by an out-of-memory error at a size the model said fits,
 * and narrowed back by steady steps. */
static void test_learnt_margin(void)
{
    const double a = 1e9, b = 1e8, room = 10e9;
    mg_planner_t p = planner(opts(), 0);
    mg_planner_set_budget(&p, (uint64_t)room);
    for (int i = 0; i < 50; i++) {
        mg_planner_end(&p, 16, (uint64_t)(a + b * 16), (uint64_t)a);
        mg_planner_end(&p, 32, (uint64_t)(a + b * 32), (uint64_t)a);
    }
    CHECK_NEAR(p.margin, 0.03, 1e-6);
    /* peaks 1 % of the room above and below the line, in turn: about 2 % */
    for (int i = 0; i < 400; i++) {
        double e = (i % 2 ? 1.0 : -1.0) * 0.01 * room;
        mg_planner_end(&p, 16, (uint64_t)(a + b * 16 + e), (uint64_t)a);
        mg_planner_end(&p, 32, (uint64_t)(a + b * 32 - e), (uint64_t)a);
    }
    CHECK_NEAR(p.margin, 0.03, 1e-6); /* 2 x 1 % is under the least */
    for (int i = 0; i < 400; i++) {
        double e = (i % 2 ? 1.0 : -1.0) * 0.04 * room;
        mg_planner_end(&p, 16, (uint64_t)(a + b * 16 + e), (uint64_t)a);
        mg_planner_end(&p, 32, (uint64_t)(a + b * 32 - e), (uint64_t)a);
    }
    CHECK(p.margin > 0.06 && p.margin < 0.09); /* about 2 x 4 % */

    /* an OOM at a size said to fit: wider by what it under-predicted */
    p = planner(opts(), 0);
    mg_planner_set_budget(&p, (uint64_t)room);
    CHECK_EQ(begin(&p, 64, OK), 64);
    for (int i = 0; i < 10; i++)
        mg_planner_end(&p, 64, (uint64_t)(a + b * 64), (uint64_t)a); /* 7.4 GB */
    double before = p.margin;
    CHECK_NEAR(before, 0.03, 1e-6);
    CHECK_EQ(oom(&p, 64), 32);
    CHECK_NEAR(p.margin, 0.03 + 0.25, 1e-6); /* 0.26 under: a quarter at most */
    CHECK_EQ(p.failed_room, (uint64_t)room);
    /* an OOM the model did not vouch for leaves the margin */
    double wide = p.margin;
    mg_planner_set_budget(&p, 2000000000ULL); /* 1 GB + 16 samples do not fit */
    CHECK_EQ(oom(&p, 32), 4); /* the room fit: (0.72 x 2e9 - 1e9) / 1e8 = 4.4 */
    CHECK_NEAR(p.margin, wide, 0);
    /* steady steps narrow it back */
    mg_planner_set_budget(&p, (uint64_t)room);
    for (int i = 0; i < 80; i++)
        mg_planner_end(&p, 32, (uint64_t)(a + b * 32), (uint64_t)a);
    CHECK_NEAR(p.margin, 0.03, 1e-3);
    CHECK(p.margin < wide / 5);
}

/* A grow that fails goes back to the last size that ran (not half the
 * size that failed); the size that failed is a ceiling until the room
 * rises by a quarter over the room it failed in, or retry_after calm steps
 * pass, a wait that doubles each time the size let pass fails again. */
static void test_ceilings(void)
{
    const double a = 1e9, b = 1e8; /* 64 peaks at 7.4 GB, 86 at 9.6 GB */
    mg_planner_opts_t o = opts();
    o.grow_after = 2;
    o.retry_after = 20;
    mg_planner_t p = planner(o, 0);
    mg_planner_set_budget(&p, 8000000000ULL);
    CHECK_EQ(begin(&p, 256, OK), 256);
    CHECK_EQ(oom(&p, 256), 128);
    CHECK_EQ(oom(&p, 128), 64);
    CHECK_EQ(p.failed, 128);
    CHECK_EQ(p.failed_room, 8000000000ULL);
    mg_planner_end(&p, 64, (uint64_t)(a + b * 64), (uint64_t)a);
    CHECK_EQ(p.ran, 64);
    /* the model says 86 fits a room of 10 GB (9.7 GB less the margin) */
    mg_planner_set_budget(&p, 10000000000ULL); /* +25 %: 128's ceiling goes */
    CHECK_EQ(begin(&p, 256, OK), 86);
    CHECK_LAST(&p, "grow", "room_back", 64, 86);
    CHECK_EQ(p.failed, 0);
    /* ... it did not: back to 64, which ran, not 43 */
    CHECK_EQ(oom(&p, 86), 64);
    CHECK_LAST(&p, "shrink", "oom", 86, 64);
    CHECK_EQ(p.failed, 86);
    mg_planner_end(&p, 64, (uint64_t)(a + b * 64), (uint64_t)a);
    /* calm steps in the same room: 86 waits */
    mg_planner_t q = p;
    for (int i = 0; i < 12; i++) {
        CHECK_EQ(begin(&p, 256, OK), 64);
        mg_planner_end(&p, 64, (uint64_t)(a + b * 64), (uint64_t)a);
    }
    CHECK_EQ(p.failed, 86);
    /* a rise under a quarter: still waits */
    mg_planner_set_budget(&p, 12000000000ULL);
    CHECK_EQ(begin(&p, 256, OK), 64);
    CHECK_EQ(p.failed, 86);
    /* a quarter and more: the ceiling goes, the model decides */
    mg_planner_set_budget(&p, 30000000000ULL);
    CHECK_EQ(calm(&p, 256, 2), 256);
    CHECK_EQ(p.failed, 0);

    /* the same room for retry_after calm steps: 86 is let pass, once the
     * margin has narrowed back; failing again, it waits twice as long */
    for (int i = 0; i < 19; i++) {
        CHECK_EQ(begin(&q, 256, OK), 64);
        mg_planner_end(&q, 64, (uint64_t)(a + b * 64), (uint64_t)a);
    }
    CHECK_EQ(q.failed, 86);
    CHECK_EQ(begin(&q, 256, OK), 86);
    CHECK_LAST(&q, "grow", "grow", 64, 86);
    CHECK_EQ(q.retried, 86);
    CHECK_EQ(oom(&q, 86), 64);
    CHECK_EQ(q.retries, 1);
    for (int i = 0; i < 39; i++) {
        CHECK_EQ(begin(&q, 256, OK), 64);
        mg_planner_end(&q, 64, (uint64_t)(a + b * 64), (uint64_t)a);
    }
    CHECK_EQ(q.failed, 86);
    CHECK_EQ(begin(&q, 256, OK), 86);

    /* a size that ran before, failing now, is no grow: half, or the room */
    p = planner(o, 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    mg_planner_end(&p, 32, 1000, 0);
    CHECK_EQ(oom(&p, 32), 16);
    /* a grow that fails after the room fell: the room's size, if smaller */
    p = planner(o, 0);
    mg_planner_set_budget(&p, 20000000000ULL);
    CHECK_EQ(begin(&p, 256, OK), 256);
    CHECK_EQ(oom(&p, 256), 128);
    mg_planner_end(&p, 128, (uint64_t)(a + b * 128), (uint64_t)a);
    CHECK_EQ(p.ran_room, 20000000000ULL);
    mg_planner_set_budget(&p, 8000000000ULL);
    CHECK_EQ(oom(&p, 256), 64); /* (0.97 x 8e9 - 1e9) / 1e8 = 67.6: 64 */

    /* without a known room, a failed size waits retry_after calm steps */
    p = planner(o, 0);
    CHECK_EQ(begin(&p, 32, OK), 32);
    CHECK_EQ(oom(&p, 32), 16);
    CHECK_EQ(p.failed_room, 0);
    CHECK_EQ(calm(&p, 32, 19), 16);
    CHECK_EQ(begin(&p, 32, OK), 32);
}

/* Step time against the number of micro-batches: learnt from timed steps,
 * the cost of one more micro-batch never below 0; the sizes that fit are
 * ranked by it: the fewest micro-batches, even, aligned where that adds
 * none. */
static void test_time_model(void)
{
    mg_planner_t p = planner(opts(), 0);
    double t = -1.0, base = -1.0, per = -1.0;
    CHECK_EQ(mg_planner_predict_time(&p, 64, &t), ENODATA);
    CHECK_EQ(mg_planner_time_model(&p, &base, &per), ENODATA);
    CHECK_EQ(begin(&p, 256, OK), 256);
    mg_planner_time(&p, 64, 256, 0.0);     /* no time: no data */
    mg_planner_time(&p, 64, 100, 0.5);     /* a short batch: not the plan's time */
    CHECK_EQ(mg_planner_time_model(&p, &base, &per), ENODATA);
    /* one number of micro-batches seen: that one only */
    for (int i = 0; i < 5; i++)
        mg_planner_time(&p, 64, 256, 0.48);
    CHECK_EQ(mg_planner_predict_time(&p, 64, &t), 0);
    CHECK_NEAR(t, 0.48, 1e-9);
    CHECK_EQ(mg_planner_predict_time(&p, 52, &t), ENODATA);
    /* 0.06 s a step plus 0.105 s a micro-batch (the GPU story: 4 x 64 in
     * 0.48 s, 5 x 52 in 0.585 s) */
    for (int i = 0; i < 5; i++)
        mg_planner_time(&p, 52, 256, 0.585);
    CHECK_EQ(mg_planner_time_model(&p, &base, &per), 0);
    CHECK_NEAR(per, 0.105, 1e-6);
    CHECK_NEAR(base, 0.06, 1e-6);
    CHECK_EQ(mg_planner_predict_time(&p, 256, &t), 0);
    CHECK_NEAR(t, 0.165, 1e-6);
    /* smaller micro-batches measured faster: not acted on (0) */
    for (int i = 0; i < 400; i++) {
        mg_planner_time(&p, 128, 256, 0.9);
        mg_planner_time(&p, 32, 256, 0.3);
    }
    CHECK_EQ(mg_planner_time_model(&p, &base, &per), 0);
    CHECK_NEAR(per, 0.0, 0);
    /* another batch size: its own time */
    CHECK_EQ(begin(&p, 512, OK), 512);
    mg_planner_time(&p, 512, 512, 0.3);
    CHECK_EQ(mg_planner_predict_time(&p, 512, &t), 0);
    CHECK_NEAR(t, 0.3, 1e-9);

    /* two sizes fit the room: the one with fewer micro-batches; 60 fits
     * a batch of 256: five micro-batches, 52 each, or 56 aligned to 8 */
    const double a = 1e9, b = 1e8;
    mg_planner_opts_t o = opts();
    o.margin = 0.1;
    p = planner(o, 0);
    CHECK_EQ(begin(&p, 256, OK), 256);
    mg_planner_end(&p, 256, (uint64_t)(a + b * 256), (uint64_t)a);
    mg_planner_set_budget(&p, (uint64_t)((a + b * 60.5) / 0.9));
    uint64_t fits = 0;
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 52);
    mg_planner_set_align(&p, 8);
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 56);
    CHECK_EQ(begin(&p, 256, OK), 56);
    CHECK_LAST(&p, "shrink", "room", 256, 56);
    /* aligned only where it adds no micro-batch: 86 fits 3, 88 would too,
     * but not the room */
    mg_planner_set_budget(&p, (uint64_t)((a + b * 86.5) / 0.9));
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 86);
    /* and never past the constraints */
    o.divisor_of = 260;
    p = planner(o, 0);
    mg_planner_set_align(&p, 8);
    CHECK_EQ(begin(&p, 256, OK), 256);
    mg_planner_end(&p, 256, (uint64_t)(a + b * 256), (uint64_t)a);
    mg_planner_set_budget(&p, (uint64_t)((a + b * 60.5) / 0.9));
    CHECK_EQ(mg_planner_room_fit(&p, &fits), 0);
    CHECK_EQ(fits, 52); /* 56 does not divide 260 */
}

int main(void)
{
    mgt_begin();
    RUN(test_options);
    RUN(test_fit);
    RUN(test_start);
    RUN(test_pressure_shrinks);
    RUN(test_oom);
    RUN(test_grow_after_calm);
    RUN(test_balanced_growth);
    RUN(test_failed_size_waits);
    RUN(test_model);
    RUN(test_room_jumps);
    RUN(test_larger_batch_starts_whole);
    RUN(test_fixed);
    RUN(test_small_batches);
    RUN(test_replay_and_copy);
    RUN(test_random_constraints);
    RUN(test_agree);
    RUN(test_learnt_margin);
    RUN(test_ceilings);
    RUN(test_time_model);
    return mgt_result();
}
