/* Pure parsers for /proc and cgroup files: buffer in, struct out. They never
 * read past len and never allocate, so the sampler can run them on stack
 * buffers and the tests can feed them truncated or corrupted fixtures. */
#include <errno.h>
#include <string.h>

#include "mgi.h"

/* Parse an unsigned decimal at [*p, end); advance *p. 0, EBADMSG, ERANGE. */
static int parse_u64(const char **p, const char *end, uint64_t *out)
{
    const char *q = *p;
    uint64_t v = 0;
    if (q >= end || *q < '0' || *q > '9')
        return EBADMSG;
    while (q < end && *q >= '0' && *q <= '9') {
        unsigned d = (unsigned)(*q - '0');
        if (v > (UINT64_MAX - d) / 10)
            return ERANGE;
        v = v * 10 + d;
        q++;
    }
    *p = q;
    *out = v;
    return 0;
}

/* Parse "123" or "123.45" without strtod (locale-free, bounded). */
static int parse_decimal(const char **p, const char *end, double *out)
{
    uint64_t ip;
    int rc = parse_u64(p, end, &ip);
    if (rc)
        return rc;
    double v = (double)ip;
    const char *q = *p;
    if (q < end && *q == '.') {
        /* digits as one integer, divided once: "0.3" gives exactly 0.3 */
        uint64_t frac = 0, scale = 1;
        q++;
        if (q >= end || *q < '0' || *q > '9')
            return EBADMSG;
        for (; q < end && *q >= '0' && *q <= '9'; q++) {
            if (scale < 1000000000000000000ULL) {
                frac = frac * 10 + (uint64_t)(*q - '0');
                scale *= 10;
            }
        }
        v += (double)frac / (double)scale;
    }
    *p = q;
    *out = v;
    return 0;
}

static const char *skip_blanks(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    return p;
}

/* Return the end of the line starting at p (the '\n' or end). */
static const char *line_end(const char *p, const char *end)
{
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    return nl ? nl : end;
}

/* What follows the separator ('\n', ',') at sep, or end when there is none:
 * a pointer past end is undefined even unread, and the buffer may end there. */
static const char *step_past(const char *sep, const char *end)
{
    return sep < end ? sep + 1 : end;
}

/* The kernel ends every line with '\n'. A line without one was cut short by
 * a read into too small a buffer (or a truncated fixture): "VmSwap: 12" may
 * be the start of "VmSwap: 1234 kB", so its value is malformed, not small. */
int mgi_find_u64(const char *buf, size_t len, const char *key, uint64_t *out)
{
    const char *p = buf, *end = buf + len;
    size_t klen = strlen(key);
    while (p < end) {
        const char *le = line_end(p, end);
        if ((size_t)(le - p) > klen && memcmp(p, key, klen) == 0 &&
            (p[klen] == ':' || p[klen] == ' ' || p[klen] == '\t')) {
            if (le == end)
                return EBADMSG;
            const char *q = p + klen;
            if (*q == ':')
                q++;
            q = skip_blanks(q, le);
            uint64_t v;
            int rc = parse_u64(&q, le, &v);
            if (rc)
                return rc;
            q = skip_blanks(q, le);
            if (le - q >= 2 && q[0] == 'k' && q[1] == 'B') {
                if (v > UINT64_MAX / 1024)
                    return ERANGE;
                v *= 1024;
                q += 2;
            }
            if (skip_blanks(q, le) != le)
                return EBADMSG;
            *out = v;
            return 0;
        }
        p = step_past(le, end);
    }
    return ENOENT;
}

/* Required field: any failure is EBADMSG with *why naming it. */
static int need(const char *buf, size_t len, const char *key, uint64_t *out,
                const char **why, const char *what)
{
    if (mgi_find_u64(buf, len, key, out) != 0) {
        *why = what;
        return EBADMSG;
    }
    return 0;
}

/* Optional field: absent is fine (returns 0 and *have = 0), malformed is not. */
static int maybe(const char *buf, size_t len, const char *key, uint64_t *out, int *have,
                 const char **why, const char *what)
{
    int rc = mgi_find_u64(buf, len, key, out);
    if (rc == ENOENT) {
        *have = 0;
        *out = 0;
        return 0;
    }
    if (rc) {
        *why = what;
        return EBADMSG;
    }
    *have = 1;
    return 0;
}

