/* The device ring and its host windows: the whole data path of a CUDA logger.
 *
 *   Ring.gather(metrics, columns, tag, step, time)  one kernel launch writes one row
 *   Ring.copy_to(window)                            one async D2H copy of the ring + one event
 *   Window.wait()                                   completion, off the training thread
 *   Window.decode(from_seq, names, nonfinite, ...)  rows -> syncless.Row (made in C)
 *   tally(rows, latest, nonfinite)                  the counts decode keeps, for Python's rows
 *
 * `latest` and the NaN/Inf counts are kept here, on this side of the C/Python line only: decode
 * updates them for the rows it makes, tally() for the rows the Python side makes.  *
 * Device memory (allocated by torch, handed to us as an address) is laid out as layout.h says:
 * a header of SL_HEADER_BYTES, then `capacity` rows of `row_words` 8-byte words. */
#include "syncless.h"

#include <math.h>
#include <string.h>

typedef struct SL_LAUNCH_BLOCK(SL_MAX_CELLS) launch_args;
_Static_assert(sizeof(launch_args) <= 4096, "the classic 4 KB kernel parameter limit");

/* Cells of each gather kernel's parameter block, smallest first. */
#define SL_CELLS(name, cells) cells,
static const uint32_t gather_cells[SL_GATHER_COUNT] = {SL_GATHER_KERNELS(SL_CELLS)};

typedef struct {
    PyObject_HEAD
    int device;
    uint64_t base; /* device address of the header */
    uint32_t capacity, columns, mask_words, row_words;
    CUfunction fn[SL_GATHER_COUNT];
    CUstream last_stream;
    CUevent order; /* orders the ring across a change of the current stream */
    int launched;
    uint64_t wrote; /* 1 + the tag of the last call whose row was launched (0: none yet) */
} Ring;

typedef struct {
    PyObject_HEAD
    int device;
    char *host; /* pinned host memory (a torch tensor the Python side keeps alive) */
    size_t nbytes;
    CUevent done;
    uint32_t capacity, columns, mask_words, row_words; /* layout of the ring last copied here */
    int pending; /* a copy was enqueued and not yet waited for */
} Window;

static uint32_t row_words(uint32_t columns)
{
    return SL_ROW_HEADER_WORDS + columns / SL_COLUMN_BLOCK + columns;
}

static size_t ring_bytes(uint32_t capacity, uint32_t row_words)
{
    return SL_HEADER_BYTES + (size_t)capacity * row_words * 8;
}

/* ---- Ring ------------------------------------------------------------------------------------ */

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", "address", "capacity", "columns", NULL};
    int device;
    unsigned long long address;
    unsigned capacity, columns;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iKII", kwlist, &device, &address, &capacity,
                                     &columns))
        return NULL;
    if (capacity == 0 || columns == 0 || columns % SL_COLUMN_BLOCK) {
        PyErr_Format(PyExc_ValueError, "ring needs capacity > 0 and columns a multiple of %d",
                     SL_COLUMN_BLOCK);
        return NULL;
    }
    sl_state *st = sl_type_state(type);
    if (sl_driver_load(st))
        return NULL;
    CUcontext prev;
    if (sl_enter_device(st, device, &prev))
        return NULL;
    Ring *self = (Ring *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL)
        goto fail;
    self->device = device;
    self->base = address;
    self->capacity = capacity;
    self->columns = columns;
    self->mask_words = columns / SL_COLUMN_BLOCK;
    self->row_words = row_words(columns);
    self->last_stream = NULL;
    self->launched = 0;
    self->wrote = 0;
    if (sl_gather_functions(st, device, self->fn) || sl_event_take(st, device, &self->order)) {
        Py_DECREF(self);
        self = NULL;
    }
fail:
    sl_leave_device(st, prev);
    return (PyObject *)self;
}

static void Ring_dealloc(Ring *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (self->order)
        sl_event_give(sl_type_state(type), self->device, self->order);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
    Py_DECREF(type);
}

