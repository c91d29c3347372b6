/* One option table {value, default, name}. Every option is read once from
 * MEMGUARD_<NAME> on first use; a bad environment value keeps the default
 * and leaves a warning that the embedding (Python, the shim) reports. */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mgi.h"

typedef enum { OPT_DOUBLE, OPT_LONG, OPT_TEXT } opt_kind_t;

#define OPT_TEXT_MAX 256

typedef struct opt {
    const char *name;
    opt_kind_t kind;
    const char *init;  /* default, as text */
    double lo, hi;     /* accepted range for numbers */
    double num;        /* value of a number option */
    char text[OPT_TEXT_MAX]; /* value of a text option */
} opt_t;

#define NUM(id, name, kind, init, lo, hi) [id] = {name, kind, init, lo, hi, 0, {0}}
#define BIG 1e12

/* Protected by opt_lock after load; loaded once under opt_once. */
static opt_t opts[MGI_OPT_COUNT] = {
    NUM(MGI_OPT_INTERVAL_MS, "interval_ms", OPT_DOUBLE, "100", 5, 60000),
    NUM(MGI_OPT_RING_SIZE, "ring_size", OPT_LONG, "4096", 16, 1 << 20),
    NUM(MGI_OPT_PROC_ROOT, "proc_root", OPT_TEXT, "/proc", 0, 0),
    NUM(MGI_OPT_CGROUP_ROOT, "cgroup_root", OPT_TEXT, "/sys/fs/cgroup", 0, 0),
    NUM(MGI_OPT_BUDGET, "budget", OPT_TEXT, "auto", 0, 0),
    NUM(MGI_OPT_BUDGET_ELEVATED, "budget_elevated", OPT_DOUBLE, "0.80", 0, 10),
    NUM(MGI_OPT_BUDGET_HIGH, "budget_high", OPT_DOUBLE, "0.90", 0, 10),
    NUM(MGI_OPT_BUDGET_CRITICAL, "budget_critical", OPT_DOUBLE, "0.97", 0, 10),
    NUM(MGI_OPT_HEADROOM_ELEVATED, "headroom_elevated", OPT_DOUBLE, "0.15", 0, 1),
    NUM(MGI_OPT_HEADROOM_HIGH, "headroom_high", OPT_DOUBLE, "0.08", 0, 1),
    NUM(MGI_OPT_HEADROOM_CRITICAL, "headroom_critical", OPT_DOUBLE, "0.03", 0, 1),
    NUM(MGI_OPT_PSI_ELEVATED, "psi_elevated", OPT_DOUBLE, "0.05", 0, 1),
    NUM(MGI_OPT_PSI_HIGH, "psi_high", OPT_DOUBLE, "0.15", 0, 1),
    NUM(MGI_OPT_PSI_CRITICAL, "psi_critical", OPT_DOUBLE, "0.40", 0, 1),
    NUM(MGI_OPT_SWAP_IN_ELEVATED, "swap_in_elevated", OPT_DOUBLE, "256", 0, BIG),
    NUM(MGI_OPT_SWAP_IN_HIGH, "swap_in_high", OPT_DOUBLE, "2560", 0, BIG),
    NUM(MGI_OPT_SWAP_IN_CRITICAL, "swap_in_critical", OPT_DOUBLE, "25600", 0, BIG),
    NUM(MGI_OPT_MAJFLT_ELEVATED, "major_faults_elevated", OPT_DOUBLE, "500", 0, BIG),
    NUM(MGI_OPT_MAJFLT_HIGH, "major_faults_high", OPT_DOUBLE, "5000", 0, BIG),
    NUM(MGI_OPT_MAJFLT_CRITICAL, "major_faults_critical", OPT_DOUBLE, "50000", 0, BIG),
    NUM(MGI_OPT_CALM_SAMPLES, "calm_samples", OPT_LONG, "10", 1, 100000),
    NUM(MGI_OPT_SLOW_INTERVAL_MS, "slow_interval_ms", OPT_DOUBLE, "1000", 5, 60000),
};

static pthread_once_t opt_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t opt_lock = PTHREAD_MUTEX_INITIALIZER; /* guards opts[] and warnings */

#define MAX_WARNINGS 16
static char warnings[MAX_WARNINGS][256]; /* guarded by opt_lock */
static int n_warnings;

/* Parse text into option o; 0 or EINVAL. Caller holds opt_lock or is loading. */
static int assign(opt_t *o, const char *text)
{
    if (o->kind == OPT_TEXT) {
        size_t n = strlen(text);
        if (n == 0 || n >= OPT_TEXT_MAX)
            return EINVAL;
        if (o - opts == MGI_OPT_BUDGET) {
            uint64_t b;
            if (mg_parse_budget(text, 1ULL << 40, 0, &b))
                return EINVAL;
        }
        memcpy(o->text, text, n + 1);
        return 0;
    }
    double v;
    if (mgi_parse_double(text, &v) || v < o->lo || v > o->hi)
        return EINVAL;
    if (o->kind == OPT_LONG && v != (double)(long)v)
        return EINVAL;
    o->num = v;
    return 0;
}

