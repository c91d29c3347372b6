/* Notifiers on Linux: one eventfd each, waited on with ppoll's nanosecond
 * timeout. */
#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "mgi.h"

int mgi_note_open(mgi_note_t *n)
{
    if (n->rd >= 0)
        return 0;
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0)
        return errno;
    n->rd = n->wr = fd;
    return 0;
}

void mgi_note_signal(const mgi_note_t *n)
{
    if (n->wr >= 0) {
        uint64_t one = 1;
        ssize_t w = write(n->wr, &one, sizeof(one));
        (void)w; /* EAGAIN only when the counter is saturated: already signalled */
    }
}

int mgi_note_drain(const mgi_note_t *n)
{
    uint64_t v;
    return n->rd >= 0 && read(n->rd, &v, sizeof(v)) == (ssize_t)sizeof(v);
}

void mgi_note_close(mgi_note_t *n)
{
    if (n->rd >= 0)
        close(n->rd);
    n->rd = n->wr = -1;
}

int mgi_note_wait(const mgi_note_t *n, int64_t timeout_ns)
{
    struct pollfd pfd = {.fd = n->rd, .events = POLLIN};
    if (timeout_ns < 0)
        timeout_ns = 0;
    struct timespec ts = {.tv_sec = timeout_ns / 1000000000, .tv_nsec = timeout_ns % 1000000000};
    return ppoll(&pfd, 1, &ts, NULL) > 0;
}
