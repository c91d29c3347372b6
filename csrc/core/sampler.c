/* The telemetry sampler: a background thread that reads every source at a
 * fixed interval into a ring of samples, runs the pressure model, and
 * signals level changes on an eventfd. Its loop neither allocates nor calls
 * Python; it is created with all signals blocked, and pthread_atfork
 * handlers leave a forked child with a stopped, restartable sampler. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mgi.h"

struct mg_sampler {
    /* Immutable after create. */
    int64_t interval_ns;
    uint32_t ring_size;
    char proc_root[MGI_PATH_MAX];
    char cgroup_root[MGI_PATH_MAX];
    mg_pressure_opts_t popts;

    /* op_lock guards running, thread and the notifiers' lifecycle. While the
     * thread runs it alone touches src, prev, have_prev and pressure; when
     * it does not, they belong to whoever holds op_lock. */
    pthread_mutex_t op_lock;
    int running;
    pthread_t thread;
    mgi_note_t stop, level, sample, wake; /* closed: -1 */
    mgi_sources_t src;
    int src_open;
    mg_sample_t prev;
    int have_prev;
    mg_pressure_t pressure;

    _Atomic uint64_t budget_bytes;   /* asked for; 0: none */
    _Atomic int live;                /* judge against mg_budget_live() */
    _Atomic int notify;              /* signal sample after each sample */
    clockid_t cpu_clock;             /* the running thread's CPU clock (op_lock) */
    _Atomic uint64_t cpu_ns_before;  /* thread CPU time of finished runs */

    /* cuda_lock guards the pushed CUDA counters. */
    pthread_mutex_t cuda_lock;
    _Atomic int have_cuda;           /* set once, by the first push */
    mg_cuda_counters_t cuda;
    int64_t cuda_pushed_ns;
    uint64_t cuda_new_retries; /* rise not yet carried by a sample */

    /* ring_lock guards ring and seq (the seq of the newest sample). */
    pthread_mutex_t ring_lock;
    mg_sample_t *ring;
    uint64_t seq;

    struct mg_sampler *next; /* registry link, guarded by reg_lock */
};

/* Every live sampler, for the fork handlers. */
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER; /* guards reg_head */
static mg_sampler_t *reg_head;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void)
{
    pthread_mutex_lock(&reg_lock);
    for (mg_sampler_t *s = reg_head; s; s = s->next) {
        pthread_mutex_lock(&s->op_lock);
        pthread_mutex_lock(&s->ring_lock);
        pthread_mutex_lock(&s->cuda_lock);
    }
}

static void fork_parent(void)
{
    for (mg_sampler_t *s = reg_head; s; s = s->next) {
        pthread_mutex_unlock(&s->cuda_lock);
        pthread_mutex_unlock(&s->ring_lock);
        pthread_mutex_unlock(&s->op_lock);
    }
    pthread_mutex_unlock(&reg_lock);
}

static void close_notes(mg_sampler_t *s)
{
    mgi_note_close(&s->stop);
    mgi_note_close(&s->level);
    mgi_note_close(&s->sample);
    mgi_note_close(&s->wake);
}

/* The child has only the forking thread: every sampler thread is gone, the
 * descriptors on /proc/self name the parent, and the notifiers are shared
 * with it. Forget all of them; start() makes new ones. */
static void fork_child(void)
{
    mgi_options_atfork_child();
    for (mg_sampler_t *s = reg_head; s; s = s->next) {
        pthread_mutex_init(&s->ring_lock, NULL);
        pthread_mutex_init(&s->op_lock, NULL);
        pthread_mutex_init(&s->cuda_lock, NULL);
        s->running = 0; /* the thread's CPU time died with it */
        mgi_sources_forget(&s->src);
        s->src_open = 0;
        s->have_prev = 0;
        close_notes(s);
    }
    pthread_mutex_init(&reg_lock, NULL);
}

