/* The pure /proc and cgroup parsers: exact values from every fixture file,
 * rejection of every malformed file in bad/, and robustness: each fixture
 * cut at every length, with bytes flipped and randomised, and random input,
 * must parse (a prefix then yields only values of the full file, never a
 * wrong number) or fail with EBADMSG and a reason. Every input sits in an
 * exactly-sized, unterminated allocation, so AddressSanitizer turns a read
 * past the end into a failure. */
#include <dirent.h>

#include "mgi.h"
#include "mgtest.h"

#define PAGE 4096 /* page size handed to the statm parser */

typedef enum {
    K_STATUS, K_MEMINFO, K_VMSTAT, K_PSI, K_STAT, K_STATM, K_CGROUP, K_LIMIT, K_CGSTAT,
    K_CGEVENTS, K_ROLLUP, K_PIDS, K_COUNT
} kind_t;

static const char *const kind_names[K_COUNT] = {
    "status", "meminfo", "vmstat", "psi", "stat", "statm", "cgroup", "limit", "cgstat", "cgevents",
    "rollup", "pids",
};

typedef struct parsed {
    mgi_status_t status;
    mgi_meminfo_t meminfo;
    mgi_vmstat_t vmstat;
    mgi_psi_t psi;
    mgi_faults_t stat;
    uint64_t statm;
    mgi_cgpaths_t cgroup;
    uint64_t limit;
    int unlimited;
    mgi_cgstat_t cgstat;
    mgi_cgevents_t cgevents;
    uint64_t rollup;
    uint32_t pids[8];
    size_t n_pids;
} parsed_t;

static int parse(kind_t k, int version, const char *buf, size_t len, parsed_t *o, const char **why)
{
    switch (k) {
    case K_STATUS: return mgi_parse_status(buf, len, &o->status, why);
    case K_MEMINFO: return mgi_parse_meminfo(buf, len, &o->meminfo, why);
    case K_VMSTAT: return mgi_parse_vmstat(buf, len, &o->vmstat, why);
    case K_PSI: return mgi_parse_psi(buf, len, &o->psi, why);
    case K_STAT: return mgi_parse_stat(buf, len, &o->stat, why);
    case K_STATM: return mgi_parse_statm(buf, len, PAGE, &o->statm, why);
    case K_CGROUP: return mgi_parse_cgroup(buf, len, &o->cgroup, why);
    case K_LIMIT: return mgi_parse_limit(buf, len, &o->limit, &o->unlimited, why);
    case K_CGSTAT: return mgi_parse_cgstat(buf, len, version, &o->cgstat, why);
    case K_CGEVENTS: return mgi_parse_cgevents(buf, len, version, &o->cgevents, why);
    case K_ROLLUP: return mgi_parse_rollup(buf, len, &o->rollup, why);
    case K_PIDS:
        o->n_pids = 0;
        return mgi_parse_pids(buf, len, o->pids, 8, &o->n_pids, why);
    default: return EINVAL;
    }
}

/* Would a prefix's parse be honest? Every value equals the full file's, or
 * is absent. v1 memory.stat may fall back to the non-hierarchical
 * inactive_file (alt) when the total_ line was cut off. */
static int consistent(kind_t k, int version, const parsed_t *f, const parsed_t *p, uint64_t alt)
{
    switch (k) {
    case K_STATUS:
        return p->status.rss_bytes == f->status.rss_bytes &&
               p->status.hwm_bytes == f->status.hwm_bytes &&
               (!p->status.have_swap || p->status.swap_bytes == f->status.swap_bytes);
    case K_MEMINFO:
        return p->meminfo.total_bytes == f->meminfo.total_bytes &&
               (!p->meminfo.have_available ||
                p->meminfo.available_bytes == f->meminfo.available_bytes) &&
               (!p->meminfo.have_swap ||
                (p->meminfo.swap_total_bytes == f->meminfo.swap_total_bytes &&
                 p->meminfo.swap_free_bytes == f->meminfo.swap_free_bytes));
    case K_VMSTAT:
        return memcmp(&p->vmstat, &f->vmstat, sizeof(p->vmstat)) == 0;
    case K_PSI:
        return p->psi.some_avg10 == f->psi.some_avg10 && p->psi.some_avg60 == f->psi.some_avg60 &&
               p->psi.some_total_us == f->psi.some_total_us &&
               (!p->psi.have_full ||
                (p->psi.full_avg10 == f->psi.full_avg10 && p->psi.full_avg60 == f->psi.full_avg60 &&
                 p->psi.full_total_us == f->psi.full_total_us));
    case K_STAT:
        return p->stat.minor == f->stat.minor && p->stat.major == f->stat.major;
    case K_STATM:
        return p->statm == f->statm;
    case K_CGROUP:
        return (!p->cgroup.have_v1 || strcmp(p->cgroup.v1_memory, f->cgroup.v1_memory) == 0) &&
               (!p->cgroup.have_v2 || strcmp(p->cgroup.v2, f->cgroup.v2) == 0);
    case K_LIMIT:
        return p->limit == f->limit && p->unlimited == f->unlimited;
    case K_CGSTAT:
        return (!p->cgstat.have_inactive_file ||
                p->cgstat.inactive_file == f->cgstat.inactive_file ||
                (version == 1 && p->cgstat.inactive_file == alt)) &&
               (p->cgstat.hierarchical_limit == 0 ||
                p->cgstat.hierarchical_limit == f->cgstat.hierarchical_limit);
    case K_CGEVENTS:
        if (version == 1)
            return !p->cgevents.have_oom_kill ? p->cgevents.oom == 0
                                              : p->cgevents.oom_kill == f->cgevents.oom_kill &&
                                                    p->cgevents.oom == f->cgevents.oom;
        return p->cgevents.oom == f->cgevents.oom &&
               (!p->cgevents.have_oom_kill || p->cgevents.oom_kill == f->cgevents.oom_kill);
    case K_ROLLUP:
        return p->rollup == f->rollup;
    case K_PIDS: /* a prefix of the pids, each whole */
        return p->n_pids <= f->n_pids &&
               memcmp(p->pids, f->pids, p->n_pids * sizeof(p->pids[0])) == 0;
    default:
        return 0;
    }
}

