/* DLPack's C exchange API (dlpack.h 1.3, DLPackExchangeAPI) for jaxbuf's views, both ways.
 *
 * Producer. BufferView.__dlpack_c_exchange_api__ is a capsule named "dlpack_exchange_api"
 * pointing at the static table below; a consumer (torch, tvm-ffi, a kernel library) calls its
 * functions with the GIL held instead of going through __dlpack__ and a capsule:
 *   managed_tensor_from_py_object_no_sync  what view.__dlpack__(max_version=(1, x)) returns,
 *       minus the capsule: the same payload (so the same flags, READ_ONLY included, and
 *       explicit strides), the same anchor (the owner's memory stays alive, and the export
 *       counts in live_exports, until the consumer calls the deleter), the same ordering (the
 *       device's default stream waits for the owner's pending writes, as stream=None does).
 *   dltensor_from_py_object_no_sync  the DLTensor alone, borrowed: shape and strides point into
 *       the view's packed payload, which lives as long as the view.
 *   current_work_stream  NULL for every device jaxbuf knows: jaxbuf's work goes on the legacy
 *       default stream (CUDA's handle 0), and the CPU has none.
 *   managed_tensor_allocator  a new tensor through jaxbuf's allocation hook (host memory or a
 *       driver allocation, kept alive by the tensor's anchor), errors through the consumer's
 *       SetError; it may be called without the GIL (tvm-ffi releases it around a call), so it
 *       takes it, and refuses once the interpreter is finalizing (taking it then would end
 *       the calling thread).
 *   managed_tensor_to_py_object_no_sync  a BufferView over a consumer's managed tensor, which
 *       is deleted when the view and everything exported from it are gone.
 * Errors: a Python exception (the GIL is held), SetError in the allocator; nothing crashes
 * and nothing leaks on a failure path.
 *
 * Consumer. exchange_to(api, view, stream) builds the same managed tensor and hands it to
 * another framework's managed_tensor_to_py_object_no_sync (torch's), after ordering `stream`
 * (the consumer's current stream, a DLPack stream number) after the owner's pending writes.
 *
 * The Python side (jaxbuf/_exchange.py) registers the view type and three hooks once, at
 * import: the ordering (views._order_after_owner), the allocation and the import.
 */
#include "_capsule.h"

#include <stdlib.h>
#include <string.h>

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h> /* PyMemberDef, T_OBJECT_EX */
#endif

#define TENSOR_OFFSET ((Py_ssize_t)offsetof(JbManagedTensorVersioned, dl_tensor))
#define HEADER_SIZE ((Py_ssize_t)sizeof(JbManagedTensorVersioned))
#define MAX_NDIM 64 /* what an allocation request may ask for: bounds the stack payload */

/* Set once by register_exchange (process-lifetime, like the type). */
static PyTypeObject *view_type = NULL;
static Py_ssize_t owner_offset = -1;   /* BufferView.owner's slot */
static Py_ssize_t payload_offset = -1; /* BufferView._versioned_payload's slot */
static PyObject *order_hook = NULL;    /* (view, stream) -> None */
static PyObject *allocate_hook = NULL; /* (device_type, device_id, nbytes) -> (ptr, keeper) */
static PyObject *import_hook = NULL;   /* (capsule, ptr, device, dtype, shape, ...) -> view */
static PyObject *api_capsule = NULL;
static PyObject *str_pack_versioned = NULL;

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* ---- building a managed tensor from a view --------------------------------------------- */

static int check_view(PyObject *view) {
    if (view_type != NULL && PyObject_TypeCheck(view, view_type)) return 0;
    PyErr_Format(PyExc_TypeError, "expected a jaxbuf BufferView, got %.100s",
                 Py_TYPE(view)->tp_name);
    return -1;
}

/* The view's versioned payload (a new reference to the (bytes, tensor_offset, shape_offset,
 * versioned) tuple of _dlpack.pack_payload), packed on first use by the view itself. */