static void register_atfork(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static int open_notes(mg_sampler_t *s)
{
    mgi_note_t *notes[] = {&s->stop, &s->level, &s->sample, &s->wake};
    for (size_t i = 0; i < 4; i++) {
        int rc = mgi_note_open(notes[i]);
        if (rc)
            return rc;
    }
    return 0;
}

int mg_sampler_create(const mg_sampler_config_t *cfg, mg_sampler_t **out)
{
    mg_sampler_config_t c = {0};
    char proc_root[MGI_PATH_MAX], cgroup_root[MGI_PATH_MAX];
    if (cfg)
        c = *cfg;
    if (c.interval_us == 0)
        c.interval_us = (uint32_t)(mgi_option_double(MGI_OPT_INTERVAL_MS) * 1000);
    if (c.ring_size == 0)
        c.ring_size = (uint32_t)mgi_option_long(MGI_OPT_RING_SIZE);
    if (!c.proc_root) {
        mgi_option_text(MGI_OPT_PROC_ROOT, proc_root, sizeof(proc_root));
        c.proc_root = proc_root;
    }
    if (!c.cgroup_root) {
        mgi_option_text(MGI_OPT_CGROUP_ROOT, cgroup_root, sizeof(cgroup_root));
        c.cgroup_root = cgroup_root;
    }
    if (c.interval_us < 5000 || c.interval_us > 60000000 || c.ring_size < 2)
        return EINVAL;

    mg_sampler_t *s = calloc(1, sizeof(*s));
    if (!s)
        return ENOMEM;
    s->ring = calloc(c.ring_size, sizeof(mg_sample_t));
    if (!s->ring) {
        free(s);
        return ENOMEM;
    }
    s->interval_ns = (int64_t)c.interval_us * 1000;
    s->ring_size = c.ring_size;
    if (mgi_join(s->proc_root, sizeof(s->proc_root), c.proc_root, NULL, NULL) ||
        mgi_join(s->cgroup_root, sizeof(s->cgroup_root), c.cgroup_root, NULL, NULL)) {
        free(s->ring);
        free(s);
        return EINVAL;
    }
    if (c.pressure)
        s->popts = *c.pressure;
    else
        mg_pressure_opts_default(&s->popts);
    if (mg_pressure_init(&s->pressure, &s->popts)) {
        free(s->ring);
        free(s);
        return EINVAL;
    }
    mg_ranks_note(); /* on the caller's thread: the sampling thread never reads it */
    atomic_init(&s->budget_bytes, c.budget_bytes);
    atomic_init(&s->live, c.live != 0);
    atomic_init(&s->notify, 0);
    atomic_init(&s->have_cuda, 0);
    atomic_init(&s->cpu_ns_before, 0);
    pthread_mutex_init(&s->op_lock, NULL);
    pthread_mutex_init(&s->ring_lock, NULL);
    pthread_mutex_init(&s->cuda_lock, NULL);
    for (int i = 0; i < MGI_SRC_COUNT; i++)
        s->src.fd[i] = -1;
    s->stop = s->level = s->sample = s->wake = (mgi_note_t)MGI_NOTE_CLOSED;
    int rc = open_notes(s);
    if (rc) {
        close_notes(s);
        free(s->ring);
        free(s);
        return rc;
    }

    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&reg_lock);
    s->next = reg_head;
    reg_head = s;
    pthread_mutex_unlock(&reg_lock);
    *out = s;
    return 0;
}

/* Copy pushed CUDA counters into a sample. */
static void cuda_into(mg_sample_t *s, const mg_cuda_counters_t *c, uint64_t new_retries)
{
    s->have |= MG_HAVE_CUDA;
    s->cuda_device = c->device;
    s->cuda_allocated_bytes = c->allocated_bytes;
    s->cuda_reserved_bytes = c->reserved_bytes;
    s->cuda_active_bytes = c->active_bytes;
    s->cuda_allocated_peak_bytes = c->allocated_peak_bytes;
    s->cuda_reserved_peak_bytes = c->reserved_peak_bytes;
    s->cuda_alloc_retries = c->alloc_retries;
    s->cuda_ooms = c->ooms;
    s->cuda_new_retries = new_retries;
    s->cuda_free_bytes = c->free_bytes;
    s->cuda_total_bytes = c->total_bytes;
    s->cuda_budget_bytes = c->budget_bytes;
}

int mg_sampler_push_cuda(mg_sampler_t *s, const mg_cuda_counters_t *c, int *raw_level)
{
    if (!c)
        return EINVAL;
    pthread_mutex_lock(&s->cuda_lock);
    uint64_t rise = 0;
    /* the same device's counters only grow; a new device (or a reset)
     * starts a new baseline */
    if (atomic_load(&s->have_cuda) && s->cuda.device == c->device &&
        c->alloc_retries > s->cuda.alloc_retries)
        rise = c->alloc_retries - s->cuda.alloc_retries;
    s->cuda = *c;
    atomic_store_explicit(&s->have_cuda, 1, memory_order_release);
    s->cuda_pushed_ns = mgi_clock_ns(CLOCK_MONOTONIC);
    s->cuda_new_retries += rise;
    pthread_mutex_unlock(&s->cuda_lock);
    if (raw_level) {
        mg_sample_t one;
        mgi_sample_init(&one);
        cuda_into(&one, c, rise);
        *raw_level = mg_pressure_cuda_level(&s->popts, &one, NULL);
    }
    return 0;
}

