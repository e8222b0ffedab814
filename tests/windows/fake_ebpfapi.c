/*
 * A stand-in for eBPF for Windows' ebpfapi.dll (its synchronous perf buffer API)
 * and for the kernel32 event/wait functions, so that aperf's real ctypes binding
 * (aperf/_native/ebpfapi) runs unchanged on Linux. Built by the test suite with gcc.
 *
 * Written from microsoft/ebpf-for-windows (commit 0be2d1c3f36c; PR #4966 merged as
 * 6926e944907d), not from aperf's expectations:
 *   - perf_buffer__new (libs/api/ebpf_api.cpp, ebpf_perf_buffer_new_internal): both
 *     callbacks required (EINVAL), page_cnt must be 0 (EINVAL), a bad fd is EBADF, a
 *     map of another type EINVAL; NULL + errno on failure. One ring per CPU
 *     (libbpf_num_possible_cpus), one MANUAL-reset event (CreateEvent(NULL, TRUE,
 *     FALSE, NULL)) shared by every ring; the lost baseline is read at creation.
 *   - the producer (libs/execution_context/ebpf_maps.c, ebpf_perf_event_array_map_output;
 *     libs/runtime/ebpf_ring_buffer.c): a ring of max_entries bytes; a record is an
 *     8-byte header (u32 length with lock bit 31 / discard bit 30, u32 page offset)
 *     then the data, padded to 8; reserve fails when the record does not fit and then
 *     lost_records (in the producer page) grows by one, without a wakeup; a submit
 *     signals the wait handle when the ring is not empty. The event stays signalled
 *     until someone resets it.
 *   - consume (libs/api/libbpf_map.cpp, _process_ring_records): the lost callback
 *     first, with lost_records minus the count seen by the last consume, then one
 *     sample callback per record in order, the consumer offset advanced after each;
 *     stops at a locked record; returns the number of samples. Callbacks run only
 *     inside consume/poll, on the caller's thread. consume_buffer with an index out of
 *     range: -EINVAL and errno EINVAL. poll: ResetEvent, consume, then wait.
 *   - kernel32: CreateEventW/SetEvent/ResetEvent/CloseHandle/WaitForSingleObject/
 *     WaitForMultipleObjects (bWaitAll FALSE) with Windows' return codes; a satisfied
 *     wait resets an auto-reset event only. Failures set the thread's last error,
 *     which aperf reads through errno here (ctypes.get_last_error on Windows).
 *
 *   - the ring buffer (include/ebpf_api.h, libs/api/ebpf_api.cpp ebpf_ring_buffer_new_internal,
 *     libs/api/libbpf_map.cpp, libs/execution_context/ebpf_maps.c ebpf_ring_buffer_map_output;
 *     BPF_MAP_TYPE_RINGBUF is 13 there): ring_buffer__new in synchronous mode (the default)
 *     needs a sample callback (EINVAL), a ring buffer map (EINVAL otherwise, EBADF for a bad
 *     fd), makes one MANUAL-reset event and sets it as the map's wait handle, and maps the
 *     ring; ebpf_ring_buffer_get_buffer hands out the consumer page (read-write, u64
 *     consumer_offset), the producer page (u64 producer_offset) and the data area mapped
 *     twice, as three pointers, with its size (EBPF_OBJECT_NOT_FOUND for an index past the
 *     one map; EBPF_INVALID_ARGUMENT in the callback mode aperf does not use);
 *     ebpf_ring_buffer_get_wait_handle the event. Offsets grow for ever (a record sits at
 *     offset % size); records are laid out as the perf rings' and as Linux's. A submit
 *     signals the event when the ring is not empty afterwards (libs/runtime/ebpf_ring_buffer.c,
 *     _ring_buffer_notify_consumer); a full ring fails the output with nothing counted (the
 *     kernel keeps no lost count for ring buffers). ring_buffer__free clears the map's wait
 *     handle, unmaps and closes the event.
 *   - wait handles (libs/api/ebpf_api.cpp ebpf_map_set_wait_handle, libs/runtime/ebpf_ring_buffer.c
 *     ebpf_ring_buffer_set_wait_handle and ebpf_ring_buffer_destroy): the kernel holds a
 *     reference to a ring's wait event (ObReferenceObjectByHandle) until another is set or the
 *     map is freed, so closing the handle does not free the event. Setting ebpf_handle_invalid,
 *     which perf_buffer__free and ring_buffer__free do to clear it, fails in kernel mode
 *     (issue #5206, open at 0be2d1c3f36c): the reference is kept, the event leaked for as long
 *     as the map lives. fake_set_fixed_5206(1) models a DLL where that is fixed.
 *
 * Test-only exports start with fake_: create maps, output samples as a BPF program
 * would (on a given CPU), pin, and count misuse (a handle closed while a thread waits
 * on it, a freed buffer used) and leaks (open handles, fds, buffers).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int BOOL;
typedef uint32_t DWORD;
typedef void *HANDLE;
typedef intptr_t ebpf_handle_t;
typedef int32_t fd_t;

#define WAIT_OBJECT_0 0x0u
#define WAIT_TIMEOUT 0x102u
#define WAIT_FAILED 0xFFFFFFFFu
#define INFINITE 0xFFFFFFFFu
#define MAXIMUM_WAIT_OBJECTS 64
#define ERROR_INVALID_HANDLE 6
#define ERROR_INVALID_PARAMETER 87

#define BPF_MAP_TYPE_RINGBUF 13
#define BPF_MAP_TYPE_PERF_EVENT_ARRAY 14
#define EBPF_SUCCESS 0
#define EBPF_INVALID_FD 4
#define EBPF_INVALID_ARGUMENT 6
#define EBPF_OBJECT_NOT_FOUND 7
#define EBPF_OUT_OF_SPACE 29
#define LOCK_BIT (1u << 31)
#define DISCARD_BIT (1u << 30)
#define HEADER 8u

/* ------------------------------------------------------------------ kernel32 */

