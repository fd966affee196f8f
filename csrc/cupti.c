/* syncless._cupti: find the host-device syncs of one thread with CUPTI's callback API.
 *
 * A sync is a CUDA runtime or driver call that makes the CPU wait for the GPU. CUPTI calls us at
 * the entry and exit of every runtime and driver call; on the audited thread we time each
 * outermost call (the runtime calls the driver inside: only the outer call counts) and report the
 * ones that synchronised to a Python callable, which finds the user's line. Kernel launches are
 * counted on every thread (autograd runs backward kernels on its own device threads).
 *
 * Nothing is loaded at import: libcupti is opened by load(), which the Python side calls with the
 * candidate paths it found next to torch. The few CUPTI types used are declared here from the
 * CUPTI Callback API documentation (cupti_callbacks.h, cupti_result.h); no toolkit is needed. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- CUPTI Callback API (subset) ------------------------------------------------------------ */
typedef int CUptiResult;
typedef uint32_t CUpti_CallbackId;
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef void (*CUpti_CallbackFunc)(void *userdata, int domain, CUpti_CallbackId cbid,
                                   const void *cbdata);

enum { CUPTI_SUCCESS = 0, CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39 };
enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 };
enum { CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RUNTIME_API = 2 };

/* cbdata for the driver and runtime domains; field order as documented for CUpti_CallbackData. */
typedef struct {
    int callbackSite;
    const char *functionName; /* a global constant: safe to keep after the callback */
    const void *functionParams;
    void *functionReturnValue;
    const char *symbolName;
    void *context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} CUpti_CallbackData;

/* cuptiSubscribe_v2's parameters (CUDA 12.9+): it names the subscriber already holding CUPTI. */
typedef struct {
    size_t structSize;
    const char *subscriberName;
    char *oldSubscriberName;
    size_t oldSubscriberSize;
} CUpti_SubscriberParams;

/* What a reported call was; the Python side (syncless.doctor.audit) names and explains them. */
enum {
    SL_SYNC = 1,       /* an explicit synchronize: stream, device, context or event */
    SL_COPY = 2,       /* a synchronous memcpy (returns once the copy is done) */
    SL_ASYNC_COPY = 3, /* an "async" memcpy that blocked: pageable host memory */
    SL_FREE = 4,       /* cudaFree / cuMemFree: an implicit device-wide sync */
    SL_SLOW = 5,       /* any other call that blocked for long (allocation, module load, ...) */
};

typedef struct {
    void *lib;
    CUptiResult (*subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
    CUptiResult (*subscribe_v2)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *,
                                CUpti_SubscriberParams *);
    CUptiResult (*unsubscribe)(CUpti_SubscriberHandle);
    CUptiResult (*enable_domain)(uint32_t, CUpti_SubscriberHandle, int);
    CUptiResult (*result_string)(CUptiResult, const char **);
    CUpti_SubscriberHandle subscriber;
    PyObject *report; /* report(name, kind, start_ns, blocked_ns); strong reference */
    pthread_t thread; /* the audited thread */
    atomic_int active;
    atomic_int generation;    /* bumped by start(): resets the nesting of threads caught mid-call */
    int64_t copy_ns, slow_ns; /* thresholds for SL_ASYNC_COPY and SL_SLOW */
    atomic_ullong launches, graph_launches;
    unsigned long long reported, report_errors;
} cupti_state;

/* Per-thread nesting, so a runtime call's inner driver calls are neither timed nor counted.
 * Thread-local rather than module state because CUPTI calls us on whichever thread made the
 * CUDA call. */