/* Fill args->cell from a {name: value} dict; names map to columns through `columns`.
 * keep[] receives the tensors made by the resolver (a.head.n references at most, NULL or new).
 * Returns -1 with an exception set, 1 (no exception) when a name has no column in this ring
 * yet (the Python side adds it, growing the ring if needed), else 0. */
static int read_cells(sl_state *st, Ring *self, PyObject *metrics, PyObject *columns,
                      launch_args *a, PyObject **keep)
{
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    uint32_t n = 0;
    while (PyDict_Next(metrics, &pos, &name, &value)) {
        if (n == SL_MAX_CELLS) {
            PyErr_Format(PyExc_ValueError,
                         "at most %d metrics per call (got %zd); split them "
                         "over two calls with the same step",
                         SL_MAX_CELLS, PyDict_Size(metrics));
            return -1;
        }
        PyObject *col = PyDict_GetItemWithError(columns, name); /* borrowed */
        if (col == NULL)
            return PyErr_Occurred() ? -1 : 1;
        sl_metric m;
        if (sl_metric_read(st, name, value, &m, &keep[n]))
            return -1;
        a->head.n = n + 1; /* keep[n] is the caller's to release from here on */
        if (m.device >= 0 && m.device != self->device) {
            PyErr_Format(PyExc_ValueError,
                         "metric %R is on cuda:%d but this logger's ring is on "
                         "cuda:%d; log each device's metrics with its own Logger, or move the "
                         "value",
                         name, m.device, self->device);
            return -1;
        }
        m.cell.column = (uint32_t)PyLong_AsUnsignedLong(col);
        if (m.cell.column >= self->columns)
            return 1; /* a column added since this ring was made: the Python side grows it */
        a->cell[n++] = m.cell;
    }
    return 0;
}

static void release(PyObject **keep, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        Py_XDECREF(keep[i]);
}

/* step: the call's step= (>= 0), or -1 for the header's next-step word (consecutive steps,
 * counted on the device, so CUDA graph replays take them too). Returns True when the launch was
 * captured into a CUDA graph, False when it ran eagerly, or GATHER_NEW_COLUMN (an int) when a
 * metric has no column in this ring: nothing was launched, and a new metric's first call costs
 * no exception (the Python side adds the column and calls again). */
static PyObject *Ring_gather(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "gather(metrics: dict, columns: dict, tag, step, time)");
        return NULL;
    }
    sl_state *st = sl_type_state(Py_TYPE(self));
    launch_args a;
    sl_launch *h = &a.head;
    PyObject *keep[SL_MAX_CELLS];
    h->n = 0;
    uint64_t tag = h->tag = PyLong_AsUnsignedLongLong(args[2]);
    h->step = PyLong_AsLongLong(args[3]);
    h->time = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    int cells = read_cells(st, self, args[0], args[1], &a, keep);
    if (cells) {
        release(keep, h->n);
        return cells < 0 ? NULL : PyLong_FromLong(SL_GATHER_NEW_COLUMN);
    }

    CUcontext prev;
    CUstream stream;
    if (sl_enter_device(st, self->device, &prev)) {
        release(keep, h->n);
        return NULL;
    }
    int capturing = 0, rc = -1;
    if (sl_current_stream(st, self->device, &stream) ||
        sl_check(st, st->drv.cuStreamIsCapturing(stream, &capturing), "cuStreamIsCapturing"))
        goto done;
    capturing = capturing != CU_STREAM_CAPTURE_STATUS_NONE;
    if (capturing) {
        if (h->step >= 0) {
            /* A replay would write this very step again, every time. */
            PyErr_SetString(PyExc_RuntimeError,
                            "log(step=...) inside CUDA graph capture: every replay would log at "
                            "that same step; drop step= (replays take consecutive steps, "
                            "counted on the device)");
            goto done;
        }
        h->tag |= SL_CAPTURED_TAG;
    } else if (self->launched && stream != self->last_stream) {
        /* Rows must land in call order: the new stream waits for the ring's last use. */
        if (sl_check(st, st->drv.cuEventRecord(self->order, self->last_stream), "cuEventRecord") ||
            sl_check(st, st->drv.cuStreamWaitEvent(stream, self->order, 0), "cuStreamWaitEvent"))
            goto done;
    }
    h->ring = self->base + SL_HEADER_BYTES;
    h->counter = self->base;
    h->capacity = self->capacity;
    h->row_words = self->row_words;
    h->mask_words = self->mask_words;
    int which = 0;
    while (h->n > gather_cells[which]) /* the last holds SL_MAX_CELLS */
        which++;
    unsigned threads = (h->n > h->mask_words ? h->n : h->mask_words);
    threads = (threads + 31) / 32 * 32;
    void *params[1] = {&a};
    if (sl_check(st,
                 st->drv.cuLaunchKernel(self->fn[which], 1, 1, 1, threads, 1, 1, 0, stream, params,
                                        NULL),
                 "cuLaunchKernel (gather)"))
        goto done;
    self->wrote = tag + 1;
    if (!capturing) {
        self->last_stream = stream;
        self->launched = 1;
    }
    rc = 0;
