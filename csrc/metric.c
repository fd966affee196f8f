/* One Python object -> one cell: where the gather kernel reads the value and how to convert it.
 *
 * A CUDA tensor becomes its device address (read later, in stream order, by the kernel); a Python
 * number or a CPU tensor becomes the value itself, carried inside the launch. The fast path reads
 * a tensor through torch's DLPack exchange table (tens of ns, no requires_grad refusal); older
 * torch goes through data_ptr()/dtype/get_device(). Errors name the metric and the problem. */
#include "syncless.h"

#include <math.h>
#include <string.h>

static int kind_of(const DLDataType *t)
{
    if (t->lanes != 1)
        return -1;
    switch (t->code) {
    case kDLFloat:
        return t->bits == 16 ? SL_F16 : t->bits == 32 ? SL_F32 : t->bits == 64 ? SL_F64 : -1;
    case kDLBfloat: return t->bits == 16 ? SL_BF16 : -1;
    case kDLInt:
        return t->bits == 8    ? SL_I8
               : t->bits == 16 ? SL_I16
               : t->bits == 32 ? SL_I32
               : t->bits == 64 ? SL_I64
                               : -1;
    case kDLUInt:
        return t->bits == 8    ? SL_U8
               : t->bits == 16 ? SL_U16
               : t->bits == 32 ? SL_U32
               : t->bits == 64 ? SL_U64
                               : -1;
    case kDLBool: return SL_BOOL;
    }
    return -1;
}

/* A value of type T at p, which may be unaligned (a 0-dim view into a packed buffer). */
#define load_as(T, p) (*(const T *)memcpy(&(T){0}, (p), sizeof(T)))

/* Read a value of `kind` from host memory; CPU tensors are read at the call, like the kernel
 * reads device tensors at the call in stream order. */
static double host_value(const void *p, int kind)
{
    switch (kind) {
    case SL_F16: {
        uint16_t h;
        memcpy(&h, p, 2);
        int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        double v = e == 0    ? ldexp(m, -24)
                   : e == 31 ? (m ? NAN : INFINITY)
                             : ldexp(m | 0x400, e - 25);
        return (h & 0x8000) ? -v : v;
    }
    case SL_BF16: {
        uint16_t h;
        uint32_t w;
        float f;
        memcpy(&h, p, 2);
        w = (uint32_t)h << 16;
        memcpy(&f, &w, 4);
        return f;
    }
    case SL_F32: return load_as(float, p);
    case SL_F64: return load_as(double, p);
    case SL_I8: return load_as(int8_t, p);
    case SL_I16: return load_as(int16_t, p);
    case SL_I32: return load_as(int32_t, p);
    case SL_I64: return (double)load_as(int64_t, p);
    case SL_U8: return load_as(uint8_t, p);
    case SL_U16: return load_as(uint16_t, p);
    case SL_U32: return load_as(uint32_t, p);
    case SL_U64: return (double)load_as(uint64_t, p);
    case SL_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
    }
    return NAN;
}

static void set_host(sl_metric *out, double v)
{
    memcpy(&out->cell.bits, &v, 8);
    out->cell.kind = SL_HOST;
    out->device = -1;
}

static int from_parts(PyObject *name, const char *shape_text, int64_t numel, int kind,
                      int device_type, int device_id, const char *data, sl_metric *out)
{
    if (numel != 1) {
        PyErr_Format(PyExc_ValueError, "metric %R must hold one element, got shape %s", name,
                     shape_text);
        return -1;
    }
    if (kind < 0) {
        PyErr_Format(PyExc_TypeError,
                     "metric %R has a dtype syncless cannot log as a real "
                     "number (complex or packed types are not metrics)",
                     name);
        return -1;
    }
    if (device_type == kDLCPU || device_type == kDLCUDAHost) {
        set_host(out, host_value(data, kind));
        return 0;
    }
    if (device_type != kDLCUDA) {
        PyErr_Format(PyExc_TypeError,
                     "metric %R lives on a device syncless cannot read (DLPack "
                     "device type %d); log CPU or CUDA tensors",
                     name, device_type);
        return -1;
    }
    out->cell.bits = (uint64_t)(uintptr_t)data;
    out->cell.kind = (uint32_t)kind;
    out->device = device_id;
    return 0;
}

static void shape_string(char *buf, size_t size, const int64_t *shape, int ndim)
{
    size_t n = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n,
                              ndim == 1 ? "%lld,"
                              : i       ? ", %lld"
                                        : "%lld",
                              (long long)shape[i]);
    if (n < size)
        snprintf(buf + n, size - n, ")");
}

