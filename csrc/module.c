/* syncless._C: module state, multi-phase init and the module-level functions.
 *
 * Importing this module touches neither torch nor CUDA: the driver is loaded by the first Ring,
 * Window or EventPair, and torch is handed in by syncless._torch through bind_torch() (torch.c).
 * The constants Python needs (the ring's layout, the cell limit, the dtype kinds) are defined in
 * layout.h and exported here, never restated in Python. */
#include "syncless.h"

#include <string.h>
#ifndef _WIN32
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#endif

static PyObject *driver_version(PyObject *module, PyObject *unused)
{
    (void)unused;
    sl_state *st = sl_get_state(module);
    if (sl_driver_load(st))
        return NULL;
    return PyLong_FromLong(st->drv.version);
}

/* defer_signals(signums): hold those signals until restore_signals(), so that no Python handler
 * (Ctrl-C's KeyboardInterrupt) runs in between. Two mechanisms, because Python runs a handler on
 * the main thread whichever thread the OS gave the signal to:
 *  - they are blocked on this thread (the main one), so a signal sent to it waits in the OS;
 *  - a signal sent to the process goes to some other thread that does not block it (a CUDA
 *    driver thread, a DataLoader's), where CPython's C handler would note it and the main
 *    thread would run the Python handler at its next bytecode: so, for the signals whose
 *    handler is CPython's, a C handler of ours takes its place that sends the signal on to
 *    this thread, where it waits with the others; restore_signals() puts CPython's back. One
 *    the OS gave that thread just before the restore may pass it on just after: its Python
 *    handler then runs a few microseconds after the restore, never inside, and none is lost.
 * The mask and handlers before are kept here, not returned, so an exception landing between the
 * calls and Python's bookkeeping cannot lose them: restore_signals() in a `finally` puts them back
 * whatever ran. Nested pairs act at the outermost. A handler already due runs here, once the
 * signals are held (as signal.pthread_sigmask runs it); one that raises leaves all as it was.
 * About 15-20 sigaction and 2 pthread_sigmask system calls a pair, a few microseconds, where
 * Python's signal.getsignal per signal and signal.pthread_sigmask's sets of Signals members cost
 * the H200's host ~100 us. Holding a signal that has no Python handler only delays its default
 * action by as long as the hold lasts; one whose default action is to stop the process, sent to
 * the process while another thread does not block it, still stops it at once. */
#ifndef _WIN32
#define HELD_MAX 64 /* signals one deferral can name */
static sigset_t saved_mask;
static int mask_depth;
static void (*python_handler)(int);             /* CPython's C handler, once seen */
static int held_signals[HELD_MAX], n_held;      /* signals whose handler we replaced */
static struct sigaction held_actions[HELD_MAX]; /* ...and their handlers before */
static pthread_t holder;                        /* the thread that defers (the main one) */

/* On whichever thread the OS chose: on to the holder (pthread_kill is async-signal-safe). */
static void pass_signal(int sig)
{
    int saved = errno;
    pthread_kill(holder, sig);
    errno = saved;
}

/* CPython installs one C function for every Python-level handler; SIGINT's, Python's own
 * default_int_handler, shows its address. Unknown until a SIGINT handler is CPython's. */
static void learn_python_handler(void)
{
    struct sigaction cur;
    if (python_handler == NULL && sigaction(SIGINT, NULL, &cur) == 0 &&
        !(cur.sa_flags & SA_SIGINFO) && cur.sa_handler != SIG_DFL && cur.sa_handler != SIG_IGN &&
        cur.sa_handler != pass_signal)
        python_handler = cur.sa_handler;
}

static void take_handlers(const int *sigs, int n)
{
    learn_python_handler();
    n_held = 0;
    if (python_handler == NULL)
        return;
    holder = pthread_self();
    for (int i = 0; i < n && n_held < HELD_MAX; i++) {
        struct sigaction cur, ours;
        if (sigaction(sigs[i], NULL, &cur) || (cur.sa_flags & SA_SIGINFO) ||
            cur.sa_handler != python_handler)
            continue;
        ours = cur;
        ours.sa_handler = pass_signal;
        sigfillset(&ours.sa_mask); /* pass_signal runs alone */
        if (sigaction(sigs[i], &ours, NULL) == 0) {
            held_actions[n_held] = cur;
            held_signals[n_held++] = sigs[i];
        }
    }
}