static void warn(const char *fmt, const char *a, const char *b)
{
    if (n_warnings < MAX_WARNINGS)
        snprintf(warnings[n_warnings++], sizeof(warnings[0]), fmt, a, b);
}

/* The thresholds of one signal: ELEVATED, HIGH, CRITICAL must rise (headroom:
 * fall), as the pressure model requires. */
static const struct {
    mgi_opt_id_t first;
    int rising;
} groups[] = {
    {MGI_OPT_BUDGET_ELEVATED, 1},   {MGI_OPT_HEADROOM_ELEVATED, 0}, {MGI_OPT_PSI_ELEVATED, 1},
    {MGI_OPT_SWAP_IN_ELEVATED, 1},  {MGI_OPT_MAJFLT_ELEVATED, 1},
};
#define N_GROUPS (sizeof(groups) / sizeof(groups[0]))

static int group_ordered(size_t g)
{
    double a = opts[groups[g].first].num, b = opts[groups[g].first + 1].num;
    double c = opts[groups[g].first + 2].num;
    return groups[g].rising ? (a <= b && b <= c) : (a >= b && b >= c);
}

/* Describe group g's values and the order they must keep into buf. */
static void describe_group(size_t g, char *buf, size_t cap)
{
    const opt_t *o = &opts[groups[g].first];
    snprintf(buf, cap, "%s=%g, %s=%g, %s=%g are out of order: they must %s from elevated "
             "to critical", o[0].name, o[0].num, o[1].name, o[1].num, o[2].name, o[2].num,
             groups[g].rising ? "rise" : "fall");
}

/* Reset every out-of-order group from the environment to its defaults. */
static void load_order(void)
{
    char why[192];
    for (size_t g = 0; g < N_GROUPS; g++) {
        if (group_ordered(g))
            continue;
        describe_group(g, why, sizeof(why));
        warn("%s (from %s variables); using the defaults for all three", why, "MEMGUARD_*");
        for (int k = 0; k < 3; k++)
            (void)assign(&opts[groups[g].first + k], opts[groups[g].first + k].init);
    }
}

static void load(void)
{
    char env[64];
    for (int i = 0; i < MGI_OPT_COUNT; i++) {
        opt_t *o = &opts[i];
        (void)assign(o, o->init);
        size_t n = (size_t)snprintf(env, sizeof(env), "MEMGUARD_%s", o->name);
        for (size_t k = 9; k < n; k++)
            env[k] = (char)toupper((unsigned char)env[k]);
        const char *v = getenv(env);
        if (v && assign(o, v) != 0) {
            warn("%s=%s is not a valid value; using the default", env, v);
            (void)assign(o, o->init);
        }
    }
    load_order();
}

static void lock(void)
{
    pthread_once(&opt_once, load);
    pthread_mutex_lock(&opt_lock);
}

double mgi_option_double(mgi_opt_id_t id)
{
    lock();
    double v = opts[id].num;
    pthread_mutex_unlock(&opt_lock);
    return v;
}

long mgi_option_long(mgi_opt_id_t id)
{
    return (long)mgi_option_double(id);
}

void mgi_option_text(mgi_opt_id_t id, char *buf, size_t cap)
{
    lock();
    snprintf(buf, cap, "%s", opts[id].text);
    pthread_mutex_unlock(&opt_lock);
}

static opt_t *find(const char *name)
{
    for (int i = 0; i < MGI_OPT_COUNT; i++)
        if (strcmp(opts[i].name, name) == 0)
            return &opts[i];
    return NULL;
}

int mg_option_get(const char *name, char *buf, size_t cap)
{
    opt_t *o = find(name);
    if (!o)
        return ENOENT;
    lock();
    if (o->kind == OPT_TEXT)
        snprintf(buf, cap, "%s", o->text);
    else
        snprintf(buf, cap, "%.17g", o->num);
    pthread_mutex_unlock(&opt_lock);
    return 0;
}

int mg_option_set(const char *name, const char *value)
{
    opt_t *o = find(name);
    if (!o)
        return ENOENT;
    lock();
    opt_t saved = *o;
    int rc = assign(o, value);
    if (rc)
        *o = saved;
    pthread_mutex_unlock(&opt_lock);
    return rc;
}

int mg_option_check(char *why, size_t cap)
{
    lock();
    int rc = 0;
    for (size_t g = 0; g < N_GROUPS && !rc; g++) {
        if (!group_ordered(g)) {
            describe_group(g, why, cap);
            rc = EINVAL;
        }
    }
    pthread_mutex_unlock(&opt_lock);
    return rc;
}

const char *mg_option_name(size_t i)
{
    return i < MGI_OPT_COUNT ? opts[i].name : NULL;
}

int mg_option_next_warning(char *buf, size_t cap)
{
    lock();
    int rc = ENOENT;
    if (n_warnings > 0) {
        snprintf(buf, cap, "%s", warnings[0]);
        memmove(warnings[0], warnings[1], sizeof(warnings[0]) * (size_t)(n_warnings - 1));
        n_warnings--;
        rc = 0;
    }
    pthread_mutex_unlock(&opt_lock);
    return rc;
}

/* The child of a fork has one thread: whoever held the lock is gone. */
void mgi_options_atfork_child(void)
{
    pthread_mutex_init(&opt_lock, NULL);
}
