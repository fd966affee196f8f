/* Loading the CUDA driver at run time, mapping its errors to Python, and per-device context and
 * kernel setup. Nothing here runs at import: the first CUDA tensor a logger or timer sees does it.
 */
#include "kernels/gather_ptx.h"
#include "syncless.h"

#include <dlfcn.h>
#include <string.h>

PyObject *sl_CudaError;

/* The driver version our prototypes were written against; cuGetProcAddress hands back the entry
 * point of that ABI generation (e.g. cuMemcpyDtoHAsync_v2) whatever the installed driver is. */
#define SL_CUDA_API_VERSION 11040
/* CU_GET_PROC_ADDRESS_LEGACY_STREAM: torch launches on the legacy default stream semantics. */
#define SL_LEGACY_STREAM 1

typedef CUresult (*get_proc_v2)(const char *, void **, int, uint64_t, int *);
typedef CUresult (*get_proc_v1)(const char *, void **, int, uint64_t);

static int driver_fail(sl_state *st, const char *msg)
{
    st->driver_state = -1;
    PyErr_Format(PyExc_RuntimeError, "syncless: CUDA driver unavailable: %s", msg);
    return -1;
}

int sl_driver_load(sl_state *st)
{
    if (st->driver_state == 1)
        return 0;
    if (st->driver_state == -1)
        return driver_fail(st, "an earlier attempt to load libcuda.so.1 failed");

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return driver_fail(st, dlerror());
    CUresult (*init)(unsigned) = (CUresult (*)(unsigned))dlsym(lib, "cuInit");
    CUresult (*version)(int *) = (CUresult (*)(int *))dlsym(lib, "cuDriverGetVersion");
    get_proc_v2 proc2 = (get_proc_v2)dlsym(lib, "cuGetProcAddress_v2");
    get_proc_v1 proc1 = (get_proc_v1)dlsym(lib, "cuGetProcAddress");
    if (init == NULL || version == NULL || (proc1 == NULL && proc2 == NULL)) {
        dlclose(lib);
        return driver_fail(st,
                           "libcuda.so.1 lacks cuInit/cuGetProcAddress (driver older than 11.3)");
    }
    if (init(0) != CUDA_SUCCESS || version(&st->drv.version) != CUDA_SUCCESS) {
        dlclose(lib);
        return driver_fail(st, "cuInit failed (no usable GPU)");
    }

    struct {
        const char *name;
        void **slot;
    } table[] = {
#define SL_ENTRY(fn) {#fn, (void **)&st->drv.fn}
        SL_ENTRY(cuGetErrorName),
        SL_ENTRY(cuGetErrorString),
        SL_ENTRY(cuDeviceGetCount),
        SL_ENTRY(cuDeviceGet),
        SL_ENTRY(cuDevicePrimaryCtxRetain),
        SL_ENTRY(cuCtxGetCurrent),
        SL_ENTRY(cuCtxSetCurrent),
        SL_ENTRY(cuModuleLoadData),
        SL_ENTRY(cuModuleGetFunction),
        SL_ENTRY(cuLaunchKernel),
        SL_ENTRY(cuMemcpyDtoHAsync),
        SL_ENTRY(cuMemsetD8Async),
        SL_ENTRY(cuMemsetD32Async),
        SL_ENTRY(cuEventCreate),
        SL_ENTRY(cuEventDestroy),
        SL_ENTRY(cuEventRecord),
        SL_ENTRY(cuEventQuery),
        SL_ENTRY(cuEventSynchronize),
        SL_ENTRY(cuEventElapsedTime),
        SL_ENTRY(cuStreamWaitEvent),
        SL_ENTRY(cuStreamIsCapturing),
#undef SL_ENTRY
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        CUresult rc =
            proc2 ? proc2(table[i].name, table[i].slot, SL_CUDA_API_VERSION, SL_LEGACY_STREAM, NULL)
                  : proc1(table[i].name, table[i].slot, SL_CUDA_API_VERSION, SL_LEGACY_STREAM);
        if (rc != CUDA_SUCCESS || *table[i].slot == NULL) {
            dlclose(lib);
            PyErr_Format(PyExc_RuntimeError,
                         "syncless: CUDA driver unavailable: no entry point %s (error %d)",
                         table[i].name, rc);
            st->driver_state = -1;
            return -1;
        }
    }
    st->libcuda = lib;
    st->driver_state = 1;
    return 0;
}

int sl_check(sl_state *st, CUresult rc, const char *what)
{
    if (rc == CUDA_SUCCESS)
        return 0;
    const char *name = "CUDA_ERROR_UNKNOWN", *text = "unknown error";
    if (st->drv.cuGetErrorName)
        st->drv.cuGetErrorName(rc, &name);
    if (st->drv.cuGetErrorString)
        st->drv.cuGetErrorString(rc, &text);
    PyErr_Format(sl_CudaError, "%s failed: %s (%d): %s", what, name, rc, text);
    return -1;
}

/* Make the device's primary context (torch's) current for a driver call. `prev` receives the
 * context to restore, or NULL when nothing changed (the common case: torch already made it
 * current), so sl_leave_device costs no driver call then. */
int sl_enter_device(sl_state *st, int device, CUcontext *prev)
{
    *prev = NULL;
    if (device < 0 || device >= SL_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "syncless: CUDA device %d out of range", device);
        return -1;
    }
    if (st->ctx[device] == NULL) {
        CUdevice dev;
        if (sl_check(st, st->drv.cuDeviceGet(&dev, device), "cuDeviceGet") ||
            sl_check(st, st->drv.cuDevicePrimaryCtxRetain(&st->ctx[device], dev),
                     "cuDevicePrimaryCtxRetain"))
            return -1;
    }
    CUcontext now;
    if (sl_check(st, st->drv.cuCtxGetCurrent(&now), "cuCtxGetCurrent"))
        return -1;
    if (now != st->ctx[device]) {
        if (sl_check(st, st->drv.cuCtxSetCurrent(st->ctx[device]), "cuCtxSetCurrent"))
            return -1;
        *prev = now;
    }
    return 0;
}

void sl_leave_device(sl_state *st, CUcontext prev)
{
    if (prev != NULL)
        st->drv.cuCtxSetCurrent(prev);
}

/* The gather kernels for a device: the driver JIT-compiles the PTX once per process and device
 * (a few ms). Callers hold the device's context current. */
#define SL_NAME(name, cells) #name,

int sl_gather_functions(sl_state *st, int device, CUfunction out[SL_GATHER_COUNT])
{
    static const char *names[] = {SL_GATHER_KERNELS(SL_NAME)};
    _Static_assert(sizeof names / sizeof *names == SL_GATHER_COUNT, "layout.h's kernel count");
    if (st->module[device] == NULL) {
        if (sl_check(st, st->drv.cuModuleLoadData(&st->module[device], sl_gather_ptx),
                     "cuModuleLoadData (JIT of the gather kernel)"))
            return -1;
        for (int i = 0; i < SL_GATHER_COUNT; i++)
            if (sl_check(st,
                         st->drv.cuModuleGetFunction(&st->gather[device][i], st->module[device],
                                                     names[i]),
                         "cuModuleGetFunction"))
                return -1;
    }
    memcpy(out, st->gather[device], sizeof st->gather[device]);
    return 0;
}
