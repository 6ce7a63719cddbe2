/* Whether a freed block is given back before its addresses serve anyone else: this program
 * defines madvise and munmap itself (linked with -rdynamic, so that the library's calls come
 * here, as UCX's memory hooks catch them) and records the ranges given back. A block that is
 * freed must be covered by a madvise(MADV_DONTNEED) or a munmap before free returns, so that a
 * library still holding a registration on it drops it; the next block of the same size reads
 * zero, whatever the last owner wrote.
 *
 * usage: reuse MiB   (prints "given back: yes|no", "reused address: yes|no", "fresh: yes|no") */
#include "common.h"
#include <sys/mman.h>

/* Volatile: the compiler knows free() as a builtin that calls no user code, and would keep
 * these in registers across it. */
static volatile struct { uintptr_t start, end; } given[256];
static volatile int count;

static void record(void *addr, size_t len) {
    if (count < 256) given[count].start = (uintptr_t)addr, given[count].end = (uintptr_t)addr + len, count++;
}

int madvise(void *addr, size_t len, int advice) {
    if (advice == MADV_DONTNEED || advice == MADV_FREE || advice == MADV_REMOVE) record(addr, len);
    return (int)syscall(SYS_madvise, addr, len, advice);
}

int munmap(void *addr, size_t len) {
    record(addr, len);
    return (int)syscall(SYS_munmap, addr, len);
}

static int covered(uintptr_t start, uintptr_t end) {
    /* The union of the recorded ranges covers start..end (they are few: a quadratic walk). */
    uintptr_t at = start;
    for (int moved = 1; moved && at < end;) {
        moved = 0;
        for (int i = 0; i < count; i++)
            if (given[i].start <= at && given[i].end > at) at = given[i].end, moved = 1;
    }
    return at >= end;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: reuse MiB");
    size_t len = (size_t)atoi(argv[1]) << 20;
    unsigned char *p = malloc(len);
    CHECK(p, "malloc");
    memset(p, 0xAB, len);
    uintptr_t start = (uintptr_t)p;
    count = 0;
    free(p);
    int back = covered(start, start + len);
    unsigned char *q = malloc(len);
    CHECK(q, "malloc");
    int fresh = 1;
    for (size_t i = 0; i < len; i += 4096) fresh &= q[i] == 0;
    printf("given back: %s\nreused address: %s\nfresh: %s\n", back ? "yes" : "no", (uintptr_t)q == start ? "yes" : "no",
           fresh ? "yes" : "no");
    free(q);
    return 0;
}
