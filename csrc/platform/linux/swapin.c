/* Bring the process's swapped-out pages back: after the kernel swapped
 * part of a run out (a limit lowered under it), the pages it never touches
 * again (the interpreter's start-up objects, a heap's cold chunks) stay in
 * swap for good, and every later touch is a major fault. Once the run fits
 * again, the mappings that hold swap (from /proc/self/smaps) are faulted
 * back in with MADV_POPULATE_READ, or read ahead with MADV_WILLNEED where
 * the kernel is older than 5.14. Reads smaps through a stack buffer and
 * allocates nothing; not for the allocation path. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mgi.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define MAX_RANGES 512

typedef struct range {
    uintptr_t lo, hi;
} range_t;

typedef struct walk {
    range_t ranges[MAX_RANGES];
    size_t n;
    uintptr_t lo, hi;   /* the mapping whose fields are being read */
    int readable;
    uint64_t swap_bytes;
} walk_t;

/* Parse a hex number at *p; 0 when there is none. */
static int hex(const char **p, const char *end, uintptr_t *out)
{
    uintptr_t v = 0;
    const char *q = *p;
    for (; q < end; q++) {
        int d = *q >= '0' && *q <= '9' ? *q - '0' : *q >= 'a' && *q <= 'f' ? *q - 'a' + 10 : -1;
        if (d < 0)
            break;
        v = v << 4 | (uintptr_t)d;
    }
    if (q == *p)
        return 0;
    *p = q;
    *out = v;
    return 1;
}

/* One line of smaps: a mapping's header ("lo-hi perms ...") or a field. */
static void line(walk_t *w, const char *s, size_t len)
{
    const char *end = s + len, *p = s;
    uintptr_t lo, hi;
    if (hex(&p, end, &lo) && p < end && *p == '-') {
        p++;
        if (hex(&p, end, &hi) && p + 2 < end && *p == ' ') {
            w->lo = lo;
            w->hi = hi;
            w->readable = p[1] == 'r';
        }
        return;
    }
    uint64_t kb;
    if (len > 5 && memcmp(s, "Swap:", 5) == 0 &&
        mgi_find_u64(s, len + 1, "Swap", &kb) == 0 && kb && w->readable && w->n < MAX_RANGES) {
        w->ranges[w->n].lo = w->lo;
        w->ranges[w->n].hi = w->hi;
        w->n++;
        w->swap_bytes += kb; /* mgi_find_u64 scaled kB to bytes */
    }
}

int mgi_swap_in(const char *proc_root, uint64_t *swap_bytes)
{
    char path[MGI_PATH_MAX], buf[16384];
    walk_t w;
    memset(&w, 0, sizeof(w));
    *swap_bytes = 0;
    if (mgi_join(path, sizeof(path), proc_root, "/self/smaps", NULL))
        return ENAMETOOLONG;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    size_t have = 0;
    ssize_t got;
    while ((got = read(fd, buf + have, sizeof(buf) - have)) > 0) {
        have += (size_t)got;
        size_t start = 0;
        char *nl;
        while ((nl = memchr(buf + start, '\n', have - start)) != NULL) {
            line(&w, buf + start, (size_t)(nl - (buf + start)));
            start = (size_t)(nl - buf) + 1;
        }
        memmove(buf, buf + start, have - start);
        have -= start;
        if (have == sizeof(buf)) /* a line longer than the buffer: not one we read */
            have = 0;
    }
    int rc = got < 0 ? errno : 0;
    close(fd);
    if (rc)
        return rc;
    int advice = MADV_POPULATE_READ;
    for (size_t i = 0; i < w.n; i++) {
        void *at = (void *)w.ranges[i].lo;
        size_t len = w.ranges[i].hi - w.ranges[i].lo;
        if (madvise(at, len, advice) != 0 && errno == EINVAL && advice == MADV_POPULATE_READ) {
            advice = MADV_WILLNEED; /* before Linux 5.14: read ahead, fault in on touch */
            (void)madvise(at, len, advice);
        }
    }
    *swap_bytes = w.swap_bytes;
    return 0;
}
