"""The JAX face: the seeds' names, handing out ``jax.Array`` where vLLM hands out tensors.

::

    from jaxbuf.jax import ExtensibleTensor, UvaBufferPool, StagedWriteTensor

Every class here is the neutral class of :mod:`jaxbuf` (a subclass), with the methods that
return a :class:`~jaxbuf.BufferView` there returning a ``jax.Array`` over the same memory
here, zero-copy, converted at the boundary by :meth:`BufferView.to_jax` (or the pools'
``framework="jax"``). Arguments take JAX dtypes (``jnp.int32``) and devices
(``jax.devices()[0]``) as well as strings and numpy dtypes. The names that hand out arrays
are those of :mod:`jaxbuf.torch`; the host side of a buffer is ``np`` (numpy over the same
memory, writable): ``cpu``, the seed's torch CPU tensor, has no JAX counterpart, since a JAX
array cannot be written in place, and raises ``AttributeError`` naming ``np``.

``device``, where the seed has one (:attr:`ExtensibleTensor.device`,
:attr:`FusedStagedWriter.device`), is the ``jax.Device`` of that memory (``jax.devices()[i]``
on a GPU, the CPU device on the host; ``ValueError`` when this JAX has no such device, as
taking an array there would raise). The other classes' ``device`` is jaxbuf's
:class:`~jaxbuf.Device` (``.jax()`` gives the ``jax.Device``); ``jaxbuf.as_device(x.device)``
is a :class:`~jaxbuf.Device` for either, which is how the layers below read it.

Aliasing contract
-----------------
JAX treats an array as an immutable value; an array from this face is a window on memory
that jaxbuf (and the host, and torch) may change. What it shows:

* **Taken after a change, it shows the change.** An array taken (``segment_view(i)``,
  ``gpu``, ``copy_to_uva(x)``, ...) after a write has completed reads the written bytes:
  jaxbuf's own producer work (a zeroing grow, ``apply_write``) is ordered before the
  array's consumer stream at import; a write by the host (``np``) or by torch must be
  finished before the array is taken (on a GPU: synchronize torch's stream first; jaxbuf
  cannot order JAX after torch's stream).
* **Taken before a change, only computations see the change.** A computation dispatched
  after the write has completed (a ``jax.jit`` step, any device op) reads the memory when it
  runs, so it reads the written bytes: that is how an array imported once serves every step
  (``UvaBuffer.jax_device_array``). A computation dispatched before the write may read
  either. The array's *host value* (``np.asarray``, printing,
  ``.tolist()``) may be a copy JAX made at an earlier read (on a GPU it is cached): read
  values on the host from an array taken after the write. A pool slot is written again
  ``max_concurrency`` calls later, which is why the pools import afresh on every call.
* **A grow changes no array's shape or bytes.** ``resize_segments_`` never moves memory or
  changes committed bytes, so an array taken before keeps its shape (the committed prefix
  then) and its values; the grown bytes are seen by a segment view taken after the grow.
  ``full_view()`` spans the whole reservation, but only committed bytes may be touched.
* **A parameter table hands out values, not windows.** ``DeviceParamTable``'s
  ``table[name].gpu`` and ``arrays("jax")`` are JAX arrays of the last ``sync``'s values,
  JAX's own and immutable: a step in flight keeps the values it was dispatched with, and
  the next access after a changed sync returns new arrays.
* **A release invalidates everything.** After ``release_physical()`` no array taken before
  may be read or written; ``free()`` leaves arrays valid (they keep the memory alive).
* **Never donate** an array of this face to a ``jax.jit`` step (``donate_argnums``): JAX
  would write its result into jaxbuf's memory and let go of the array early. For steps
  that update a KV cache in place use :class:`jaxbuf.kv.KVCacheStep`; for row writes from
  inside ``jit`` use :mod:`jaxbuf.jax_ops`.

Importing this module needs JAX installed (``ImportError`` naming the extra otherwise); it
imports JAX then, not at the first array.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

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

# ImportError naming the extra (pip install jaxbuf[jax]) now, rather than at the first array.
# Then JAX itself, here and not at the first array: a Ctrl-C in the middle of JAX's import
# (seconds) leaves it half-initialized for the process, which belongs to an import
# statement, not to a harmless-looking call.
interop.get("jax")
import jax  # noqa: E402


@functools.cache
def _jax_device(device: Device) -> jax.Device:
    """``device`` as the ``jax.Device`` with its local index, found once per device
    (ValueError, not cached, when JAX has none)."""
    return device.jax()


def _no_cpu(owner: object) -> NoReturn:
    raise AttributeError(
        f"{type(owner).__name__} of jaxbuf.jax has no cpu: JAX arrays cannot be written in "
        "place. Write the host side through .np (numpy over the same memory), then take a "
        "fresh device array"
    )


class ExtensibleTensor(_ExtensibleTensor):
    """:class:`jaxbuf.ExtensibleTensor` whose views are JAX uint8 arrays.

    The neutral views behind them are kept (as templates that refer to no handle) while
    their bytes stay the same, so a repeated ``segment_view(i)`` costs one import; a handle
    dropped without :meth:`free` still goes at once.
    """

    _reuse_views = True

    def full_view(self) -> jax.Array:
        """Uint8 array spanning every segment (only committed prefixes may be touched)."""
        return super().full_view().to_jax()

    def segment_view(self, index: int) -> jax.Array:
        """Uint8 array over one segment's committed prefix, sized exactly to it."""
        return super().segment_view(index).to_jax()

    @property
    def device(self) -> jax.Device:
        """The ``jax.Device`` of this memory (the seed's ``device``, in JAX's type)."""
        return _jax_device(super().device)


