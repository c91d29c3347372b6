/* The micro-batch planner (see memguard-planner.h): pure arithmetic on its
 * own struct, so tests replay recorded traces through exactly this code. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "memguard/memguard-planner.h"

void mg_planner_opts_default(mg_planner_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    o->min_micro = 1;
    o->multiple_of = 1;
    o->margin = 0.03;
    o->decay = 0.98;
    o->grow_after = 8;
    o->retry_after = 64;
    o->align = 1;
}

static int allowed(const mg_planner_opts_t *o, uint64_t s)
{
    return s >= o->min_micro && s % o->multiple_of == 0 &&
           (o->divisor_of == 0 || o->divisor_of % s == 0);
}

int mg_planner_opts_check(const mg_planner_opts_t *o)
{
    if (o->min_micro == 0 || o->multiple_of == 0 || !(o->margin >= 0.0 && o->margin < 1.0) ||
        !(o->decay > 0.0 && o->decay <= 1.0) || o->grow_after == 0)
        return EINVAL;
    if (o->divisor_of == 0)
        return 0;
    /* with a divisor, some divisor of it must pass the other two rules */
    for (uint64_t s = o->min_micro; s <= o->divisor_of; s++)
        if (allowed(o, s))
            return 0;
    return EINVAL;
}

static uint64_t next_up(const mg_planner_t *p, uint64_t x);

int mg_planner_init(mg_planner_t *p, const mg_planner_opts_t *o, uint64_t micro)
{
    int rc = mg_planner_opts_check(o);
    if (rc)
        return rc;
    memset(p, 0, sizeof(*p));
    p->opts = *o;
    p->margin = o->margin;
    if (micro && !allowed(o, micro)) { /* no batch seen yet: the constraints alone */
        uint64_t s;
        micro = mg_planner_fit(p, micro, &s) == 0 ? s : next_up(p, micro);
    }
    p->micro = micro;
    p->last.reason = MG_PLAN_R_START;
    return 0;
}

int mg_planner_fit(const mg_planner_t *p, uint64_t x, uint64_t *size)
{
    const mg_planner_opts_t *o = &p->opts;
    if (p->full && x >= p->full) {
        *size = p->full; /* the whole batch in one piece splits nothing */
        return 0;
    }
    if (x < o->min_micro)
        return ENOENT;
    if (o->divisor_of == 0) {
        uint64_t s = x - x % o->multiple_of;
        if (s < o->min_micro)
            return ENOENT;
        *size = s;
        return 0;
    }
    /* divisors are few and batches small: a bounded downward scan */
    for (uint64_t s = x < o->divisor_of ? x : o->divisor_of; s >= o->min_micro; s--) {
        if (allowed(o, s)) {
            *size = s;
            return 0;
        }
    }
    return ENOENT;
}

/* Line through the decayed observations: peak = a + b * size. While the
 * sizes seen do not spread (or the slope is not positive), the line through
 * the mean floor (what the source held as steps began) and the mean peak:
 * above the truth for larger sizes, and at most the size-independent part
 * of a step (gradients) below it for smaller ones; without floors, the line
 * through the origin. 0, or ENODATA with nothing observed. */
static int model(const mg_planner_t *p, double *a, double *b)
{
    if (p->sw <= 0.0 || p->sx <= 0.0)
        return ENODATA;
    double mx = p->sx / p->sw, my = p->sy / p->sw, mf = p->sfw > 0.0 ? p->sf / p->sfw : 0.0;
    double var = p->sxx / p->sw - mx * mx;
    if (var > 1e-6 * mx * mx) {
        double slope = (p->sxy / p->sw - mx * my) / var;
        if (slope > 0.0) {
            *b = slope;
            *a = my - slope * mx;
            return 0;
        }
    }
    *a = mf > 0.0 && mf < my ? mf : 0.0;
    *b = (my - *a) / mx;
    return 0;
}

int mg_planner_predict(const mg_planner_t *p, uint64_t micro, uint64_t *bytes)
{
    double a, b;
    if (model(p, &a, &b))
        return ENODATA;
    double y = a + b * (double)micro;
    *bytes = y <= 0.0 ? 0 : y >= 1.8e19 ? UINT64_MAX : (uint64_t)y;
    return 0;
}

