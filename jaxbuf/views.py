"""``BufferView``: a typed window on memory that jaxbuf owns, consumable through DLPack.

A view is a pointer, a size, a dtype, a shape, a device and the owner that keeps the memory
alive. It holds no memory itself: the owner (an ``ExtensibleTensor``, a ``UvaBuffer``, ...)
does, and every framework array made from a view aliases the owner's memory. Keep the owner
alive (and unfreed) while such arrays are in use; ``to_numpy`` and ``to_torch`` tie the owner's
lifetime to the array they return, JAX arrays cannot carry such a reference.

torch and JAX are imported on first use, inside the ``to_*`` methods.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _dlpack
from ._checks import as_int, as_shape
from .devices import Device
from .drivers.base import K_DL_CPU, K_DL_CUDA, K_DL_CUDA_HOST, K_DL_ROCM, K_DL_ROCM_HOST
from .dtypes import DType, canonical_dtype, uint8

_HOST_DEVICE_TYPES = (K_DL_CPU, K_DL_CUDA_HOST, K_DL_ROCM_HOST)
_STREAM_DEVICE_TYPES = (K_DL_CUDA, K_DL_CUDA_HOST, K_DL_ROCM, K_DL_ROCM_HOST)


class _NumpyHolder:
    """Carries ``__array_interface__`` and the owner, so a numpy array keeps the owner alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.__array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        self.owner = owner