int mgi_parse_status(const char *buf, size_t len, mgi_status_t *out, const char **why)
{
    memset(out, 0, sizeof(*out));
    if (need(buf, len, "VmRSS", &out->rss_bytes, why, "VmRSS missing or malformed") ||
        need(buf, len, "VmHWM", &out->hwm_bytes, why, "VmHWM missing or malformed") ||
        maybe(buf, len, "VmSwap", &out->swap_bytes, &out->have_swap, why,
              "VmSwap malformed"))
        return EBADMSG;
    return 0;
}

int mgi_parse_meminfo(const char *buf, size_t len, mgi_meminfo_t *out, const char **why)
{
    int have_total = 0, have_free = 0;
    memset(out, 0, sizeof(*out));
    if (need(buf, len, "MemTotal", &out->total_bytes, why, "MemTotal missing or malformed") ||
        maybe(buf, len, "MemAvailable", &out->available_bytes, &out->have_available, why,
              "MemAvailable malformed") ||
        maybe(buf, len, "SwapTotal", &out->swap_total_bytes, &have_total, why,
              "SwapTotal malformed") ||
        maybe(buf, len, "SwapFree", &out->swap_free_bytes, &have_free, why,
              "SwapFree malformed"))
        return EBADMSG;
    if (out->total_bytes == 0) {
        *why = "MemTotal is zero";
        return EBADMSG;
    }
    out->have_swap = have_total && have_free;
    return 0;
}

int mgi_parse_rollup(const char *buf, size_t len, uint64_t *private_bytes, const char **why)
{
    uint64_t clean, dirty, swap;
    /* SwapPss is in every smaps_rollup (both since Linux 4.14) */
    if (need(buf, len, "Private_Clean", &clean, why, "Private_Clean missing or malformed") ||
        need(buf, len, "Private_Dirty", &dirty, why, "Private_Dirty missing or malformed") ||
        need(buf, len, "SwapPss", &swap, why, "SwapPss missing or malformed"))
        return EBADMSG;
    if (clean > UINT64_MAX - dirty || clean + dirty > UINT64_MAX - swap) {
        *why = "Private_Clean + Private_Dirty + SwapPss overflows";
        return EBADMSG;
    }
    *private_bytes = clean + dirty + swap;
    return 0;
}

int mgi_parse_pids(const char *buf, size_t len, uint32_t *pids, size_t cap, size_t *n,
                   const char **why)
{
    const char *p = buf, *end = buf + len;
    size_t k = *n;
    for (;;) {
        while (p < end && (*p == ' ' || *p == '\n'))
            p++;
        if (p == end)
            break;
        uint64_t v;
        /* the kernel ends every pid with a blank: one at the very end may
         * be the start of a longer one */
        if (parse_u64(&p, end, &v) || p == end || (*p != ' ' && *p != '\n')) {
            *n = k;
            *why = "a pid is malformed or cut off";
            return EBADMSG;
        }
        if (v == 0 || v > 0x3fffffff) { /* above the kernel's PID_MAX_LIMIT */
            *n = k;
            *why = "a pid is out of range";
            return EBADMSG;
        }
        size_t i = 0;
        while (i < k && pids[i] != (uint32_t)v)
            i++;
        if (i == k && k < cap)
            pids[k++] = (uint32_t)v;
    }
    *n = k;
    return 0;
}

int mgi_parse_vmstat(const char *buf, size_t len, mgi_vmstat_t *out, const char **why)
{
    memset(out, 0, sizeof(*out));
    if (need(buf, len, "pswpin", &out->pswpin, why, "pswpin missing or malformed") ||
        need(buf, len, "pswpout", &out->pswpout, why, "pswpout missing or malformed") ||
        need(buf, len, "pgmajfault", &out->pgmajfault, why, "pgmajfault missing or malformed"))
        return EBADMSG;
    return 0;
}

/* One PSI line after its "some"/"full" word: avg10=.. avg60=.. avg300=.. total=.. */
static int parse_psi_line(const char *p, const char *le, double *avg10, double *avg60,
                          uint64_t *total)
{
    int seen = 0;
    while ((p = skip_blanks(p, le)) < le) {
        const char *eq = memchr(p, '=', (size_t)(le - p));
        if (!eq)
            return EBADMSG;
        size_t klen = (size_t)(eq - p);
        const char *v = eq + 1;
        int rc;
        double ignored;
        if (klen == 5 && memcmp(p, "avg10", 5) == 0) {
            rc = parse_decimal(&v, le, avg10);
            seen |= 1;
        } else if (klen == 5 && memcmp(p, "avg60", 5) == 0) {
            rc = parse_decimal(&v, le, avg60);
            seen |= 2;
        } else if (klen == 5 && memcmp(p, "total", 5) == 0) {
            rc = parse_u64(&v, le, total);
            seen |= 4;
        } else {
            rc = parse_decimal(&v, le, &ignored); /* avg300, or a future field */
        }
        if (rc)
            return EBADMSG;
        if (v < le && *v != ' ' && *v != '\t')
            return EBADMSG;
        p = v;
    }
    return seen == 7 ? 0 : EBADMSG;
}

