/* The in-process install rewrites ELF import slots (the Linux layer's
 * install.c); this layer has no way to route torch's CPU allocations, so
 * the arena stays out of the process and the throttle works from the
 * footprint and from torch's own out-of-memory errors. */
#include <errno.h>

#include "memguard/memguard-arena.h"

int mg_install(const char *prefix, int *slots)
{
    (void)prefix;
    if (slots)
        *slots = 0;
    return ENOTSUP;
}

int mg_uninstall(void)
{
    return 0; /* nothing was installed */
}

int mg_installed(void)
{
    return 0;
}
