/* Large blocks written whole (staging buffers, read targets): malloc N, memset N, free, ITER
 * times for each N given. Run with and without the library under LD_PRELOAD: the library's bulk
 * populate must keep this shape at least as fast as before.
 *
 * usage: whole_write ITER MIB...   prints ms per iteration for each size, and the total */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: whole_write ITER MIB...\n");
        return 2;
    }
    int iter = atoi(argv[1]);
    double total = 0;
    for (int a = 2; a < argc; a++) {
        size_t len = (size_t)atoi(argv[a]) << 20;
        double t0 = now_ms();
        for (int i = 0; i < iter; i++) {
            unsigned char *p = malloc(len);
            if (!p) {
                perror("malloc");
                return 1;
            }
            memset(p, i, len);
            /* Keep the writes: the compiler may drop a memset of memory only freed after. */
            __asm__ volatile("" : : "r"(p) : "memory");
            free(p);
        }
        double ms = now_ms() - t0;
        total += ms;
        printf("%s MiB: %.3f ms per iteration\n", argv[a], ms / iter);
    }
    printf("total: %.1f ms\n", total);
    return 0;
}
