/* aperf's optional compiled fast path: the per-span scans of perf rings and BPF ring
 * buffers, the building of events, the iterator of ``async for`` and the drain tick's look
 * at every ring's head, in C.
 *
 * Each function here does what a pure-Python function of aperf does, with the same
 * results (tests/unit/test_speedups.py compares them on random and adversarial rings,
 * also under AddressSanitizer); aperf/_native/speedups.py loads this module unless
 * APERF_NO_EXTENSIONS=1, and the pure path runs wherever it is missing.
 *
 * Built on CPython's limited API (3.11: the buffer protocol), so one abi3 wheel serves
 * every CPython from 3.11 on. The memory read here is written by the kernel and by
 * other processes: every length and offset is checked against the buffer before use,
 * and nothing is kept across calls but what a Python object owns.
 */

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Not in the limited API of 3.11. */
#define SETREF(dst, src)          \
    do {                          \
        PyObject *_old = (dst);   \
        (dst) = (src);            \
        Py_XDECREF(_old);         \
    } while (0)
#define OBJ(x) ((PyObject *)(x))

static PyObject *call1(PyObject *callable, PyObject *arg)
{
    return PyObject_CallFunctionObjArgs(callable, arg, NULL);
}

/* ---- shared state, set once by setup() ------------------------------------------------ */

static PyObject *BrokenRingError;  /* aperf.BrokenRingError */
static PyObject *TupleNew;         /* tuple.__new__ */
static newfunc tuple_tp_new;
static initproc object_tp_init;
/* 1 where tp_alloc plus PyTuple_SetItem builds a tuple subclass exactly as
 * tuple.__new__(cls, items) does (3.11 to 3.13; 3.14 caches a tuple's hash in the
 * object, which tuple.__new__ resets and tp_alloc does not). */
static int fast_tuples;

/* ---- little-endian reads (the formats are little-endian, as the pure struct formats) --- */

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }

/* ---- tuples of aperf's classes ---------------------------------------------------------- */

/* An instance of tuple subclass ``cls`` holding ``items`` (stolen, all non-NULL), as
 * tuple.__new__(cls, items) makes it. */
static PyObject *new_tuple_of(PyObject *cls, PyObject **items, Py_ssize_t n)
{
    Py_ssize_t i;
    if (fast_tuples) {
        allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)cls, Py_tp_alloc);
        PyObject *obj = alloc ? alloc((PyTypeObject *)cls, n) : NULL;
        if (obj == NULL) {
            for (i = 0; i < n; i++)
                Py_DECREF(items[i]);
            return NULL;
        }
        for (i = 0; i < n; i++) {
            if (PyTuple_SetItem(obj, i, items[i]) < 0) { /* steals even on failure */
                for (i = i + 1; i < n; i++)
                    Py_DECREF(items[i]);
                Py_DECREF(obj);
                return NULL;
            }
        }
        return obj;
    }
    PyObject *plain = PyTuple_New(n);
    if (plain == NULL) {
        for (i = 0; i < n; i++)
            Py_DECREF(items[i]);
        return NULL;
    }
    for (i = 0; i < n; i++)
        PyTuple_SetItem(plain, i, items[i]);
    PyObject *obj = PyObject_CallFunctionObjArgs(TupleNew, cls, plain, NULL);
    Py_DECREF(plain);
    return obj;
}

/* Whether cls(row) is tuple.__new__(cls, row) for a tuple row: a tuple subclass with
 * tuple's __new__, object's __init__ and an ordinary metaclass (aperf's records). */
static int is_plain_tuple_class(PyObject *cls)
{
    if (!PyType_Check(cls) || Py_TYPE(cls) != &PyType_Type)
        return 0;
    PyTypeObject *t = (PyTypeObject *)cls;
    if (!PyType_IsSubtype(t, &PyTuple_Type))
        return 0;
    return PyType_GetSlot(t, Py_tp_new) == (void *)tuple_tp_new &&
           PyType_GetSlot(t, Py_tp_init) == (void *)object_tp_init;
}

/* record_class(row) for a fresh tuple ``row`` (stolen). */
static PyObject *make_record(PyObject *record_class, int plain, PyObject *row)
{
    if (plain && PyTuple_CheckExact(row)) {
        Py_ssize_t n = PyTuple_Size(row), i;
        PyObject *stack[64];
        PyObject **items = n <= 64 ? stack : PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
        if (items == NULL) {
            Py_DECREF(row);
            return PyErr_NoMemory();
        }
        for (i = 0; i < n; i++) {
            items[i] = PyTuple_GetItem(row, i);
            Py_INCREF(items[i]);
        }
        Py_DECREF(row);
        PyObject *obj = new_tuple_of(record_class, items, n);
        if (items != stack)
            PyMem_Free(items);
        return obj;
    }
    PyObject *obj = call1(record_class, row);
    Py_DECREF(row);
    return obj;
}

static int tuple_class(PyObject *cls, const char *what)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple subclass", what);
        return 0;
    }
    return 1;
}

static PyObject *int_of(long long v) { return PyLong_FromLongLong(v); }

/* ---- perf records: _rings/perf/format.split_span ---------------------------------------- */

#define PERF_RECORD_LOST 2
#define PERF_RECORD_SAMPLE 9
#define PERF_HEADER 8

/* uniform_run_end: the end of the run of identical sample records at ``pos``; ``pos`` if
 * fewer than two are in line before the first slot whose type byte says LOST, -1 if
 * their 12 header and raw-size bytes differ.
 *
 * One pass: record k equal to record 0 goes on (its type byte is 9, not LOST); the first
 * one that differs ends the run where it stands if its type byte says LOST (no slot
 * before it did), and fails the run otherwise (the pure code would compare it, within
 * the records before the first LOST slot, and find it different). */
static Py_ssize_t perf_run_end(const uint8_t *b, Py_ssize_t pos, Py_ssize_t size, Py_ssize_t end)
{
    Py_ssize_t n = (end - pos) / size, k;
    uint64_t head;
    uint32_t raw;
    memcpy(&head, b + pos, 8);
    memcpy(&raw, b + pos + 8, 4);
    for (k = 1; k < n; k++) {
        const uint8_t *r = b + pos + k * size;
        uint64_t h;
        uint32_t w;
        memcpy(&h, r, 8);
        memcpy(&w, r + 8, 4);
        if (h == head && w == raw)
            continue;
        if (r[0] == PERF_RECORD_LOST)
            return k >= 2 ? pos + k * size : pos;
        return -1;
    }
    return n >= 2 ? pos + n * size : pos;
}