static PyObject *payload_of(PyObject *view) {
    PyObject *payload = SLOT(view, payload_offset);
    if (payload == NULL || payload == Py_None) {
        payload = PyObject_CallMethodNoArgs(view, str_pack_versioned);
        if (payload == NULL) return NULL;
    } else {
        Py_INCREF(payload);
    }
    PyObject *bytes = PyTuple_CheckExact(payload) && PyTuple_GET_SIZE(payload) == 4 &&
                              PyTuple_GET_ITEM(payload, 3) == Py_True
                          ? PyTuple_GET_ITEM(payload, 0)
                          : NULL;
    if (bytes == NULL || !PyBytes_CheckExact(bytes) || PyBytes_GET_SIZE(bytes) < HEADER_SIZE ||
        (PyBytes_GET_SIZE(bytes) - HEADER_SIZE) % 16 != 0) {
        Py_DECREF(payload);
        PyErr_SetString(PyExc_ValueError, "malformed DLPack payload");
        return NULL;
    }
    return payload;
}

static PyObject *owner_of(PyObject *view) {
    PyObject *owner = SLOT(view, owner_offset);
    if (owner == NULL) PyErr_SetString(PyExc_AttributeError, "the view has no owner slot set");
    return owner; /* borrowed */
}

/* A managed tensor over the view, holding its owner's anchor: what __dlpack__ would return
 * in a versioned capsule. No stream ordering. NULL with an exception. */
static JbManagedTensorVersioned *managed_from_view(PyObject *view) {
    if (check_view(view) < 0) return NULL;
    PyObject *owner = owner_of(view);
    if (owner == NULL) return NULL;
    PyObject *anchor = jaxbuf_anchor_for(owner); /* raises for a freed owner */
    if (anchor == NULL) return NULL;
    PyObject *payload = payload_of(view);
    if (payload == NULL) {
        Py_DECREF(anchor);
        return NULL;
    }
    PyObject *bytes = PyTuple_GET_ITEM(payload, 0);
    char *block = jaxbuf_managed_block(PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes),
                                       TENSOR_OFFSET, HEADER_SIZE, 1,
                                       anchor == Py_None ? NULL : anchor);
    Py_DECREF(payload);
    Py_DECREF(anchor);
    return (JbManagedTensorVersioned *)block;
}

static int is_stream_device(int device_type) {
    return device_type == JAXBUF_KDL_CUDA || device_type == JAXBUF_KDL_CUDA_HOST ||
           device_type == JAXBUF_KDL_ROCM || device_type == JAXBUF_KDL_ROCM_HOST;
}