static void decide(mg_planner_t *p, int action, int reason, uint64_t to)
{
    if (action == MG_PLAN_SHRINK)
        p->shrunk_room = p->opts.budget_bytes;
    else if (action == MG_PLAN_GROW)
        p->shrunk_room = 0;
    p->last.step = p->step;
    p->last.from = p->micro;
    p->last.to = to;
    p->last.action = action;
    p->last.reason = reason;
    if (to != p->micro)
        p->calm = 0;
    p->micro = to;
}

/* Smallest size above @p x that is allowed or is the full batch; UINT64_MAX
 * when there is none. */
static uint64_t next_up(const mg_planner_t *p, uint64_t x)
{
    const mg_planner_opts_t *o = &p->opts;
    uint64_t s = x < o->min_micro ? o->min_micro : x + 1;
    uint64_t cap = p->full > x ? p->full : UINT64_MAX;
    if (o->divisor_of == 0) {
        s += (o->multiple_of - s % o->multiple_of) % o->multiple_of; /* the next multiple */
    } else {
        while (s < cap && s <= o->divisor_of && !allowed(o, s))
            s++;
        if (!allowed(o, s))
            s = UINT64_MAX;
    }
    return s < cap ? s : cap;
}

/* @p s rounded up to a multiple of opts.align when that is allowed, at
 * most @p lim, and still @p k micro-batches of the full batch; else @p s. */
static uint64_t aligned(const mg_planner_t *p, uint64_t s, uint64_t lim, uint64_t k)
{
    uint64_t al = p->opts.align;
    if (al <= 1 || s % al == 0)
        return s;
    uint64_t up = s + (al - s % al);
    if (up > lim || !allowed(&p->opts, up) || (p->full + up - 1) / up != k)
        return s;
    return up;
}

/* Allowed size at most @p target that splits the full batch into as few
 * micro-batches as target would, and as evenly: 31 of 32 still takes two
 * micro-batches, and two of 16 hold less at their peak. */
static int balanced(const mg_planner_t *p, uint64_t target, uint64_t *size)
{
    uint64_t s;
    if (mg_planner_fit(p, target, &s))
        return ENOENT;
    if (p->full > s) {
        /* the smallest allowed size that still takes k micro-batches: one
         * of full/k or more; s itself is such a size */
        uint64_t k = (p->full + s - 1) / s, lim = s;
        s = next_up(p, (p->full + k - 1) / k - 1);
        s = aligned(p, s, lim, k);
    }
    *size = s;
    return 0;
}

int mg_planner_room_fit(const mg_planner_t *p, uint64_t *size)
{
    const mg_planner_opts_t *o = &p->opts;
    double a, b;
    if (!o->budget_bytes || model(p, &a, &b) || b <= 0.0)
        return ENODATA;
    double room = (double)o->budget_bytes * (1.0 - p->margin) - a;
    double x = room <= 0.0 ? 0.0 : room / b;
    uint64_t s;
    if (x >= 1.8e19)
        x = 1.8e19;
    if (balanced(p, (uint64_t)x, &s))
        s = 0; /* not even the smallest allowed size fits */
    *size = s;
    return 0;
}

void mg_planner_set_budget(mg_planner_t *p, uint64_t budget_bytes)
{
    p->opts.budget_bytes = budget_bytes;
}

void mg_planner_set_align(mg_planner_t *p, uint64_t align)
{
    p->opts.align = align ? align : 1;
}

/* The margin from what the model has seen: twice its root-mean-square
 * error as a share of the room, at least opts.margin, plus what
 * out-of-memory errors added; at most a half. */
static void remargin(mg_planner_t *p)
{
    double learnt = p->sew > 0.0 ? 2.0 * sqrt(p->se / p->sew) : 0.0;
    double m = (learnt > p->opts.margin ? learnt : p->opts.margin) + p->boost;
    p->margin = m < 0.5 ? m : 0.5;
}

/* An out-of-memory error at @p micro: where the model said it fits, the
 * margin widens by what it under-predicted at least (the peak passed the
 * room): never by less than opts.margin, nor by more than a quarter of the
 * room at once (one batch far above the others, a long sequence, is not
 * the model's error; the failed size's ceiling keeps it from recurring). */
static void widen(mg_planner_t *p, uint64_t micro)
{
    uint64_t pred;
    double room = (double)p->opts.budget_bytes;
    if (room <= 0.0 || mg_planner_predict(p, micro, &pred) ||
        (double)pred > room * (1.0 - p->margin))
        return;
    double under = (room - (double)pred) / room;
    under = under > 0.25 ? 0.25 : under;
    p->boost += under > p->opts.margin ? under : p->opts.margin;
    remargin(p);
}

