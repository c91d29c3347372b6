/* Internal declarations shared by the C core's files (mgi_ prefix). Nothing
 * here is part of the public API; tests include it to reach the parsers. */
#ifndef MEMGUARD_MGI_H
#define MEMGUARD_MGI_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "memguard/memguard.h"

/* ---- pure parsers (procfs.c): buffer in, struct out ---------------------
 * Each returns 0, or EBADMSG with *why set to a static description of what
 * was missing or malformed. Buffers need not be NUL-terminated; nothing is
 * read past len. */

typedef struct mgi_status {
    uint64_t rss_bytes, hwm_bytes, swap_bytes;
    int have_swap;
} mgi_status_t;

typedef struct mgi_meminfo {
    uint64_t total_bytes, available_bytes, swap_total_bytes, swap_free_bytes;
    int have_available, have_swap;
} mgi_meminfo_t;

typedef struct mgi_vmstat {
    uint64_t pswpin, pswpout, pgmajfault;
} mgi_vmstat_t;

typedef struct mgi_psi {
    double some_avg10, some_avg60, full_avg10, full_avg60;
    uint64_t some_total_us, full_total_us;
    int have_full;
} mgi_psi_t;

typedef struct mgi_faults {
    uint64_t minor, major;
} mgi_faults_t;

/* Where this process sits in each hierarchy, from /proc/self/cgroup. */
#define MGI_CGPATH_MAX 512
typedef struct mgi_cgpaths {
    char v1_memory[MGI_CGPATH_MAX]; /* "" when no v1 memory line */
    char v2[MGI_CGPATH_MAX];        /* "" when no "0::" line */
    int have_v1, have_v2;
} mgi_cgpaths_t;

/* Fields of a cgroup memory.stat we use (v1 names are total_* when present). */
typedef struct mgi_cgstat {
    uint64_t inactive_file;
    uint64_t hierarchical_limit; /* v1 only; 0 when absent */
    int have_inactive_file;
} mgi_cgstat_t;

typedef struct mgi_cgevents {
    uint64_t oom, oom_kill, high, max;
    int have_oom_kill;
} mgi_cgevents_t;

int mgi_parse_status(const char *buf, size_t len, mgi_status_t *out, const char **why);
int mgi_parse_meminfo(const char *buf, size_t len, mgi_meminfo_t *out, const char **why);
int mgi_parse_vmstat(const char *buf, size_t len, mgi_vmstat_t *out, const char **why);
int mgi_parse_psi(const char *buf, size_t len, mgi_psi_t *out, const char **why);
/* /proc/self/statm: resident pages (second field) times page_size. */
int mgi_parse_statm(const char *buf, size_t len, uint64_t page_size, uint64_t *rss_bytes,
                    const char **why);
int mgi_parse_stat(const char *buf, size_t len, mgi_faults_t *out, const char **why);
int mgi_parse_cgroup(const char *buf, size_t len, mgi_cgpaths_t *out, const char **why);
/* A single number, or "max" (v2) which gives *unlimited = 1. */
int mgi_parse_limit(const char *buf, size_t len, uint64_t *out, int *unlimited,
                    const char **why);
int mgi_parse_cgstat(const char *buf, size_t len, int version, mgi_cgstat_t *out,
                     const char **why);
/* v2 memory.events, or v1 memory.oom_control (version 1). */
int mgi_parse_cgevents(const char *buf, size_t len, int version, mgi_cgevents_t *out,
                       const char **why);
/* A child's /proc/PID/smaps_rollup: the bytes it holds alone (its private
 * pages, and its share of swap). */
int mgi_parse_rollup(const char *buf, size_t len, uint64_t *private_bytes, const char **why);
/* A task's "children" file: pids each followed by a blank, appended to
 * pids[*n] (at most cap in all, none twice). On EBADMSG, those before the
 * bad one were appended. */
int mgi_parse_pids(const char *buf, size_t len, uint32_t *pids, size_t cap, size_t *n,
                   const char **why);
