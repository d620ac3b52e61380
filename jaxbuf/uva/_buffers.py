"""Pinned host memory the device reads in place (:class:`UvaBuffer`) and its explicit-copy
fallback (:class:`NonUvaBuffer`).

Ownership (:mod:`jaxbuf._owner`): each buffer has one allocation (the pinned block,
or the fallback's device memory; :mod:`jaxbuf.uva._memory`) and a
:class:`~jaxbuf._owner.Lifetime` over it. Every export (``np``, ``cpu``, a torch tensor, a JAX
array, a DLPack capsule) holds the lifetime's anchor, which holds the allocation and nothing
else, so the memory outlives the buffer object while any array uses it. ``free()`` means "I
am done": no new views or exports, the memory goes when the last export does (at once when
there is none).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import interop
from .._checks import as_int, as_shape
from .._errors import ClosedError
from .._interrupts import deferred_interrupts
from .._lifetime import release_or_retry_later
from .._owner import Lifetime
from .._resolve import resolve
from ..devices import Device, DeviceLike, as_device, default_device
from ..drivers.base import K_DL_CPU, VmmDriver
from ..dtypes import DType, DTypeLike, canonical_dtype
from ..views import BufferView
from ._memory import (
    _check_host_bytes,
    _DeviceMemory,
    _nothing,
    _PinnedHostMemory,
    _refuse_copy,
    _release_now,
    _ViewOwner,
)

# Distinct lengths whose framework arrays a slot keeps; past it the cache starts over, so a
# workload with unbounded distinct lengths costs one DLPack import per call, not memory.
_MAX_CACHED_LENGTHS = 256


# -- validation ---------------------------------------------------------------------------
def _as_shape(size: Any) -> tuple[int, ...]:
    """``size`` (an int or a sequence of ints) as a shape of at least one dimension."""
    dims = as_shape(size, "size")
    if not dims:
        raise ValueError(f"size must have at least one dimension, got {size!r}")
    return dims


# -- the buffers --------------------------------------------------------------------------
class _BufferBase:
    """What :class:`UvaBuffer` and :class:`NonUvaBuffer` share: shape, dtype, the lifetime,
    the lazy framework arrays and the per-length caches the pool's hot path reads."""

    shape: tuple[int, ...]
    dtype: DType
    device: Device
    nbytes: int
    np: np.ndarray
    _device_view: BufferView
    _row_bytes: int
    _lifetime: Lifetime
    _owner: _ViewOwner
    _allocation: Any  # None once no release is left to this buffer

    __reduce_ex__ = _refuse_copy

    def _init_common(self, shape: tuple[int, ...], dtype: DType, device: Device) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self._row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self.nbytes = shape[0] * self._row_bytes
        _check_host_bytes(self.nbytes, f"a {type(self).__name__} of size {shape} of {dtype}")
        self._arrays: dict[str, Any] = {}
        # framework ("view" or an adapter name) -> {rows: array over the first rows of the
        # device memory}
        self._caches: defaultdict[str, dict[int, Any]] = defaultdict(dict)

    def _init_lifetime(self, allocation: Any, driver: VmmDriver) -> None:
        self._driver = driver
        self._allocation = allocation
        self._lifetime = Lifetime(allocation)
        self._owner = _ViewOwner(self.device, driver, self._lifetime, type(self).__name__)

    def _view(self, ptr: int, device_type: int) -> BufferView:
        return BufferView(
            ptr, max(self.nbytes, 1), self.dtype, self.shape, self.device, self._owner, device_type
        )

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        state = "freed" if self._closed else "open"
        name = type(self).__name__
        return (
            f"{name}(device={self.device}, dtype={self.dtype}, shape={self.shape}, "
            f"nbytes={self.nbytes}, {state})"
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _closed(self) -> bool:
        return self._lifetime.anchor is None

    def _check_open(self) -> None:
        if self._lifetime.anchor is None:
            raise ClosedError(type(self).__name__)

    # -- the owner contract (jaxbuf._owner.MemoryOwner) --------------------------------------
    @property
    def driver(self) -> VmmDriver:
        return self._driver

    @property
    def ready_event(self) -> Any:
        """The driver event after the last host-to-device copy (NonUvaBuffer), or None."""
        return self._owner.ready_event

    def check_exportable(self) -> None:
        if self._lifetime.anchor is None:
            raise ClosedError(type(self).__name__)

    @property
    def export_anchor(self) -> object:
        """The lifetime's anchor: it holds the allocation while an export lives."""
        return self._lifetime.anchor

    @property
    def live_exports(self) -> int:
        """Framework arrays alive over this buffer's memory (a UvaBuffer's own ``np`` counts
        while the buffer is open); after ``free()`` the memory goes when this reaches 0."""
        return self._lifetime.live_exports

    @property
    def released(self) -> bool:
        """Whether the memory has been given back (after ``free()`` and the last export)."""
        return self._lifetime.released

    # -- rows and arrays ------------------------------------------------------------------
    def _check_rows(self, n: int | None) -> int:
        if n is None:
            return self.shape[0]
        n = as_int(n, "n")
        if not 0 <= n <= self.shape[0]:
            raise IndexError(f"n={n} out of range for a buffer of {self.shape[0]} rows")
        return n

    def _rows_view(self, n: int) -> BufferView:
        return self._device_view.view(shape=(n, *self.shape[1:]))

    def _cached(self, framework: str, n: int) -> Any:
        """The device array of the first ``n`` rows for ``framework`` ("view" or an adapter
        name), made once per length."""
        cache = self._caches[framework]
        array = cache.get(n)
        if array is None:
            self._check_open()
            array = self._rows_view(n)
            if framework != "view":
                adapter = interop.get(framework)
                array = adapter.from_view(array)
                if not adapter.mutable_arrays:
                    # Never cache an array of a framework that treats arrays as immutable
                    # over memory that changes: JAX caches an array's host value (np.asarray
                    # of a reused GPU array returned the previous step's rows). Each call
                    # imports afresh.
                    return array
            if len(cache) >= _MAX_CACHED_LENGTHS:
                cache.clear()
            cache[n] = array
        return array

    def _lazy(self, name: str, make) -> Any:
        array = self._arrays.get(name)
        if array is None:
            self._check_open()
            array = self._arrays[name] = make()
        return array

    def _host_array(self, adapter: interop.FrameworkAdapter) -> Any:
        """``adapter``'s host array over ``np`` (made on first use, then cached)."""
        return self._lazy(f"host:{adapter.name}", lambda: adapter.host_array(self.np))

    @property
    def cpu(self) -> Any:
        """A torch CPU tensor over the host memory (made on first use, then cached)."""
        return self._host_array(interop.get("torch"))

    @property
    def view(self) -> BufferView:
        """The device view of the whole buffer (``kDLCUDA`` on CUDA, ``kDLCPU`` on the CPU)."""
        self._check_open()
        return self._device_view

    @property
    def torch_device_tensor(self) -> Any:
        """A torch tensor over the device memory, zero-copy (cached)."""
        return self._lazy("torch", lambda: self._device_view.to_torch())

    @property
    def jax_device_array(self) -> Any:
        """A JAX array over the device memory, zero-copy. Pass this one to ``jit``.

        A fresh import on every access (about 40 µs on a GPU): JAX caches an array's host
        value, so an array kept across host writes would read stale on ``np.asarray``."""
        return self._device_view.to_jax()

    def _set_ready_event(self, event: Any) -> None:
        with deferred_interrupts():  # swapped and the old one destroyed as one step
            owner = self._owner
            previous, owner.ready_event = owner.ready_event, event
            if previous is not None:
                driver = self._driver  # a failed destroy is retried, the event never leaked
                release_or_retry_later(lambda: driver.destroy_event(previous), "an event", driver)

    def _drop_arrays(self) -> None:
        """Forget the arrays this buffer made; those nobody else holds go, with their
        exports (they would otherwise count as users of the memory at ``free()``)."""
        self._arrays.clear()
        for cache in self._caches.values():
            cache.clear()

    def free(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        """Same as :meth:`free`."""
        self.free()


class UvaBuffer(_BufferBase):
    """Pinned host memory with a zero-copy device view.

    ``np`` is a numpy array over the host memory; ``cpu`` a torch CPU tensor over it. The
    device sees the same bytes through ``view`` / :meth:`uva` (a :class:`BufferView`, DLPack
    ``kDLCUDA`` on CUDA, ``kDLCPU`` on the CPU driver, where "device" memory is host memory),
    ``torch_device_tensor`` (a torch CUDA tensor) and two JAX arrays:

    * ``jax_device_array``: imported through ``kDLCUDA``, so JAX treats it as ordinary
      device memory. **Pass this one into ``jit``**: the compiled kernels read the pinned
      bytes in place over the bus, with no copy.
    * ``jax_pinned_host_array``: imported through ``kDLCUDAHost``, which JAX turns into an
      array of memory kind ``pinned_host`` (torch rejects ``kDLCUDAHost``). Memory kinds are
      part of a ``jit`` signature; JAX's host-offloading guide moves such inputs into
      ``device`` memory with an explicit ``jax.device_put`` inside the function before
      computing on them, i.e. a host-to-device copy. Use it for ``device_put`` /
      ``out_shardings`` style offloading, not as the zero-copy input of a computation.

    Host writes are visible to kernels launched afterwards (no cache to flush); kernels'
    writes are visible to the host once they have finished.

    Invariants: the pointers never change. Every array made from the buffer (``np``,
    ``cpu``, torch tensors, JAX arrays, anything imported from a view) keeps the memory
    alive and mapped at its address until it goes, so no later allocation can alias it.
    ``free()`` (or ``close()``, or leaving a ``with`` block) means "done": no new views or
    exports (views taken earlier raise at export), the memory goes with the last array (at
    once when there is none; see ``live_exports`` and ``released``). Idempotent.

    Not thread-safe: one thread writes ``np`` and hands out views; the views themselves may
    be exported from any thread. Not picklable or copyable (``TypeError``).

    Parameters
    ----------
    size : int or sequence of int
        The shape; the first dimension is the row count.
    dtype : numpy, torch or JAX dtype, or str
    device : device spec, optional
        Default: :func:`jaxbuf.devices.default_device`.
    driver : VmmDriver, optional
        Default: the device's driver (tests pass a fault-injecting one).
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        device: DeviceLike | None = None,
        *,
        driver: VmmDriver | None = None,
    ) -> None:
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        device, driver = resolve(device, driver)
        self._init_common(shape, dtype, device)
        memory = _PinnedHostMemory(driver, self.nbytes, device)
        self._init_lifetime(memory, driver)
        self._host_view = self._view(memory.host_ptr, K_DL_CPU)
        self._pinned_host_view = self._view(memory.host_ptr, driver.dlpack_host_device_type)
        self._device_view = self._view(memory.device_ptr, driver.dlpack_device_type)
        self.np = self._host_view.to_numpy()

    @property
    def host_ptr(self) -> int:
        self._check_open()
        return self._host_view.ptr

    @property
    def device_ptr(self) -> int:
        self._check_open()
        return self._device_view.ptr

    def uva(self, n: int | None = None) -> BufferView:
        """The device view of the first ``n`` rows (all when None): no copy, no sync."""
        return self._cached("view", self._check_rows(n))

    @property
    def pinned_host_view(self) -> BufferView:
        """The host memory as DLPack ``kDLCUDAHost`` on CUDA (``kDLCPU`` on the CPU)."""
        self._check_open()
        return self._pinned_host_view

    @property
    def jax_pinned_host_array(self) -> Any:
        """A JAX array of memory kind ``pinned_host`` over the host memory (a plain CPU array
        on the CPU driver). Not for ``jit`` inputs; see the class docstring."""
        return self._lazy("jax_pinned_host", lambda: self._pinned_host_view.to_jax())

    def _publish(self, framework: str, n: int) -> Any:
        # The device already sees the host memory: nothing to copy.
        return self._cached(framework, n)

    def free(self) -> None:
        """Done with the buffer: no new views or exports; the pinned memory goes now, or with
        the last array made from it. Safe to call more than once. A driver failure leaves
        the buffer open and usable; calling ``free()`` again retries."""
        self._free(quiesce=True)

    def _free(self, quiesce: bool) -> None:
        lifetime = self._lifetime
        if lifetime.anchor is None:
            return
        self._drop_arrays()
        self.np = np.empty((0, *self.shape[1:]), self.dtype.numpy)  # np is an export too
        allocation, device = self._allocation, self.device
        try:
            # One atomic step: an export taken on another thread before it holds the memory
            # (released by the last export, the block's __del__), one after it is refused;
            # checking for exports first, then closing, let one slip in between.
            lifetime.close(lambda memory: _release_now(memory, device, quiesce))
        except BaseException:
            if lifetime.anchor is not None:
                # Interrupted before it closed: still open, its exports holding this lifetime.
                self.np = self._host_view.to_numpy()
            elif lifetime.live_exports or lifetime.released:
                # Closed, the memory left to the exports or released (the interrupt landed
                # after): done. A new lifetime here would let the next free() release the
                # memory under those exports.
                self._allocation = None
            else:
                # The release failed (or was cut short) with no export alive: the buffer
                # stays usable, over a new lifetime of the same memory.
                self._lifetime = self._owner._lifetime = Lifetime(allocation)
                self.np = self._host_view.to_numpy()
            raise
        self._allocation = None


class NonUvaBuffer(_BufferBase):
    """Explicit-copy fallback: host memory plus a separate device allocation.

    Same interface as :class:`UvaBuffer`: ``np`` (pageable host memory, the source),
    ``cpu``, ``view``, ``torch_device_tensor``, ``jax_device_array``. The device memory is a
    small :class:`~jaxbuf.extensible.ExtensibleTensor`. :meth:`uva` copies the first ``n``
    rows host-to-device on the driver's producer stream and returns the device view; DLPack
    consumers that pass their stream wait for that copy. There is no pinned memory, so
    ``jax_pinned_host_array`` raises ``BufferError``.

    Lifetime as :class:`UvaBuffer`'s (arrays over the device memory keep it alive; ``free()``
    means done), except that a failed ``free()`` leaves the buffer closed (the device memory
    may be half released) and a retry frees the rest. Not thread-safe; not picklable or
    copyable.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        device: DeviceLike | None = None,
        *,
        driver: VmmDriver | None = None,
    ) -> None:
        from ..extensible import ExtensibleTensor

        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        device, driver = resolve(device, driver)
        self._init_common(shape, dtype, device)
        self.np = np.zeros(shape, dtype.numpy)
        self._checked_np = self.np  # the array _copy_rows last checked: a rebinding is seen
        nbytes = max(self.nbytes, 1)
        tensor = ExtensibleTensor(nbytes, device=device, driver=driver)
        try:
            tensor.resize_per_segment_(nbytes, zero_new=True)
        except BaseException:
            # Freed now, not when the error (whose traceback holds this object) goes.
            tensor.free()
            raise
        self._init_lifetime(_DeviceMemory(tensor), driver)
        self._device_view = self._view(tensor.base_ptr, driver.dlpack_device_type)

    def uva(self, n: int | None = None) -> BufferView:
        """Copy the first ``n`` rows (all when None) to the device; return their view."""
        n = self._check_rows(n)
        self._copy_rows(n)
        return self._cached("view", n)

    @property
    def jax_pinned_host_array(self) -> Any:
        raise BufferError("NonUvaBuffer has no pinned host memory; use jax_device_array")

    def _host_source(self) -> np.ndarray:
        """``np``, checked again whenever it was rebound (one identity test otherwise): the
        copy reads ``nbytes`` from it, so it must be a C-contiguous array of the buffer's
        shape and dtype (``ValueError`` / ``TypeError`` naming what it is)."""
        array = self.np
        if array is not self._checked_np:
            if not isinstance(array, np.ndarray):
                raise TypeError(
                    f"{type(self).__name__}.np was rebound to {type(array).__name__}; it must "
                    f"be a numpy array of shape {self.shape} and dtype {self.dtype}"
                )
            if array.shape != self.shape or array.dtype != self.dtype.numpy:
                raise ValueError(
                    f"{type(self).__name__}.np was rebound to an array of shape {array.shape} "
                    f"and dtype {array.dtype}; it must keep shape {self.shape} and dtype "
                    f"{self.dtype} (write into it instead: buf.np[...] = values)"
                )
            if not array.flags.c_contiguous:
                raise ValueError(f"{type(self).__name__}.np was rebound to a non-contiguous array")
            self._checked_np = array
        return array

    def _copy_rows(self, n: int) -> None:
        self._check_open()
        nbytes = n * self._row_bytes
        if nbytes:
            driver, index = self._driver, self.device.index
            source = self._host_source()
            driver.copy(self._device_view.ptr, source.ctypes.data, nbytes, index)
            with deferred_interrupts():  # recorded as it is made: an interrupt cannot leak it
                self._set_ready_event(driver.record_ready_event(index))

    def _publish(self, framework: str, n: int) -> Any:
        array = self._cached(framework, n)
        adapter = None if framework == "view" else interop.get(framework)
        if adapter is not None and adapter.mutable_arrays and self.device.is_cuda:
            # A reused array imported before this copy: copy on the framework's current
            # stream instead (torch), ordered with the array's readers, no event needed.
            if n:
                adapter.copy_into(array, self._host_array(adapter)[:n])
            return array
        self._copy_rows(n)
        event = self._owner.ready_event
        if adapter is not None and event is not None:
            # The array was imported before this copy was enqueued and its consumer passes no
            # stream to a view: wait for the copy.
            self._driver.event_synchronize(event)
        return array

    def free(self) -> None:
        """Done with the buffer: no new views or exports; the device memory goes now, or with
        the last array made from it. Safe to call more than once; after a driver failure
        the buffer is closed and calling ``free()`` again frees what is left."""
        self._free(quiesce=True)

    def _free(self, quiesce: bool) -> None:
        lifetime = self._lifetime
        if lifetime.anchor is not None:
            # Closed first: a failing release may already have unmapped the device memory.
            self._drop_arrays()
            if not lifetime.close(_nothing):
                self._allocation = None  # exported: the last export releases it
        self._set_ready_event(None)
        allocation = self._allocation
        # Exports alive: the last one releases the memory. Asked of the lifetime, not of
        # ``_allocation`` alone: an interrupt after close() returned, before the line that
        # forgot the allocation, must not make this call release it under them.
        if allocation is not None and not lifetime.live_exports:
            # ExtensibleTensor.free() waits for the frameworks itself, whatever ``quiesce``.
            _release_now(allocation, self.device, quiesce=False)
        self._allocation = None


def async_copy_to_device(
    x: Any, device: Any = None, dtype: Any = None, framework: str = "torch"
) -> Any:
    """Host data (list, numpy, CPU torch) to a new device array without blocking the host.

    The seed's ``async_tensor_h2d``, through the ``framework`` adapter's own staging: torch
    (``pin_memory()`` + non-blocking copy; torch's host allocator keeps the staging block
    until the copy is done), JAX (``jax.device_put``) or any registered framework. For
    repeated small copies a :class:`~jaxbuf.uva.UvaBufferPool` is faster.
    """
    adapter = interop.get(framework)
    device = default_device() if device is None else as_device(device)
    dtype = None if dtype is None else canonical_dtype(dtype)
    return adapter.to_device(x, device, dtype)