static _Thread_local int tl_depth, tl_generation;
static _Thread_local int64_t tl_enter_ns;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock behind time.perf_counter_ns() on Linux */
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int starts_with(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

static int classify(const char *name, int64_t ns, const cupti_state *st)
{
    if (strstr(name, "Synchronize"))
        return SL_SYNC;
    int is_async = strstr(name, "Async") != NULL;
    if (starts_with(name, "cudaMemcpy") || starts_with(name, "cuMemcpy"))
        return !is_async ? SL_COPY : ns >= st->copy_ns ? SL_ASYNC_COPY : 0;
    if (!is_async && (starts_with(name, "cudaFree") || starts_with(name, "cuMemFree")))
        return SL_FREE;
    return ns >= st->slow_ns ? SL_SLOW : 0;
}

static void count_launch(cupti_state *st, const char *name)
{
    if (!strstr(name, "Launch") || strstr(name, "HostFunc"))
        return;
    if (strstr(name, "Graph"))
        atomic_fetch_add_explicit(&st->graph_launches, 1, memory_order_relaxed);
    else
        atomic_fetch_add_explicit(&st->launches, 1, memory_order_relaxed);
}

/* Hands one sync to Python. Taking the GIL here is what lets the report name the line: the
 * thread's Python stack is exactly the one that made the call. torch releases the GIL around
 * most ops, so PyGILState_Ensure usually has to wait for it; this can deadlock only if another
 * thread holds the GIL while waiting on a lock this thread holds across a CUDA call (torch's
 * allocator does that only in its out-of-memory retry path). That risk is confined to the
 * audit() block, which is a diagnostic, never the always-on monitor. */
static void deliver(cupti_state *st, const char *name, int kind, int64_t start, int64_t ns)
{
    PyGILState_STATE g = PyGILState_Ensure();
    if (atomic_load(&st->active) && st->report) {
        tl_depth++; /* CUDA calls made by the report itself are not the user's */
        PyObject *r =
            PyObject_CallFunction(st->report, "siLL", name, kind, (long long)start, (long long)ns);
        tl_depth--;
        if (r == NULL) {
            st->report_errors++;
            PyErr_WriteUnraisable(st->report);
        }
        Py_XDECREF(r);
        st->reported++;
    }
    PyGILState_Release(g);
}

static void on_api(void *userdata, int domain, CUpti_CallbackId cbid, const void *cbdata)
{
    (void)cbid;
    cupti_state *st = userdata;
    const CUpti_CallbackData *cb = cbdata;
    if ((domain != CUPTI_CB_DOMAIN_DRIVER_API && domain != CUPTI_CB_DOMAIN_RUNTIME_API) ||
        !atomic_load_explicit(&st->active, memory_order_relaxed))
        return;
    int generation = atomic_load_explicit(&st->generation, memory_order_relaxed);
    if (tl_generation != generation) {
        tl_generation = generation;
        tl_depth = 0;
    }
    if (cb->callbackSite == CUPTI_API_ENTER) {
        if (tl_depth++ == 0) {
            count_launch(st, cb->functionName);
            tl_enter_ns = now_ns();
        }
        return;
    }
    if (tl_depth == 0) /* the exit of a call entered before start() */
        return;
    if (--tl_depth != 0 || !pthread_equal(pthread_self(), st->thread))
        return;
    int64_t end = now_ns();
    int64_t ns = end - tl_enter_ns;
    int kind = classify(cb->functionName, ns, st);
    if (kind)
        deliver(st, cb->functionName, kind, tl_enter_ns, ns);
}

/* ---- module ---------------------------------------------------------------------------------- */

static cupti_state *get_state(PyObject *module)
{
    return (cupti_state *)PyModule_GetState(module);
}

static PyObject *cupti_error(cupti_state *st, CUptiResult rc, const char *what, const char *extra)
{
    const char *text = NULL;
    if (st->result_string == NULL || st->result_string(rc, &text) != CUPTI_SUCCESS || !text)
        text = "unknown CUPTI error";
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (CUPTI error %d)%s", what, text, rc,
                 extra ? extra : "");
    return NULL;
}

static void *symbol(void *lib, const char *name)
{
    return dlsym(lib, name);
}

/* load(candidates) -> the library used. A libcupti torch already loaded wins (two copies of
 * CUPTI in one process would fight over the driver's callback slot). */
