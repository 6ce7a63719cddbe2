/* What glibc's own allocator promises inside glibc and to the program, checked with large
 * requests (run with a threshold of 4 KiB or the default):
 *   locale:  setlocale(LC_ALL, "") allocates stdio's buffer while it holds the locale lock; a
 *            later mbstowcs and strerror must not wait on that lock forever;
 *   errno:   successful malloc, calloc, realloc and free leave errno as it was, and a pending
 *            dlerror() stays pending across them;
 *   cancel:  malloc and free contain no cancellation point: a thread with a pending deferred
 *            cancellation returns from them, and is cancelled at the next testcancel. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <locale.h>
#include <pthread.h>
#include <wchar.h>

#include "common.h"

#define MIB ((size_t)1 << 20)

static void locale_case(void) {
    CHECK(setlocale(LC_ALL, "") != NULL, "setlocale");
    wchar_t wide[16];
    size_t n = mbstowcs(wide, "locale", 16);
    /* stdio's first buffer is allocated under the locale lock; the next large request too. */
    char *big = malloc(8 * MIB);
    CHECK(big != NULL, "malloc");
    memset(big, 1, 8 * MIB);
    free(big);
    printf("mbstowcs %zu, %s\n", n, strerror(ENOENT));
}

static void errno_case(void) {
    CHECK(dlopen("/nonexistent/libnothing.so", RTLD_NOW) == NULL, "dlopen of nothing");
    errno = 1234;
    char *a = malloc(64 * MIB);
    CHECK(a != NULL && errno == 1234, "malloc(64 MiB) set errno to %d", errno);
    memset(a, 2, 64 * MIB);
    char *z = calloc(96, MIB);
    CHECK(z != NULL && errno == 1234, "calloc(96 MiB) set errno to %d", errno);
    CHECK(z[5 * MIB] == 0, "calloc's memory is zero");
    a = realloc(a, 80 * MIB);
    CHECK(a != NULL && errno == 1234, "realloc to 80 MiB set errno to %d", errno);
    CHECK(a[63 * MIB] == 2, "realloc kept the contents");
    free(a);
    free(z);
    CHECK(errno == 1234, "free set errno to %d", errno);
    const char *pending = dlerror();
    CHECK(pending != NULL, "the program's pending dlerror() was taken by an allocation");
    printf("errno kept, dlerror pending\n");
}

static volatile int returned;

static void *cancelled(void *arg) {
    (void)arg;
    pthread_cancel(pthread_self());
    /* 4 to 128 MiB: carved and dedicated blocks, the first populated by a node's workers
     * (the pool is made then). */
    for (int i = 0; i < 6; i++) {
        size_t len = ((size_t)4 << i) * MIB;
        char *p = malloc(len);
        CHECK(p != NULL, "malloc");
        memset(p, 3, len);
        free(p);
    }
    returned = 1;
    pthread_testcancel();
    return NULL;
}

static void cancel_case(void) {
    pthread_t t;
    CHECK(pthread_create(&t, NULL, cancelled, NULL) == 0, "pthread_create");
    void *result;
    CHECK(pthread_join(t, &result) == 0, "pthread_join");
    CHECK(returned, "the thread was cancelled inside malloc or free");
    CHECK(result == PTHREAD_CANCELED, "the thread was not cancelled at testcancel");
    printf("no cancellation point inside malloc or free\n");
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: inside_glibc locale|errno|cancel");
    if (!strcmp(argv[1], "locale")) locale_case();
    else if (!strcmp(argv[1], "errno")) errno_case();
    else if (!strcmp(argv[1], "cancel")) cancel_case();
    else CHECK(0, "unknown case %s", argv[1]);
    return 0;
}