done:
    sl_leave_device(st, prev);
    release(keep, h->n); /* stream order: a later reuse of their memory runs after the kernel */
    if (rc)
        return NULL;
    return PyBool_FromLong(capturing);
}

/* Zero the header and rows on the current stream (once, before the first gather) and set the
 * next-step word: the step the host has reached (a ring that replaces a narrower one, or the
 * first one after rows of CPU values). */
static PyObject *Ring_clear(Ring *self, PyObject *arg)
{
    long long next = PyLong_AsLongLong(arg);
    if (next == -1 && PyErr_Occurred())
        return NULL;
    if (next < 0) {
        PyErr_SetString(PyExc_ValueError, "clear(next_step): next_step must be >= 0");
        return NULL;
    }
    sl_state *st = sl_type_state(Py_TYPE(self));
    CUcontext prev;
    CUstream stream;
    if (sl_enter_device(st, self->device, &prev))
        return NULL;
    int rc = sl_current_stream(st, self->device, &stream) ||
             sl_check(st,
                      st->drv.cuMemsetD8Async(self->base, 0,
                                              ring_bytes(self->capacity, self->row_words), stream),
                      "cuMemsetD8Async");
    CUdeviceptr word = self->base + 8 * SL_HDR_NEXT_STEP; /* little-endian: low half first */
    for (int half = 0; half < 2 && !rc; half++) {
        unsigned bits = (unsigned)((unsigned long long)next >> (32 * half));
        if (bits)
            rc = sl_check(st, st->drv.cuMemsetD32Async(word + 4 * half, bits, 1, stream),
                          "cuMemsetD32Async");
    }
    sl_leave_device(st, prev);
    if (rc)
        return NULL;
    Py_RETURN_NONE;
}

