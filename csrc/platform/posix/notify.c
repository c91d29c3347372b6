/* Notifiers anywhere POSIX: a non-blocking pipe each (no eventfd), waited
 * on with poll, whose timeout is whole milliseconds (rounded up, so a wait
 * never ends early). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include "mgi.h"

static int set_flags(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
        return errno;
    return 0;
}

int mgi_note_open(mgi_note_t *n)
{
    if (n->rd >= 0)
        return 0;
    int fds[2];
    if (pipe(fds) != 0)
        return errno;
    int rc = set_flags(fds[0]);
    if (!rc)
        rc = set_flags(fds[1]);
    if (rc) {
        close(fds[0]);
        close(fds[1]);
        return rc;
    }
    n->rd = fds[0];
    n->wr = fds[1];
    return 0;
}

void mgi_note_signal(const mgi_note_t *n)
{
    if (n->wr >= 0) {
        char one = 1;
        ssize_t w = write(n->wr, &one, 1);
        (void)w; /* EAGAIN only when the pipe is full: already signalled */
    }
}

int mgi_note_drain(const mgi_note_t *n)
{
    char buf[64];
    int got = 0;
    if (n->rd < 0)
        return 0;
    while (read(n->rd, buf, sizeof(buf)) > 0)
        got = 1;
    return got;
}

void mgi_note_close(mgi_note_t *n)
{
    if (n->rd >= 0)
        close(n->rd);
    if (n->wr >= 0)
        close(n->wr);
    n->rd = n->wr = -1;
}

int mgi_note_wait(const mgi_note_t *n, int64_t timeout_ns)
{
    struct pollfd pfd = {.fd = n->rd, .events = POLLIN};
    if (timeout_ns < 0)
        timeout_ns = 0;
    int64_t ms = (timeout_ns + 999999) / 1000000;
    return poll(&pfd, 1, ms > 1000000000 ? 1000000000 : (int)ms) > 0;
}
