/* What every platform layer shares: the sources' common start, the sample's
 * initial state, the arena's counters, and the rates between two samples of
 * one sampler. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "memguard/memguard-arena.h"
#include "mgi.h"

int mgi_sources_begin(mgi_sources_t *src, const char *proc_root, const char *cgroup_root)
{
    memset(src, 0, sizeof(*src));
    for (int i = 0; i < MGI_SRC_COUNT; i++)
        src->fd[i] = -1;
    if (mgi_join(src->proc_root, sizeof(src->proc_root), proc_root, NULL, NULL) ||
        mgi_join(src->cgroup_root, sizeof(src->cgroup_root), cgroup_root, NULL, NULL))
        return EINVAL;
    return 0;
}

double mgi_rate(uint64_t prev, uint64_t cur, double seconds)
{
    return cur >= prev ? (double)(cur - prev) / seconds : 0.0;
}

static double stall(uint64_t prev_us, uint64_t cur_us, double interval_us)
{
    double f = mgi_rate(prev_us, cur_us, interval_us);
    return f > 1.0 ? 1.0 : f;
}

void mgi_sample_init(mg_sample_t *s)
{
    memset(s, 0, sizeof(*s));
    s->size = sizeof(*s);
    s->version = MG_SAMPLE_VERSION;
    /* rates and fractions not computed read NaN, which Python turns into None */
    s->minor_faults_per_s = s->major_faults_per_s = NAN;
    s->swap_in_pages_per_s = s->swap_out_pages_per_s = NAN;
    s->psi_some_stall = s->psi_full_stall = NAN;
    s->cgroup_psi_some_stall = s->cgroup_psi_full_stall = NAN;
    s->budget_used_fraction = s->headroom_fraction = NAN;
    s->arena_budget_used_fraction = NAN;
    s->cuda_budget_used_fraction = NAN;
    s->cuda_device = -1;
    s->compressions_per_s = NAN;
}

void mgi_read_arena(mg_sample_t *s)
{
    mg_arena_stats_t a;
    /* a handful of atomic loads; an arena never initialised reserves nothing */
    if (mg_arena_stats(&a) != 0 || a.reserve_bytes == 0)
        return;
    s->have |= MG_HAVE_ARENA;
    s->arena_allocated_bytes = a.allocated_current;
    s->arena_reserved_bytes = a.reserved_current;
    s->arena_cached_bytes = a.cached_bytes;
    s->arena_budget_bytes = a.budget_bytes;
    s->arena_ooms = a.num_ooms;
}

void mgi_sample_deltas(const mg_sample_t *prev, mg_sample_t *cur)
{
    int64_t dt = cur->mono_ns - prev->mono_ns;
    if (dt <= 0)
        return;
    double sec = (double)dt / 1e9, us = (double)dt / 1e3;
    uint64_t both = prev->have & cur->have;
    cur->interval_ns = dt;
    cur->have |= MG_HAVE_RATES;
    if (both & MG_HAVE_FAULTS) {
        cur->minor_faults_per_s = mgi_rate(prev->minor_faults, cur->minor_faults, sec);
        cur->major_faults_per_s = mgi_rate(prev->major_faults, cur->major_faults, sec);
    }
    if (both & MG_HAVE_PSI)
        cur->psi_some_stall = stall(prev->psi_some_total_us, cur->psi_some_total_us, us);
    if (both & MG_HAVE_PSI_FULL)
        cur->psi_full_stall = stall(prev->psi_full_total_us, cur->psi_full_total_us, us);
    if (both & MG_HAVE_CGROUP_PSI) {
        cur->cgroup_psi_some_stall =
            stall(prev->cgroup_psi_some_total_us, cur->cgroup_psi_some_total_us, us);
        cur->cgroup_psi_full_stall =
            stall(prev->cgroup_psi_full_total_us, cur->cgroup_psi_full_total_us, us);
    }
}