/* Is the current stream capturing a graph? (Flushes are skipped under capture.) */
static PyObject *Ring_capturing(Ring *self, PyObject *unused)
{
    (void)unused;
    sl_state *st = sl_type_state(Py_TYPE(self));
    CUcontext prev;
    CUstream stream;
    int status = 0;
    if (sl_enter_device(st, self->device, &prev))
        return NULL;
    int rc = sl_current_stream(st, self->device, &stream) ||
             sl_check(st, st->drv.cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
    sl_leave_device(st, prev);
    if (rc)
        return NULL;
    return PyBool_FromLong(status != CU_STREAM_CAPTURE_STATUS_NONE);
}

static PyObject *Ring_copy_to(Ring *self, PyObject *arg)
{
    sl_state *st = sl_type_state(Py_TYPE(self));
    if (!PyObject_TypeCheck(arg, st->window_type)) {
        PyErr_SetString(PyExc_TypeError, "copy_to() takes a Window");
        return NULL;
    }
    Window *w = (Window *)arg;
    size_t n = ring_bytes(self->capacity, self->row_words);
    if (w->device != self->device || w->nbytes < n) {
        PyErr_Format(PyExc_ValueError,
                     "window (cuda:%d, %zu bytes) cannot hold this ring "
                     "(cuda:%d, %zu bytes)",
                     w->device, w->nbytes, self->device, n);
        return NULL;
    }
    if (w->pending) {
        PyErr_SetString(PyExc_RuntimeError, "window still holds an undelivered copy");
        return NULL;
    }
    CUcontext prev;
    CUstream stream;
    if (sl_enter_device(st, self->device, &prev))
        return NULL;
    /* Pinned destination: the copy is truly asynchronous (pageable memory would block). */
    int rc = sl_current_stream(st, self->device, &stream) ||
             sl_check(st, st->drv.cuMemcpyDtoHAsync(w->host, self->base, n, stream),
                      "cuMemcpyDtoHAsync") ||
             sl_check(st, st->drv.cuEventRecord(w->done, stream), "cuEventRecord");
    sl_leave_device(st, prev);
    if (rc)
        return NULL;
    if (self->launched && stream != self->last_stream)
        self->last_stream = stream; /* the copy is the ring's last use now */
    w->capacity = self->capacity;
    w->columns = self->columns;
    w->mask_words = self->mask_words;
    w->row_words = self->row_words;
    w->pending = 1;
    Py_RETURN_NONE;
}

/* wrote(tag): did the gather of call `tag` launch its row? The Logger counts a call before its
 * gather, and asks this only when the gather raised: an exception raised before the launch (a
 * new metric, a bad value) takes the call back; one raised after it (a signal handler's, run
 * as the C call returns) leaves the row counted. */
static PyObject *Ring_wrote(Ring *self, PyObject *arg)
{
    unsigned long long tag = PyLong_AsUnsignedLongLong(arg);
    if (tag == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(self->wrote == (uint64_t)tag + 1);
}

static PyObject *Ring_get_columns(Ring *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->columns);
}

static PyObject *Ring_get_capacity(Ring *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->capacity);
}

