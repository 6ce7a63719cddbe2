/* Shared by the preload's test programs: where a buffer's pages lie, and how its mapping is
 * placed, read the way an outside observer reads them (move_pages, /proc/self/numa_maps). */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                  \
            fputc('\n', stderr);                           \
            exit(1);                                       \
        }                                                  \
    } while (0)

/* The pages of p..p+len on each node (move_pages with no target: query only); returns the
 * count on `node`, and the count of pages not on it through *elsewhere. */
static inline size_t pages_on(const void *p, size_t len, int node, size_t *elsewhere) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = (uintptr_t)p / page * page;
    size_t n = ((uintptr_t)p + len - first + page - 1) / page;
    void **pages = calloc(n, sizeof *pages);
    int *status = calloc(n, sizeof *status);
    CHECK(pages && status, "calloc for %zu pages", n);
    for (size_t i = 0; i < n; i++) pages[i] = (void *)(first + i * page);
    long r = syscall(SYS_move_pages, 0, n, pages, NULL, status, 0);
    CHECK(r == 0, "move_pages: %s", strerror(errno));
    size_t on = 0;
    *elsewhere = 0;
    for (size_t i = 0; i < n; i++) {
        if (status[i] == node) on++;
        else (*elsewhere)++;
    }
    free(pages);
    free(status);
    return on;
}

/* The NUMA policy of the mapping holding p, as /proc/self/numa_maps writes it ("default",
 * "prefer:0", "bind:0", ...), into out. */
static inline void policy_of(const void *p, char *out, size_t cap) {
    FILE *maps = fopen("/proc/self/maps", "r");
    CHECK(maps, "opening /proc/self/maps");
    char line[512];
    unsigned long start = 0, end = 0, found = 0;
    while (fgets(line, sizeof line, maps)) {
        if (sscanf(line, "%lx-%lx", &start, &end) == 2 && (uintptr_t)p >= start &&
            (uintptr_t)p < end) {
            found = 1;
            break;
        }
    }
    fclose(maps);
    CHECK(found, "no mapping holds %p", p);
    FILE *numa = fopen("/proc/self/numa_maps", "r");
    CHECK(numa, "opening /proc/self/numa_maps");
    snprintf(out, cap, "?");
    while (fgets(line, sizeof line, numa)) {
        unsigned long at;
        char policy[64];
        if (sscanf(line, "%lx %63s", &at, policy) == 2 && at == start) {
            snprintf(out, cap, "%s", policy);
            break;
        }
    }
    fclose(numa);
}
