/* The library dlopen()ed by a program that did not preload it (as Python's ctypes would): its
 * own entry points, found with dlsym, serve a large block from a fresh thread. A library built
 * with initial-exec TLS fails to load here ("cannot allocate memory in static TLS block") or
 * faults at its first thread-local access.
 *
 * usage: dlopened PATH_TO_LIBRARY */
#include "common.h"
#include <dlfcn.h>
#include <pthread.h>

static void *(*lib_malloc)(size_t);
static void (*lib_free)(void *);

static void *use(void *arg) {
    (void)arg;
    char *p = lib_malloc(64 << 20);
    CHECK(p, "the library's malloc failed");
    for (size_t i = 0; i < (64 << 20); i += 4096) p[i] = 1;
    char policy[64];
    policy_of(p, policy, sizeof policy);
    printf("dlopened: policy %s\n", policy);
    lib_free(p);
    return NULL;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: dlopened PATH");
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    CHECK(lib, "dlopen: %s", dlerror());
    lib_malloc = (void *(*)(size_t))dlsym(lib, "malloc");
    lib_free = (void (*)(void *))dlsym(lib, "free");
    CHECK(lib_malloc && lib_free, "dlsym");
    pthread_t t;
    pthread_create(&t, NULL, use, NULL);
    pthread_join(t, NULL);
    use(NULL);
    printf("ok\n");
    return 0;
}