/* Value of "key <u64>" (or "key: <u64> kB" with scale) lines; ENOENT if absent. */
int mgi_find_u64(const char *buf, size_t len, const char *key, uint64_t *out);

/* A locale-free decimal ("0.9", "256") filling the whole string. 0 or EINVAL. */
int mgi_parse_double(const char *text, double *out);

/* v1 reports "no limit" as a huge page-rounded number. */
#define MGI_V1_UNLIMITED ((uint64_t)1 << 62)

/* ---- sources (the platform layer's sources.c) -------------------------------
 * Linux: kept-open /proc and cgroup descriptors read into stack buffers. */

enum {
    MGI_SRC_STATUS, MGI_SRC_STAT, MGI_SRC_STATM, MGI_SRC_MEMINFO, MGI_SRC_VMSTAT, MGI_SRC_PSI,
    MGI_SRC_CG_USAGE, MGI_SRC_CG_LIMIT, MGI_SRC_CG_HIGH, MGI_SRC_CG_STAT,
    MGI_SRC_CG_EVENTS, MGI_SRC_CG_PSI,
    MGI_SRC_COUNT
};

/* The slow sources (status, meminfo, vmstat, cgroup limit/stat/events) cost
 * 20-40 us each when cold, so they are cached and re-read only every
 * slow_interval_ms, on every sample once pressure is ELEVATED, or as soon as
 * RSS or cgroup usage moves by a sixteenth of the last known headroom. */
typedef struct mgi_slow {
    int have_status, have_meminfo, have_vm, have_vm_rate, have_cgstat, have_cgevents;
    int have_cg_usage;
    uint64_t cg_usage;              /* cached usage, used when there is no limit */
    mgi_status_t status;
    mgi_meminfo_t meminfo;
    mgi_vmstat_t vm;
    double swap_in_per_s, swap_out_per_s;
    uint64_t cg_limit, cg_high;     /* 0: none */
    uint64_t cg_own_limit;          /* the cgroup's own limit file as read (0: none) */
    mgi_cgstat_t cgstat;
    mgi_cgevents_t cgevents;
    uint64_t rss_at, cg_usage_at;   /* at the last refresh */
    int have_tree;                  /* the children were read */
    uint32_t children;              /* processes below this one, other ranks left out */
    uint64_t children_bytes;        /* their private and swapped bytes */
    uint64_t move_trigger;          /* bytes of movement forcing a refresh */
} mgi_slow_t;

#define MGI_PATH_MAX 1024
typedef struct mgi_sources {
    int fd[MGI_SRC_COUNT];          /* -1: closed or absent */
    int cg_version;                 /* 0: no memory cgroup found */
    int use_rusage;                 /* faults from getrusage, not self/stat */
    uint64_t cg_parent_limit;       /* v2: smallest memory.max above ours, 0 none */
    char proc_root[MGI_PATH_MAX];
    char cgroup_root[MGI_PATH_MAX];
    char cg_dir[MGI_PATH_MAX];      /* resolved cgroup directory */
    char cg_mount[MGI_PATH_MAX];    /* the hierarchy's mount (v2 parent limits) */

    uint64_t page_size;             /* for statm */
    uint64_t maxrss_bytes;          /* peak RSS from getrusage (live only) */
    void *layer;                    /* the platform layer's own state (macOS), or NULL */
    int64_t slow_period_ns;         /* refresh period of the slow sources */
    int64_t slow_at_ns;             /* time of the last refresh, 0 never */
    mgi_slow_t slow;
} mgi_sources_t;

/* Locate and open every source; absent ones stay -1. Never fails for a
 * missing source; EINVAL for roots that do not fit. */
int mgi_sources_open(mgi_sources_t *src, const char *proc_root, const char *cgroup_root);
/* Read the sources into the raw fields of *s (no rates, no level); s->mono_ns
 * must be set. @p urgent forces a refresh of the slow sources. */
