/* The C side of jaxbuf's DLPack capsules: the deleter, the capsule destructor, the capsule
 * builder, and ExportAnchor, the object every capsule keeps alive.
 *
 * A producer hands a consumer a PyCapsule named "dltensor" (or "dltensor_versioned") whose
 * pointer is a malloc'd DLManagedTensor[Versioned]. A consumer that takes ownership renames the
 * capsule to "used_dltensor[_versioned]" and later calls the tensor's deleter itself (torch and
 * numpy when the array dies, JAX possibly from one of its own threads, possibly early when an
 * imported array is donated). When a capsule dies unconsumed, its destructor calls the deleter.
 *
 * Ownership (the numpy pattern, numpy/_core/src/multiarray/dlpack.c): manager_ctx holds a
 * strong reference to an ExportAnchor, which holds the allocation (its `target`) and counts the
 * capsules alive over it. The deleter frees the malloc block, then takes the GIL (it may run on
 * a thread Python never saw) and drops the reference; dropping the last one drops the target,
 * whose own release then runs. A view over foreign memory exports with no anchor (manager_ctx
 * NULL): the deleter then only frees the block.
 *
 * Shutdown. Once the interpreter is finalizing, a thread that takes the GIL is ended with
 * pthread_exit (3.14: parked forever); JAX calls deleters from C++ worker threads inside
 * noexcept destructors, where that unwind is std::terminate ("terminate called without an
 * active exception"). Checking Py_IsFinalizing() first is not enough: a deleter can pass the
 * check, then wait for the GIL while the main thread starts finalizing (and JAX still drops
 * buffers from its threads after atexit, while the main thread tears modules down and
 * releases the GIL). numpy's deleter (Py_IsInitialized, then PyGILState_Ensure) has the same
 * race. So: an atexit handler registered at import (before finalization starts: atexit runs
 * first in Py_FinalizeEx) sets `exiting`; from then on every deleter only frees its block and
 * leaks its anchor reference (the process returns the memory). A deleter counts itself in
 * `deleters_in_python` before it reads `exiting`, and the handler, after setting it, waits
 * with the GIL released until that count is zero: a deleter that saw `exiting` clear finishes
 * while taking the GIL is still safe (the pair of sequentially consistent atomics makes at
 * least one side see the other). Leaked references leave their allocations unreleased at
 * exit, which is what the finalizers do anyway (jaxbuf/_lifetime.py).
 *
 * Whose anchor: anchor_for(owner) asks the owner (jaxbuf/_owner.py: check_exportable(), then
 * export_anchor); an owner that names no ExportAnchor gets the one anchor_of() shares among the
 * live exports of that object, filed by address and gone with its last export.
 *
 * The same managed tensors go out without a capsule through DLPack's C exchange API
 * (_exchange.c, built into this module): jaxbuf_managed_block and the versioned deleter below
 * serve both.
 *
 * This needs _Py_IsFinalizing and _PyObject_LookupAttr before 3.13, outside the limited API:
 * the module is built per Python version (setup.py).
 */
#include "_capsule.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __unix__
#include <pthread.h>
#endif

/* The two managed-tensor layouts of dlpack.h, by offset (both little-endian 64-bit here;
 * _dlpack.py checks its struct formats against the ctypes layouts):
 *   legacy     DLManagedTensor:          dl_tensor[48], manager_ctx @48, deleter @56
 *   versioned  DLManagedTensorVersioned: version[8], manager_ctx @8, deleter @16, flags @24,
 *                                        dl_tensor @32 */
#define LEGACY_TENSOR_OFFSET 0
#define LEGACY_CTX_OFFSET 48
#define LEGACY_DELETER_OFFSET 56
#define LEGACY_SIZE 64
#define VERSIONED_TENSOR_OFFSET 32
#define VERSIONED_CTX_OFFSET 8
#define VERSIONED_DELETER_OFFSET 16
#define VERSIONED_SIZE 80

typedef void (*dl_deleter)(void *managed);

/* Save and restore the error indicator around code that must neither see nor clear it: a
 * capsule may be dropped, and an anchor die, while an exception propagates. */
