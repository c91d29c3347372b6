/* Replays inputs through a libFuzzer target without libFuzzer, so a
 * compiler that has none (gcc) still runs the seeds through the parsers
 * under its sanitizers: each file named on the command line is read whole
 * into a buffer of exactly its size (as libFuzzer passes it, so a read one
 * byte past the end is caught) and given once to LLVMFuzzerTestOneInput.
 * Exits 0 after the last file, 2 on a file it cannot read; a finding
 * aborts through the sanitizer or the target. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The whole of `path` in a malloc'd buffer of its size: 0, or -1. */
static int read_all(const char *path, uint8_t **data, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    long n = -1;
    *data = NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
        *data = malloc((size_t)n);      /* malloc(0) may be NULL: nothing is read */
        if (n > 0 && (!*data || fread(*data, 1, (size_t)n, f) != (size_t)n))
            n = -1;
    }
    fclose(f);
    if (n < 0) {
        free(*data);
        return -1;
    }
    *size = (size_t)n;
    return 0;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        uint8_t *data;
        size_t size;
        if (read_all(argv[i], &data, &size) != 0) {
            perror(argv[i]);
            return 2;
        }
        LLVMFuzzerTestOneInput(data, size);
        free(data);
    }
    printf("replayed %d inputs\n", argc - 1);
    return 0;
}
