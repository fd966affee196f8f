/* One Python object -> one cell: where the gather kernel reads the value and how to convert it.
 *
 * A CUDA tensor becomes its device address (read later, in stream order, by the kernel); a Python
 * number or a CPU tensor becomes the value itself, carried inside the launch. The fast path reads
 * a tensor through torch's DLPack exchange table (tens of ns, no requires_grad refusal); older
 * torch goes through data_ptr()/dtype/get_device(). Errors name the metric and the problem. */
#include "syncless.h"

#include <math.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h> /* malloc_usable_size: how far a TensorImpl may be read */
#endif

/* Every dtype a metric may have: the kernel's kind number, torch's name, the DLPack code.
 * Exported as _C.KINDS; the torch binding derives its dtype map from it. */
const sl_kind_info sl_kinds[] = {
    {SL_F16, "float16", kDLFloat, 16},
    {SL_BF16, "bfloat16", kDLBfloat, 16},
    {SL_F32, "float32", kDLFloat, 32},
    {SL_F64, "float64", kDLFloat, 64},
    {SL_I8, "int8", kDLInt, 8},
    {SL_I16, "int16", kDLInt, 16},
    {SL_I32, "int32", kDLInt, 32},
    {SL_I64, "int64", kDLInt, 64},
    {SL_U8, "uint8", kDLUInt, 8},
    {SL_U16, "uint16", kDLUInt, 16},
    {SL_U32, "uint32", kDLUInt, 32},
    {SL_U64, "uint64", kDLUInt, 64},
    {SL_BOOL, "bool", kDLBool, 8},
    {SL_F8E4M3FN, "float8_e4m3fn", kDLFloat8_e4m3fn, 8},
    {SL_F8E5M2, "float8_e5m2", kDLFloat8_e5m2, 8},
    {SL_F8E4M3FNUZ, "float8_e4m3fnuz", kDLFloat8_e4m3fnuz, 8},
    {SL_F8E5M2FNUZ, "float8_e5m2fnuz", kDLFloat8_e5m2fnuz, 8},
    {SL_F8E8M0FNU, "float8_e8m0fnu", kDLFloat8_e8m0fnu, 8},
    {0, NULL, 0, 0},
};

static int kind_of(int code, int bits, int lanes)
{
    if (lanes != 1)
        return -1;
    for (const sl_kind_info *k = sl_kinds; k->name; k++)
        if (k->code == code && k->bits == bits)
            return k->kind;
    return -1;
}

static size_t kind_size(int kind)
{
    for (const sl_kind_info *k = sl_kinds; k->name; k++)
        if (k->kind == kind)
            return k->bits / 8;
    return 1;
}

/* An 8-bit float: sign, `e` exponent bits, `m` mantissa bits. The "fn" formats have no
 * infinity (all ones is NaN), "fnuz" ones no negative zero (0x80 is NaN); e8m0 is unsigned, a
 * bare exponent. The same decoding runs in the gather kernel (gather.cu, minifloat). */
static double minifloat(unsigned b, int kind)
{
    int e = 4, m = 3, bias = 7;
    switch (kind) {
    case SL_F8E5M2: e = 5, m = 2, bias = 15; break;
    case SL_F8E4M3FNUZ: bias = 8; break;
    case SL_F8E5M2FNUZ: e = 5, m = 2, bias = 16; break;
    case SL_F8E8M0FNU: return b == 0xff ? NAN : ldexp(1.0, (int)b - 127);
    }
    if ((kind == SL_F8E4M3FNUZ || kind == SL_F8E5M2FNUZ) && b == 0x80)
        return NAN;
    if (kind == SL_F8E4M3FN && (b & 0x7f) == 0x7f)
        return NAN;
    unsigned ex = (b >> m) & ((1u << e) - 1), man = b & ((1u << m) - 1);
    if (kind == SL_F8E5M2 && ex == 31)
        return man ? NAN : (b & 0x80 ? -INFINITY : INFINITY);
    double v =
        ex ? ldexp((double)(man | 1u << m), (int)ex - bias - m) : ldexp((double)man, 1 - bias - m);
    return b & 0x80 ? -v : v;
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
    case SL_F8E4M3FN:
    case SL_F8E5M2:
    case SL_F8E4M3FNUZ:
    case SL_F8E5M2FNUZ:
    case SL_F8E8M0FNU: return minifloat(*(const uint8_t *)p, kind);
    }
    return NAN;
}

static void set_host(sl_metric *out, double v)
{
    memcpy(&out->cell.bits, &v, 8);
    out->cell.kind = SL_HOST;
    out->device = -1;
}