static const char *fixtures;

/* Parse fixture file rel (relative to the fixture tree) into *o; 0 or rc. */
static int load(const char *rel, kind_t k, int version, parsed_t *o)
{
    char path[1024];
    size_t len;
    const char *why = NULL;
    snprintf(path, sizeof(path), "%s/%s", fixtures, rel);
    char *buf = mgt_slurp(path, &len);
    if (!buf) {
        printf("cannot read %s\n", path);
        return ENOENT;
    }
    memset(o, 0, sizeof(*o));
    int rc = parse(k, version, buf, len, o, &why);
    if (rc)
        printf("%s: %s\n", rel, why ? why : "(no reason)");
    free(buf);
    return rc;
}

#define KiB 1024ULL

static void test_status(void)
{
    static const struct {
        const char *rel;
        uint64_t rss_kb, hwm_kb, swap_kb;
        int have_swap;
    } cases[] = {
        {"v1_hybrid/proc/self/status", 102400, 204800, 2048, 1},
        {"v1_parent_limit/proc/self/status", 81920, 102400, 0, 1},
        {"v2/proc/self/status", 204800, 307200, 0, 1},
        {"v2_nolimit/proc/self/status", 51200, 51200, 0, 0},
        {"no_psi/proc/self/status", 30720, 40960, 0, 1},
        {"nscgroup/proc/self/status", 153600, 153600, 512, 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        parsed_t o;
        CHECK_EQ(load(cases[i].rel, K_STATUS, 2, &o), 0);
        CHECK_EQ(o.status.rss_bytes, cases[i].rss_kb * KiB);
        CHECK_EQ(o.status.hwm_bytes, cases[i].hwm_kb * KiB);
        CHECK_EQ(o.status.have_swap, cases[i].have_swap);
        CHECK_EQ(o.status.swap_bytes, cases[i].swap_kb * KiB);
    }
}

static void test_statm_and_stat(void)
{
    static const struct {
        const char *scenario;
        uint64_t resident, minflt, majflt;
    } cases[] = {
        {"v1_hybrid", 25600, 123456, 789}, {"v1_parent_limit", 20480, 1000, 10},
        {"v2", 51200, 222222, 22},         {"v2_nolimit", 12800, 5000, 0},
        {"no_psi", 7680, 777, 7},          {"nscgroup", 38400, 424242, 4242},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char rel[256];
        parsed_t o;
        snprintf(rel, sizeof(rel), "%s/proc/self/statm", cases[i].scenario);
        CHECK_EQ(load(rel, K_STATM, 2, &o), 0);
        CHECK_EQ(o.statm, cases[i].resident * PAGE);
        snprintf(rel, sizeof(rel), "%s/proc/self/stat", cases[i].scenario);
        CHECK_EQ(load(rel, K_STAT, 2, &o), 0);
        CHECK_EQ(o.stat.minor, cases[i].minflt);
        CHECK_EQ(o.stat.major, cases[i].majflt);
    }
    /* a command name with spaces and parentheses: fields start after the last ')' */
    static const char odd[] = "7 (a) b) (c) S 1 7 7 0 -1 0 11 0 22 0 0 0 0 0 20 0 1 0\n";
    mgi_faults_t f;
    const char *why = NULL;
    char *b = mgt_copy(odd, sizeof(odd) - 1);
    CHECK_EQ(mgi_parse_stat(b, sizeof(odd) - 1, &f, &why), 0);
    CHECK_EQ(f.minor, 11);
    CHECK_EQ(f.major, 22);
    free(b);
    uint64_t rss = 0;
    CHECK_EQ(mgi_parse_statm("10 20\n", 6, 16384, &rss, &why), 0);
    CHECK_EQ(rss, 20 * 16384);
    CHECK_EQ(mgi_parse_statm("10 9999999999999999999 0\n", 25, 4096, &rss, &why), EBADMSG);
}

static void test_meminfo_and_vmstat(void)
{
    parsed_t o;
    CHECK_EQ(load("v2/proc/meminfo", K_MEMINFO, 2, &o), 0);
    CHECK_EQ(o.meminfo.total_bytes, 32768000 * KiB);
    CHECK_EQ(o.meminfo.have_available, 1);
    CHECK_EQ(o.meminfo.available_bytes, 16384000 * KiB);
    CHECK_EQ(o.meminfo.have_swap, 1);
    CHECK_EQ(o.meminfo.swap_total_bytes, 8388604 * KiB);
    CHECK_EQ(o.meminfo.swap_free_bytes, 8000000 * KiB);

    CHECK_EQ(load("v2_nolimit/proc/meminfo", K_MEMINFO, 2, &o), 0);
    CHECK_EQ(o.meminfo.available_bytes, 2000000 * KiB);
    CHECK_EQ(o.meminfo.have_swap, 1);
    CHECK_EQ(o.meminfo.swap_total_bytes, 0);

    CHECK_EQ(load("no_psi/proc/meminfo", K_MEMINFO, 2, &o), 0);
    CHECK_EQ(o.meminfo.total_bytes, 16384000 * KiB);
    CHECK_EQ(o.meminfo.have_available, 0);
    CHECK_EQ(o.meminfo.available_bytes, 0);
    CHECK_EQ(o.meminfo.swap_free_bytes, 2097148 * KiB);

    CHECK_EQ(load("v1_hybrid/proc/vmstat", K_VMSTAT, 2, &o), 0);
    CHECK_EQ(o.vmstat.pswpin, 1111);
    CHECK_EQ(o.vmstat.pswpout, 2222);
    CHECK_EQ(o.vmstat.pgmajfault, 3333);
    CHECK_EQ(load("v2/proc/vmstat", K_VMSTAT, 2, &o), 0);
    CHECK_EQ(o.vmstat.pswpin, 5000);
    CHECK_EQ(o.vmstat.pswpout, 6000);
    CHECK_EQ(o.vmstat.pgmajfault, 7000);
    CHECK_EQ(load("v2_nolimit/proc/vmstat", K_VMSTAT, 2, &o), 0);
    CHECK_EQ(o.vmstat.pgmajfault, 42);

    /* a key is a whole word: "pswpin_x" and "xpswpin" are other counters */
    static const char vm[] = "pswpin_x 5\nxpswpin 6\npswpin 7\npswpout 8\npgmajfault 9\n";
    const char *why = NULL;
    mgi_vmstat_t v;
    CHECK_EQ(mgi_parse_vmstat(vm, sizeof(vm) - 1, &v, &why), 0);
    CHECK_EQ(v.pswpin, 7);
    uint64_t x = 0;
    CHECK_EQ(mgi_find_u64(vm, sizeof(vm) - 1, "nothere", &x), ENOENT);
    CHECK_EQ(mgi_find_u64("a: 3 kB\n", 8, "a", &x), 0);
    CHECK_EQ(x, 3 * KiB);
    CHECK_EQ(mgi_find_u64("a 18014398509481984 kB\n", 23, "a", &x), ERANGE);
}

static void test_psi(void)
{
    parsed_t o;
    CHECK_EQ(load("v1_hybrid/proc/pressure/memory", K_PSI, 2, &o), 0);
    CHECK_NEAR(o.psi.some_avg10, 1.50, 1e-12);
    CHECK_NEAR(o.psi.some_avg60, 0.75, 1e-12);
    CHECK_EQ(o.psi.some_total_us, 123456);
    CHECK_EQ(o.psi.have_full, 1);
    CHECK_NEAR(o.psi.full_avg10, 0.50, 1e-12);
    CHECK_NEAR(o.psi.full_avg60, 0.25, 1e-12);
    CHECK_EQ(o.psi.full_total_us, 65432);

    CHECK_EQ(load("v2/proc/pressure/memory", K_PSI, 2, &o), 0);
    CHECK_NEAR(o.psi.some_avg10, 12.34, 1e-12);
    CHECK_NEAR(o.psi.some_avg60, 5.67, 1e-12);
    CHECK_EQ(o.psi.some_total_us, 98765432);
    CHECK_NEAR(o.psi.full_avg10, 3.21, 1e-12);
    CHECK_NEAR(o.psi.full_avg60, 1.11, 1e-12);
    CHECK_EQ(o.psi.full_total_us, 12345678);

    CHECK_EQ(load("v2/cgroup/user.slice/app.scope/memory.pressure", K_PSI, 2, &o), 0);
    CHECK_NEAR(o.psi.some_avg10, 4.0, 1e-12);
    CHECK_EQ(o.psi.some_total_us, 444444);
    CHECK_NEAR(o.psi.full_avg10, 2.5, 1e-12);
    CHECK_EQ(o.psi.full_total_us, 222222);

    /* cpu-style files have no "full" line; unknown keys are skipped */
    static const char some_only[] = "some avg10=0.10 avg60=0.20 avg300=0.30 total=5 extra=7\n";
    const char *why = NULL;
    mgi_psi_t p;
    CHECK_EQ(mgi_parse_psi(some_only, sizeof(some_only) - 1, &p, &why), 0);
    CHECK_EQ(p.have_full, 0);
    CHECK_NEAR(p.some_avg60, 0.2, 1e-12);
    CHECK_EQ(p.some_total_us, 5);
}

static void test_cgroup_paths(void)
{
    parsed_t o;
    CHECK_EQ(load("v1_hybrid/proc/self/cgroup", K_CGROUP, 2, &o), 0);
    CHECK_EQ(o.cgroup.have_v1, 1);
    CHECK_STR(o.cgroup.v1_memory, "/training/job42");
    CHECK_EQ(o.cgroup.have_v2, 1);
    CHECK_STR(o.cgroup.v2, "/");

    CHECK_EQ(load("v2/proc/self/cgroup", K_CGROUP, 2, &o), 0);
    CHECK_EQ(o.cgroup.have_v1, 0);
    CHECK_STR(o.cgroup.v2, "/user.slice/app.scope");
    CHECK_EQ(load("nscgroup/proc/self/cgroup", K_CGROUP, 2, &o), 0);
    CHECK_STR(o.cgroup.v2, "/system.slice/docker-4f2a9c.scope");

    /* memory shares a v1 hierarchy with other controllers; a path may hold ':' */
    static const char shared[] = "3:cpu,memory,pids:/a:b/c\n";
    const char *why = NULL;
    mgi_cgpaths_t cg;
    CHECK_EQ(mgi_parse_cgroup(shared, sizeof(shared) - 1, &cg, &why), 0);
    CHECK_EQ(cg.have_v1, 1);
    CHECK_STR(cg.v1_memory, "/a:b/c");
    CHECK_EQ(cg.have_v2, 0);
    /* "memoryx" is not "memory" */
    static const char other[] = "3:memoryx:/a\n";
    CHECK_EQ(mgi_parse_cgroup(other, sizeof(other) - 1, &cg, &why), EBADMSG);
}

static void test_cgroup_files(void)
{
    parsed_t o;
    /* v1 */
    const char *job = "v1_hybrid/cgroup/memory/training/job42/";
    char rel[256];
    snprintf(rel, sizeof(rel), "%smemory.usage_in_bytes", job);
    CHECK_EQ(load(rel, K_LIMIT, 1, &o), 0);
    CHECK_EQ(o.limit, 3221225472ULL);
    snprintf(rel, sizeof(rel), "%smemory.limit_in_bytes", job);
    CHECK_EQ(load(rel, K_LIMIT, 1, &o), 0);
    CHECK_EQ(o.limit, 8589934592ULL);
    CHECK_EQ(o.unlimited, 0);
    snprintf(rel, sizeof(rel), "%smemory.stat", job);
    CHECK_EQ(load(rel, K_CGSTAT, 1, &o), 0);
    CHECK_EQ(o.cgstat.have_inactive_file, 1);
    CHECK_EQ(o.cgstat.inactive_file, 536870912ULL); /* total_inactive_file, not inactive_file */
    CHECK_EQ(o.cgstat.hierarchical_limit, 8589934592ULL);
    snprintf(rel, sizeof(rel), "%smemory.oom_control", job);
    CHECK_EQ(load(rel, K_CGEVENTS, 1, &o), 0);
    CHECK_EQ(o.cgevents.have_oom_kill, 1);
    CHECK_EQ(o.cgevents.oom_kill, 2);
    CHECK_EQ(o.cgevents.oom, 2);

    CHECK_EQ(load("v1_parent_limit/cgroup/memory/batch/job7/memory.limit_in_bytes", K_LIMIT, 1, &o), 0);
    CHECK_EQ(o.limit, 9223372036854771712ULL);
    CHECK_EQ(load("v1_parent_limit/cgroup/memory/batch/job7/memory.stat", K_CGSTAT, 1, &o), 0);
    CHECK_EQ(o.cgstat.hierarchical_limit, 6442450944ULL);
    CHECK_EQ(o.cgstat.inactive_file, 0);
    CHECK_EQ(o.cgstat.have_inactive_file, 1);
    CHECK_EQ(load("v1_parent_limit/cgroup/memory/batch/job7/memory.oom_control", K_CGEVENTS, 1, &o), 0);
    CHECK_EQ(o.cgevents.have_oom_kill, 0);
    CHECK_EQ(o.cgevents.oom, 0);

    /* v2 */
    const char *app = "v2/cgroup/user.slice/app.scope/";
    snprintf(rel, sizeof(rel), "%smemory.current", app);
    CHECK_EQ(load(rel, K_LIMIT, 2, &o), 0);
    CHECK_EQ(o.limit, 4026531840ULL);
    snprintf(rel, sizeof(rel), "%smemory.max", app);
    CHECK_EQ(load(rel, K_LIMIT, 2, &o), 0);
    CHECK_EQ(o.unlimited, 1);
    CHECK_EQ(o.limit, 0);
    snprintf(rel, sizeof(rel), "%smemory.high", app);
    CHECK_EQ(load(rel, K_LIMIT, 2, &o), 0);
    CHECK_EQ(o.limit, 4160749568ULL);
    CHECK_EQ(load("v2/cgroup/user.slice/memory.max", K_LIMIT, 2, &o), 0);
    CHECK_EQ(o.limit, 4294967296ULL);
    snprintf(rel, sizeof(rel), "%smemory.stat", app);
    CHECK_EQ(load(rel, K_CGSTAT, 2, &o), 0);
    CHECK_EQ(o.cgstat.inactive_file, 134217728ULL);
    CHECK_EQ(o.cgstat.hierarchical_limit, 0);
    snprintf(rel, sizeof(rel), "%smemory.events", app);
    CHECK_EQ(load(rel, K_CGEVENTS, 2, &o), 0);
    CHECK_EQ(o.cgevents.oom, 1);
    CHECK_EQ(o.cgevents.oom_kill, 1);
    CHECK_EQ(o.cgevents.high, 17);
    CHECK_EQ(o.cgevents.max, 3);

    CHECK_EQ(load("nscgroup/cgroup/memory.max", K_LIMIT, 2, &o), 0);
    CHECK_EQ(o.limit, 2147483648ULL);
    CHECK_EQ(load("nscgroup/cgroup/memory.stat", K_CGSTAT, 2, &o), 0);
    CHECK_EQ(o.cgstat.inactive_file, 268435456ULL);

    /* blanks around a limit are fine */
    const char *why = NULL;
    uint64_t v;
    int unl;
    CHECK_EQ(mgi_parse_limit("  42 \n\n", 7, &v, &unl, &why), 0);
    CHECK_EQ(v, 42);
    CHECK_EQ(mgi_parse_limit("max", 3, &v, &unl, &why), 0);
    CHECK_EQ(unl, 1);
}

static void test_parse_double(void)
{
    double d = 0;
    CHECK_EQ(mgi_parse_double("0.9", &d), 0);
    CHECK_NEAR(d, 0.9, 1e-15);
    CHECK_EQ(mgi_parse_double(" 256 ", &d), 0);
    CHECK_NEAR(d, 256, 0);
    CHECK_EQ(mgi_parse_double("", &d), EINVAL);
    CHECK_EQ(mgi_parse_double("-1", &d), EINVAL);
    CHECK_EQ(mgi_parse_double("1e3", &d), EINVAL);
    CHECK_EQ(mgi_parse_double("1.", &d), EINVAL);
    CHECK_EQ(mgi_parse_double("0.5x", &d), EINVAL);
}

/* Every file in bad/ (named <kind>.<case> or <kind>.v1.<case>) is EBADMSG. */
static void test_bad_files(void)
{
    char dir[1024];
    snprintf(dir, sizeof(dir), "%s/bad", fixtures);
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    if (!d)
        return;
    int seen = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        kind_t k = K_COUNT;
        for (int i = 0; i < K_COUNT; i++) {
            size_t n = strlen(kind_names[i]);
            if (strncmp(e->d_name, kind_names[i], n) == 0 && e->d_name[n] == '.')
                k = (kind_t)i;
        }
        if (k == K_COUNT) {
            printf("bad/%s: no parser of that name\n", e->d_name);
            CHECK(k != K_COUNT);
            continue;
        }
        int version = strstr(e->d_name, ".v1.") ? 1 : 2;
        char path[2048];
        parsed_t o;
        const char *why = NULL;
        size_t len;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        char *buf = mgt_slurp(path, &len);
        CHECK(buf != NULL);
        if (!buf)
            continue;
        int rc = parse(k, version, buf, len, &o, &why);
        if (rc != EBADMSG)
            printf("bad/%s was accepted (rc %d)\n", e->d_name, rc);
        CHECK_EQ(rc, EBADMSG);
        CHECK(why != NULL && why[0] != '\0');
        free(buf);
        seen++;
    }
    closedir(d);
    CHECK(seen >= 40);
}