/* Segments are appended to ``segments``; a run of single payloads waits in *single. */
static int flush_single(PyObject *segments, PyObject **single)
{
    if (*single == NULL)
        return 0;
    PyObject *pair = Py_BuildValue("(OO)", *single, Py_False);
    Py_CLEAR(*single);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(segments, pair);
    Py_DECREF(pair);
    return rc;
}

static int append_single(PyObject **single, const uint8_t *data, Py_ssize_t length)
{
    if (*single == NULL && (*single = PyList_New(0)) == NULL)
        return -1;
    PyObject *payload = PyBytes_FromStringAndSize((const char *)data, length);
    if (payload == NULL)
        return -1;
    int rc = PyList_Append(*single, payload);
    Py_DECREF(payload);
    return rc;
}

static int append_steal(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* Raise BrokenRingError(key, message) with ``partial`` (or leave it as the class has it). */
static PyObject *raise_broken(PyObject *key, PyObject *message, PyObject *partial)
{
    if (message == NULL)
        return NULL;
    PyObject *exc = PyObject_CallFunctionObjArgs(BrokenRingError, key, message, NULL);
    Py_DECREF(message);
    if (exc == NULL)
        return NULL;
    if (partial != NULL && PyObject_SetAttrString(exc, "partial", partial) < 0) {
        Py_DECREF(exc);
        return NULL;
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* The call has ``want`` arguments (else TypeError with ``usage``) and setup() was called. */
static int ready(Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return 0;
    }
    if (BrokenRingError == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aperf._native._speedups.setup() was not called");
        return 0;
    }
    return 1;
}

/* The end of a split: (segments, count), or BrokenRingError(key, message) with ``partial``
 * set to the segments when asked (perf's), or NULL on an error already set. Every
 * reference passed in is released here, and the buffer. */
static PyObject *end_split(Py_buffer *view, PyObject *key, PyObject *segments, PyObject *single,
                           PyObject *message, long long count, int with_partial)
{
    PyObject *result = NULL;
    if (segments != NULL && !PyErr_Occurred() && flush_single(segments, &single) == 0) {
        if (message != NULL) {
            raise_broken(key, message, with_partial ? segments : NULL);
            message = NULL;
        }
        else {
            result = Py_BuildValue("(OL)", segments, count);
        }
    }
    PyBuffer_Release(view);
    Py_XDECREF(segments);
    Py_XDECREF(single);
    Py_XDECREF(message);
    return result;
}

PyDoc_STRVAR(perf_split_doc,
"perf_split(key, span, Run) -> (segments, other)\n\n"
"_rings/perf/format.split_span(key, span) with its default run_end, in C (``Run``: the\n"
"class of its runs, _rings.seam.Run).");

static PyObject *perf_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready(nargs, 3, "perf_split(key, span, Run)"))
        return NULL;
    PyObject *key = args[0], *span = args[1], *run_type = args[2];
    if (!tuple_class(run_type, "Run"))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(span, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *b = view.buf;
    Py_ssize_t end = view.len, pos = 0;
    long long other = 0;
    int fast = 1;
    PyObject *segments = PyList_New(0), *single = NULL, *message = NULL;
    if (segments == NULL)
        goto fail;
    while (pos < end) {
        Py_ssize_t left = end - pos;
        if (left < PERF_HEADER) {
            message = PyUnicode_FromFormat("%zd trailing bytes are shorter than a header", left);
            break;
        }
        uint32_t kind = rd32(b + pos);
        Py_ssize_t size = rd16(b + pos + 6);
        if (size < PERF_HEADER || size > left) {
            message = PyUnicode_FromFormat("record at byte %zd claims size %zd of %zd", pos, size, left);
            break;
        }
        if (kind == PERF_RECORD_SAMPLE) {
            if (size < 12) {
                message = PyUnicode_FromFormat("sample at byte %zd is only %zd bytes", pos, size);
                break;
            }
            uint32_t raw = rd32(b + pos + 8);
            if (12 + (uint64_t)raw > (uint64_t)size) {
                message = PyUnicode_FromFormat("sample at byte %zd claims %lu raw bytes in %zd",
                                               pos, (unsigned long)raw, size);
                break;
            }
            if (fast) {
                Py_ssize_t stop = perf_run_end(b, pos, size, end);
                if (stop > pos) {
                    if (flush_single(segments, &single) < 0)
                        goto fail;
                    PyObject *items[6] = {span, int_of(pos), int_of((stop - pos) / size),
                                          int_of(size), int_of(12), int_of(raw)};
                    Py_INCREF(span);
                    if (!items[1] || !items[2] || !items[3] || !items[4] || !items[5]) {
                        for (int i = 0; i < 6; i++)
                            Py_XDECREF(items[i]);
                        goto fail;
                    }
                    if (append_steal(segments, new_tuple_of(run_type, items, 6)) < 0)
                        goto fail;
                    pos = stop;
                    continue;
                }
                /* A failed check is not retried record by record (quadratic); the next
                 * lost record starts a fresh attempt. */
                fast = stop == pos;
            }
            if (append_single(&single, b + pos + 12, (Py_ssize_t)raw) < 0)
                goto fail;
        }
        else if (kind == PERF_RECORD_LOST) {
            if (size < 24) {
                message = PyUnicode_FromFormat("lost record at byte %zd is only %zd bytes", pos, size);
                break;
            }
            if (flush_single(segments, &single) < 0 ||
                append_steal(segments, PyLong_FromUnsignedLongLong(rd64(b + pos + 16))) < 0)
                goto fail;
            fast = 1;
        }
        else {
            other++;
        }
        pos += size;
    }
    return end_split(&view, key, segments, single, message, other, 1);
fail:
    Py_CLEAR(segments);
    return end_split(&view, key, segments, single, message, other, 1);
}

/* ---- BPF ring buffer records: _rings/ringbuf/format.py ---------------------------------- */

#define RB_BUSY 0x80000000u
#define RB_DISCARD 0x40000000u
#define RB_LENGTH (RB_DISCARD - 1)
#define RB_HEADER 8

static inline uint64_t rb_step(uint32_t word) { return ((uint64_t)(word & RB_LENGTH) + RB_HEADER + 7) & ~(uint64_t)7; }

PyDoc_STRVAR(ringbuf_split_doc,
"ringbuf_split(key, span) -> (segments, discarded)\n\n"
"_rings/ringbuf/format.split_span(key, span), in C.");

static PyObject *ringbuf_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready(nargs, 2, "ringbuf_split(key, span)"))
        return NULL;
    PyObject *key = args[0];
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *b = view.buf;
    Py_ssize_t end = view.len, pos = 0;
    long long discarded = 0;
    PyObject *segments = PyList_New(0), *single = NULL, *message = NULL;
    if (segments == NULL)
        goto fail;
    while (pos < end) {
        Py_ssize_t left = end - pos;
        if (left < RB_HEADER) {
            message = PyUnicode_FromFormat("%zd trailing bytes are shorter than a header", left);
            break;
        }
        uint32_t word = rd32(b + pos);
        if (word & RB_BUSY) {
            message = PyUnicode_FromFormat("record at byte %zd is still reserved", pos);
            break;
        }
        Py_ssize_t length = (Py_ssize_t)(word & RB_LENGTH);
        uint64_t step64 = rb_step(word);
        if (step64 > (uint64_t)left) {
            message = PyUnicode_FromFormat("record at byte %zd claims %llu of %zd bytes",
                                           pos, (unsigned long long)step64, left);
            break;
        }
        Py_ssize_t step = (Py_ssize_t)step64, count = left / step, same = 1;
        while (same < count && rd32(b + pos + same * step) == word)
            same++;
        if (word & RB_DISCARD) {
            discarded += same;
        }
        else if (same > 1) {
            PyObject *payloads = PyList_New(same);
            if (payloads == NULL)
                goto fail;
            for (Py_ssize_t i = 0; i < same; i++) {
                PyObject *p = PyBytes_FromStringAndSize((const char *)b + pos + i * step + RB_HEADER, length);
                if (p == NULL) {
                    Py_DECREF(payloads);
                    goto fail;
                }
                PyList_SetItem(payloads, i, p);
            }
            if (flush_single(segments, &single) < 0) {
                Py_DECREF(payloads);
                goto fail;
            }
            if (append_steal(segments, Py_BuildValue("(NO)", payloads, Py_True)) < 0)
                goto fail;
        }
        else if (append_single(&single, b + pos + RB_HEADER, length) < 0) {
            goto fail;
        }
        pos += same * step;
    }
    /* As the pure split: no partial. */
    return end_split(&view, key, segments, single, message, discarded, 0);
