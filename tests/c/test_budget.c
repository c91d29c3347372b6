/* mg_parse_size and mg_parse_budget: every unit, exact decimals, blanks,
 * percentages, "auto", overflow and garbage. */
#include <stdint.h>

#include "mgi.h"
#include "mgtest.h"

/* Parse text as a size; the result, or the error code shifted out of the
 * way of any size a test uses (errno values are small positive ints). */
static uint64_t size_of(const char *text, int *rc)
{
    uint64_t v = 0xDEADBEEF;
    *rc = mg_parse_size(text, &v);
    return v;
}

#define CHECK_SIZE(text, expected)                                                    \
    do {                                                                              \
        int rc_;                                                                      \
        uint64_t v_ = size_of(text, &rc_);                                            \
        CHECK_EQ(rc_, 0);                                                             \
        CHECK_EQ(v_, expected);                                                       \
    } while (0)

#define CHECK_SIZE_ERR(text, err)                                                     \
    do {                                                                              \
        int rc_;                                                                      \
        uint64_t v_ = size_of(text, &rc_);                                            \
        CHECK_EQ(rc_, err);                                                           \
        CHECK_EQ(v_, 0xDEADBEEF); /* untouched on error */                            \
    } while (0)

#define CHECK_BUDGET(text, total, avail, expected)                                    \
    do {                                                                              \
        uint64_t v_ = 0;                                                              \
        CHECK_EQ(mg_parse_budget(text, total, avail, &v_), 0);                        \
        CHECK_EQ(v_, expected);                                                       \
    } while (0)

#define CHECK_BUDGET_ERR(text, total, avail, err)                                     \
    do {                                                                              \
        uint64_t v_ = 0;                                                              \
        CHECK_EQ(mg_parse_budget(text, total, avail, &v_), err);                      \
    } while (0)

static void test_units(void)
{
    static const struct {
        const char *unit;
        uint64_t scale;
    } units[] = {
        {"", 1},
        {"B", 1},
        {"b", 1},
        {"K", 1024ULL},
        {"k", 1024ULL},
        {"KiB", 1024ULL},
        {"kib", 1024ULL},
        {"KB", 1000ULL},
        {"kB", 1000ULL},
        {"M", 1ULL << 20},
        {"MiB", 1ULL << 20},
        {"MB", 1000000ULL},
        {"G", 1ULL << 30},
        {"GiB", 1ULL << 30},
        {"gIb", 1ULL << 30},
        {"GB", 1000000000ULL},
        {"T", 1ULL << 40},
        {"TiB", 1ULL << 40},
        {"TB", 1000000000000ULL},
    };
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        char text[32];
        snprintf(text, sizeof(text), "12%s", units[i].unit);
        CHECK_SIZE(text, 12 * units[i].scale);
        snprintf(text, sizeof(text), "7 %s", units[i].unit);
        CHECK_SIZE(text, 7 * units[i].scale);
    }
    CHECK_SIZE("0", 0);
    CHECK_SIZE("0GiB", 0);
    CHECK_SIZE("18446744073709551615", UINT64_MAX);
}

static void test_decimals_are_exact(void)
{
    CHECK_SIZE("1.5G", 3ULL << 29);
    CHECK_SIZE("0.5KiB", 512);
    CHECK_SIZE("2.2583GB", 2258300000ULL); /* a double product gives one byte less */
    CHECK_SIZE("719.780112GB", 719780112000ULL);
    CHECK_SIZE("0.1K", 102);                 /* floor(102.4) */
    CHECK_SIZE("0.001KB", 1);
    CHECK_SIZE("0.0009KB", 0);
    CHECK_SIZE("1.0", 1);                    /* a whole number of bytes written with .0 */
    CHECK_SIZE("3.999999999999999999999T", (4ULL << 40) - 1);
    CHECK_SIZE("16777215.5T", (16777215ULL << 40) + (1ULL << 39));
}

static void test_blanks(void)
{
    CHECK_SIZE("  12 GiB  ", 12ULL << 30);
    CHECK_SIZE("\t12\tG\t", 12ULL << 30);
    CHECK_SIZE("12GiB\n", 12ULL << 30);      /* as read from a file */
    CHECK_SIZE("12\n", 12);
    CHECK_BUDGET(" 12GiB\n", 0, 0, 12ULL << 30);
    CHECK_BUDGET(" auto\n", 1000, 0, 900);
    CHECK_BUDGET("75% \n", 1000, 0, 750);
}