static void set_device(sl_metric *out, const char *data, int kind, int device_id)
{
    out->cell.bits = (uint64_t)(uintptr_t)data;
    out->cell.kind = (uint32_t)kind;
    out->device = device_id;
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

static int dtype_error(PyObject *name, const DLDataType *t)
{
    if (t->code == kDLComplex)
        PyErr_Format(PyExc_TypeError,
                     "metric %R has a dtype that is not a real number: complex%d (log its "
                     ".real, .imag or .abs())",
                     name, (int)t->bits);
    else if (t->lanes != 1 || t->bits < 8)
        PyErr_Format(PyExc_TypeError,
                     "metric %R has a dtype that packs %d values of %d bits into each element "
                     "(e.g. float4_e2m1fn_x2), not one real number; unpack it first",
                     name, (int)t->lanes, (int)t->bits);
    else
        PyErr_Format(PyExc_TypeError,
                     "metric %R has a dtype syncless cannot log as a real number (DLPack code %d, "
                     "%d bits)",
                     name, (int)t->code, (int)t->bits);
    return -1;
}

/* An exact tensor type (torch.Tensor, nn.Parameter). */
static int is_plain(sl_state *st, PyObject *value)
{
    return Py_IS_TYPE(value, (PyTypeObject *)st->tensor_type) ||
           (st->param_type && Py_IS_TYPE(value, (PyTypeObject *)st->param_type));
}

/* Does the tensor carry a negative bit (x.conj().imag, torch._neg_view): a pending sign the
 * memory does not hold? 1 yes, 0 no, -1 error. Asking torch (is_neg()) costs ~0.34 us per tensor
 * on the CI host, more than reading the tensor itself; when learn_neg_bit() found where this
 * torch keeps the bit, it is one load from the tensor's key set (a few ns). */
static int negative(sl_state *st, PyObject *t)
{
    if (st->neg_obj_off && !(st->neg_flag_off && ((const char *)t)[st->neg_flag_off])) {
        const char *impl;
        uint64_t keys;
        memcpy(&impl, (const char *)t + st->neg_obj_off, sizeof impl);
        memcpy(&keys, impl + st->neg_key_off, sizeof keys);
        return (keys & st->neg_bit) != 0;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(st->is_neg_fn, t, NULL);
    if (r == NULL)
        return -1;
    int neg = PyObject_IsTrue(r);
    Py_DECREF(r);
    return neg;
}

/* Can the element at `data` be read, and is its value the tensor's? 1 yes; 0 hand it to the
 * Python resolver; -1 error set. A NULL pointer is a tensor without data (functionalized, zero,
 * storage freed). A storage freed with resize_(0) (FSDP frees parameters that way) leaves its
 * views a pointer of storage_offset * itemsize, not NULL: one call tells them apart. Measured on
 * the CI host (2 cores, torch 2.13), per tensor: the read itself 0.23 us, storage_offset()
 * 0.16 us (called only for pointers below 2^40, see below). A storage shrunk to a nonzero size
 * below a view is read as torch reads it (the resolver checks bounds when it is called for
 * another reason). */
static int readable(sl_state *st, PyObject *t, const char *data, size_t itemsize)
{
    if (data == NULL)
        return 0;
    int neg = negative(st, t);
    if (neg)
        return neg < 0 ? -1 : 0;
    /* A storage without memory leaves a pointer below its former size; no real allocation
     * (heap, mmap, CUDA's address range) lies that low, so only low pointers need the call. */
    if ((uintptr_t)data >= ((uintptr_t)1 << 40))
        return 1;
    PyObject *offset = PyObject_CallFunctionObjArgs(st->offset_fn, t, NULL);
    if (offset == NULL)
        return -1;
    Py_ssize_t off = PyLong_AsSsize_t(offset);
    Py_DECREF(offset);
    if (off == -1 && PyErr_Occurred())
        return -1;
    return (uintptr_t)data != (uintptr_t)off * itemsize; /* equal: the storage has no memory */
}

/* The words of a TensorImpl searched for the key set: at most SL_IMPL_WORDS, and never past the
 * smallest probe's allocation (torch allocates a TensorImpl with operator new, that is malloc;
 * 176 bytes on torch 2.13), so the search reads nothing outside the objects. */
#define SL_IMPL_WORDS 32

static Py_ssize_t impl_words(const char *const *impl, Py_ssize_t n)
{
#ifdef __GLIBC__
    size_t least = SL_IMPL_WORDS * 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t size = malloc_usable_size((void *)impl[i]);
        if (size < least)
            least = size;
    }
    return (Py_ssize_t)(least / 8);
#else
    (void)impl, (void)n;
    return 22; /* sizeof(TensorImpl) on torch 2.13, x86-64 and aarch64 */
#endif
}

/* learn_neg_bit(probes) -> bool: find where this torch keeps a tensor's negative bit.
 * probes: plain tensors, some with the bit. Each one's TensorImpl address (Tensor._cdata) must
 * sit at one offset of the Python object, either right after the object header or behind a
 * zero flag byte (torch's MaybeOwned); and exactly one bit of one word of the TensorImpl must be
 * set in every negative probe and clear in every other. Anything less and the answer is False:
 * negative() keeps asking is_neg(). */
PyObject *sl_learn_neg_bit(PyObject *module, PyObject *probes)
{
    sl_state *st = sl_get_state(module);
    st->neg_obj_off = 0;
    if (st->is_neg_fn == NULL || !PyList_Check(probes)) {
        PyErr_SetString(PyExc_TypeError, "learn_neg_bit(list of tensors) after bind_torch()");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(probes), negs = 0, obj_off = 0, flag_off = 0, key_off = -1;
    if (n > 64)
        n = 64;
    const char *impl[64];
    int neg[64];
    uint64_t bit = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GetItem(probes, i);
        if (!is_plain(st, t))
            Py_RETURN_FALSE;
        PyObject *cdata = PyObject_GetAttrString(t, "_cdata");
        impl[i] = cdata ? (const char *)PyLong_AsVoidPtr(cdata) : NULL;
        Py_XDECREF(cdata);
        if ((neg[i] = negative(st, t)) < 0 || impl[i] == NULL)
            return NULL;
        negs += neg[i];
    }
    if (negs < 3 || n - negs < 3)
        Py_RETURN_FALSE;
    const Py_ssize_t head = 2 * (Py_ssize_t)sizeof(void *); /* refcount, type */
    for (Py_ssize_t off = head; off <= head + 8 && !obj_off; off += 8) {
        int all = 1;
        for (Py_ssize_t i = 0; i < n && all; i++) {
            const char *obj = (const char *)PyList_GetItem(probes, i), *p;
            memcpy(&p, obj + off, sizeof p);
            all = p == impl[i] && (off == head || obj[head] == 0);
        }
        if (all)
            obj_off = off, flag_off = off == head ? 0 : head;
    }
    if (!obj_off)
        Py_RETURN_FALSE;
    Py_ssize_t words = impl_words(impl, n);
    for (Py_ssize_t w = 1; w < words; w++) {
        uint64_t set = ~(uint64_t)0, clear = ~(uint64_t)0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t keys;
            memcpy(&keys, impl[i] + 8 * w, 8);
            if (neg[i])
                set &= keys;
            else
                clear &= ~keys;
        }
        uint64_t found = set & clear;
        if (found == 0)
            continue;
        if (key_off >= 0 || (found & (found - 1)))
            Py_RETURN_FALSE; /* more than one candidate: ambiguous */
        key_off = 8 * w, bit = found;
    }
    if (key_off < 0)
        Py_RETURN_FALSE;
    st->neg_flag_off = flag_off, st->neg_key_off = key_off, st->neg_bit = bit;
    st->neg_obj_off = obj_off;
    Py_RETURN_TRUE;
}

