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

/* bind_torch(Tensor, Parameter, dtype_kinds, exchange_capsule_or_None, raw_stream, resolve,
 *            number)
 * dtype_kinds maps torch dtypes to enum sl_kind for torch builds without the exchange table;
 * resolve(name, tensor) and number(name, value) are syncless._metric's slow paths. */
static PyObject *bind_torch(PyObject *module, PyObject *args)
{
    sl_state *st = sl_get_state(module);
    PyObject *tensor, *param, *kinds, *capsule, *raw_stream, *resolve, *number;
    if (!PyArg_ParseTuple(args, "OOO!OOOO", &tensor, &param, &PyDict_Type, &kinds, &capsule,
                          &raw_stream, &resolve, &number))
        return NULL;
    if (!PyType_Check(tensor) || !PyType_Check(param) || !PyCallable_Check(resolve) ||
        !PyCallable_Check(number)) {
        PyErr_SetString(PyExc_TypeError,
                        "bind_torch() needs torch.Tensor, torch.nn.Parameter and two callables");
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
    /* Unbound methods, called with the tensor: no attribute lookup per metric. */
    PyObject *is_neg = PyObject_GetAttr(tensor, st->is_neg_str);
    PyObject *offset = is_neg ? PyObject_GetAttr(tensor, st->storage_offset_str) : NULL;
    if (offset == NULL) {
        Py_XDECREF(is_neg);
        return NULL;
    }
    replace_ref(&st->is_neg_fn, is_neg);
    replace_ref(&st->offset_fn, offset);
    Py_DECREF(is_neg);
    Py_DECREF(offset);
    replace_ref(&st->tensor_type, tensor);
    replace_ref(&st->param_type, param);
    replace_ref(&st->dtype_codes, kinds);
    replace_ref(&st->raw_stream, raw_stream);
    replace_ref(&st->xapi_capsule, capsule);
    replace_ref(&st->resolver, resolve);
    replace_ref(&st->number, number);
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
        PyObject *keep;
        if (sl_metric_read(st, name, value, &m, &keep))
            goto error;
        Py_XDECREF(keep); /* only the device is reported, nothing is read later */
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
     "bind_torch(Tensor, Parameter, dtype_kinds, exchange_capsule, raw_stream, resolve, number) "
     "-> whether the fast path is on"},
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
    if (rc || PyModule_AddIntConstant(module, "MAX_CELLS", SL_MAX_CELLS))
        return -1;
    if (sl_ring_init_types(module, st) || sl_timer_init_types(module, st))
        return -1;
    return 0;
}

static int traverse(PyObject *module, visitproc visit, void *arg)
{
    sl_state *st = sl_get_state(module);
    Py_VISIT(st->ring_type);
    Py_VISIT(st->window_type);
    Py_VISIT(st->timer_type);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->xapi_capsule);
    Py_VISIT(st->dtype_codes);
    Py_VISIT(st->raw_stream);
    Py_VISIT(st->param_type);
    Py_VISIT(st->resolver);
    Py_VISIT(st->number);
    Py_VISIT(st->is_neg_fn);
    Py_VISIT(st->offset_fn);
    return 0;
}

static int clear(PyObject *module)
{
    sl_state *st = sl_get_state(module);
    Py_CLEAR(st->ring_type);
    Py_CLEAR(st->window_type);
    Py_CLEAR(st->timer_type);
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