static int read_exchange(sl_state *st, PyObject *name, PyObject *value, sl_metric *out)
{
    DLTensor t;
    if (st->xapi->dltensor_from_py_object_no_sync(value, &t) != 0) {
        /* torch refuses tensors with no data to view (meta, sparse, ...); say which metric. */
        PyObject *type, *val, *tb, *text = NULL, *lines = NULL;
        PyErr_Fetch(&type, &val, &tb);
        if (val && (text = PyObject_Str(val)) != NULL)
            lines = PyUnicode_Splitlines(text, 0); /* torch appends a C++ backtrace */
        PyErr_Format(PyExc_TypeError, "metric %R: this tensor has no data syncless can read (%S)",
                     name, lines && PyList_Size(lines) ? PyList_GetItem(lines, 0) : Py_None);
        Py_XDECREF(lines);
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
        return -1;
    }
    int64_t numel = 1;
    for (int i = 0; i < t.ndim; i++)
        numel *= t.shape[i];
    char shape[128] = "";
    if (numel != 1)
        shape_string(shape, sizeof shape, t.shape, t.ndim);
    return from_parts(name, shape, numel, kind_of(&t.dtype), t.device.device_type,
                      t.device.device_id, (const char *)t.data + t.byte_offset, out);
}

/* torch without the exchange table: four attribute calls, still no sync. */
static int read_fallback(sl_state *st, PyObject *name, PyObject *value, sl_metric *out)
{
    PyObject *numel = NULL, *dtype = NULL, *kindobj = NULL, *dev = NULL, *ptr = NULL;
    int rc = -1;
    if (!(numel = PyObject_CallMethodObjArgs(value, st->numel_str, NULL)))
        goto error;
    long long n = PyLong_AsLongLong(numel);
    if (n != 1) {
        PyObject *shape = PyObject_GetAttrString(value, "shape");
        PyObject *tuple = shape ? PySequence_Tuple(shape) : NULL;
        Py_XDECREF(shape);
        if (tuple) {
            PyErr_Format(PyExc_ValueError, "metric %R must hold one element, got shape %S", name,
                         tuple);
            Py_DECREF(tuple);
        }
        goto error;
    }
    if (!(dtype = PyObject_GetAttr(value, st->dtype_str)))
        goto error;
    kindobj = PyDict_GetItemWithError(st->dtype_codes, dtype); /* borrowed */
    if (kindobj == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "metric %R has dtype %S, which is not a real number",
                         name, dtype);
        goto error;
    }
    int kind = (int)PyLong_AsLong(kindobj);
    if (!(dev = PyObject_CallMethodObjArgs(value, st->get_device_str, NULL)) ||
        !(ptr = PyObject_CallMethodObjArgs(value, st->data_ptr_str, NULL)))
        goto error;
    long device = PyLong_AsLong(dev);
    void *data = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred())
        goto error;
    rc = from_parts(name, "", 1, kind, device < 0 ? kDLCPU : kDLCUDA, (int)device, data, out);
error:
    Py_XDECREF(numel);
    Py_XDECREF(dtype);
    Py_XDECREF(dev);
    Py_XDECREF(ptr);
    return rc;
}

int sl_metric_read(sl_state *st, PyObject *name, PyObject *value, sl_metric *out)
{
    if (PyFloat_Check(value)) {
        set_host(out, PyFloat_AsDouble(value));
        return 0;
    }
    if (PyLong_Check(value)) { /* bool included */
        double v = PyLong_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "metric %R is an integer too large for a float", name);
            return -1;
        }
        set_host(out, v);
        return 0;
    }
    if (st->tensor_type && PyObject_TypeCheck(value, (PyTypeObject *)st->tensor_type))
        return st->xapi ? read_exchange(st, name, value, out) : read_fallback(st, name, value, out);
    if (PyUnicode_Check(value) || PyBytes_Check(value) || PyComplex_Check(value) ||
        !PyNumber_Check(value)) {
        PyErr_Format(PyExc_TypeError,
                     "metric %R must be a real number or a one-element tensor, "
                     "got %s",
                     name,
                     Py_TYPE(value) == &PyUnicode_Type ? "str"
                     : PyComplex_Check(value)          ? "a complex number"
                                                       : "an unsupported type");
        return -1;
    }
    /* numpy scalars and other real numbers */
    PyObject *f = PyNumber_Float(value);
    if (f == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "metric %R must be a real number or a one-element tensor",
                     name);
        return -1;
    }
    set_host(out, PyFloat_AsDouble(f));
    Py_DECREF(f);
    return 0;
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
