/* Bringing swapped-out pages back needs a map of where they are (Linux's
 * smaps); portable POSIX has none. */
#include <errno.h>

#include "mgi.h"

int mgi_swap_in(const char *proc_root, uint64_t *swap_bytes)
{
    (void)proc_root;
    *swap_bytes = 0;
    return ENOSYS;
}
