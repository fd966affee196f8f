/* The event pool and the timer's event pairs.
 *
 * cuEventCreate/Destroy cost microseconds and can serialize with other driver work, so events are
 * created once and recycled per device. All are created with the blocking-sync flag: a thread
 * that waits for one sleeps rather than spinning a core. Timing stays enabled for the timer. */
#include "syncless.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <structmember.h>
#include <time.h>

/* The host clock of time.perf_counter() on Linux, in ns. */
static int64_t host_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int sl_event_take(sl_state *st, int device, CUevent *out)
{
    if (st->pool_len[device] > 0) {
        *out = st->pool[device][--st->pool_len[device]];
        return 0;
    }
    return sl_check(st, st->drv.cuEventCreate(out, CU_EVENT_BLOCKING_SYNC), "cuEventCreate");
}

/* Callers hold the GIL; the event's context must be (or become) current only to destroy it. */
void sl_event_give(sl_state *st, int device, CUevent ev)
{
    if (st->pool_len[device] == st->pool_cap[device]) {
        int cap = st->pool_cap[device] ? 2 * st->pool_cap[device] : 16;
        CUevent *grown = realloc(st->pool[device], (size_t)cap * sizeof(CUevent));
        if (grown == NULL) {
            st->drv.cuEventDestroy(ev);
            return;
        }
        st->pool[device] = grown;
        st->pool_cap[device] = cap;
    }
    st->pool[device][st->pool_len[device]++] = ev;
}

void sl_events_clear(sl_state *st)
{
    for (int d = 0; d < SL_MAX_DEVICES; d++) {
        for (int i = 0; i < st->pool_len[d]; i++)
            st->drv.cuEventDestroy(st->pool[d][i]);
        free(st->pool[d]);
        st->pool[d] = NULL;
        st->pool_len[d] = st->pool_cap[d] = 0;
    }
}

/* ---- EventPair: the GPU half of syncless.timer() ------------------------------------------- */

void sl_pair_init(sl_state *st, EventPair *self, int device)
{
    self->st = st;
    self->device = device;
    self->start = self->stop = NULL;
    self->started_on = NULL;
    self->state = SL_PAIR_FRESH;
    self->t0 = 0;
    self->cpu_ms = self->ms = NAN;
    self->name = Py_None;
    Py_INCREF(Py_None);
}

static PyObject *EventPair_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", NULL};
    int device;
    if (kw == NULL && PyTuple_Size(args) == 1 && PyLong_Check(PyTuple_GetItem(args, 0))) {
        /* the timer's path: EventPair(device), ~0.1 us cheaper than the argument parser */
        device = (int)PyLong_AsLong(PyTuple_GetItem(args, 0));
        if (device == -1 && PyErr_Occurred())
            return NULL;
    } else if (!PyArg_ParseTupleAndKeywords(args, kw, "i", kwlist, &device))
        return NULL;
    if (device < 0 || device >= SL_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "syncless: CUDA device %d out of range", device);
        return NULL;
    }
    sl_state *st = sl_state_of(type);
    if (st == NULL || sl_driver_load(st))
        return NULL;
    EventPair *self = (EventPair *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL)
        return NULL;
    /* The events are taken at start(), after the capture check: nothing reaches the driver
     * before we know the stream is not being captured. */
    sl_pair_init(st, self, device);
    return (PyObject *)self;
}

static void EventPair_dealloc(EventPair *self)
{
    PyTypeObject *type = Py_TYPE(self);
    sl_state *st = self->st;
    if (self->start)
        sl_event_give(st, self->device, self->start);
    if (self->stop)
        sl_event_give(st, self->device, self->stop);
    Py_CLEAR(self->name);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
    Py_DECREF(type);
}

/* Record the start (which == 0) or the end (1) on torch's current stream of the pair's device:
 * 0, or -1 with an exception set. */