/* Order `stream` (a DLPack stream number) after the owner's pending writes: order_hook. */
static int order_after_owner(PyObject *view, PyObject *stream) {
    PyObject *owner = SLOT(view, owner_offset);
    if (owner == NULL || owner == Py_None) return 0; /* foreign memory: nothing pending */
    PyObject *result = PyObject_CallFunctionObjArgs(order_hook, view, stream, NULL);
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

/* What __dlpack__(stream=None) orders: the device's default stream (CUDA's legacy stream,
 * DLPack number 1; ROCm's, 0) after the owner's pending writes. The host has no streams. */
static int order_default_stream(PyObject *view, int device_type) {
    if (!is_stream_device(device_type)) return 0;
    int rocm = device_type == JAXBUF_KDL_ROCM || device_type == JAXBUF_KDL_ROCM_HOST;
    PyObject *stream = PyLong_FromLong(rocm ? 0 : 1);
    if (stream == NULL) return -1;
    int status = order_after_owner(view, stream);
    Py_DECREF(stream);
    return status;
}

/* ---- the producer's table -------------------------------------------------------------- */

/* A C caller may pass NULL for the object: a ValueError naming the function, not a crash. */
static int check_py_object(void *py_object, const char *function) {
    if (py_object != NULL) return 0;
    PyErr_Format(PyExc_ValueError, "%s: py_object is NULL", function);
    return -1;
}

static int api_from_py_object(void *py_object, JbManagedTensorVersioned **out) {
    PyObject *view = (PyObject *)py_object;
    if (out == NULL) {
        PyErr_SetString(PyExc_ValueError, "managed_tensor_from_py_object_no_sync: out is NULL");
        return -1;
    }
    *out = NULL;
    if (check_py_object(py_object, "managed_tensor_from_py_object_no_sync") < 0) return -1;
    JbManagedTensorVersioned *managed = managed_from_view(view);
    if (managed == NULL) return -1;
    if (order_default_stream(view, managed->dl_tensor.device.device_type) < 0) {
        managed->deleter(managed); /* gives the export back; the exception stays set */
        return -1;
    }
    *out = managed;
    return 0;
}

static int api_dltensor_from_py_object(void *py_object, JbDLTensor *out) {
    PyObject *view = (PyObject *)py_object;
    if (out == NULL) {
        PyErr_SetString(PyExc_ValueError, "dltensor_from_py_object_no_sync: out is NULL");
        return -1;
    }
    if (check_py_object(py_object, "dltensor_from_py_object_no_sync") < 0) return -1;
    if (check_view(view) < 0) return -1;
    PyObject *owner = owner_of(view);
    if (owner == NULL) return -1;
    PyObject *anchor = jaxbuf_anchor_for(owner); /* a freed owner raises: no pointer out */
    if (anchor == NULL) return -1;
    int closed = anchor != Py_None && jaxbuf_anchor_closed(anchor);
    if (closed) jaxbuf_raise_closed(anchor);
    Py_DECREF(anchor);
    if (closed) return -1;
    PyObject *payload = payload_of(view);
    if (payload == NULL) return -1;
    /* Borrowed: the view keeps its payload (packed once, never replaced) for its lifetime. */
    int kept = SLOT(view, payload_offset) == payload;
    Py_DECREF(payload);
    if (!kept) {
        PyErr_SetString(PyExc_BufferError, "the view's payload is not its own");
        return -1;
    }
    char *bytes = PyBytes_AS_STRING(PyTuple_GET_ITEM(payload, 0));
    memcpy(out, bytes + TENSOR_OFFSET, sizeof(JbDLTensor));
    out->shape = (int64_t *)(bytes + HEADER_SIZE);
    out->strides = out->shape + out->ndim;
    return order_default_stream(view, out->device.device_type);
}

static int api_current_work_stream(int device_type, int32_t device_id, void **out_stream) {
    if (out_stream != NULL && (device_type == JAXBUF_KDL_CPU || is_stream_device(device_type))) {
        *out_stream = NULL; /* the legacy default stream (handle 0), or none on the host */
        return 0;
    }
    PyGILState_STATE state = PyGILState_Ensure();
    if (out_stream == NULL) {
        PyErr_SetString(PyExc_ValueError, "current_work_stream: out_current_stream is NULL");
    } else {
        PyErr_Format(PyExc_BufferError, "jaxbuf has no work stream on DLPack device type %d",
                     device_type);
    }
    PyGILState_Release(state);
    return -1;
}

/* The pending Python exception, cleared, handed to SetError as (type name, str). */
static void pass_error(void *error_ctx, JbSetError set_error) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *error = PyErr_GetRaisedException();
#else
    PyObject *type, *error, *trace;
    PyErr_Fetch(&type, &error, &trace);
    PyErr_NormalizeException(&type, &error, &trace);
    Py_XDECREF(type);
    Py_XDECREF(trace);
#endif
    const char *kind = error == NULL ? "RuntimeError" : Py_TYPE(error)->tp_name;
    PyObject *text = error == NULL ? NULL : PyObject_Str(error);
    const char *message = text == NULL ? NULL : PyUnicode_AsUTF8(text);
    PyErr_Clear(); /* from str() itself, if it failed */
    set_error(error_ctx, kind, message == NULL ? "jaxbuf could not allocate the tensor" : message);
    Py_XDECREF(text);
    Py_XDECREF(error);
}

static int reject(void *error_ctx, JbSetError set_error, const char *message) {
    if (set_error != NULL) set_error(error_ctx, "ValueError", message);
    return -1;
}

