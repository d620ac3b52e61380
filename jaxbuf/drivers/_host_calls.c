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

#include "_batch_arrays.h"

/* The arrays hold uint64 addresses and sizes, used as pointers and size_t: a 32-bit build
 * would truncate them. The extension is optional, so such a build skips it and the driver
 * falls back to ctypes. */
_Static_assert(sizeof(void *) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
               "jaxbuf.drivers._host_calls needs 64-bit pointers and sizes");

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
    Py_buffer views[3];
    if (get_batch_arrays(args, views) < 0) return NULL;
    Py_ssize_t count = views[0].shape[0];
    const uint64_t *dsts = views[0].buf, *srcs = views[1].buf, *sizes = views[2].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        if (sizes[i])
            memmove((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i],
                    (size_t)sizes[i]);
    }
    Py_END_ALLOW_THREADS
    release_batch_arrays(views, 3);
    Py_RETURN_NONE;
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