/* The fixture files the robustness tests cut and corrupt: one of each kind
 * and layout (v1 and v2 cgroup files, a file with and one without a "full"
 * PSI line, status with and without VmSwap). */
static const struct {
    const char *rel;
    kind_t kind;
    int version;
} fuzz_files[] = {
    {"v2/proc/self/status", K_STATUS, 2},
    {"v2_nolimit/proc/self/status", K_STATUS, 2},
    {"v2/proc/self/statm", K_STATM, 2},
    {"v2/proc/self/stat", K_STAT, 2},
    {"v1_hybrid/proc/self/cgroup", K_CGROUP, 2},
    {"v2/proc/self/cgroup", K_CGROUP, 2},
    {"v2/proc/meminfo", K_MEMINFO, 2},
    {"no_psi/proc/meminfo", K_MEMINFO, 2},
    {"v2/proc/vmstat", K_VMSTAT, 2},
    {"v2/proc/pressure/memory", K_PSI, 2},
    {"v2/cgroup/user.slice/app.scope/memory.current", K_LIMIT, 2},
    {"v2/cgroup/user.slice/app.scope/memory.max", K_LIMIT, 2},
    {"v2/cgroup/user.slice/app.scope/memory.stat", K_CGSTAT, 2},
    {"v2/cgroup/user.slice/app.scope/memory.events", K_CGEVENTS, 2},
    {"v2/cgroup/user.slice/app.scope/memory.pressure", K_PSI, 2},
    {"v1_hybrid/cgroup/memory/training/job42/memory.limit_in_bytes", K_LIMIT, 1},
    {"v1_hybrid/cgroup/memory/training/job42/memory.stat", K_CGSTAT, 1},
    {"v1_hybrid/cgroup/memory/training/job42/memory.oom_control", K_CGEVENTS, 1},
    {"tree/proc/4242/smaps_rollup", K_ROLLUP, 2},
    {"tree/proc/self/task/100/children", K_PIDS, 2},
};
#define N_FUZZ (sizeof(fuzz_files) / sizeof(fuzz_files[0]))

