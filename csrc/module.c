/* syncless._C: module state, multi-phase init and the module-level functions.
 *
 * Importing this module touches neither torch nor CUDA: the driver is loaded by the first Ring,
 * Window or EventPair, and torch is handed in by syncless._torch through bind_torch() (torch.c).
 * The constants Python needs (the ring's layout, the cell limit, the dtype kinds) are defined in
 * layout.h and exported here, never restated in Python. */
#include "syncless.h"

#include <string.h>

static PyMethodDef methods[] = {
    {"bind_torch", sl_bind_torch, METH_VARARGS,
     "bind_torch(Tensor, Parameter, dtype_kinds, exchange_capsule, raw_stream, resolve, number, "
     "real_types) -> whether the fast path is on"},
    {"learn_neg_bit", sl_learn_neg_bit, METH_O,
     "learn_neg_bit(probes) -> bool: find where torch keeps a tensor's negative bit, from plain "
     "tensors with and without it (False: is_neg() is asked instead)."},
    {"read_host_values", sl_read_host_values, METH_O,
     "read_host_values(metrics) -> (device, floats or None): read one call's metrics on the host, "
     "or name the CUDA device of the first GPU one"},
    {"tally", sl_tally, METH_VARARGS,
     "tally(rows, latest, nonfinite): each metric's last value into latest and its NaN/Inf "
     "count into nonfinite (either may be None), for rows made in Python"},
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
        PyModule_AddIntConstant(module, "COLUMN_BLOCK", SL_COLUMN_BLOCK) ||
        PyModule_AddIntConstant(module, "GATHER_NEW_COLUMN", SL_GATHER_NEW_COLUMN))
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