static pthread_mutex_t k_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t k_cond = PTHREAD_COND_INITIALIZER;
static __thread DWORD last_error;

typedef struct event {
    int live;
    int manual;
    int signalled;
    int waiters;     /* threads inside a WaitFor* on it */
    int kernel_refs; /* rings whose wait event it is: the object outlives its handle */
} event_t;

#define MAX_EVENTS 4096
static event_t events[MAX_EVENTS]; /* HANDLE = index + 1 (0 is NULL) */
static int misuse;                 /* handles closed while waited on, freed buffers used */

static void set_error(DWORD code) {
    last_error = code;
    errno = (int)code; /* what aperf reads off Windows (use_errno) */
}

DWORD GetLastError(void) { return last_error; }

static event_t *event_of(HANDLE h) { /* k_lock held */
    uintptr_t i = (uintptr_t)h;
    if (i == 0 || i > MAX_EVENTS || !events[i - 1].live)
        return NULL;
    return &events[i - 1];
}

HANDLE CreateEventW(void *attributes, BOOL manual_reset, BOOL initial, const void *name) {
    (void)attributes;
    (void)name;
    pthread_mutex_lock(&k_lock);
    for (int i = 0; i < MAX_EVENTS; i++) {
        if (!events[i].live && events[i].waiters == 0 && events[i].kernel_refs == 0) {
            events[i] = (event_t){.live = 1, .manual = !!manual_reset, .signalled = !!initial};
            pthread_mutex_unlock(&k_lock);
            return (HANDLE)(uintptr_t)(i + 1);
        }
    }
    pthread_mutex_unlock(&k_lock);
    set_error(8); /* ERROR_NOT_ENOUGH_MEMORY */
    return NULL;
}

enum { SIGNAL, RESET, CLOSE };

/* SetEvent, ResetEvent and CloseHandle: FALSE and ERROR_INVALID_HANDLE on a bad handle. */
static BOOL change(HANDLE h, int what) {
    pthread_mutex_lock(&k_lock);
    event_t *e = event_of(h);
    if (!e) {
        pthread_mutex_unlock(&k_lock);
        set_error(ERROR_INVALID_HANDLE);
        return 0;
    }
    if (what == CLOSE) {
        if (e->waiters)
            misuse++; /* undefined behaviour on Windows */
        e->live = 0;
    } else {
        e->signalled = what == SIGNAL;
    }
    if (what != RESET)
        pthread_cond_broadcast(&k_cond);
    pthread_mutex_unlock(&k_lock);
    return 1;
}

BOOL SetEvent(HANDLE h) { return change(h, SIGNAL); }
BOOL ResetEvent(HANDLE h) { return change(h, RESET); }
BOOL CloseHandle(HANDLE h) { return change(h, CLOSE); }