/* Parse a private copy of buf[0, len); 0 or EBADMSG (with a reason) is all
 * a parser may answer. Returns the rc, or -1 after reporting a violation. */
static int parse_copy(kind_t k, int version, const char *buf, size_t len, parsed_t *o,
                      const char *what, size_t where)
{
    char *c = mgt_copy(buf, len);
    const char *why = NULL;
    memset(o, 0, sizeof(*o));
    int rc = parse(k, version, c, len, o, &why);
    free(c);
    if (rc == 0 || (rc == EBADMSG && why != NULL))
        return rc;
    printf("%s %s at %zu: rc %d, why %s\n", kind_names[k], what, where, rc, why ? why : "NULL");
    return -1;
}

static void test_truncated_everywhere(void)
{
    for (size_t i = 0; i < N_FUZZ; i++) {
        char path[1024];
        size_t len;
        snprintf(path, sizeof(path), "%s/%s", fixtures, fuzz_files[i].rel);
        char *buf = mgt_slurp(path, &len);
        CHECK(buf != NULL);
        if (!buf)
            continue;
        kind_t k = fuzz_files[i].kind;
        int v = fuzz_files[i].version;
        parsed_t full, part;
        CHECK_EQ(parse_copy(k, v, buf, len, &full, "full file", len), 0);
        uint64_t alt = 0;
        (void)mgi_find_u64(buf, len, "inactive_file", &alt);
        int bad = 0, accepted = 0;
        for (size_t n = 0; n < len; n++) {
            int rc = parse_copy(k, v, buf, n, &part, "prefix", n);
            if (rc < 0 || (rc == 0 && !consistent(k, v, &full, &part, alt))) {
                if (!bad++)
                    printf("%s cut at %zu: rc %d, values not those of the full file\n",
                           fuzz_files[i].rel, n, rc);
            }
            accepted += rc == 0;
        }
        CHECK_EQ(bad, 0);
        /* a prefix holding every line the parser needs parses too: the cut
         * checks are not so eager that only whole files pass (a one-line
         * file has no such prefix) */
        int one_line = memchr(buf, '\n', len) == buf + len - 1;
        if (!one_line && accepted == 0)
            printf("%s: no prefix parses\n", fuzz_files[i].rel);
        CHECK(one_line || accepted > 0);
        free(buf);
    }
}