void mgi_sources_read(mgi_sources_t *src, mg_sample_t *s, int urgent);
void mgi_sources_close(mgi_sources_t *src);
/* Close without touching anything but the descriptors (fork child). */
void mgi_sources_forget(mgi_sources_t *src);

/* ---- the sample (sample.c): what every platform layer shares ------------ */

/* Clear *src, close nothing, and copy the roots: every layer's
 * mgi_sources_open starts here. EINVAL for roots that do not fit. */
int mgi_sources_begin(mgi_sources_t *src, const char *proc_root, const char *cgroup_root);
/* Per-second rate of a counter; a counter that went backwards reads 0. */
double mgi_rate(uint64_t prev, uint64_t cur, double seconds);
/* Zero *s, set size/version, and mark every rate and fraction NaN (absent). */
void mgi_sample_init(mg_sample_t *s);
/* The arena's counters into *s (MG_HAVE_ARENA when an arena exists). */
void mgi_read_arena(mg_sample_t *s);
/* Fill the rate and stall fields of *cur from *prev (same sampler). */
void mgi_sample_deltas(const mg_sample_t *prev, mg_sample_t *cur);

/* Processes of a tree that are read at most (the children of the process
 * and theirs: DataLoader workers). */
#define MGI_TREE_MAX 64

/* ---- ranks of the same job (ranks.c) --------------------------------------
 * A descendant whose environment names another LOCAL_RANK or RANK than this
 * process is a rank of the same distributed job, not a worker: the process
 * tree leaves it out, with its own descendants. */
#define MGI_RANK_KEYS 2 /* LOCAL_RANK, RANK */
#define MGI_NO_RANK (-1)
typedef struct mgi_ranks {
    int64_t v[MGI_RANK_KEYS]; /* MGI_NO_RANK: not named, or not a rank number */
} mgi_ranks_t;

/* An environment block (/proc/PID/environ: "NAME=value" entries, each ended
 * by a NUL), fed in pieces of any size. ranks holds the first rank number
 * each key is given by an entry whose NUL was seen: an entry cut off at the
 * end of what was read gives nothing (its number may be cut too). */
typedef struct mgi_envscan {
    mgi_ranks_t ranks;
    size_t pos;      /* bytes of the current entry's name seen */
    unsigned match;  /* bits of the keys its name may still be */
    int key;         /* the key whose value is being read, or -1 */
    int digits;      /* of the value so far; -1: not a rank number */
    int64_t value;
} mgi_envscan_t;
void mgi_envscan_init(mgi_envscan_t *e);
void mgi_envscan_feed(mgi_envscan_t *e, const char *buf, size_t len);
/* Both keys are known: the rest of the block changes nothing. */
int mgi_envscan_done(const mgi_envscan_t *e);
/* A whole block at once. */
void mgi_parse_ranks(const char *buf, size_t len, mgi_ranks_t *out);
/* Whether a process whose environment names @p theirs is another rank of
 * this process's job (as mg_ranks_note last saw this process's own). */
int mgi_ranks_other(const mgi_ranks_t *theirs);

/* Fault the process's swapped-out pages back in (the layer's swapin.c):
 * every readable mapping of <proc_root>/self/smaps that holds swap. @p
 * swap_bytes gets what they held. 0 or errno; ENOSYS where the layer cannot. */
int mgi_swap_in(const char *proc_root, uint64_t *swap_bytes);

/* ---- notifiers (the platform layer's notify.c) --------------------------
 * A flag one thread raises and another polls for POLLIN on rd, with no
 * allocation and no lock: an eventfd on Linux (rd == wr), a non-blocking
 * pipe elsewhere. Signalling an already signalled notifier changes nothing. */
typedef struct mgi_note {
    int rd, wr; /* -1 when closed */
} mgi_note_t;
#define MGI_NOTE_CLOSED {-1, -1}

