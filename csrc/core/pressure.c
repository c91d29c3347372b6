/* The pressure model: each sample's signals map to a raw level; the level
 * rises at once and falls only after calm_samples samples below it, so one
 * quiet reading in a storm does not undo a shrink. Pure: no I/O, no clock. */
#include <errno.h>
#include <math.h>

#include "mgi.h"

void mg_pressure_opts_default(mg_pressure_opts_t *o)
{
    for (int i = 0; i < 3; i++) {
        o->budget[i] = mgi_option_double(MGI_OPT_BUDGET_ELEVATED + i);
        o->headroom[i] = mgi_option_double(MGI_OPT_HEADROOM_ELEVATED + i);
        o->psi[i] = mgi_option_double(MGI_OPT_PSI_ELEVATED + i);
        o->swap_in[i] = mgi_option_double(MGI_OPT_SWAP_IN_ELEVATED + i);
        o->major_faults[i] = mgi_option_double(MGI_OPT_MAJFLT_ELEVATED + i);
    }
    o->calm_samples = (uint32_t)mgi_option_long(MGI_OPT_CALM_SAMPLES);
}

static int ascending(const double t[3])
{
    return t[0] >= 0 && t[0] <= t[1] && t[1] <= t[2];
}

int mg_pressure_opts_check(const mg_pressure_opts_t *o)
{
    if (!ascending(o->budget) || !ascending(o->psi) || !ascending(o->swap_in) ||
        !ascending(o->major_faults) || o->calm_samples < 1)
        return EINVAL;
    if (!(o->headroom[0] >= o->headroom[1] && o->headroom[1] >= o->headroom[2] &&
          o->headroom[2] >= 0 && o->headroom[0] <= 1))
        return EINVAL;
    return 0;
}

int mg_pressure_init(mg_pressure_t *p, const mg_pressure_opts_t *opts)
{
    if (mg_pressure_opts_check(opts))
        return EINVAL;
    p->opts = *opts;
    p->level = MG_LEVEL_OK;
    p->calm = 0;
    p->calm_max = MG_LEVEL_OK;
    return 0;
}

/* Level of a signal that is worse when higher; NaN (absent) is OK. */
static int above(double v, const double t[3])
{
    if (isnan(v))
        return MG_LEVEL_OK;
    return v >= t[2] ? MG_LEVEL_CRITICAL : v >= t[1] ? MG_LEVEL_HIGH
                                         : v >= t[0] ? MG_LEVEL_ELEVATED
                                                     : MG_LEVEL_OK;
}

/* Level of a signal that is worse when lower (headroom). */
static int below(double v, const double t[3])
{
    if (isnan(v))
        return MG_LEVEL_OK;
    return v <= t[2] ? MG_LEVEL_CRITICAL : v <= t[1] ? MG_LEVEL_HIGH
                                         : v <= t[0] ? MG_LEVEL_ELEVATED
                                                     : MG_LEVEL_OK;
}

static void consider(int level, uint32_t reason, int *raw, uint32_t *reasons)
{
    if (level > *raw) {
        *raw = level;
        *reasons = reason;
    } else if (level == *raw && level > MG_LEVEL_OK) {
        *reasons |= reason;
    }
}

static double max_known(double a, double b)
{
    if (isnan(a))
        return b;
    if (isnan(b))
        return a;
    return a > b ? a : b;
}

int mg_pressure_cuda_level(const mg_pressure_opts_t *o, mg_sample_t *s, uint32_t *reasons)
{
    int raw = MG_LEVEL_OK;
    uint32_t why = 0;
    if (s->have & MG_HAVE_CUDA) {
        if (s->cuda_budget_bytes) {
            s->have |= MG_HAVE_CUDA_BUDGET;
            s->cuda_budget_used_fraction =
                (double)s->cuda_allocated_bytes / (double)s->cuda_budget_bytes;
            consider(above(s->cuda_budget_used_fraction, o->budget), MG_REASON_BUDGET, &raw,
                     &why);
        }
        if (s->cuda_new_retries)
            consider(MG_LEVEL_HIGH, MG_REASON_CUDA_RETRIES, &raw, &why);
    }
    if (reasons)
        *reasons = why;
    return raw;
}

/* The operating system's own signals (macOS): the kernel's level, and the
 * pages it pushes out of memory each second, to its compressor or to swap,
 * judged as swap-ins are (the compressor fills before swap is written, so
 * its growth is the early sign the story's 14 GB of compressed memory was). */
