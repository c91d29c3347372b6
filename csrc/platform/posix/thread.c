/* Another thread's CPU clock, through POSIX's Thread CPU-Time Clocks
 * (Linux and the BSDs have them). */
#include <pthread.h>
#include <time.h>

#include "mgi.h"

int mgi_thread_cpu_clock(pthread_t thread, clockid_t *clock)
{
    return pthread_getcpuclockid(thread, clock);
}