/* The budget a sample is judged against: the one asked for, or the live
 * one capped by it (the reserve is what the pressure model calls HIGH
 * headroom, so living within the budget never reads HIGH by itself). */
static void judge_budget(mg_sampler_t *s, mg_sample_t *cur)
{
    uint64_t user = atomic_load_explicit(&s->budget_bytes, memory_order_relaxed), b;
    int src = MG_BUDGET_SRC_NONE;
    cur->user_budget_bytes = user;
    if (atomic_load_explicit(&s->live, memory_order_relaxed)) {
        if (mg_budget_live(cur, user, s->popts.headroom[1], &b, &src) == 0)
            user = b;
    } else if (user) {
        src = MG_BUDGET_SRC_USER;
    }
    cur->budget_bytes = user;
    cur->budget_source = src;
}

/* Read, derive, judge and publish one sample. Runs on the sampler thread or,
 * when it is not running, on a caller holding op_lock. */
static void take_sample(mg_sampler_t *s, mg_sample_t *out)
{
    mg_sample_t cur;
    mgi_sample_init(&cur);
    cur.mono_ns = mgi_clock_ns(CLOCK_MONOTONIC);
    cur.t_ns = mgi_clock_ns(CLOCK_REALTIME);
    mgi_sources_read(&s->src, &cur, s->pressure.level >= MG_LEVEL_ELEVATED);
    mgi_read_arena(&cur);
    if (atomic_load_explicit(&s->have_cuda, memory_order_acquire)) { /* no lock without CUDA */
        pthread_mutex_lock(&s->cuda_lock);
        cuda_into(&cur, &s->cuda, s->cuda_new_retries);
        cur.cuda_age_ns = cur.mono_ns - s->cuda_pushed_ns;
        s->cuda_new_retries = 0;
        pthread_mutex_unlock(&s->cuda_lock);
    }
    if (s->have_prev)
        mgi_sample_deltas(&s->prev, &cur);
    judge_budget(s, &cur);
    int changed = mg_pressure_update(&s->pressure, &cur);
    cur.cost_ns = mgi_clock_ns(CLOCK_MONOTONIC) - cur.mono_ns;

    pthread_mutex_lock(&s->ring_lock);
    cur.seq = ++s->seq;
    s->ring[(cur.seq - 1) % s->ring_size] = cur;
    pthread_mutex_unlock(&s->ring_lock);

    s->prev = cur;
    s->have_prev = 1;
    if (out)
        *out = cur;
    if (changed)
        mgi_note_signal(&s->level);
    if (atomic_load_explicit(&s->notify, memory_order_relaxed))
        mgi_note_signal(&s->sample);
}

static void *sampler_main(void *arg)
{
    mg_sampler_t *s = arg;
    int64_t next = mgi_clock_ns(CLOCK_MONOTONIC);
    for (;;) {
        take_sample(s, NULL);
        int64_t now = mgi_clock_ns(CLOCK_MONOTONIC);
        next += s->interval_ns;
        if (next <= now) /* fell behind (suspend, overload): skip, don't burst */
            next = now + s->interval_ns - (now - next) % s->interval_ns;
        if (mgi_note_wait(&s->stop, next - now) > 0)
            break; /* stop requested */
    }
    /* the thread's CPU clock dies with it: bank this run's time */
    atomic_fetch_add(&s->cpu_ns_before, (uint64_t)mgi_clock_ns(CLOCK_THREAD_CPUTIME_ID));
    return NULL;
}

int mg_sampler_start(mg_sampler_t *s)
{
    int rc = 0;
    pthread_mutex_lock(&s->op_lock);
    if (s->running) {
        rc = EALREADY;
        goto out;
    }
    if ((rc = open_notes(s)) != 0)
        goto out;
    if (!s->src_open) {
        if ((rc = mgi_sources_open(&s->src, s->proc_root, s->cgroup_root)) != 0)
            goto out;
        s->src_open = 1;
    }
    mgi_note_drain(&s->stop);

    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&s->thread, NULL, sampler_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0) {
        s->running = 1;
        if (mgi_thread_cpu_clock(s->thread, &s->cpu_clock) != 0)
            s->cpu_clock = (clockid_t)-1;
    }
out:
    pthread_mutex_unlock(&s->op_lock);
    return rc;
}

int mg_sampler_stop(mg_sampler_t *s)
{
    pthread_mutex_lock(&s->op_lock);
    if (s->running) {
        mgi_note_signal(&s->stop);
        pthread_join(s->thread, NULL);
        mgi_note_drain(&s->stop);
        s->running = 0;
    }
    pthread_mutex_unlock(&s->op_lock);
    return 0;
}

int mg_sampler_running(const mg_sampler_t *s)
{
    mg_sampler_t *m = (mg_sampler_t *)s;
    pthread_mutex_lock(&m->op_lock);
    int r = m->running;
    pthread_mutex_unlock(&m->op_lock);
    return r;
}

