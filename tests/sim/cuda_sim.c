/*
 * cuda_sim: a CUDA driver simulator, built by the tests as `libcuda.so` and found the way the
 * real driver is found (the library path), so that tests go through cudarc's real code.
 *
 * What it models, because the crate's safety depends on it:
 *   - Device memory is host memory the simulator owns (CUdeviceptr = its address).
 *   - Copies that touch page-locked host memory (cuMemHostRegister'ed ranges, cuMemHostAlloc)
 *     run on the stream's worker thread after a delay (CUDA_SIM_DELAY_US, default 3000 us): the
 *     call returns at once, as DMA does. The data moves at the END of the delay, so a host that
 *     reads too early sees stale bytes and a host that reuses a source too early sends its new
 *     bytes.
 *   - Copies from or to pageable memory complete before returning (CUDA stages them), after all
 *     earlier work on their stream.
 *   - Streams execute in order; events complete when their stream reaches them;
 *     cuStreamWaitEvent, cuEventSynchronize, cuStreamSynchronize and cuCtxSynchronize really wait.
 *   - Registration tracks ranges: overlapping registration answers 712
 *     (HOST_MEMORY_ALREADY_REGISTERED), unregistering an unknown base 713 (NOT_REGISTERED).
 *   - A virtual clock: every copy takes bytes / bandwidth of simulated time (pinned 25 GB/s,
 *     pageable 10 GB/s; one copy engine per direction); a host that blocks waits in simulated
 *     time too, and cuSimHostWork adds modelled host work. cuSimStats reports the busy time
 *     (copies and host work) and the span, whose ratio is the overlap, independent of the test
 *     machine's speed.
 *   - cuSimHold(1) keeps page-locked copies queued until cuSimHold(0), so that tests decide when
 *     a DMA completes; unregistering or freeing page-locked memory that a queued copy still uses
 *     aborts the process, as it would corrupt memory with a real driver.
 *   - A copy whose host range spans two registrations (or registered and unregistered memory)
 *     fails with CUDA_ERROR_INVALID_VALUE, as the driver's does.
 *   - Registration takes time under the driver's global lock, as the real one's does (its page-table
 *     work): CUDA_SIM_REGISTER_US_PER_GIB microseconds per GiB, spent
 *     holding the lock every other call takes, so copies and queries stall behind a long one.
 *     cuSimStats reports the longest single registration call. A registration or a stream's
 *     wait for an event (cuStreamWaitEvent) after the library's teardown at exit aborts, as
 *     either would touch the real driver's freed state.
 *   - Error injection: cuSimFail("cuMemHostRegister_v2", code, skip, count), or the environment
 *     CUDA_SIM_FAIL=name:code[:skip[:count]] (cuInit included).
 *   - Host-NUMA memory (CUDA 12.2+): cuMemCreate with a HOST_NUMA location makes a memory file
 *     whose pages are placed on the node (mbind, when the kernel allows it) and faulted in at
 *     once, as the driver's are; cuMemAddressReserve reserves an inaccessible range; cuMemMap maps
 *     the file there, still inaccessible; cuMemSetAccess opens it to the host (mprotect: without
 *     a host entry a CPU touch faults, as with the driver) and to the device (without a device
 *     entry a copy fails with CUDA_ERROR_INVALID_VALUE: the real driver's answer is not known
 *     here). A mapped range counts as page-locked: copies from it are asynchronous, and a copy
 *     straddling it and other memory fails as for registrations. Misuse answers an error: a map
 *     outside a reservation or over a mapping, a handle released twice, an address range freed
 *     while still mapped (the simulator's rule), an unmap or access change not covering whole
 *     mappings. Releasing the handle while mapped keeps the memory until the unmap, as CUDA
 *     does. A host-NUMA pool (cuMemPoolCreate) hands out blocks placed the same way, reachable
 *     from the host at once and from the device after cuMemPoolSetAccess; a free
 *     (cuMemFreeAsync) takes effect when its stream reaches it, and keeps the block for reuse up
 *     to the release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, the only attribute modelled);
 *     an allocation is usable at once (its stream order is not modelled). Refusals (no
 *     CAP_SYS_NICE: CUDA_ERROR_NOT_PERMITTED) are injected with CUDA_SIM_FAIL=cuMemCreate:800;
 *     a node without CPUs answers CUDA_ERROR_INVALID_VALUE. cuSimHostNumaStats counts what is
 *     live. Built with -DCUDA_SIM_WITHOUT_HOST_NUMA, the library lacks all of it, as a driver
 *     before CUDA 10.2 does.
 *
 * Environment: CUDA_SIM_DEVICES (default 1), CUDA_SIM_HOST_NUMA_ID (comma list per device,
 * default 0; -1 reports "unknown"), CUDA_SIM_PCI (comma list, default 0000:0N:00.0),
 * CUDA_SIM_DELAY_US, CUDA_SIM_REGISTER_US_PER_GIB, CUDA_SIM_TEARDOWN_US, CUDA_SIM_INIT_US (how long
 * the first cuInit takes), CUDA_SIM_LOCK_FILE (a lock file every registration must be made under:
 * cuSimLockStats counts those made while no process held its flock, and the unregistrations of
 * ranges already unmapped).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef unsigned int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct sim_ctx *CUcontext;
typedef struct sim_stream *CUstream;
typedef struct sim_event *CUevent;

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_READY = 600,
    ALREADY_REGISTERED = 712,
    NOT_REGISTERED = 713,
    NOT_SUPPORTED = 801,
};

#define MAX_DEVICES 8
#define MAX_RANGES 4096
#define PINNED_BYTES_PER_US 25000.0 /* 25 GB/s */
#define PAGEABLE_BYTES_PER_US 10000.0

/* ---------------------------------------------------------------- global state */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
/* Set when the library is unloaded at exit, as the driver tears down its state then: a
 * registration or a stream's wait for an event after it would touch freed driver state, so the
 * simulator aborts. */
static int torn_down;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int initialised;
static int device_count = 1;
static int numa_ids[MAX_DEVICES];
static char pci_ids[MAX_DEVICES][32];
static unsigned delay_us = 3000;
/* Real time a registration takes per GiB, under the global lock (CUDA_SIM_REGISTER_US_PER_GIB). */
static unsigned long long register_us_per_gib;
/* Microseconds the first cuInit takes (CUDA_SIM_INIT_US), outside the lock: loading and
 * initialising the real driver takes hundreds of milliseconds. */
static unsigned long long init_us;
static int held; /* cuSimHold: page-locked copies wait until released */

struct sim_ctx {
    int device;
    int retained;
};
static struct sim_ctx contexts[MAX_DEVICES];

static __thread CUcontext current;
static __thread CUcontext pushed[16];
static __thread int pushed_depth;
static __thread unsigned capture_mode;

/* Page-locked host ranges: registered, from cuMemHostAlloc, host-NUMA mappings and pool blocks. */
enum range_kind { RANGE_REGISTERED, RANGE_HOST_ALLOC, RANGE_MAPPED, RANGE_POOL };
struct range {
    uintptr_t base;
    size_t len;
    enum range_kind kind;
    const int *device_access; /* host-NUMA memory: whether the device may use it (else NULL) */
};
static struct range ranges[MAX_RANGES];
static int range_count;

