/* Small helpers shared by the C core: clocks and bounded file reads. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mgi.h"

int64_t mgi_clock_ns(int clock_id)
{
    struct timespec ts;
    if (clock_gettime((clockid_t)clock_id, &ts) != 0)
        return 0;
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* seq_file and kernfs fill the whole buffer unless the file ends first, so a
 * short read is the end: one pread per file, not two. */
int mgi_pread_file(int fd, char *buf, size_t cap, size_t *len)
{
    size_t got = 0;
    *len = 0;
    if (cap == 0)
        return EINVAL;
    while (got < cap - 1) {
        ssize_t n = pread(fd, buf + got, cap - 1 - got, (off_t)got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            buf[got] = '\0';
            return errno;
        }
        if (n == 0)
            break;
        got += (size_t)n;
        if ((size_t)n < cap - 1 - (got - (size_t)n))
            break;
    }
    buf[got] = '\0';
    *len = got;
    return 0;
}

int mgi_read_path(const char *path, char *buf, size_t cap, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    int rc = mgi_pread_file(fd, buf, cap, len);
    close(fd);
    return rc;
}

int mgi_join(char *out, size_t cap, const char *a, const char *b, const char *c)
{
    int n = snprintf(out, cap, "%s%s%s", a, b ? b : "", c ? c : "");
    if (n < 0 || (size_t)n >= cap)
        return ENAMETOOLONG;
    return 0;
}

/* Looked up at run time: which allocator serves malloc is only known then. */
int mg_system_trim(const char **how)
{
    typedef int (*mallctl_fn)(const char *, void *, size_t *, void *, size_t);
    typedef int (*trim_fn)(size_t);
    mallctl_fn mallctl = (mallctl_fn)dlsym(RTLD_DEFAULT, "mallctl");
    if (mallctl) {
        *how = "jemalloc";
        /* 4096 is MALLCTL_ARENAS_ALL: every arena */
        return mallctl("arena.4096.purge", NULL, NULL, NULL, 0);
    }
    trim_fn trim = (trim_fn)dlsym(RTLD_DEFAULT, "malloc_trim");
    if (trim) {
        *how = "glibc";
        (void)trim(0);
        return 0;
    }
    /* macOS: every malloc zone gives back what it can (goal 0: no limit) */
    typedef size_t (*relief_fn)(void *, size_t);
    relief_fn relief = (relief_fn)dlsym(RTLD_DEFAULT, "malloc_zone_pressure_relief");
    if (relief) {
        *how = "darwin";
        (void)relief(NULL, 0);
        return 0;
    }
    *how = "none";
    return ENOTSUP;
}
