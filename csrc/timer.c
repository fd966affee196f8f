/* The timer's hot path: `with syncless.timer():` enters and exits here.
 *
 * Python's Timer subclasses TimerBase and its readings (Timing) subclass EventPair. One use is a
 * record allocation, a clock read and one cuEventRecord at each end, and the capture check at the
 * start. Policy (names, series, logging) stays in Python and runs only for timers that have some:
 * TimerBase calls Timer._before(record) / Timer._after(record) when its `_hooks` ask for it.
 * Measured on the H200 (benchmarks/percall.py): the Python version of this path cost ~2.5 us of
 * interpreter work around the two records. */
#include "syncless.h"

#include <math.h>
#include <stddef.h>
#include <structmember.h>
#include <time.h>

/* Exported to Python (TIMER_CPU ..., TIMER_AFTER ...): timer.py reads them from _C. */
enum { MODE_CPU = -1, MODE_CUDA = -2, MODE_AUTO = -3 };
enum { HOOK_AFTER = 1, HOOK_BEFORE = 2 };

typedef struct {
    PyObject_HEAD
    int mode; /* a CUDA ordinal, or MODE_* */
    int hooks;
    PyObject *name; /* str or None */
    PyObject *open; /* list: records of blocks entered and not yet exited, innermost last */
    PyObject *last; /* the last finished record, or None */
    PyObject *series, *log, *step; /* Python's policy state (Timer), NULL reads as None */
    sl_state *st;
} TimerBase;

/* perf_counter's clock on Linux */
static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The device a use times on: a fixed one, the host clock, or (auto / "cuda") the device whose
 * primary context is current on this thread once CUDA is known to be up; otherwise torch is
 * asked (auto: the host clock until torch initialised CUDA, so a CPU-only program never loads
 * the driver). Returns -1 for the host clock, -2 with an exception set. */
static int choose_device(sl_state *st, int mode)
{
    if (mode >= 0 || mode == MODE_CPU)
        return mode;
    if (st->cuda_seen && st->driver_state == 1) {
        CUcontext ctx = NULL;
        if (st->drv.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx != NULL)
            for (int d = 0; d < SL_MAX_DEVICES; d++)
                if (st->ctx[d] == ctx)
                    return d;
    }
    if (st->auto_device == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "syncless: the timer is not bound (import syncless)");
        return -2;
    }
    PyObject *r = PyObject_CallFunction(st->auto_device, "i", mode);
    if (r == NULL)
        return -2;
    long d = PyLong_AsLong(r);
    Py_DECREF(r);
    if (d == -1 && PyErr_Occurred())
        return -2;
    if (d >= 0)
        st->cuda_seen = 1;
    return d < 0 ? -1 : (int)d;
}

static PyObject *TimerBase_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    sl_state *st = sl_state_of(type);
    if (st == NULL)
        return NULL;
    TimerBase *self = (TimerBase *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL)
        return NULL;
    self->st = st;
    self->mode = MODE_AUTO;
    self->hooks = 0;
    self->name = Py_None;
    Py_INCREF(Py_None);
    self->last = Py_None;
    Py_INCREF(Py_None);
    self->open = PyList_New(0);
    if (self->open == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int TimerBase_traverse(TimerBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->open);
    Py_VISIT(self->last);
    Py_VISIT(self->series);
    Py_VISIT(self->log);
    Py_VISIT(self->step);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int TimerBase_clear(TimerBase *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->open);
    Py_CLEAR(self->last);
    Py_CLEAR(self->series);
    Py_CLEAR(self->log);
    Py_CLEAR(self->step);
    return 0;
}

static void TimerBase_dealloc(TimerBase *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    TimerBase_clear(self);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
    Py_DECREF(type);
}

static PyObject *TimerBase_enter(TimerBase *self, PyObject *unused)
{
    (void)unused;
    sl_state *st = self->st;
    if (st->timing_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "syncless: the timer is not bound (import syncless)");
        return NULL;
    }
    int device = choose_device(st, self->mode);
    if (device == -2)
        return NULL;
    if (device >= 0 && sl_driver_load(st))
        return NULL;
    PyTypeObject *type = (PyTypeObject *)st->timing_type;
    EventPair *rec = (EventPair *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (rec == NULL)
        return NULL;
    sl_pair_init(st, rec, device);
    Py_INCREF(self->name);
    Py_DECREF(rec->name);
    rec->name = self->name;
    if (self->hooks & HOOK_BEFORE) {
        PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, st->before_str, rec, NULL);
        if (r == NULL)
            goto error;
        Py_DECREF(r);
    }
    /* Raises, touching nothing, under graph capture. */
    if (device >= 0 && sl_pair_record(st, rec, 0))
        goto error;
    rec->state = SL_PAIR_STARTED;
    if (PyList_Append(self->open, (PyObject *)rec))
        goto error;
    rec->t0 = now();
    return (PyObject *)rec;
error:
    Py_DECREF(rec);
    return NULL;
}

