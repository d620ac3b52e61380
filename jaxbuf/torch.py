"""The torch face: the seeds' names, handing out ``torch.Tensor`` wherever vLLM does.

Porting vLLM code is changing its import line::

    from jaxbuf.torch import ExtensibleTensor, UvaBufferPool, StagedWriteTensor

Every class here is the neutral class of :mod:`jaxbuf` (a subclass: ``isinstance`` checks,
:mod:`jaxbuf.sharing` and :mod:`jaxbuf.transfer` take it as they take the neutral one), with
the methods that return a :class:`~jaxbuf.BufferView` there returning a torch tensor over the
same memory here: the same pointer, device and dtype, zero-copy, converted at the boundary by
:meth:`BufferView.to_torch` (or the pools' ``framework="torch"``). Nothing else changes:
arguments (``torch.device`` objects, ints, strings; torch, numpy or string dtypes), errors,
lifetimes. A tensor keeps its memory alive, also after the owner's ``free()``.

=====================================  ============================================
seed name                              torch tensor where the seed has one
=====================================  ============================================
:class:`ExtensibleTensor`              ``full_view()``, ``segment_view(i)``
:func:`uint8_tensor_from_ptr`          its result
:class:`UvaBuffer`, :class:`NonUvaBuffer`  ``uva(n)``, ``cpu``
:class:`UvaBufferPool`                 ``copy_to_uva(x)``, ``copy_to_gpu(x, out)``
:class:`UvaBackedTensor`               ``gpu``, ``copy_to_uva(n)``, ``cpu``
:class:`StagedWriteTensor`             ``gpu``
:class:`ExtensibleKVCacheBuilder`      ``reserve(size, num_segments)``
:class:`ExtensibleKVCacheBuffers`      ``full_view(i)``, ``segment_views``, ``committed_views``,
                                       ``layer_views``
:class:`DeviceParamTable`              ``table[name].gpu``
=====================================  ============================================

:func:`granule_size` and :func:`is_uva_available` return no tensor: they are the neutral
ones; :class:`FusedStagedWriter` is the neutral one with the seed's ``device``. ``device``,
where the seed has one (:attr:`ExtensibleTensor.device`, :attr:`FusedStagedWriter.device`),
is the seed's ``torch.device`` (``torch.device("cuda", i)``, or ``torch.device("cpu")``).
The other classes' ``device`` is jaxbuf's :class:`~jaxbuf.Device` (``.torch()`` gives the
``torch.device``); ``jaxbuf.as_device(x.device)`` is a :class:`~jaxbuf.Device` for either,
which is how :mod:`jaxbuf.sharing`, :mod:`jaxbuf.transfer` and :mod:`jaxbuf.kv` read it.

A view taken before a grow keeps its size: take ``segment_view(i)`` again after
``resize_segments_``. Each call makes a new tensor (about a microsecond); a pool hands the
same tensor back for the same slot and length.

Importing this module needs torch installed (``ImportError`` naming the extra otherwise); it
imports torch then, not at the first tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxbuf import interop
from jaxbuf import views as _views
from jaxbuf.extensible import ExtensibleTensor as _ExtensibleTensor
from jaxbuf.extensible import granule_size
from jaxbuf.kv import DeviceParamTable as _DeviceParamTable
from jaxbuf.kv import ExtensibleKVCacheBuffers as _ExtensibleKVCacheBuffers
from jaxbuf.kv import ExtensibleKVCacheBuilder as _ExtensibleKVCacheBuilder
from jaxbuf.kv import ParamField
from jaxbuf.staged import FusedStagedWriter as _FusedStagedWriter
from jaxbuf.staged import StagedWriteTensor as _StagedWriteTensor
from jaxbuf.uva import NonUvaBuffer as _NonUvaBuffer
from jaxbuf.uva import UvaBackedTensor as _UvaBackedTensor
from jaxbuf.uva import UvaBuffer as _UvaBuffer
from jaxbuf.uva import UvaBufferPool as _UvaBufferPool
from jaxbuf.uva import is_uva_available

if TYPE_CHECKING:
    from jaxbuf.devices import Device

__all__ = [
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
    "granule_size",
    "is_uva_available",
    "uint8_tensor_from_ptr",
]

# ImportError naming the extra (pip install jaxbuf[torch]) now, rather than at the first
# tensor. Then torch itself, here and not at the first tensor: a Ctrl-C in the middle of
# torch's import (seconds) leaves it half-initialized for the process, which belongs to an
# import statement, not to a harmless-looking call.
interop.get("torch")
import torch  # noqa: E402


@functools.cache
def _torch_device(device: Device) -> torch.device:
    """``device`` as the seed's ``torch.device``, made once per device."""
    return device.torch()


