/* The CPU driver's batched copy, made from C: jaxbuf.drivers._host_calls.
 *
 * A block transfer copies hundreds of blocks between two mappings of one process. A ctypes
 * memmove per block costs about a microsecond of Python each and holds the GIL throughout;
 * copy_batch walks the whole list in C with the GIL released, so other threads (JAX's, a
 * transfer's peer) run while the bytes move.
 *
 * This module links nothing and knows nothing of devices: it checks the three uint64 arrays
 * (their shape and type, through the buffer protocol) and trusts the addresses in them as
 * the driver does (the layering of DESIGN.md: platform calls only through a driver).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The arrays hold uint64 addresses and sizes, used as pointers and size_t: a 32-bit build
 * would truncate them. The extension is optional, so such a build skips it and the driver
 * falls back to ctypes. */
_Static_assert(sizeof(void *) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
               "jaxbuf.drivers._host_calls needs 64-bit pointers and sizes");

/* One of copy_batch's arrays through the buffer protocol: a 1-D C-contiguous array of native
 * unsigned 8-byte integers (numpy uint64). 0, or -1 with the TypeError / ValueError that
 * names it (what the driver's Python check says for the same input). */
static int get_array(const char *name, PyObject *object, Py_buffer *view) {
    if (PyObject_GetBuffer(object, view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D numpy array of uint64, got %s", name,
                     Py_TYPE(object)->tp_name);
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    if (format[0] == '@' || format[0] == '=') format++;
    if (view->itemsize != 8 || (strcmp(format, "Q") && strcmp(format, "L"))) {
        /* Name the dtype as numpy does (int64, >u8), else the buffer format. */
        PyObject *dtype = PyObject_GetAttrString(object, "dtype");
        if (dtype == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s must have dtype uint64 (native byte order), got buffer format '%s'",
                         name, view->format ? view->format : "B");
        } else {
            PyErr_Format(PyExc_TypeError,
                         "%s must have dtype uint64 (native byte order), got %S", name, dtype);
            Py_DECREF(dtype);
        }
    } else if (view->ndim != 1) {
        PyObject *shape = PyObject_GetAttrString(object, "shape");
        if (shape == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be 1-D, got %d dimensions", name,
                         view->ndim);
        } else {
            PyErr_Format(PyExc_ValueError, "%s must be 1-D, got shape %S", name, shape);
            Py_DECREF(shape);
        }
    } else if (view->shape[0] > 1 && view->strides[0] != 8) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous, got strides (%zd,)", name,
                     view->strides[0]);
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

/* copy_batch(dsts, srcs, sizes) -> None
 *
 * memmove(dsts[i], srcs[i], sizes[i]) for every i, in order, with the GIL released: three
 * 1-D C-contiguous uint64 arrays of one length, checked here (a check in C costs a tenth of
 * reading numpy's __array_interface__ three times, on a path a 1-block transfer takes).
 * memmove rather than memcpy: a copy whose own source and destination overlap gives what
 * the ctypes fallback (ctypes.memmove) gives. */
static PyObject *copy_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy_batch takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    static const char *const names[3] = {"dsts", "srcs", "sizes"};
    Py_buffer views[3];
    int held = 0;
    for (; held < 3; held++)
        if (get_array(names[held], args[held], &views[held]) < 0) break;
    PyObject *result = NULL;
    if (held == 3) {
        Py_ssize_t count = views[0].shape[0];
        if (views[1].shape[0] != count || views[2].shape[0] != count) {
            PyErr_Format(PyExc_ValueError,
                         "dsts, srcs and sizes must have one length, got %zd, %zd and %zd",
                         count, views[1].shape[0], views[2].shape[0]);
        } else {
            const uint64_t *dsts = views[0].buf, *srcs = views[1].buf, *sizes = views[2].buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < count; i++) {
                if (sizes[i])
                    memmove((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i],
                            (size_t)sizes[i]);
            }
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    while (held-- > 0) PyBuffer_Release(&views[held]);
    return result;
}

static PyMethodDef host_calls_methods[] = {
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_FASTCALL,
     "copy_batch(dsts, srcs, sizes) -> None: memmove of each (dst, src, size) of three 1-D "
     "uint64 arrays, in order, with the GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef host_calls_module = {
    PyModuleDef_HEAD_INIT, "_host_calls",
    "The CPU driver's batched copy, made from C with the GIL released.", -1, host_calls_methods,
};

PyMODINIT_FUNC PyInit__host_calls(void) { return PyModule_Create(&host_calls_module); }
