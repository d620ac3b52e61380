"""jaxbuf: device memory that JAX and torch share, zero-copy.

Growable buffers on virtual memory (:class:`ExtensibleTensor`), pinned host memory the device
reads in place (:class:`UvaBuffer`, :class:`UvaBufferPool`) and batched row writes applied by
one kernel launch (:class:`StagedWriteTensor`, :class:`FusedStagedWriter`). ``import jaxbuf``
needs only numpy; torch, JAX, Triton and cuda-bindings are imported when first used, torch and
JAX only by their adapters in :mod:`jaxbuf.interop`.
"""

from . import interop  # the framework adapters: jaxbuf.interop.register adds a framework
from ._errors import ByteOrderError, ClosedError
from .devices import Device, DeviceLike, as_device, default_device
from .dtypes import DType, DTypeLike, canonical_dtype
from .extensible import ExtensibleTensor, granule_size
from .kv import DeviceParamTable, ExtensibleKVCacheBuffers, ExtensibleKVCacheBuilder
from .staged import FusedStagedWriter, StagedWriteTensor
from .uva import (
    NonUvaBuffer,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    async_copy_to_device,
    is_uva_available,
    uva_unavailable_reason,
)
from .views import BufferView, uint8_tensor_from_ptr

# The one source of the version: pyproject.toml reads this literal ([tool.setuptools.dynamic]).
__version__ = "0.1.0"

__all__ = [
    "BufferView",
    "ByteOrderError",
    "ClosedError",
    "Device",
    "DeviceLike",
    "DType",
    "DTypeLike",
    "DeviceParamTable",
    "ExtensibleKVCacheBuffers",
    "ExtensibleKVCacheBuilder",
    "ExtensibleTensor",
    "FusedStagedWriter",
    "NonUvaBuffer",
    "StagedWriteTensor",
    "UvaBackedTensor",
    "UvaBuffer",
    "UvaBufferPool",
    "async_copy_to_device",
    "is_uva_available",
    "uva_unavailable_reason",
    "as_device",
    "canonical_dtype",
    "default_device",
    "granule_size",
    "interop",
    "uint8_tensor_from_ptr",
]
