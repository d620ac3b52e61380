/* The hot paths of StagedWriteTensor.stage_write and FusedStagedWriter.apply, in C.
 *
 * A Stager holds a tensor's two staging buffers (bytearrays: packed write records and the
 * values' raw bytes) and its bounds. Stager.stage(row, start, values) stages the write and
 * returns True when everything is plain: row and start exact ints, values a C-contiguous 1-D
 * buffer whose format is the target's, the write in bounds. Otherwise it stages nothing and
 * returns False, and the Python path (jaxbuf/staged.py) converts, validates and raises the
 * precise error. So this file decides nothing the Python path does not also decide; it only
 * saves the interpreter's time on the common case (a numpy array of the right dtype), which
 * vLLM-style loops call hundreds of times per step.
 *
 * pack(stagers, group_table, address, capacity) lays an apply out in a pinned staging slot:
 * the group table, the write table (each tensor's records with its group id and the byte
 * offset of its values filled in) and every tensor's values, each tensor's at an offset aligned
 * to its element size. It also says whether some row is written twice (the caller then runs the
 * exact overlap test). It replaces some twenty numpy calls per apply; staged.py keeps a numpy
 * implementation of the same layout for builds without this extension.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_FIELDS 5 /* group, row, start, content_offset, length: the kernel's write table */

typedef struct {
    PyObject_HEAD
    PyObject *records;  /* bytearray of int64 records */
    PyObject *contents; /* bytearray of values' bytes */
    long long num_rows;
    long long row_len;
    char format[16]; /* the buffer format of the target dtype, e.g. "i"; never matched if "" */
    Py_ssize_t itemsize;
    unsigned int *row_stamps; /* pack's repeated-row test: stamp == generation means seen */
    unsigned int generation;
} Stager;

static int append(PyObject *bytearray, const void *data, Py_ssize_t size) {
    Py_ssize_t old = PyByteArray_GET_SIZE(bytearray);
    /* PyByteArray_Resize over-allocates when growing: appends are amortised O(1). */
    if (PyByteArray_Resize(bytearray, old + size) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(bytearray) + old, data, (size_t)size);
    return 0;
}

static int exact_index(PyObject *obj, long long *value) {
    if (!PyLong_CheckExact(obj)) return 0; /* bool, numpy ints, ...: the Python path */
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (*value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static PyObject *stager_stage(Stager *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "stage(row, start, values) takes 3 arguments");
        return NULL;
    }
    long long row, start;
    if (!exact_index(args[0], &row) || !exact_index(args[1], &start)) Py_RETURN_FALSE;
    if (!PyObject_CheckBuffer(args[2])) Py_RETURN_FALSE;
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* not contiguous, or a dtype without a buffer format */
        Py_RETURN_FALSE;
    }
    int plain = view.ndim == 1 && view.itemsize == self->itemsize && view.format != NULL &&
                strcmp(view.format, self->format) == 0;
    long long length = plain ? (long long)view.shape[0] : 0;
    if (!plain || row < 0 || row >= self->num_rows || start < 0 ||
        start > self->row_len - length) {
        PyBuffer_Release(&view);
        Py_RETURN_FALSE;
    }
    if (length > 0) {
        long long record[RECORD_FIELDS] = {0, row, start, 0, length};
        Py_ssize_t old = PyByteArray_GET_SIZE(self->contents);
        if (append(self->contents, view.buf, view.len) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        if (append(self->records, record, sizeof(record)) < 0) {
            /* Keep the two buffers consistent: drop the contents just appended. */
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyByteArray_Resize(self->contents, old);
            PyErr_Restore(type, value, traceback);
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

static PyObject *stager_close(Stager *self, PyObject *unused) {
    self->num_rows = 0; /* every later stage() falls back to Python, which says why */
    Py_RETURN_NONE;
}

/* Stager(records, contents, num_rows, row_len, format, itemsize) */
static int stager_init(Stager *self, PyObject *args, PyObject *kwargs) {
    PyObject *records, *contents;
    long long num_rows, row_len;
    const char *format;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "O!O!LLsn", &PyByteArray_Type, &records, &PyByteArray_Type,
                          &contents, &num_rows, &row_len, &format, &itemsize))
        return -1;
    if (strlen(format) >= sizeof(self->format) || itemsize <= 0 || num_rows < 0 || row_len < 0) {
        PyErr_SetString(PyExc_ValueError, "bad format or itemsize");
        return -1;
    }
    Py_INCREF(records);
    Py_XSETREF(self->records, records);
    Py_INCREF(contents);
    Py_XSETREF(self->contents, contents);
    self->num_rows = num_rows;
    self->row_len = row_len;
    strcpy(self->format, format);
    self->itemsize = itemsize;
    return 0;
}

static void stager_dealloc(Stager *self) {
    PyMem_Free(self->row_stamps);
    Py_XDECREF(self->records);
    Py_XDECREF(self->contents);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyTypeObject *stager_type;

/* pack(stagers, group_table, address, capacity) -> (num_writes, contents_start, total_bytes,
 * repeated_row). Nothing is written when total_bytes > capacity (grow the slot and call again).
 * address is the host address of a slot of capacity bytes, 8-byte aligned. */
static PyObject *pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pack(stagers, group_table, address, capacity)");
        return NULL;
    }
    PyObject *stagers = PySequence_Fast(args[0], "stagers must be a sequence");
    if (stagers == NULL) return NULL;
    PyObject *result = NULL;
    Py_buffer groups = {0};
    Py_ssize_t num_groups = PySequence_Fast_GET_SIZE(stagers);
    PyObject **items = PySequence_Fast_ITEMS(stagers);
    if (PyObject_GetBuffer(args[1], &groups, PyBUF_SIMPLE) < 0) goto done;
    if (groups.len != num_groups * 24) {
        PyErr_SetString(PyExc_ValueError, "group_table must hold 3 int64 per stager");
        goto done;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) goto done;
    if (address % 8) {
        PyErr_SetString(PyExc_ValueError, "address must be 8-byte aligned");
        goto done;
    }
    Py_ssize_t num_writes = 0, contents_bytes = 0;
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        if (Py_TYPE(items[g]) != stager_type) {
            PyErr_SetString(PyExc_TypeError, "stagers must be Stager objects");
            goto done;
        }
        Stager *s = (Stager *)items[g];
        num_writes += PyByteArray_GET_SIZE(s->records) / (RECORD_FIELDS * 8);
        contents_bytes = (contents_bytes + s->itemsize - 1) / s->itemsize * s->itemsize;
        contents_bytes += PyByteArray_GET_SIZE(s->contents);
    }
    Py_ssize_t contents_start = (num_groups * 3 + num_writes * RECORD_FIELDS) * 8;
    Py_ssize_t total = contents_start + contents_bytes;
    int repeated = 0;
    if (num_writes > 0 && total <= capacity) {
        char *slot = (char *)(uintptr_t)address;
        memcpy(slot, groups.buf, (size_t)groups.len);
        long long *table = (long long *)(slot + num_groups * 24);
        Py_ssize_t base = 0;
        for (Py_ssize_t g = 0; g < num_groups; g++) {
            Stager *s = (Stager *)items[g];
            Py_ssize_t n = PyByteArray_GET_SIZE(s->records) / (RECORD_FIELDS * 8);
            Py_ssize_t size = PyByteArray_GET_SIZE(s->contents);
            base = (base + s->itemsize - 1) / s->itemsize * s->itemsize;
            if (n == 0) continue;
            memcpy(table, PyByteArray_AS_STRING(s->records), (size_t)n * RECORD_FIELDS * 8);
            memcpy(slot + contents_start + base, PyByteArray_AS_STRING(s->contents), (size_t)size);
            if (s->row_stamps == NULL && s->num_rows > 0) {
                s->row_stamps = PyMem_Calloc((size_t)s->num_rows, sizeof(unsigned int));
                if (s->row_stamps == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
            }
            if (++s->generation == 0) { /* wrapped: forget every stamp */
                memset(s->row_stamps, 0, (size_t)s->num_rows * sizeof(unsigned int));
                s->generation = 1;
            }
            long long offset = base;
            for (Py_ssize_t w = 0; w < n; w++, table += RECORD_FIELDS) {
                long long row = table[1];
                table[0] = g;
                table[3] = offset;
                offset += table[4] * s->itemsize;
                /* Rows were bounds-checked when staged; check again rather than trust. */
                if (row < 0 || row >= s->num_rows) {
                    PyErr_SetString(PyExc_RuntimeError, "staged row out of range");
                    goto done;
                }
                if (s->row_stamps[row] == s->generation) repeated = 1;
                s->row_stamps[row] = s->generation;
            }
            base += size;
        }
    }
    result = Py_BuildValue("nnni", num_writes, contents_start, total, repeated);
done:
    if (groups.obj != NULL) PyBuffer_Release(&groups);
    Py_DECREF(stagers);
    return result;
}