class BufferView:
    """A dense, row-major view of ``nbytes`` bytes at ``ptr``.

    Invariants: ``prod(shape) * dtype.itemsize <= nbytes``; ``ptr`` is aligned to the
    itemsize. Views are immutable; :meth:`view` makes a new one.

    Thread-safety: a view may be exported from several threads at once.
    """

    __slots__ = ("ptr", "nbytes", "dtype", "shape", "device", "owner", "dlpack_device_type",
                 "_legacy_payload", "_versioned_payload")  # fmt: skip

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        dtype: Any = uint8,
        shape: Any = None,
        device: Device = Device("cpu"),
        owner: Any = None,
        dlpack_device_type: int = K_DL_CPU,
    ) -> None:
        ptr, nbytes = as_int(ptr, "ptr"), as_int(nbytes, "nbytes")
        for name, value in (("ptr", ptr), ("nbytes", nbytes)):
            if not 0 <= value < 1 << 64:
                raise ValueError(f"{name} must be in [0, 2**64), got {value!r}")
        dtype = canonical_dtype(dtype)
        shape = (nbytes // dtype.itemsize,) if shape is None else as_shape(shape)
        needed = math.prod(shape) * dtype.itemsize
        if needed > nbytes:
            raise ValueError(
                f"shape {shape} of {dtype} needs {needed} bytes but the view has {nbytes}"
            )
        if ptr % dtype.itemsize:
            raise ValueError(f"pointer {ptr:#x} is not aligned to {dtype} ({dtype.itemsize} bytes)")
        self.ptr = ptr
        self.nbytes = nbytes
        self.dtype: DType = dtype
        self.shape: tuple[int, ...] = shape
        self.device = device
        self.owner = owner
        self.dlpack_device_type = dlpack_device_type
        # A view is immutable, so its capsule payloads are packed once; an export is one C call.
        self._legacy_payload = self._pack(versioned=False)
        self._versioned_payload = None

    def __repr__(self) -> str:
        return (
            f"BufferView(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    # -- reinterpretation -------------------------------------------------------------
    def view(self, dtype: Any = None, shape: Any = None) -> BufferView:
        """The same bytes as another dtype and/or shape (a prefix when smaller).

        Raises ``TypeError`` for an unsupported dtype and ``ValueError`` for a shape that does
        not fit or a pointer misaligned for the dtype.
        """
        dtype = self.dtype if dtype is None else canonical_dtype(dtype)
        if shape is None and self.nbytes % dtype.itemsize:
            raise ValueError(f"{self.nbytes} bytes is not a whole number of {dtype} elements")
        return BufferView(self.ptr, self.nbytes, dtype, shape, self.device, self.owner,
                          self.dlpack_device_type)  # fmt: skip

    # -- DLPack -----------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.dlpack_device_type, self.device.index if self.device.is_cuda else 0)

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ):
        """Export as a DLPack capsule (array-API semantics).

        A versioned capsule is returned only when ``max_version`` asks for major version 1 or
        more; otherwise a legacy ``dltensor`` capsule (what JAX asks for). On CUDA, ``stream``
        is the consumer's stream: it is made to wait for the owner's pending writes; ``-1``
        means no synchronisation, ``None`` the legacy default stream (which jaxbuf's own work
        runs on). ``BufferError`` for what cannot be honoured: ``copy=True``, another device.
        """
        if copy:
            raise BufferError("jaxbuf views are zero-copy: copy=True is not supported")
        for name, value in (("max_version", max_version), ("dl_device", dl_device)):
            if value is not None and not (
                isinstance(value, tuple) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            ):
                raise TypeError(f"{name} must be None or a tuple of two ints, got {value!r}")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(
                f"cannot export to device {tuple(dl_device)}: the view lives on "
                f"{self.__dlpack_device__()}"
            )
        if stream is not None and stream != -1:
            if self.dlpack_device_type not in _STREAM_DEVICE_TYPES:
                raise BufferError(f"stream must be None for a CPU view, got {stream!r}")
            self._order_stream(stream)
        if max_version is not None and max_version[0] >= 1:
            if self._versioned_payload is None:
                self._versioned_payload = self._pack(versioned=True)
            return _dlpack.new_capsule(self._versioned_payload)
        return _dlpack.new_capsule(self._legacy_payload)

    def _order_stream(self, stream: int) -> None:
        """Make the consumer's ``stream`` wait for the owner's pending producer work."""
        event = getattr(self.owner, "_ready_event", None)
        if event is not None:
            self.owner._driver.stream_wait_event(stream, event, self.device.index)

    def _pack(self, versioned: bool) -> _dlpack.Payload:
        return _dlpack.pack_payload(
            self.ptr, self.dlpack_device_type, self.device.index if self.device.is_cuda else 0,
            self.dtype.dlpack_code, self.dtype.itemsize * 8, self.shape, versioned=versioned,
        )  # fmt: skip

    # -- framework adapters -------------------------------------------------------------
    def to_numpy(self) -> np.ndarray:
        """A numpy array over the same bytes (host memory only); it keeps the owner alive."""
        if self.dlpack_device_type not in _HOST_DEVICE_TYPES:
            raise BufferError(f"to_numpy needs host memory; this view is on {self.device}")
        raw = np.asarray(_NumpyHolder(self.ptr, self.nbytes, self.owner))
        count = math.prod(self.shape)
        return raw[: count * self.dtype.itemsize].view(self.dtype.numpy).reshape(self.shape)

    def to_torch(self, dtype: Any = None, shape: Any = None):
        """A torch tensor over the same bytes, zero-copy, on this view's device.

        The capsule goes straight to torch's C importer, skipping ``torch.from_dlpack``'s
        Python-level protocol handling; pending producer work is ordered before torch's
        current stream. The tensor keeps a reference to the owner.
        """
        import torch

        target = self if dtype is None and shape is None else self.view(dtype, shape)
        if target.dlpack_device_type not in (K_DL_CPU, K_DL_CUDA, K_DL_ROCM):
            raise BufferError(
                f"torch cannot import DLPack device type {target.dlpack_device_type}; "
                "use the device view of a pinned buffer"
            )
        if self.device.is_cuda and getattr(self.owner, "_ready_event", None) is not None:
            stream = torch.cuda.current_stream(self.device.index).cuda_stream
            # torch names the legacy default stream 0; DLPack reserves 0 and calls it 1.
            target._order_stream(stream or 1)
        tensor = torch._C._from_dlpack(_dlpack.new_capsule(target._legacy_payload))
        tensor._jaxbuf_owner = self.owner
        return tensor

    def to_jax(self, dtype: Any = None, shape: Any = None):
        """A JAX array over the same bytes, zero-copy (through ``jax.dlpack.from_dlpack``)."""
        import jax.dlpack

        target = self if dtype is None and shape is None else self.view(dtype, shape)
        return jax.dlpack.from_dlpack(target)