/* CPython's handlers back (unless something installed another meanwhile); the signals passed
 * on meanwhile wait on this thread (blocked) until the mask comes back. */
static void give_back_handlers(void)
{
    for (int i = 0; i < n_held; i++) {
        struct sigaction cur;
        if (sigaction(held_signals[i], NULL, &cur) == 0 && cur.sa_handler == pass_signal)
            sigaction(held_signals[i], &held_actions[i], NULL);
    }
    n_held = 0;
}

static void end_deferral(void)
{
    give_back_handlers();
    pthread_sigmask(SIG_SETMASK, &saved_mask, NULL);
}
#endif

static PyObject *defer_signals(PyObject *module, PyObject *signums)
{
    (void)module;
#ifdef _WIN32
    (void)signums;
#else
    if (!PyTuple_Check(signums)) {
        PyErr_SetString(PyExc_TypeError, "defer_signals() takes a tuple of signal numbers");
        return NULL;
    }
    sigset_t set, old;
    int sigs[HELD_MAX], n = 0;
    sigemptyset(&set);
    for (Py_ssize_t i = 0, k = PyTuple_Size(signums); i < k; i++) {
        long v = PyLong_AsLong(PyTuple_GetItem(signums, i));
        if (v == -1 && PyErr_Occurred())
            return NULL;
        if (v <= 0 || v >= NSIG || sigaddset(&set, (int)v)) {
            PyErr_Format(PyExc_ValueError, "defer_signals(): %ld is not a signal number", v);
            return NULL;
        }
        if (n < HELD_MAX)
            sigs[n++] = (int)v;
    }
    int err = pthread_sigmask(SIG_BLOCK, &set, &old);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (mask_depth++ == 0) {
        saved_mask = old;
        take_handlers(sigs, n);
    }
    if (PyErr_CheckSignals()) {
        if (--mask_depth == 0)
            end_deferral();
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

/* restore_signals(): undo the matching defer_signals() (nothing when it raised or never ran);
 * at the outermost, the handlers and mask before it come back and the handlers of the signals
 * that arrived meanwhile run: one that raises raises here. */
static PyObject *restore_signals(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
#ifndef _WIN32
    if (mask_depth == 0 || --mask_depth > 0)
        Py_RETURN_NONE;
    give_back_handlers();
    int err = pthread_sigmask(SIG_SETMASK, &saved_mask, NULL);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (PyErr_CheckSignals())
        return NULL;
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"defer_signals", defer_signals, METH_O,
     "defer_signals(signums): block these signals on this thread until restore_signals()"},
    {"restore_signals", restore_signals, METH_NOARGS,
     "restore_signals(): undo the matching defer_signals(); pending handlers then run"},
    {"bind_torch", sl_bind_torch, METH_VARARGS,
     "bind_torch(Tensor, Parameter, dtype_kinds, exchange_capsule, raw_stream, resolve, number, "
     "real_types) -> whether the fast path is on"},
    {"learn_neg_bit", sl_learn_neg_bit, METH_O,
     "learn_neg_bit(probes) -> bool: find where torch keeps a tensor's negative bit, from plain "
     "tensors with and without it (False: is_neg() is asked instead)."},
    {"read_host_values", sl_read_host_values, METH_O,
     "read_host_values(metrics) -> (device, floats or None): read one call's metrics on the host, "
     "or name the CUDA device of the first GPU one"},
    {"driver_version", driver_version, METH_NOARGS,
     "Load the CUDA driver (if not yet) and return its version, e.g. 13000."},
    {"event_floor", sl_event_floor, METH_VARARGS,
     "event_floor(device, n) -> {what: ns per pair}: the driver's cost of timing, measured in C"},
    {"ring_nbytes", sl_ring_nbytes, METH_VARARGS,
     "ring_nbytes(capacity, columns) -> device bytes a Ring of that shape needs"},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module)
{
    sl_state *st = sl_get_state(module);
    memset(st, 0, sizeof *st);
    if (!(st->data_ptr_str = PyUnicode_InternFromString("data_ptr")) ||
        !(st->dtype_str = PyUnicode_InternFromString("dtype")) ||
        !(st->get_device_str = PyUnicode_InternFromString("get_device")) ||
        !(st->numel_str = PyUnicode_InternFromString("numel")) ||
        !(st->is_neg_str = PyUnicode_InternFromString("is_neg")) ||
        !(st->storage_offset_str = PyUnicode_InternFromString("storage_offset")))
        return -1;
    if (sl_CudaError == NULL) {
        sl_CudaError =
            PyErr_NewExceptionWithDoc("syncless.CudaError",
                                      "A CUDA driver call failed; the message carries the driver's "
                                      "own error name and text.",
                                      PyExc_RuntimeError, NULL);
        if (sl_CudaError == NULL)
            return -1;
    }
    if (PyModule_AddObjectRef(module, "CudaError", sl_CudaError))
        return -1;
    PyObject *kinds = PyDict_New();
    if (kinds == NULL)
        return -1;
    for (const sl_kind_info *k = sl_kinds; k->name; k++) {
        PyObject *v = PyLong_FromLong(k->kind);
        if (v == NULL || PyDict_SetItemString(kinds, k->name, v)) {
            Py_XDECREF(v);
            Py_DECREF(kinds);
            return -1;
        }
        Py_DECREF(v);
    }
    int rc = PyModule_AddObjectRef(module, "KINDS", kinds);
    Py_DECREF(kinds);
    if (rc || PyModule_AddIntConstant(module, "MAX_CELLS", SL_MAX_CELLS) ||
        PyModule_AddIntConstant(module, "HEADER_BYTES", SL_HEADER_BYTES) ||
        PyModule_AddIntConstant(module, "ROW_HEADER_WORDS", SL_ROW_HEADER_WORDS) ||
        PyModule_AddIntConstant(module, "COLUMN_BLOCK", SL_COLUMN_BLOCK))
        return -1;
    PyObject *tag = PyLong_FromUnsignedLongLong(SL_CAPTURED_TAG);
    if (tag == NULL)
        return -1;
    rc = PyModule_AddObjectRef(module, "CAPTURED_TAG", tag);
    Py_DECREF(tag);
    if (rc)
        return -1;
    if (sl_ring_init_types(module, st) || sl_event_pair_init_types(module, st) ||
        sl_clock_init_types(module, st))
        return -1;
    return 0;
}

static int traverse(PyObject *module, visitproc visit, void *arg)
{
    sl_state *st = sl_get_state(module);
    Py_VISIT(st->ring_type);
    Py_VISIT(st->window_type);
    Py_VISIT(st->event_pair_type);
    Py_VISIT(st->clock_type);
    Py_VISIT(st->timing_type);
    Py_VISIT(st->auto_device);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->xapi_capsule);
    Py_VISIT(st->dtype_codes);
    Py_VISIT(st->raw_stream);
    Py_VISIT(st->param_type);
    Py_VISIT(st->resolver);
    Py_VISIT(st->number);
    Py_VISIT(st->real_types);
    Py_VISIT(st->is_neg_fn);
    Py_VISIT(st->offset_fn);
    return 0;
}

