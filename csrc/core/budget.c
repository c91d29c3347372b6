/* Byte sizes and budgets as people write them: "12GiB", "512MB", "75%",
 * "auto". Locale-free and bounded, so the preload shim can use it before
 * anything else in the process is set up. Integer arithmetic throughout:
 * "2.2583GB" is 2258300000 bytes, not one less as a double product gives. */
#include <ctype.h>
#include <errno.h>
#include <string.h>
#include <strings.h>

#include "mgi.h"

/* Fraction digits kept; later ones move a size by under a thousandth of a
 * byte, and a percentage of 2^64 bytes by under twenty. */
#define FRAC_DIGITS 16

/* A decimal as written: integer part, and the fraction as digits over a power
 * of ten, so no binary rounding creeps in. */
typedef struct number {
    uint64_t ip;   /* integer part */
    uint64_t fnum; /* fraction digits as one integer */
    uint64_t fden; /* 10^(digits kept); 1 without a fraction */
} number_t;

/* Blanks around a number or a unit; '\n' too, as a value read from a file
 * or an environment variable set by $(cat file) may end with one. */
static int blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n';
}

/* floor(a * b / den) for b <= den < 2^61 without 128-bit arithmetic: long
 * multiplication over the bits of a, the remainder kept below den. */
static uint64_t mul_div(uint64_t a, uint64_t b, uint64_t den)
{
    uint64_t q = 0, r = 0;
    for (int bit = 63; bit >= 0; bit--) {
        q <<= 1;
        r <<= 1;
        if ((a >> bit) & 1)
            r += b;
        while (r >= den) {
            r -= den;
            q++;
        }
    }
    return q;
}

/* Split text into a decimal number and a unit word, skipping blanks around
 * both. */
static int split_number(const char *t, number_t *num, char *unit, size_t ucap)
{
    while (blank(*t))
        t++;
    if (!isdigit((unsigned char)*t))
        return EINVAL;
    uint64_t v = 0;
    while (isdigit((unsigned char)*t)) {
        unsigned d = (unsigned)(*t - '0');
        if (v > (UINT64_MAX - d) / 10)
            return ERANGE;
        v = v * 10 + d;
        t++;
    }
    num->ip = v;
    num->fnum = 0;
    num->fden = 1;
    if (*t == '.') {
        t++;
        if (!isdigit((unsigned char)*t))
            return EINVAL;
        for (int kept = 0; isdigit((unsigned char)*t); t++, kept++) {
            if (kept < FRAC_DIGITS) {
                num->fnum = num->fnum * 10 + (uint64_t)(*t - '0');
                num->fden *= 10;
            }
        }
    }
    while (blank(*t))
        t++;
    size_t n = 0;
    while (*t && !blank(*t)) {
        if (n + 1 >= ucap)
            return EINVAL;
        unit[n++] = *t++;
    }
    unit[n] = '\0';
    while (blank(*t))
        t++;
    return *t ? EINVAL : 0;
}

/* Multiplier of a unit word; 0 for an unknown unit. Single letters and
 * "iB" forms are binary, "KB"/"MB"/... decimal. */
static uint64_t unit_scale(const char *u)
{
    static const struct {
        const char *name;
        uint64_t scale;
    } units[] = {
        {"", 1},          {"b", 1},
        {"k", 1ULL << 10}, {"kib", 1ULL << 10}, {"kb", 1000ULL},
        {"m", 1ULL << 20}, {"mib", 1ULL << 20}, {"mb", 1000000ULL},
        {"g", 1ULL << 30}, {"gib", 1ULL << 30}, {"gb", 1000000000ULL},
        {"t", 1ULL << 40}, {"tib", 1ULL << 40}, {"tb", 1000000000000ULL},
    };
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++)
        if (strcasecmp(u, units[i].name) == 0)
            return units[i].scale;
    return 0;
}

int mg_parse_size(const char *text, uint64_t *out)
{
    number_t num;
    char unit[8];
    if (!text)
        return EINVAL;
    int rc = split_number(text, &num, unit, sizeof(unit));
    if (rc)
        return rc;
    uint64_t scale = unit_scale(unit);
    if (scale == 0 || (scale == 1 && num.fnum != 0))
        return EINVAL;
    if (num.ip > UINT64_MAX / scale)
        return ERANGE;
    uint64_t v = num.ip * scale, extra = mul_div(scale, num.fnum, num.fden);
    if (v > UINT64_MAX - extra)
        return ERANGE;
    *out = v + extra;
    return 0;
}

