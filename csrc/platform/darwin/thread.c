/* macOS has no pthread_getcpuclockid: a running sampler's CPU time is not
 * read from outside it; its finished runs' time (banked by the thread from
 * CLOCK_THREAD_CPUTIME_ID as it ends) is all mg_sampler_cpu_ns counts. */
#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "mgi.h"

int mgi_thread_cpu_clock(pthread_t thread, clockid_t *clock)
{
    (void)thread;
    (void)clock;
    return ENOTSUP;
}
