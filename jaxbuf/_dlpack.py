"""DLPack structs and capsule builders, in ctypes (producer side only).

Layouts follow ``dlpack.h`` (v1.x). A capsule's payload is one ``malloc`` block holding the
managed tensor followed by its ``shape`` and ``strides`` arrays, so the deleter is libc
``free`` itself: it releases exactly what the capsule allocated, needs no GIL and never calls
into Python (JAX calls the deleter, possibly on another thread or at exit). The *memory* the
tensor points at is never freed by a deleter: it belongs to the producing buffer.

An unconsumed capsule is freed by the C destructor in ``_capsule.c``, which also holds the
capsule names as static strings (a name must outlive capsules alive at interpreter exit).

Capsules are built by packing the bytes with a precompiled ``struct.Struct`` and one
``memmove``: writing ctypes fields one by one costs several microseconds per capsule.
"""

from __future__ import annotations

import ctypes
import struct
from functools import lru_cache

from ._capsule import DESTRUCTOR_ADDRESS, LEGACY_NAME_ADDRESS, VERSIONED_NAME_ADDRESS

DLPACK_VERSION = (1, 0)
FLAG_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY



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
        ("manager_ctx", ctypes.c_void_p),  # unused by jaxbuf: NULL
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor *): libc free
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The 1.x managed tensor, named ``dltensor_versioned`` in a capsule."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),  # unused by jaxbuf: NULL
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned *): libc free
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
if _LEGACY_SIZE != ctypes.sizeof(DLManagedTensor) or _VERSIONED_SIZE != ctypes.sizeof(
    DLManagedTensorVersioned
):  # pragma: no cover - a platform with unexpected struct layout
    raise ImportError("DLPack struct layout differs from the packed format on this platform")

_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.argtypes = [ctypes.c_size_t]
_malloc.restype = ctypes.c_void_p
_free = _libc.free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None
FREE_ADDRESS: int = ctypes.cast(_free, ctypes.c_void_p).value  # the deleter of every capsule
_memmove = ctypes.memmove

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_capsule_new.restype = ctypes.py_object


@lru_cache(maxsize=64)
def _layout(versioned: bool, ndim: int) -> tuple[struct.Struct, int]:
    """The packer for a capsule payload of ``ndim`` dims and the offset of its shape array."""
    header = _VERSIONED_FORMAT if versioned else _LEGACY_FORMAT
    packer = struct.Struct(header + "q" * (2 * ndim))
    return packer, struct.calcsize(header)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def tensor_fields(
    data: int, device_type: int, device_id: int, dtype_code: int, dtype_bits: int, ndim: int
) -> tuple[int, ...]:
    """The address-independent leading fields of a ``DLTensor``, for :func:`new_capsule`."""
    return (data, device_type, device_id, ndim, dtype_code, dtype_bits, 1)


def new_capsule(
    head: tuple[int, ...], dims: tuple[int, ...], versioned: bool = False, flags: int = 0
):
    """Build a ``dltensor`` (or ``dltensor_versioned``) capsule.

    ``head`` comes from :func:`tensor_fields`; ``dims`` is the shape followed by the strides
    (in elements). The capsule owns one malloc block (struct + shape + strides): a consumer
    frees it through the deleter, an unconsumed capsule in its C destructor. The tensor's
    data is not owned. Views cache ``head`` and ``dims``: this is the per-export hot path.
    """
    packer, shape_offset = _layout(versioned, len(dims) // 2)
    address = _malloc(packer.size)
    if not address:
        raise MemoryError(f"malloc({packer.size}) failed for a DLPack capsule")
    shape_address = address + shape_offset
    try:
        if versioned:
            _memmove(address, packer.pack(*DLPACK_VERSION, 0, FREE_ADDRESS, flags, *head,
                     shape_address, shape_address + 4 * len(dims), 0, *dims), packer.size)
            return _capsule_new(address, VERSIONED_NAME_ADDRESS, DESTRUCTOR_ADDRESS)
        _memmove(address, packer.pack(*head, shape_address, shape_address + 4 * len(dims),
                 0, 0, FREE_ADDRESS, *dims), packer.size)  # fmt: skip
        return _capsule_new(address, LEGACY_NAME_ADDRESS, DESTRUCTOR_ADDRESS)
    except BaseException:
        _free(address)
        raise