/* One element tensor viewed through DLPack -> a cell. 1 when it needs the resolver. */
static int from_view(sl_state *st, PyObject *name, PyObject *value, const DLTensor *t,
                     sl_metric *out)
{
    int64_t numel = 1;
    for (int i = 0; i < t->ndim; i++)
        numel *= t->shape[i];
    if (numel != 1) {
        char shape[128] = "";
        shape_string(shape, sizeof shape, t->shape, t->ndim);
        PyErr_Format(PyExc_ValueError, "metric %R must hold one element, got shape %s", name,
                     shape);
        return -1;
    }
    int kind = kind_of(t->dtype.code, t->dtype.bits, t->dtype.lanes);
    if (kind < 0)
        return dtype_error(name, &t->dtype);
    int device_type = t->device.device_type;
    if (device_type != kDLCPU && device_type != kDLCUDAHost && device_type != kDLCUDA) {
        PyErr_Format(PyExc_TypeError,
                     "metric %R lives on a device syncless cannot read (DLPack device type %d); "
                     "log CPU or CUDA tensors",
                     name, device_type);
        return -1;
    }
    const char *data = (const char *)t->data + t->byte_offset;
    int ok = readable(st, value, data, t->dtype.bits / 8);
    if (ok <= 0)
        return ok < 0 ? -1 : 1;
    if (device_type == kDLCUDA)
        set_device(out, data, kind, t->device.device_id);
    else
        set_host(out, host_value(data, kind));
    return 0;
}

static int read_exchange(sl_state *st, PyObject *name, PyObject *value, sl_metric *out)
{
    DLTensor t;
    if (st->xapi->dltensor_from_py_object_no_sync(value, &t) != 0) {
        /* torch refuses tensors it cannot view (meta, sparse, ...): the resolver names why. */
        PyErr_Clear();
        return 1;
    }
    return from_view(st, name, value, &t, out);
}