int sl_pair_record(sl_state *st, EventPair *self, int which)
{
    CUcontext prev;
    CUstream stream;
    int capturing = 0;
    if (sl_enter_device(st, self->device, &prev))
        return -1;
    int rc = sl_current_stream(st, self->device, &stream);
    /* The end, on the stream the start was recorded on, skips the second check (one driver call
     * of the ~3 per record): the start proved that stream was not capturing, and a block that
     * begins a capture without ending it is not supported (reading it then raises CudaError). */
    if (rc == 0 && !(which == 1 && stream == self->started_on))
        rc = sl_check(st, st->drv.cuStreamIsCapturing(stream, &capturing), "cuStreamIsCapturing");
    if (rc == 0 && capturing != CU_STREAM_CAPTURE_STATUS_NONE) {
        /* A recorded event inside capture cannot be queried or timed; refuse before touching
         * the capture, so the user's graph stays intact. */
        PyErr_SetString(PyExc_RuntimeError, "syncless.timer() cannot time work inside CUDA graph "
                                            "capture; time the graph's replay() instead");
        rc = -1;
    }
    if (rc == 0 && self->start == NULL)
        rc = sl_event_take(st, self->device, &self->start);
    if (rc == 0 && self->stop == NULL)
        rc = sl_event_take(st, self->device, &self->stop);
    if (rc == 0)
        rc = sl_check(st, st->drv.cuEventRecord(which ? self->stop : self->start, stream),
                      "cuEventRecord");
    sl_leave_device(st, prev);
    if (rc)
        return -1;
    if (which == 0) {
        /* A pair started again is a new measurement: forget the last reading. */
        self->started_on = stream;
        self->cpu_ms = self->ms = NAN;
    }
    self->state = which ? SL_PAIR_STOPPED : SL_PAIR_STARTED;
    return 0;
}