static int api_allocator(JbDLTensor *prototype, JbManagedTensorVersioned **out, void *error_ctx,
                         JbSetError set_error) {
    if (out != NULL) *out = NULL;
    if (prototype == NULL || out == NULL) return reject(error_ctx, set_error, "NULL argument");
    int ndim = prototype->ndim;
    if (ndim < 0 || ndim > MAX_NDIM || (ndim > 0 && prototype->shape == NULL)) {
        return reject(error_ctx, set_error, "prototype ndim out of range or shape NULL");
    }
    JbDLDataType dtype = prototype->dtype;
    if (dtype.lanes != 1 || dtype.bits == 0 || dtype.bits % 8 != 0) {
        return reject(error_ctx, set_error, "jaxbuf allocates whole-byte, single-lane dtypes");
    }
    /* The payload _dlpack.pack_payload would pack: header, shape, row-major strides. */
    char payload[sizeof(JbManagedTensorVersioned) + 16 * MAX_NDIM];
    memset(payload, 0, sizeof(payload));
    JbManagedTensorVersioned *header = (JbManagedTensorVersioned *)payload;
    int64_t *shape = (int64_t *)(payload + HEADER_SIZE);
    int64_t *strides = shape + ndim;
    int64_t count = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        int64_t extent = prototype->shape[i];
        if (extent < 0) return reject(error_ctx, set_error, "negative extent in prototype");
        shape[i] = extent;
        strides[i] = count;
        if (extent > 0 && count > INT64_MAX / extent) {
            return reject(error_ctx, set_error, "prototype shape overflows int64");
        }
        count *= extent > 0 ? extent : 1;
    }
    int any_zero = 0;
    for (int i = 0; i < ndim; i++) any_zero |= shape[i] == 0;
    int64_t itemsize = dtype.bits / 8;
    if (count > INT64_MAX / itemsize) {
        return reject(error_ctx, set_error, "prototype size overflows int64");
    }
    long long nbytes = any_zero ? 0 : (long long)(count * itemsize);
    header->version.major = JAXBUF_DLPACK_MAJOR;
    header->version.minor = JAXBUF_DLPACK_MINOR;
    header->dl_tensor.device = prototype->device;
    header->dl_tensor.ndim = ndim;
    header->dl_tensor.dtype = dtype;

    if (!Py_IsInitialized() || JAXBUF_IS_FINALIZING()) {
        if (set_error != NULL) set_error(error_ctx, "RuntimeError", "the interpreter is exiting");
        return -1;
    }
    PyGILState_STATE state = PyGILState_Ensure();
    int status = -1;
    PyObject *result = NULL, *anchor = NULL;
    if (allocate_hook == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "jaxbuf's exchange API is not registered");
        goto done;
    }
    result = PyObject_CallFunction(allocate_hook, "iiL", (int)prototype->device.device_type,
                                   (int)prototype->device.device_id, nbytes);
    if (result == NULL) goto done;
    if (!PyTuple_CheckExact(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_TypeError, "the allocation hook must return (ptr, keeper)");
        goto done;
    }
    void *data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(result, 0));
    if (data == NULL && PyErr_Occurred()) goto done;
    header->dl_tensor.data = any_zero ? NULL : data;
    PyObject *keeper = PyTuple_GET_ITEM(result, 1); /* None: nothing allocated (no bytes) */
    if (keeper != Py_None && (anchor = jaxbuf_anchor_of(keeper)) == NULL) goto done;
    char *block = jaxbuf_managed_block(payload, HEADER_SIZE + 16 * (Py_ssize_t)ndim,
                                       TENSOR_OFFSET, HEADER_SIZE, 1, anchor);
    if (block == NULL) goto done;
    *out = (JbManagedTensorVersioned *)block;
    status = 0;
done:
    Py_XDECREF(anchor);
    Py_XDECREF(result);
    if (status < 0) {
        if (set_error != NULL) {
            pass_error(error_ctx, set_error);
        } else {
            PyErr_Clear();
        }
    }
    PyGILState_Release(state);
    return status;
}

/* The hook's arguments for a consumer's tensor: (ptr, device_type, device_id, code, bits,
 * lanes, shape, read_only), or NULL with BufferError for what no view can describe or what
 * is inconsistent (another major version, whose other fields dlpack.h says not to read; a
 * NULL shape, a negative or absurd rank or extent; NULL data under elements; a byte offset
 * that wraps the address; a strided layout). */