class ExtensibleTensor(_ExtensibleTensor):
    """:class:`jaxbuf.ExtensibleTensor` whose views are torch uint8 tensors.

    The neutral views behind them are kept (as templates that refer to no handle) while
    their bytes stay the same, so a repeated ``segment_view(i)`` costs one import; a handle
    dropped without :meth:`free` still goes at once.
    """

    _reuse_views = True

    def full_view(self) -> torch.Tensor:
        """Uint8 tensor spanning every segment (only committed prefixes may be touched)."""
        return super().full_view().to_torch()

    def segment_view(self, index: int) -> torch.Tensor:
        """Uint8 tensor over one segment's committed prefix, sized exactly to it."""
        return super().segment_view(index).to_torch()

    @property
    def device(self) -> torch.device:
        """The seed's ``torch.device("cuda", i)``, or ``torch.device("cpu")``."""
        return _torch_device(super().device)


class FusedStagedWriter(_FusedStagedWriter):
    """:class:`jaxbuf.FusedStagedWriter` whose ``device`` is a ``torch.device``, as in the
    seed."""

    @property
    def device(self) -> torch.device:
        return _torch_device(super().device)


def uint8_tensor_from_ptr(ptr: int, num_bytes: int, device_index: Any) -> torch.Tensor:
    """Wrap memory at ``ptr`` as a uint8 tensor; the caller keeps it mapped
    (see :func:`jaxbuf.uint8_tensor_from_ptr`)."""
    return _views.uint8_tensor_from_ptr(ptr, num_bytes, device_index).to_torch()


class UvaBuffer(_UvaBuffer):
    """:class:`jaxbuf.UvaBuffer` whose device view is a torch tensor (``cpu`` is the host
    side as a torch CPU tensor, ``np`` as numpy, as in the seed)."""

    def uva(self, n: int | None = None) -> torch.Tensor:
        """The device tensor of the first ``n`` rows (all when None): no copy, no sync."""
        return super().uva(n).to_torch()


class NonUvaBuffer(_NonUvaBuffer):
    """:class:`jaxbuf.NonUvaBuffer` whose device copy is a torch tensor."""

    def uva(self, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (all when None) to the device; return their tensor."""
        return super().uva(n).to_torch()


class UvaBufferPool(_UvaBufferPool):
    """:class:`jaxbuf.UvaBufferPool` handing out torch tensors (``framework="torch"``)."""

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: Any,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        framework: str = "torch",
        **options: Any,
    ) -> None:
        super().__init__(size, dtype, max_concurrency, device, framework=framework, **options)


class UvaBackedTensor(_UvaBackedTensor):
    """:class:`jaxbuf.UvaBackedTensor` whose ``gpu`` is a torch tensor."""

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: Any,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        framework: str = "torch",
        **options: Any,
    ) -> None:
        super().__init__(size, dtype, max_concurrency, device, framework=framework, **options)


class StagedWriteTensor(_StagedWriteTensor):
    """:class:`jaxbuf.StagedWriteTensor` whose ``gpu`` is a torch tensor over the target.

    Each access exports the target afresh (about a microsecond), ordered after the applied
    writes on torch's current stream, as :meth:`jaxbuf.BufferView.to_torch` is."""

    __slots__ = ()

    @property
    def gpu(self) -> torch.Tensor:
        """The target as a torch tensor (shape ``size``, dtype ``dtype``)."""
        return super().gpu.to_torch()

    def to_torch(self) -> torch.Tensor:
        return super().gpu.to_torch()

    def to_jax(self) -> Any:
        return super().gpu.to_jax()

    def to_numpy(self) -> Any:
        return super().gpu.to_numpy()


class ExtensibleKVCacheBuffers(_ExtensibleKVCacheBuffers):
    """:class:`jaxbuf.ExtensibleKVCacheBuffers` whose views are torch tensors."""

    def full_view(self, index: int) -> torch.Tensor:
        return super().full_view(index).to_torch()

    def segment_views(
        self,
        index: int,
        num_blocks: int | None = None,
        dtype: Any = None,
        block_shape: Any = None,
    ) -> list[torch.Tensor]:
        views = super().segment_views(index, num_blocks, dtype, block_shape)
        return [view.to_torch() for view in views]


class ExtensibleKVCacheBuilder(_ExtensibleKVCacheBuilder):
    """:class:`jaxbuf.ExtensibleKVCacheBuilder` whose ``reserve`` returns a torch uint8
    tensor and whose ``finish`` returns this face's :class:`ExtensibleKVCacheBuffers`."""

    buffers_type = ExtensibleKVCacheBuffers

    def __init__(
        self,
        num_blocks_capacity: int,
        device: Any = None,
        shareable: bool | str = False,
        *,
        framework: str = "torch",
        **options: Any,
    ) -> None:
        super().__init__(num_blocks_capacity, device, shareable, framework=framework, **options)


class DeviceParamTable(_DeviceParamTable):
    """:class:`jaxbuf.DeviceParamTable` whose fields' ``gpu`` are torch tensors (the same
    tensor every time: it aliases the fixed device table, which ``sync`` updates)."""

    def __getitem__(self, name: str) -> ParamField:
        field = super().__getitem__(name)
        gpu = self.arrays("torch")[name]
        return ParamField(field.name, field.dtype, field.offset, field.np, gpu)

    @property
    def fields(self) -> dict[str, ParamField]:
        return {name: self[name] for name in self}