static void test_corrupted_everywhere(void)
{
    static const unsigned char flips[] = {'\0', '\n', ' ', 'x', '9', '0', ':', ')', '=', '.',
                                          '\t', '-', 0xff, 0x80, '/', 'k'};
    for (size_t i = 0; i < N_FUZZ; i++) {
        char path[1024];
        size_t len;
        snprintf(path, sizeof(path), "%s/%s", fixtures, fuzz_files[i].rel);
        char *buf = mgt_slurp(path, &len);
        if (!buf || len == 0) {
            CHECK(buf != NULL);
            free(buf);
            continue;
        }
        kind_t k = fuzz_files[i].kind;
        int v = fuzz_files[i].version;
        parsed_t o;
        int bad = 0;
        /* each byte replaced by two values from the table, in turn */
        for (size_t p = 0; p < len; p++) {
            for (int r = 0; r < 2; r++) {
                char saved = buf[p];
                buf[p] = (char)flips[(p * 2 + (size_t)r) % sizeof(flips)];
                bad += parse_copy(k, v, buf, len, &o, "flipped byte", p) < 0;
                buf[p] = saved;
            }
        }
        /* several random bytes at random places, then a random cut */
        char *work = malloc(len);
        for (int round = 0; round < 400 && work; round++) {
            memcpy(work, buf, len);
            int n = 1 + (int)(mgt_rand() % 8);
            for (int j = 0; j < n; j++)
                work[mgt_rand() % len] = (char)(mgt_rand() & 0xff);
            size_t cut = mgt_rand() % 2 ? len : (size_t)(mgt_rand() % (len + 1));
            bad += parse_copy(k, v, work, cut, &o, "random bytes", (size_t)round) < 0;
        }
        free(work);
        CHECK_EQ(bad, 0);
        free(buf);
    }
}

