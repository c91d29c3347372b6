/* Byte sizes and budgets as people write them: "12GiB", "512MB", "75%",
 * "auto". Locale-free and bounded, so the preload shim can use it before
 * anything else in the process is set up. */
#include <ctype.h>
#include <errno.h>
#include <string.h>
#include <strings.h>

#include "mgi.h"

/* Split text into a decimal number (integer part and fraction) and a unit
 * word, skipping blanks around both. */
static int split_number(const char *t, uint64_t *ip, double *frac, char *unit, size_t ucap)
{
    while (*t == ' ' || *t == '\t')
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
    double f = 0;
    if (*t == '.') {
        /* digits as one integer, divided once, so "0.3" is exactly 0.3 */
        uint64_t frac = 0, scale = 1;
        t++;
        if (!isdigit((unsigned char)*t))
            return EINVAL;
        for (; isdigit((unsigned char)*t); t++) {
            if (scale < 1000000000000000000ULL) {
                frac = frac * 10 + (uint64_t)(*t - '0');
                scale *= 10;
            }
        }
        f = (double)frac / (double)scale;
    }
    while (*t == ' ' || *t == '\t')
        t++;
    size_t n = 0;
    while (*t && *t != ' ' && *t != '\t') {
        if (n + 1 >= ucap)
            return EINVAL;
        unit[n++] = *t++;
    }
    unit[n] = '\0';
    while (*t == ' ' || *t == '\t' || *t == '\n')
        t++;
    if (*t)
        return EINVAL;
    *ip = v;
    *frac = f;
    return 0;
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
    uint64_t ip;
    double frac;
    char unit[8];
    if (!text)
        return EINVAL;
    int rc = split_number(text, &ip, &frac, unit, sizeof(unit));
    if (rc)
        return rc;
    uint64_t scale = unit_scale(unit);
    if (scale == 0 || (scale == 1 && frac != 0))
        return EINVAL;
    if (ip > UINT64_MAX / scale)
        return ERANGE;
    uint64_t v = ip * scale, extra = (uint64_t)(frac * (double)scale);
    if (v > UINT64_MAX - extra)
        return ERANGE;
    *out = v + extra;
    return 0;
}

int mg_parse_budget(const char *text, uint64_t total, uint64_t available, uint64_t *out)
{
    if (!text)
        return EINVAL;
    while (*text == ' ' || *text == '\t')
        text++;
    size_t n = strlen(text);
    while (n && (text[n - 1] == ' ' || text[n - 1] == '\t' || text[n - 1] == '\n'))
        n--;
    if (n == 4 && strncasecmp(text, "auto", 4) == 0) {
        uint64_t base = available && available < total ? available : total;
        if (base == 0)
            return EINVAL;
        *out = base / 10 * 9;
        return 0;
    }
    if (n && text[n - 1] == '%') {
        char num[32];
        uint64_t ip;
        double frac;
        char unit[2];
        if (n - 1 >= sizeof(num) || total == 0)
            return EINVAL;
        memcpy(num, text, n - 1);
        num[n - 1] = '\0';
        int rc = split_number(num, &ip, &frac, unit, sizeof(unit));
        if (rc || unit[0])
            return rc ? rc : EINVAL;
        double pct = (double)ip + frac;
        if (!(pct > 0) || pct > 100)
            return ERANGE;
        *out = (uint64_t)((double)total * (pct / 100.0));
        return *out ? 0 : EINVAL;
    }
    uint64_t v;
    int rc = mg_parse_size(text, &v);
    if (rc)
        return rc;
    if (v == 0)
        return EINVAL;
    *out = v;
    return 0;
}