/* Virtual clock, in microseconds of simulated time. */
static double host_vtime;
static double engine_vtime[2]; /* 0: host to device, 1: device to host (and device to device) */
static double busy_vtime, clock_start, last_end, host_work_vtime;
static unsigned long long async_copies, sync_copies;

/* ---------------------------------------------------------------- error injection */

struct fault {
    char name[64];
    CUresult code;
    unsigned skip, count;
};
static struct fault faults[16];
static int fault_count;

/* Adds a fault: the call `name` fails with `code` after `skip` good calls, `count` times. */
void cuSimFail(const char *name, CUresult code, unsigned skip, unsigned count) {
    pthread_mutex_lock(&lock);
    if (fault_count < 16) {
        struct fault *f = &faults[fault_count++];
        snprintf(f->name, sizeof f->name, "%s", name);
        f->code = code;
        f->skip = skip;
        f->count = count;
    }
    pthread_mutex_unlock(&lock);
}

static CUresult injected_locked(const char *name) {
    for (int i = 0; i < fault_count; i++) {
        struct fault *f = &faults[i];
        if (f->count == 0 || strcmp(f->name, name) != 0) continue;
        if (f->skip > 0) {
            f->skip--;
            continue;
        }
        f->count--;
        return f->code;
    }
    return SUCCESS;
}

static CUresult injected(const char *name) {
    pthread_mutex_lock(&lock);
    CUresult r = injected_locked(name);
    pthread_mutex_unlock(&lock);
    return r;
}

#define INJECT(name)                          \
    do {                                      \
        CUresult injected_ = injected(name);  \
        if (injected_ != SUCCESS) return injected_; \
    } while (0)

/* ---------------------------------------------------------------- streams and events */

enum op_kind { OP_COPY, OP_SET, OP_RECORD, OP_WAIT, OP_POOL_FREE };

struct op {
    enum op_kind kind;
    void *dst;
    const void *src;
    size_t len;
    unsigned char value;
    int delayed;
    CUevent event;
    unsigned long long generation;
    struct op *next;
};

struct sim_stream {
    struct op *head, *tail;
    unsigned long long enqueued, completed;
    double vtime;
    int destroyed;
    pthread_t worker;
};

struct sim_event {
    unsigned long long recorded, completed; /* generations */
    double vtime;
    int destroyed;
    struct sim_event *next_created; /* every event stays reachable: queued work may name it */
};
static struct sim_event *events_created;

/* Every stream created and not finished: destroyed ones stay until their worker drained them. */
static struct sim_stream *streams[1024];
static int stream_count;

static struct sim_stream null_stream;
static int null_stream_started;

static void sleep_us(unsigned long long us) {
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

#ifndef CUDA_SIM_WITHOUT_HOST_NUMA
static void pool_free_locked(void *block);
#endif

static void *worker_main(void *arg) {
    struct sim_stream *s = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!s->head && !s->destroyed) pthread_cond_wait(&changed, &lock);
        if (!s->head) break; /* destroyed and drained */
        struct op *op = s->head;
        if (op->kind == OP_WAIT) {
            while (op->event->completed < op->generation) pthread_cond_wait(&changed, &lock);
        } else if (op->kind == OP_RECORD) {
            if (op->event->completed < op->generation) op->event->completed = op->generation;
#ifndef CUDA_SIM_WITHOUT_HOST_NUMA
        } else if (op->kind == OP_POOL_FREE) {
            pool_free_locked(op->dst);
#endif
        } else {
            while (held && op->delayed) pthread_cond_wait(&changed, &lock);
            pthread_mutex_unlock(&lock);
            if (op->delayed) sleep_us(delay_us);
            if (op->kind == OP_COPY)
                memcpy(op->dst, op->src, op->len);
            else
                memset(op->dst, op->value, op->len);
            pthread_mutex_lock(&lock);
        }
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        s->completed++;
        free(op);
        pthread_cond_broadcast(&changed);
    }
    if (s != &null_stream) {
        for (int i = 0; i < stream_count; i++) {
            if (streams[i] == s) {
                streams[i] = streams[--stream_count];
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    if (s != &null_stream) free(s);
    return NULL;
}

/* The stream a handle names: NULL and the per-thread handle (0x2) are the null stream. */
static struct sim_stream *stream_of(CUstream h) {
    if (h && (uintptr_t)h != 0x1 && (uintptr_t)h != 0x2) return h;
    if (!null_stream_started) {
        null_stream_started = 1;
        pthread_create(&null_stream.worker, NULL, worker_main, &null_stream);
        pthread_detach(null_stream.worker);
    }
    return &null_stream;
}

static void enqueue_locked(struct sim_stream *s, struct op *op) {
    op->next = NULL;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->enqueued++;
    pthread_cond_broadcast(&changed);
}

static void drain_locked(struct sim_stream *s) {
    unsigned long long target = s->enqueued;
    while (s->completed < target) pthread_cond_wait(&changed, &lock);
    if (host_vtime < s->vtime) host_vtime = s->vtime;
}

static int pinned_locked(const void *p, size_t len) {
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < range_count; i++)
        if (a < ranges[i].base + ranges[i].len && ranges[i].base < a + len) return 1;
    return 0;
}

/* Whether `p`..`p+len` touches page-locked memory without lying inside one registered range:
 * it spans two registrations, or registered and unregistered memory. The driver refuses such a
 * copy with CUDA_ERROR_INVALID_VALUE (the documentation of cuMemcpy*). */
static int straddles_locked(const void *p, size_t len) {
    uintptr_t a = (uintptr_t)p;
    int overlaps = 0;
    for (int i = 0; i < range_count; i++) {
        if (a >= ranges[i].base && a + len <= ranges[i].base + ranges[i].len) return 0;
        if (a < ranges[i].base + ranges[i].len && ranges[i].base < a + len) overlaps++;
    }
    return overlaps > 0;
}

/* Whether `p`..`p+len` lies in host-NUMA memory the device was not given access to. */
static int device_refused_locked(const void *p, size_t len) {
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < range_count; i++)
        if (a >= ranges[i].base && a + len <= ranges[i].base + ranges[i].len)
            return ranges[i].device_access && !*ranges[i].device_access;
    return 0;
}

/* Simulated duration of a copy, and its place on the virtual timeline. */
static void account_copy_locked(struct sim_stream *s, size_t len, int engine, int pinned) {
    double duration = (double)len / (pinned ? PINNED_BYTES_PER_US : PAGEABLE_BYTES_PER_US);
    double start = s->vtime;
    if (start < host_vtime) start = host_vtime;
    if (start < engine_vtime[engine]) start = engine_vtime[engine];
    double end = start + duration;
    s->vtime = engine_vtime[engine] = end;
    busy_vtime += duration;
    if (end > last_end) last_end = end;
    if (pinned)
        async_copies++;
    else {
        sync_copies++;
        host_vtime = end;
    }
}

/* A copy on stream `h`: asynchronous when `host` (len bytes) is page-locked, else complete on
 * return after the stream's earlier work. */