/* Random buffers, biased towards the characters of real files so the parsers
 * get past their first checks. */
static void test_random_input(void)
{
    static const char alphabet[] = "0123456789 \n\t:.=()/,kBmaxsomefulltavg1036VmRSHWMTtinrqp";
    char buf[512];
    parsed_t o;
    int bad = 0;
    for (int k = 0; k < K_COUNT; k++) {
        for (int round = 0; round < 3000; round++) {
            size_t len = (size_t)(mgt_rand() % sizeof(buf));
            int printable = round % 4 != 0;
            for (size_t j = 0; j < len; j++)
                buf[j] = printable ? alphabet[mgt_rand() % (sizeof(alphabet) - 1)]
                                   : (char)(mgt_rand() & 0xff);
            bad += parse_copy((kind_t)k, 1 + round % 2, buf, len, &o, "random", (size_t)round) < 0;
        }
    }
    CHECK_EQ(bad, 0);
}

/* The process tree's files: a child's private bytes, and pids lists. */
static void test_tree_files(void)
{
    parsed_t o;
    CHECK_EQ(load("tree/proc/4242/smaps_rollup", K_ROLLUP, 2, &o), 0);
    CHECK_EQ(o.rollup, (1024 + 51200 + 2048) * KiB); /* private clean, dirty, SwapPss */
    CHECK_EQ(load("tree/proc/4244/smaps_rollup", K_ROLLUP, 2, &o), 0);
    CHECK_EQ(o.rollup, 10240 * KiB);
    CHECK_EQ(load("tree/proc/self/task/100/children", K_PIDS, 2, &o), 0);
    CHECK_EQ(o.n_pids, 3);
    CHECK_EQ(o.pids[0], 4242);
    CHECK_EQ(o.pids[1], 4243);
    CHECK_EQ(o.pids[2], 4250);
    CHECK_EQ(load("tree/proc/self/task/101/children", K_PIDS, 2, &o), 0);
    CHECK_EQ(o.n_pids, 0);
    /* appended to what is there, none twice, at most cap */
    uint32_t pids[3] = {4243, 0, 0};
    size_t n = 1;
    const char *why = NULL;
    CHECK_EQ(mgi_parse_pids("4242 4243 7 9 ", 14, pids, 3, &n, &why), 0);
    CHECK_EQ(n, 3);
    CHECK_EQ(pids[1], 4242);
    CHECK_EQ(pids[2], 7);
    /* the rows before a bad one were taken */
    n = 0;
    CHECK_EQ(mgi_parse_pids("12 x ", 5, pids, 3, &n, &why), EBADMSG);
    CHECK_EQ(n, 1);
}