static void deadline_after(struct timespec *ts, DWORD ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

DWORD WaitForMultipleObjects(DWORD count, const HANDLE *handles, BOOL wait_all, DWORD ms) {
    if (count == 0 || count > MAXIMUM_WAIT_OBJECTS || wait_all || !handles) {
        set_error(ERROR_INVALID_PARAMETER); /* aperf never waits for all */
        return WAIT_FAILED;
    }
    struct timespec deadline;
    if (ms != INFINITE)
        deadline_after(&deadline, ms);
    for (DWORD i = 0; i < count; i++) {
        for (DWORD j = 0; j < i; j++) {
            if (handles[i] == handles[j]) {
                set_error(ERROR_INVALID_PARAMETER); /* "cannot contain multiple copies" */
                return WAIT_FAILED;
            }
        }
    }
    pthread_mutex_lock(&k_lock);
    for (DWORD i = 0; i < count; i++) {
        if (!event_of(handles[i])) {
            pthread_mutex_unlock(&k_lock);
            set_error(ERROR_INVALID_HANDLE);
            return WAIT_FAILED;
        }
    }
    for (DWORD i = 0; i < count; i++)
        event_of(handles[i])->waiters++;
    DWORD result = WAIT_TIMEOUT;
    for (;;) {
        int closed = 0;
        for (DWORD i = 0; i < count; i++) {
            event_t *e = event_of(handles[i]);
            if (!e) {
                closed = 1;
                break;
            }
            if (e->signalled) {
                if (!e->manual)
                    e->signalled = 0;
                result = WAIT_OBJECT_0 + i;
                break;
            }
        }
        if (closed) {
            result = WAIT_FAILED;
            break;
        }
        if (result != WAIT_TIMEOUT || ms == 0)
            break;
        if (ms == INFINITE)
            pthread_cond_wait(&k_cond, &k_lock);
        else if (pthread_cond_timedwait(&k_cond, &k_lock, &deadline) == ETIMEDOUT)
            ms = 0; /* one last look, then time out */
    }
    for (DWORD i = 0; i < count; i++) {
        uintptr_t index = (uintptr_t)handles[i];
        if (index && index <= MAX_EVENTS && events[index - 1].waiters)
            events[index - 1].waiters--;
    }
    pthread_mutex_unlock(&k_lock);
    if (result == WAIT_FAILED)
        set_error(ERROR_INVALID_HANDLE);
    return result;
}

DWORD WaitForSingleObject(HANDLE h, DWORD ms) { return WaitForMultipleObjects(1, &h, 0, ms); }

/* ------------------------------------------------------------------- maps */

typedef struct ring {
    pthread_mutex_t producer; /* one producer at a time (the per-CPU DISPATCH_LEVEL writer) */
    uint8_t *data;            /* 2 * size: the second half mirrors the first (double mapping) */
    uint64_t size;
    volatile uint64_t producer_offset;
    volatile uint64_t consumer_offset;
    volatile uint64_t lost_records; /* the perf producer page's counter */
    HANDLE wait_handle;             /* set by perf_buffer__new (ebpf_map_set_wait_handle) */
} ring_t;

typedef struct map {
    uint32_t id, type, max_entries, refs;
    char name[64];
    int ncpus;
    ring_t *rings;
    char pin[256];
} map_t;

typedef struct bpf_map_info { /* ebpf_structs.h */
    uint32_t id, type, key_size, value_size, max_entries;
    char name[64];
    uint32_t map_flags, inner_map_id, pinned_path_count;
} bpf_map_info_t;

#define MAX_FDS 256
#define FD_BASE 100
static pthread_mutex_t m_lock = PTHREAD_MUTEX_INITIALIZER;
static map_t *fds[MAX_FDS]; /* fd = FD_BASE + index */
static map_t *maps[MAX_FDS];
static uint32_t next_id = 1;
static int cpu_count = 2;

static map_t *map_of(int fd) { /* m_lock held */
    if (fd < FD_BASE || fd >= FD_BASE + MAX_FDS)
        return NULL;
    return fds[fd - FD_BASE];
}

static int new_fd(map_t *m) { /* m_lock held */
    for (int i = 0; i < MAX_FDS; i++) {
        if (!fds[i]) {
            fds[i] = m;
            m->refs++;
            return FD_BASE + i;
        }
    }
    return -EMFILE;
}

static void kernel_deref(HANDLE h) { /* ObDereferenceObject of a ring's wait event */
    uintptr_t i = (uintptr_t)h;
    if (i == 0 || i > MAX_EVENTS)
        return;
    pthread_mutex_lock(&k_lock);
    if (events[i - 1].kernel_refs > 0)
        events[i - 1].kernel_refs--;
    pthread_mutex_unlock(&k_lock);
}

static void unref(map_t *m) { /* m_lock held */
    if (--m->refs)
        return;
    for (int i = 0; i < MAX_FDS; i++)
        if (maps[i] == m)
            maps[i] = NULL;
    for (int c = 0; c < m->ncpus; c++)
        kernel_deref(m->rings[c].wait_handle); /* ebpf_ring_buffer_destroy */
    for (int c = 0; c < m->ncpus; c++) {
        pthread_mutex_destroy(&m->rings[c].producer);
        free(m->rings[c].data);
    }
    free(m->rings);
    free(m);
}

int libbpf_num_possible_cpus(void) { return cpu_count; }

void fake_set_cpu_count(int n) { cpu_count = n; }

int fake_map_create(uint32_t type, uint32_t max_entries, const char *name) {
    map_t *m = calloc(1, sizeof *m);
    if (!m)
        return -ENOMEM;
    m->type = type;
    m->max_entries = max_entries;
    strncpy(m->name, name ? name : "", sizeof m->name - 1);
    m->ncpus = type == BPF_MAP_TYPE_RINGBUF ? 1 : cpu_count; /* one ring for every CPU */
    m->rings = calloc((size_t)m->ncpus, sizeof(ring_t));
    for (int c = 0; c < m->ncpus; c++) {
        ring_t *r = &m->rings[c];
        pthread_mutex_init(&r->producer, NULL);
        r->size = max_entries;
        if (type == BPF_MAP_TYPE_PERF_EVENT_ARRAY || type == BPF_MAP_TYPE_RINGBUF)
            r->data = calloc(2, max_entries);
    }
    pthread_mutex_lock(&m_lock);
    m->id = next_id++;
    for (int i = 0; i < MAX_FDS; i++) {
        if (!maps[i]) {
            maps[i] = m;
            break;
        }
    }
    int fd = new_fd(m);
    pthread_mutex_unlock(&m_lock);
    return fd;
}

int fake_map_pin(int fd, const char *path) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    if (m) {
        strncpy(m->pin, path, sizeof m->pin - 1);
        m->refs++; /* the pin holds the map */
    }
    pthread_mutex_unlock(&m_lock);
    return m ? 0 : -EBADF;
}

