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

static struct PyModuleDef capsule_module = {
    PyModuleDef_HEAD_INIT, "_capsule",
    "Addresses of the C destructor and static names for jaxbuf's DLPack capsules.", -1, NULL,
};

PyMODINIT_FUNC PyInit__capsule(void) {
    PyObject *module = PyModule_Create(&capsule_module);
    if (module == NULL) return NULL;
    if (add_address(module, "DESTRUCTOR_ADDRESS", (const void *)dltensor_capsule_destructor) < 0 ||
        add_address(module, "LEGACY_NAME_ADDRESS", LEGACY_NAME) < 0 ||
        add_address(module, "VERSIONED_NAME_ADDRESS", VERSIONED_NAME) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