static PyMethodDef Ring_methods[] = {
    {"gather", (PyCFunction)(void (*)(void))Ring_gather, METH_FASTCALL,
     "gather(metrics, columns, tag, step, time) -> True (captured), False (launched) or "
     "GATHER_NEW_COLUMN (a metric has no column in this ring; nothing launched)."},
    {"clear", (PyCFunction)Ring_clear, METH_O,
     "clear(next_step): zero the ring on the current stream; log() without step= goes on from "
     "next_step."},
    {"capturing", (PyCFunction)Ring_capturing, METH_NOARGS,
     "Whether the current stream is capturing a CUDA graph."},
    {"wrote", (PyCFunction)Ring_wrote, METH_O,
     "wrote(tag) -> bool: whether the last gather that launched a row had this tag."},
    {"copy_to", (PyCFunction)Ring_copy_to, METH_O,
     "Enqueue one async copy of the whole ring into a Window, then its event."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"columns", (getter)Ring_get_columns, NULL, "metric columns per row", NULL},
    {"capacity", (getter)Ring_get_capacity, NULL, "rows", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Layout helper for the Python side, which allocates the memory before the Ring exists. */
PyObject *sl_ring_nbytes(PyObject *module, PyObject *args)
{
    (void)module;
    unsigned capacity, columns;
    if (!PyArg_ParseTuple(args, "II", &capacity, &columns))
        return NULL;
    if (columns % SL_COLUMN_BLOCK) {
        PyErr_Format(PyExc_ValueError, "columns must be a multiple of %d", SL_COLUMN_BLOCK);
        return NULL;
    }
    return PyLong_FromSize_t(ring_bytes(capacity, row_words(columns)));
}

/* ---- Window ---------------------------------------------------------------------------------- */

static PyObject *Window_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", "address", "nbytes", NULL};
    int device;
    unsigned long long address;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iKn", kwlist, &device, &address, &nbytes))
        return NULL;
    sl_state *st = sl_type_state(type);
    if (sl_driver_load(st))
        return NULL;
    Window *self = (Window *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL)
        return NULL;
    self->device = device;
    self->host = (char *)(uintptr_t)address;
    self->nbytes = (size_t)nbytes;
    self->pending = 0;
    CUcontext prev;
    if (sl_enter_device(st, device, &prev)) {
        Py_DECREF(self);
        return NULL;
    }
    int rc = sl_event_take(st, device, &self->done);
    sl_leave_device(st, prev);
    if (rc) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Window_dealloc(Window *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (self->done)
        sl_event_give(sl_type_state(type), self->device, self->done);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
    Py_DECREF(type);
}

/* Block this (delivery) thread until the copy landed. The event was created with the
 * blocking-sync flag, so the thread sleeps instead of spinning a core, and the GIL is released
 * so the training thread runs on meanwhile. */
static PyObject *Window_wait(Window *self, PyObject *unused)
{
    (void)unused;
    if (!self->pending)
        Py_RETURN_NONE;
    sl_state *st = sl_type_state(Py_TYPE(self));
    CUresult rc = st->drv.cuEventQuery(self->done);
    if (rc == CUDA_ERROR_NOT_READY) {
        CUcontext prev;
        if (sl_enter_device(st, self->device, &prev))
            return NULL;
        Py_BEGIN_ALLOW_THREADS
        rc = st->drv.cuEventSynchronize(self->done);
        Py_END_ALLOW_THREADS
        sl_leave_device(st, prev);
    }
    if (sl_check(st, rc, "cuEventSynchronize (window copy)"))
        return NULL;
    Py_RETURN_NONE;
}

/* Has the copy landed? One cuEventQuery, never a wait: delivery on the training thread
 * (Logger(delivery="caller")) decodes only the windows that answer True. */
static PyObject *Window_ready(Window *self, PyObject *unused)
{
    (void)unused;
    if (!self->pending)
        Py_RETURN_TRUE;
    sl_state *st = sl_type_state(Py_TYPE(self));
    CUresult rc = st->drv.cuEventQuery(self->done);
    if (rc == CUDA_ERROR_NOT_READY)
        Py_RETURN_FALSE;
    if (sl_check(st, rc, "cuEventQuery (window copy)"))
        return NULL;
    Py_RETURN_TRUE;
}

/* nonfinite[name] += 1 */
static int count_nonfinite(PyObject *nonfinite, PyObject *name)
{
    PyObject *old = PyDict_GetItemWithError(nonfinite, name); /* borrowed */
    if (old == NULL && PyErr_Occurred())
        return -1;
    long count = old ? PyLong_AsLong(old) : 0;
    PyObject *nc = PyLong_FromLong(count + 1);
    if (nc == NULL || PyDict_SetItem(nonfinite, name, nc)) {
        Py_XDECREF(nc);
        return -1;
    }
    Py_DECREF(nc);
    return 0;
}

/* A row_type instance (step, time, values); steals `values`, even on failure. */
static PyObject *made_row(allocfunc alloc, PyTypeObject *type, int64_t step, double time,
                          PyObject *values)
{
    PyObject *s = PyLong_FromLongLong(step), *t = PyFloat_FromDouble(time);
    PyObject *item = s && t ? alloc(type, 3) : NULL;
    if (item == NULL) {
        Py_XDECREF(s);
        Py_XDECREF(t);
        Py_DECREF(values);
        return NULL;
    }
    /* A fresh tuple (of a subclass): PyTuple_SetItem fills it and takes each reference. */
    PyTuple_SetItem(item, 0, s);
    PyTuple_SetItem(item, 1, t);
    PyTuple_SetItem(item, 2, values);
    return item;
}

/* decode(from_seq, names, nonfinite, row_type, replay_time, latest=None, gpu=None)
 *   -> (counter, rows)
 * rows: the rows for seq in [from_seq, counter) still in the ring, as instances of row_type (a
 * tuple subclass of (step, time, values): syncless.Row) made here, so the delivery thread's
 * Python work per row, under the GIL the training thread needs, is none. A row written by a
 * graph replay had no host call: its time is replay_time (the time of the flush that found it),
 * chosen here and nowhere else. names[column] is the metric name; nonfinite[name] counts NaN/Inf
 * values; latest, a dict, ends up holding each metric's last value in these rows; gpu, a list,
 * receives (gpu_ns, replayed) for each row: the GPU clock when the row was written, and whether
 * a graph replay wrote it. */
static PyObject *Window_decode(Window *self, PyObject *args)
{
    unsigned long long from_seq;
    PyObject *names, *nonfinite, *row_type, *latest = Py_None, *gpu = Py_None;
    double replay_time;
    if (!PyArg_ParseTuple(args, "KO!O!Od|OO", &from_seq, &PyList_Type, &names, &PyDict_Type,
                          &nonfinite, &row_type, &replay_time, &latest, &gpu))
        return NULL;
    if ((latest != Py_None && !PyDict_Check(latest)) || (gpu != Py_None && !PyList_Check(gpu))) {
        PyErr_SetString(PyExc_TypeError,
                        "decode(): latest must be a dict or None, gpu a list or None");
        return NULL;
    }
    if (!PyType_Check(row_type) || !PyType_IsSubtype((PyTypeObject *)row_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "decode(): row_type must be a tuple subclass");
        return NULL;
    }
    /* A row is made as tuple.__new__(row_type, (step, time, values)) makes it, after a
     * NamedTuple's own Python-level argument handling: the type's allocator, then the three
     * items (what a Python call of either would cost each row is saved). */
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)row_type, Py_tp_alloc);
    self->pending = 0;
    uint64_t counter;
    memcpy(&counter, self->host, 8);
    uint64_t first = from_seq;
    if (counter > self->capacity && first < counter - self->capacity)
        first = counter - self->capacity;
    PyObject *rows = PyList_New(0);
    if (rows == NULL)
        return NULL;
    Py_ssize_t nnames = PyList_Size(names);
    for (uint64_t seq = first; seq < counter; seq++) {
        const uint64_t *row = (const uint64_t *)(self->host + SL_HEADER_BYTES) +
                              (seq % self->capacity) * self->row_words;
        if (row[SL_ROW_SEQ] != seq)
            continue; /* not written in stream order before the copy (another stream's write) */
        const uint64_t *mask = row + SL_ROW_HEADER_WORDS;
        const double *values = (const double *)(mask + self->mask_words);
        PyObject *d = PyDict_New();
        if (d == NULL)
            goto error;
        for (uint32_t c = 0; c < self->columns; c++) {
            if (!(mask[c / SL_COLUMN_BLOCK] >> (c % SL_COLUMN_BLOCK) & 1))
                continue;
            if (c >= (uint32_t)nnames) {
                Py_DECREF(d);
                PyErr_Format(PyExc_RuntimeError, "ring row %llu names column %u, unknown",
                             (unsigned long long)seq, c);
                goto error;
            }
            PyObject *name = PyList_GetItem(names, c); /* borrowed */
            PyObject *v = PyFloat_FromDouble(values[c]);
            if (v == NULL || PyDict_SetItem(d, name, v) ||
                (latest != Py_None && PyDict_SetItem(latest, name, v))) {
                Py_XDECREF(v);
                Py_DECREF(d);
                goto error;
            }
            Py_DECREF(v);
            if (!isfinite(values[c]) && count_nonfinite(nonfinite, name)) {
                Py_DECREF(d);
                goto error;
            }
        }
        const int replayed = (row[SL_ROW_TAG] & SL_CAPTURED_TAG) != 0;
        double time;
        memcpy(&time, &row[SL_ROW_TIME], 8);
        PyObject *item = made_row(alloc, (PyTypeObject *)row_type, (int64_t)row[SL_ROW_STEP],
                                  replayed ? replay_time : time, d);
        if (item == NULL || PyList_Append(rows, item)) {
            Py_XDECREF(item);
            goto error;
        }
        Py_DECREF(item);
        if (gpu != Py_None) {
            PyObject *clock = Py_BuildValue("(KO)", (unsigned long long)row[SL_ROW_GPU_NS],
                                            replayed ? Py_True : Py_False);
            if (clock == NULL || PyList_Append(gpu, clock)) {
                Py_XDECREF(clock);
                goto error;
            }
            Py_DECREF(clock);
        }
    }
    return Py_BuildValue("(KN)", (unsigned long long)counter, rows);
error:
    Py_DECREF(rows);
    return NULL;
}