static CUresult copy(void *dst, const void *src, size_t len, const void *host, int engine,
                     CUstream h) {
    if (len == 0) return SUCCESS;
    if (!dst || !src) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (host && (straddles_locked(host, len) || device_refused_locked(host, len))) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    struct sim_stream *s = stream_of(h);
    int is_async = host == NULL || pinned_locked(host, len);
    account_copy_locked(s, len, engine, is_async);
    if (is_async) {
        struct op *op = calloc(1, sizeof *op);
        if (!op) {
            pthread_mutex_unlock(&lock);
            return OUT_OF_MEMORY;
        }
        op->kind = OP_COPY;
        op->dst = dst;
        op->src = src;
        op->len = len;
        op->delayed = 1;
        enqueue_locked(s, op);
        pthread_mutex_unlock(&lock);
        return SUCCESS;
    }
    drain_locked(s);
    pthread_mutex_unlock(&lock);
    memcpy(dst, src, len);
    return SUCCESS;
}

/* ---------------------------------------------------------------- initialisation and devices */

static void read_environment(void) {
    const char *v = getenv("CUDA_SIM_DEVICES");
    if (v) device_count = atoi(v);
    if (device_count < 0) device_count = 0;
    if (device_count > MAX_DEVICES) device_count = MAX_DEVICES;
    const char *numa = getenv("CUDA_SIM_HOST_NUMA_ID");
    const char *pci = getenv("CUDA_SIM_PCI");
    for (int d = 0; d < MAX_DEVICES; d++) {
        numa_ids[d] = 0;
        snprintf(pci_ids[d], sizeof pci_ids[d], "0000:%02x:00.0", d + 1);
        contexts[d].device = d;
    }
    for (int d = 0; numa && *numa && d < MAX_DEVICES; d++) {
        numa_ids[d] = atoi(numa);
        numa = strchr(numa, ',');
        if (numa) numa++;
    }
    for (int d = 0; pci && *pci && d < MAX_DEVICES; d++) {
        size_t n = strcspn(pci, ",");
        snprintf(pci_ids[d], sizeof pci_ids[d], "%.*s", (int)n, pci);
        pci += n + (pci[n] == ',');
    }
    v = getenv("CUDA_SIM_DELAY_US");
    if (v) delay_us = (unsigned)atoi(v);
    v = getenv("CUDA_SIM_REGISTER_US_PER_GIB");
    if (v) register_us_per_gib = strtoull(v, NULL, 10);
    v = getenv("CUDA_SIM_INIT_US");
    if (v) init_us = strtoull(v, NULL, 10);
    const char *fail = getenv("CUDA_SIM_FAIL");
    if (fail) {
        char name[64];
        unsigned code = 0, skip = 0, count = 1;
        if (sscanf(fail, "%63[^:]:%u:%u:%u", name, &code, &skip, &count) >= 2)
            cuSimFail(name, code, skip, count);
    }
}

CUresult cuInit(unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (!initialised) {
        pthread_mutex_unlock(&lock);
        read_environment();
        sleep_us(init_us);
        pthread_mutex_lock(&lock);
    }
    CUresult r = injected_locked("cuInit");
    if (r == SUCCESS) initialised = 1;
    pthread_mutex_unlock(&lock);
    return r;
}

#define REQUIRE_INIT() \
    do {               \
        if (!initialised) return NOT_INITIALIZED; \
    } while (0)

static int valid_device(CUdevice d) { return d >= 0 && d < device_count; }

CUresult cuDeviceGetCount(int *count) {
    REQUIRE_INIT();
    if (!count) return INVALID_VALUE;
    *count = device_count;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    REQUIRE_INIT();
    if (!device) return INVALID_VALUE;
    if (!valid_device(ordinal)) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d) {
    REQUIRE_INIT();
    if (!value) return INVALID_VALUE;
    if (!valid_device(d)) return INVALID_DEVICE;
    switch (attribute) {
    case 134: *value = numa_ids[d]; break;      /* HOST_NUMA_ID */
    case 113: *value = 1; break;                /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    case 19: *value = 1; break;                 /* CAN_MAP_HOST_MEMORY */
    case 75: *value = 9; break;                 /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;                 /* COMPUTE_CAPABILITY_MINOR */
    default: *value = 0; break;                 /* memory pools and the rest: unsupported */
    }
    return SUCCESS;
}

static CUresult copy_text(char *buf, int len, const char *text) {
    if (!buf || len <= 0) return INVALID_VALUE;
    snprintf(buf, (size_t)len, "%s", text);
    return SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    REQUIRE_INIT();
    if (!valid_device(d)) return INVALID_DEVICE;
    char text[32];
    snprintf(text, sizeof text, "cuda-sim device %d", d);
    return copy_text(name, len, text);
}

CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice d) {
    REQUIRE_INIT();
    if (!valid_device(d)) return INVALID_DEVICE;
    return copy_text(id, len, pci_ids[d]);
}

CUresult cuDeviceGetUuid(unsigned char uuid[16], CUdevice d) {
    REQUIRE_INIT();
    if (!uuid) return INVALID_VALUE;
    if (!valid_device(d)) return INVALID_DEVICE;
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0x50 + i + 16 * d);
    return SUCCESS;
}

CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice d) { return cuDeviceGetUuid(uuid, d); }

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    REQUIRE_INIT();
    if (!bytes) return INVALID_VALUE;
    if (!valid_device(d)) return INVALID_DEVICE;
    *bytes = (size_t)80 << 30;
    return SUCCESS;
}