static PyObject *record(EventPair *self, int which)
{
    if (sl_pair_record(self->st, self, which))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *EventPair_start(EventPair *self, PyObject *unused)
{
    (void)unused;
    return record(self, 0);
}

static PyObject *EventPair_stop(EventPair *self, PyObject *unused)
{
    (void)unused;
    if (self->state != SL_PAIR_STARTED) {
        PyErr_SetString(PyExc_RuntimeError, self->state == SL_PAIR_FRESH ? "stop() before start()"
                                                                         : "stop() called twice");
        return NULL;
    }
    return record(self, 1);
}

/* Milliseconds between the two events, or NULL with *not_ready set when the end event has not
 * completed (no exception then). The device's context is made current because these calls may
 * come from a thread torch never touched (the logger's delivery thread). */
static PyObject *read_elapsed(EventPair *self, int wait, int *not_ready)
{
    sl_state *st = self->st;
    CUcontext prev;
    float ms = 0;
    *not_ready = 0;
    if (sl_enter_device(st, self->device, &prev))
        return NULL;
    CUresult rc = st->drv.cuEventElapsedTime(&ms, self->start, self->stop);
    if (rc == CUDA_ERROR_NOT_READY && wait) {
        /* The events were made with the blocking-sync flag: this thread sleeps, and the GIL is
         * released so the training thread keeps running meanwhile. */
        Py_BEGIN_ALLOW_THREADS
        rc = st->drv.cuEventSynchronize(self->stop);
        Py_END_ALLOW_THREADS
        if (rc == CUDA_SUCCESS)
            rc = st->drv.cuEventElapsedTime(&ms, self->start, self->stop);
    }
    sl_leave_device(st, prev);
    if (rc == CUDA_ERROR_NOT_READY && !wait) {
        *not_ready = 1;
        return NULL;
    }
    if (sl_check(st, rc, "cuEventElapsedTime"))
        return NULL;
    self->ms = ms;
    /* The reading is kept; the two events go back to the pool at once. */
    sl_event_give(st, self->device, self->start);
    sl_event_give(st, self->device, self->stop);
    self->start = self->stop = NULL;
    return PyFloat_FromDouble(ms);
}

/* Milliseconds between the two events; waits for the end event first, so the number can never
 * be read early. One driver call when the end event already completed. */
static PyObject *EventPair_elapsed(EventPair *self, PyObject *unused)
{
    (void)unused;
    int not_ready;
    if (!isnan(self->ms))
        return PyFloat_FromDouble(self->ms);
    if (self->state != SL_PAIR_STOPPED) {
        PyErr_SetString(PyExc_RuntimeError, "the timed block has not ended yet");
        return NULL;
    }
    return read_elapsed(self, 1, &not_ready);
}

/* The same without waiting: None while the end event has not completed. One driver call
 * (cuEventElapsedTime itself reports NOT_READY), cheaper than query + elapsed. */
static PyObject *EventPair_poll(EventPair *self, PyObject *unused)
{
    (void)unused;
    int not_ready;
    if (!isnan(self->ms))
        return PyFloat_FromDouble(self->ms);
    if (self->state != SL_PAIR_STOPPED)
        Py_RETURN_NONE;
    PyObject *ms = read_elapsed(self, 0, &not_ready);
    if (ms == NULL && not_ready)
        Py_RETURN_NONE;
    return ms;
}

static PyMethodDef EventPair_methods[] = {
    {"start", (PyCFunction)EventPair_start, METH_NOARGS, "Record the start on the current stream."},
    {"stop", (PyCFunction)EventPair_stop, METH_NOARGS, "Record the end on the current stream."},
    {"elapsed", (PyCFunction)EventPair_elapsed, METH_NOARGS,
     "GPU milliseconds, waiting for the end event first."},
    {"poll", (PyCFunction)EventPair_poll, METH_NOARGS,
     "GPU milliseconds if the end event completed, else None; never waits."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef EventPair_members[] = {
    {"name", T_OBJECT, offsetof(EventPair, name), READONLY, "the timer's name, or None"},
    {"_device", T_INT, offsetof(EventPair, device), READONLY, "CUDA ordinal, -1: host clock"},
    {"_state", T_INT, offsetof(EventPair, state), READONLY,
     "PAIR_FRESH, PAIR_STARTED or PAIR_STOPPED"},
    {"_cpu_ms", T_DOUBLE, offsetof(EventPair, cpu_ms), READONLY, "host ms inside, NaN: running"},
    {"_ms", T_DOUBLE, offsetof(EventPair, ms), READONLY, "the reading in ms once known, else NaN"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot EventPair_slots[] = {
    {Py_tp_new, EventPair_new},
    {Py_tp_dealloc, EventPair_dealloc},
    {Py_tp_methods, EventPair_methods},
    {Py_tp_members, EventPair_members},
    {Py_tp_doc, "EventPair(device): two pooled CUDA events timing a stretch of one stream."},
    {0, NULL},
};

static PyType_Spec EventPair_spec = {"syncless._C.EventPair", sizeof(EventPair), 0,
                                     Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, EventPair_slots};

/* event_floor(device, n) -> {what: ns per pair}: the driver's cost of timing, measured in C on
 * torch's current stream (benchmarks/event_floor.py prints it beside EventPair and timer()).
 * "record_pair": two cuEventRecord of timing events; "checked_pair": what start()+stop() do in C
 * (context check and current stream twice, one capture check, two records). */
PyObject *sl_event_floor(PyObject *module, PyObject *args)
{
    sl_state *st = sl_get_state(module);
    int device, n;
    if (!PyArg_ParseTuple(args, "ii", &device, &n))
        return NULL;
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "event_floor() needs n >= 1");
        return NULL;
    }
    if (sl_driver_load(st))
        return NULL;
    CUcontext prev;
    CUstream stream;
    CUevent a = NULL, b = NULL;
    if (sl_enter_device(st, device, &prev))
        return NULL;
    int rc = sl_current_stream(st, device, &stream) || sl_event_take(st, device, &a) ||
             sl_event_take(st, device, &b);
    int64_t t0 = host_ns();
    for (int i = 0; rc == 0 && i < n; i++)
        rc = sl_check(st, st->drv.cuEventRecord(a, stream), "cuEventRecord") ||
             sl_check(st, st->drv.cuEventRecord(b, stream), "cuEventRecord");
    int64_t t1 = host_ns();
    for (int i = 0; rc == 0 && i < n; i++) {
        CUcontext p1 = NULL, p2 = NULL;
        CUstream s1, s2;
        int capturing;
        rc = sl_enter_device(st, device, &p1) || sl_current_stream(st, device, &s1) ||
             sl_check(st, st->drv.cuStreamIsCapturing(s1, &capturing), "cuStreamIsCapturing") ||
             sl_check(st, st->drv.cuEventRecord(a, s1), "cuEventRecord");
        sl_leave_device(st, p1);
        rc = rc || sl_enter_device(st, device, &p2) || sl_current_stream(st, device, &s2) ||
             sl_check(st, st->drv.cuEventRecord(b, s2), "cuEventRecord");
        sl_leave_device(st, p2);
    }
    int64_t t2 = host_ns();
    if (rc == 0)
        rc = sl_check(st, st->drv.cuEventSynchronize(b), "cuEventSynchronize");
    if (a)
        sl_event_give(st, device, a);
    if (b)
        sl_event_give(st, device, b);
    sl_leave_device(st, prev);
    if (rc)
        return NULL;
    return Py_BuildValue("{sdsd}", "record_pair", (double)(t1 - t0) / n, "checked_pair",
                         (double)(t2 - t1) / n);
}

int sl_event_pair_init_types(PyObject *module, sl_state *st)
{
    st->event_pair_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &EventPair_spec, NULL);
    if (st->event_pair_type == NULL ||
        PyModule_AddObjectRef(module, "EventPair", (PyObject *)st->event_pair_type) ||
        PyModule_AddIntConstant(module, "PAIR_FRESH", SL_PAIR_FRESH) ||
        PyModule_AddIntConstant(module, "PAIR_STARTED", SL_PAIR_STARTED) ||
        PyModule_AddIntConstant(module, "PAIR_STOPPED", SL_PAIR_STOPPED))
        return -1;
    return 0;
}