int bpf_obj_get(const char *path) {
    pthread_mutex_lock(&m_lock);
    int fd = -ENOENT;
    for (int i = 0; i < MAX_FDS && path; i++) {
        if (maps[i] && strcmp(maps[i]->pin, path) == 0) {
            fd = new_fd(maps[i]);
            break;
        }
    }
    pthread_mutex_unlock(&m_lock);
    if (fd < 0)
        errno = -fd;
    return fd;
}

int bpf_obj_get_info_by_fd(int fd, void *info, uint32_t *info_len) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    if (!m) {
        pthread_mutex_unlock(&m_lock);
        errno = EBADF;
        return -EBADF;
    }
    bpf_map_info_t out = {.id = m->id, .type = m->type, .max_entries = m->max_entries};
    memcpy(out.name, m->name, sizeof out.name);
    pthread_mutex_unlock(&m_lock);
    if (!info || !info_len) {
        errno = EINVAL;
        return -EINVAL;
    }
    uint32_t n = *info_len < sizeof out ? *info_len : (uint32_t)sizeof out;
    memcpy(info, &out, n);
    *info_len = n;
    return 0;
}

int ebpf_duplicate_fd(fd_t fd, fd_t *dup) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    int result = EBPF_INVALID_FD;
    if (m && dup) {
        int new = new_fd(m);
        if (new >= 0) {
            *dup = new;
            result = EBPF_SUCCESS;
        }
    }
    pthread_mutex_unlock(&m_lock);
    return result;
}

int ebpf_close_fd(fd_t fd) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    if (m) {
        fds[fd - FD_BASE] = NULL;
        unref(m);
    }
    pthread_mutex_unlock(&m_lock);
    return m ? EBPF_SUCCESS : EBPF_INVALID_FD;
}

int fake_open_fds(void) {
    int n = 0;
    pthread_mutex_lock(&m_lock);
    for (int i = 0; i < MAX_FDS; i++)
        n += fds[i] != NULL;
    pthread_mutex_unlock(&m_lock);
    return n;
}

static uint64_t record_size(uint32_t length) { return (HEADER + length + 7) & ~7ull; }

/* bpf_perf_event_output on `cpu` (ebpf_perf_event_array_map_output): 0, or -ENOSPC
 * when the ring is full (the drop is counted), -EBADF/-EINVAL on bad arguments. */
int fake_output(int fd, uint32_t cpu, const void *data, uint32_t length) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    if (m)
        m->refs++;
    pthread_mutex_unlock(&m_lock);
    if (!m)
        return -EBADF;
    int result = 0;
    if (m->type != BPF_MAP_TYPE_PERF_EVENT_ARRAY || cpu >= (uint32_t)m->ncpus) {
        result = -EINVAL;
        goto out;
    }
    ring_t *r = &m->rings[cpu];
    uint64_t total = record_size(length);
    pthread_mutex_lock(&r->producer);
    uint64_t producer = r->producer_offset;
    uint64_t consumer = __atomic_load_n(&r->consumer_offset, __ATOMIC_ACQUIRE);
    if (total > r->size - (producer - consumer)) {
        __atomic_store_n(&r->lost_records, r->lost_records + 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&r->producer);
        result = -ENOSPC;
        goto out;
    }
    /* reserve: a locked header, then publish the producer offset */
    uint8_t *base = r->data;
    uint64_t at = producer % r->size;
    uint32_t header[2] = {length | LOCK_BIT, (uint32_t)(at / 4096)};
    for (uint64_t i = 0; i < HEADER; i++) {
        uint64_t p = (at + i) % r->size;
        base[p] = base[p + r->size] = ((uint8_t *)header)[i];
    }
    __atomic_store_n(&r->producer_offset, producer + total, __ATOMIC_RELEASE);
    for (uint64_t i = 0; i < length; i++) {
        uint64_t p = (at + HEADER + i) % r->size;
        base[p] = base[p + r->size] = ((const uint8_t *)data)[i];
    }
    /* submit: unlock the header (both views), then notify */
    __atomic_store_n((uint32_t *)(base + at + r->size), length, __ATOMIC_RELEASE);
    __atomic_store_n((uint32_t *)(base + at), length, __ATOMIC_RELEASE);
    HANDLE wait_handle = r->wait_handle;
    uint64_t now_consumer = __atomic_load_n(&r->consumer_offset, __ATOMIC_ACQUIRE);
    if (wait_handle && producer + total != now_consumer)
        SetEvent(wait_handle);
    pthread_mutex_unlock(&r->producer);
