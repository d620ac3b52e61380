/* The CUDA driver calls of a staged apply, made from C: jaxbuf.drivers._cuda_calls.
 *
 * cuda.bindings wraps every driver call in Python objects: converting a kernel launch's
 * eleven arguments, or building a CUevent's result tuple, costs 1-3 us a call on an H200
 * host, about as much as the driver itself. A staged apply makes five such calls (context
 * check, slot event query, copy, launch, event record), so the CUDA driver
 * (jaxbuf/drivers/cuda.py) makes those through an EntryPoints instead: a handful of driver
 * function pointers it got from cuGetProcAddress, called with plain integers. The context
 * check, copy and launch go together in one call (copy_and_launch).
 *
 * This module links no CUDA library and knows nothing of devices: every pointer comes from
 * the driver object, which alone decides when they are valid (the layering of DESIGN.md:
 * platform calls only through a driver). Each method returns the CUresult as an int and
 * leaves error reporting to the driver. The GIL is released around each call: a launch can
 * block while the device's queue is full, and JAX's threads (capsule deleters, host
 * callbacks) must be able to run meanwhile.
 *
 * A transfer's block copies go through copy_batch: the whole list of (dst, src, size) in one
 * call, through cuMemcpyBatchAsync when the driver has it (CUDA 12.8+; looked up apart from
 * SYMBOLS, with the ABI version it was asked for, see with_memcpy_batch), else a loop of
 * cuMemcpyAsync in C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_batch_arrays.h"

typedef int CUresult; /* an enum in cuda.h: int-sized on every ABI CUDA supports */
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;

/* The signatures of cuda.h (CUDA 12.0, the ABI version asked of cuGetProcAddress). */
typedef CUresult (*CtxGetCurrentFn)(CUcontext *);
typedef CUresult (*CtxSetCurrentFn)(CUcontext);
typedef CUresult (*LaunchKernelFn)(CUfunction, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, unsigned int,
                                   CUstream, void **, void **);
typedef CUresult (*EventRecordFn)(CUevent, CUstream);
typedef CUresult (*EventQueryFn)(CUevent);
typedef CUresult (*MemcpyAsyncFn)(CUdeviceptr, CUdeviceptr, size_t, CUstream);

/* cuMemcpyBatchAsync's attributes (cuda.h 12.8+, CUmemcpyAttributes_v1): one entry applies
 * to the whole batch. Enums are int-sized, as CUresult. */
typedef struct {
    int type; /* CUmemLocationType; 0, CU_MEM_LOCATION_TYPE_INVALID: no hint */
    int id;
} CUmemLocation;
typedef struct {
    int srcAccessOrder; /* CUmemcpySrcAccessOrder */
    CUmemLocation srcLocHint;
    CUmemLocation dstLocHint;
    unsigned int flags; /* CUmemcpyFlags */
} CUmemcpyAttributes;
enum { CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1 };
/* Its two ABIs, by the version asked of cuGetProcAddress: CUDA 12.8's reports the index of
 * the copy that failed (failIdx); CUDA 13.0's (cuMemcpyBatchAsync_v2) has no failIdx. */
enum { MEMCPY_BATCH_12080 = 12080, MEMCPY_BATCH_13000 = 13000 };
typedef CUresult (*MemcpyBatch12080Fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                       CUmemcpyAttributes *, size_t *, size_t, size_t *,
                                       CUstream);
typedef CUresult (*MemcpyBatch13000Fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                       CUmemcpyAttributes *, size_t *, size_t, CUstream);
/* copy_batch passes the caller's uint64 arrays as CUdeviceptr[] and size_t[] as they are. */
_Static_assert(sizeof(CUdeviceptr) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
               "copy_batch needs 64-bit CUdeviceptr and size_t");

/* The order of SYMBOLS, which the driver looks up in this order. */
enum { CTX_GET_CURRENT, CTX_SET_CURRENT, LAUNCH_KERNEL, EVENT_RECORD, EVENT_QUERY,
       MEMCPY_ASYNC, NUM_SYMBOLS };
static const char *const symbol_names[NUM_SYMBOLS] = {
    "cuCtxGetCurrent", "cuCtxSetCurrent", "cuLaunchKernel",
    "cuEventRecord",   "cuEventQuery",    "cuMemcpyAsync",
};

