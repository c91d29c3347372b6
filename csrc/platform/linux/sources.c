/* Telemetry sources: locate the memory cgroup once, keep every file open,
 * and read them with pread into one stack buffer per sample, so a sample
 * costs a handful of syscalls and no allocation. */
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "memguard/memguard-arena.h"
#include "mgi.h"

/* /proc/vmstat is the largest file we read (about 5 KiB today). */
#define MGI_READ_BUF 16384

static int path_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Strip the last component of an absolute cgroup path in place ("/a/b" -> "/a",
 * "/a" -> ""). Returns 0 when nothing was left to strip. */
static int strip_last(char *rel)
{
    char *slash = strrchr(rel, '/');
    if (!slash || rel[0] == '\0')
        return 0;
    *slash = '\0';
    return 1;
}

/* Find the deepest existing directory mount+rel[..] holding @p probe. Inside a
 * cgroup namespace or a container the path in /proc/self/cgroup may name
 * directories the mount does not show, so walk up until one exists. */
/* Does the cgroup path have a ".." component? */
static int climbs(const char *rel)
{
    size_t n = strlen(rel);
    return strstr(rel, "/../") != NULL || (n >= 3 && strcmp(rel + n - 3, "/..") == 0);
}

static int find_cg_dir(const char *mount, const char *rel_in, const char *probe,
                       char *dir, size_t cap)
{
    char rel[MGI_CGPATH_MAX];
    char file[MGI_PATH_MAX];
    snprintf(rel, sizeof(rel), "%s", rel_in);
    /* Outside a namespace's root the path climbs with "..": joined to the
     * mount it would leave it, so start from the mount's root instead. */
    if (strcmp(rel, "/") == 0 || climbs(rel))
        rel[0] = '\0';
    for (;;) {
        if (mgi_join(dir, cap, mount, rel, NULL) == 0 &&
            mgi_join(file, sizeof(file), dir, "/", probe) == 0 && path_exists(file))
            return 0;
        if (!strip_last(rel))
            return ENOENT;
    }
}

static int open_at(const char *dir, const char *name)
{
    char path[MGI_PATH_MAX];
    if (mgi_join(path, sizeof(path), dir, "/", name) != 0)
        return -1;
    return open(path, O_RDONLY | O_CLOEXEC);
}

/* v2 limits are hierarchical: the tightest memory.max above us applies too. */
static uint64_t v2_parent_limit(const char *mount, const char *dir)
{
    char d[MGI_PATH_MAX], file[MGI_PATH_MAX], buf[64];
    size_t mlen = strlen(mount), len;
    uint64_t best = 0;
    snprintf(d, sizeof(d), "%s", dir);
    while (strlen(d) > mlen) {
        char *slash = strrchr(d, '/');
        if (!slash || (size_t)(slash - d) < mlen)
            break;
        *slash = '\0';
        if (strlen(d) <= mlen)
            break; /* the root cgroup has no memory.max */
        uint64_t v;
        int unlimited;
        const char *why;
        if (mgi_join(file, sizeof(file), d, "/memory.max", NULL) == 0 &&
            mgi_read_path(file, buf, sizeof(buf), &len) == 0 &&
            mgi_parse_limit(buf, len, &v, &unlimited, &why) == 0 && !unlimited &&
            (best == 0 || v < best))
            best = v;
    }
    return best;
}

static void locate_cgroup(mgi_sources_t *src)
{
    char path[MGI_PATH_MAX], buf[4096], mount[MGI_PATH_MAX];
    size_t len;
    const char *why;
    mgi_cgpaths_t cg;

    src->cg_version = 0;
    if (mgi_join(path, sizeof(path), src->proc_root, "/self/cgroup", NULL) ||
        mgi_read_path(path, buf, sizeof(buf), &len) || mgi_parse_cgroup(buf, len, &cg, &why))
        return;

    /* pure v2: the root itself lists controllers */
    if (mgi_join(path, sizeof(path), src->cgroup_root, "/cgroup.controllers", NULL) == 0 &&
        path_exists(path)) {
        if (cg.have_v2 &&
            find_cg_dir(src->cgroup_root, cg.v2, "memory.current", src->cg_dir,
                        sizeof(src->cg_dir)) == 0) {
            src->cg_version = 2;
            snprintf(src->cg_mount, sizeof(src->cg_mount), "%s", src->cgroup_root);
        }
        return;
    }
    /* v1 or hybrid: the memory controller has its own mount */
    if (cg.have_v1 && mgi_join(mount, sizeof(mount), src->cgroup_root, "/memory", NULL) == 0 &&
        find_cg_dir(mount, cg.v1_memory, "memory.usage_in_bytes", src->cg_dir,
                    sizeof(src->cg_dir)) == 0) {
        src->cg_version = 1;
        return;
    }
    /* hybrid with the memory controller moved to the unified mount */
    if (cg.have_v2 && mgi_join(mount, sizeof(mount), src->cgroup_root, "/unified", NULL) == 0 &&
        find_cg_dir(mount, cg.v2, "memory.current", src->cg_dir, sizeof(src->cg_dir)) == 0) {
        src->cg_version = 2;
        snprintf(src->cg_mount, sizeof(src->cg_mount), "%s", mount);
    }
}

