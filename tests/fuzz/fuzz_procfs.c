/* libFuzzer target: every /proc and cgroup parser of csrc/core/procfs.c and
 * the environment scanner of ranks.c. The first byte picks the parser, the
 * rest is the file's content, copied to a buffer of exactly its length (no
 * terminator), so that a read past `len` is an AddressSanitizer report. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mgi.h"

enum { STATM, STATUS, MEMINFO, VMSTAT, PSI, STAT, CGROUP, LIMIT, CGSTAT1, CGSTAT2,
       CGEVENTS1, CGEVENTS2, ROLLUP, PIDS, FIND, ENVIRON, N_PARSERS };

/* An environment block names the same ranks fed whole or in two pieces. */
static void scan_environ(const char *buf, size_t len)
{
    mgi_ranks_t whole;
    mgi_envscan_t e;
    mgi_parse_ranks(buf, len, &whole);
    mgi_envscan_init(&e);
    mgi_envscan_feed(&e, buf, len / 2);
    mgi_envscan_feed(&e, buf + len / 2, len - len / 2);
    if (memcmp(&whole, &e.ranks, sizeof(whole)) != 0)
        abort();
}

static void parse(int which, const char *buf, size_t len)
{
    const char *why = NULL;
    uint64_t u = 0;
    int unlimited = 0;
    switch (which) {
    case STATM: (void)mgi_parse_statm(buf, len, 4096, &u, &why); break;
    case STATUS: { mgi_status_t s; (void)mgi_parse_status(buf, len, &s, &why); break; }
    case MEMINFO: { mgi_meminfo_t m; (void)mgi_parse_meminfo(buf, len, &m, &why); break; }
    case VMSTAT: { mgi_vmstat_t v; (void)mgi_parse_vmstat(buf, len, &v, &why); break; }
    case PSI: { mgi_psi_t p; (void)mgi_parse_psi(buf, len, &p, &why); break; }
    case STAT: { mgi_faults_t f; (void)mgi_parse_stat(buf, len, &f, &why); break; }
    case CGROUP: { mgi_cgpaths_t c; (void)mgi_parse_cgroup(buf, len, &c, &why); break; }
    case LIMIT: (void)mgi_parse_limit(buf, len, &u, &unlimited, &why); break;
    case CGSTAT1:
    case CGSTAT2: {
        mgi_cgstat_t c;
        (void)mgi_parse_cgstat(buf, len, which == CGSTAT1 ? 1 : 2, &c, &why);
        break;
    }
    case CGEVENTS1:
    case CGEVENTS2: {
        mgi_cgevents_t e;
        (void)mgi_parse_cgevents(buf, len, which == CGEVENTS1 ? 1 : 2, &e, &why);
        break;
    }
    case ROLLUP: (void)mgi_parse_rollup(buf, len, &u, &why); break;
    case PIDS: {
        uint32_t pids[8];
        size_t n = 0;
        (void)mgi_parse_pids(buf, len, pids, 8, &n, &why);
        break;
    }
    case ENVIRON: scan_environ(buf, len); break;
    default: (void)mgi_find_u64(buf, len, "MemAvailable:", &u); break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t len = size - 1;
    char *buf = malloc(len ? len : 1);
    if (!buf)
        return 0;
    memcpy(buf, data + 1, len);
    parse(data[0] % N_PARSERS, buf, len);
    free(buf);
    return 0;
}