typedef struct {
    PyObject_HEAD
    void *entry[NUM_SYMBOLS];
    void *memcpy_batch;       /* cuMemcpyBatchAsync, or NULL: copy_batch loops cuMemcpyAsync */
    int memcpy_batch_version; /* the ABI of memcpy_batch (MEMCPY_BATCH_*), 0 without it */
} EntryPoints;

/* An address argument: an int, or anything with __int__ (cuda.bindings' CUevent, CUstream,
 * CUfunction, CUcontext). -1 with an exception set on failure. */
static int as_address(PyObject *object, uintptr_t *out) {
    if (PyLong_Check(object)) {
        *out = (uintptr_t)PyLong_AsUnsignedLongLong(object);
    } else {
        /* int(str) would parse text and int(float) truncate: neither is an address. */
        if (PyUnicode_Check(object) || PyBytes_Check(object) || PyByteArray_Check(object) ||
            PyFloat_Check(object) || Py_TYPE(object)->tp_as_number == NULL ||
            Py_TYPE(object)->tp_as_number->nb_int == NULL) {
            PyErr_Format(PyExc_TypeError, "expected an address (an int), got %R", object);
            return -1;
        }
        PyObject *number = PyNumber_Long(object);
        if (number == NULL) return -1;
        *out = (uintptr_t)PyLong_AsUnsignedLongLong(number);
        Py_DECREF(number);
    }
    return (*out == (uintptr_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* An unsigned int argument (grid and block sizes, shared bytes): OverflowError past 2**32. */
static int as_uint(PyObject *object, unsigned int *out) {
    unsigned long value = PyLong_AsUnsignedLong(object);
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (value > 0xFFFFFFFFUL) {
        PyErr_Format(PyExc_OverflowError, "%lu does not fit an unsigned int", value);
        return -1;
    }
    *out = (unsigned int)value;
    return 0;
}

static int check_count(const char *name, Py_ssize_t nargs, Py_ssize_t expected) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, nargs);
    return -1;
}

static PyObject *entry_points_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *addresses;
    static char *keywords[] = {"addresses", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:EntryPoints", keywords, &addresses))
        return NULL;
    PyObject *sequence = PySequence_Fast(addresses, "addresses must be a sequence of ints");
    if (sequence == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(sequence) != NUM_SYMBOLS) {
        PyErr_Format(PyExc_ValueError, "addresses must name the %d functions of SYMBOLS, got %zd",
                     NUM_SYMBOLS, PySequence_Fast_GET_SIZE(sequence));
        Py_DECREF(sequence);
        return NULL;
    }
    void *entry[NUM_SYMBOLS];
    for (int i = 0; i < NUM_SYMBOLS; i++) {
        uintptr_t address;
        if (as_address(PySequence_Fast_GET_ITEM(sequence, i), &address) < 0) {
            Py_DECREF(sequence);
            return NULL;
        }
        if (address == 0) { /* cuGetProcAddress gives NULL for what the driver lacks */
            PyErr_Format(PyExc_ValueError, "no address for %s", symbol_names[i]);
            Py_DECREF(sequence);
            return NULL;
        }
        entry[i] = (void *)address;
    }
    Py_DECREF(sequence);
    EntryPoints *self = (EntryPoints *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    memcpy(self->entry, entry, sizeof entry);
    return (PyObject *)self;
}

/* make_current(context) -> CUresult: cuCtxSetCurrent only when context is not current, so
 * the common case is one cuCtxGetCurrent. */
static PyObject *make_current(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t wanted;
    if (check_count("make_current", nargs, 1) < 0 || as_address(args[0], &wanted) < 0)
        return NULL;
    CUcontext context = NULL;
    CUresult result;
    Py_BEGIN_ALLOW_THREADS
    result = ((CtxGetCurrentFn)self->entry[CTX_GET_CURRENT])(&context);
    if (result == 0 && (uintptr_t)context != wanted)
        result = ((CtxSetCurrentFn)self->entry[CTX_SET_CURRENT])((CUcontext)wanted);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* launch(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, stream,
 * kernel_params) -> CUresult: cuLaunchKernel, kernel_params the address of the void*[] of
 * the kernel's arguments (no "extra"). */
static PyObject *launch(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t function, stream, params;
    unsigned int dims[7]; /* grid x, y, z; block x, y, z; shared bytes */
    if (check_count("launch", nargs, 10) < 0 || as_address(args[0], &function) < 0) return NULL;
    for (int i = 0; i < 7; i++)
        if (as_uint(args[1 + i], &dims[i]) < 0) return NULL;
    if (as_address(args[8], &stream) < 0 || as_address(args[9], &params) < 0) return NULL;
    CUresult result;
    Py_BEGIN_ALLOW_THREADS
    result = ((LaunchKernelFn)self->entry[LAUNCH_KERNEL])(
        (CUfunction)function, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
        (CUstream)stream, (void **)params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* record(event, stream) -> CUresult */
static PyObject *record(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t event, stream;
    if (check_count("record", nargs, 2) < 0 || as_address(args[0], &event) < 0 ||
        as_address(args[1], &stream) < 0)
        return NULL;
    CUresult result;
    Py_BEGIN_ALLOW_THREADS
    result = ((EventRecordFn)self->entry[EVENT_RECORD])((CUevent)event, (CUstream)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* query(event) -> CUresult (0 done, CUDA_ERROR_NOT_READY pending) */
static PyObject *query(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t event;
    if (check_count("query", nargs, 1) < 0 || as_address(args[0], &event) < 0) return NULL;
    CUresult result;
    Py_BEGIN_ALLOW_THREADS
    result = ((EventQueryFn)self->entry[EVENT_QUERY])((CUevent)event);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* copy(dst, src, size, stream) -> CUresult: cuMemcpyAsync (unified addressing) */
static PyObject *copy(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t dst, src, stream;
    if (check_count("copy", nargs, 4) < 0 || as_address(args[0], &dst) < 0 ||
        as_address(args[1], &src) < 0 || as_address(args[3], &stream) < 0)
        return NULL;
    size_t size = PyLong_AsSize_t(args[2]);
    if (size == (size_t)-1 && PyErr_Occurred()) return NULL;
    CUresult result;
    Py_BEGIN_ALLOW_THREADS
    result = ((MemcpyAsyncFn)self->entry[MEMCPY_ASYNC])((CUdeviceptr)dst, (CUdeviceptr)src, size,
                                                        (CUstream)stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* The steps of copy_and_launch, in order (and record_in's last); a failure reports the name
 * of its step's call. */
enum { STEP_CONTEXT, STEP_COPY, STEP_LAUNCH, NUM_STEPS, STEP_RECORD = NUM_STEPS };
static const char *const step_names[NUM_STEPS + 1] = {"cuCtxSetCurrent", "cuMemcpyAsync",
                                                      "cuLaunchKernel", "cuEventRecord"};

/* Make `context` current when another one is: the first step of the calls below. */
static CUresult make_current_unlocked(EntryPoints *self, uintptr_t context) {
    CUcontext current = NULL;
    CUresult result = ((CtxGetCurrentFn)self->entry[CTX_GET_CURRENT])(&current);
    if (result == 0 && (uintptr_t)current != context)
        result = ((CtxSetCurrentFn)self->entry[CTX_SET_CURRENT])((CUcontext)context);
    return result;
}

/* 0, or (the name of the call that failed, its CUresult). */
static PyObject *step_result(CUresult result, int step) {
    if (result == 0) return PyLong_FromLong(0);
    return Py_BuildValue("(si)", step_names[step], (int)result);
}

/* copy_and_launch(context, dst, src, size, function, grid_x, block_x, shared_bytes, stream,
 * kernel_params) -> 0, or (call, CUresult) for the first step that failed (call: its name in
 * COPY_AND_LAUNCH_STEPS; the later steps are not made).
 *
 * A staged apply's whole submission in one call, with the GIL released once: make `context`
 * current (only when it is not), copy `size` bytes from `src` to `dst` on `stream` (none when
 * size is 0), then launch `function` on a one-dimensional grid of `grid_x` programs of
 * `block_x` threads (none when grid_x is 0). Each step is the call the methods above make;
 * made separately from Python they cost 1-2 us of glue each on an H200 host. */
static PyObject *copy_and_launch(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t context, dst, src, function, stream, params;
    unsigned int grid_x, block_x, shared;
    if (check_count("copy_and_launch", nargs, 10) < 0 || as_address(args[0], &context) < 0 ||
        as_address(args[1], &dst) < 0 || as_address(args[2], &src) < 0)
        return NULL;
    size_t size = PyLong_AsSize_t(args[3]);
    if (size == (size_t)-1 && PyErr_Occurred()) return NULL;
    if (as_address(args[4], &function) < 0 || as_uint(args[5], &grid_x) < 0 ||
        as_uint(args[6], &block_x) < 0 || as_uint(args[7], &shared) < 0 ||
        as_address(args[8], &stream) < 0 || as_address(args[9], &params) < 0)
        return NULL;
    CUresult result;
    int step = STEP_CONTEXT;
    Py_BEGIN_ALLOW_THREADS
    result = make_current_unlocked(self, context);
    if (result == 0 && size) {
        step = STEP_COPY;
        result = ((MemcpyAsyncFn)self->entry[MEMCPY_ASYNC])((CUdeviceptr)dst, (CUdeviceptr)src,
                                                            size, (CUstream)stream);
    }
    if (result == 0 && grid_x) {
        step = STEP_LAUNCH;
        result = ((LaunchKernelFn)self->entry[LAUNCH_KERNEL])(
            (CUfunction)function, grid_x, 1, 1, block_x, 1, 1, shared, (CUstream)stream,
            (void **)params, NULL);
    }
    Py_END_ALLOW_THREADS
    return step_result(result, step);
}

/* record_in(context, event, stream) -> 0, or (call, CUresult): cuEventRecord with `context`
 * made current first (only when it is not), as the legacy and per-thread stream handles
 * name the current context's stream. */
static PyObject *record_in(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t context, event, stream;
    if (check_count("record_in", nargs, 3) < 0 || as_address(args[0], &context) < 0 ||
        as_address(args[1], &event) < 0 || as_address(args[2], &stream) < 0)
        return NULL;
    CUresult result;
    int step = STEP_CONTEXT;
    Py_BEGIN_ALLOW_THREADS
    result = make_current_unlocked(self, context);
    if (result == 0) {
        step = STEP_RECORD;
        result = ((EventRecordFn)self->entry[EVENT_RECORD])((CUevent)event, (CUstream)stream);
    }
    Py_END_ALLOW_THREADS
    return step_result(result, step);
}

/* with_memcpy_batch(address, version) -> EntryPoints: a copy of these entry points whose
 * copy_batch calls cuMemcpyBatchAsync at `address`, the pointer cuGetProcAddress gave for
 * MEMCPY_BATCH_SYMBOL when asked for ABI `version` (one of MEMCPY_BATCH_VERSIONS). */
static PyObject *with_memcpy_batch(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t address;
    if (check_count("with_memcpy_batch", nargs, 2) < 0 || as_address(args[0], &address) < 0)
        return NULL;
    long version = PyLong_AsLong(args[1]);
    if (version == -1 && PyErr_Occurred()) return NULL;
    if (version != MEMCPY_BATCH_12080 && version != MEMCPY_BATCH_13000) {
        PyErr_Format(PyExc_ValueError, "no cuMemcpyBatchAsync ABI for version %ld (known: %d, %d)",
                     version, MEMCPY_BATCH_13000, MEMCPY_BATCH_12080);
        return NULL;
    }
    if (address == 0) {
        PyErr_SetString(PyExc_ValueError, "no address for cuMemcpyBatchAsync");
        return NULL;
    }
    PyTypeObject *type = Py_TYPE(self);
    EntryPoints *copy = (EntryPoints *)type->tp_alloc(type, 0);
    if (copy == NULL) return NULL;
    memcpy(copy->entry, self->entry, sizeof self->entry);
    copy->memcpy_batch = (void *)address;
    copy->memcpy_batch_version = (int)version;
    return (PyObject *)copy;
}

/* One cuMemcpyBatchAsync over `count` copies, none of size 0; *fail_index set to the failed
 * copy when the ABI reports it. Without the GIL. */
static CUresult memcpy_batch_unlocked(EntryPoints *self, const uint64_t *dsts,
                                      const uint64_t *srcs, const uint64_t *sizes, size_t count,
                                      CUstream stream, size_t *fail_index) {
    /* The sources are read in stream order (after the work enqueued before), as by
     * cuMemcpyAsync; no location hints (they are for managed memory), no flags. */
    CUmemcpyAttributes attributes;
    memset(&attributes, 0, sizeof attributes);
    attributes.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t first_copy = 0; /* attributes applies to copies [0, count) */
    CUdeviceptr *dst_ptrs = (CUdeviceptr *)dsts, *src_ptrs = (CUdeviceptr *)srcs;
    size_t *copy_sizes = (size_t *)sizes;
    if (self->memcpy_batch_version == MEMCPY_BATCH_13000)
        return ((MemcpyBatch13000Fn)self->memcpy_batch)(dst_ptrs, src_ptrs, copy_sizes, count,
                                                         &attributes, &first_copy, 1, stream);
    size_t failed = SIZE_MAX;
    CUresult result = ((MemcpyBatch12080Fn)self->memcpy_batch)(
        dst_ptrs, src_ptrs, copy_sizes, count, &attributes, &first_copy, 1, &failed, stream);
    if (result != 0 && failed < count) *fail_index = failed;
    return result;
}

/* copy_batch(context, dsts, srcs, sizes, stream) -> 0, or (call, CUresult, index) for the
 * call that failed (index: the copy it failed on, -1 when unknown); later copies are not
 * enqueued, earlier ones may have been.
 *
 * A transfer's block copies in one call, with the GIL released once: make `context` current
 * (only when it is not), then enqueue on `stream` the copy of sizes[i] bytes from srcs[i] to
 * dsts[i] for each i, where dsts, srcs and sizes are 1-D uint64 arrays of one length,
 * checked here (_batch_arrays.h). With cuMemcpyBatchAsync, one batch per
 * run of non-empty copies (one, unless the list holds copies of size 0, which are skipped:
 * the batch API does not say it takes them); else one cuMemcpyAsync per non-empty copy.
 * cuMemcpyBatchAsync refuses the legacy default stream: the driver passes another. */
static PyObject *copy_batch(EntryPoints *self, PyObject *const *args, Py_ssize_t nargs) {
    uintptr_t context, stream;
    if (check_count("copy_batch", nargs, 5) < 0 || as_address(args[0], &context) < 0 ||
        as_address(args[4], &stream) < 0)
        return NULL;
    Py_buffer views[3];
    if (get_batch_arrays(args + 1, views) < 0) return NULL;
    size_t count = (size_t)views[0].shape[0];
    const uint64_t *dsts = views[0].buf, *srcs = views[1].buf, *sizes = views[2].buf;
    const char *call = "cuCtxSetCurrent";
    size_t fail_index = SIZE_MAX;
    CUresult result;
    Py_BEGIN_ALLOW_THREADS
    result = make_current_unlocked(self, context);
    /* One copy: cuMemcpyAsync, which the batch call costs more than (its setup per call). */
    if (result == 0 && self->memcpy_batch != NULL && count > 1) {
        call = "cuMemcpyBatchAsync";
        size_t start = 0;
        while (result == 0 && start < count) {
            while (start < count && sizes[start] == 0) start++;
            size_t end = start;
            while (end < count && sizes[end] != 0) end++;
            if (end > start) {
                size_t failed = SIZE_MAX;
                result = memcpy_batch_unlocked(self, dsts + start, srcs + start, sizes + start,
                                               end - start, (CUstream)stream, &failed);
                if (result != 0 && failed != SIZE_MAX) fail_index = start + failed;
            }
            start = end;
        }
    } else if (result == 0) {
        call = "cuMemcpyAsync";
        for (size_t i = 0; result == 0 && i < count; i++) {
            if (sizes[i] == 0) continue;
            result = ((MemcpyAsyncFn)self->entry[MEMCPY_ASYNC])(
                (CUdeviceptr)dsts[i], (CUdeviceptr)srcs[i], (size_t)sizes[i], (CUstream)stream);
            if (result != 0) fail_index = i;
        }
    }
    Py_END_ALLOW_THREADS
    release_batch_arrays(views, 3);
    if (result == 0) return PyLong_FromLong(0);
    return Py_BuildValue("(sin)", call, (int)result,
                         fail_index == SIZE_MAX ? (Py_ssize_t)-1 : (Py_ssize_t)fail_index);
}

/* EntryPoints.memcpy_batch_version: the cuMemcpyBatchAsync ABI copy_batch calls, 0 when it
 * loops cuMemcpyAsync. */
static PyObject *get_memcpy_batch_version(EntryPoints *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->memcpy_batch_version);
}

static PyGetSetDef entry_points_getset[] = {
    {"memcpy_batch_version", (getter)get_memcpy_batch_version, NULL,
     "the cuMemcpyBatchAsync ABI (12080 or 13000) copy_batch calls; 0: a cuMemcpyAsync loop",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef entry_points_methods[] = {
    {"make_current", (PyCFunction)(void (*)(void))make_current, METH_FASTCALL,
     "make_current(context) -> CUresult; sets it only when another one is current"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(function, gx, gy, gz, bx, by, bz, shared_bytes, stream, kernel_params) -> CUresult"},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL,
     "record(event, stream) -> CUresult"},
    {"query", (PyCFunction)(void (*)(void))query, METH_FASTCALL, "query(event) -> CUresult"},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src, size, stream) -> CUresult"},
    {"copy_and_launch", (PyCFunction)(void (*)(void))copy_and_launch, METH_FASTCALL,
     "copy_and_launch(context, dst, src, size, function, grid_x, block_x, shared_bytes, "
     "stream, kernel_params) -> 0 or (call, CUresult)"},
    {"record_in", (PyCFunction)(void (*)(void))record_in, METH_FASTCALL,
     "record_in(context, event, stream) -> 0 or (call, CUresult)"},
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_FASTCALL,
     "copy_batch(context, dsts_address, srcs_address, sizes_address, count, stream) -> 0 or "
     "(call, CUresult, index)"},
    {"with_memcpy_batch", (PyCFunction)(void (*)(void))with_memcpy_batch, METH_FASTCALL,
     "with_memcpy_batch(address, version) -> EntryPoints whose copy_batch calls "
     "cuMemcpyBatchAsync at address, in the ABI of version"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EntryPointsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jaxbuf.drivers._cuda_calls.EntryPoints",
    .tp_basicsize = sizeof(EntryPoints),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "EntryPoints(addresses): driver functions, in the order of SYMBOLS, called with "
              "ints; each method returns the CUresult as an int.",
    .tp_new = entry_points_new,
    .tp_methods = entry_points_methods,
    .tp_getset = entry_points_getset,
};

static struct PyModuleDef cuda_calls_module = {
    PyModuleDef_HEAD_INIT, "_cuda_calls",
    "The CUDA driver calls of a staged apply, made from C through driver-supplied pointers.",
    -1, NULL,
};

/* module.<attribute> = a tuple of the `count` strings of `names`; -1 with an exception set. */
static int add_names(PyObject *module, const char *attribute, const char *const *names,
                     int count) {
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL) return -1;
    for (int i = 0; i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == NULL) {
            Py_DECREF(tuple);
            return -1;
        }
        PyTuple_SET_ITEM(tuple, i, name);
    }
    if (PyModule_AddObject(module, attribute, tuple) < 0) {
        Py_DECREF(tuple);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__cuda_calls(void) {
    if (PyType_Ready(&EntryPointsType) < 0) return NULL;
    PyObject *module = PyModule_Create(&cuda_calls_module);
    if (module == NULL) return NULL;
    if (add_names(module, "SYMBOLS", symbol_names, NUM_SYMBOLS) < 0 ||
        add_names(module, "COPY_AND_LAUNCH_STEPS", step_names, NUM_STEPS) < 0)
        goto fail;
    Py_INCREF(&EntryPointsType);
    if (PyModule_AddObject(module, "EntryPoints", (PyObject *)&EntryPointsType) < 0) {
        Py_DECREF(&EntryPointsType);
        goto fail;
    }
    /* The ABI version asked of cuGetProcAddress for SYMBOLS (the signatures above). */
    if (PyModule_AddIntConstant(module, "CUDA_VERSION", 12000) < 0) goto fail;
    /* The optional batch copy: its name, and the ABI versions with_memcpy_batch takes, newest
     * first (the driver asks for the newest its driver version has). */
    if (PyModule_AddStringConstant(module, "MEMCPY_BATCH_SYMBOL", "cuMemcpyBatchAsync") < 0)
        goto fail;
    PyObject *versions = Py_BuildValue("(ii)", MEMCPY_BATCH_13000, MEMCPY_BATCH_12080);
    if (versions == NULL) goto fail;
    if (PyModule_AddObject(module, "MEMCPY_BATCH_VERSIONS", versions) < 0) {
        Py_DECREF(versions);
        goto fail;
    }
    return module;
fail:
    Py_DECREF(module);
    return NULL;
}
