/* The three arrays of a batched copy, checked through the buffer protocol: shared by the C
 * modules of jaxbuf's drivers (_host_calls.c, _cuda_calls.c), each built on its own.
 *
 * get_batch_arrays(args, views) takes dsts, srcs and sizes: 1-D C-contiguous arrays of native
 * unsigned 8-byte integers (numpy uint64) of one length. A check in C costs a tenth of reading
 * numpy's __array_interface__ three times, on the path of every one-block transfer. 0 with the
 * three views held (the caller releases them with release_batch_arrays), or -1 with the
 * TypeError / ValueError naming the bad argument, as the drivers' Python check words it.
 */
#ifndef JAXBUF_BATCH_ARRAYS_H
#define JAXBUF_BATCH_ARRAYS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* One of copy_batch's arrays through the buffer protocol: a 1-D C-contiguous array of native
 * unsigned 8-byte integers (numpy uint64). 0, or -1 with the TypeError / ValueError that
 * names it (what the driver's Python check says for the same input). */
static int get_batch_array(const char *name, PyObject *object, Py_buffer *view) {
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

static void release_batch_arrays(Py_buffer *views, int held) {
    while (held-- > 0) PyBuffer_Release(&views[held]);
}

static int get_batch_arrays(PyObject *const *args, Py_buffer *views) {
    static const char *const names[3] = {"dsts", "srcs", "sizes"};
    for (int held = 0; held < 3; held++) {
        if (get_batch_array(names[held], args[held], &views[held]) < 0) {
            release_batch_arrays(views, held);
            return -1;
        }
    }
    Py_ssize_t count = views[0].shape[0];
    if (views[1].shape[0] != count || views[2].shape[0] != count) {
        PyErr_Format(PyExc_ValueError,
                     "dsts, srcs and sizes must have one length, got %zd, %zd and %zd", count,
                     views[1].shape[0], views[2].shape[0]);
        release_batch_arrays(views, 3);
        return -1;
    }
    return 0;
}

#endif