static PyObject *cupti_load(PyObject *module, PyObject *candidates)
{
    cupti_state *st = get_state(module);
    if (st->lib)
        Py_RETURN_NONE;
    static const char *sonames[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so.11.8",
                                    "libcupti.so", NULL};
    const char *used = NULL;
    void *lib = NULL;
    for (int i = 0; sonames[i] && !lib; i++) {
        lib = dlopen(sonames[i], RTLD_NOW | RTLD_NOLOAD);
        used = sonames[i];
    }
    Py_ssize_t n = PySequence_Size(candidates);
    if (n < 0)
        return NULL;
    PyObject *used_obj = NULL;
    for (Py_ssize_t i = 0; !lib && i < n; i++) {
        PyObject *item = PySequence_GetItem(candidates, i); /* new reference */
        if (item == NULL)
            return NULL;
        const char *path = PyUnicode_AsUTF8AndSize(item, NULL);
        if (path == NULL) {
            Py_DECREF(item);
            return NULL;
        }
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (lib)
            used_obj = item;
        else
            Py_DECREF(item);
    }
    if (lib == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "libcupti not found (%s)", why ? why : "no candidates");
        return NULL;
    }
    st->subscribe = (CUptiResult (*)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *))symbol(
        lib, "cuptiSubscribe");
    st->subscribe_v2 = (CUptiResult (*)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *,
                                        CUpti_SubscriberParams *))symbol(lib, "cuptiSubscribe_v2");
    st->unsubscribe = (CUptiResult (*)(CUpti_SubscriberHandle))symbol(lib, "cuptiUnsubscribe");
    st->enable_domain =
        (CUptiResult (*)(uint32_t, CUpti_SubscriberHandle, int))symbol(lib, "cuptiEnableDomain");
    st->result_string =
        (CUptiResult (*)(CUptiResult, const char **))symbol(lib, "cuptiGetResultString");
    if (!st->subscribe || !st->unsubscribe || !st->enable_domain) {
        Py_XDECREF(used_obj);
        PyErr_SetString(PyExc_OSError, "libcupti lacks the callback API (cuptiSubscribe)");
        return NULL;
    }
    st->lib = lib; /* never closed: CUPTI does not support being unloaded */
    return used_obj ? used_obj : PyUnicode_FromString(used);
}

static int stop_subscription(cupti_state *st)
{
    if (st->subscriber == NULL)
        return 0;
    atomic_store(&st->active, 0);
    st->enable_domain(0, st->subscriber, CUPTI_CB_DOMAIN_RUNTIME_API);
    st->enable_domain(0, st->subscriber, CUPTI_CB_DOMAIN_DRIVER_API);
    CUptiResult rc = st->unsubscribe(st->subscriber);
    st->subscriber = NULL;
    return rc;
}

/* start(report, copy_threshold_us, slow_threshold_us): audit the calling thread. */
static PyObject *cupti_start(PyObject *module, PyObject *args)
{
    cupti_state *st = get_state(module);
    PyObject *report;
    double copy_us, slow_us;
    if (!PyArg_ParseTuple(args, "Odd", &report, &copy_us, &slow_us))
        return NULL;
    if (st->lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "call load() first");
        return NULL;
    }
    if (st->subscriber) {
        PyErr_SetString(PyExc_RuntimeError, "an audit is already running in this process");
        return NULL;
    }
    Py_XDECREF(st->report);
    st->report = Py_NewRef(report);
    st->generation++;
    st->thread = pthread_self();
    st->copy_ns = (int64_t)(copy_us * 1e3);
    st->slow_ns = (int64_t)(slow_us * 1e3);
    st->reported = st->report_errors = 0;
    CUptiResult rc;
    char holder[80] = "";
    if (st->subscribe_v2) {
        CUpti_SubscriberParams p = {offsetof(CUpti_SubscriberParams, oldSubscriberSize) +
                                        sizeof(size_t),
                                    "syncless", holder, sizeof(holder)};
        rc = st->subscribe_v2(&st->subscriber, on_api, st, &p);
    } else {
        rc = st->subscribe(&st->subscriber, on_api, st);
    }
    if (rc != CUPTI_SUCCESS) {
        st->subscriber = NULL;
        char extra[128] = "";
        if (holder[0])
            snprintf(extra, sizeof(extra), "; CUPTI is held by '%s'", holder);
        return cupti_error(st, rc, "cuptiSubscribe", extra);
    }
    atomic_store(&st->active, 1);
    rc = st->enable_domain(1, st->subscriber, CUPTI_CB_DOMAIN_RUNTIME_API);
    if (rc == CUPTI_SUCCESS)
        rc = st->enable_domain(1, st->subscriber, CUPTI_CB_DOMAIN_DRIVER_API);
    if (rc != CUPTI_SUCCESS) {
        stop_subscription(st);
        return cupti_error(st, rc, "cuptiEnableDomain", NULL);
    }
    Py_RETURN_NONE;
}

