/* libFuzzer target: the option table (csrc/core/options.c). The first
 * byte picks an option, the rest is the value set; every option is then
 * read back, and the thresholds' order checked, as configure() does. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "memguard/memguard.h"

static size_t n_options(void)
{
    size_t n = 0;
    while (mg_option_name(n))
        n++;
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static size_t count;
    if (!count)
        count = n_options();
    if (size < 1 || !count)
        return 0;
    char *value = malloc(size);
    if (!value)
        return 0;
    memcpy(value, data + 1, size - 1);
    value[size - 1] = '\0';
    const char *name = mg_option_name(data[0] % count);
    char saved[512], buf[512], why[256];
    if (mg_option_get(name, saved, sizeof(saved)) != 0)
        abort();
    int rc = mg_option_set(name, value);
    if (rc != 0 && rc != EINVAL)
        abort();
    for (size_t i = 0; i < count; i++)
        if (mg_option_get(mg_option_name(i), buf, sizeof(buf)) != 0)
            abort();
    (void)mg_option_check(why, sizeof(why));
    while (mg_option_next_warning(buf, sizeof(buf)) == 0) {
    }
    if (mg_option_set(name, saved) != 0)        /* what was read back is valid */
        abort();
    free(value);
    return 0;
}
