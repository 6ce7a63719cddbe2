/* The time a foreign free spends in the library's ownership check. Run under LD_PRELOAD of the
 * library: `free` (the library's, found through the PLT as any program finds it) against
 * glibc's `__libc_free` called directly, on the same small blocks of glibc's, in alternating
 * rounds; the difference per call is the check (one to three loads) plus the forwarding call.
 *
 * usage: foreign_free [ROUNDS]   prints ns per free for each, and the differences */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void *__libc_malloc(size_t);
void __libc_free(void *);

#define BATCH 4096

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* ns per free of BATCH glibc blocks of 64 bytes freed by `release`; the best of `rounds`. */
static double timed(void (*release)(void *), int rounds, void **blocks) {
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < BATCH; i++) blocks[i] = __libc_malloc(64);
        double t0 = now_ns();
        for (int i = 0; i < BATCH; i++) release(blocks[i]);
        double ns = (now_ns() - t0) / BATCH;
        if (ns < best) best = ns;
    }
    return best;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 200;
    void **blocks = __libc_malloc(BATCH * sizeof *blocks);
    double direct = 0, checked = 0;
    /* Alternate, so that both see the same cache and frequency conditions. */
    for (int pass = 0; pass < 5; pass++) {
        double d = timed(__libc_free, rounds, blocks), c = timed(free, rounds, blocks);
        if (pass == 0 || d < direct) direct = d;
        if (pass == 0 || c < checked) checked = c;
    }
    printf("foreign free (64 B blocks of glibc's), best of %d rounds of %d:\n", rounds * 5, BATCH);
    printf("  __libc_free directly       %6.2f ns\n", direct);
    printf("  free through the library   %6.2f ns\n", checked);
    printf("  ownership check + forward  %6.2f ns\n", checked - direct);
    return 0;
}
