/* Whether a large malloc the program barely touches stays overcommitted, as with glibc: a block
 * of MIB MiB with one byte written, freed; then two written whole (malloc, memset, free); then
 * one more, not touched at all. Prints how much each of the first and the last added to the
 * resident set (/proc/self/statm) while it was live.
 *
 * usage: overcommit MIB   (prints "untouched: N MiB", "after whole writes: N MiB") */
#include "common.h"

/* Resident bytes of the process. */
static size_t resident(void) {
    FILE *statm = fopen("/proc/self/statm", "r");
    CHECK(statm, "opening /proc/self/statm");
    unsigned long size = 0, pages = 0;
    CHECK(fscanf(statm, "%lu %lu", &size, &pages) == 2, "reading /proc/self/statm");
    fclose(statm);
    return pages * (size_t)sysconf(_SC_PAGESIZE);
}

/* What a malloc of len bytes, with `touch` bytes written at its start, adds to the resident set. */
static size_t growth(size_t len, size_t touch) {
    size_t before = resident();
    unsigned char *p = malloc(len);
    CHECK(p, "malloc(%zu)", len);
    memset(p, 1, touch);
    size_t grown = resident() - before;
    free(p);
    return grown;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: overcommit MIB");
    size_t len = (size_t)atoi(argv[1]) << 20;
    CHECK(len > 0, "a size in MiB");
    size_t untouched = growth(len, 1);
    for (int i = 0; i < 2; i++) {
        unsigned char *p = malloc(len);
        CHECK(p, "malloc(%zu)", len);
        memset(p, 2, len);
        /* The compiler may drop a memset of memory only freed after it. */
        __asm__ volatile("" : : "r"(p) : "memory");
        free(p);
    }
    size_t after = growth(len, 0);
    printf("untouched: %zu MiB\nafter whole writes: %zu MiB\n", untouched >> 20, after >> 20);
    return 0;
}