#if PY_VERSION_HEX >= 0x030C0000
#define SAVE_ERROR() PyObject *saved_error = PyErr_GetRaisedException()
#define RESTORE_ERROR() PyErr_SetRaisedException(saved_error)
#else
#define SAVE_ERROR()                                  \
    PyObject *saved_type, *saved_value, *saved_trace; \
    PyErr_Fetch(&saved_type, &saved_value, &saved_trace)
#define RESTORE_ERROR() PyErr_Restore(saved_type, saved_value, saved_trace)
#endif

/* ---- ExportAnchor ------------------------------------------------------------------------ */

/* Keeps `target` (an allocation) alive while capsules over it exist, and counts them.
 * live_exports is changed only with the GIL held (new_capsule, the deleter). */
typedef struct {
    PyObject_HEAD
    PyObject *target;
    Py_ssize_t live_exports;
    PyObject *weakreflist;
    int shared; /* filed in shared_anchors (made by anchor_of) */
    int closed; /* set by close(): new_capsule refuses it from then on */
} ExportAnchor;

static PyTypeObject ExportAnchorType;

/* anchor_of's table: target address -> address of the live anchor made for it, both as ints.
 * It references neither object: an anchor removes its entry when it is deallocated, before it
 * drops its target, so an address in the table always names a live target and anchor. All
 * access holds the GIL and runs no Python code, so lookup-then-insert is atomic. */
static PyObject *shared_anchors = NULL;

static PyObject *anchor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"target", NULL};
    PyObject *target;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:ExportAnchor", keywords, &target)) {
        return NULL;
    }
    ExportAnchor *self = (ExportAnchor *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(target);
    self->target = target;
    self->live_exports = 0;
    self->weakreflist = NULL;
    self->shared = 0;
    self->closed = 0;
    return (PyObject *)self;
}

/* close() -> int: refuse new capsules from now on and return live_exports. One step with the
 * GIL held, as new_capsule's check-and-count is: an export racing the owner's free() on
 * another thread either counts before this (and the owner leaves the memory to it) or is
 * refused after it, never made over memory the owner released. */
static PyObject *anchor_close(ExportAnchor *self, PyObject *unused) {
    self->closed = 1;
    return PyLong_FromSsize_t(self->live_exports);
}

static void forget_shared(ExportAnchor *self) {
    if (!self->shared) return;
    self->shared = 0;
    PyObject *key = PyLong_FromVoidPtr((void *)self->target);
    if (key == NULL || PyDict_DelItem(shared_anchors, key) < 0) PyErr_WriteUnraisable(NULL);
    Py_XDECREF(key);
}

/* The target may reference whatever references the anchor (an owner that stores its anchor
 * and is its own target): the anchor takes part in garbage collection. A live capsule's
 * reference is invisible to the collector, so an anchor with live exports always counts as
 * reachable and is never cleared under a consumer. */
static int anchor_traverse(ExportAnchor *self, visitproc visit, void *arg) {
    Py_VISIT(self->target);
    return 0;
}

static int anchor_clear(ExportAnchor *self) {
    forget_shared(self);
    Py_CLEAR(self->target);
    return 0;
}