out:
    pthread_mutex_lock(&m_lock);
    unref(m);
    pthread_mutex_unlock(&m_lock);
    return result;
}

/* The exported API a test on real Windows uses too (include/bpf/bpf.h, include/ebpf_api.h). */
int bpf_map_create(uint32_t map_type, const char *map_name, uint32_t key_size, uint32_t value_size,
                   uint32_t max_entries, const void *opts) {
    (void)key_size;
    (void)value_size;
    (void)opts;
    int fd = fake_map_create(map_type, max_entries, map_name);
    if (fd < 0)
        errno = -fd;
    return fd;
}

/* Writes on the calling thread's CPU, as the kernel's map write does (a test pins its thread). */
int ebpf_perf_event_array_map_write(fd_t fd, const void *data, size_t length) {
    if (!data || !length)
        return EBPF_INVALID_ARGUMENT;
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    int ncpus = m ? m->ncpus : 1;
    pthread_mutex_unlock(&m_lock);
    if (!m)
        return EBPF_INVALID_FD;
    int cpu = sched_getcpu();
    int result = fake_output(fd, (uint32_t)(cpu < 0 ? 0 : cpu % ncpus), data, (uint32_t)length);
    return result == 0 ? EBPF_SUCCESS : result == -ENOSPC ? EBPF_OUT_OF_SPACE : EBPF_INVALID_ARGUMENT;
}

uint64_t fake_lost(int fd, uint32_t cpu) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    uint64_t lost = (m && cpu < (uint32_t)m->ncpus) ? m->rings[cpu].lost_records : 0;
    pthread_mutex_unlock(&m_lock);
    return lost;
}

/* ------------------------------------------------------------ wait handles */

static int fixed_5206;
void fake_set_fixed_5206(int fixed) { fixed_5206 = fixed; }

/* ebpf_ring_buffer_set_wait_handle on ring `index` of `m`: reference the new event, store
 * it, dereference the old one. ebpf_handle_invalid fails (#5206) unless fixed_5206. */
static int set_wait(map_t *m, uint64_t index, ebpf_handle_t handle) {
    if (index >= (uint64_t)m->ncpus)
        return EBPF_INVALID_ARGUMENT;
    pthread_mutex_lock(&k_lock);
    event_t *e = event_of((HANDLE)handle);
    if (e)
        e->kernel_refs++;
    pthread_mutex_unlock(&k_lock);
    if (!e && !(fixed_5206 && handle == (ebpf_handle_t)-1))
        return EBPF_INVALID_ARGUMENT; /* ObReferenceObjectByHandle failed: nothing changes */
    ring_t *r = &m->rings[index];
    pthread_mutex_lock(&r->producer);
    HANDLE old = r->wait_handle;
    r->wait_handle = e ? (HANDLE)handle : NULL;
    pthread_mutex_unlock(&r->producer);
    kernel_deref(old);
    return EBPF_SUCCESS;
}

int ebpf_map_set_wait_handle(fd_t map_fd, uint64_t index, ebpf_handle_t handle) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(map_fd);
    if (m)
        m->refs++;
    pthread_mutex_unlock(&m_lock);
    if (!m)
        return EBPF_INVALID_FD;
    int result = set_wait(m, index, handle);
    pthread_mutex_lock(&m_lock);
    unref(m);
    pthread_mutex_unlock(&m_lock);
    return result;
}

/* Events whose handle was closed but that a ring still references: leaked until the map goes. */
int fake_leaked_events(void) {
    int n = 0;
    pthread_mutex_lock(&k_lock);
    for (int i = 0; i < MAX_EVENTS; i++)
        n += !events[i].live && events[i].kernel_refs > 0;
    pthread_mutex_unlock(&k_lock);
    return n;
}

