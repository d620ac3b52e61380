"""DLPack structs and capsule builders, in ctypes, and the C exchange API's consumer side.

Layouts follow ``dlpack.h`` (v1.x). A capsule's payload is one ``malloc`` block holding the
managed tensor followed by its ``shape`` and ``strides`` arrays. Its ``manager_ctx`` holds an
:class:`ExportAnchor` (a C object: a strong reference to the allocation plus a count of live
exports) or NULL for a view over foreign memory; its deleter, in C (``_capsule.c``), frees the
block, then takes the GIL and drops the anchor. Once the process exits (an ``atexit`` handler
that ``_capsule`` registers at import, which runs before finalization starts) a deleter only
frees the block and leaks the anchor: JAX calls deleters from its own threads, and one that
took the GIL during finalization would be ended there and abort the process. The memory the
tensor points at is never freed by a deleter directly: it belongs to the allocation, released
when the anchor drops it.

An unconsumed capsule is freed by the C destructor in ``_capsule.c``, which also holds the
capsule names as static strings (a name must outlive capsules alive at interpreter exit).

A view packs its payload once (``pack_payload``, a ``struct`` format checked against the ctypes
layouts); each export is then one C call, ``_capsule.new_capsule``, which copies the payload
into a malloc block, points the shape/strides fields at it, sets ``manager_ctx`` and the
deleter, and wraps it in a capsule. Writing ctypes fields one by one, as the seed does, costs
several microseconds per capsule.

The same managed tensor also goes out without a capsule, through DLPack's C exchange API
(``BufferView.__dlpack_c_exchange_api__``, ``_exchange.c``); :func:`exchange_to` hands it to
another framework's exchange API (``to_torch`` to torch's) in one C call.
"""

from __future__ import annotations

import ctypes
import struct
from functools import lru_cache

from . import _capsule
from ._capsule import ExportAnchor

__all__ = [
    "DLPACK_VERSION",
    "ExportAnchor",
    "anchor_for",
    "exchange_api_of",
    "exchange_to",
    "new_capsule",
    "pack_payload",
]

#: DLManagedTensorVersioned.version: the dlpack.h the tensors follow (1.3, as the exchange
#: table in _capsule.h says), as torch stamps its own. dlpack.h keeps the ABI within a major
#: version, so a consumer that asked for max_version=(1, 0) accepts any 1.x.
DLPACK_VERSION = (1, 3)
FLAG_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_IS_COPIED = 2  # DLPACK_FLAG_BITMASK_IS_COPIED: the producer copied for this export


class DLDevice(ctypes.Structure):
    _fields_ = [
        ("device_type", ctypes.c_int32),  # DLDeviceType: kDLCPU = 1, kDLCUDA = 2, ...
        ("device_id", ctypes.c_int32),  # device ordinal; 0 for the CPU
    ]


class DLDataType(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),  # DLDataTypeCode: kDLInt = 0, kDLUInt, kDLFloat, ...
        ("bits", ctypes.c_uint8),  # bits per lane
        ("lanes", ctypes.c_uint16),  # 1 for scalars
    ]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),  # pointer to the first element (plus byte_offset)
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),  # ndim extents
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # ndim strides, in elements
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """The legacy (pre-1.0) managed tensor, named ``dltensor`` in a capsule."""

    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),  # the ExportAnchor (a PyObject *), or NULL
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor *): LEGACY_DELETER_ADDRESS
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The 1.x managed tensor, named ``dltensor_versioned`` in a capsule."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),  # the ExportAnchor (a PyObject *), or NULL
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned *): see below
        ("flags", ctypes.c_uint64),  # DLPACK_FLAG_BITMASK_*
        ("dl_tensor", DLTensor),
    ]


# The same layouts as struct formats (little-endian, no implicit padding): asserted equal to
# the ctypes sizes below so the two descriptions cannot drift apart.
_DLTENSOR_FORMAT = "QiiiBBHQQQ"
_LEGACY_FORMAT = "<" + _DLTENSOR_FORMAT + "QQ"
_VERSIONED_FORMAT = "<IIQQQ" + _DLTENSOR_FORMAT
_LEGACY_SIZE = struct.calcsize(_LEGACY_FORMAT)
_VERSIONED_SIZE = struct.calcsize(_VERSIONED_FORMAT)
_CTYPES_SIZES = (ctypes.sizeof(DLManagedTensor), ctypes.sizeof(DLManagedTensorVersioned))
if _CTYPES_SIZES != (_LEGACY_SIZE, _VERSIONED_SIZE):  # pragma: no cover - unexpected layout
    raise ImportError("DLPack struct layout differs from the packed format on this platform")