static void anchor_dealloc(ExportAnchor *self) {
    PyObject_GC_UnTrack(self);
    if (self->shared) { /* first: weakref callbacks below may call anchor_of(target) */
        SAVE_ERROR();
        forget_shared(self);
        RESTORE_ERROR();
    }
    if (self->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    /* Dropping the target runs the allocation's own release (its __del__). */
    Py_CLEAR(self->target);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *anchor_get_target(ExportAnchor *self, void *closure) {
    if (self->target == NULL) Py_RETURN_NONE; /* only after the collector cleared a cycle */
    Py_INCREF(self->target);
    return self->target;
}

static PyObject *anchor_get_live_exports(ExportAnchor *self, void *closure) {
    return PyLong_FromSsize_t(self->live_exports);
}

static PyObject *anchor_repr(ExportAnchor *self) {
    const char *kind = self->target == NULL ? "NoneType" : Py_TYPE(self->target)->tp_name;
    return PyUnicode_FromFormat("<ExportAnchor of %s object at %p, live_exports=%zd>", kind,
                                (void *)self->target, self->live_exports);
}

static PyObject *anchor_get_closed(ExportAnchor *self, void *closure) {
    return PyBool_FromLong(self->closed);
}

static PyMethodDef anchor_methods[] = {
    {"close", (PyCFunction)anchor_close, METH_NOARGS,
     "close() -> int: refuse new capsules over this anchor; return live_exports"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef anchor_getset[] = {
    {"closed", (getter)anchor_get_closed, NULL, "Whether close() was called.", NULL},
    {"target", (getter)anchor_get_target, NULL, "The object kept alive (the allocation).",
     NULL},
    {"live_exports", (getter)anchor_get_live_exports, NULL,
     "Capsules made over this anchor whose deleter has not run yet (consumed or not).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(anchor_doc,
             "ExportAnchor(target)\n--\n\n"
             "What a DLPack capsule keeps alive: a strong reference to ``target`` (the\n"
             "allocation) and a count of live exports. Every capsule made with this anchor\n"
             "holds a reference to it until the consumer's array is gone (the capsule's\n"
             "deleter drops it, with the GIL); when the last reference goes, ``target`` is\n"
             "dropped and its own release runs. Not subclassable; supports weak references.");

static PyTypeObject ExportAnchorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "jaxbuf._capsule.ExportAnchor",
    .tp_basicsize = sizeof(ExportAnchor),
    .tp_dealloc = (destructor)anchor_dealloc,
    .tp_repr = (reprfunc)anchor_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = anchor_doc,
    .tp_traverse = (traverseproc)anchor_traverse,
    .tp_clear = (inquiry)anchor_clear,
    .tp_weaklistoffset = offsetof(ExportAnchor, weakreflist),
    .tp_getset = anchor_getset,
    .tp_methods = anchor_methods,
    .tp_new = anchor_new,
};

/* anchor_of(target) -> ExportAnchor
 *
 * The anchor alive for `target` if there is one, else a new one filed for it: exports of an
 * object that has no anchor of its own share one (one live_exports count), and nothing keeps
 * the anchor alive but its exports, so it never outlives them or pins the target. */
static PyObject *anchor_of(PyObject *module, PyObject *target) {
    PyObject *key = PyLong_FromVoidPtr((void *)target);
    if (key == NULL) return NULL;
    PyObject *found = PyDict_GetItemWithError(shared_anchors, key); /* borrowed */
    if (found != NULL) {
        ExportAnchor *anchor = (ExportAnchor *)PyLong_AsVoidPtr(found);
        Py_DECREF(key);
        if (anchor == NULL && PyErr_Occurred()) return NULL;
        Py_INCREF(anchor);
        return (PyObject *)anchor;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    ExportAnchor *anchor = (ExportAnchor *)ExportAnchorType.tp_alloc(&ExportAnchorType, 0);
    PyObject *value = anchor == NULL ? NULL : PyLong_FromVoidPtr((void *)anchor);
    if (value == NULL || PyDict_SetItem(shared_anchors, key, value) < 0) {
        Py_DECREF(key);
        Py_XDECREF(value);
        Py_XDECREF(anchor);
        return NULL;
    }
    Py_DECREF(key);
    Py_DECREF(value);
    Py_INCREF(target);
    anchor->target = target;
    anchor->shared = 1;
    return (PyObject *)anchor;
}

/* Look up an attribute that may be missing without raising (1 found, 0 missing, -1 error). */
static int lookup_optional_attr(PyObject *object, PyObject *name, PyObject **result) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(object, name, result);
#else
    return _PyObject_LookupAttr(object, name, result);
#endif
}

static PyObject *str_check_exportable = NULL; /* interned at import */
static PyObject *str_export_anchor = NULL;

/* anchor_for(owner) -> ExportAnchor | None
 *
 * What an export of owner's memory holds. None for owner=None (foreign memory). The owner
 * contract (jaxbuf/_owner.py) makes owner.export_anchor the owner's one ExportAnchor while it
 * is open and None once it is freed: a live anchor is returned at once (one attribute read:
 * the common case, on every export, within a capsule's half-microsecond budget). Otherwise
 * owner.check_exportable() is called, which raises for a freed owner; an owner outside the
 * contract gets anchor_of(the object export_anchor names, or the owner itself). */
static PyObject *anchor_for(PyObject *module, PyObject *owner) {
    if (owner == Py_None) Py_RETURN_NONE;
    PyObject *anchor;
    if (lookup_optional_attr(owner, str_export_anchor, &anchor) < 0) return NULL;
    if (anchor != NULL && Py_TYPE(anchor) == &ExportAnchorType) return anchor;
    PyObject *check;
    if (lookup_optional_attr(owner, str_check_exportable, &check) < 0) {
        Py_XDECREF(anchor);
        return NULL;
    }
    if (check != NULL) {
        PyObject *result = PyObject_CallNoArgs(check);
        Py_DECREF(check);
        if (result == NULL) {
            Py_XDECREF(anchor);
            return NULL;
        }
        Py_DECREF(result);
    }
    if (anchor == Py_None) {
        /* Closed, yet check_exportable did not raise: refuse rather than export unanchored. */
        Py_DECREF(anchor);
        PyErr_Format(PyExc_RuntimeError, "%R has been freed: no new exports", owner);
        return NULL;
    }
    if (anchor == NULL) {
        Py_INCREF(owner);
        anchor = owner;
    }
    PyObject *shared = anchor_of(module, anchor);
    Py_DECREF(anchor);
    return shared;
}

PyObject *jaxbuf_anchor_for(PyObject *owner) { return anchor_for(NULL, owner); }

PyObject *jaxbuf_anchor_of(PyObject *target) { return anchor_of(NULL, target); }

int jaxbuf_anchor_closed(PyObject *anchor) {
    return Py_TYPE(anchor) == &ExportAnchorType && ((ExportAnchor *)anchor)->closed;
}

/* ---- the deleters ------------------------------------------------------------------------ */

/* Shutdown state (see the header). Sequentially consistent: each deleter increments
 * deleters_in_python and then reads exiting; at_exit stores exiting and then reads the count. */
static atomic_int exiting = 0;
static atomic_long deleters_in_python = 0;

/* How long at_exit waits for deleters already past their check (a CUDA release synchronizes
 * the device, so one may take a while); after that the process exits regardless. */
#define AT_EXIT_WAIT_NS (10LL * 1000 * 1000 * 1000)
#define AT_EXIT_POLL_NS (100LL * 1000)

/* Drop one export's reference to its anchor: with the GIL, and never once exiting. */
static void release_anchor(PyObject *anchor) {
    atomic_fetch_add(&deleters_in_python, 1);
    if (atomic_load(&exiting) || !Py_IsInitialized() || JAXBUF_IS_FINALIZING()) {
        atomic_fetch_sub(&deleters_in_python, 1);
        return; /* leak the reference: see the header */
    }
    PyGILState_STATE state = PyGILState_Ensure();
    SAVE_ERROR();
    ((ExportAnchor *)anchor)->live_exports -= 1;
    Py_DECREF(anchor);
    RESTORE_ERROR();
    PyGILState_Release(state);
    atomic_fetch_sub(&deleters_in_python, 1);
}

/* at_exit() -> None: registered with atexit at import (see the header). After it, deleters
 * leak their anchor references instead of taking the GIL; it returns once no deleter is still
 * between its check and its GIL release (or after AT_EXIT_WAIT_NS). */
static PyObject *at_exit(PyObject *module, PyObject *unused) {
    atomic_store(&exiting, 1);
    if (atomic_load(&deleters_in_python) == 0) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS /* the deleters in flight need the GIL to finish */
    struct timespec poll = {0, AT_EXIT_POLL_NS};
    for (long long waited = 0; atomic_load(&deleters_in_python) > 0 && waited < AT_EXIT_WAIT_NS;
         waited += AT_EXIT_POLL_NS) {
        nanosleep(&poll, NULL);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#ifdef __unix__
/* A forked child has only the forking thread: deleters in flight on other threads of the parent
 * do not exist there, and at_exit must not wait for them. */
static void forget_deleters_in_flight(void) { atomic_store(&deleters_in_python, 0); }
#endif

static PyObject *is_exiting(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(atomic_load(&exiting));
}

/* DLManagedTensor.deleter: free the block (struct + shape + strides), then drop the anchor. */
static void legacy_deleter(void *managed) {
    PyObject *anchor;
    memcpy(&anchor, (char *)managed + LEGACY_CTX_OFFSET, sizeof(anchor));
    free(managed);
    if (anchor != NULL) release_anchor(anchor);
}

/* The block this thread watches for (exchange_to: did a failing consumer delete it?). */
static _Thread_local JbDeletionWatch deletion_watch = {NULL, 0};

JbDeletionWatch jaxbuf_watch_deletion(JbDeletionWatch watch) {
    JbDeletionWatch previous = deletion_watch;
    deletion_watch = watch;
    return previous;
}

/* DLManagedTensorVersioned.deleter: the same for the versioned layout. */
void jaxbuf_versioned_deleter(void *managed) {
    if (managed == deletion_watch.block) deletion_watch.deleted = 1;
    PyObject *anchor;
    memcpy(&anchor, (char *)managed + VERSIONED_CTX_OFFSET, sizeof(anchor));
    free(managed);
    if (anchor != NULL) release_anchor(anchor);
}

/* The capsule destructor: an unconsumed capsule's deleter is the producer's to call. */
void jaxbuf_dltensor_capsule_destructor(PyObject *capsule) {
    /* PyCapsule_IsValid never raises, so no error state is disturbed. */
    dl_deleter deleter = NULL;
    char *managed = NULL;
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        managed = (char *)PyCapsule_GetPointer(capsule, "dltensor");
        if (managed != NULL) memcpy(&deleter, managed + LEGACY_DELETER_OFFSET, sizeof(deleter));
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        managed = (char *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (managed != NULL) {
            memcpy(&deleter, managed + VERSIONED_DELETER_OFFSET, sizeof(deleter));
        }
    }
    /* A "used_" capsule belongs to its consumer: nothing to do. A consumer's deleter may run
     * Python (a ctypes callback) while this capsule dies under a propagating exception (an
     * import refused): it must neither see that exception nor clear it. */
    if (deleter != NULL) {
        SAVE_ERROR();
        deleter(managed);
        RESTORE_ERROR();
    }
}

/* ---- the builder ------------------------------------------------------------------------- */

/* The owner was freed between the export taking its anchor and making the capsule (free() on
 * another thread): jaxbuf.ClosedError naming what the anchor holds. Error path only. */
void jaxbuf_raise_closed(PyObject *anchor_object) {
    ExportAnchor *anchor = (ExportAnchor *)anchor_object;
    const char *kind = anchor->target == NULL ? "memory" : Py_TYPE(anchor->target)->tp_name;
    PyObject *module = PyImport_ImportModule("jaxbuf._errors");
    PyObject *type = module == NULL ? NULL : PyObject_GetAttrString(module, "ClosedError");
    Py_XDECREF(module);
    if (type == NULL) return;
    PyObject *error = PyObject_CallFunction(
        type, "sss", kind, "freed",
        "free() ran on another thread while this export was being made; nothing was exported");
    Py_DECREF(type);
    if (error == NULL) return;
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
}

/* One export's malloc block, for a capsule (new_capsule) or the exchange API (_exchange.c). */
char *jaxbuf_managed_block(const char *payload, Py_ssize_t size, Py_ssize_t tensor_offset,
                           Py_ssize_t shape_offset, int versioned, PyObject *anchor) {
    if (anchor != NULL && ((ExportAnchor *)anchor)->closed) {
        jaxbuf_raise_closed(anchor);
        return NULL;
    }
    Py_ssize_t header = versioned ? VERSIONED_SIZE : LEGACY_SIZE;
    if (tensor_offset != (versioned ? VERSIONED_TENSOR_OFFSET : LEGACY_TENSOR_OFFSET) ||
        shape_offset != header || size < shape_offset || (size - shape_offset) % 16 != 0) {
        PyErr_SetString(PyExc_ValueError, "malformed DLPack payload");
        return NULL;
    }
    char *block = (char *)malloc((size_t)size);
    if (block == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(block, payload, (size_t)size);
    Py_ssize_t ndim = (size - shape_offset) / 16;
    /* Explicit strides always: DLPack 1.2 forbids NULL strides when ndim > 0. */
    void *shape = block + shape_offset;
    void *strides = block + shape_offset + 8 * ndim;
    memcpy(block + tensor_offset + 24, &shape, sizeof(void *));
    memcpy(block + tensor_offset + 32, &strides, sizeof(void *));
    dl_deleter deleter = versioned ? jaxbuf_versioned_deleter : legacy_deleter;
    memcpy(block + (versioned ? VERSIONED_CTX_OFFSET : LEGACY_CTX_OFFSET), &anchor,
           sizeof(anchor));
    memcpy(block + (versioned ? VERSIONED_DELETER_OFFSET : LEGACY_DELETER_OFFSET), &deleter,
           sizeof(deleter));
    if (anchor != NULL) {
        Py_INCREF(anchor);
        ((ExportAnchor *)anchor)->live_exports += 1;
    }
    return block;
}

/* Capsule names must outlive every capsule, including those alive at interpreter exit, so they
 * are static C strings rather than Python bytes objects. */
static const char LEGACY_NAME[] = "dltensor";
static const char VERSIONED_NAME[] = "dltensor_versioned";

/* new_capsule(payload: bytes, tensor_offset: int, shape_offset: int, versioned: bool,
 *             anchor: ExportAnchor | None = None)
 *
 * Copy a managed-tensor payload packed by _dlpack.py into one malloc block, point its DLTensor's
 * shape and strides fields (at tensor_offset + 24 and + 32) at the arrays that follow the
 * header (at shape_offset), set manager_ctx to the anchor and the deleter to the one for the
 * layout, and wrap the block in a capsule. One C call instead of several ctypes calls: capsule
 * export is on every framework import. */
static PyObject *new_capsule(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    char *payload;
    Py_ssize_t size;
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "new_capsule takes 4 or 5 arguments");
        return NULL;
    }
    PyObject *anchor = nargs == 5 ? args[4] : Py_None;
    if (anchor == Py_None) {
        anchor = NULL;
    } else if (Py_TYPE(anchor) != &ExportAnchorType) {
        PyErr_Format(PyExc_TypeError, "anchor must be an ExportAnchor or None, not %.100s",
                     Py_TYPE(anchor)->tp_name);
        return NULL;
    }
    if (PyBytes_AsStringAndSize(args[0], &payload, &size) < 0) return NULL;
    Py_ssize_t tensor_offset = PyLong_AsSsize_t(args[1]);
    Py_ssize_t shape_offset = PyLong_AsSsize_t(args[2]);
    int versioned = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred() || versioned < 0) return NULL;
    char *block =
        jaxbuf_managed_block(payload, size, tensor_offset, shape_offset, versioned, anchor);
    if (block == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(block, versioned ? VERSIONED_NAME : LEGACY_NAME,
                                      jaxbuf_dltensor_capsule_destructor);
    if (capsule == NULL) {
        /* The deleter frees the block and gives the export back. */
        (versioned ? jaxbuf_versioned_deleter : legacy_deleter)(block);
        return NULL;
    }
    return capsule;
}

static PyMethodDef capsule_methods[] = {
    {"anchor_for", (PyCFunction)anchor_for, METH_O,
     "anchor_for(owner) -> ExportAnchor | None: what an export of owner's memory holds"},
    {"anchor_of", (PyCFunction)anchor_of, METH_O,
     "anchor_of(target) -> ExportAnchor: the anchor alive for target, or a new shared one"},
    {"new_capsule", (PyCFunction)(void (*)(void))new_capsule, METH_FASTCALL,
     "new_capsule(payload, tensor_offset, shape_offset, versioned, anchor=None) -> capsule"},
    {"at_exit", (PyCFunction)at_exit, METH_NOARGS,
     "at_exit() -> None: from now on deleters leak their anchor instead of taking the GIL\n"
     "(registered with atexit at import; the process is exiting)"},
    {"is_exiting", (PyCFunction)is_exiting, METH_NOARGS,
     "is_exiting() -> bool: whether at_exit has run"},
    {"register_exchange", (PyCFunction)(void (*)(void))jaxbuf_register_exchange, METH_FASTCALL,
     "register_exchange(view_type, order_hook, allocate_hook, import_hook) -> capsule: the\n"
     "view type's DLPack C exchange API (\"dlpack_exchange_api\")"},
    {"exchange_to", (PyCFunction)(void (*)(void))jaxbuf_exchange_to, METH_FASTCALL,
     "exchange_to(api, view, stream) -> object: the view imported by another framework's\n"
     "DLPack C exchange API, stream (a DLPack number or None) ordered after pending writes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef capsule_module = {
    PyModuleDef_HEAD_INIT, "_capsule",
    "The C side of jaxbuf's DLPack capsules: ExportAnchor, the deleters, the destructor and a "
    "fast builder.",
    -1, capsule_methods,
};

static int add_address(PyObject *module, const char *name, const void *address) {
    PyObject *value = PyLong_FromVoidPtr((void *)address);
    if (value == NULL) return -1;
    if (PyModule_AddObject(module, name, value) < 0) {
        Py_DECREF(value);
        return -1;
    }
    return 0;
}

/* atexit.register(module.at_exit), once per process (the exiting flag is process-wide), and
 * the fork handler above. */
static int register_at_exit(PyObject *module) {
    static int registered = 0;
    if (registered) return 0;
    PyObject *atexit_module = PyImport_ImportModule("atexit");
    if (atexit_module == NULL) return -1;
    PyObject *handler = PyObject_GetAttrString(module, "at_exit");
    PyObject *result =
        handler == NULL ? NULL : PyObject_CallMethod(atexit_module, "register", "O", handler);
    Py_DECREF(atexit_module);
    Py_XDECREF(handler);
    if (result == NULL) return -1;
    Py_DECREF(result);
#ifdef __unix__
    if (pthread_atfork(NULL, NULL, forget_deleters_in_flight) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return -1;
    }
#endif
    registered = 1;
    return 0;
}

PyMODINIT_FUNC PyInit__capsule(void) {
    if (PyType_Ready(&ExportAnchorType) < 0) return NULL;
    if (shared_anchors == NULL) { /* process-lifetime, like the type */
        shared_anchors = PyDict_New();
        str_check_exportable = PyUnicode_InternFromString("check_exportable");
        str_export_anchor = PyUnicode_InternFromString("export_anchor");
        if (shared_anchors == NULL || str_check_exportable == NULL || str_export_anchor == NULL)
            return NULL;
    }
    PyObject *module = PyModule_Create(&capsule_module);
    if (module == NULL) return NULL;
    Py_INCREF(&ExportAnchorType);
    if (PyModule_AddObject(module, "ExportAnchor", (PyObject *)&ExportAnchorType) < 0) {
        Py_DECREF(&ExportAnchorType);
        Py_DECREF(module);
        return NULL;
    }
    const void *destructor = (const void *)jaxbuf_dltensor_capsule_destructor;
    const void *versioned_deleter = (const void *)jaxbuf_versioned_deleter;
    if (add_address(module, "DESTRUCTOR_ADDRESS", destructor) < 0 ||
        add_address(module, "LEGACY_DELETER_ADDRESS", (const void *)legacy_deleter) < 0 ||
        add_address(module, "VERSIONED_DELETER_ADDRESS", versioned_deleter) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (jaxbuf_exchange_init(module) < 0 || register_at_exit(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