static const struct {
    CUresult code;
    const char *name;
} error_names[] = {
    {SUCCESS, "CUDA_SUCCESS"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
    {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {100, "CUDA_ERROR_NO_DEVICE"},
    {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
    {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
    {NOT_READY, "CUDA_ERROR_NOT_READY"},
    {ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
    {NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
    {800, "CUDA_ERROR_NOT_PERMITTED"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY"},
    {999, "CUDA_ERROR_UNKNOWN"},
};

CUresult cuGetErrorName(CUresult code, const char **name) {
    if (!name) return INVALID_VALUE;
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++) {
        if (error_names[i].code == code) {
            *name = error_names[i].name;
            return SUCCESS;
        }
    }
    *name = NULL;
    return INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult code, const char **text) { return cuGetErrorName(code, text); }

/* ---------------------------------------------------------------- contexts */

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
    REQUIRE_INIT();
    INJECT("cuDevicePrimaryCtxRetain");
    if (!ctx) return INVALID_VALUE;
    if (!valid_device(d)) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    contexts[d].retained++;
    pthread_mutex_unlock(&lock);
    *ctx = &contexts[d];
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    REQUIRE_INIT();
    if (!valid_device(d)) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    CUresult r = contexts[d].retained > 0 ? SUCCESS : INVALID_CONTEXT;
    if (r == SUCCESS) contexts[d].retained--;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    REQUIRE_INIT();
    current = ctx;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    REQUIRE_INIT();
    if (!ctx) return INVALID_VALUE;
    *ctx = current;
    return SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    REQUIRE_INIT();
    if (!device) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    *device = current->device;
    return SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    REQUIRE_INIT();
    if (!ctx) return INVALID_CONTEXT;
    if (pushed_depth == 16) return INVALID_VALUE;
    pushed[pushed_depth++] = current;
    current = ctx;
    return SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    REQUIRE_INIT();
    if (pushed_depth == 0 || !current) return INVALID_CONTEXT;
    if (ctx) *ctx = current;
    current = pushed[--pushed_depth];
    return SUCCESS;
}

CUresult cuThreadExchangeStreamCaptureMode(unsigned *mode) {
    REQUIRE_INIT();
    if (!mode) return INVALID_VALUE;
    unsigned old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return SUCCESS;
}

/* Waits for every stream. */
CUresult cuCtxSynchronize(void) {
    REQUIRE_INIT();
    if (!current) return INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    drain_locked(stream_of(NULL));
    for (int i = 0; i < stream_count; i++) drain_locked(streams[i]);
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

/* ---------------------------------------------------------------- streams */

CUresult cuStreamCreate(CUstream *stream, unsigned flags) {
    (void)flags;
    REQUIRE_INIT();
    if (!stream) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    struct sim_stream *s = calloc(1, sizeof *s);
    if (!s) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    if (stream_count == 1024) {
        pthread_mutex_unlock(&lock);
        free(s);
        return OUT_OF_MEMORY;
    }
    s->vtime = host_vtime;
    streams[stream_count++] = s;
    pthread_create(&s->worker, NULL, worker_main, s);
    pthread_detach(s->worker);
    pthread_mutex_unlock(&lock);
    *stream = s;
    return SUCCESS;
}

CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned flags, int priority) {
    (void)priority;
    return cuStreamCreate(stream, flags);
}

CUresult cuStreamDestroy_v2(CUstream h) {
    REQUIRE_INIT();
    if (!h) return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int found = 0;
    for (int i = 0; i < stream_count; i++)
        found |= streams[i] == h && !h->destroyed;
    if (found) {
        /* Like CUDA: returns at once; the worker finishes the queued work, then frees it. */
        h->destroyed = 1;
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&lock);
    return found ? SUCCESS : INVALID_HANDLE;
}

CUresult cuStreamSynchronize(CUstream h) {
    REQUIRE_INIT();
    pthread_mutex_lock(&lock);
    drain_locked(stream_of(h));
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuStreamQuery(CUstream h) {
    REQUIRE_INIT();
    pthread_mutex_lock(&lock);
    struct sim_stream *s = stream_of(h);
    CUresult r = s->completed == s->enqueued ? SUCCESS : NOT_READY;
    pthread_mutex_unlock(&lock);
    return r;
}

/* ---------------------------------------------------------------- events */

CUresult cuEventCreate(CUevent *event, unsigned flags) {
    (void)flags;
    REQUIRE_INIT();
    INJECT("cuEventCreate");
    if (!event) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    struct sim_event *e = calloc(1, sizeof *e);
    if (!e) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    e->next_created = events_created;
    events_created = e;
    pthread_mutex_unlock(&lock);
    *event = e;
    return SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e) {
    REQUIRE_INIT();
    if (!e) return INVALID_HANDLE;
    /* Queued operations may still name the event: keep its memory (a few bytes per event). */
    pthread_mutex_lock(&lock);
    e->destroyed = 1;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream h) {
    REQUIRE_INIT();
    INJECT("cuEventRecord");
    if (!e || e->destroyed) return INVALID_HANDLE;
    struct op *op = calloc(1, sizeof *op);
    if (!op) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct sim_stream *s = stream_of(h);
    op->kind = OP_RECORD;
    op->event = e;
    op->generation = ++e->recorded;
    e->vtime = s->vtime;
    enqueue_locked(s, op);
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuEventQuery(CUevent e) {
    REQUIRE_INIT();
    INJECT("cuEventQuery");
    if (!e || e->destroyed) return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    CUresult r = e->completed >= e->recorded ? SUCCESS : NOT_READY;
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventSynchronize(CUevent e) {
    REQUIRE_INIT();
    if (!e || e->destroyed) return INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    unsigned long long target = e->recorded;
    while (e->completed < target) pthread_cond_wait(&changed, &lock);
    if (host_vtime < e->vtime) host_vtime = e->vtime;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned flags) {
    (void)flags;
    REQUIRE_INIT();
    if (!e || e->destroyed) return INVALID_HANDLE;
    struct op *op = calloc(1, sizeof *op);
    if (!op) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    if (torn_down) {
        fprintf(stderr, "cuda_sim: cuStreamWaitEvent after the driver was torn down at exit\n");
        abort();
    }
    struct sim_stream *s = stream_of(h);
    op->kind = OP_WAIT;
    op->event = e;
    op->generation = e->recorded;
    if (s->vtime < e->vtime) s->vtime = e->vtime;
    enqueue_locked(s, op);
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    REQUIRE_INIT();
    if (!ms || !start || !end) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *ms = (float)((end->vtime - start->vtime) / 1000.0);
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

/* ---------------------------------------------------------------- device memory and copies */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    REQUIRE_INIT();
    INJECT("cuMemAlloc_v2");
    if (!dptr || size == 0) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    void *p = malloc(size);
    if (!p) return OUT_OF_MEMORY;
    memset(p, 0xA5, size); /* device memory starts as garbage, not zeros */
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    REQUIRE_INIT();
    free((void *)(uintptr_t)dptr);
    return SUCCESS;
}

CUresult cuMemsetD8Async(CUdeviceptr dptr, unsigned char value, size_t n, CUstream h) {
    REQUIRE_INIT();
    if (n == 0) return SUCCESS;
    struct op *op = calloc(1, sizeof *op);
    if (!op) return OUT_OF_MEMORY;
    op->kind = OP_SET;
    op->dst = (void *)(uintptr_t)dptr;
    op->len = n;
    op->value = value;
    pthread_mutex_lock(&lock);
    enqueue_locked(stream_of(h), op);
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) {
    REQUIRE_INIT();
    INJECT("cuMemcpyHtoDAsync_v2");
    return copy((void *)(uintptr_t)dst, src, n, src, 0, h);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) {
    REQUIRE_INIT();
    INJECT("cuMemcpyDtoHAsync_v2");
    return copy(dst, (const void *)(uintptr_t)src, n, dst, 1, h);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    REQUIRE_INIT();
    return copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, NULL, 1, h);
}

/* ---------------------------------------------------------------- page-locked host memory */

static CUresult add_range_locked(void *p, size_t len, enum range_kind kind,
                                 const int *device_access) {
    if (pinned_locked(p, len)) return ALREADY_REGISTERED;
    if (range_count == MAX_RANGES) return OUT_OF_MEMORY;
    ranges[range_count++] = (struct range){(uintptr_t)p, len, kind, device_access};
    return SUCCESS;
}

/* A real driver cannot take back memory a queued DMA still uses: the simulator stops the process,
 * so that a test catches an allocator that unregisters or frees such a block. */
static int queued_use(const struct sim_stream *s, uintptr_t base, size_t len) {
    for (const struct op *op = s->head; op; op = op->next) {
        if (op->kind != OP_COPY && op->kind != OP_SET) continue;
        uintptr_t a = (uintptr_t)op->dst, b = (uintptr_t)op->src;
        if ((a < base + len && base < a + op->len) || (b && b < base + len && base < b + op->len))
            return 1;
    }
    return 0;
}

static void refuse_if_in_use_locked(const char *call, int i) {
    int used = null_stream_started && queued_use(&null_stream, ranges[i].base, ranges[i].len);
    for (int k = 0; k < stream_count && !used; k++)
        used = queued_use(streams[k], ranges[i].base, ranges[i].len);
    if (used) {
        fprintf(stderr, "cuda_sim: %s(%p) while a queued copy still uses the range\n", call,
                (void *)ranges[i].base);
        abort();
    }
}

static int find_range_locked(void *p, enum range_kind kind) {
    for (int i = 0; i < range_count; i++)
        if (ranges[i].base == (uintptr_t)p && ranges[i].kind == kind) return i;
    return -1;
}

/* Successful cuMemHostRegister_v2 calls since the start, the longest range one covered and the
 * longest time one took (microseconds, real time). */
static unsigned long long registrations, largest_registration, longest_registration_us;
/* With CUDA_SIM_LOCK_FILE set: registrations made while no process held that file's flock, and
 * unregistrations of ranges already unmapped (first page), of all unregistrations. */
static unsigned long long unlocked_registrations, unmapped_unregistrations, unregistrations;

/* Whether some open file holds the lock file's flock (a fresh open of ours cannot take it). */
static int lock_file_held(void) {
    const char *path = getenv("CUDA_SIM_LOCK_FILE");
    if (!path) return 1;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return 0;
    int held_by_other = flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (!held_by_other) flock(fd, LOCK_UN);
    close(fd);
    return held_by_other;
}

/* Whether the page at p is mapped (mincore answers ENOMEM for an unmapped one). */
static int page_mapped(void *p) {
    long ps = sysconf(_SC_PAGESIZE);
    unsigned char vec;
    void *page = (void *)((uintptr_t)p & ~(uintptr_t)(ps - 1));
    return mincore(page, (size_t)ps, &vec) == 0 || errno != ENOMEM;
}

static unsigned long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000ull + (unsigned long long)t.tv_nsec / 1000;
}


__attribute__((destructor)) static void tear_down(void) {
    pthread_mutex_lock(&lock);
    torn_down = 1;
    pthread_mutex_unlock(&lock);
    /* The teardown takes time (CUDA_SIM_TEARDOWN_US): other threads still run meanwhile. */
    const char *v = getenv("CUDA_SIM_TEARDOWN_US");
    sleep_us(v ? strtoull(v, NULL, 10) : 0);
}

CUresult cuMemHostRegister_v2(void *p, size_t len, unsigned flags) {
    (void)flags;
    REQUIRE_INIT();
    INJECT("cuMemHostRegister_v2");
    if (!p || len == 0) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    unsigned long long start = now_us();
    pthread_mutex_lock(&lock);
    if (torn_down) {
        fprintf(stderr, "cuda_sim: cuMemHostRegister_v2 after the driver was torn down at exit\n");
        abort();
    }
    CUresult r = add_range_locked(p, len, RANGE_REGISTERED, NULL);
    if (r == SUCCESS) {
        registrations++;
        if (!lock_file_held()) unlocked_registrations++;
        if (len > largest_registration) largest_registration = len;
        /* The page-table work, holding the lock as the driver does. */
        sleep_us((unsigned long long)((double)register_us_per_gib * (double)len /
                                      (double)(1ull << 30)));
        unsigned long long took = now_us() - start;
        if (took > longest_registration_us) longest_registration_us = took;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemHostUnregister(void *p) {
    REQUIRE_INIT();
    INJECT("cuMemHostUnregister");
    pthread_mutex_lock(&lock);
    int i = find_range_locked(p, RANGE_REGISTERED);
    if (i >= 0) {
        unregistrations++;
        if (!page_mapped(p)) unmapped_unregistrations++;
        refuse_if_in_use_locked("cuMemHostUnregister", i);
        ranges[i] = ranges[--range_count];
    }
    pthread_mutex_unlock(&lock);
    return i >= 0 ? SUCCESS : NOT_REGISTERED;
}

CUresult cuMemHostAlloc(void **pp, size_t len, unsigned flags) {
    (void)flags;
    REQUIRE_INIT();
    INJECT("cuMemHostAlloc");
    if (!pp || len == 0) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    void *p = NULL;
    if (posix_memalign(&p, 4096, len) != 0) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    CUresult r = add_range_locked(p, len, RANGE_HOST_ALLOC, NULL);
    pthread_mutex_unlock(&lock);
    if (r != SUCCESS) {
        free(p);
        return r;
    }
    *pp = p;
    return SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    REQUIRE_INIT();
    pthread_mutex_lock(&lock);
    int i = find_range_locked(p, RANGE_HOST_ALLOC);
    if (i >= 0) {
        refuse_if_in_use_locked("cuMemFreeHost", i);
        ranges[i] = ranges[--range_count];
    }
    pthread_mutex_unlock(&lock);
    if (i < 0) return INVALID_VALUE;
    free(p);
    return SUCCESS;
}

/* ---------------------------------------------------------------- host-NUMA memory */
#ifndef CUDA_SIM_WITHOUT_HOST_NUMA

typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct sim_pool *CUmemoryPool;

/* The driver's structs, as cuda.h lays them out. */
struct mem_location {
    unsigned type;
    int id;
};
struct mem_allocation_prop {
    unsigned type;
    unsigned requested_handle_types;
    struct mem_location location;
    void *win32_handle_meta_data;
    unsigned char alloc_flags[8];
};
struct mem_access_desc {
    struct mem_location location;
    unsigned flags;
};
struct mem_pool_props {
    unsigned alloc_type;
    unsigned handle_types;
    struct mem_location location;
    void *win32_security_attributes;
    size_t max_size;
    unsigned char reserved[56];
};

enum {
    LOCATION_DEVICE = 1,
    LOCATION_HOST = 2,
    LOCATION_HOST_NUMA = 3,
    LOCATION_HOST_NUMA_CURRENT = 4,
    ALLOCATION_PINNED = 1,
    ACCESS_NONE = 0,
    ACCESS_READ = 1,
    ACCESS_READWRITE = 3,
    POOL_ATTR_RELEASE_THRESHOLD = 4,
};

#define GRANULARITY ((size_t)2 << 20)
#define MAX_HOST_NUMA 1024
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define MPOL_BIND_ 2

/* cuMemCreate's memory: a memory file whose pages were placed and faulted in when created. */
struct phys {
    int fd;
    size_t len;
    int released; /* cuMemRelease was called: freed with the last unmap */
    int mappings;
};
struct reservation {
    uintptr_t base;
    size_t len;
};
struct mapping {
    uintptr_t base;
    size_t len;
    struct phys *phys;
    int device_access;
};
static struct phys *physs[MAX_HOST_NUMA];
static int phys_count;
static struct reservation reservations[MAX_HOST_NUMA];
static int reservation_count;
static struct mapping *mappings[MAX_HOST_NUMA];
static int mapping_count;

/* Whether host node `id` exists and has CPUs (the driver rejects CPU-less nodes, nccl #2190);
 * a kernel without NUMA has node 0 only. */
static int node_usable(int id) {
    if (id < 0) return 0;
    if (access("/sys/devices/system/node", F_OK) != 0) return id == 0;
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d/cpulist", id);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int c = fgetc(f);
    fclose(f);
    return c != EOF && c != '\n';
}

/* The answer for a memory location of a physical allocation or pool. */
static CUresult check_location(const struct mem_location *l) {
    switch (l->type) {
    case LOCATION_HOST_NUMA: return node_usable(l->id) ? SUCCESS : INVALID_VALUE;
    case LOCATION_DEVICE: return NOT_SUPPORTED; /* the simulator models host memory only */
    default: return INVALID_VALUE; /* HOST_NUMA_CURRENT included: rejected for these */
    }
}

/* Binds `p`..`p+len` to `node` when the kernel allows it (no CAP_SYS_NICE in a container: the
 * pages land anywhere), then faults every page in, as the driver's pinned memory is. */
static CUresult place_and_populate(void *p, size_t len, int node) {
    unsigned long mask[16] = {0};
    if (node < (int)(sizeof mask * 8)) {
        mask[node / 64] = 1ul << (node % 64);
        (void)syscall(SYS_mbind, p, len, MPOL_BIND_, mask, sizeof mask * 8 + 1, 0);
    }
    if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return SUCCESS;
    if (errno == ENOMEM) return OUT_OF_MEMORY;
    for (size_t off = 0; off < len; off += 4096) ((volatile char *)p)[off] = 0;
    return SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const struct mem_allocation_prop *prop,
                                       unsigned option) {
    REQUIRE_INIT();
    if (!granularity || !prop || option > 1 || prop->type != ALLOCATION_PINNED)
        return INVALID_VALUE;
    *granularity = GRANULARITY;
    return SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const struct mem_allocation_prop *prop, unsigned long long flags) {
    REQUIRE_INIT();
    INJECT("cuMemCreate");
    if (!handle || !prop || flags != 0 || prop->type != ALLOCATION_PINNED) return INVALID_VALUE;
    if (size == 0 || size % GRANULARITY != 0) return INVALID_VALUE;
    if (!current) return INVALID_CONTEXT;
    if (prop->requested_handle_types != 0) return NOT_SUPPORTED;
    CUresult r = check_location(&prop->location);
    if (r != SUCCESS) return r;
    struct phys *ph = calloc(1, sizeof *ph);
    if (!ph) return OUT_OF_MEMORY;
    ph->len = size;
    ph->fd = memfd_create("cuda_sim_host_numa", MFD_CLOEXEC);
    void *p = MAP_FAILED;
    if (ph->fd >= 0 && ftruncate(ph->fd, (off_t)size) == 0)
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, ph->fd, 0);
    r = p == MAP_FAILED ? OUT_OF_MEMORY : place_and_populate(p, size, prop->location.id);
    if (p != MAP_FAILED) munmap(p, size);
    pthread_mutex_lock(&lock);
    if (r == SUCCESS && phys_count == MAX_HOST_NUMA) r = OUT_OF_MEMORY;
    if (r == SUCCESS) physs[phys_count++] = ph;
    pthread_mutex_unlock(&lock);
    if (r != SUCCESS) {
        if (ph->fd >= 0) close(ph->fd);
        free(ph);
        return r;
    }
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)ph;
    return SUCCESS;
}

static int find_phys_locked(CUmemGenericAllocationHandle handle) {
    for (int i = 0; i < phys_count; i++)
        if ((CUmemGenericAllocationHandle)(uintptr_t)physs[i] == handle) return i;
    return -1;
}

/* Frees physical memory that is released and no longer mapped. */
static void drop_phys_if_done_locked(struct phys *ph) {
    if (!ph->released || ph->mappings > 0) return;
    for (int i = 0; i < phys_count; i++)
        if (physs[i] == ph) physs[i] = physs[--phys_count];
    close(ph->fd);
    free(ph);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    REQUIRE_INIT();
    pthread_mutex_lock(&lock);
    int i = find_phys_locked(handle);
    CUresult r = i < 0 || physs[i]->released ? INVALID_VALUE : SUCCESS;
    if (r == SUCCESS) {
        physs[i]->released = 1;
        drop_phys_if_done_locked(physs[i]);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Address hints (`addr`) are not followed: the kernel picks the range. */
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    (void)addr;
    REQUIRE_INIT();
    if (!ptr || size == 0 || size % GRANULARITY != 0 || flags != 0) return INVALID_VALUE;
    if (alignment & (alignment - 1)) return INVALID_VALUE;
    if (alignment < GRANULARITY) alignment = GRANULARITY;
    size_t span = size + alignment;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    char *base = (char *)(((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1));
    if (base > p) munmap(p, (size_t)(base - p));
    if (base + size < p + span) munmap(base + size, (size_t)(p + span - (base + size)));
    pthread_mutex_lock(&lock);
    CUresult r = reservation_count == MAX_HOST_NUMA ? OUT_OF_MEMORY : SUCCESS;
    if (r == SUCCESS) reservations[reservation_count++] = (struct reservation){(uintptr_t)base, size};
    pthread_mutex_unlock(&lock);
    if (r != SUCCESS) {
        munmap(base, size);
        return r;
    }
    *ptr = (CUdeviceptr)(uintptr_t)base;
    return SUCCESS;
}

/* Mappings overlapping `a`..`a+len`; -1 unless they cover it exactly, each wholly inside. */
static int covering_locked(uintptr_t a, size_t len) {
    size_t covered = 0;
    int n = 0;
    for (int i = 0; i < mapping_count; i++) {
        const struct mapping *m = mappings[i];
        if (m->base >= a + len || a >= m->base + m->len) continue;
        if (m->base < a || m->base + m->len > a + len) return -1;
        covered += m->len;
        n++;
    }
    return n > 0 && covered == len ? n : -1;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    REQUIRE_INIT();
    pthread_mutex_lock(&lock);
    int found = -1;
    for (int i = 0; i < reservation_count; i++)
        if (reservations[i].base == (uintptr_t)ptr && reservations[i].len == size) found = i;
    int mapped = 0;
    for (int i = 0; i < mapping_count; i++)
        mapped |= mappings[i]->base >= (uintptr_t)ptr && mappings[i]->base < (uintptr_t)ptr + size;
    CUresult r = found < 0 || mapped ? INVALID_VALUE : SUCCESS;
    if (r == SUCCESS) {
        reservations[found] = reservations[--reservation_count];
        munmap((void *)(uintptr_t)ptr, size);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    REQUIRE_INIT();
    uintptr_t a = (uintptr_t)ptr;
    if (flags != 0 || size == 0 || size % GRANULARITY || offset % GRANULARITY || a % GRANULARITY)
        return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult r = SUCCESS;
    int i = find_phys_locked(handle);
    struct phys *ph = i >= 0 && !physs[i]->released ? physs[i] : NULL;
    int reserved = 0;
    for (int k = 0; k < reservation_count; k++)
        reserved |= a >= reservations[k].base &&
                    a + size <= reservations[k].base + reservations[k].len;
    int overlaps = 0;
    for (int k = 0; k < mapping_count; k++)
        overlaps |= mappings[k]->base < a + size && a < mappings[k]->base + mappings[k]->len;
    struct mapping *m = NULL;
    if (!ph)
        r = INVALID_HANDLE;
    else if (!reserved || overlaps || offset + size > ph->len)
        r = INVALID_VALUE;
    else if (mapping_count == MAX_HOST_NUMA || !(m = calloc(1, sizeof *m)))
        r = OUT_OF_MEMORY;
    else if (mmap((void *)a, size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, (off_t)offset) ==
             MAP_FAILED)
        r = OUT_OF_MEMORY;
    if (r == SUCCESS) {
        *m = (struct mapping){a, size, ph, 0};
        r = add_range_locked((void *)a, size, RANGE_MAPPED, &m->device_access);
    }
    if (r == SUCCESS) {
        mappings[mapping_count++] = m;
        ph->mappings++;
    } else if (m) {
        free(m);
        /* Mapped but not recorded: back to reserved address space. */
        mmap((void *)a, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
             -1, 0);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    REQUIRE_INIT();
    uintptr_t a = (uintptr_t)ptr;
    pthread_mutex_lock(&lock);
    if (covering_locked(a, size) < 0) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    for (int i = mapping_count - 1; i >= 0; i--) {
        struct mapping *m = mappings[i];
        if (m->base < a || m->base >= a + size) continue;
        int r = find_range_locked((void *)m->base, RANGE_MAPPED);
        refuse_if_in_use_locked("cuMemUnmap", r);
        ranges[r] = ranges[--range_count];
        /* Back to reserved, inaccessible address space. */
        mmap((void *)m->base, m->len, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        m->phys->mappings--;
        drop_phys_if_done_locked(m->phys);
        mappings[i] = mappings[--mapping_count];
        free(m);
    }
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

/* The host protection an access flag gives; -1 for a flag that is not one. */
static int host_protection(unsigned flags) {
    switch (flags) {
    case ACCESS_NONE: return PROT_NONE;
    case ACCESS_READ: return PROT_READ;
    case ACCESS_READWRITE: return PROT_READ | PROT_WRITE;
    default: return -1;
    }
}

/* Whether `d` names a location the simulator knows for access: a device, or the host. */
static CUresult check_access(const struct mem_access_desc *d) {
    if (host_protection(d->flags) < 0) return INVALID_VALUE;
    switch (d->location.type) {
    case LOCATION_DEVICE: return valid_device(d->location.id) ? SUCCESS : INVALID_DEVICE;
    case LOCATION_HOST_NUMA: return d->location.id >= 0 ? SUCCESS : INVALID_VALUE;
    case LOCATION_HOST: return SUCCESS;
    default: return INVALID_VALUE;
    }
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct mem_access_desc *desc,
                        size_t count) {
    REQUIRE_INIT();
    uintptr_t a = (uintptr_t)ptr;
    if (!desc || count == 0) return INVALID_VALUE;
    for (size_t k = 0; k < count; k++) {
        CUresult r = check_access(&desc[k]);
        if (r != SUCCESS) return r;
    }
    pthread_mutex_lock(&lock);
    if (covering_locked(a, size) < 0) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    for (size_t k = 0; k < count; k++) {
        if (desc[k].location.type != LOCATION_DEVICE) {
            mprotect((void *)a, size, host_protection(desc[k].flags));
            continue;
        }
        for (int i = 0; i < mapping_count; i++)
            if (mappings[i]->base >= a && mappings[i]->base < a + size)
                mappings[i]->device_access = desc[k].flags != ACCESS_NONE;
    }
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

/* A stream-ordered pool: blocks placed on its node, each its own mapping, kept when freed up to
 * the release threshold. */
struct pool_block {
    void *base;
    size_t len;
    struct sim_pool *pool;
    int live;                    /* 1 allocated, -1 its free queued, 0 kept for reuse */
    struct sim_stream *freed_on; /* the queued free's stream */
    struct op *pending_free;     /* the queued free */
    struct pool_block *next;
};
struct sim_pool {
    int node;
    int device_access;
    int destroyed;
    unsigned long long release_threshold;
    unsigned long long kept_bytes; /* freed blocks kept for reuse */
    struct pool_block *blocks;     /* live and kept */
};
static struct sim_pool *pools[64];
static int pool_count;
static unsigned long long pool_blocks_made; /* since the start */

static int find_pool_locked(CUmemoryPool pool) {
    for (int i = 0; i < pool_count; i++)
        if (pools[i] == pool && !pool->destroyed) return i;
    return -1;
}

/* Gives a block's memory back to the kernel, and the pool's bookkeeping once nothing is left. */
static void drop_block_locked(struct pool_block *b) {
    struct sim_pool *pool = b->pool;
    int r = find_range_locked(b->base, RANGE_POOL);
    refuse_if_in_use_locked("a pool's release", r);
    ranges[r] = ranges[--range_count];
    for (struct pool_block **p = &pool->blocks; *p; p = &(*p)->next) {
        if (*p == b) {
            *p = b->next;
            break;
        }
    }
    if (!b->live) pool->kept_bytes -= b->len;
    munmap(b->base, b->len);
    free(b);
}

/* Frees a destroyed pool's bookkeeping once its last block is gone. */
static void forget_pool_if_done_locked(struct sim_pool *pool) {
    if (!pool->destroyed || pool->blocks) return;
    for (int i = 0; i < pool_count; i++)
        if (pools[i] == pool) pools[i] = pools[--pool_count];
    free(pool);
}

/* A free reached by its stream: the block is kept, unless that passes the release threshold or
 * the pool is gone. NULL: the block was allocated again on that stream meanwhile. */
static void pool_free_locked(void *block) {
    struct pool_block *b = block;
    if (!b) return;
    struct sim_pool *pool = b->pool;
    b->pending_free = NULL;
    b->live = 0;
    pool->kept_bytes += b->len;
    if (pool->destroyed || pool->kept_bytes > pool->release_threshold) drop_block_locked(b);
    forget_pool_if_done_locked(pool);
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const struct mem_pool_props *props) {
    REQUIRE_INIT();
    INJECT("cuMemPoolCreate");
    if (!pool || !props || props->alloc_type != ALLOCATION_PINNED) return INVALID_VALUE;
    if (props->handle_types != 0) return NOT_SUPPORTED;
    CUresult r = check_location(&props->location);
    if (r != SUCCESS) return r;
    struct sim_pool *p = calloc(1, sizeof *p);
    if (!p) return OUT_OF_MEMORY;
    p->node = props->location.id;
    pthread_mutex_lock(&lock);
    r = pool_count == 64 ? OUT_OF_MEMORY : SUCCESS;
    if (r == SUCCESS) pools[pool_count++] = p;
    pthread_mutex_unlock(&lock);
    if (r != SUCCESS) {
        free(p);
        return r;
    }
    *pool = p;
    return SUCCESS;
}

/* Like CUDA: returns at once; blocks still allocated are given back when they are freed. */
CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    REQUIRE_INIT();
    pthread_mutex_lock(&lock);
    CUresult r = find_pool_locked(pool) < 0 ? INVALID_VALUE : SUCCESS;
    if (r == SUCCESS) {
        pool->destroyed = 1;
        struct pool_block *next;
        for (struct pool_block *b = pool->blocks; b; b = next) {
            next = b->next;
            if (!b->live) drop_block_locked(b);
        }
        forget_pool_if_done_locked(pool);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Only the release threshold is modelled; other attributes answer NOT_SUPPORTED. */
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, unsigned attr, void *value) {
    REQUIRE_INIT();
    if (!value) return INVALID_VALUE;
    if (attr != POOL_ATTR_RELEASE_THRESHOLD) return NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    CUresult r = find_pool_locked(pool) < 0 ? INVALID_VALUE : SUCCESS;
    if (r == SUCCESS) pool->release_threshold = *(const unsigned long long *)value;
    pthread_mutex_unlock(&lock);
    return r;
}

/* The host keeps its access (a host-NUMA pool's default; taking it away is not modelled). */
CUresult cuMemPoolSetAccess(CUmemoryPool pool, const struct mem_access_desc *desc, size_t count) {
    REQUIRE_INIT();
    if (!desc || count == 0) return INVALID_VALUE;
    for (size_t k = 0; k < count; k++) {
        CUresult r = check_access(&desc[k]);
        if (r != SUCCESS) return r;
    }
    pthread_mutex_lock(&lock);
    CUresult r = find_pool_locked(pool) < 0 ? INVALID_VALUE : SUCCESS;
    for (size_t k = 0; r == SUCCESS && k < count; k++)
        if (desc[k].location.type == LOCATION_DEVICE)
            pool->device_access = desc[k].flags != ACCESS_NONE;
    pthread_mutex_unlock(&lock);
    return r;
}

/* A kept block at least `size` long is reused, or one whose free is queued on the same stream
 * (stream order makes it free by then, as CUDA reuses it); else a new one is placed and faulted
 * in. */
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h) {
    REQUIRE_INIT();
    INJECT("cuMemAllocFromPoolAsync");
    if (!dptr || size == 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (find_pool_locked(pool) < 0) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    for (struct pool_block *b = pool->blocks; b; b = b->next) {
        int same_stream = b->live == -1 && b->freed_on == stream_of(h);
        if ((b->live == 0 || same_stream) && b->len >= size) {
            if (b->live == 0) pool->kept_bytes -= b->len;
            if (same_stream) b->pending_free->dst = NULL; /* the queued free is void */
            b->pending_free = NULL;
            b->live = 1;
            *dptr = (CUdeviceptr)(uintptr_t)b->base;
            pthread_mutex_unlock(&lock);
            return SUCCESS;
        }
    }
    int node = pool->node;
    pthread_mutex_unlock(&lock);
    size_t len = (size + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    CUresult r = place_and_populate(p, len, node);
    struct pool_block *b = r == SUCCESS ? calloc(1, sizeof *b) : NULL;
    pthread_mutex_lock(&lock);
    if (r == SUCCESS && (!b || find_pool_locked(pool) < 0)) r = b ? INVALID_VALUE : OUT_OF_MEMORY;
    if (r == SUCCESS) r = add_range_locked(p, len, RANGE_POOL, &pool->device_access);
    if (r == SUCCESS) {
        *b = (struct pool_block){p, len, pool, 1, NULL, NULL, pool->blocks};
        pool->blocks = b;
        pool_blocks_made++;
    }
    pthread_mutex_unlock(&lock);
    if (r != SUCCESS) {
        free(b);
        munmap(p, len);
        return r;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

/* The block goes back to its pool when stream `h` reaches the free. */
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream h) {
    REQUIRE_INIT();
    struct op *op = calloc(1, sizeof *op);
    if (!op) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct pool_block *found = NULL;
    for (int i = 0; i < pool_count && !found; i++)
        for (struct pool_block *b = pools[i]->blocks; b && !found; b = b->next)
            if (b->live && (CUdeviceptr)(uintptr_t)b->base == dptr) found = b;
    if (found) {
        op->kind = OP_POOL_FREE;
        op->dst = found;
        found->live = -1; /* being freed: not freed twice */
        found->freed_on = stream_of(h);
        found->pending_free = op;
        enqueue_locked(found->freed_on, op);
    }
    pthread_mutex_unlock(&lock);
    if (!found) free(op);
    return found ? SUCCESS : INVALID_VALUE;
}

#endif /* CUDA_SIM_WITHOUT_HOST_NUMA */

/* ---------------------------------------------------------------- the tests' side */

/* What the virtual clock saw since the last reset. */
struct sim_stats {
    double busy_us;         /* sum of simulated copy durations, plus host work (cuSimHostWork) */
    double span_us;         /* clock reset to the end of the last copy or host work */
    unsigned long long async_copies, sync_copies;
    unsigned long long registered_ranges;
    unsigned long long registrations, largest_registration;
    unsigned long long longest_registration_us;
};

void cuSimStats(struct sim_stats *out) {
    pthread_mutex_lock(&lock);
    out->busy_us = busy_vtime + host_work_vtime;
    double end = last_end > host_vtime ? last_end : host_vtime;
    out->span_us = end - clock_start;
    out->async_copies = async_copies;
    out->sync_copies = sync_copies;
    out->registered_ranges = (unsigned long long)range_count;
    out->registrations = registrations;
    out->largest_registration = largest_registration;
    out->longest_registration_us = longest_registration_us;
    pthread_mutex_unlock(&lock);
}

/* What CUDA_SIM_LOCK_FILE and the unregistrations saw (see unlocked_registrations). */
struct sim_lock_stats {
    unsigned long long unlocked_registrations, unmapped_unregistrations, unregistrations;
};

void cuSimLockStats(struct sim_lock_stats *out) {
    pthread_mutex_lock(&lock);
    out->unlocked_registrations = unlocked_registrations;
    out->unmapped_unregistrations = unmapped_unregistrations;
    out->unregistrations = unregistrations;
    pthread_mutex_unlock(&lock);
}

/* Starts a new measurement: the timeline restarts after everything queued so far. */
void cuSimResetClock(void) {
    pthread_mutex_lock(&lock);
    double now = host_vtime;
    for (int e = 0; e < 2; e++)
        if (engine_vtime[e] > now) now = engine_vtime[e];
    host_vtime = clock_start = last_end = now;
    busy_vtime = host_work_vtime = 0;
    async_copies = sync_copies = 0;
    pthread_mutex_unlock(&lock);
}

/* The calling program did `us` of simulated host work (filling a buffer, say): the host's clock
 * moves on, while queued copies keep running. */
void cuSimHostWork(double us) {
    pthread_mutex_lock(&lock);
    host_vtime += us;
    host_work_vtime += us;
    pthread_mutex_unlock(&lock);
}

/* While on, page-locked copies stay queued (their stream stops there): a test decides when
 * in-flight DMA completes, whatever the machine's speed. */
void cuSimHold(int on) {
    pthread_mutex_lock(&lock);
    held = on;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

#ifndef CUDA_SIM_WITHOUT_HOST_NUMA
/* What host-NUMA memory is live: physical allocations (until released and unmapped), reserved
 * address ranges, mappings, pools (until destroyed and empty) and their blocks (allocated or
 * kept); and how many pool blocks were made since the start (a reuse makes none). */
struct sim_host_numa_stats {
    unsigned long long allocations, reservations, mappings, pools, pool_blocks;
    unsigned long long pool_blocks_made;
};

void cuSimHostNumaStats(struct sim_host_numa_stats *out) {
    pthread_mutex_lock(&lock);
    out->allocations = (unsigned long long)phys_count;
    out->reservations = (unsigned long long)reservation_count;
    out->mappings = (unsigned long long)mapping_count;
    out->pools = (unsigned long long)pool_count;
    out->pool_blocks = 0;
    for (int i = 0; i < pool_count; i++)
        for (struct pool_block *b = pools[i]->blocks; b; b = b->next) out->pool_blocks++;
    out->pool_blocks_made = pool_blocks_made;
    pthread_mutex_unlock(&lock);
}
#endif
