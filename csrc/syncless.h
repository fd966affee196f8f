/* syncless private header: the CUDA driver and DLPack declarations we use, and the sl_ prototypes.
 *
 * Nothing here comes from the CUDA toolkit or torch headers: the types and prototypes are declared
 * from the CUDA Driver API and DLPack documentation so the extension builds with a C compiler and
 * the CPython headers alone. The driver is opened with dlopen() on first use, never at import. */
#ifndef SYNCLESS_H
#define SYNCLESS_H

#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "layout.h"

/* ---- CUDA driver API (subset) ------------------------------------------------------------ */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_NOT_READY = 600,
};
enum { CU_EVENT_BLOCKING_SYNC = 0x1, CU_EVENT_DISABLE_TIMING = 0x2 };
enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_STREAM_CAPTURE_STATUS_ACTIVE = 1 };
enum { CU_STREAM_CAPTURE_MODE_RELAXED = 2 };

/* Every entry point we call, resolved once through cuGetProcAddress at the version we were
 * written against, so a newer driver's changed ABI never reaches us by accident. */
typedef struct sl_driver {
    int version;
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, CUstream, void **, void **);
    CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
    CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
    CUresult (*cuStreamIsCapturing)(CUstream, int *);
} sl_driver;

/* ---- DLPack (v1.x ABI) and torch's C exchange table ---------------------------------------- */
enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6 };
/* DLPack >= 1.1 (torch reports 1.3): the 8-bit floats. */
enum {
    kDLFloat8_e4m3fn = 10,
    kDLFloat8_e4m3fnuz = 11,
    kDLFloat8_e5m2 = 12,
    kDLFloat8_e5m2fnuz = 13,
    kDLFloat8_e8m0fnu = 14,
};

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

/* torch >= 2.10 publishes this table as the capsule Tensor.__dlpack_c_exchange_api__ (named
 * "dlpack_exchange_api"). Only the two functions we call are typed; both return 0 on success. */
typedef struct {
    uint32_t major, minor;
    void *prev;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(PyObject *, DLTensor *);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **stream);
} sl_exchange_api;

/* ---- metric values ------------------------------------------------------------------------- */
typedef struct {
    int kind;
    const char *name; /* torch's dtype name */
    int code, bits;   /* DLPack */
} sl_kind_info;

extern const sl_kind_info sl_kinds[]; /* ends with a NULL name */

typedef struct {
    sl_cell cell;
    int device; /* CUDA ordinal, or -1 for a host value */
} sl_metric;

/* ---- module state -------------------------------------------------------------------------- */
#define SL_MAX_DEVICES 64

typedef struct {
    PyTypeObject *ring_type;
    PyTypeObject *window_type;
    PyTypeObject *event_pair_type;
    PyTypeObject *clock_type;
    PyObject *tensor_type;       /* torch.Tensor once registered, else NULL */
    const sl_exchange_api *xapi; /* borrowed from the capsule we keep in xapi_capsule */
    PyObject *xapi_capsule;
    PyObject *param_type;            /* torch.nn.Parameter: read like a Tensor (same storage) */
    PyObject *resolver;              /* syncless._metric.resolve(name, tensor) -> plain tensor */
    PyObject *number;                /* syncless._metric.number(name, value) -> float */
    PyObject *real_types;            /* {type: True}: scalar types number() found real */
    PyObject *is_neg_fn, *offset_fn; /* Tensor.is_neg, Tensor.storage_offset (unbound) */
    /* Where a tensor keeps its negative bit, learnt from probes (metric.c, learn_neg_bit):
     * the TensorImpl pointer at obj + neg_obj_off (0: not learnt, call is_neg()), behind an
     * ownership flag byte at obj + neg_flag_off when that is nonzero; the bit neg_bit of the
     * word at impl + neg_key_off (its dispatch key set). */
    Py_ssize_t neg_obj_off, neg_flag_off, neg_key_off;
    uint64_t neg_bit;
    PyObject *data_ptr_str, *dtype_str, *get_device_str, *numel_str, *is_neg_str;
    PyObject *storage_offset_str;
    PyObject *dtype_codes; /* {torch.dtype: kind} for the fallback path */
    PyObject *raw_stream;  /* torch._C._cuda_getCurrentRawStream, for the fallback path */
    /* The driver: loaded on first use. */
    int driver_state; /* 0 untried, 1 loaded, -1 failed */
    void *libcuda;
    sl_driver drv;
    CUcontext ctx[SL_MAX_DEVICES];
    CUmodule module[SL_MAX_DEVICES];
    CUfunction gather[SL_MAX_DEVICES][SL_GATHER_COUNT];
    /* Event pool (timer and windows); events are per device context. */
    /* The timer's fast path (timer.c): the Python record type, the Python device chooser for
     * when no context says it, and whether torch's CUDA is known to be initialised. */
    PyObject *timing_type, *auto_device, *after_str, *before_str;
    int cuda_seen;
    CUevent *pool[SL_MAX_DEVICES];
    int pool_len[SL_MAX_DEVICES], pool_cap[SL_MAX_DEVICES];
} sl_state;

