/* The library in a program's life: a calloc before main, fork, threads freeing each other's
 * blocks, realloc across the threshold both ways, errno kept by free, usable sizes, memalign's
 * rounding, and a multithreaded malloc/free stress with every byte checked.
 *
 * usage: lifecycle THREADS ROUNDS [portable]   (prints "ok" and a checksum that does not depend
 * on the allocator, so that runs with and without the library compare; `portable` leaves out
 * glibc's own rules, which jemalloc and mimalloc do not all follow: memalign's rounding, pvalloc,
 * realloc(p, 0)) */
#include "common.h"
#include <malloc.h>
#include <pthread.h>
#include <sys/wait.h>

#define MiB ((size_t)1 << 20)

static unsigned char *before_main;

__attribute__((constructor)) static void early(void) {
    before_main = calloc(1, 8 * MiB);
}

static void fill(unsigned char *p, size_t len, unsigned seed) {
    for (size_t i = 0; i < len; i += 512) p[i] = (unsigned char)(seed + i / 512);
    p[len - 1] = (unsigned char)seed;
}

/* The first `kept` bytes of a block `fill` wrote (a realloc keeps a prefix). */
static int prefix_intact(const unsigned char *p, size_t kept, unsigned seed) {
    for (size_t i = 0; i < kept; i += 512)
        if (p[i] != (unsigned char)(seed + i / 512)) return 0;
    return 1;
}

static int intact(const unsigned char *p, size_t len, unsigned seed) {
    return prefix_intact(p, len - 1, seed) && p[len - 1] == (unsigned char)seed;
}

/* Blocks handed between threads: each thread frees the previous thread's block. */
#define SLOTS 64
static unsigned char *slot[SLOTS];
static size_t slot_len[SLOTS];
static unsigned slot_seed[SLOTS];
static pthread_mutex_t slot_lock = PTHREAD_MUTEX_INITIALIZER;

struct worker {
    int id, rounds;
    unsigned long long sum;
};

static void *stress(void *arg) {
    struct worker *w = arg;
    unsigned rng = 12345u + (unsigned)w->id * 7919u;
    for (int r = 0; r < w->rounds; r++) {
        rng = rng * 1103515245u + 12345u;
        /* Sizes from 64 bytes to 24 MiB: both sides of the threshold. */
        size_t len = (size_t)64 << (rng >> 16) % 19;
        len += (rng >> 8) % 4096;
        unsigned seed = rng >> 3;
        unsigned char *p = (rng >> 28) & 1 ? malloc(len) : calloc(1, len);
        CHECK(p, "allocating %zu", len);
        fill(p, len, seed);
        if ((rng >> 24) % 4 == 0) {
            /* Across the threshold either way, or within one side. */
            size_t to = (rng >> 20) & 1 ? len * 5 + 3 : len / 3 + 1;
            unsigned char *q = realloc(p, to);
            CHECK(q, "realloc %zu -> %zu", len, to);
            CHECK(prefix_intact(q, (to < len ? to : len) - 1, seed), "realloc %zu -> %zu lost bytes", len, to);
            p = q;
            len = to;
            fill(p, len, seed);
        }
        CHECK(malloc_usable_size(p) >= len, "usable %zu < %zu", malloc_usable_size(p), len);
        w->sum += len;
        int k = (int)((rng >> 5) % SLOTS);
        pthread_mutex_lock(&slot_lock);
        unsigned char *old = slot[k];
        size_t old_len = slot_len[k];
        unsigned old_seed = slot_seed[k];
        slot[k] = p, slot_len[k] = len, slot_seed[k] = seed;
        pthread_mutex_unlock(&slot_lock);
        if (old) {
            CHECK(intact(old, old_len, old_seed), "a block of %zu bytes changed while live", old_len);
            free(old);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    CHECK(argc == 3 || argc == 4, "usage: lifecycle THREADS ROUNDS [portable]");
    int threads = atoi(argv[1]), rounds = atoi(argv[2]);
    int glibc_rules = argc == 3;

    CHECK(before_main, "calloc before main failed");
    for (size_t i = 0; i < 8 * MiB; i += 4096) CHECK(before_main[i] == 0, "calloc before main not zero");
    free(before_main);

    /* free keeps errno, for blocks of ours and glibc's. */
    void *large = malloc(16 * MiB), *small = malloc(100);
    errno = 1234;
    free(large);
    CHECK(errno == 1234, "free of a large block changed errno to %d", errno);
    free(small);
    CHECK(errno == 1234, "free of a small block changed errno to %d", errno);

    if (glibc_rules) {
        /* memalign rounds a non-power-of-two alignment up, as glibc's does. */
        void *odd = memalign(3000, 4 * MiB);
        CHECK(odd && (uintptr_t)odd % 4096 == 0, "memalign(3000) gave %p", odd);
        free(odd);
        void *pv = pvalloc(4 * MiB + 1);
        long page = sysconf(_SC_PAGESIZE);
        CHECK(pv && (uintptr_t)pv % (uintptr_t)page == 0 && malloc_usable_size(pv) >= 4 * MiB + 1,
              "pvalloc");
        free(pv);
    }
    free(valloc(3 * MiB));
    void *bad;
    CHECK(posix_memalign(&bad, 24, 4 * MiB) == EINVAL, "posix_memalign with alignment 24");

    /* realloc across the threshold both ways keeps the data. */
    unsigned char *r = malloc(1000);
    fill(r, 1000, 7);
    r = realloc(r, 32 * MiB);
    CHECK(r && prefix_intact(r, 999, 7), "realloc small -> large");
    fill(r, 32 * MiB, 9);
    r = realloc(r, 5000);
    CHECK(r && prefix_intact(r, 5000, 9), "realloc large -> small");
    if (glibc_rules) CHECK(realloc(r, 0) == NULL, "realloc(p, 0) frees and returns null, as glibc's");
    else free(r);

    /* fork: the child uses, frees and allocates blocks, the parent's are untouched. */
    unsigned char *shared = malloc(24 * MiB);
    fill(shared, 24 * MiB, 3);
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        if (!intact(shared, 24 * MiB, 3)) _exit(3);
        free(shared);
        unsigned char *mine = malloc(40 * MiB);
        fill(mine, 40 * MiB, 5);
        if (!intact(mine, 40 * MiB, 5)) _exit(4);
        free(mine);
        _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child failed: status %d", status);
    CHECK(intact(shared, 24 * MiB, 3), "the parent's block changed across the fork");
    free(shared);

    pthread_t tid[64];
    struct worker w[64];
    CHECK(threads > 0 && threads <= 64, "1..64 threads");
    for (int t = 0; t < threads; t++) {
        w[t] = (struct worker){t, rounds, 0};
        pthread_create(&tid[t], NULL, stress, &w[t]);
    }
    unsigned long long sum = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        sum += w[t].sum;
    }
    for (int k = 0; k < SLOTS; k++) {
        if (slot[k]) CHECK(intact(slot[k], slot_len[k], slot_seed[k]), "slot %d changed", k);
        free(slot[k]);
    }
    printf("ok, %llu bytes allocated\n", sum);
    return 0;
}