static int clear(PyObject *module)
{
    sl_state *st = sl_get_state(module);
    Py_CLEAR(st->ring_type);
    Py_CLEAR(st->window_type);
    Py_CLEAR(st->event_pair_type);
    Py_CLEAR(st->clock_type);
    Py_CLEAR(st->timing_type);
    Py_CLEAR(st->auto_device);
    Py_CLEAR(st->after_str);
    Py_CLEAR(st->before_str);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->xapi_capsule);
    Py_CLEAR(st->dtype_codes);
    Py_CLEAR(st->raw_stream);
    Py_CLEAR(st->data_ptr_str);
    Py_CLEAR(st->dtype_str);
    Py_CLEAR(st->get_device_str);
    Py_CLEAR(st->numel_str);
    Py_CLEAR(st->is_neg_str);
    Py_CLEAR(st->storage_offset_str);
    Py_CLEAR(st->param_type);
    Py_CLEAR(st->resolver);
    Py_CLEAR(st->number);
    Py_CLEAR(st->real_types);
    Py_CLEAR(st->is_neg_fn);
    Py_CLEAR(st->offset_fn);
    st->xapi = NULL;
    return 0;
}

static void free_module(void *module)
{
    sl_state *st = sl_get_state((PyObject *)module);
    clear((PyObject *)module);
    if (st->driver_state == 1)
        sl_events_clear(st);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "syncless._C",
    "The hot path of syncless: read metric tensors, launch the gather kernel, copy windows, "
    "record and query CUDA events. Policy lives in the Python package.",
    sizeof(sl_state),
    methods,
    slots,
    traverse,
    clear,
    free_module,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&moduledef);
}