int mgi_sources_open(mgi_sources_t *src, const char *proc_root, const char *cgroup_root)
{
    static const char *const proc_files[] = {
        [MGI_SRC_STATUS] = "/self/status", [MGI_SRC_STAT] = "/self/stat",
        [MGI_SRC_STATM] = "/self/statm",
        [MGI_SRC_MEMINFO] = "/meminfo",   [MGI_SRC_VMSTAT] = "/vmstat",
        [MGI_SRC_PSI] = "/pressure/memory",
    };
    if (mgi_sources_begin(src, proc_root, cgroup_root))
        return EINVAL;
    /* On the live /proc, getrusage gives the same fault counters as
     * /proc/self/stat for a sixth of the cost; fixture roots read the file. */
    src->use_rusage = strcmp(src->proc_root, "/proc") == 0;
    src->page_size = (uint64_t)sysconf(_SC_PAGESIZE);
    src->slow_period_ns = (int64_t)(mgi_option_double(MGI_OPT_SLOW_INTERVAL_MS) * 1e6);
    for (int i = MGI_SRC_STATUS; i <= MGI_SRC_PSI; i++) {
        if (i == MGI_SRC_STAT && src->use_rusage)
            continue;
        char path[MGI_PATH_MAX];
        if (mgi_join(path, sizeof(path), src->proc_root, proc_files[i], NULL) == 0)
            src->fd[i] = open(path, O_RDONLY | O_CLOEXEC);
    }
    locate_cgroup(src);
    if (src->cg_version == 2) {
        src->fd[MGI_SRC_CG_USAGE] = open_at(src->cg_dir, "memory.current");
        src->fd[MGI_SRC_CG_LIMIT] = open_at(src->cg_dir, "memory.max");
        src->fd[MGI_SRC_CG_HIGH] = open_at(src->cg_dir, "memory.high");
        src->fd[MGI_SRC_CG_STAT] = open_at(src->cg_dir, "memory.stat");
        src->fd[MGI_SRC_CG_EVENTS] = open_at(src->cg_dir, "memory.events");
        src->fd[MGI_SRC_CG_PSI] = open_at(src->cg_dir, "memory.pressure");
    } else if (src->cg_version == 1) {
        src->fd[MGI_SRC_CG_USAGE] = open_at(src->cg_dir, "memory.usage_in_bytes");
        src->fd[MGI_SRC_CG_LIMIT] = open_at(src->cg_dir, "memory.limit_in_bytes");
        src->fd[MGI_SRC_CG_STAT] = open_at(src->cg_dir, "memory.stat");
        src->fd[MGI_SRC_CG_EVENTS] = open_at(src->cg_dir, "memory.oom_control");
    }
    return 0;
}

void mgi_sources_forget(mgi_sources_t *src)
{
    for (int i = 0; i < MGI_SRC_COUNT; i++) {
        if (src->fd[i] >= 0)
            close(src->fd[i]);
        src->fd[i] = -1;
    }
}

void mgi_sources_close(mgi_sources_t *src)
{
    mgi_sources_forget(src);
    src->cg_version = 0;
}

/* Read source i into buf; 0 when it is open and readable. */
static int rd(mgi_sources_t *src, int i, char *buf, size_t *len)
{
    if (src->fd[i] < 0)
        return EBADF;
    return mgi_pread_file(src->fd[i], buf, MGI_READ_BUF, len);
}

