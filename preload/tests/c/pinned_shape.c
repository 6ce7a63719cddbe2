/* The shape of PyTorch's pinned memory with pinned_use_cuda_host_register:True
 * (CachingHostAllocator.cpp, allocWithCudaHostRegister): an allocation of a power-of-two size,
 * one byte written per 4 KiB by unbound pool threads, then cudaHostRegister, here through the
 * driver (the simulator in tests). Also the other call paths: posix_memalign (CPU tensors,
 * nixlbench), aligned_alloc (Mooncake), calloc, and realloc across the threshold.
 *
 * usage: pinned_shape API LOG2_SIZE THREADS NODE
 * Prints the mapping's policy, the pages on NODE, and the registration's result; exits 1 when
 * a page is elsewhere or the data is wrong. */
#include "common.h"
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>

typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_get_t)(int *, int);
typedef int (*cu_ctx_retain_t)(void **, int);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_register_t)(void *, size_t, unsigned);
typedef int (*cu_unregister_t)(void *);

struct slice {
    char *base;
    size_t from, to;
};

static void *touch(void *arg) {
    struct slice *s = arg;
    for (size_t i = s->from; i < s->to; i += 4096) s->base[i] = (char)(i >> 12);
    /* The last page too, when the buffer does not start a page. */
    s->base[s->to - 1] = 0;
    return NULL;
}

static char *allocate(const char *api, size_t size) {
    void *p = NULL;
    if (!strcmp(api, "malloc")) return malloc(size);
    if (!strcmp(api, "calloc")) {
        char *c = calloc(1, size);
        for (size_t i = 0; c && i < size; i += 4096) CHECK(c[i] == 0, "calloc not zero at %zu", i);
        return c;
    }
    if (!strcmp(api, "posix_memalign")) {
        CHECK(posix_memalign(&p, 64, size) == 0, "posix_memalign");
        CHECK((uintptr_t)p % 64 == 0, "posix_memalign alignment");
        return p;
    }
    if (!strcmp(api, "aligned_alloc")) {
        p = aligned_alloc(4096, size);
        CHECK((uintptr_t)p % 4096 == 0, "aligned_alloc alignment");
        return p;
    }
    if (!strcmp(api, "realloc")) {
        /* Grows from glibc's small size across the threshold: the data moves with it. */
        char *small = malloc(1000);
        for (int i = 0; i < 1000; i++) small[i] = (char)i;
        char *grown = realloc(small, size);
        for (int i = 0; grown && i < 1000; i++) CHECK(grown[i] == (char)i, "realloc lost byte %d", i);
        return grown;
    }
    fprintf(stderr, "unknown API %s\n", api);
    exit(2);
}

int main(int argc, char **argv) {
    CHECK(argc == 5, "usage: pinned_shape API LOG2_SIZE THREADS NODE");
    size_t size = (size_t)1 << atoi(argv[2]);
    int threads = atoi(argv[3]), node = atoi(argv[4]);
    char *p = allocate(argv[1], size);
    CHECK(p, "%s of %zu bytes failed", argv[1], size);
    CHECK(malloc_usable_size(p) >= size, "usable size %zu < %zu", malloc_usable_size(p), size);

    pthread_t tid[64];
    struct slice s[64];
    CHECK(threads > 0 && threads <= 64, "1..64 threads");
    for (int t = 0; t < threads; t++) {
        s[t] = (struct slice){p, size / threads * t, size / threads * (t + 1)};
        pthread_create(&tid[t], NULL, touch, &s[t]);
    }
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);

    char policy[64];
    policy_of(p, policy, sizeof policy);
    size_t elsewhere;
    size_t on = pages_on(p, size, node, &elsewhere);
    printf("%s %zu MiB: policy %s, pages on node %d: %zu, elsewhere: %zu\n", argv[1], size >> 20,
           policy, node, on, elsewhere);

    void *cuda = dlopen("libcuda.so", RTLD_NOW);
    if (cuda) {
        cu_init_t init = (cu_init_t)dlsym(cuda, "cuInit");
        cu_device_get_t get = (cu_device_get_t)dlsym(cuda, "cuDeviceGet");
        cu_ctx_retain_t retain = (cu_ctx_retain_t)dlsym(cuda, "cuDevicePrimaryCtxRetain");
        cu_ctx_set_t set = (cu_ctx_set_t)dlsym(cuda, "cuCtxSetCurrent");
        cu_register_t reg = (cu_register_t)dlsym(cuda, "cuMemHostRegister_v2");
        cu_unregister_t unreg = (cu_unregister_t)dlsym(cuda, "cuMemHostUnregister");
        int dev;
        void *ctx;
        CHECK(init(0) == 0 && get(&dev, 0) == 0 && retain(&ctx, dev) == 0 && set(ctx) == 0,
              "driver set-up");
        int r = reg(p, size, 1 /* PORTABLE */);
        printf("register: %d\n", r);
        if (r == 0) CHECK(unreg(p) == 0, "unregister");
    } else {
        printf("register: no driver (%s)\n", dlerror());
    }
    for (size_t i = 0; i < size; i += 4096) CHECK(p[i] == (char)(i >> 12), "byte %zu changed", i);
    free(p);
    printf("ok\n");
    return elsewhere == 0 ? 0 : 1;
}