/* clear(stagers): drop every stager's staged writes (after a successful launch). */
static PyObject *clear(PyObject *module, PyObject *arg) {
    PyObject *stagers = PySequence_Fast(arg, "stagers must be a sequence");
    if (stagers == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(stagers);
    PyObject **items = PySequence_Fast_ITEMS(stagers);
    for (Py_ssize_t g = 0; g < count; g++) {
        if (Py_TYPE(items[g]) != stager_type) {
            Py_DECREF(stagers);
            PyErr_SetString(PyExc_TypeError, "stagers must be Stager objects");
            return NULL;
        }
        Stager *s = (Stager *)items[g];
        if (PyByteArray_Resize(s->records, 0) < 0 || PyByteArray_Resize(s->contents, 0) < 0) {
            Py_DECREF(stagers);
            return NULL;
        }
    }
    Py_DECREF(stagers);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(stagers, group_table, address, capacity) -> (num_writes, contents_start, "
     "total_bytes, repeated_row)"},
    {"clear", (PyCFunction)clear, METH_O, "clear(stagers): drop their staged writes"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef stager_methods[] = {
    {"stage", (PyCFunction)(void (*)(void))stager_stage, METH_FASTCALL,
     "stage(row, start, values) -> bool: True when staged, False to take the Python path"},
    {"close", (PyCFunction)stager_close, METH_NOARGS, "refuse every later stage()"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot stager_slots[] = {
    {Py_tp_init, stager_init},
    {Py_tp_dealloc, stager_dealloc},
    {Py_tp_methods, stager_methods},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "The C fast path of StagedWriteTensor.stage_write."},
    {0, NULL},
};

static PyType_Spec stager_spec = {
    "jaxbuf._staging.Stager", sizeof(Stager), 0, Py_TPFLAGS_DEFAULT, stager_slots,
};

static struct PyModuleDef staging_module = {
    PyModuleDef_HEAD_INIT, "_staging",
    "The C fast paths of StagedWriteTensor.stage_write and FusedStagedWriter.apply.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__staging(void) {
    PyObject *module = PyModule_Create(&staging_module);
    if (module == NULL) return NULL;
    PyObject *type = PyType_FromSpec(&stager_spec);
    if (type == NULL || PyModule_AddObject(module, "Stager", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    stager_type = (PyTypeObject *)type; /* the module keeps the reference */
    return module;
}
