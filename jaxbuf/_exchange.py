"""DLPack's C exchange API for :class:`~jaxbuf.views.BufferView`: the Python side of
``jaxbuf/_exchange.c``.

``BufferView.__dlpack_c_exchange_api__`` is a capsule named ``"dlpack_exchange_api"`` over a
static ``DLPackExchangeAPI`` (dlpack.h 1.3), implemented in C: torch, tvm-ffi and the kernel
libraries built on it exchange a view in one C call instead of ``__dlpack__`` plus a capsule.
The managed tensor it hands out is the one ``view.__dlpack__(max_version=(1, 3))`` would put
in a capsule (same payload, flags, anchor and ordering). This module holds the three things
the C asks Python for: ordering a stream after the owner's pending writes (the views' own
rule), allocating a tensor a consumer asks for (``managed_tensor_allocator``), and importing
a consumer's managed tensor as a view (``managed_tensor_to_py_object_no_sync``).

The consumer side, another framework's tensor over a view built by that framework's exchange
API (``to_torch`` uses torch's), is :func:`jaxbuf._dlpack.exchange_to`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _capsule
from ._capsule import ExportAnchor
from .devices import Device
from .drivers.base import K_DL_CPU, K_DL_CUDA
from .dtypes import SUPPORTED_DTYPES, canonical_dtype

__all__ = ["register"]

#: Host allocations a consumer asks for are aligned like JAX's (and cache lines and AVX-512).
_HOST_ALIGNMENT = 64

# (dlpack code, bits) -> jaxbuf dtype, for importing a consumer's tensor.
_BY_DLPACK = {
    (dtype.dlpack_code, dtype.itemsize * 8): dtype
    for dtype in map(canonical_dtype, SUPPORTED_DTYPES)
}

# The view type register() made exchangeable: what an import builds.
_view_type: list[type] = []


class _Exchanged:
    """The owner of a view over a consumer's managed tensor (the owner contract of
    :mod:`jaxbuf._owner`): its anchor holds the tensor's capsule, whose destructor calls the
    consumer's deleter once the view and every export of it are gone. Never freed by jaxbuf:
    the memory is the consumer's."""

    __slots__ = ("device", "read_only", "export_anchor", "_driver")

    def __init__(self, capsule: Any, device: Device, read_only: bool) -> None:
        self.device = device
        self.read_only = read_only
        self.export_anchor = ExportAnchor(capsule)
        self._driver: Any = None

    @property
    def driver(self) -> Any:
        if self._driver is None:
            from .drivers import get_vmm_driver

            self._driver = get_vmm_driver(self.device)
        return self._driver

    @property
    def ready_event(self) -> None:
        return None  # the consumer orders its own work (the tensor came without a sync)

    def check_exportable(self) -> None:
        return None


def _device_of(device_type: int, device_id: int) -> Device:
    if device_type == K_DL_CPU:
        return Device("cpu", 0)
    if device_type == K_DL_CUDA:
        return Device("cuda", device_id)
    raise BufferError(f"jaxbuf views hold CPU or CUDA memory, not DLPack device type {device_type}")


def import_view(
    capsule: Any,
    ptr: int,
    device_type: int,
    device_id: int,
    code: int,
    bits: int,
    lanes: int,
    shape: tuple[int, ...],
    read_only: bool,
) -> Any:
    """A :class:`BufferView` over the consumer's managed tensor in ``capsule`` (unconsumed,
    named ``dltensor_versioned``), described by the other arguments (read in C; the C has
    refused strided layouts and other major versions): a jaxbuf dtype on the CPU or a CUDA
    device, else ``BufferError``. The view's owner keeps the capsule, so the tensor, alive;
    dropping the capsule on a failure deletes the tensor."""
    device = _device_of(device_type, device_id)
    dtype = _BY_DLPACK.get((code, bits))
    if dtype is None or lanes != 1:
        raise BufferError(f"no jaxbuf dtype for DLPack code {code}, {bits} bits, {lanes} lanes")
    nbytes = math.prod(shape) * dtype.itemsize
    owner = _Exchanged(capsule, device, read_only)
    return _view_type[0](ptr if nbytes else 0, nbytes, dtype, shape, device, owner, device_type)


def allocate(device_type: int, device_id: int, nbytes: int) -> tuple[int, Any]:
    """``nbytes`` of fresh memory for a consumer's ``managed_tensor_allocator`` call, as
    ``(ptr, keeper)``: the memory lives while ``keeper`` does (the tensor's anchor holds it).
    Host memory, 64-byte aligned, or a driver allocation on a CUDA device."""
    if nbytes == 0:
        return 0, None
    if device_type == K_DL_CPU:
        block = np.empty(nbytes + _HOST_ALIGNMENT, np.uint8)
        ptr = block.ctypes.data
        return ptr + (-ptr % _HOST_ALIGNMENT), block
    if device_type == K_DL_CUDA:
        from .drivers import get_vmm_driver

        memory = get_vmm_driver(Device("cuda", device_id)).device_alloc(nbytes, device_id)
        return memory.ptr, memory
    raise BufferError(
        f"jaxbuf allocates on the CPU or a CUDA device, not DLPack type {device_type}"
    )


def register(view_type: type, order_after_owner: Any) -> Any:
    """Make ``view_type`` (BufferView) exchangeable; returns the ``"dlpack_exchange_api"``
    capsule for its ``__dlpack_c_exchange_api__``. ``order_after_owner(view, stream)`` makes
    a DLPack stream wait for the view's owner's pending writes."""
    _view_type[:] = [view_type]
    return _capsule.register_exchange(view_type, order_after_owner, allocate, import_view)