/* ------------------------------------------------------------ perf buffer */

typedef void (*perf_buffer_sample_fn)(void *ctx, int cpu, void *data, uint32_t size);
typedef void (*perf_buffer_lost_fn)(void *ctx, int cpu, uint64_t cnt);

#define PB_MAGIC 0x70657266u
typedef struct perf_buffer {
    uint32_t magic;
    map_t *map;
    perf_buffer_sample_fn sample_cb;
    perf_buffer_lost_fn lost_cb;
    void *ctx;
    HANDLE wait_handle;
    uint64_t *lost_seen; /* per CPU: the lost count at the last consume */
    int count;
} perf_buffer_t;

static int live_buffers;

struct perf_buffer *perf_buffer__new(int map_fd, size_t page_cnt, perf_buffer_sample_fn sample_cb,
                                     perf_buffer_lost_fn lost_cb, void *ctx, const void *opts) {
    (void)opts;
    if (!sample_cb || !lost_cb || page_cnt != 0) {
        errno = EINVAL;
        return NULL;
    }
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(map_fd);
    if (m)
        m->refs++; /* the real one keeps using map_fd; this keeps the map alive */
    pthread_mutex_unlock(&m_lock);
    if (!m) {
        errno = EBADF;
        return NULL;
    }
    if (m->type != BPF_MAP_TYPE_PERF_EVENT_ARRAY) {
        pthread_mutex_lock(&m_lock);
        unref(m);
        pthread_mutex_unlock(&m_lock);
        errno = EINVAL;
        return NULL;
    }
    perf_buffer_t *pb = calloc(1, sizeof *pb);
    pb->magic = PB_MAGIC;
    pb->map = m;
    pb->sample_cb = sample_cb;
    pb->lost_cb = lost_cb;
    pb->ctx = ctx;
    pb->count = m->ncpus < cpu_count ? m->ncpus : cpu_count;
    pb->wait_handle = CreateEventW(NULL, 1, 0, NULL);
    pb->lost_seen = calloc((size_t)pb->count, sizeof(uint64_t));
    for (int c = 0; c < pb->count; c++) {
        ring_t *r = &m->rings[c];
        (void)set_wait(m, (uint64_t)c, (ebpf_handle_t)pb->wait_handle);
        pb->lost_seen[c] = __atomic_load_n(&r->lost_records, __ATOMIC_ACQUIRE);
    }
    pthread_mutex_lock(&m_lock);
    live_buffers++;
    pthread_mutex_unlock(&m_lock);
    return pb;
}

static int valid(const perf_buffer_t *pb) {
    if (pb && pb->magic == PB_MAGIC)
        return 1;
    pthread_mutex_lock(&k_lock);
    misuse++;
    pthread_mutex_unlock(&k_lock);
    return 0;
}

static int process_ring(perf_buffer_t *pb, int cpu) {
    ring_t *r = &pb->map->rings[cpu];
    uint64_t consumer = __atomic_load_n(&r->consumer_offset, __ATOMIC_ACQUIRE);
    uint64_t producer = __atomic_load_n(&r->producer_offset, __ATOMIC_ACQUIRE);
    uint64_t lost = __atomic_load_n(&r->lost_records, __ATOMIC_ACQUIRE);
    if (lost - pb->lost_seen[cpu] > 0) {
        pb->lost_cb(pb->ctx, cpu, lost - pb->lost_seen[cpu]);
        pb->lost_seen[cpu] = lost;
    }
    int processed = 0;
    while (consumer < producer) {
        uint8_t *record = r->data + consumer % r->size;
        uint32_t word = __atomic_load_n((uint32_t *)record, __ATOMIC_ACQUIRE);
        if (word & LOCK_BIT)
            break;
        uint32_t length = word & ~(LOCK_BIT | DISCARD_BIT);
        if (!(word & DISCARD_BIT)) {
            pb->sample_cb(pb->ctx, cpu, record + HEADER, length);
            processed++;
        }
        consumer += record_size(length);
        __atomic_store_n(&r->consumer_offset, consumer, __ATOMIC_RELEASE);
        if (consumer >= producer)
            producer = __atomic_load_n(&r->producer_offset, __ATOMIC_ACQUIRE);
    }
    return processed;
}

int perf_buffer__consume_buffer(struct perf_buffer *pb, size_t index) {
    if (!valid(pb)) {
        errno = EINVAL;
        return -EINVAL;
    }
    if (index >= (size_t)pb->count) {
        errno = EINVAL;
        return -EINVAL;
    }
    return process_ring(pb, (int)index);
}

int perf_buffer__consume(struct perf_buffer *pb) {
    if (!valid(pb)) {
        errno = EINVAL;
        return -EINVAL;
    }
    int total = 0;
    for (int c = 0; c < pb->count; c++)
        total += process_ring(pb, c);
    return total;
}