static PyObject *TimerBase_exit(TimerBase *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    double t1 = now();
    Py_ssize_t n = PyList_Size(self->open);
    if (n <= 0) {
        PyErr_SetString(PyExc_RuntimeError, "timer exited more often than it was entered");
        return NULL;
    }
    EventPair *rec = (EventPair *)PyList_GetItem(self->open, n - 1); /* borrowed */
    Py_INCREF(rec);
    if (PyList_SetSlice(self->open, n - 1, n, NULL)) {
        Py_DECREF(rec);
        return NULL;
    }
    if (rec->device >= 0 && sl_pair_record(self->st, rec, 1)) {
        Py_DECREF(rec);
        return NULL;
    }
    rec->state = SL_PAIR_STOPPED;
    rec->cpu_ms = (t1 - rec->t0) * 1e3;
    if (rec->device < 0)
        rec->ms = rec->cpu_ms;
    /* An unnamed timer starts keeping a series at its second use (Timer._after does that). */
    if ((self->hooks & HOOK_AFTER) || self->last != Py_None) {
        PyObject *r = PyObject_CallMethodObjArgs((PyObject *)self, self->st->after_str, rec, NULL);
        if (r == NULL) {
            Py_DECREF(rec);
            return NULL;
        }
        Py_DECREF(r);
    }
    PyObject *old = self->last;
    self->last = (PyObject *)rec; /* takes our reference */
    Py_XDECREF(old);
    Py_RETURN_FALSE; /* never swallows the block's exception */
}

static PyMethodDef TimerBase_methods[] = {
    {"__enter__", (PyCFunction)TimerBase_enter, METH_NOARGS,
     "Start a reading (record the start event) and return it."},
    {"__exit__", (PyCFunction)(void (*)(void))TimerBase_exit, METH_FASTCALL,
     "End the innermost open reading (record the end event)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef TimerBase_members[] = {
    {"name", T_OBJECT, offsetof(TimerBase, name), 0, "the name readings aggregate under, or None"},
    {"last", T_OBJECT, offsetof(TimerBase, last), READONLY, "the last finished reading, or None"},
    {"_mode", T_INT, offsetof(TimerBase, mode), 0,
     "a CUDA ordinal, or TIMER_CPU, TIMER_CUDA, TIMER_AUTO"},
    {"_hooks", T_INT, offsetof(TimerBase, hooks), 0,
     "TIMER_AFTER: call _after at exit; TIMER_BEFORE: _before at entry"},
    {"_open", T_OBJECT, offsetof(TimerBase, open), READONLY, "readings of open blocks"},
    {"_series", T_OBJECT, offsetof(TimerBase, series), 0, "the readings' series, or None"},
    {"_log", T_OBJECT, offsetof(TimerBase, log), 0, "the Logger durations go to, or None"},
    {"_step", T_OBJECT, offsetof(TimerBase, step), 0, "the step they are logged at, or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot TimerBase_slots[] = {
    {Py_tp_new, TimerBase_new},
    {Py_tp_dealloc, TimerBase_dealloc},
    {Py_tp_traverse, TimerBase_traverse},
    {Py_tp_clear, TimerBase_clear},
    {Py_tp_methods, TimerBase_methods},
    {Py_tp_members, TimerBase_members},
    {Py_tp_doc, "The C half of syncless.Timer: enter and exit of a timed block."},
    {0, NULL},
};

static PyType_Spec TimerBase_spec = {"syncless._C.TimerBase", sizeof(TimerBase), 0,
                                     Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
                                     TimerBase_slots};

/* bind_timer(Timing, auto_device): the record type TimerBase makes, and the Python function that
 * chooses a device when no CUDA context says it (called with the timer's mode). */
static PyObject *bind_timer(PyObject *module, PyObject *args)
{
    sl_state *st = sl_get_state(module);
    PyObject *timing, *chooser;
    if (!PyArg_ParseTuple(args, "OO", &timing, &chooser))
        return NULL;
    if (!PyType_Check(timing) || !PyType_IsSubtype((PyTypeObject *)timing, st->event_pair_type) ||
        !PyCallable_Check(chooser)) {
        PyErr_SetString(PyExc_TypeError, "bind_timer(Timing: EventPair subclass, callable)");
        return NULL;
    }
    Py_INCREF(timing);
    Py_XDECREF(st->timing_type);
    st->timing_type = timing;
    Py_INCREF(chooser);
    Py_XDECREF(st->auto_device);
    st->auto_device = chooser;
    Py_RETURN_NONE;
}

/* In a forked child CUDA is unusable: forget that it was up, so timers ask torch again. */
static PyObject *forget_cuda(PyObject *module, PyObject *unused)
{
    (void)unused;
    sl_get_state(module)->cuda_seen = 0;
    Py_RETURN_NONE;
}

static PyMethodDef clock_functions[] = {
    {"bind_timer", bind_timer, METH_VARARGS, "bind_timer(Timing, auto_device)"},
    {"forget_cuda", forget_cuda, METH_NOARGS, "After fork: CUDA is not known to be up."},
    {NULL, NULL, 0, NULL},
};

int sl_clock_init_types(PyObject *module, sl_state *st)
{
    if (!(st->after_str = PyUnicode_InternFromString("_after")) ||
        !(st->before_str = PyUnicode_InternFromString("_before")))
        return -1;
    st->clock_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &TimerBase_spec, NULL);
    if (st->clock_type == NULL ||
        PyModule_AddObjectRef(module, "TimerBase", (PyObject *)st->clock_type) ||
        PyModule_AddIntConstant(module, "TIMER_CPU", MODE_CPU) ||
        PyModule_AddIntConstant(module, "TIMER_CUDA", MODE_CUDA) ||
        PyModule_AddIntConstant(module, "TIMER_AUTO", MODE_AUTO) ||
        PyModule_AddIntConstant(module, "TIMER_AFTER", HOOK_AFTER) ||
        PyModule_AddIntConstant(module, "TIMER_BEFORE", HOOK_BEFORE))
        return -1;
    return PyModule_AddFunctions(module, clock_functions);
}