/* Open *n unless it is open; 0 or errno. */
int mgi_note_open(mgi_note_t *n);
void mgi_note_signal(const mgi_note_t *n);
/* Clear *n; 1 when it was signalled. */
int mgi_note_drain(const mgi_note_t *n);
void mgi_note_close(mgi_note_t *n);
/* Block until *n is signalled (1) or timeout_ns has passed (0). */
int mgi_note_wait(const mgi_note_t *n, int64_t timeout_ns);

/* ---- threads (the layer's thread.c) -------------------------------------- */
/* The CPU clock of @p thread for clock_gettime; 0 or errno (ENOTSUP where the
 * system has no such clocks). */
int mgi_thread_cpu_clock(pthread_t thread, clockid_t *clock);

/* ---- util --------------------------------------------------------------- */
int64_t mgi_clock_ns(int clock_id);
/* pread from offset 0 into buf (cap-1 bytes at most), NUL-terminate. */
int mgi_pread_file(int fd, char *buf, size_t cap, size_t *len);
/* Read a whole small file by path into buf; 0 or errno. */
int mgi_read_path(const char *path, char *buf, size_t cap, size_t *len);
/* snprintf that reports truncation as ENAMETOOLONG. */
int mgi_join(char *out, size_t cap, const char *a, const char *b, const char *c);

/* ---- the tree budget (arena.c) -------------------------------------------
 * The segment processes of one run share a budget through (`memguard run
 * --budget`): anonymous and inherited by fork, or a file that processes
 * started by exec map too. All zero is a valid empty tree. Here so that
 * tests can look inside. */
#define MGI_TREE_MAGIC 0x6d67747265650001ULL /* "mgtree", layout 1 */
#define MGI_TREE_SLOTS 4096
typedef struct mgi_tree {
    _Atomic uint64_t magic;  /* 0 until the first process maps it */
    _Atomic uint64_t budget; /* 0: none */
    _Atomic uint64_t total;  /* the slots' charges added up */
    struct {
        /* a generation << 32 | the pid; pid 0: free, -1: being taken back.
         * Every change of hands counts a generation, so a process whose pid
         * came back is never taken for the gone one it replaced. */
        _Atomic uint64_t owner;
        _Atomic uint64_t charge; /* what the process reserved beyond what it inherited */
    } slot[MGI_TREE_SLOTS];
} mgi_tree_t;
#define MGI_SLOT_PID(owner) ((int32_t)(uint32_t)(owner))

/* ---- options (options.c) ------------------------------------------------ */
typedef enum mgi_opt_id {
    MGI_OPT_INTERVAL_MS, MGI_OPT_RING_SIZE, MGI_OPT_PROC_ROOT, MGI_OPT_CGROUP_ROOT,
    MGI_OPT_BUDGET,
    MGI_OPT_BUDGET_ELEVATED, MGI_OPT_BUDGET_HIGH, MGI_OPT_BUDGET_CRITICAL,
    MGI_OPT_HEADROOM_ELEVATED, MGI_OPT_HEADROOM_HIGH, MGI_OPT_HEADROOM_CRITICAL,
    MGI_OPT_PSI_ELEVATED, MGI_OPT_PSI_HIGH, MGI_OPT_PSI_CRITICAL,
    MGI_OPT_SWAP_IN_ELEVATED, MGI_OPT_SWAP_IN_HIGH, MGI_OPT_SWAP_IN_CRITICAL,
    MGI_OPT_MAJFLT_ELEVATED, MGI_OPT_MAJFLT_HIGH, MGI_OPT_MAJFLT_CRITICAL,
    MGI_OPT_CALM_SAMPLES, MGI_OPT_SLOW_INTERVAL_MS,
    MGI_OPT_COUNT
} mgi_opt_id_t;

double mgi_option_double(mgi_opt_id_t id);
void mgi_options_atfork_child(void);
long mgi_option_long(mgi_opt_id_t id);
/* Copy a text option (roots, budget) into buf. */
void mgi_option_text(mgi_opt_id_t id, char *buf, size_t cap);

#endif /* MEMGUARD_MGI_H */