/* A limit of "max" (v2) or v1's huge page-rounded sentinel means none. */
static int real_limit(uint64_t v, int unlimited)
{
    return !unlimited && v > 0 && v < MGI_V1_UNLIMITED;
}

/* cgroup usage, into the sample. */
static void read_cg_usage(mgi_sources_t *src, mg_sample_t *s, char *buf)
{
    size_t len;
    const char *why;
    uint64_t v;
    int unlimited;
    if (rd(src, MGI_SRC_CG_USAGE, buf, &len) || mgi_parse_limit(buf, len, &v, &unlimited, &why) ||
        unlimited)
        return;
    s->have |= MG_HAVE_CGROUP;
    s->cgroup_version = src->cg_version;
    s->cgroup_usage_bytes = v;
}

/* v2 cgroup PSI, into the sample. Stall totals move fast and their rate
 * needs two samples in a row, so it is read on every sample, limit or not. */
static void read_cg_psi(mgi_sources_t *src, mg_sample_t *s, char *buf)
{
    size_t len;
    const char *why;
    mgi_psi_t psi;
    if (rd(src, MGI_SRC_CG_PSI, buf, &len) == 0 && mgi_parse_psi(buf, len, &psi, &why) == 0 &&
        psi.have_full) {
        s->have |= MG_HAVE_CGROUP_PSI;
        s->cgroup_psi_some_avg10 = psi.some_avg10;
        s->cgroup_psi_full_avg10 = psi.full_avg10;
        s->cgroup_psi_some_total_us = psi.some_total_us;
        s->cgroup_psi_full_total_us = psi.full_total_us;
    }
}

/* Every sample: the cheap sources whose values move fastest. */
static void read_fast(mgi_sources_t *src, mg_sample_t *s, char *buf)
{
    size_t len;
    const char *why;
    uint64_t v;

    if (rd(src, MGI_SRC_STATM, buf, &len) == 0 &&
        mgi_parse_statm(buf, len, src->page_size, &v, &why) == 0) {
        s->have |= MG_HAVE_STATUS;
        s->rss_bytes = v;
    }
    if (src->use_rusage) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) == 0) {
            s->have |= MG_HAVE_FAULTS;
            s->minor_faults = (uint64_t)ru.ru_minflt;
            s->major_faults = (uint64_t)ru.ru_majflt;
            src->maxrss_bytes = (uint64_t)ru.ru_maxrss * 1024;
        }
    } else if (rd(src, MGI_SRC_STAT, buf, &len) == 0) {
        mgi_faults_t f;
        if (mgi_parse_stat(buf, len, &f, &why) == 0) {
            s->have |= MG_HAVE_FAULTS;
            s->minor_faults = f.minor;
            s->major_faults = f.major;
        }
    }
    /* PSI may exist but fail to read (EOPNOTSUPP with psi=0 on the kernel
     * command line): the sample simply lacks it. */
    mgi_psi_t psi;
    if (rd(src, MGI_SRC_PSI, buf, &len) == 0 && mgi_parse_psi(buf, len, &psi, &why) == 0) {
        s->have |= MG_HAVE_PSI;
        s->psi_some_avg10 = psi.some_avg10;
        s->psi_some_avg60 = psi.some_avg60;
        s->psi_some_total_us = psi.some_total_us;
        if (psi.have_full) {
            s->have |= MG_HAVE_PSI_FULL;
            s->psi_full_avg10 = psi.full_avg10;
            s->psi_full_avg60 = psi.full_avg60;
            s->psi_full_total_us = psi.full_total_us;
        }
    }
    /* Without a limit, cgroup usage is no pressure signal: read it with the
     * slow sources instead of every sample. */
    if (src->cg_version && (src->slow.cg_limit || src->slow_at_ns == 0))
        read_cg_usage(src, s, buf);
    if (src->cg_version == 2)
        read_cg_psi(src, s, buf);
}

/* A directory entry as getdents64 writes it: read into a stack buffer, as
 * opendir would allocate. */
struct mgi_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* Append the children of every task of process @p pid ("self" or a number)
 * to pids[] (at most MGI_TREE_MAX, none twice). 0 when its tasks could be
 * listed. */