fail:
    Py_CLEAR(segments);
    return end_split(&view, key, segments, single, message, discarded, 0);
}

PyDoc_STRVAR(ringbuf_committed_end_doc,
"ringbuf_committed_end(words, offset, mask, pos, prod) -> end\n\n"
"RingBufferRing._committed_end(pos, prod) over the ring's mapping ``words``, in C: the\n"
"position after the last committed record in [pos, prod), stopping at a BUSY one.");

static PyObject *ringbuf_committed_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready(nargs, 5, "ringbuf_committed_end(words, offset, mask, pos, prod)"))
        return NULL;
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    unsigned long long mask = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long pos = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long prod = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset must not be negative");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *b = view.buf;
    uint64_t len = (uint64_t)view.len;
    PyObject *message = NULL;
    while (pos < prod) {
        uint64_t at = (uint64_t)offset + (pos & mask);
        uint64_t word_at = at & ~(uint64_t)3; /* words[at >> 2] */
        if (at + 4 > len || word_at + 4 > len) {
            message = PyUnicode_FromFormat("record at position %llu lies past the mapping", pos);
            break;
        }
        uint32_t word;
        memcpy(&word, b + word_at, 4); /* the kernel writes it in the CPU's byte order */
        if (word & RB_BUSY)
            break; /* reserved, not committed: its commit wakes the reader */
        uint64_t step = rb_step(word);
        if (step > prod - pos) {
            message = PyUnicode_FromFormat("record at position %llu claims %llu bytes, %llu written",
                                           pos, (unsigned long long)step, prod - pos);
            break;
        }
        uint64_t count = (prod - pos) / step, same = 0;
        if (count >= 2) {
            /* The run of records whose header, read where the first one's position says
             * (unaligned if that is), is this word; at least the first record. */
            while (same < count && at + same * step + 4 <= len && rd32(b + at + same * step) == word)
                same++;
        }
        pos += step * (same > 1 ? same : 1);
    }
    PyBuffer_Release(&view);
    if (message != NULL) {
        PyObject *key = PyLong_FromLong(-1);
        if (key == NULL) {
            Py_DECREF(message);
            return NULL;
        }
        raise_broken(key, message, NULL);
        Py_DECREF(key);
        return NULL;
    }
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(pos);
}

/* ---- a perf ring's control page: take() and the head's look ----------------------------- */

static PyObject *ClosedResourceError;

typedef struct {
    PyObject_HEAD
    uint64_t *head; /* data_head, written by the kernel */
    uint64_t *tail; /* data_tail, ours */
    const uint8_t *data;
    uint64_t size;
    int mapped;
} RingCell;

static PyTypeObject *RingCellType, *RingWatchType;

static int cell_check(RingCell *cell)
{
    if (!cell->mapped) {
        PyErr_SetString(ClosedResourceError ? ClosedResourceError : PyExc_ValueError,
                        "perf ring memory was released");
        return 0;
    }
    return 1;
}

static int cell_init(RingCell *self, PyObject *args, PyObject *kwds)
{
    PyObject *address;
    if (!PyArg_ParseTuple(args, "O:RingCell", &address))
        return -1;
    uint8_t *base = PyLong_AsVoidPtr(address);
    if (base == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a ring's base address cannot be NULL");
        return -1;
    }
    uint64_t data_offset, data_size;
    memcpy(&data_offset, base + 1040, 8);
    memcpy(&data_size, base + 1048, 8);
    if (data_size == 0 || (data_size & (data_size - 1)) || data_offset < 1056 || data_offset % 8) {
        PyErr_Format(PyExc_ValueError, "perf ring control page says data at %llu, %llu bytes",
                     (unsigned long long)data_offset, (unsigned long long)data_size);
        return -1;
    }
    self->head = (uint64_t *)(base + 1024);
    self->tail = (uint64_t *)(base + 1032);
    self->data = base + data_offset;
    self->size = data_size;
    self->mapped = 1;
    return 0;
}