int perf_buffer__poll(struct perf_buffer *pb, int timeout_ms) {
    if (!valid(pb)) {
        errno = EINVAL;
        return -EINVAL;
    }
    ResetEvent(pb->wait_handle);
    int result = perf_buffer__consume(pb);
    if (result != 0 || timeout_ms == 0)
        return result;
    DWORD wait = WaitForSingleObject(pb->wait_handle, timeout_ms < 0 ? INFINITE : (DWORD)timeout_ms);
    if (wait == WAIT_OBJECT_0)
        return perf_buffer__consume(pb);
    if (wait != WAIT_TIMEOUT) {
        errno = EIO;
        return -EIO;
    }
    return 0;
}

size_t perf_buffer__buffer_cnt(const struct perf_buffer *pb) {
    if (!pb)
        return 0;
    return valid(pb) ? (size_t)pb->count : 0;
}

ebpf_handle_t ebpf_perf_buffer_get_wait_handle(const struct perf_buffer *pb) {
    if (!pb || !valid(pb))
        return (ebpf_handle_t)-1;
    return (ebpf_handle_t)pb->wait_handle;
}

void perf_buffer__free(struct perf_buffer *pb) {
    if (!pb || !valid(pb))
        return;
    for (int c = 0; c < pb->count; c++)
        (void)set_wait(pb->map, (uint64_t)c, (ebpf_handle_t)-1); /* fails: #5206 */
    CloseHandle(pb->wait_handle);
    pb->magic = 0; /* a later use is counted as misuse (the memory is kept for that) */
    pthread_mutex_lock(&m_lock);
    unref(pb->map);
    live_buffers--;
    pthread_mutex_unlock(&m_lock);
    free(pb->lost_seen);
}

/* ------------------------------------------------------------ ring buffer */

static void mirror_write(ring_t *r, uint64_t at, const void *bytes, uint64_t length) {
    for (uint64_t i = 0; i < length; i++) {
        uint64_t p = (at + i) % r->size;
        r->data[p] = r->data[p + r->size] = ((const uint8_t *)bytes)[i];
    }
}

static map_t *ringbuf_ref(int fd) {
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(fd);
    if (m && m->type == BPF_MAP_TYPE_RINGBUF)
        m->refs++;
    else
        m = NULL;
    pthread_mutex_unlock(&m_lock);
    return m;
}

static void map_unref(map_t *m) {
    pthread_mutex_lock(&m_lock);
    unref(m);
    pthread_mutex_unlock(&m_lock);
}

/* bpf_ringbuf_reserve: the record's offset, or -ENOSPC (full; nothing is counted),
 * -EINVAL (not a ring buffer map). The header is locked until fake_ringbuf_commit. */
int64_t fake_ringbuf_reserve(int fd, uint32_t length) {
    map_t *m = ringbuf_ref(fd);
    if (!m)
        return -EINVAL;
    ring_t *r = &m->rings[0];
    uint64_t total = record_size(length);
    int64_t result;
    pthread_mutex_lock(&r->producer);
    uint64_t producer = r->producer_offset;
    uint64_t consumer = __atomic_load_n(&r->consumer_offset, __ATOMIC_ACQUIRE);
    if (total > r->size - (producer - consumer)) {
        result = -ENOSPC;
    } else {
        uint64_t at = producer % r->size;
        uint32_t header[2] = {length | LOCK_BIT, (uint32_t)(at / 4096)};
        mirror_write(r, at, header, HEADER);
        __atomic_store_n(&r->producer_offset, producer + total, __ATOMIC_RELEASE);
        result = (int64_t)producer;
    }
    pthread_mutex_unlock(&r->producer);
    map_unref(m);
    return result;
}

/* bpf_ringbuf_submit/discard of the record reserved at `offset`, with `length` bytes of
 * data (its reserved length); then the wait handle is signalled. */
int fake_ringbuf_commit(int fd, uint64_t offset, const void *data, uint32_t length, int discard) {
    map_t *m = ringbuf_ref(fd);
    if (!m)
        return -EINVAL;
    ring_t *r = &m->rings[0];
    uint64_t at = offset % r->size;
    mirror_write(r, at + HEADER, data, length);
    uint32_t word = length | (discard ? DISCARD_BIT : 0);
    __atomic_store_n((uint32_t *)(r->data + at + r->size), word, __ATOMIC_RELEASE);
    __atomic_store_n((uint32_t *)(r->data + at), word, __ATOMIC_RELEASE);
    pthread_mutex_lock(&r->producer);
    HANDLE wait_handle = r->wait_handle;
    uint64_t producer = __atomic_load_n(&r->producer_offset, __ATOMIC_ACQUIRE);
    if (wait_handle && producer != __atomic_load_n(&r->consumer_offset, __ATOMIC_ACQUIRE))
        SetEvent(wait_handle); /* _ring_buffer_notify_consumer: "ring might not be empty" */
    pthread_mutex_unlock(&r->producer);
    map_unref(m);
    return 0;
}