static void test_overflow(void)
{
    CHECK_SIZE_ERR("18446744073709551616", ERANGE);
    CHECK_SIZE_ERR("99999999999999999999999", ERANGE);
    CHECK_SIZE_ERR("16777216T", ERANGE);     /* 2^24 * 2^40 = 2^64 */
    CHECK_SIZE("16777215.99999999999T", 18446744073709551605ULL); /* just fits */
    CHECK_SIZE_ERR("18446744073709551615K", ERANGE);
    CHECK_SIZE_ERR("18446744073709551615.5B", EINVAL); /* a fraction of a byte */
    CHECK_BUDGET_ERR("99999999999999999999TiB", 1ULL << 40, 0, ERANGE);
    CHECK_BUDGET("4611686018427387904", 1ULL << 40, 0, MG_BUDGET_MAX); /* 4 EiB: the most */
    CHECK_BUDGET_ERR("4611686018427387905", 1ULL << 40, 0, ERANGE);
    CHECK_BUDGET_ERR("16777216TiB", 1ULL << 40, 0, ERANGE);            /* 16 EiB: a size */
}

static void test_garbage(void)
{
    static const char *const bad[] = {
        "", " ", "abc", "GiB", "-1", "+1", "-1G", "1e9", "0x100", "1,000", "12XB", "12 GiB extra",
        "1.5", "1.5B", "1.", ".5G", "1..5G", "12 G B", "nan", "inf", "12gigabytes", "1 2",
        "12GiB\x01", "12\xc2\xa0GiB",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc;
        uint64_t v = size_of(bad[i], &rc);
        if (rc != EINVAL)
            printf("size \"%s\": rc %d, value %llu\n", bad[i], rc, (unsigned long long)v);
        CHECK_EQ(rc, EINVAL);
    }
    uint64_t v;
    CHECK_EQ(mg_parse_size(NULL, &v), EINVAL);
    CHECK_EQ(mg_parse_budget(NULL, 100, 0, &v), EINVAL);
}

