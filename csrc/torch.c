/* The torch binding: what syncless._torch hands the C core, and torch's current stream.
 *
 * The module never imports torch. syncless._torch calls bind_torch() once with torch.Tensor,
 * nn.Parameter, the dtype map, torch's DLPack exchange table (torch >= 2.10: a non-owning view of
 * a tensor in tens of ns, and the current work stream) and the Python slow paths. */
#include "syncless.h"

/* Py_XSETREF is not in the limited API. */
static void replace_ref(PyObject **slot, PyObject *value)
{
    PyObject *old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
}

/* bind_torch(Tensor, Parameter, dtype_kinds, exchange_capsule_or_None, raw_stream, resolve,
 *            number, real_types)
 * dtype_kinds maps torch dtypes to enum sl_kind for torch builds without the exchange table;
 * resolve(name, tensor) and number(name, value) are syncless._metric's slow paths; real_types is
 * its dict of scalar types (numpy's) that number() found to be real: read with float() in C. */
PyObject *sl_bind_torch(PyObject *module, PyObject *args)
{
    sl_state *st = sl_get_state(module);
    PyObject *tensor, *param, *kinds, *capsule, *raw_stream, *resolve, *number, *real_types;
    if (!PyArg_ParseTuple(args, "OOO!OOOOO!", &tensor, &param, &PyDict_Type, &kinds, &capsule,
                          &raw_stream, &resolve, &number, &PyDict_Type, &real_types))
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
    replace_ref(&st->real_types, real_types);
    st->xapi = api;
    st->neg_obj_off = 0; /* learnt again for these types (learn_neg_bit) */
    return PyBool_FromLong(api != NULL);
}

int sl_current_stream(sl_state *st, int device, CUstream *out)
{
    void *s = NULL;
    if (st->xapi) {
        if (st->xapi->current_work_stream(kDLCUDA, device, &s) != 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "torch could not name its current stream");
            return -1;
        }
        *out = (CUstream)s;
        return 0;
    }
    /* torch without the exchange table: its raw-stream getter (about 0.1 us). */
    if (st->raw_stream == NULL || st->raw_stream == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "syncless: torch is not bound (no stream source)");
        return -1;
    }
    PyObject *r = PyObject_CallFunction(st->raw_stream, "i", device);
    if (r == NULL)
        return -1;
    *out = (CUstream)PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
}