class FusedStagedWriter(_FusedStagedWriter):
    """:class:`jaxbuf.FusedStagedWriter` whose ``device`` is a ``jax.Device``."""

    @property
    def device(self) -> jax.Device:
        return _jax_device(super().device)


def uint8_tensor_from_ptr(ptr: int, num_bytes: int, device_index: Any) -> jax.Array:
    """Wrap memory at ``ptr`` as a uint8 array; the caller keeps it mapped
    (see :func:`jaxbuf.uint8_tensor_from_ptr`)."""
    return _views.uint8_tensor_from_ptr(ptr, num_bytes, device_index).to_jax()


class UvaBuffer(_UvaBuffer):
    """:class:`jaxbuf.UvaBuffer` whose device view is a JAX array, imported afresh per call."""

    def uva(self, n: int | None = None) -> jax.Array:
        """The device array of the first ``n`` rows (all when None): no copy."""
        return super().uva(n).to_jax()

    @property
    def cpu(self) -> NoReturn:
        _no_cpu(self)


class NonUvaBuffer(_NonUvaBuffer):
    """:class:`jaxbuf.NonUvaBuffer` whose device copy is a JAX array."""

    def uva(self, n: int | None = None) -> jax.Array:
        """Copy the first ``n`` rows (all when None) to the device; return their array."""
        return super().uva(n).to_jax()

    @property
    def cpu(self) -> NoReturn:
        _no_cpu(self)


class UvaBufferPool(_UvaBufferPool):
    """:class:`jaxbuf.UvaBufferPool` handing out JAX arrays (``framework="jax"``), imported
    afresh on every call; ``copy_to_gpu(x, out)`` takes a JAX ``out``."""

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: Any,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        framework: str = "jax",
        **options: Any,
    ) -> None:
        super().__init__(size, dtype, max_concurrency, device, framework=framework, **options)


class UvaBackedTensor(_UvaBackedTensor):
    """:class:`jaxbuf.UvaBackedTensor` whose ``gpu`` is a JAX array (write ``np``, then
    ``copy_to_uva``)."""

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: Any,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        framework: str = "jax",
        **options: Any,
    ) -> None:
        super().__init__(size, dtype, max_concurrency, device, framework=framework, **options)

    @property
    def cpu(self) -> NoReturn:
        _no_cpu(self)


class StagedWriteTensor(_StagedWriteTensor):
    """:class:`jaxbuf.StagedWriteTensor` whose ``gpu`` is a JAX array over the target,
    imported afresh on every access: take it after :meth:`apply_write`."""

    __slots__ = ()

    @property
    def gpu(self) -> jax.Array:
        """The target as a JAX array (shape ``size``, dtype ``dtype``)."""
        return super().gpu.to_jax()

    def to_torch(self) -> Any:
        return super().gpu.to_torch()

    def to_jax(self) -> jax.Array:
        return super().gpu.to_jax()

    def to_numpy(self) -> Any:
        return super().gpu.to_numpy()


class ExtensibleKVCacheBuffers(_ExtensibleKVCacheBuffers):
    """:class:`jaxbuf.ExtensibleKVCacheBuffers` whose views are JAX arrays."""

    def full_view(self, index: int) -> jax.Array:
        return super().full_view(index).to_jax()

    def segment_views(
        self,
        index: int,
        num_blocks: int | None = None,
        dtype: Any = None,
        block_shape: Any = None,
    ) -> list[jax.Array]:
        views = super().segment_views(index, num_blocks, dtype, block_shape)
        return [view.to_jax() for view in views]


class ExtensibleKVCacheBuilder(_ExtensibleKVCacheBuilder):
    """:class:`jaxbuf.ExtensibleKVCacheBuilder` whose ``reserve`` returns a JAX uint8 array
    and whose ``finish`` returns this face's :class:`ExtensibleKVCacheBuffers`."""

    buffers_type = ExtensibleKVCacheBuffers

    def __init__(
        self,
        num_blocks_capacity: int,
        device: Any = None,
        shareable: bool | str = False,
        *,
        framework: str = "jax",
        **options: Any,
    ) -> None:
        super().__init__(num_blocks_capacity, device, shareable, framework=framework, **options)


class DeviceParamTable(_DeviceParamTable):
    """:class:`jaxbuf.DeviceParamTable` whose fields' ``gpu`` are JAX arrays holding the
    values of the last :meth:`sync` (``arrays("jax")[name]``: immutable, the same array
    until the next changed sync; take them after it)."""

    def __getitem__(self, name: str) -> ParamField:
        field = super().__getitem__(name)
        gpu = self.arrays("jax")[name]
        return ParamField(field.name, field.dtype, field.offset, field.np, gpu)

    @property
    def fields(self) -> dict[str, ParamField]:
        return {name: self[name] for name in self}