/* The ranks an environment block names, fed whole and in every two pieces
 * (and byte by byte): the same either way. */
static void check_block(const char *block, size_t len, int64_t local_rank, int64_t rank)
{
    mgi_envscan_t e;
    char *buf = malloc(len ? len : 1); /* exactly sized: a read past it is an ASan report */
    memcpy(buf, block, len);
    for (size_t cut = 0; cut <= len; cut++) {
        mgi_envscan_init(&e);
        mgi_envscan_feed(&e, buf, cut);
        mgi_envscan_feed(&e, buf + cut, len - cut);
        CHECK_EQ(e.ranks.v[0], local_rank);
        CHECK_EQ(e.ranks.v[1], rank);
    }
    mgi_envscan_init(&e);
    for (size_t i = 0; i < len; i++)
        mgi_envscan_feed(&e, buf + i, 1);
    CHECK_EQ(e.ranks.v[0], local_rank);
    CHECK_EQ(e.ranks.v[1], rank);
    free(buf);
}

#define BLOCK(text) text, sizeof(text) - 1

static void test_environ_ranks(void)
{
    check_block(BLOCK("HOME=/h\0LOCAL_RANK=1\0RANK=3\0"), 1, 3);
    check_block(BLOCK("RANK=12\0PATH=/b\0"), MGI_NO_RANK, 12);
    check_block(BLOCK(""), MGI_NO_RANK, MGI_NO_RANK);
    /* names that only begin or end like a key */
    check_block(BLOCK("LOCAL_RANKS=3\0RANK_SEED=2\0XRANK=5\0LOCAL_RAN=4\0RANK\0"), MGI_NO_RANK,
                MGI_NO_RANK);
    /* values that are no rank number: empty, signed, spaced, too long */
    check_block(BLOCK("LOCAL_RANK=\0RANK=-1\0"), MGI_NO_RANK, MGI_NO_RANK);
    check_block(BLOCK("LOCAL_RANK= 1\0RANK=1234567890\0"), MGI_NO_RANK, MGI_NO_RANK);
    check_block(BLOCK("LOCAL_RANK=1x\0RANK=123456789\0"), MGI_NO_RANK, 123456789);
    /* the first of two, as getenv gives it; a bad one does not hide a good one */
    check_block(BLOCK("LOCAL_RANK=2\0LOCAL_RANK=5\0RANK=x\0RANK=7\0"), 2, 7);
    /* an entry whose NUL was not read may be cut: it gives nothing */
    check_block(BLOCK("RANK=1\0LOCAL_RANK=12"), MGI_NO_RANK, 1);
    check_block(BLOCK("LOCAL_RANK=1\0=\0\0\0RANK=0\0"), 1, 0);

    mgi_ranks_t r;
    mgi_parse_ranks(BLOCK("LOCAL_RANK=1\0"), &r);
    CHECK_EQ(r.v[0], 1);

    /* the fixture tree: a worker with near-miss names, a rank and its worker */
    char path[1024];
    size_t len;
    static const struct {
        const char *pid;
        int64_t local_rank;
    } files[] = {{"4242", MGI_NO_RANK}, {"4250", 1}, {"4251", 1}};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        snprintf(path, sizeof(path), "%s/tree/proc/%s/environ", fixtures, files[i].pid);
        char *buf = mgt_slurp(path, &len);
        CHECK(buf != NULL);
        if (!buf)
            continue;
        check_block(buf, len, files[i].local_rank, MGI_NO_RANK);
        free(buf);
    }
}