int mgi_parse_psi(const char *buf, size_t len, mgi_psi_t *out, const char **why)
{
    const char *p = buf, *end = buf + len;
    int have_some = 0;
    memset(out, 0, sizeof(*out));
    while (p < end) {
        const char *le = line_end(p, end);
        if (le == end) {
            /* a cut "total=12" may have been "total=1234": see mgi_find_u64 */
            *why = "last line cut short (no newline)";
            return EBADMSG;
        }
        if (le - p >= 5 && memcmp(p, "some ", 5) == 0) {
            if (parse_psi_line(p + 5, le, &out->some_avg10, &out->some_avg60,
                               &out->some_total_us)) {
                *why = "malformed \"some\" line";
                return EBADMSG;
            }
            have_some = 1;
        } else if (le - p >= 5 && memcmp(p, "full ", 5) == 0) {
            if (parse_psi_line(p + 5, le, &out->full_avg10, &out->full_avg60,
                               &out->full_total_us)) {
                *why = "malformed \"full\" line";
                return EBADMSG;
            }
            out->have_full = 1;
        }
        p = step_past(le, end);
    }
    if (!have_some) {
        *why = "no \"some\" line";
        return EBADMSG;
    }
    return 0;
}

int mgi_parse_statm(const char *buf, size_t len, uint64_t page_size, uint64_t *rss_bytes,
                    const char **why)
{
    const char *p = buf, *end = buf + len;
    uint64_t size, resident;
    if (parse_u64(&p, end, &size) || (p = skip_blanks(p, end)) == end ||
        parse_u64(&p, end, &resident)) {
        *why = "fewer than two numbers";
        return EBADMSG;
    }
    /* the kernel writes seven fields: a count at the very end may be cut */
    if (p == end || (*p != ' ' && *p != '\t' && *p != '\n')) {
        *why = "resident page count cut short or malformed";
        return EBADMSG;
    }
    if (page_size && resident > UINT64_MAX / page_size) {
        *why = "resident page count overflows";
        return EBADMSG;
    }
    *rss_bytes = resident * page_size;
    return 0;
}

int mgi_parse_stat(const char *buf, size_t len, mgi_faults_t *out, const char **why)
{
    const char *end = buf + len, *p = NULL;
    /* comm may hold spaces and parentheses: fields start after the last ')' */
    for (const char *q = buf; q < end; q++)
        if (*q == ')')
            p = q + 1;
    memset(out, 0, sizeof(*out));
    if (!p) {
        *why = "no \")\" closing the command name";
        return EBADMSG;
    }
    /* after ')': state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt */
    for (int field = 0; field <= 9; field++) {
        p = skip_blanks(p, end);
        if (p >= end || *p == '\n') {
            *why = "fewer than 12 fields";
            return EBADMSG;
        }
        if (field == 7 || field == 9) {
            uint64_t v;
            /* more fields follow majflt, so a count at the very end was cut */
            if (parse_u64(&p, end, &v) || p == end ||
                (*p != ' ' && *p != '\t' && *p != '\n')) {
                *why = "malformed fault count";
                return EBADMSG;
            }
            *(field == 7 ? &out->minor : &out->major) = v;
        } else {
            while (p < end && *p != ' ' && *p != '\t' && *p != '\n')
                p++;
        }
    }
    return 0;
}

/* Does the comma-separated list [p, e) contain the word w? */
static int list_has(const char *p, const char *e, const char *w)
{
    size_t wl = strlen(w);
    while (p < e) {
        const char *c = memchr(p, ',', (size_t)(e - p));
        const char *ie = c ? c : e;
        if ((size_t)(ie - p) == wl && memcmp(p, w, wl) == 0)
            return 1;
        p = step_past(ie, e);
    }
    return 0;
}