/* Shrink towards @p target; 0, or ENOMEM when nothing smaller is allowed. */
static int shrink(mg_planner_t *p, uint64_t from, uint64_t target, int reason)
{
    uint64_t s;
    if (balanced(p, target, &s))
        s = next_up(p, target); /* target below every allowed size: the smallest */
    if (s >= from) {
        if (from <= 1 || balanced(p, from - 1, &s))
            return ENOMEM;
    }
    decide(p, MG_PLAN_SHRINK, reason, s);
    return 0;
}

/* The room rose by a quarter since the last shrink: growth need not wait
 * for calm steps, as a shrink does not when the room falls. 1 when it grew
 * to the largest size that fits (never to one that failed recently). */
static int grow_room_back(mg_planner_t *p)
{
    uint64_t fits, s;
    if (!p->shrunk_room || !p->opts.budget_bytes ||
        (double)p->opts.budget_bytes < 1.25 * (double)p->shrunk_room ||
        mg_planner_room_fit(p, &fits) != 0)
        return 0;
    if (p->failed && fits >= p->failed)
        fits = p->failed - 1;
    if (balanced(p, fits, &s) != 0 || s <= p->micro)
        return 0;
    decide(p, MG_PLAN_GROW, MG_PLAN_R_ROOM_BACK, s);
    return 1;
}

/* Calm for grow_after steps: to the largest size the model says fits the
 * room (several doublings at once), or the next doubling without a model;
 * never to a size that failed recently. */
static void grow(mg_planner_t *p)
{
    int limit = MG_PLAN_R_GROW;
    uint64_t target = p->micro > p->full / 2 ? p->full : 2 * p->micro, s, fits;

    if (mg_planner_room_fit(p, &fits) == 0) {
        target = fits;
        if (fits <= p->micro)
            limit = MG_PLAN_R_MODEL;
    } else if (mg_planner_fit(p, target, &s) || s <= p->micro) {
        /* sizes that divide divisor_of can lie more than twice apart (9: 1,
         * 3, 9): aim at least at the next one up, or growth stops for good */
        target = next_up(p, p->micro);
    }
    if (p->failed && target >= p->failed) {
        target = p->failed - 1;
        limit = MG_PLAN_R_FAILED;
    }
    if (balanced(p, target, &s) == 0 && s > p->micro)
        decide(p, MG_PLAN_GROW, MG_PLAN_R_GROW, s);
    else
        decide(p, MG_PLAN_HOLD, limit, p->micro);
}

/* Pressure at HIGH or above: the size that fits the room where the model
 * knows (hold when this one does), else a half, or a quarter at CRITICAL. */
static void under_pressure(mg_planner_t *p, int level)
{
    int crit = level >= MG_LEVEL_CRITICAL;
    int reason = crit ? MG_PLAN_R_CRITICAL : MG_PLAN_R_HIGH;
    uint64_t fits;
    p->calm = 0;
    if (mg_planner_room_fit(p, &fits) != 0) {
        fits = p->micro / (crit ? 4 : 2);
    } else if (fits >= p->micro) {
        decide(p, MG_PLAN_HOLD, MG_PLAN_R_FITS, p->micro);
        return;
    }
    if (shrink(p, p->micro, fits, reason))
        decide(p, MG_PLAN_HOLD, MG_PLAN_R_AT_MIN, p->micro);
}

/* A size that failed caps growth only while the room is below a quarter
 * above the room it failed in; then the model decides. */
static void lift_ceiling(mg_planner_t *p)
{
    if (p->failed && p->failed_room &&
        (double)p->opts.budget_bytes >= 1.25 * (double)p->failed_room) {
        p->failed = 0;
        p->failed_room = 0;
        p->calm_since_fail = 0;
        p->retried = 0;
        p->retries = 0;
    }
}

/* Calm steps before a failed size is tried again in the same room (a
 * one-off spike, a long sequence, must not split the run for good):
 * retry_after, doubled each time the size retried fails again. */
static uint64_t retry_wait(const mg_planner_t *p)
{
    uint32_t n = p->retries < 16 ? p->retries : 16;
    return (uint64_t)p->opts.retry_after << n;
}