# Every capsule's deleter, by layout (set by new_capsule, not packed).
LEGACY_DELETER_ADDRESS: int = _capsule.LEGACY_DELETER_ADDRESS
VERSIONED_DELETER_ADDRESS: int = _capsule.VERSIONED_DELETER_ADDRESS
# libc free: a valid deleter for an anchor-less block (the benchmark's seed-style capsule).
FREE_ADDRESS: int = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value
_LEGACY_TENSOR_OFFSET = 0
_VERSIONED_TENSOR_OFFSET = ctypes.sizeof(DLManagedTensorVersioned) - ctypes.sizeof(DLTensor)


@lru_cache(maxsize=64)
def _packer(versioned: bool, ndim: int) -> struct.Struct:
    header = _VERSIONED_FORMAT if versioned else _LEGACY_FORMAT
    return struct.Struct(header + "q" * (2 * ndim))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


Payload = tuple  # (bytes, tensor_offset, shape_offset, versioned): new_capsule's arguments


def pack_payload(
    data: int,
    device_type: int,
    device_id: int,
    dtype_code: int,
    dtype_bits: int,
    shape: tuple[int, ...],
    *,
    versioned: bool = False,
    read_only: bool = False,
    is_copied: bool = False,
) -> Payload:
    """Pack a managed tensor over ``data`` with row-major strides, ready for :func:`new_capsule`.

    A tensor with no elements gets a NULL ``data`` pointer (dlpack.h asks for it, and no
    consumer may read there). The shape/strides pointers, ``manager_ctx`` and the deleter are
    left NULL: :func:`new_capsule` sets them. ``read_only`` and ``is_copied`` are flags of the
    versioned layout only (the legacy one has no flags).
    """
    ndim = len(shape)
    if 0 in shape:
        data = 0
    tensor = (data, device_type, device_id, ndim, dtype_code, dtype_bits, 1, 0, 0, 0)
    dims = (*shape, *contiguous_strides(shape))
    packer = _packer(versioned, ndim)
    if versioned:
        flags = (FLAG_READ_ONLY if read_only else 0) | (FLAG_IS_COPIED if is_copied else 0)
        payload = packer.pack(*DLPACK_VERSION, 0, 0, flags, *tensor, *dims)
        return payload, _VERSIONED_TENSOR_OFFSET, _VERSIONED_SIZE, True
    payload = packer.pack(*tensor, 0, 0, *dims)
    return payload, _LEGACY_TENSOR_OFFSET, _LEGACY_SIZE, False


def new_capsule(payload: Payload, anchor: ExportAnchor | None = None):
    """A fresh ``dltensor`` (or ``dltensor_versioned``) capsule from a packed payload.

    The capsule owns one malloc block (struct + shape + strides) and, when ``anchor`` is given,
    one reference to it (counted in ``anchor.live_exports``): a consumer releases both through
    the deleter, an unconsumed capsule in its C destructor. ``anchor=None`` (a view over
    foreign memory) keeps nothing alive.
    """
    return _capsule.new_capsule(*payload, anchor)


# anchor_for(owner) -> ExportAnchor | None, in C (it runs on every export): the anchor an
# export of ``owner``'s memory must hold, after ``owner.check_exportable()`` (which raises once
# the owner is freed). None for ``owner=None`` (foreign memory). An owner following the owner
# contract (``jaxbuf._owner``) returns its one ``ExportAnchor`` from ``export_anchor``; anything
# else (an object to keep alive, or an owner without the property, kept alive itself) gets the
# anchor ``_capsule.anchor_of`` shares among the live exports of that object, made and dropped
# with them.
anchor_for = _capsule.anchor_for


# -- DLPack's C exchange API (dlpack.h 1.3), the consumer side ---------------------------------

EXCHANGE_API_NAME = b"dlpack_exchange_api"

_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_is_valid.restype = ctypes.c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_pointer.restype = ctypes.c_void_p


def exchange_api_of(cls: type):
    """``cls.__dlpack_c_exchange_api__`` when it is a DLPack 1.x exchange API capsule, else
    None (a framework too old to offer one). Looked up on the type, as dlpack.h asks."""
    api = getattr(cls, "__dlpack_c_exchange_api__", None)
    if api is None or not _capsule_is_valid(api, EXCHANGE_API_NAME):
        return None
    major = ctypes.c_uint32.from_address(_capsule_pointer(api, EXCHANGE_API_NAME)).value
    return api if major == 1 else None


# exchange_to(api, view, stream), in C (jaxbuf/_exchange.c): another framework's object over a
# BufferView, built by that framework's exchange API ``api`` (its "dlpack_exchange_api"
# capsule) from the managed tensor the view's own exchange API gives; ``stream`` (a DLPack
# stream number, None on the host) is first ordered after the owner's pending writes.
exchange_to = _capsule.exchange_to
