/* The DLPack capsule destructor, the only C in jaxbuf.
 *
 * A producer hands a consumer a PyCapsule named "dltensor" (or "dltensor_versioned") whose
 * pointer is a malloc'd DLManagedTensor[Versioned]. A consumer that takes ownership renames the
 * capsule to "used_dltensor[_versioned]" and later calls the tensor's deleter itself. When a
 * capsule dies unconsumed, the producer must call the deleter: that is this function.
 *
 * It is C, not a ctypes callback, because it can run during interpreter shutdown, after ctypes'
 * Python-level state is gone, and because the rule in DESIGN.md is that capsules never call
 * back into Python. The deleter it calls is libc free() (see _dlpack.py), which needs no GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

/* The deleter is the second field after manager_ctx in both layouts; we only need its address,
 * so both structs are described by their prefix. */
typedef struct {
    char dl_tensor[48];
    void *manager_ctx;
    void (*deleter)(void *self);
} LegacyManaged;

typedef struct {
    unsigned int major;
    unsigned int minor;
    void *manager_ctx;
    void (*deleter)(void *self);
} VersionedManaged;

static void dltensor_capsule_destructor(PyObject *capsule) {
    /* PyCapsule_IsValid never raises, so no error state is disturbed. */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        LegacyManaged *managed = (LegacyManaged *)PyCapsule_GetPointer(capsule, "dltensor");
        if (managed != NULL && managed->deleter != NULL) managed->deleter(managed);
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        VersionedManaged *managed =
            (VersionedManaged *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (managed != NULL && managed->deleter != NULL) managed->deleter(managed);
    }
    /* A "used_" capsule belongs to its consumer: nothing to do. */
}

/* Capsule names must outlive every capsule, including those alive at interpreter exit, so they
 * are static C strings rather than Python bytes objects. */
static const char LEGACY_NAME[] = "dltensor";
static const char VERSIONED_NAME[] = "dltensor_versioned";

static int add_address(PyObject *module, const char *name, const void *address) {
    PyObject *value = PyLong_FromVoidPtr((void *)address);
    if (value == NULL) return -1;
    if (PyModule_AddObject(module, name, value) < 0) {
        Py_DECREF(value);
        return -1;
    }
    return 0;
}

/* new_capsule(payload: bytes, tensor_offset: int, shape_offset: int, versioned: bool)
 *
 * Copy a managed-tensor payload packed by _dlpack.py into one malloc block, point its DLTensor's
 * shape and strides fields (at tensor_offset + 24 and + 32) at the arrays that follow the
 * header (at shape_offset), and wrap the block in a capsule. One C call instead of three ctypes
 * calls (malloc, memmove, PyCapsule_New): capsule export is on every framework import. */
static PyObject *new_capsule(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    char *payload;
    Py_ssize_t size;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "new_capsule takes 4 arguments");
        return NULL;
    }
    if (PyBytes_AsStringAndSize(args[0], &payload, &size) < 0) return NULL;
    Py_ssize_t tensor_offset = PyLong_AsSsize_t(args[1]);
    Py_ssize_t shape_offset = PyLong_AsSsize_t(args[2]);
    int versioned = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred() || versioned < 0) return NULL;
    if (tensor_offset < 0 || shape_offset < tensor_offset + 48 || shape_offset > size ||
        (size - shape_offset) % 16 != 0) {
        PyErr_SetString(PyExc_ValueError, "malformed DLPack payload");
        return NULL;
    }
    char *block = (char *)malloc((size_t)size);
    if (block == NULL) return PyErr_NoMemory();
    memcpy(block, payload, (size_t)size);
    Py_ssize_t ndim = (size - shape_offset) / 16;
    void *shape = block + shape_offset;
    void *strides = block + shape_offset + 8 * ndim;
    memcpy(block + tensor_offset + 24, &shape, sizeof(void *));
    memcpy(block + tensor_offset + 32, &strides, sizeof(void *));
    PyObject *capsule = PyCapsule_New(block, versioned ? VERSIONED_NAME : LEGACY_NAME,
                                      dltensor_capsule_destructor);
    if (capsule == NULL) free(block);
    return capsule;
}

static PyMethodDef capsule_methods[] = {
    {"new_capsule", (PyCFunction)(void (*)(void))new_capsule, METH_FASTCALL,
     "new_capsule(payload, tensor_offset, shape_offset, versioned) -> capsule"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef capsule_module = {
    PyModuleDef_HEAD_INIT, "_capsule",
    "The C side of jaxbuf's DLPack capsules: their destructor and a fast builder.", -1,
    capsule_methods,
};

PyMODINIT_FUNC PyInit__capsule(void) {
    PyObject *module = PyModule_Create(&capsule_module);
    if (module == NULL) return NULL;
    if (add_address(module, "DESTRUCTOR_ADDRESS", (const void *)dltensor_capsule_destructor) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