/* tally(rows, latest, nonfinite): for rows made on the Python side (host rows, late values,
 * rows with GPU-clock metrics), what decode does for its own: latest[name] = each metric's last
 * value, nonfinite[name] += 1 per NaN/Inf value. rows: a list of dicts {name: float}, or of
 * tuples holding one at index 2 (syncless.Row); latest or nonfinite may be None. */
PyObject *sl_tally(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *rows, *latest, *nonfinite;
    if (!PyArg_ParseTuple(args, "O!OO", &PyList_Type, &rows, &latest, &nonfinite))
        return NULL;
    if ((latest != Py_None && !PyDict_Check(latest)) ||
        (nonfinite != Py_None && !PyDict_Check(nonfinite))) {
        PyErr_SetString(PyExc_TypeError, "tally(): latest and nonfinite must be dicts or None");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *values = PyList_GetItem(rows, i); /* borrowed */
        if (values != NULL && PyTuple_Check(values))
            values = PyTuple_GetItem(values, 2);
        if (values == NULL)
            return NULL;
        if (!PyDict_Check(values)) {
            PyErr_SetString(PyExc_TypeError, "tally(): a row's values must be a dict");
            return NULL;
        }
        Py_ssize_t pos = 0;
        PyObject *name, *v;
        while (PyDict_Next(values, &pos, &name, &v)) {
            if (latest != Py_None && PyDict_SetItem(latest, name, v))
                return NULL;
            if (nonfinite == Py_None)
                continue;
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred())
                return NULL;
            if (!isfinite(x) && count_nonfinite(nonfinite, name))
                return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef Window_methods[] = {
    {"wait", (PyCFunction)Window_wait, METH_NOARGS, "Sleep until the copy landed (GIL released)."},
    {"ready", (PyCFunction)Window_ready, METH_NOARGS, "Has the copy landed? (never waits)"},
    {"decode", (PyCFunction)Window_decode, METH_VARARGS,
     "decode(from_seq, names, nonfinite, row_type, replay_time, latest=None, gpu=None) -> "
     "(counter, rows)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Ring_slots[] = {
    {Py_tp_new, Ring_new},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {Py_tp_doc, "Ring(device, address, capacity, columns): a logger's device ring."},
    {0, NULL},
};

static PyType_Slot Window_slots[] = {
    {Py_tp_new, Window_new},
    {Py_tp_dealloc, Window_dealloc},
    {Py_tp_methods, Window_methods},
    {Py_tp_doc, "Window(device, address, nbytes): pinned host memory a ring is copied into."},
    {0, NULL},
};

static PyType_Spec Ring_spec = {"syncless._C.Ring", sizeof(Ring), 0, Py_TPFLAGS_DEFAULT,
                                Ring_slots};
static PyType_Spec Window_spec = {"syncless._C.Window", sizeof(Window), 0, Py_TPFLAGS_DEFAULT,
                                  Window_slots};

int sl_ring_init_types(PyObject *module, sl_state *st)
{
    st->ring_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Ring_spec, NULL);
    if (st->ring_type == NULL || PyModule_AddObjectRef(module, "Ring", (PyObject *)st->ring_type))
        return -1;
    st->window_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Window_spec, NULL);
    if (st->window_type == NULL ||
        PyModule_AddObjectRef(module, "Window", (PyObject *)st->window_type))
        return -1;
    return 0;
}