static PyObject *describe(const JbManagedTensorVersioned *tensor) {
    if (tensor->version.major != JAXBUF_DLPACK_MAJOR) {
        PyErr_Format(PyExc_BufferError, "DLPack major version %u is not %d",
                     tensor->version.major, JAXBUF_DLPACK_MAJOR);
        return NULL;
    }
    const JbDLTensor *dl = &tensor->dl_tensor;
    if (dl->ndim < 0 || dl->ndim > MAX_NDIM || (dl->ndim > 0 && dl->shape == NULL)) {
        PyErr_Format(PyExc_BufferError,
                     "malformed DLTensor: ndim %d (0 to %d) or a NULL shape", dl->ndim,
                     MAX_NDIM);
        return NULL;
    }
    PyObject *shape = PyTuple_New(dl->ndim);
    if (shape == NULL) return NULL;
    int empty = 0, strided = 0;
    int64_t step = 1;
    for (int i = dl->ndim - 1; i >= 0; i--) {
        int64_t extent = dl->shape[i];
        if (extent < 0) {
            Py_DECREF(shape);
            PyErr_Format(PyExc_BufferError, "malformed DLTensor: extent %lld in dimension %d",
                         (long long)extent, i);
            return NULL;
        }
        PyObject *item = PyLong_FromLongLong(extent);
        if (item == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, item);
        empty |= extent == 0;
        /* Row-major: a dimension of extent 1 may have any stride (torch gives such). */
        if (dl->strides != NULL && extent > 1 && dl->strides[i] != step) strided = 1;
        /* Saturating (no signed overflow): a size past int64 is refused as the view's. */
        if (extent > 1) step = step <= INT64_MAX / extent ? step * extent : INT64_MAX;
    }
    if (strided && !empty) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_BufferError, "jaxbuf views are row-major; this tensor is strided");
        return NULL;
    }
    if (dl->data == NULL && !empty) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_BufferError,
                        "malformed DLTensor: NULL data under a shape with elements");
        return NULL;
    }
    uintptr_t ptr = (uintptr_t)dl->data + (uintptr_t)dl->byte_offset;
    if (!empty && ptr < (uintptr_t)dl->data) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_BufferError, "malformed DLTensor: data + byte_offset wraps");
        return NULL;
    }
    return Py_BuildValue("(KiiiiiNO)", (unsigned long long)ptr, (int)dl->device.device_type,
                         (int)dl->device.device_id, (int)dl->dtype.code, (int)dl->dtype.bits,
                         (int)dl->dtype.lanes, shape,
                         (tensor->flags & JAXBUF_DLPACK_FLAG_READ_ONLY) ? Py_True : Py_False);
}

static int api_to_py_object(JbManagedTensorVersioned *tensor, void **out_py_object) {
    if (out_py_object != NULL) *out_py_object = NULL;
    if (tensor == NULL || out_py_object == NULL || import_hook == NULL) {
        /* Stolen: deleted first, so a deleter that runs Python finds no exception set. */
        if (tensor != NULL && tensor->deleter != NULL) tensor->deleter(tensor);
        PyErr_SetString(PyExc_ValueError,
                        tensor == NULL ? "managed_tensor_to_py_object_no_sync: tensor is NULL"
                        : out_py_object == NULL
                            ? "managed_tensor_to_py_object_no_sync: out_py_object is NULL"
                            : "managed_tensor_to_py_object_no_sync: no import hook");
        return -1;
    }
    /* The tensor is ours now: an unconsumed capsule deletes it when it dies, whether the
     * import below succeeds (the view's owner holds the capsule) or fails. */
    PyObject *capsule =
        PyCapsule_New(tensor, "dltensor_versioned", jaxbuf_dltensor_capsule_destructor);
    if (capsule == NULL) {
        if (tensor->deleter != NULL) tensor->deleter(tensor);
        return -1;
    }
    PyObject *fields = describe(tensor);
    PyObject *view = NULL;
    if (fields != NULL) {
        PyObject *call[9] = {capsule};
        for (Py_ssize_t i = 0; i < 8; i++) call[i + 1] = PyTuple_GET_ITEM(fields, i);
        view = PyObject_Vectorcall(import_hook, call, 9, NULL);
        Py_DECREF(fields);
    }
    Py_DECREF(capsule);
    if (view == NULL) return -1;
    *out_py_object = view;
    return 0;
}

static JbExchangeAPI exchange_api = {
    .header = {.version = {JAXBUF_DLPACK_MAJOR, JAXBUF_DLPACK_MINOR}, .prev_api = NULL},
    .managed_tensor_allocator = api_allocator,
    .managed_tensor_from_py_object_no_sync = api_from_py_object,
    .managed_tensor_to_py_object_no_sync = api_to_py_object,
    .dltensor_from_py_object_no_sync = api_dltensor_from_py_object,
    .current_work_stream = api_current_work_stream,
};

/* ---- module functions ------------------------------------------------------------------ */

