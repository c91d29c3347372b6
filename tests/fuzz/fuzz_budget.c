/* libFuzzer target: budgets and sizes as people write them
 * (csrc/core/budget.c) and the locale-free decimal parser options use.
 * The first 16 bytes are the machine's total and available memory, the
 * rest the text. A budget is positive; a size never passes MG_BUDGET_MAX
 * and means the same bytes as a budget; a share never passes the total. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mgi.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t total = 0, available = 0, out = 0;
    if (size >= 16) {
        memcpy(&total, data, 8);
        memcpy(&available, data + 8, 8);
        data += 16;
        size -= 16;
    }
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    uint64_t size_bytes = 0;
    int size_rc = mg_parse_size(text, &size_bytes);
    int rc = mg_parse_budget(text, total, available, &out);
    if (rc == 0 && (out == 0 || (out > MG_BUDGET_MAX && out > total)))
        abort();      /* positive; a size bounded, a share of the total within it */
    if (size_rc == 0 && size_bytes > 0 && size_bytes <= MG_BUDGET_MAX &&
        (rc != 0 || out != size_bytes))
        abort();                                 /* a size is the same budget */
    double d;
    (void)mgi_parse_double(text, &d);
    free(text);
    return 0;
}