int mgi_parse_cgroup(const char *buf, size_t len, mgi_cgpaths_t *out, const char **why)
{
    const char *p = buf, *end = buf + len;
    memset(out, 0, sizeof(*out));
    while (p < end) {
        const char *le = line_end(p, end);
        const char *c1 = memchr(p, ':', (size_t)(le - p));
        const char *c2 = c1 ? memchr(c1 + 1, ':', (size_t)(le - c1 - 1)) : NULL;
        if (le > p && !c2) {
            *why = "line without hierarchy:controllers:path";
            return EBADMSG;
        }
        if (c2) {
            const char *path = c2 + 1;
            size_t plen = (size_t)(le - path);
            char *dst = NULL;
            if (c1 - p == 1 && p[0] == '0' && c2 == c1 + 1) {
                dst = out->v2;
                out->have_v2 = 1;
            } else if (list_has(c1 + 1, c2, "memory")) {
                dst = out->v1_memory;
                out->have_v1 = 1;
            }
            if (dst) {
                if (le == end) {
                    /* "/user.slice/app" may be the start of "/user.slice/app.scope" */
                    *why = "cgroup line cut short (no newline)";
                    return EBADMSG;
                }
                if (plen == 0 || path[0] != '/' || plen >= MGI_CGPATH_MAX) {
                    *why = "cgroup path empty, relative or too long";
                    return EBADMSG;
                }
                memcpy(dst, path, plen);
                dst[plen] = '\0';
            }
        }
        p = step_past(le, end);
    }
    if (!out->have_v1 && !out->have_v2) {
        *why = "neither a v2 line nor a v1 memory line";
        return EBADMSG;
    }
    return 0;
}

int mgi_parse_limit(const char *buf, size_t len, uint64_t *out, int *unlimited,
                    const char **why)
{
    const char *p = skip_blanks(buf, buf + len), *end = buf + len;
    *out = 0;
    *unlimited = 0;
    if (end - p >= 3 && memcmp(p, "max", 3) == 0) {
        *unlimited = 1;
        p += 3;
    } else if (parse_u64(&p, end, out)) {
        *why = "not a number or \"max\"";
        return EBADMSG;
    } else if (p == end) {
        /* "4294" may be the start of "4294967296\n": the kernel ends it with '\n' */
        *why = "number cut short (no newline)";
        return EBADMSG;
    }
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n'))
        p++;
    if (p != end) {
        *why = "trailing text after the value";
        return EBADMSG;
    }
    return 0;
}

int mgi_parse_cgstat(const char *buf, size_t len, int version, mgi_cgstat_t *out,
                     const char **why)
{
    int have_limit = 0, rc;
    memset(out, 0, sizeof(*out));
    rc = mgi_find_u64(buf, len, version == 1 ? "total_inactive_file" : "inactive_file",
                      &out->inactive_file);
    if (rc == ENOENT && version == 1)
        rc = mgi_find_u64(buf, len, "inactive_file", &out->inactive_file);
    if (rc == 0)
        out->have_inactive_file = 1;
    else if (rc != ENOENT) {
        *why = "inactive_file malformed";
        return EBADMSG;
    }
    if (version == 1 && maybe(buf, len, "hierarchical_memory_limit", &out->hierarchical_limit,
                              &have_limit, why, "hierarchical_memory_limit malformed"))
        return EBADMSG;
    if (!out->have_inactive_file && !have_limit) {
        *why = "no field memguard uses";
        return EBADMSG;
    }
    return 0;
}

int mgi_parse_cgevents(const char *buf, size_t len, int version, mgi_cgevents_t *out,
                       const char **why)
{
    int have = 0;
    memset(out, 0, sizeof(*out));
    if (version == 1) {
        uint64_t under;
        if (need(buf, len, "under_oom", &under, why, "under_oom missing or malformed") ||
            maybe(buf, len, "oom_kill", &out->oom_kill, &out->have_oom_kill, why,
                  "oom_kill malformed"))
            return EBADMSG;
        out->oom = out->oom_kill; /* v1 counts kills only */
        return 0;
    }
    if (need(buf, len, "oom", &out->oom, why, "oom missing or malformed") ||
        maybe(buf, len, "oom_kill", &out->oom_kill, &out->have_oom_kill, why,
              "oom_kill malformed") ||
        maybe(buf, len, "high", &out->high, &have, why, "high malformed") ||
        maybe(buf, len, "max", &out->max, &have, why, "max malformed"))
        return EBADMSG;
    return 0;
}

int mgi_parse_double(const char *text, double *out)
{
    const char *end = text + strlen(text);
    const char *p = skip_blanks(text, end);
    if (parse_decimal(&p, end, out))
        return EINVAL;
    return skip_blanks(p, end) == end ? 0 : EINVAL;
}