int mg_parse_budget(const char *text, uint64_t total, uint64_t available, uint64_t *out)
{
    if (!text)
        return EINVAL;
    while (blank(*text))
        text++;
    size_t n = strlen(text);
    while (n && blank(text[n - 1]))
        n--;
    if (n == 4 && strncasecmp(text, "auto", 4) == 0) {
        uint64_t base = available && available < total ? available : total;
        uint64_t v = mul_div(base, 9, 10);
        if (v == 0)
            return EINVAL; /* a zero budget is no budget, as for "0" */
        *out = v;
        return 0;
    }
    if (n && text[n - 1] == '%') {
        char digits[32];
        number_t pct;
        char unit[2];
        if (n - 1 >= sizeof(digits) || total == 0)
            return EINVAL;
        memcpy(digits, text, n - 1);
        digits[n - 1] = '\0';
        int rc = split_number(digits, &pct, unit, sizeof(unit));
        if (rc || unit[0])
            return rc ? rc : EINVAL;
        if (pct.ip > 100 || (pct.ip == 100 && pct.fnum) || (pct.ip == 0 && pct.fnum == 0))
            return ERANGE;
        /* total * pct / 100 exactly: 100% of any total is that total */
        uint64_t v = mul_div(total, pct.ip * pct.fden + pct.fnum, 100 * pct.fden);
        if (v == 0)
            return EINVAL;
        *out = v;
        return 0;
    }
    uint64_t v;
    int rc = mg_parse_size(text, &v);
    if (rc)
        return rc;
    if (v == 0)
        return EINVAL;
    if (v > MG_BUDGET_MAX)
        return ERANGE;
    *out = v;
    return 0;
}

/* Keep the least of the candidate budgets, and what set it. */
static void least(uint64_t v, int src, uint64_t *best, int *best_src)
{
    if (*best_src == MG_BUDGET_SRC_NONE || v < *best) {
        *best = v;
        *best_src = src;
    }
}

int mg_budget_live(const mg_sample_t *s, uint64_t user_bytes, double reserve, uint64_t *out,
                   int *source)
{
    uint64_t best = 0;
    int src = MG_BUDGET_SRC_NONE;
    if (user_bytes)
        least(user_bytes, MG_BUDGET_SRC_USER, &best, &src);
    /* resident bytes of the process and its children (theirs are counted
     * whole: a child's swapped share is small next to what it holds) */
    uint64_t resident = ((s->have & MG_HAVE_STATUS) ? s->rss_bytes : 0) +
                        ((s->have & MG_HAVE_CHILDREN) ? s->children_bytes : 0);
    if ((s->have & MG_HAVE_CGROUP_LIMIT) && s->cgroup_limit_bytes) {
        uint64_t limit = s->cgroup_limit_bytes;
        if ((s->have & MG_HAVE_CGROUP_HIGH) && s->cgroup_high_bytes < limit)
            limit = s->cgroup_high_bytes; /* above memory.high the kernel throttles */
        uint64_t used = (s->have & MG_HAVE_CGROUP_WS) ? s->cgroup_working_set_bytes
                                                      : s->cgroup_usage_bytes;
        uint64_t others = used > resident ? used - resident : 0;
        uint64_t keep = others + (uint64_t)(reserve * (double)limit);
        least(limit > keep ? limit - keep : 0, MG_BUDGET_SRC_CGROUP, &best, &src);
    }
    if ((s->have & MG_HAVE_MEMAVAIL) && (s->have & MG_HAVE_STATUS)) {
        uint64_t can = resident + s->mem_available_bytes;
        uint64_t keep = (uint64_t)(reserve * (double)s->mem_total_bytes);
        least(can > keep ? can - keep : 0, MG_BUDGET_SRC_HOST, &best, &src);
    }
    if (src == MG_BUDGET_SRC_NONE)
        return ENODATA;
    *out = best ? best : 1; /* nothing left is still a budget: every byte is over it */
    if (source)
        *source = src;
    return 0;
}