static void test_percent(void)
{
    CHECK_BUDGET("75%", 1000, 0, 750);
    CHECK_BUDGET("12.5%", 1000, 0, 125);
    CHECK_BUDGET("33.3%", 1000, 0, 333);
    CHECK_BUDGET("0.1%", 1000, 0, 1);
    CHECK_BUDGET("100%", 1000, 0, 1000);
    CHECK_BUDGET("100%", UINT64_MAX, 0, UINT64_MAX);           /* no float overflow */
    CHECK_BUDGET("100%", (1ULL << 53) + 1, 0, (1ULL << 53) + 1); /* no float rounding */
    CHECK_BUDGET("50%", UINT64_MAX, 0, UINT64_MAX / 2);
    CHECK_BUDGET("75 %", 1000, 0, 750);
    CHECK_BUDGET("75%", 1000, 10, 750); /* a share of the total, not of what is free */
    CHECK_BUDGET_ERR("0%", 1000, 0, ERANGE);
    CHECK_BUDGET_ERR("0.0%", 1000, 0, ERANGE);
    CHECK_BUDGET_ERR("100.5%", 1000, 0, ERANGE);
    CHECK_BUDGET_ERR("101%", 1000, 0, ERANGE);
    CHECK_BUDGET_ERR("99999999999999999999999%", 1000, 0, ERANGE);
    CHECK_BUDGET_ERR("0.01%", 100, 0, EINVAL); /* rounds to a zero budget */
    CHECK_BUDGET_ERR("50%", 0, 0, EINVAL);     /* no total to take a share of */
    CHECK_BUDGET_ERR("%", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("-5%", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("5G%", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("5%%", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("inf%", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("1234567890123456789012345678901234%", 1000, 0, EINVAL); /* too long */
}

static void test_auto(void)
{
    CHECK_BUDGET("auto", 1000, 0, 900);
    CHECK_BUDGET("AUTO", 1000, 0, 900);
    CHECK_BUDGET("Auto", 1000, 500, 450);     /* the smaller of total and available */
    CHECK_BUDGET("auto", 1000, 2000, 900);    /* available above total: total */
    CHECK_BUDGET("auto", 1000003, 0, 900002); /* floor(0.9 * total), not 0.9 * floor(total / 10) */
    CHECK_BUDGET("auto", UINT64_MAX, 0, 16602069666338596453ULL);
    CHECK_BUDGET("auto", 5, 0, 4);
    CHECK_BUDGET_ERR("auto", 1, 0, EINVAL); /* 90 % of one byte is no budget */
    CHECK_BUDGET_ERR("auto", 0, 0, EINVAL);
    CHECK_BUDGET_ERR("auto2", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("au to", 1000, 0, EINVAL);
}

static void test_budget_sizes(void)
{
    CHECK_BUDGET("12GiB", 0, 0, 12ULL << 30);
    CHECK_BUDGET("512MB", 1000, 0, 512000000ULL); /* a size ignores the total */
    CHECK_BUDGET("4096", 0, 0, 4096);
    CHECK_BUDGET_ERR("0", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("0GiB", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("0.0001KB", 1000, 0, EINVAL); /* floors to zero bytes */
    CHECK_BUDGET_ERR("twelve", 1000, 0, EINVAL);
    CHECK_BUDGET_ERR("", 1000, 0, EINVAL);
}

/* The live budget: the least of the user's, the cgroup's room and the
 * host's; what bound it; nothing known is ENODATA. */
static void test_live(void)
{
    const uint64_t M = 1ULL << 20;
    const double R = 0.08; /* the reserve: 8 % of the limit, of MemTotal */
    mg_sample_t s;
    mgi_sample_init(&s);
    uint64_t b = 0xDEADBEEF;
    int src = -1;
    CHECK_EQ(mg_budget_live(&s, 0, R, &b, &src), ENODATA);
    CHECK_EQ(b, 0xDEADBEEF);
    CHECK_EQ(mg_budget_live(&s, 700 * M, R, &b, &src), 0);
    CHECK_EQ(b, 700 * M);
    CHECK_EQ(src, MG_BUDGET_SRC_USER);

    /* the host: resident bytes plus MemAvailable less 8 % of MemTotal */
    s.have |= MG_HAVE_STATUS | MG_HAVE_MEMAVAIL | MG_HAVE_MEMINFO;
    s.rss_bytes = 1000 * M;
    s.mem_total_bytes = 16000 * M;
    s.mem_available_bytes = 3000 * M;
    CHECK_EQ(mg_budget_live(&s, 0, R, &b, &src), 0);
    CHECK_EQ(b, 2720 * M);
    CHECK_EQ(src, MG_BUDGET_SRC_HOST);
    CHECK_EQ(mg_budget_live(&s, 2000 * M, R, &b, &src), 0);
    CHECK_EQ(src, MG_BUDGET_SRC_USER);
    /* the children's own bytes are the tree's */
    s.have |= MG_HAVE_CHILDREN;
    s.children_bytes = 500 * M;
    CHECK_EQ(mg_budget_live(&s, 0, R, &b, &src), 0);
    CHECK_EQ(b, 3220 * M);
    /* nothing left is a budget of one byte, not none */
    s.mem_available_bytes = 0;
    CHECK_EQ(mg_budget_live(&s, 0, 0.99, &b, &src), 0);
    CHECK_EQ(b, 1);

    /* a cgroup: its limit less what others in it use, less 8 % of it */
    s.mem_available_bytes = 9000 * M;
    s.have |= MG_HAVE_CGROUP | MG_HAVE_CGROUP_LIMIT | MG_HAVE_CGROUP_WS;
    s.cgroup_limit_bytes = 2200 * M;
    s.cgroup_usage_bytes = 2100 * M;
    s.cgroup_working_set_bytes = 1800 * M; /* 300 MiB of it others' */
    CHECK_EQ(mg_budget_live(&s, 0, R, &b, &src), 0);
    CHECK_EQ(b, 2200 * M - 300 * M - (uint64_t)(R * 2200 * M));
    CHECK_EQ(src, MG_BUDGET_SRC_CGROUP);
    s.cgroup_working_set_bytes = 1200 * M; /* less than the tree: nobody else */
    CHECK_EQ(mg_budget_live(&s, 0, 0.0, &b, &src), 0);
    CHECK_EQ(b, 2200 * M);
    /* without a working set, usage; memory.high below the limit binds */
    s.have &= ~(uint64_t)MG_HAVE_CGROUP_WS;
    s.have |= MG_HAVE_CGROUP_HIGH;
    s.cgroup_high_bytes = 2000 * M;
    CHECK_EQ(mg_budget_live(&s, 0, 0.0, &b, &src), 0);
    CHECK_EQ(b, 1400 * M); /* 2000 - (2100 - 1500) */
    CHECK_EQ(mg_budget_live(&s, 1000 * M, R, &b, NULL), 0);
    CHECK_EQ(b, 1000 * M);
    /* the host below the cgroup binds */
    s.mem_available_bytes = 100 * M;
    CHECK_EQ(mg_budget_live(&s, 0, R, &b, &src), 0);
    CHECK_EQ(b, 320 * M);
    CHECK_EQ(src, MG_BUDGET_SRC_HOST);
}

int main(void)
{
    mgt_begin();
    RUN(test_units);
    RUN(test_decimals_are_exact);
    RUN(test_blanks);
    RUN(test_overflow);
    RUN(test_garbage);
    RUN(test_percent);
    RUN(test_auto);
    RUN(test_budget_sizes);
    RUN(test_live);
    return mgt_result();
}
