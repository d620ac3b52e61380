/* What jaxbuf/_capsule.c shares with jaxbuf/_exchange.c, the two sources of jaxbuf._capsule:
 * the export anchors, the managed-tensor builder and deleter, and the DLPack structs the
 * exchange API reads and writes.
 *
 * The structs follow dlpack.h of DLPack 1.3 (https://github.com/dmlc/dlpack, Apache-2.0),
 * written out here with only the members jaxbuf uses; _capsule.c's byte offsets and
 * _dlpack.py's struct formats describe the same layouts (asserted below and at import).
 */
#ifndef JAXBUF_CAPSULE_H
#define JAXBUF_CAPSULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#if PY_VERSION_HEX >= 0x030D0000
#define JAXBUF_IS_FINALIZING() Py_IsFinalizing()
#else
#define JAXBUF_IS_FINALIZING() _Py_IsFinalizing()
#endif

#if defined(__GNUC__)
#define JAXBUF_INTERNAL __attribute__((visibility("hidden")))
#else
#define JAXBUF_INTERNAL
#endif

/* ---- dlpack.h (1.3) --------------------------------------------------------------------- */

#define JAXBUF_DLPACK_MAJOR 1
#define JAXBUF_DLPACK_MINOR 3
#define JAXBUF_DLPACK_FLAG_READ_ONLY 1ULL

enum { JAXBUF_KDL_CPU = 1, JAXBUF_KDL_CUDA = 2, JAXBUF_KDL_CUDA_HOST = 3,
       JAXBUF_KDL_ROCM = 10, JAXBUF_KDL_ROCM_HOST = 11 };

typedef struct {
    int32_t device_type;
    int32_t device_id;
} JbDLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} JbDLDataType;

typedef struct {
    void *data;
    JbDLDevice device;
    int32_t ndim;
    JbDLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* never NULL from jaxbuf when ndim > 0 (DLPack 1.2 forbids it) */
    uint64_t byte_offset;
} JbDLTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} JbDLPackVersion;

typedef struct JbManagedTensorVersioned {
    JbDLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct JbManagedTensorVersioned *self);
    uint64_t flags;
    JbDLTensor dl_tensor;
} JbManagedTensorVersioned;

typedef void (*JbSetError)(void *error_ctx, const char *kind, const char *message);

typedef struct JbExchangeAPIHeader {
    JbDLPackVersion version;
    struct JbExchangeAPIHeader *prev_api;
} JbExchangeAPIHeader;

typedef struct {
    JbExchangeAPIHeader header;
    int (*managed_tensor_allocator)(JbDLTensor *prototype, JbManagedTensorVersioned **out,
                                    void *error_ctx, JbSetError set_error);
    int (*managed_tensor_from_py_object_no_sync)(void *py_object,
                                                 JbManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(JbManagedTensorVersioned *tensor,
                                               void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, JbDLTensor *out);
    int (*current_work_stream)(int device_type, int32_t device_id, void **out_stream);
} JbExchangeAPI;

_Static_assert(sizeof(JbDLTensor) == 48, "DLTensor layout");
_Static_assert(offsetof(JbManagedTensorVersioned, manager_ctx) == 8, "manager_ctx offset");
_Static_assert(offsetof(JbManagedTensorVersioned, deleter) == 16, "deleter offset");
_Static_assert(offsetof(JbManagedTensorVersioned, dl_tensor) == 32, "dl_tensor offset");
_Static_assert(sizeof(JbManagedTensorVersioned) == 80, "DLManagedTensorVersioned size");

/* ---- _capsule.c ------------------------------------------------------------------------- */

/* anchor_for(owner): a new reference to the ExportAnchor an export of owner's memory holds,
 * None (new reference) for owner None, NULL with an exception for a freed owner. */
JAXBUF_INTERNAL PyObject *jaxbuf_anchor_for(PyObject *owner);

/* anchor_of(target): the anchor shared by the live exports of target (new reference). */
JAXBUF_INTERNAL PyObject *jaxbuf_anchor_of(PyObject *target);

/* One malloc block holding a managed tensor copied from a packed payload (see new_capsule),
 * its shape and strides pointed at the arrays after the header, manager_ctx set to anchor
 * (NULL: none) and the deleter set to the layout's. Counts one live export on the anchor and
 * takes a reference to it. NULL with an exception (a closed anchor: ClosedError). */
JAXBUF_INTERNAL char *jaxbuf_managed_block(const char *payload, Py_ssize_t size,
                                           Py_ssize_t tensor_offset, Py_ssize_t shape_offset,
                                           int versioned, PyObject *anchor);

/* Whether anchor is an ExportAnchor that close() has refused new exports on. */
JAXBUF_INTERNAL int jaxbuf_anchor_closed(PyObject *anchor);

/* Raise ClosedError for an export over a closed anchor. */
JAXBUF_INTERNAL void jaxbuf_raise_closed(PyObject *anchor);

/* The deleter of every versioned managed tensor jaxbuf makes: frees the block, then drops
 * the anchor with the GIL (any thread; never once the process is exiting). */
JAXBUF_INTERNAL void jaxbuf_versioned_deleter(void *managed);

/* A block the versioned deleter reports on, on this thread: `deleted` is set once it frees it.
 * jaxbuf_watch_deletion installs a watch and returns the one it replaces (restored after, so
 * nested watches on one thread keep theirs). */
typedef struct {
    void *block;
    int deleted;
} JbDeletionWatch;
JAXBUF_INTERNAL JbDeletionWatch jaxbuf_watch_deletion(JbDeletionWatch watch);

/* The destructor of a "dltensor[_versioned]" capsule: calls the deleter of an unconsumed one. */
JAXBUF_INTERNAL void jaxbuf_dltensor_capsule_destructor(PyObject *capsule);

/* ---- _exchange.c ------------------------------------------------------------------------ */

/* The exchange API's module functions (see _exchange.c). */
JAXBUF_INTERNAL PyObject *jaxbuf_register_exchange(PyObject *module, PyObject *const *args,
                                                   Py_ssize_t nargs);
JAXBUF_INTERNAL PyObject *jaxbuf_exchange_to(PyObject *module, PyObject *const *args,
                                             Py_ssize_t nargs);

/* Adds the exchange API's addresses to the module. 0 or -1 with an exception. */
JAXBUF_INTERNAL int jaxbuf_exchange_init(PyObject *module);

#endif