/* The offset of a T_OBJECT_EX slot named `name` of `type` (a __slots__ member). */
static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *descriptor = PyObject_GetAttrString((PyObject *)type, name);
    if (descriptor == NULL) return -1;
    Py_ssize_t offset = -1;
    if (Py_TYPE(descriptor) == &PyMemberDescr_Type) {
        PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
#if PY_VERSION_HEX >= 0x030C0000
        if (member->type == Py_T_OBJECT_EX) offset = member->offset;
#else
        if (member->type == T_OBJECT_EX) offset = member->offset;
#endif
    }
    Py_DECREF(descriptor);
    if (offset < 0) PyErr_Format(PyExc_TypeError, "%s is not an object slot", name);
    return offset;
}

/* register_exchange(view_type, order_hook, allocate_hook, import_hook) -> capsule
 *
 * Make view_type's instances exchangeable through the table above and return the
 * "dlpack_exchange_api" capsule for its __dlpack_c_exchange_api__. view_type must have the
 * slots `owner` and `_versioned_payload` and the method `_pack_versioned` (BufferView). */
PyObject *jaxbuf_register_exchange(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyType_Check(args[0]) || !PyCallable_Check(args[1]) ||
        !PyCallable_Check(args[2]) || !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "register_exchange(view_type, order_hook, allocate_hook, import_hook)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[0];
    Py_ssize_t owner = slot_offset(type, "owner");
    Py_ssize_t payload = owner < 0 ? -1 : slot_offset(type, "_versioned_payload");
    if (payload < 0) return NULL;
    if (str_pack_versioned == NULL) {
        str_pack_versioned = PyUnicode_InternFromString("_pack_versioned");
        if (str_pack_versioned == NULL) return NULL;
    }
    if (api_capsule == NULL) {
        api_capsule = PyCapsule_New(&exchange_api, "dlpack_exchange_api", NULL);
        if (api_capsule == NULL) return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(view_type, type);
    owner_offset = owner;
    payload_offset = payload;
    Py_INCREF(args[1]);
    Py_XSETREF(order_hook, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(allocate_hook, args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(import_hook, args[3]);
    Py_INCREF(api_capsule);
    return api_capsule;
}

/* exchange_to(api, view, stream) -> object
 *
 * The consumer side: another framework's object over the view, built by that framework's
 * exchange API (`api`, its "dlpack_exchange_api" capsule) from the managed tensor
 * managed_tensor_from_py_object_no_sync would give. `stream` (a DLPack stream number, or
 * None on the host) is ordered after the owner's pending writes first. */
PyObject *jaxbuf_exchange_to(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "exchange_to(api, view, stream)");
        return NULL;
    }
    const JbExchangeAPI *api =
        (const JbExchangeAPI *)PyCapsule_GetPointer(args[0], "dlpack_exchange_api");
    if (api == NULL) return NULL;
    if (api->header.version.major != JAXBUF_DLPACK_MAJOR ||
        api->managed_tensor_to_py_object_no_sync == NULL) {
        PyErr_Format(PyExc_BufferError,
                     "the consumer's DLPack exchange API is version %u.%u without an importer",
                     api->header.version.major, api->header.version.minor);
        return NULL;
    }
    PyObject *view = args[1];
    JbManagedTensorVersioned *managed = managed_from_view(view);
    if (managed == NULL) return NULL;
    if (args[2] != Py_None && order_after_owner(view, args[2]) < 0) {
        managed->deleter(managed);
        return NULL;
    }
    /* dlpack.h gives the consumer the tensor even when it fails, but a consumer may fail
     * before it takes it (torch's importer throws on a dtype it lacks before it builds the
     * guard that calls the deleter). A consumer that deletes it on failure does so within
     * this call, on this thread, where the deleter reports it. */
    JbDeletionWatch outer = jaxbuf_watch_deletion((JbDeletionWatch){managed, 0});
    void *result = NULL;
    int status = api->managed_tensor_to_py_object_no_sync(managed, &result);
    JbDeletionWatch watch = jaxbuf_watch_deletion(outer);
    if (status != 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_BufferError, "the consumer refused the managed tensor");
        }
        if (!watch.deleted) managed->deleter(managed);
    }
    return status == 0 ? (PyObject *)result : NULL;
}

int jaxbuf_exchange_init(PyObject *module) {
    PyObject *address = PyLong_FromVoidPtr((void *)&exchange_api);
    if (address == NULL) return -1;
    if (PyModule_AddObject(module, "EXCHANGE_API_ADDRESS", address) < 0) {
        Py_DECREF(address);
        return -1;
    }
    return 0;
}