/* stop() -> (syncs reported, report errors). Idempotent. */
static PyObject *cupti_stop(PyObject *module, PyObject *unused)
{
    (void)unused;
    cupti_state *st = get_state(module);
    CUptiResult rc = stop_subscription(st);
    Py_CLEAR(st->report);
    if (rc != CUPTI_SUCCESS)
        return cupti_error(st, rc, "cuptiUnsubscribe", NULL);
    return Py_BuildValue("(KK)", st->reported, st->report_errors);
}

/* launches() -> (kernel launches, graph launches) seen so far on any thread, while active. */
static PyObject *cupti_launches(PyObject *module, PyObject *unused)
{
    (void)unused;
    cupti_state *st = get_state(module);
    return Py_BuildValue("(KK)", (unsigned long long)atomic_load(&st->launches),
                         (unsigned long long)atomic_load(&st->graph_launches));
}

static PyObject *cupti_active(PyObject *module, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(atomic_load(&get_state(module)->active));
}

static PyObject *cupti_loaded(PyObject *module, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(get_state(module)->lib != NULL);
}

static PyMethodDef cupti_methods[] = {
    {"load", cupti_load, METH_O, "load(paths) -> str: open libcupti (one torch loaded first)."},
    {"start", cupti_start, METH_VARARGS,
     "start(report, copy_threshold_us, slow_threshold_us): audit the calling thread."},
    {"stop", cupti_stop, METH_NOARGS, "stop() -> (reported, report_errors)."},
    {"launches", cupti_launches, METH_NOARGS, "launches() -> (kernels, graphs) launched so far."},
    {"active", cupti_active, METH_NOARGS, "True while an audit is subscribed."},
    {"loaded", cupti_loaded, METH_NOARGS, "True once libcupti is open."},
    {NULL, NULL, 0, NULL},
};

static int cupti_exec(PyObject *module)
{
    cupti_state *st = get_state(module);
    memset(st, 0, sizeof(*st));
    return PyModule_AddIntConstant(module, "SYNC", SL_SYNC) ||
           PyModule_AddIntConstant(module, "COPY", SL_COPY) ||
           PyModule_AddIntConstant(module, "ASYNC_COPY", SL_ASYNC_COPY) ||
           PyModule_AddIntConstant(module, "FREE", SL_FREE) ||
           PyModule_AddIntConstant(module, "SLOW", SL_SLOW);
}

static int cupti_traverse(PyObject *module, visitproc visit, void *arg)
{
    cupti_state *st = get_state(module);
    if (st)
        Py_VISIT(st->report);
    return 0;
}

static int cupti_clear(PyObject *module)
{
    cupti_state *st = get_state(module);
    if (st)
        Py_CLEAR(st->report);
    return 0;
}

/* CUPTI holds a pointer to this state as userdata: unsubscribe before it goes away. */
static void cupti_free(void *module)
{
    cupti_state *st = get_state(module);
    if (st == NULL)
        return;
    stop_subscription(st);
    Py_CLEAR(st->report);
}

static PyModuleDef_Slot cupti_slots[] = {
    {Py_mod_exec, cupti_exec},
    {0, NULL},
};

static struct PyModuleDef cupti_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "syncless._cupti",
    .m_doc = "Host-device sync finder on CUPTI's callback API (see syncless.doctor.audit).",
    .m_size = sizeof(cupti_state),
    .m_methods = cupti_methods,
    .m_slots = cupti_slots,
    .m_traverse = cupti_traverse,
    .m_clear = cupti_clear,
    .m_free = cupti_free,
};

PyMODINIT_FUNC PyInit__cupti(void)
{
    return PyModuleDef_Init(&cupti_module);
}