static PyObject *cell_positions(RingCell *self, PyObject *unused)
{
    if (!cell_check(self))
        return NULL;
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_ACQUIRE); /* before the data below it */
    uint64_t tail = __atomic_load_n(self->tail, __ATOMIC_RELAXED);
    return Py_BuildValue("(KK)", (unsigned long long)head, (unsigned long long)tail);
}

static PyObject *cell_take(RingCell *self, PyObject *key)
{
    if (!cell_check(self))
        return NULL;
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_ACQUIRE);
    uint64_t tail = __atomic_load_n(self->tail, __ATOMIC_RELAXED);
    uint64_t size = self->size, length = head - tail;
    if (head < tail || length > size) {
        PyObject *message = head < tail
            ? PyUnicode_FromFormat("head %llu and tail %llu are -%llu bytes apart in a %llu-byte ring",
                                   (unsigned long long)head, (unsigned long long)tail,
                                   (unsigned long long)(tail - head), (unsigned long long)size)
            : PyUnicode_FromFormat("head %llu and tail %llu are %llu bytes apart in a %llu-byte ring",
                                   (unsigned long long)head, (unsigned long long)tail,
                                   (unsigned long long)length, (unsigned long long)size);
        return raise_broken(key, message, NULL);
    }
    if (length == 0)
        return PyBytes_FromStringAndSize(NULL, 0);
    uint64_t start = tail & (size - 1), first = size - start;
    PyObject *span = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
    if (span == NULL)
        return NULL;
    char *out = PyBytes_AsString(span);
    if (out == NULL) {
        Py_DECREF(span);
        return NULL;
    }
    if (length <= first) {
        memcpy(out, self->data + start, length);
    }
    else {
        memcpy(out, self->data + start, first);
        memcpy(out + first, self->data, length - first);
    }
    __atomic_store_n(self->tail, head, __ATOMIC_RELEASE); /* after the copy: the space is free */
    return span;
}

static PyObject *cell_pending(RingCell *self, PyObject *unused)
{
    if (!cell_check(self))
        return NULL;
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_ACQUIRE);
    uint64_t tail = __atomic_load_n(self->tail, __ATOMIC_RELAXED);
    return PyLong_FromLongLong((long long)head - (long long)tail);
}

static PyObject *cell_release(RingCell *self, PyObject *unused)
{
    self->mapped = 0;
    self->head = self->tail = NULL;
    self->data = NULL;
    Py_RETURN_NONE;
}

static PyObject *cell_get_mapped(RingCell *self, void *closure) { return PyBool_FromLong(self->mapped); }

static PyObject *cell_get_size(RingCell *self, void *closure) { return PyLong_FromUnsignedLongLong(self->size); }