int mg_planner_begin(mg_planner_t *p, uint64_t batch, int level, uint64_t *micro)
{
    if (batch == 0)
        return EINVAL;
    if (batch > p->full) {
        /* a larger batch than any before: where the steps ran whole, they
         * start whole again, as at the first step; what failed or held at
         * the smaller batch's sizes does not cap the new one (a first batch
         * of 1 must not make batches of 64 grow back one doubling at a
         * time) */
        if (p->full && p->micro >= p->full && !p->opts.fixed) {
            p->micro = batch;
            p->failed = 0;
            p->failed_room = 0;
            p->retried = 0;
            p->retries = 0;
            p->calm = 0;
        }
        p->full = batch;
    }
    if (p->micro == 0 || (p->micro > p->full && !p->opts.fixed)) {
        /* (a fixed plan survives a short batch, such as an epoch's last) */
        p->micro = p->full;
    } else if (p->micro < p->full && !allowed(&p->opts, p->micro)) {
        /* a starting size the constraints do not allow, or the full batch
         * of earlier, smaller batches: down to an allowed size (up when
         * none is smaller) */
        uint64_t s;
        p->micro = mg_planner_fit(p, p->micro, &s) == 0 ? s : next_up(p, p->micro);
    }

    lift_ceiling(p);
    uint64_t fits;
    if (p->step == 0 && (level < MG_LEVEL_HIGH || p->opts.fixed)) {
        decide(p, MG_PLAN_HOLD, MG_PLAN_R_START, p->micro);
    } else if (p->opts.fixed) {
        decide(p, MG_PLAN_HOLD, MG_PLAN_R_FIXED, p->micro);
    } else if (level >= MG_LEVEL_HIGH) {
        under_pressure(p, level);
    } else if (mg_planner_room_fit(p, &fits) == 0 && fits < p->micro) {
        /* the room fell under this size's predicted peak, pressure or not */
        p->calm = 0;
        if (shrink(p, p->micro, fits, MG_PLAN_R_ROOM))
            decide(p, MG_PLAN_HOLD, MG_PLAN_R_AT_MIN, p->micro);
    } else if (p->micro < p->full && grow_room_back(p)) {
        /* decided */
    } else if (level == MG_LEVEL_ELEVATED) {
        p->calm = 0;
        decide(p, MG_PLAN_HOLD, MG_PLAN_R_ELEVATED, p->micro);
    } else {
        p->calm++;
        if (p->failed && ++p->calm_since_fail >= retry_wait(p)) {
            p->retried = p->failed;
            p->failed = 0;
            p->failed_room = 0;
            p->calm_since_fail = 0;
        }
        if (p->micro >= p->full)
            decide(p, MG_PLAN_HOLD, MG_PLAN_R_AT_FULL, p->micro);
        else if (p->calm >= p->opts.grow_after)
            grow(p);
        else
            decide(p, MG_PLAN_HOLD, MG_PLAN_R_CALM, p->micro);
    }
    p->step++;
    *micro = p->micro < batch ? p->micro : batch;
    return 0;
}

/* A size failed in the room there is now: a ceiling until the room rises. */
static void note_failed(mg_planner_t *p, uint64_t size)
{
    p->calm = 0;
    p->calm_since_fail = 0;
    if (size && (p->failed == 0 || size <= p->failed)) {
        p->failed = size;
        p->failed_room = p->opts.budget_bytes;
    }
    if (size && size >= p->retried && p->retried) /* a retry failed: wait longer */
        p->retries++;
}

/* Where a step that ran out of memory at @p micro is redone: a grow that
 * failed goes back to the size that ran (unless the room fell since, and
 * the model says less fits); else a half at least, less where the room
 * says so. */
static uint64_t redo_target(const mg_planner_t *p, uint64_t micro)
{
    uint64_t fits, room = p->opts.budget_bytes;
    int known = mg_planner_room_fit(p, &fits) == 0;
    if (p->ran && p->ran < micro) {
        int fell = room && (double)room < (double)p->ran_room * (1.0 - p->opts.margin);
        return fell && known && fits < p->ran ? fits : p->ran;
    }
    return known && fits < micro / 2 ? fits : micro / 2;
}

int mg_planner_oom(mg_planner_t *p, uint64_t micro, uint64_t *next)
{
    p->ooms++;
    widen(p, micro);
    note_failed(p, micro);
    int rc = shrink(p, micro, redo_target(p, micro), MG_PLAN_R_OOM);
    if (rc == 0) {
        p->last.step = p->step ? p->step - 1 : 0; /* the step being redone */
        *next = p->micro;
    }
    return rc;
}

