/* syncless._C: module state, multi-phase init and the module-level functions.
 *
 * Importing this module touches neither torch nor CUDA: the driver is loaded by the first Ring,
 * Window or EventPair, and torch is handed in by syncless.logger through bind_torch(). */
#include "syncless.h"

#include <string.h>

/* Py_XSETREF is not in the limited API. */
static void replace_ref(PyObject **slot, PyObject *value)
{
    PyObject *old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
}

sl_state *sl_get_state(PyObject *module)
{
    return (sl_state *)PyModule_GetState(module);
}

sl_state *sl_type_state(PyTypeObject *type)
{
    return (sl_state *)PyType_GetModuleState(type);
}

/* Our heap types carry the module; a Python subclass of one (Timer, Timing) does not, so look
 * at its bases. Only for constructors: instances keep the state pointer they were made with. */
sl_state *sl_state_of(PyTypeObject *type)
{
    for (int depth = 0; type != NULL && depth < 8; depth++) {
        sl_state *st = (sl_state *)PyType_GetModuleState(type);
        if (st != NULL)
            return st;
        PyErr_Clear();
        type = (PyTypeObject *)PyType_GetSlot(type, Py_tp_base);
    }
    PyErr_SetString(PyExc_TypeError, "syncless: not a syncless._C type");
    return NULL;
}

/* bind_torch(Tensor, dtype_kinds, exchange_capsule_or_None, raw_stream)
 * dtype_kinds maps torch dtypes to enum sl_kind for torch builds without the exchange table. */
static PyObject *bind_torch(PyObject *module, PyObject *args)
{
    sl_state *st = sl_get_state(module);
    PyObject *tensor, *kinds, *capsule, *raw_stream;
    if (!PyArg_ParseTuple(args, "OO!OO", &tensor, &PyDict_Type, &kinds, &capsule, &raw_stream))
        return NULL;
    if (!PyType_Check(tensor)) {
        PyErr_SetString(PyExc_TypeError, "bind_torch() needs torch.Tensor");
        return NULL;
    }
    const sl_exchange_api *api = NULL;
    if (capsule != Py_None) {
        api = (const sl_exchange_api *)PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
        if (api == NULL)
            return NULL;
        if (api->major != 1 || api->dltensor_from_py_object_no_sync == NULL ||
            api->current_work_stream == NULL)
            api = NULL; /* an ABI we were not written for: use the attribute path */
    }
    replace_ref(&st->tensor_type, tensor);
    replace_ref(&st->dtype_codes, kinds);
    replace_ref(&st->raw_stream, raw_stream);
    replace_ref(&st->xapi_capsule, capsule);
    st->xapi = api;
    return PyBool_FromLong(api != NULL);
}

/* values(metrics) -> (device, {name: float} or None)
 * Reads every metric of a call once. When none lives on a GPU the floats come back (the host
 * path of a logger); otherwise the CUDA device of the first GPU metric and None. */
static PyObject *values(PyObject *module, PyObject *metrics)
{
    sl_state *st = sl_get_state(module);
    if (!PyDict_Check(metrics)) {
        PyErr_SetString(PyExc_TypeError, "metrics must be a dict of name -> value");
        return NULL;
    }
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    int device = -1;
    while (PyDict_Next(metrics, &pos, &name, &value)) {
        sl_metric m;
        if (sl_metric_read(st, name, value, &m))
            goto error;
        if (m.device >= 0) {
            if (device < 0)
                device = m.device;
            continue;
        }
        double v;
        memcpy(&v, &m.cell.bits, 8);
        PyObject *f = PyFloat_FromDouble(v);
        if (f == NULL || PyDict_SetItem(out, name, f)) {
            Py_XDECREF(f);
            goto error;
        }
        Py_DECREF(f);
    }
    if (device >= 0) {
        Py_DECREF(out);
        return Py_BuildValue("(iO)", device, Py_None);
    }
    return Py_BuildValue("(iN)", -1, out);
error:
    Py_DECREF(out);
    return NULL;
}

static PyObject *driver_version(PyObject *module, PyObject *unused)
{
    (void)unused;
    sl_state *st = sl_get_state(module);
    if (sl_driver_load(st))
        return NULL;
    return PyLong_FromLong(st->drv.version);
}

PyObject *sl_ring_nbytes(PyObject *module, PyObject *args);

static PyMethodDef methods[] = {
    {"bind_torch", bind_torch, METH_VARARGS,
     "bind_torch(Tensor, dtype_kinds, exchange_capsule, raw_stream) -> whether the fast path is "
     "on"},
    {"values", values, METH_O,
     "values(metrics) -> (device, floats or None): read one call's metrics"},
    {"driver_version", driver_version, METH_NOARGS,
     "Load the CUDA driver (if not yet) and return its version, e.g. 13000."},
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
        !(st->is_cuda_str = PyUnicode_InternFromString("is_cuda")))
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
    if (sl_ring_init_types(module, st) || sl_timer_init_types(module, st) ||
        sl_clock_init_types(module, st))
        return -1;
    return 0;
}

static int traverse(PyObject *module, visitproc visit, void *arg)
{
    sl_state *st = sl_get_state(module);
    Py_VISIT(st->ring_type);
    Py_VISIT(st->window_type);
    Py_VISIT(st->timer_type);
    Py_VISIT(st->clock_type);
    Py_VISIT(st->timing_type);
    Py_VISIT(st->auto_device);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->xapi_capsule);
    Py_VISIT(st->dtype_codes);
    Py_VISIT(st->raw_stream);
    return 0;
}

static int clear(PyObject *module)
{
    sl_state *st = sl_get_state(module);
    Py_CLEAR(st->ring_type);
    Py_CLEAR(st->window_type);
    Py_CLEAR(st->timer_type);
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
    Py_CLEAR(st->is_cuda_str);
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