static void cell_dealloc(RingCell *self)
{
    PyTypeObject *tp = Py_TYPE(OBJ(self));
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef cell_methods[] = {
    {"positions", (PyCFunction)cell_positions, METH_NOARGS, "(head, tail), the head read first."},
    {"pending_bytes", (PyCFunction)cell_pending, METH_NOARGS, "head - tail."},
    {"take", (PyCFunction)cell_take, METH_O,
     "take(key) -> bytes: PerfRing.take(): every complete record copied out, the space released."},
    {"release", (PyCFunction)cell_release, METH_NOARGS,
     "Forget the mapping (before it is unmapped): later calls raise ClosedResourceError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef cell_getset[] = {
    {"mapped", (getter)cell_get_mapped, NULL, "Whether the mapping may be read.", NULL},
    {"size", (getter)cell_get_size, NULL, "Data bytes of the ring.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot cell_slots[] = {
    {Py_tp_doc, "RingCell(base): a perf ring's control page at address ``base`` (mmapped by\n"
                "libbpf) and its data area; release() before the mapping goes."},
    {Py_tp_init, cell_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, cell_dealloc},
    {Py_tp_methods, cell_methods},
    {Py_tp_getset, cell_getset},
    {0, NULL},
};

static PyType_Spec cell_spec = {
    "aperf._native._speedups.RingCell", sizeof(RingCell), 0, Py_TPFLAGS_DEFAULT, cell_slots,
};

/* ---- the drain tick's look at every ring ------------------------------------------------ */

typedef struct {
    PyObject *key, *ring, *cell; /* cell: the ring's _cell when it is a RingCell, else NULL */
} WatchEntry;

typedef struct {
    PyObject_HEAD
    WatchEntry *entries;
    char *busy;
    Py_ssize_t n, cap;
    int walking; /* a busy() runs: a ring's pending_bytes() calling busy() again is refused */
} RingWatch;

static void watch_clear_from(RingWatch *self, Py_ssize_t first)
{
    for (Py_ssize_t i = first; i < self->n; i++) {
        Py_CLEAR(self->entries[i].key);
        Py_CLEAR(self->entries[i].ring);
        Py_CLEAR(self->entries[i].cell);
    }
    if (first < self->n)
        self->n = first;
}

static PyObject *cell_of(PyObject *ring)
{
    PyObject *cell = PyObject_GetAttrString(ring, "_cell");
    if (cell == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return cell;
}

PyDoc_STRVAR(watch_busy_doc,
"busy(rings) -> list\n\n"
"The keys of the rings of dict ``rings`` that hold something, in order: what\n"
"``[key for key, ring in rings.items() if ring.pending_bytes()]`` says, with one C loop\n"
"over the heads of the rings that have a ``_cell`` (a RingCell standing for their\n"
"pending_bytes()), remembered from one call to the next.");

static PyObject *watch_walk(RingWatch *self, PyObject *rings);

static PyObject *watch_busy(RingWatch *self, PyObject *rings)
{
    if (!PyDict_Check(rings)) {
        PyErr_SetString(PyExc_TypeError, "busy() takes the dict of rings (a dict or a subclass)");
        return NULL;
    }
    if (self->walking) {
        PyErr_SetString(PyExc_RuntimeError, "RingWatch.busy() called from a ring it asks");
        return NULL;
    }
    self->walking = 1;
    PyObject *out = watch_walk(self, rings);
    self->walking = 0;
    return out;
}

static PyObject *watch_walk(RingWatch *self, PyObject *rings)
{
    Py_ssize_t size = PyDict_Size(rings), it = 0, i = 0;
    if (size > self->cap) {
        Py_ssize_t cap = size * 2;
        WatchEntry *entries = PyMem_Realloc(self->entries, sizeof(WatchEntry) * (size_t)cap);
        if (entries == NULL)
            return PyErr_NoMemory();
        self->entries = entries;
        char *busy = PyMem_Realloc(self->busy, (size_t)cap);
        if (busy == NULL)
            return PyErr_NoMemory();
        self->busy = busy;
        memset(self->entries + self->cap, 0, sizeof(WatchEntry) * (size_t)(cap - self->cap));
        self->cap = cap;
    }
    PyObject *key, *ring;
    /* First every entry is made current (no Python code runs while the dict is walked),
     * then the heads are read; rings without a cell are asked afterwards. */
    while (PyDict_Next(rings, &it, &key, &ring)) {
        if (i >= size)
            break; /* cannot happen: nothing runs between PyDict_Size and here */
        WatchEntry *e = &self->entries[i];
        if (i >= self->n || e->ring != ring || e->key != key) {
            Py_INCREF(key);
            Py_INCREF(ring);
            SETREF(e->key, key);
            SETREF(e->ring, ring);
            Py_CLEAR(e->cell);
            if (i >= self->n)
                self->n = i + 1;
        }
        i++;
    }
    watch_clear_from(self, i);
    /* Each ring's control page is a page of its own: after the loop slept, reading it
     * costs a TLB and a cache miss. Ask for them all first, so that the misses overlap. */
    for (i = 0; i < self->n; i++) {
        RingCell *c = (RingCell *)self->entries[i].cell;
        if (c != NULL && Py_TYPE(OBJ(c)) == RingCellType && c->mapped)
            __builtin_prefetch(c->head);
    }
    for (i = 0; i < self->n; i++) {
        WatchEntry *e = &self->entries[i];
        if (e->cell == NULL) {
            PyObject *cell = cell_of(e->ring);
            if (cell == NULL)
                return NULL;
            e->cell = cell; /* None: ask the ring */
        }
        RingCell *c = (RingCell *)e->cell;
        if (Py_TYPE(e->cell) == RingCellType && c->mapped) {
            uint64_t head = __atomic_load_n(c->head, __ATOMIC_ACQUIRE);
            self->busy[i] = head != __atomic_load_n(c->tail, __ATOMIC_RELAXED);
        }
        else {
            PyObject *pending = PyObject_CallMethod(e->ring, "pending_bytes", NULL);
            int truth = pending == NULL ? -1 : PyObject_IsTrue(pending);
            Py_XDECREF(pending);
            if (truth < 0)
                return NULL;
            self->busy[i] = (char)truth;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (i = 0; i < self->n; i++) {
        if (self->busy[i] && PyList_Append(out, self->entries[i].key) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *watch_forget(RingWatch *self, PyObject *unused)
{
    if (self->walking) {
        PyErr_SetString(PyExc_RuntimeError, "RingWatch.forget() called from a ring it asks");
        return NULL;
    }
    watch_clear_from(self, 0);
    Py_RETURN_NONE;
}

static int watch_traverse(RingWatch *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(OBJ(self)));
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Py_VISIT(self->entries[i].key);
        Py_VISIT(self->entries[i].ring);
        Py_VISIT(self->entries[i].cell);
    }
    return 0;
}

static int watch_clear(RingWatch *self)
{
    watch_clear_from(self, 0);
    return 0;
}

static void watch_dealloc(RingWatch *self)
{
    PyTypeObject *tp = Py_TYPE(OBJ(self));
    PyObject_GC_UnTrack(self);
    watch_clear_from(self, 0);
    PyMem_Free(self->entries);
    PyMem_Free(self->busy);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef watch_methods[] = {
    {"busy", (PyCFunction)watch_busy, METH_O, watch_busy_doc},
    {"forget", (PyCFunction)watch_forget, METH_NOARGS, "Drop every ring remembered."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot watch_slots[] = {
    {Py_tp_doc, "RingWatch(): the rings of a reader, their heads read in one call (busy())."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, watch_dealloc},
    {Py_tp_traverse, watch_traverse},
    {Py_tp_clear, watch_clear},
    {Py_tp_methods, watch_methods},
    {0, NULL},
};

static PyType_Spec watch_spec = {
    "aperf._native._speedups.RingWatch", sizeof(RingWatch), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, watch_slots,
};

/* The dealloc of a GC type whose tp_clear drops every reference it holds. */
static void gc_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    inquiry clear = (inquiry)PyType_GetSlot(tp, Py_tp_clear);
    clear(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

/* ---- events: _reading/build.EventBuilder ------------------------------------------------ */

/* out.append(item), item stolen. */
static int out_append(PyObject *out, PyObject *append, PyObject *item)
{
    if (item == NULL)
        return -1;
    int rc = 0;
    if (append == NULL) {
        rc = PyList_Append(out, item);
    }
    else {
        PyObject *r = call1(append, item);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(item);
    return rc;
}

static PyObject *appender(PyObject *out)
{
    if (PyList_CheckExact(out))
        return Py_NewRef(Py_None);
    return PyObject_GetAttrString(out, "append");
}

PyDoc_STRVAR(build_run_doc,
"build_run(sample, cpu, span, at, count, stride, skip, size, values, record, out)\n\n"
"Append ``count`` events ``sample(cpu, payload, value)`` to ``out``: the payloads are the\n"
"``size`` bytes ``skip`` bytes into each of the records of ``stride`` bytes from byte\n"
"``at`` of ``span``; the values come from iterator ``values`` (None: every value None),\n"
"each made ``record(row)`` unless ``record`` is None. ``values`` may also be a plan\n"
"``(order, ((offset, code), ...))`` (SizedDecoder.fields_plan): each value is then the\n"
"row ``struct`` would unpack from the payload, read here. What EventBuilder.run's zip of\n"
"Run.each_payload and the decoder's rows builds, without the zip.");

/* A field of a plan: its offset in the payload, its struct code and size. */
typedef struct {
    Py_ssize_t offset;
    char code;
    int size;
} Field;

static int standard_size(char code)
{
    switch (code) {
    case 'b': case 'B': case '?': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': case 'l': case 'L': return 4;
    case 'q': case 'Q': case 'd': return 8;
    default: return 0;
    }
}

/* The plan ``(order, ((offset, code), ...))`` as Fields (PyMem_Free them), each checked to
 * lie within ``size`` bytes; NULL with an error set. */
static Field *read_plan(PyObject *plan, Py_ssize_t size, Py_ssize_t *n, int *big)
{
    PyObject *order = PyTuple_Check(plan) && PyTuple_Size(plan) == 2 ? PyTuple_GetItem(plan, 0) : NULL;
    PyObject *fields = order ? PyTuple_GetItem(plan, 1) : NULL;
    const char *o = order && PyUnicode_Check(order) ? PyUnicode_AsUTF8AndSize(order, NULL) : NULL;
    if (o == NULL || (strcmp(o, "<") && strcmp(o, ">")) || !PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "build_run: a plan is (order, ((offset, code), ...))");
        return NULL;
    }
    *big = o[0] == '>';
    *n = PyTuple_Size(fields);
    Field *out = PyMem_Malloc(sizeof(Field) * (size_t)(*n > 0 ? *n : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *pair = PyTuple_GetItem(fields, i);
        PyObject *code = PyTuple_Check(pair) && PyTuple_Size(pair) == 2 ? PyTuple_GetItem(pair, 1) : NULL;
        const char *c = code && PyUnicode_Check(code) ? PyUnicode_AsUTF8AndSize(code, NULL) : NULL;
        out[i].offset = c ? PyLong_AsSsize_t(PyTuple_GetItem(pair, 0)) : -1;
        out[i].code = c ? c[0] : 0;
        out[i].size = c && c[1] == 0 ? standard_size(c[0]) : 0;
        if (PyErr_Occurred() || out[i].size == 0 || out[i].offset < 0 ||
            out[i].offset > size - out[i].size) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "build_run: a plan's field is unknown or lies "
                                                  "past the payload");
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

/* The value struct unpacks for one field, at standard size and the given byte order. */
static PyObject *field_value(const uint8_t *p, const Field *f, int big)
{
    uint64_t bits = 0; /* the field's bytes as a number, in its byte order */
    for (int i = 0; i < f->size; i++)
        bits = (bits << 8) | p[big ? i : f->size - 1 - i];
    switch (f->code) {
    case 'b': return PyLong_FromLong((int8_t)bits);
    case 'B': case 'H': case 'I': case 'L': return PyLong_FromUnsignedLongLong(bits);
    case '?': return PyBool_FromLong(p[0] != 0);
    case 'h': return PyLong_FromLong((int16_t)bits);
    case 'i': case 'l': return PyLong_FromLong((int32_t)bits);
    case 'q': return PyLong_FromLongLong((int64_t)bits);
    case 'Q': return PyLong_FromUnsignedLongLong(bits);
    case 'd': {
        double v;
        memcpy(&v, &bits, 8);
        return PyFloat_FromDouble(v);
    }
    default:
        PyErr_SetString(PyExc_SystemError, "build_run: a field code slipped through");
        return NULL;
    }
}

/* The row of a payload by a plan: a record (``record``, plain or called) or a tuple. */
static PyObject *row_by_plan(const uint8_t *p, const Field *fields, Py_ssize_t n, int big,
                             PyObject *record, int plain)
{
    PyObject *stack[64];
    PyObject **items = n <= 64 ? stack : PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    if (items == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((items[i] = field_value(p + fields[i].offset, &fields[i], big)) == NULL) {
            while (i-- > 0)
                Py_DECREF(items[i]);
            if (items != stack)
                PyMem_Free(items);
            return NULL;
        }
    }
    PyObject *row;
    if (record != Py_None && plain) {
        row = new_tuple_of(record, items, n);
    }
    else {
        row = PyTuple_New(n);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (row == NULL)
                Py_DECREF(items[i]);
            else
                PyTuple_SetItem(row, i, items[i]);
        }
        if (row != NULL && record != Py_None)
            row = make_record(record, 0, row);
    }
    if (items != stack)
        PyMem_Free(items);
    return row;
}

static PyObject *build_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "build_run(sample, cpu, span, at, count, stride, skip, size, values, record, out)");
        return NULL;
    }
    PyObject *sample = args[0], *cpu = args[1], *span = args[2], *values = args[8];
    PyObject *record = args[9], *out = args[10];
    Py_ssize_t at = PyLong_AsSsize_t(args[3]), count = PyLong_AsSsize_t(args[4]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[5]), skip = PyLong_AsSsize_t(args[6]);
    Py_ssize_t size = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred() || !tuple_class(sample, "sample"))
        return NULL;
    if (at < 0 || count < 0 || stride <= 0 || skip < 0 || size < 0 || size > stride - skip) {
        PyErr_SetString(PyExc_ValueError, "build_run: a negative offset or a payload past its record");
        return NULL;
    }
    Field *plan = NULL;
    Py_ssize_t nfields = 0;
    int big = 0;
    if (PyTuple_Check(values)) {
        if ((plan = read_plan(values, size, &nfields, &big)) == NULL)
            return NULL;
    }
    else if (values != Py_None && !PyIter_Check(values)) {
        PyErr_SetString(PyExc_TypeError, "build_run: values must be an iterator, a plan or None");
        return NULL;
    }
    int plain = 0;
    if (record != Py_None) {
        if (values == Py_None) {
            PyErr_SetString(PyExc_TypeError, "build_run: a record class needs values");
            return NULL;
        }
        plain = is_plain_tuple_class(record);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(span, &view, PyBUF_SIMPLE) < 0) {
        PyMem_Free(plan);
        return NULL;
    }
    if (count > 0 && (at > view.len || (view.len - at) / stride < count)) {
        PyBuffer_Release(&view);
        PyMem_Free(plan);
        PyErr_SetString(PyExc_ValueError, "build_run: the records lie past the end of the span");
        return NULL;
    }
    PyObject *append = appender(out);
    if (append == NULL) {
        PyBuffer_Release(&view);
        PyMem_Free(plan);
        return NULL;
    }
    if (append == Py_None)
        Py_CLEAR(append);
    const char *b = (const char *)view.buf + at + skip;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *payload = PyBytes_FromStringAndSize(b + i * stride, size);
        if (payload == NULL)
            goto fail;
        PyObject *value;
        if (values == Py_None) {
            value = Py_NewRef(Py_None);
        }
        else if (plan != NULL) {
            value = row_by_plan((const uint8_t *)b + i * stride, plan, nfields, big, record, plain);
            if (value == NULL) {
                Py_DECREF(payload);
                goto fail;
            }
        }
        else {
            value = PyIter_Next(values);
            if (value == NULL) {
                Py_DECREF(payload);
                if (PyErr_Occurred())
                    goto fail;
                break; /* as zip: the shortest ends it */
            }
            if (record != Py_None && (value = make_record(record, plain, value)) == NULL) {
                Py_DECREF(payload);
                goto fail;
            }
        }
        PyObject *items[3] = {Py_NewRef(cpu), payload, value};
        if (out_append(out, append, new_tuple_of(sample, items, 3)) < 0)
            goto fail;
    }
    PyBuffer_Release(&view);
    PyMem_Free(plan);
    Py_XDECREF(append);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&view);
    PyMem_Free(plan);
    Py_XDECREF(append);
    return NULL;
}

PyDoc_STRVAR(build_payloads_doc,
"build_payloads(sample, cpu, payloads, values, out)\n\n"
"Append ``sample(cpu, payload, value)`` for each payload of list ``payloads`` and value of\n"
"list ``values`` (None: every value None) to ``out``, as far as the shorter goes.");

static PyObject *build_payloads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "build_payloads(sample, cpu, payloads, values, out)");
        return NULL;
    }
    PyObject *sample = args[0], *cpu = args[1], *payloads = args[2], *values = args[3];
    PyObject *out = args[4];
    if (!tuple_class(sample, "sample"))
        return NULL;
    if (!PyList_Check(payloads) || (values != Py_None && !PyList_Check(values))) {
        PyErr_SetString(PyExc_TypeError, "build_payloads: payloads and values must be lists");
        return NULL;
    }
    PyObject *append = appender(out);
    if (append == NULL)
        return NULL;
    if (append == Py_None)
        Py_CLEAR(append);
    /* Sizes are read at each step: appending to ``out`` runs no code of theirs, but a
     * list is only borrowed from. */
    for (Py_ssize_t i = 0; i < PyList_Size(payloads); i++) {
        if (values != Py_None && i >= PyList_Size(values))
            break;
        PyObject *payload = PyList_GetItem(payloads, i);
        PyObject *value = values == Py_None ? Py_None : PyList_GetItem(values, i);
        if (payload == NULL || value == NULL)
            goto fail;
        PyObject *items[3] = {Py_NewRef(cpu), Py_NewRef(payload), Py_NewRef(value)};
        if (out_append(out, append, new_tuple_of(sample, items, 3)) < 0)
            goto fail;
    }
    Py_XDECREF(append);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(append);
    return NULL;
}

PyDoc_STRVAR(records_doc,
"records(record, rows) -> list\n\n"
"[record(row) for row in rows]: rows a list of tuples, record a tuple subclass.");

static PyObject *records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "records(record, rows): rows must be a list");
        return NULL;
    }
    PyObject *record = args[0], *rows = args[1];
    int plain = is_plain_tuple_class(record);
    Py_ssize_t n = PyList_Size(rows);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n && i < PyList_Size(rows); i++) {
        PyObject *row = PyList_GetItem(rows, i);
        if (row == NULL || append_steal(out, make_record(record, plain, Py_NewRef(row))) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* ---- the iterator of async for, batches() and arrays(): _drivers/stream._Items ---------- */

/* Items(next_item, slow): __anext__() returns an awaitable that, when awaited, hands out
 * next_item() at once (no coroutine, no StopIteration) or, when it raises IndexError,
 * becomes the coroutine slow() (the pure iterator's __anext__, which fills and waits).
 * Nothing is taken before the awaitable is awaited: an anext() cancelled before it
 * ran loses nothing, as with the pure coroutine. */

typedef struct {
    PyObject_HEAD
    PyObject *next_item;
    PyObject *slow;
    PyObject *spare; /* an awaitable nothing else holds, for the next __anext__ */
} Items;

typedef struct {
    PyObject_HEAD
    PyObject *items;
    PyObject *delegate; /* slow()'s coroutine, once the front was empty */
    int state;          /* 0 fresh, 1 delegating, 2 done */
} Next;

static PyTypeObject *ItemsType, *NextType;

static int items_init(Items *self, PyObject *args, PyObject *kwds)
{
    PyObject *next_item, *slow;
    if (!PyArg_ParseTuple(args, "OO:Items", &next_item, &slow))
        return -1;
    if (!PyCallable_Check(next_item) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "Items(next_item, slow) takes two callables");
        return -1;
    }
    SETREF(self->next_item, Py_NewRef(next_item));
    SETREF(self->slow, Py_NewRef(slow));
    return 0;
}

static PyObject *items_aiter(PyObject *self) { return Py_NewRef(self); }

static PyObject *items_anext(Items *self)
{
    Next *next = (Next *)self->spare;
    if (next != NULL && Py_REFCNT(OBJ(next)) == 1) {
        /* Only this iterator holds it: the last await finished with it. */
        Py_CLEAR(next->delegate);
        next->state = 0;
        return Py_NewRef(OBJ(next));
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(NextType, Py_tp_alloc);
    next = (Next *)alloc(NextType, 0);
    if (next == NULL)
        return NULL;
    next->items = Py_NewRef(OBJ(self));
    next->delegate = NULL;
    next->state = 0;
    SETREF(self->spare, Py_NewRef(OBJ(next)));
    return (PyObject *)next;
}

static int items_traverse(Items *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(OBJ(self)));
    Py_VISIT(self->next_item);
    Py_VISIT(self->slow);
    Py_VISIT(self->spare);
    return 0;
}

static int items_clear(Items *self)
{
    Py_CLEAR(self->next_item);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->spare);
    return 0;
}