static void consider_os(const mg_pressure_opts_t *o, const mg_sample_t *s, int *raw,
                        uint32_t *reasons)
{
    if (s->have & MG_HAVE_OS_LEVEL) {
        int lvl = s->os_pressure_level >= MG_OS_LEVEL_CRITICAL ? MG_LEVEL_CRITICAL
                  : s->os_pressure_level >= MG_OS_LEVEL_WARN   ? MG_LEVEL_HIGH
                                                               : MG_LEVEL_OK;
        consider(lvl, MG_REASON_OS, raw, reasons);
    }
    if ((s->have & MG_HAVE_COMPRESSED) && !isnan(s->compressions_per_s)) {
        double out = s->compressions_per_s +
                     (isnan(s->swap_out_pages_per_s) ? 0.0 : s->swap_out_pages_per_s);
        consider(above(out, o->swap_in), MG_REASON_COMPRESSOR, raw, reasons);
    }
}

int mg_pressure_update(mg_pressure_t *p, mg_sample_t *s)
{
    const mg_pressure_opts_t *o = &p->opts;
    int raw = MG_LEVEL_OK;
    uint32_t reasons = 0;

    /* memguard's own cached blocks are released before any allocation would
     * fail, at every step boundary they are not reused, and under pressure:
     * they are room, not use */
    uint64_t cached = (s->have & MG_HAVE_ARENA) ? s->arena_cached_bytes : 0;
    if (s->budget_bytes && (s->have & MG_HAVE_STATUS)) {
        s->have |= MG_HAVE_BUDGET;
        uint64_t used = (s->have & MG_HAVE_FOOTPRINT) ? s->footprint_bytes : s->rss_bytes;
        used = used > cached ? used - cached : 0;
        s->budget_used_fraction = (double)used / (double)s->budget_bytes;
        consider(above(s->budget_used_fraction, o->budget), MG_REASON_BUDGET, &raw, &reasons);
    }

    if ((s->have & MG_HAVE_ARENA) && s->arena_budget_bytes) {
        s->arena_budget_used_fraction =
            (double)(s->arena_reserved_bytes > s->arena_cached_bytes
                         ? s->arena_reserved_bytes - s->arena_cached_bytes : 0) /
            (double)s->arena_budget_bytes;
        consider(above(s->arena_budget_used_fraction, o->budget), MG_REASON_BUDGET, &raw,
                 &reasons);
    }

    double head = NAN;
    if ((s->have & MG_HAVE_MEMAVAIL) && s->mem_total_bytes) {
        uint64_t free_b = s->mem_available_bytes + cached;
        head = (double)(free_b < s->mem_total_bytes ? free_b : s->mem_total_bytes) /
               (double)s->mem_total_bytes;
    }
    if ((s->have & MG_HAVE_CGROUP_LIMIT) && s->cgroup_limit_bytes) {
        uint64_t used = (s->have & MG_HAVE_CGROUP_WS) ? s->cgroup_working_set_bytes
                                                      : s->cgroup_usage_bytes;
        used = used > cached ? used - cached : 0;
        double cg = used >= s->cgroup_limit_bytes
                        ? 0.0
                        : (double)(s->cgroup_limit_bytes - used) / (double)s->cgroup_limit_bytes;
        head = isnan(head) || cg < head ? cg : head;
    }
    if (!isnan(head)) {
        s->have |= MG_HAVE_HEADROOM;
        s->headroom_fraction = head;
        consider(below(head, o->headroom), MG_REASON_HEADROOM, &raw, &reasons);
    }

    consider(above(max_known(s->psi_some_stall, s->cgroup_psi_some_stall), o->psi),
             MG_REASON_PSI, &raw, &reasons);
    consider(above(s->swap_in_pages_per_s, o->swap_in), MG_REASON_SWAP, &raw, &reasons);
    consider(above(s->major_faults_per_s, o->major_faults), MG_REASON_FAULTS, &raw, &reasons);
    consider_os(o, s, &raw, &reasons);
    uint32_t cuda_reasons;
    int cuda = mg_pressure_cuda_level(o, s, &cuda_reasons);
    if (cuda_reasons)
        consider(cuda, cuda_reasons, &raw, &reasons);

    s->raw_level = raw;
    s->reasons = reasons;

    int before = p->level;
    if (raw >= p->level) {
        p->level = raw;
        p->calm = 0;
        p->calm_max = MG_LEVEL_OK;
    } else {
        if (raw > p->calm_max)
            p->calm_max = raw;
        if (++p->calm >= o->calm_samples) {
            p->level = p->calm_max;
            p->calm = 0;
            p->calm_max = MG_LEVEL_OK;
        }
    }
    s->level = p->level;
    return p->level != before;
}