/* torch without the exchange table: attribute calls, still no sync. */
static int read_fallback(sl_state *st, PyObject *name, PyObject *value, sl_metric *out)
{
    PyObject *numel = NULL, *dtype = NULL, *code = NULL, *dev = NULL, *ptr = NULL;
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
    code = PyDict_GetItemWithError(st->dtype_codes, dtype); /* borrowed */
    if (code == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "metric %R has a dtype that is not a real number: %S",
                         name, dtype);
        goto error;
    }
    int kind = (int)PyLong_AsLong(code);
    if (!(dev = PyObject_CallMethodObjArgs(value, st->get_device_str, NULL)) ||
        !(ptr = PyObject_CallMethodObjArgs(value, st->data_ptr_str, NULL)))
        goto error;
    long device = PyLong_AsLong(dev);
    const char *data = PyLong_AsVoidPtr(ptr);
    if (PyErr_Occurred())
        goto error;
    int ok = readable(st, value, data, kind_size(kind));
    if (ok <= 0) {
        rc = ok < 0 ? -1 : 1;
        goto error;
    }
    if (device >= 0)
        set_device(out, data, kind, (int)device);
    else
        set_host(out, host_value(data, kind));
    rc = 0;
error:
    Py_XDECREF(numel);
    Py_XDECREF(dtype);
    Py_XDECREF(dev);
    Py_XDECREF(ptr);
    return rc;
}

/* A tensor of an exact tensor type: 0 read, 1 needs the resolver, -1 error. */
static int read_plain(sl_state *st, PyObject *name, PyObject *value, sl_metric *out)
{
    return st->xapi ? read_exchange(st, name, value, out) : read_fallback(st, name, value, out);
}

/* Anything else that is a tensor goes to syncless._metric.resolve(name, value), which returns
 * a plain tensor that is safe to read (new reference, kept in *keep until the launch is
 * enqueued) or raises an error naming the metric. */
static int read_resolved(sl_state *st, PyObject *name, PyObject *value, sl_metric *out,
                         PyObject **keep)
{
    if (st->resolver == NULL) {
        PyErr_Format(PyExc_TypeError, "metric %R: syncless cannot read this tensor", name);
        return -1;
    }
    PyObject *plain = PyObject_CallFunctionObjArgs(st->resolver, name, value, NULL);
    if (plain == NULL)
        return -1;
    int rc = -1;
    if (!Py_IS_TYPE(plain, (PyTypeObject *)st->tensor_type))
        PyErr_Format(PyExc_TypeError, "metric %R: the resolver returned %S, not a torch.Tensor",
                     name, (PyObject *)Py_TYPE(plain));
    else if ((rc = read_plain(st, name, plain, out)) == 1) {
        PyErr_Format(PyExc_TypeError, "metric %R: this tensor's data cannot be read safely", name);
        rc = -1;
    }
    if (rc == 0 && out->device >= 0)
        *keep = plain; /* the kernel reads it: it must outlive the launch's enqueue */
    else
        Py_DECREF(plain);
    return rc;
}

int sl_metric_read(sl_state *st, PyObject *name, PyObject *value, sl_metric *out, PyObject **keep)
{
    *keep = NULL;
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
    if (st->tensor_type && is_plain(st, value)) {
        int rc = read_plain(st, name, value, out);
        if (rc != 1)
            return rc;
        return read_resolved(st, name, value, out, keep);
    }
    if (st->tensor_type && PyObject_TypeCheck(value, (PyTypeObject *)st->tensor_type))
        return read_resolved(st, name, value, out, keep);
    if (st->real_types != NULL && PyDict_Contains(st->real_types, (PyObject *)Py_TYPE(value))) {
        /* a numpy real scalar type seen before (np.float32, np.int64, ...) */
        PyObject *f = PyNumber_Float(value);
        if (f == NULL)
            return -1;
        set_host(out, PyFloat_AsDouble(f));
        Py_DECREF(f);
        return 0;
    }
    if (st->number != NULL) {
        /* numpy scalars and other numbers: the Python side refuses complex and str. */
        PyObject *f = PyObject_CallFunctionObjArgs(st->number, name, value, NULL);
        if (f == NULL)
            return -1;
        set_host(out, PyFloat_AsDouble(f));
        Py_DECREF(f);
        return PyErr_Occurred() ? -1 : 0;
    }
    PyErr_Format(PyExc_TypeError, "metric %R must be a real number or a one-element tensor, got %S",
                 name, (PyObject *)Py_TYPE(value));
    return -1;
}

/* read_host_values(metrics) -> (device, {name: float} or None)
 * Reads every metric of a call once. When none lives on a GPU the floats come back (the host
 * path of a logger); otherwise the CUDA device of the first GPU metric and None. */
PyObject *sl_read_host_values(PyObject *module, PyObject *metrics)
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
