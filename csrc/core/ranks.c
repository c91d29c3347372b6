/* Ranks of the same distributed job among the process's descendants. A
 * launcher that starts ranks as its own children (Lightning's subprocess
 * launcher: rank 0 starts ranks 1..N-1) gives each its rank in the
 * environment; DataLoader workers inherit their rank's, forked ones as it
 * was at exec (/proc/PID/environ shows that), spawned ones as it is at
 * their start. So a descendant whose environment names another LOCAL_RANK
 * or RANK than this process is a rank of its own, not a worker of ours. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "mgi.h"

/* In the order of mgi_ranks_t's values. */
static const char *const keys[MGI_RANK_KEYS] = {"LOCAL_RANK", "RANK"};
static const size_t key_len[MGI_RANK_KEYS] = {sizeof("LOCAL_RANK") - 1, sizeof("RANK") - 1};

/* A rank number has at most this many digits (no launcher goes near it). */
#define RANK_DIGITS 9

#define ALL_KEYS ((1u << MGI_RANK_KEYS) - 1)

/* This process's ranks as its environment last named them (mg_ranks_note).
 * Atomics: the sampling thread reads them while a caller notes new ones. */
static _Atomic int64_t own[MGI_RANK_KEYS] = {MGI_NO_RANK, MGI_NO_RANK};

/* The value of "digits" of length n: a rank, or MGI_NO_RANK. */
static int64_t rank_number(const char *p, size_t n)
{
    int64_t v = 0;
    if (n == 0 || n > RANK_DIGITS)
        return MGI_NO_RANK;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return MGI_NO_RANK;
        v = v * 10 + (p[i] - '0');
    }
    return v;
}

/* Start a new entry. */
static void next_entry(mgi_envscan_t *e)
{
    e->pos = 0;
    e->match = ALL_KEYS;
    e->key = -1;
    e->digits = 0;
    e->value = 0;
}

void mgi_envscan_init(mgi_envscan_t *e)
{
    for (int k = 0; k < MGI_RANK_KEYS; k++)
        e->ranks.v[k] = MGI_NO_RANK;
    next_entry(e);
}

/* An entry ended (its NUL was seen): keep its value if it is a key's first. */
static void end_entry(mgi_envscan_t *e)
{
    if (e->key >= 0 && e->digits > 0 && e->ranks.v[e->key] == MGI_NO_RANK)
        e->ranks.v[e->key] = e->value;
    next_entry(e);
}

/* One byte of an entry's name (at e->pos), or the '=' after it. */
static void name_byte(mgi_envscan_t *e, char c)
{
    for (int k = 0; k < MGI_RANK_KEYS; k++) {
        if (!(e->match & (1u << k)))
            continue;
        if (e->pos < key_len[k] ? keys[k][e->pos] != c : c != '=') {
            e->match &= ~(1u << k);
        } else if (e->pos == key_len[k]) {
            e->key = k;
            e->match = 0;
        }
    }
    e->pos++;
}

void mgi_envscan_feed(mgi_envscan_t *e, const char *buf, size_t len)
{
    const char *p = buf, *end = buf + len;
    while (p < end) {
        if (e->key < 0 && e->match == 0) { /* neither key: skip to the entry's end */
            const char *nul = memchr(p, '\0', (size_t)(end - p));
            if (!nul)
                return;
            p = nul;
        }
        char c = *p++;
        if (c == '\0') {
            end_entry(e);
        } else if (e->key < 0) {
            name_byte(e, c);
        } else if (c >= '0' && c <= '9' && e->digits >= 0 && e->digits < RANK_DIGITS) {
            e->value = e->value * 10 + (c - '0');
            e->digits++;
        } else {
            e->digits = -1; /* not a rank number */
        }
    }
}

int mgi_envscan_done(const mgi_envscan_t *e)
{
    for (int k = 0; k < MGI_RANK_KEYS; k++)
        if (e->ranks.v[k] == MGI_NO_RANK)
            return 0;
    return 1;
}

void mgi_parse_ranks(const char *buf, size_t len, mgi_ranks_t *out)
{
    mgi_envscan_t e;
    mgi_envscan_init(&e);
    mgi_envscan_feed(&e, buf, len);
    *out = e.ranks;
}

void mg_ranks_note(void)
{
    for (int k = 0; k < MGI_RANK_KEYS; k++) {
        const char *v = getenv(keys[k]);
        atomic_store_explicit(&own[k], v ? rank_number(v, strlen(v)) : MGI_NO_RANK,
                              memory_order_relaxed);
    }
}

int mgi_ranks_other(const mgi_ranks_t *theirs)
{
    for (int k = 0; k < MGI_RANK_KEYS; k++)
        if (theirs->v[k] != MGI_NO_RANK &&
            theirs->v[k] != atomic_load_explicit(&own[k], memory_order_relaxed))
            return 1;
    return 0;
}
