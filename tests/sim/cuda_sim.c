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
 *     cuSimStats reports the longest single registration call. A registration after the
 *     library's teardown at exit aborts, as it would touch the real driver's freed state.
 *   - Error injection: cuSimFail("cuMemHostRegister_v2", code, skip, count), or the environment
 *     CUDA_SIM_FAIL=name:code[:skip[:count]] (cuInit included).
 *
 * Environment: CUDA_SIM_DEVICES (default 1), CUDA_SIM_HOST_NUMA_ID (comma list per device,
 * default 0; -1 reports "unknown"), CUDA_SIM_PCI (comma list, default 0000:0N:00.0),
 * CUDA_SIM_DELAY_US, CUDA_SIM_REGISTER_US_PER_GIB, CUDA_SIM_TEARDOWN_US, CUDA_SIM_INIT_US (how long
 * the first cuInit takes).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
};

#define MAX_DEVICES 8
#define MAX_RANGES 4096
#define PINNED_BYTES_PER_US 25000.0 /* 25 GB/s */
#define PAGEABLE_BYTES_PER_US 10000.0

/* ---------------------------------------------------------------- global state */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
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

/* Page-locked host ranges. */
struct range {
    uintptr_t base;
    size_t len;
    int host_alloc; /* cuMemHostAlloc (freed by cuMemFreeHost) vs cuMemHostRegister */
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

enum op_kind { OP_COPY, OP_SET, OP_RECORD, OP_WAIT };

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
    if (host && straddles_locked(host, len)) {
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

static CUresult add_range_locked(void *p, size_t len, int host_alloc) {
    if (pinned_locked(p, len)) return ALREADY_REGISTERED;
    if (range_count == MAX_RANGES) return OUT_OF_MEMORY;
    ranges[range_count++] = (struct range){(uintptr_t)p, len, host_alloc};
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

static int find_range_locked(void *p, int host_alloc) {
    for (int i = 0; i < range_count; i++)
        if (ranges[i].base == (uintptr_t)p && ranges[i].host_alloc == host_alloc) return i;
    return -1;
}

/* Successful cuMemHostRegister_v2 calls since the start, the longest range one covered and the
 * longest time one took (microseconds, real time). */
static unsigned long long registrations, largest_registration, longest_registration_us;

static unsigned long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000ull + (unsigned long long)t.tv_nsec / 1000;
}

/* Set when the library is unloaded at exit, as the driver tears down its state then: a
 * registration after it would touch freed driver state, so the simulator aborts. */
static int torn_down;

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
    CUresult r = add_range_locked(p, len, 0);
    if (r == SUCCESS) {
        registrations++;
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
    int i = find_range_locked(p, 0);
    if (i >= 0) {
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
    CUresult r = add_range_locked(p, len, 1);
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
    int i = find_range_locked(p, 1);
    if (i >= 0) {
        refuse_if_in_use_locked("cuMemFreeHost", i);
        ranges[i] = ranges[--range_count];
    }
    pthread_mutex_unlock(&lock);
    if (i < 0) return INVALID_VALUE;
    free(p);
    return SUCCESS;
}

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