static PyType_Slot items_slots[] = {
    {Py_tp_doc, "Items(next_item, slow): the stream's async iterator, its fast step in C."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, items_init},
    {Py_tp_dealloc, gc_dealloc},
    {Py_tp_traverse, items_traverse},
    {Py_tp_clear, items_clear},
    {Py_am_aiter, items_aiter},
    {Py_am_anext, items_anext},
    {0, NULL},
};

static PyType_Spec items_spec = {
    "aperf._native._speedups.Items", sizeof(Items), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    items_slots,
};

static PySendResult next_send_impl(Next *self, PyObject *arg, PyObject **result)
{
    *result = NULL;
    if (self->state == 2) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse an already awaited anext()");
        return PYGEN_ERROR;
    }
    if (self->state == 0) {
        Items *items = (Items *)self->items;
        PyObject *item = PyObject_CallNoArgs(items->next_item);
        if (item != NULL) {
            self->state = 2;
            *result = item;
            return PYGEN_RETURN;
        }
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) {
            self->state = 2;
            return PYGEN_ERROR;
        }
        PyErr_Clear();
        self->delegate = PyObject_CallNoArgs(items->slow);
        if (self->delegate == NULL) {
            self->state = 2;
            return PYGEN_ERROR;
        }
        self->state = 1;
    }
    PySendResult r = PyIter_Send(self->delegate, arg, result);
    if (r != PYGEN_NEXT) {
        self->state = 2;
        Py_CLEAR(self->delegate);
    }
    return r;
}