static inline sl_state *sl_get_state(PyObject *module)
{
    return (sl_state *)PyModule_GetState(module);
}

/* The state of the module that defined `type` (Ring, Window, EventPair). */
static inline sl_state *sl_type_state(PyTypeObject *type)
{
    return (sl_state *)PyType_GetModuleState(type);
}

/* Our heap types carry the module; a Python subclass of one (Timer, Timing) does not, so look
 * at its bases. Only for constructors: instances keep the state pointer they were made with. */
static inline sl_state *sl_state_of(PyTypeObject *type)
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

/* cuda.c */
int sl_driver_load(sl_state *st);                          /* 0, or -1 with an exception set */
int sl_check(sl_state *st, CUresult rc, const char *what); /* 0, or -1 with CudaError set */
int sl_enter_device(sl_state *st, int device, CUcontext *prev);
void sl_leave_device(sl_state *st, CUcontext prev);
int sl_gather_functions(sl_state *st, int device, CUfunction out[SL_GATHER_COUNT]);
extern PyObject *sl_CudaError;

/* torch.c */
PyObject *sl_bind_torch(PyObject *module, PyObject *args);
int sl_current_stream(sl_state *st, int device, CUstream *out);

/* metric.c */
PyObject *sl_read_host_values(PyObject *module, PyObject *metrics);
PyObject *sl_learn_neg_bit(PyObject *module, PyObject *probes);
/* 0, or -1 with an exception set. *keep receives a new reference (or NULL) to a tensor the
 * cell points into, which must stay alive until the launch is enqueued. */
int sl_metric_read(sl_state *st, PyObject *name, PyObject *value, sl_metric *out, PyObject **keep);

/* ring.c */
int sl_ring_init_types(PyObject *module, sl_state *st);
/* Ring.gather's answer when a metric has no column in the ring yet (nothing launched); the
 * others are True (captured into a CUDA graph) and False (launched). */
#define SL_GATHER_NEW_COLUMN 2
PyObject *sl_ring_nbytes(PyObject *module, PyObject *args);
PyObject *sl_tally(PyObject *module, PyObject *args);

/* events.c: an event pair, also the record of one timed block (Python's Timing subclasses it;
 * timer.c makes them): host clock readings and the GPU reading once known (NaN until then). */
enum { SL_PAIR_FRESH = 0, SL_PAIR_STARTED = 1, SL_PAIR_STOPPED = 2 };
typedef struct sl_pair {
    PyObject_HEAD
    int device; /* CUDA ordinal, or -1 for a block timed on the host clock */
    CUevent start, stop;
    CUstream started_on;
    int state; /* SL_PAIR_FRESH, _STARTED, _STOPPED (exported to Python as _C.PAIR_*) */
    double t0; /* host seconds (CLOCK_MONOTONIC, perf_counter's clock) at the start */
    double cpu_ms, ms;
    PyObject *name; /* the timer's name, or None */
    sl_state *st;   /* kept: a Python subclass's type has no module state of its own */
} EventPair;

void sl_pair_init(sl_state *st, EventPair *self, int device);
int sl_pair_record(sl_state *st, EventPair *self, int which);
/* timer.c */
int sl_clock_init_types(PyObject *module, sl_state *st);
/* events.c */
int sl_event_take(sl_state *st, int device, CUevent *out);
void sl_event_give(sl_state *st, int device, CUevent ev);
int sl_event_pair_init_types(PyObject *module, sl_state *st);
PyObject *sl_event_floor(PyObject *module, PyObject *args);
void sl_events_clear(sl_state *st);

#endif