int mg_planner_agree(mg_planner_t *p, uint64_t micro, uint64_t failed)
{
    if (micro == 0)
        return EINVAL;
    if (failed)
        note_failed(p, failed);
    if (micro != p->micro) {
        decide(p, micro < p->micro ? MG_PLAN_SHRINK : MG_PLAN_GROW, MG_PLAN_R_PEER, micro);
        p->last.step = p->step ? p->step - 1 : 0; /* the step under way */
    }
    return 0;
}

void mg_planner_end(mg_planner_t *p, uint64_t micro, uint64_t peak_bytes, uint64_t floor_bytes)
{
    if (micro == 0 || peak_bytes == 0)
        return;
    double d = p->opts.decay, x = (double)micro, y = (double)peak_bytes;
    uint64_t pred;
    if (p->opts.budget_bytes && mg_planner_predict(p, micro, &pred) == 0) {
        double r = (y - (double)pred) / (double)p->opts.budget_bytes;
        p->se = p->se * d + r * r;
        p->sew = p->sew * d + 1.0;
    }
    p->boost *= 0.9; /* a steady step narrows what errors added */
    remargin(p);
    if (micro == p->micro) { /* the plan ran (not a short batch's whole) */
        p->ran = micro;
        p->ran_room = p->opts.budget_bytes;
    }
    p->sf *= d;
    p->sfw *= d;
    if (floor_bytes && floor_bytes < peak_bytes) { /* else unknown: no information */
        p->sf += (double)floor_bytes;
        p->sfw += 1.0;
    }
    p->sw = p->sw * d + 1.0;
    p->sx = p->sx * d + x;
    p->sy = p->sy * d + y;
    p->sxx = p->sxx * d + x * x;
    p->sxy = p->sxy * d + x * y;
}

void mg_planner_time(mg_planner_t *p, uint64_t micro, uint64_t batch, double seconds)
{
    if (micro == 0 || batch == 0 || !(seconds > 0.0) || batch != p->full)
        return;
    if (batch != p->timed_full) { /* a new batch size: its own time */
        p->tw = p->tk = p->tt = p->tkk = p->tkt = 0.0;
        p->timed_full = batch;
    }
    double d = p->opts.decay, k = (double)((batch + micro - 1) / micro);
    p->tw = p->tw * d + 1.0;
    p->tk = p->tk * d + k;
    p->tt = p->tt * d + seconds;
    p->tkk = p->tkk * d + k * k;
    p->tkt = p->tkt * d + k * seconds;
}

/* t = base + per_micro * k over the timed steps; with one k seen, or a
 * slope below 0 (noise, or a loaded machine, more often than a real
 * saving: acting on it would stop growth back), per_micro is 0. */
int mg_planner_time_model(const mg_planner_t *p, double *base, double *per_micro)
{
    if (p->tw <= 0.0)
        return ENODATA;
    double mk = p->tk / p->tw, mt = p->tt / p->tw, var = p->tkk / p->tw - mk * mk;
    double slope = var > 1e-9 ? (p->tkt / p->tw - mk * mt) / var : 0.0;
    if (slope < 0.0)
        slope = 0.0;
    *per_micro = slope;
    *base = mt - slope * mk;
    return 0;
}

int mg_planner_predict_time(const mg_planner_t *p, uint64_t micro, double *seconds)
{
    double base, per, k = (double)((p->timed_full + micro - 1) / (micro ? micro : 1));
    if (micro == 0 || mg_planner_time_model(p, &base, &per))
        return ENODATA;
    double mk = p->tk / p->tw, var = p->tkk / p->tw - mk * mk;
    if (var <= 1e-9 && fabs(k - mk) > 0.5)
        return ENODATA; /* one number of micro-batches seen: no slope to go by */
    *seconds = base + per * k;
    return 0;
}

const char *mg_plan_action_name(int action)
{
    static const char *const names[] = {"hold", "shrink", "grow"};
    return action >= 0 && action < 3 ? names[action] : "?";
}

const char *mg_plan_reason_name(int reason)
{
    static const char *const names[MG_PLAN_R_COUNT] = {
        "start", "calm", "elevated", "high", "critical", "oom", "at_min",
        "at_full", "grow", "model", "failed", "fixed", "peer", "room", "fits", "room_back",
    };
    return reason >= 0 && reason < MG_PLAN_R_COUNT ? names[reason] : "?";
}