static PySendResult next_am_send(PyObject *self, PyObject *arg, PyObject **result)
{
    return next_send_impl((Next *)self, arg, result);
}

/* The generator protocol for callers that do not use am_send. */
static PyObject *next_result(PySendResult r, PyObject *result)
{
    if (r == PYGEN_NEXT)
        return result;
    if (r == PYGEN_RETURN) {
        /* StopIteration(value), the value never unpacked as arguments. */
        PyObject *exc = call1(PyExc_StopIteration, result);
        Py_DECREF(result);
        if (exc != NULL) {
            PyErr_SetObject(PyExc_StopIteration, exc);
            Py_DECREF(exc);
        }
    }
    return NULL;
}

static PyObject *next_iternext(PyObject *self)
{
    PyObject *result;
    PySendResult r = next_send_impl((Next *)self, Py_None, &result);
    return next_result(r, result);
}

static PyObject *next_send(PyObject *self, PyObject *arg)
{
    PyObject *result;
    PySendResult r = next_send_impl((Next *)self, arg, &result);
    return next_result(r, result);
}

static PyObject *next_throw(Next *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    if (self->state == 1) {
        PyObject *throw = PyObject_GetAttrString(self->delegate, "throw");
        PyObject *targs = throw == NULL ? NULL : PyTuple_New(nargs);
        if (targs != NULL)
            for (Py_ssize_t i = 0; i < nargs; i++)
                PyTuple_SetItem(targs, i, Py_NewRef(args[i]));
        PyObject *r = targs == NULL ? NULL : PyObject_Call(throw, targs, NULL);
        Py_XDECREF(targs);
        Py_XDECREF(throw);
        if (r == NULL) {
            self->state = 2;
            Py_CLEAR(self->delegate);
        }
        return r;
    }
    /* Not started, or over: the exception comes out here, as from a fresh coroutine. */
    self->state = 2;
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : Py_None;
    if (PyExceptionInstance_Check(typ))
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    else if (PyExceptionClass_Check(typ))
        PyErr_SetObject(typ, val);
    else
        PyErr_SetString(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException");
    return NULL;
}

static PyObject *next_close(Next *self, PyObject *unused)
{
    PyObject *delegate = self->delegate;
    self->delegate = NULL;
    self->state = 2;
    if (delegate != NULL) {
        PyObject *r = PyObject_CallMethod(delegate, "close", NULL);
        Py_DECREF(delegate);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *next_await(PyObject *self) { return Py_NewRef(self); }

static int next_traverse(Next *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(OBJ(self)));
    Py_VISIT(self->items);
    Py_VISIT(self->delegate);
    return 0;
}

static int next_clear(Next *self)
{
    Py_CLEAR(self->items);
    Py_CLEAR(self->delegate);
    return 0;
}

static PyMethodDef next_methods[] = {
    {"send", (PyCFunction)next_send, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))next_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)next_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot next_slots[] = {
    {Py_tp_doc, "What Items.__anext__() returns: the next item, once awaited."},
    {Py_tp_dealloc, gc_dealloc},
    {Py_tp_traverse, next_traverse},
    {Py_tp_clear, next_clear},
    {Py_tp_iter, next_await},
    {Py_tp_iternext, next_iternext},
    {Py_tp_methods, next_methods},
    {Py_am_await, next_await},
    {Py_am_send, next_am_send},
    {0, NULL},
};

static PyType_Spec next_spec = {
    "aperf._native._speedups.Next", sizeof(Next), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    next_slots,
};

/* ---- the module ------------------------------------------------------------------------- */

PyDoc_STRVAR(setup_doc,
"setup(BrokenRingError, ClosedResourceError)\n\n"
"The exceptions this module raises (aperf's own), once, before anything else.");

static PyObject *setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyExceptionClass_Check(args[0]) || !PyExceptionClass_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "setup(BrokenRingError, ClosedResourceError)");
        return NULL;
    }
    SETREF(BrokenRingError, Py_NewRef(args[0]));
    SETREF(ClosedResourceError, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL, setup_doc},
    {"perf_split", (PyCFunction)(void (*)(void))perf_split, METH_FASTCALL, perf_split_doc},
    {"ringbuf_split", (PyCFunction)(void (*)(void))ringbuf_split, METH_FASTCALL, ringbuf_split_doc},
    {"ringbuf_committed_end", (PyCFunction)(void (*)(void))ringbuf_committed_end, METH_FASTCALL,
     ringbuf_committed_end_doc},
    {"build_run", (PyCFunction)(void (*)(void))build_run, METH_FASTCALL, build_run_doc},
    {"build_payloads", (PyCFunction)(void (*)(void))build_payloads, METH_FASTCALL, build_payloads_doc},
    {"records", (PyCFunction)(void (*)(void))records, METH_FASTCALL, records_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aperf._native._speedups",
    "aperf's optional compiled fast path (aperf/_native/speedups.py loads it).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **out)
{
    PyObject *type = PyType_FromSpec(spec);
    if (type == NULL)
        return -1;
    *out = (PyTypeObject *)type;
    const char *name = strrchr(spec->name, '.') + 1;
    if (PyModule_AddObjectRef(m, name, type) < 0)
        return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    TupleNew = PyObject_GetAttrString((PyObject *)&PyTuple_Type, "__new__");
    tuple_tp_new = (newfunc)PyType_GetSlot(&PyTuple_Type, Py_tp_new);
    object_tp_init = (initproc)PyType_GetSlot(&PyBaseObject_Type, Py_tp_init);
    fast_tuples = Py_Version >= 0x030B0000 && Py_Version < 0x030E0000;
    if (TupleNew == NULL || tuple_tp_new == NULL || object_tp_init == NULL ||
        add_type(m, &cell_spec, &RingCellType) < 0 || add_type(m, &watch_spec, &RingWatchType) < 0 ||
        add_type(m, &items_spec, &ItemsType) < 0 || add_type(m, &next_spec, &NextType) < 0 ||
        PyModule_AddIntConstant(m, "FAST_TUPLES", fast_tuples) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