static int add_children(const mgi_sources_t *src, const char *pid, uint32_t *pids, size_t *n,
                         char *buf)
{
    char path[MGI_PATH_MAX], task[MGI_PATH_MAX];
    _Alignas(8) char dents[2048];
    size_t len;
    if (snprintf(task, sizeof(task), "%s/%s/task", src->proc_root, pid) >= (int)sizeof(task))
        return ENAMETOOLONG;
    int fd = open(task, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    long got;
    while ((got = syscall(SYS_getdents64, fd, dents, sizeof(dents))) > 0) {
        for (long off = 0; off < got;) {
            struct mgi_dirent64 *d = (struct mgi_dirent64 *)(dents + off);
            off += d->d_reclen;
            if (d->d_name[0] == '.' ||
                snprintf(path, sizeof(path), "%s/%s/children", task, d->d_name) >=
                    (int)sizeof(path) ||
                mgi_read_path(path, buf, MGI_READ_BUF, &len) != 0)
                continue;
            const char *why;
            (void)mgi_parse_pids(buf, len, pids, MGI_TREE_MAX, n, &why); /* adds what it could */
        }
    }
    close(fd);
    return 0;
}

/* Environments are read this far at most (a few KiB is usual). */
#define MGI_ENV_MAX (256 * 1024)

/* Whether descendant @p pid is another rank of this process's job: its
 * environment, read through buf, names another LOCAL_RANK or RANK. One it
 * cannot read (gone, not ours) is no rank. */
static int is_rank(const mgi_sources_t *src, uint32_t pid, char *buf)
{
    char path[MGI_PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%u/environ", src->proc_root, pid) >= (int)sizeof(path))
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    mgi_envscan_t e;
    mgi_envscan_init(&e);
    size_t seen = 0;
    while (seen < MGI_ENV_MAX && !mgi_envscan_done(&e)) {
        ssize_t got = read(fd, buf, MGI_READ_BUF);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        mgi_envscan_feed(&e, buf, (size_t)got);
        seen += (size_t)got;
    }
    close(fd);
    return mgi_ranks_other(&e.ranks);
}

/* The process tree below this one (DataLoader workers and theirs): how many
 * processes, and the bytes they hold alone (private pages and their share
 * of swap). What they share with this process is in its RSS already.
 * Other ranks of the job this process started are left out, with theirs. */
static void read_tree(mgi_sources_t *src, char *buf)
{
    mgi_slow_t *c = &src->slow;
    uint32_t pids[MGI_TREE_MAX];
    unsigned char rank[MGI_TREE_MAX];
    char pid[16], path[MGI_PATH_MAX];
    size_t n = 0, len;
    const char *why;
    c->have_tree = add_children(src, "self", pids, &n, buf) == 0;
    for (size_t i = 0; i < n; i++) { /* n grows as grandchildren are found */
        rank[i] = (unsigned char)is_rank(src, pids[i], buf);
        if (rank[i])
            continue; /* its tree is its own */
        snprintf(pid, sizeof(pid), "%u", pids[i]);
        (void)add_children(src, pid, pids, &n, buf);
    }
    c->children = 0;
    c->children_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t v;
        if (rank[i] ||
            snprintf(path, sizeof(path), "%s/%u/smaps_rollup", src->proc_root, pids[i]) >=
                (int)sizeof(path) ||
            mgi_read_path(path, buf, MGI_READ_BUF, &len) != 0 ||
            mgi_parse_rollup(buf, len, &v, &why) != 0)
            continue; /* gone, or not ours to read */
        c->children++;
        c->children_bytes += v;
    }
}

/* Re-read the slow sources into src's cache; swap rates span the time since
 * the last refresh. */
static void refresh_slow(mgi_sources_t *src, mg_sample_t *s, char *buf)
{
    size_t len;
    const char *why;
    uint64_t v;
    int unlimited;
    mgi_slow_t *c = &src->slow;
    int64_t dt = s->mono_ns - src->slow_at_ns;

    c->have_status = rd(src, MGI_SRC_STATUS, buf, &len) == 0 &&
                     mgi_parse_status(buf, len, &c->status, &why) == 0;
    c->have_meminfo = rd(src, MGI_SRC_MEMINFO, buf, &len) == 0 &&
                      mgi_parse_meminfo(buf, len, &c->meminfo, &why) == 0;

    mgi_vmstat_t vm;
    if (rd(src, MGI_SRC_VMSTAT, buf, &len) == 0 && mgi_parse_vmstat(buf, len, &vm, &why) == 0) {
        c->have_vm_rate = c->have_vm && src->slow_at_ns && dt > 0;
        if (c->have_vm_rate) {
            c->swap_in_per_s = mgi_rate(c->vm.pswpin, vm.pswpin, (double)dt / 1e9);
            c->swap_out_per_s = mgi_rate(c->vm.pswpout, vm.pswpout, (double)dt / 1e9);
        }
        c->vm = vm;
        c->have_vm = 1;
    } else {
        c->have_vm = c->have_vm_rate = 0;
    }

    c->cg_limit = 0;
    c->cg_high = 0;
    c->have_cgstat = c->have_cgevents = 0;
    if (src->cg_version && !(s->have & MG_HAVE_CGROUP))
        read_cg_usage(src, s, buf);
    c->have_cg_usage = (s->have & MG_HAVE_CGROUP) != 0;
    c->cg_usage = s->cgroup_usage_bytes;
    if (src->cg_version == 2) /* limits above ours can change too */
        src->cg_parent_limit = v2_parent_limit(src->cg_mount, src->cg_dir);
    c->cg_own_limit = 0;
    if (src->cg_version) {
        if (rd(src, MGI_SRC_CG_LIMIT, buf, &len) == 0 &&
            mgi_parse_limit(buf, len, &v, &unlimited, &why) == 0 && real_limit(v, unlimited))
            c->cg_limit = c->cg_own_limit = v;
        if (src->cg_parent_limit && (c->cg_limit == 0 || src->cg_parent_limit < c->cg_limit))
            c->cg_limit = src->cg_parent_limit;
        c->have_cgstat = rd(src, MGI_SRC_CG_STAT, buf, &len) == 0 &&
                         mgi_parse_cgstat(buf, len, src->cg_version, &c->cgstat, &why) == 0;
        if (c->have_cgstat && real_limit(c->cgstat.hierarchical_limit, 0) &&
            (c->cg_limit == 0 || c->cgstat.hierarchical_limit < c->cg_limit))
            c->cg_limit = c->cgstat.hierarchical_limit;
        if (rd(src, MGI_SRC_CG_HIGH, buf, &len) == 0 &&
            mgi_parse_limit(buf, len, &v, &unlimited, &why) == 0 && real_limit(v, unlimited))
            c->cg_high = v;
        c->have_cgevents = rd(src, MGI_SRC_CG_EVENTS, buf, &len) == 0 &&
                           mgi_parse_cgevents(buf, len, src->cg_version, &c->cgevents, &why) == 0 &&
                           (src->cg_version == 2 || c->cgevents.have_oom_kill);
    }

    read_tree(src, buf);

    /* Where the process's own growth would eat the headroom, re-read early. */
    uint64_t head = UINT64_MAX;
    if (c->have_meminfo && c->meminfo.have_available)
        head = c->meminfo.available_bytes;
    if (c->cg_limit && s->cgroup_usage_bytes < c->cg_limit && c->cg_limit - s->cgroup_usage_bytes < head)
        head = c->cg_limit - s->cgroup_usage_bytes;
    c->move_trigger = head == UINT64_MAX ? UINT64_MAX : head / 16;
    c->rss_at = s->rss_bytes;
    c->cg_usage_at = s->cgroup_usage_bytes;
    src->slow_at_ns = s->mono_ns;
}

static uint64_t absdiff(uint64_t a, uint64_t b)
{
    return a > b ? a - b : b - a;
}

static int slow_due(const mgi_sources_t *src, const mg_sample_t *s, int urgent)
{
    const mgi_slow_t *c = &src->slow;
    return urgent || src->slow_at_ns == 0 || s->mono_ns - src->slow_at_ns >= src->slow_period_ns ||
           absdiff(s->rss_bytes, c->rss_at) > c->move_trigger ||
           ((s->have & MG_HAVE_CGROUP) &&
            absdiff(s->cgroup_usage_bytes, c->cg_usage_at) > c->move_trigger);
}

/* Copy the cached slow values into the sample. */
static void fill_slow(const mgi_sources_t *src, mg_sample_t *s)
{
    const mgi_slow_t *c = &src->slow;
    if (c->have_status) {
        if (!(s->have & MG_HAVE_STATUS)) {
            s->have |= MG_HAVE_STATUS;
            s->rss_bytes = c->status.rss_bytes;
        }
        s->rss_peak_bytes = c->status.hwm_bytes;
        if (c->status.have_swap) {
            s->have |= MG_HAVE_SWAP;
            s->swap_bytes = c->status.swap_bytes;
        }
    }
    if (s->have & MG_HAVE_STATUS) {
        s->have |= MG_HAVE_FOOTPRINT;
        s->footprint_bytes = s->rss_bytes + ((s->have & MG_HAVE_SWAP) ? s->swap_bytes : 0);
    }
    if (c->have_tree) {
        s->have |= MG_HAVE_CHILDREN;
        s->children = c->children;
        s->children_bytes = c->children_bytes;
        s->footprint_bytes += c->children_bytes;
    }
    /* the peak is never below what we see now or what getrusage saw */
    if (s->have & MG_HAVE_STATUS)
        s->have |= MG_HAVE_RSS_PEAK;
    if (src->maxrss_bytes > s->rss_peak_bytes)
        s->rss_peak_bytes = src->maxrss_bytes;
    if (s->rss_bytes > s->rss_peak_bytes)
        s->rss_peak_bytes = s->rss_bytes;
    if (c->have_meminfo) {
        s->have |= MG_HAVE_MEMINFO | MG_HAVE_SWAP_TOTAL;
        s->mem_total_bytes = c->meminfo.total_bytes;
        s->swap_total_bytes = c->meminfo.swap_total_bytes;
        s->swap_free_bytes = c->meminfo.swap_free_bytes;
        if (c->meminfo.have_available) {
            s->have |= MG_HAVE_MEMAVAIL;
            s->mem_available_bytes = c->meminfo.available_bytes;
        }
    }
    if (c->have_vm) {
        s->have |= MG_HAVE_VMSTAT;
        s->swap_in_pages = c->vm.pswpin;
        s->swap_out_pages = c->vm.pswpout;
        s->system_major_faults = c->vm.pgmajfault;
        if (c->have_vm_rate) {
            s->swap_in_pages_per_s = c->swap_in_per_s;
            s->swap_out_pages_per_s = c->swap_out_per_s;
        }
    }
    if (!(s->have & MG_HAVE_CGROUP) && c->have_cg_usage) {
        s->have |= MG_HAVE_CGROUP;
        s->cgroup_version = src->cg_version;
        s->cgroup_usage_bytes = c->cg_usage;
    }
    if (!(s->have & MG_HAVE_CGROUP))
        return;
    if (c->cg_limit) {
        s->have |= MG_HAVE_CGROUP_LIMIT;
        s->cgroup_limit_bytes = c->cg_limit;
    }
    if (c->cg_high) {
        s->have |= MG_HAVE_CGROUP_HIGH;
        s->cgroup_high_bytes = c->cg_high;
    }
    if (c->have_cgstat && c->cgstat.have_inactive_file) {
        s->have |= MG_HAVE_CGROUP_WS;
        s->cgroup_working_set_bytes = s->cgroup_usage_bytes > c->cgstat.inactive_file
                                          ? s->cgroup_usage_bytes - c->cgstat.inactive_file
                                          : 0;
    }
    if (c->have_cgevents) {
        s->have |= MG_HAVE_CGROUP_EVENTS;
        s->cgroup_oom_events = c->cgevents.oom;
        s->cgroup_oom_kill_events = c->cgevents.oom_kill;
    }
}

/* Whether the cgroup's own limit differs from the one last refreshed: a
 * limit lowered (or raised) mid-run is met within one sample, not one slow
 * period. One pread of a small file. */
static int limit_moved(mgi_sources_t *src, char *buf)
{
    size_t len;
    const char *why;
    uint64_t v;
    int unlimited;
    if (!src->cg_version || src->slow_at_ns == 0 || rd(src, MGI_SRC_CG_LIMIT, buf, &len) ||
        mgi_parse_limit(buf, len, &v, &unlimited, &why))
        return 0;
    return (real_limit(v, unlimited) ? v : 0) != src->slow.cg_own_limit;
}

void mgi_sources_read(mgi_sources_t *src, mg_sample_t *s, int urgent)
{
    char buf[MGI_READ_BUF];
    read_fast(src, s, buf);
    urgent |= limit_moved(src, buf);
    if (slow_due(src, s, urgent))
        refresh_slow(src, s, buf);
    fill_slow(src, s);
}