int mg_sampler_sample_now(mg_sampler_t *s, mg_sample_t *out)
{
    int rc = 0;
    pthread_mutex_lock(&s->op_lock);
    if (s->running) {
        rc = EBUSY;
    } else {
        if (!s->src_open) {
            rc = mgi_sources_open(&s->src, s->proc_root, s->cgroup_root);
            s->src_open = rc == 0;
        }
        if (rc == 0)
            take_sample(s, out);
    }
    pthread_mutex_unlock(&s->op_lock);
    return rc;
}

int mg_sampler_latest(mg_sampler_t *s, mg_sample_t *out)
{
    int rc = ENOENT;
    pthread_mutex_lock(&s->ring_lock);
    if (s->seq) {
        *out = s->ring[(s->seq - 1) % s->ring_size];
        rc = 0;
    }
    pthread_mutex_unlock(&s->ring_lock);
    return rc;
}

int mg_sampler_since(mg_sampler_t *s, uint64_t after_seq, mg_sample_t *out, size_t cap,
                     size_t *n, uint64_t *dropped)
{
    size_t k = 0;
    uint64_t lost = 0;
    pthread_mutex_lock(&s->ring_lock);
    uint64_t newest = s->seq;
    uint64_t oldest = newest > s->ring_size ? newest - s->ring_size + 1 : 1;
    if (after_seq >= newest) {
        pthread_mutex_unlock(&s->ring_lock);
        *n = 0;
        if (dropped)
            *dropped = 0;
        return 0;
    }
    uint64_t first = after_seq + 1;
    if (first < oldest) {
        lost = oldest - first;
        first = oldest;
    }
    for (uint64_t q = first; q <= newest && k < cap; q++)
        out[k++] = s->ring[(q - 1) % s->ring_size];
    pthread_mutex_unlock(&s->ring_lock);
    *n = k;
    if (dropped)
        *dropped = lost;
    return 0;
}

void mg_sampler_notify_samples(mg_sampler_t *s, int on)
{
    atomic_store(&s->notify, on ? 1 : 0);
}

int mg_sampler_wait(mg_sampler_t *s, int timeout_ms, int *wake)
{
    struct pollfd p[3] = {
        {.fd = s->level.rd, .events = POLLIN},
        {.fd = s->sample.rd, .events = POLLIN},
        {.fd = s->wake.rd, .events = POLLIN},
    };
    *wake = 0;
    int n = poll(p, 3, timeout_ms);
    if (n < 0)
        return errno == EINTR ? 0 : errno;
    if ((p[0].revents & POLLIN) && mgi_note_drain(&s->level))
        *wake |= MG_WAKE_LEVEL;
    if ((p[1].revents & POLLIN) && mgi_note_drain(&s->sample))
        *wake |= MG_WAKE_SAMPLE;
    if ((p[2].revents & POLLIN) && mgi_note_drain(&s->wake))
        *wake |= MG_WAKE_USER;
    return 0;
}

int mg_sampler_wake(mg_sampler_t *s)
{
    mgi_note_signal(&s->wake);
    return 0;
}

int mg_sampler_level_fd(const mg_sampler_t *s)
{
    return s->level.rd;
}

int mg_sampler_cpu_ns(const mg_sampler_t *s, uint64_t *out)
{
    mg_sampler_t *m = (mg_sampler_t *)s;
    uint64_t now = 0;
    pthread_mutex_lock(&m->op_lock);
    if (m->running && m->cpu_clock != (clockid_t)-1)
        now = (uint64_t)mgi_clock_ns(m->cpu_clock);
    *out = atomic_load(&m->cpu_ns_before) + now;
    pthread_mutex_unlock(&m->op_lock);
    return 0;
}

void mg_sampler_set_budget(mg_sampler_t *s, uint64_t budget_bytes)
{
    atomic_store(&s->budget_bytes, budget_bytes);
}

void mg_sampler_set_live(mg_sampler_t *s, int live)
{
    atomic_store(&s->live, live != 0);
}

void mg_sampler_destroy(mg_sampler_t *s)
{
    if (!s)
        return;
    mg_sampler_stop(s);
    pthread_mutex_lock(&reg_lock);
    for (mg_sampler_t **pp = &reg_head; *pp; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    }
    pthread_mutex_unlock(&reg_lock);
    mgi_sources_close(&s->src);
    close_notes(s);
    pthread_mutex_destroy(&s->op_lock);
    pthread_mutex_destroy(&s->ring_lock);
    pthread_mutex_destroy(&s->cuda_lock);
    free(s->ring);
    free(s);
}