/* bpf_ringbuf_output: 0, -ENOSPC when the ring is full, -EINVAL for another map type. */
int fake_ringbuf_output(int fd, const void *data, uint32_t length) {
    int64_t offset = fake_ringbuf_reserve(fd, length);
    if (offset < 0)
        return (int)offset;
    return fake_ringbuf_commit(fd, (uint64_t)offset, data, length, 0);
}

typedef int (*ring_buffer_sample_fn)(void *ctx, void *data, size_t size);

#define RB_MAGIC 0x72696e67u
typedef struct ring_buffer {
    uint32_t magic;
    map_t *map;
    HANDLE wait_handle;
} ring_buffer_t;

struct ring_buffer *ring_buffer__new(int map_fd, ring_buffer_sample_fn sample_cb, void *ctx,
                                     const void *opts) {
    (void)ctx;
    (void)opts; /* ring_buffer_opts: only sz; aperf passes none (synchronous mode) */
    if (!sample_cb) {
        errno = EINVAL;
        return NULL;
    }
    pthread_mutex_lock(&m_lock);
    map_t *m = map_of(map_fd);
    int type = m ? (int)m->type : -1;
    pthread_mutex_unlock(&m_lock);
    if (!m) {
        errno = EBADF;
        return NULL;
    }
    if (type != BPF_MAP_TYPE_RINGBUF || !(m = ringbuf_ref(map_fd))) {
        errno = EINVAL;
        return NULL;
    }
    ring_buffer_t *rb = calloc(1, sizeof *rb);
    rb->magic = RB_MAGIC;
    rb->map = m;
    rb->wait_handle = CreateEventW(NULL, 1, 0, NULL);
    (void)set_wait(m, 0, (ebpf_handle_t)rb->wait_handle); /* ebpf_map_set_wait_handle */
    pthread_mutex_lock(&m_lock);
    live_buffers++;
    pthread_mutex_unlock(&m_lock);
    return rb;
}

static int valid_rb(const ring_buffer_t *rb) {
    if (rb && rb->magic == RB_MAGIC)
        return 1;
    pthread_mutex_lock(&k_lock);
    misuse++;
    pthread_mutex_unlock(&k_lock);
    return 0;
}

int ebpf_ring_buffer_get_buffer(struct ring_buffer *rb, uint32_t index, void **consumer_page,
                                const void **producer_page, const uint8_t **data,
                                uint64_t *data_size) {
    if (!valid_rb(rb) || !consumer_page || !producer_page || !data || !data_size)
        return EBPF_INVALID_ARGUMENT;
    if (index != 0)
        return EBPF_OBJECT_NOT_FOUND;
    ring_t *r = &rb->map->rings[0];
    *consumer_page = (void *)&r->consumer_offset; /* ebpf_ring_buffer_consumer_page_t */
    *producer_page = (const void *)&r->producer_offset;
    *data = r->data;
    *data_size = r->size;
    return EBPF_SUCCESS;
}

ebpf_handle_t ebpf_ring_buffer_get_wait_handle(struct ring_buffer *rb) {
    if (!rb || !valid_rb(rb))
        return (ebpf_handle_t)-1;
    return (ebpf_handle_t)rb->wait_handle;
}

void ring_buffer__free(struct ring_buffer *rb) {
    if (!rb || !valid_rb(rb))
        return;
    (void)set_wait(rb->map, 0, (ebpf_handle_t)-1); /* fails: #5206 */
    CloseHandle(rb->wait_handle);
    rb->magic = 0; /* a later use is counted as misuse (the memory is kept for that) */
    pthread_mutex_lock(&m_lock);
    unref(rb->map);
    live_buffers--;
    pthread_mutex_unlock(&m_lock);
}

/* ------------------------------------------------------------ test probes */

int fake_misuse_count(void) {
    pthread_mutex_lock(&k_lock);
    int n = misuse;
    pthread_mutex_unlock(&k_lock);
    return n;
}

int fake_open_handles(void) {
    int n = 0;
    pthread_mutex_lock(&k_lock);
    for (int i = 0; i < MAX_EVENTS; i++)
        n += events[i].live;
    pthread_mutex_unlock(&k_lock);
    return n;
}

int fake_live_buffers(void) { return live_buffers; }

/* Threads blocked in a WaitFor* call on h (tests use it to know a waiter is parked). */
int fake_waiters(HANDLE h) {
    pthread_mutex_lock(&k_lock);
    event_t *e = event_of(h);
    int n = e ? e->waiters : -1;
    pthread_mutex_unlock(&k_lock);
    return n;
}