/* Another rank is one that names a value this process does not have, as
 * the environment last noted gave it. */
static void test_other_ranks(void)
{
    mgi_ranks_t none = {{MGI_NO_RANK, MGI_NO_RANK}}, one = {{1, MGI_NO_RANK}};
    mgi_ranks_t zero = {{0, MGI_NO_RANK}}, global = {{MGI_NO_RANK, 3}};
    unsetenv("LOCAL_RANK");
    unsetenv("RANK");
    mg_ranks_note();
    CHECK_EQ(mgi_ranks_other(&none), 0); /* a forked worker of a process without ranks */
    CHECK_EQ(mgi_ranks_other(&one), 1);  /* Lightning's rank 1, seen from its launcher */
    CHECK_EQ(mgi_ranks_other(&global), 1);
    setenv("LOCAL_RANK", "0", 1);        /* rank 0 once the launcher named it */
    CHECK_EQ(mgi_ranks_other(&zero), 1); /* not noted yet */
    mg_ranks_note();
    CHECK_EQ(mgi_ranks_other(&zero), 0); /* a worker it spawned */
    CHECK_EQ(mgi_ranks_other(&none), 0); /* one it forked: its environment as at exec */
    CHECK_EQ(mgi_ranks_other(&one), 1);
    setenv("LOCAL_RANK", "x", 1);        /* no rank number: as if not named */
    mg_ranks_note();
    CHECK_EQ(mgi_ranks_other(&zero), 1);
    unsetenv("LOCAL_RANK");
    mg_ranks_note();
}

int main(int argc, char **argv)
{
    mgt_begin();
    fixtures = mgt_fixtures(argc, argv);
    RUN(test_status);
    RUN(test_statm_and_stat);
    RUN(test_meminfo_and_vmstat);
    RUN(test_psi);
    RUN(test_cgroup_paths);
    RUN(test_cgroup_files);
    RUN(test_parse_double);
    RUN(test_tree_files);
    RUN(test_environ_ranks);
    RUN(test_other_ranks);
    RUN(test_bad_files);
    RUN(test_truncated_everywhere);
    RUN(test_corrupted_everywhere);
    RUN(test_random_input);
    return mgt_result();
}
