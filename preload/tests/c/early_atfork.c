/* A library whose constructor runs before the preload library's (the program links it) and
 * registers fork handlers that allocate large blocks, as glibc allows in every handler. */
#include <pthread.h>

#include "common.h"

static void allocate(void) {
    char *p = malloc(24 << 20);
    CHECK(p != NULL, "malloc in a fork handler");
    memset(p, 7, 24 << 20);
    free(p);
}

__attribute__((constructor)) static void register_handlers(void) {
    CHECK(pthread_atfork(allocate, allocate, allocate) == 0, "pthread_atfork");
}
