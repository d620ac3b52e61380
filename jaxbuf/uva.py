"""Pinned host memory the device reads in place (UVA), and round-robin pools of it.

A :class:`UvaBuffer` is page-locked host memory mapped into the device's address space
(``cuMemHostAlloc`` + ``cuMemHostGetDevicePointer`` on CUDA, page-aligned ``mmap`` on the CPU
driver), allocated through the driver seam, so no framework is needed to make one. The host
writes it through numpy (``.np``); kernels of torch, JAX or Triton read the same bytes through
a device view, with no copy. :class:`NonUvaBuffer` has the same interface for platforms where
that is unavailable or unsafe (:func:`uva_unavailable_reason` says why): it copies explicitly.

:class:`UvaBufferPool` hands out one of ``max_concurrency`` slots per step, so the host can
fill step *t + 1* while the device still reads step *t*; :class:`UvaBackedTensor` keeps a host
source of truth and publishes it through a pool.

Examples
--------
>>> import numpy as np, jaxbuf.uva as uva
>>> pool = uva.UvaBufferPool(8, "int32", device="cpu", framework="view")
>>> view = pool.copy_to_uva([1, 2, 3])
>>> view.shape, view.to_numpy().tolist()
((3,), [1, 2, 3])
>>> pool.close()
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from collections import defaultdict
from typing import Any

import numpy as np

from . import interop
from ._checks import as_count, as_int, as_shape
from ._errors import Cleanup
from ._lifetime import release_when_collected
from ._resolve import resolve
from .devices import Device, as_device, default_device
from .drivers import DriverError, get_vmm_driver
from .drivers.base import K_DL_CPU, VmmDriver
from .dtypes import DType, canonical_dtype
from .views import BufferView

__all__ = [
    "DEFAULT_MAX_CONCURRENCY",
    "NonUvaBuffer",
    "UvaBackedTensor",
    "UvaBuffer",
    "UvaBufferPool",
    "async_copy_to_device",
    "is_uva_available",
    "uva_unavailable_reason",
]

_logger = logging.getLogger(__name__)

#: Slots per pool when ``max_concurrency`` is None: the step being read and the step being
#: written. A constant documenting the constructor default, not a setting.
DEFAULT_MAX_CONCURRENCY = 2

_GUARD_MODES = {False: None, True: "wait", "wait": "wait", "raise": "raise"}
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


def _pool_adapter(framework: Any) -> interop.FrameworkAdapter | None:
    """The adapter a pool hands out arrays of (None for ``"view"``): a registered framework
    of device arrays. ValueError naming anything else; ImportError when it is missing."""
    if framework == "view":
        return None
    try:
        adapter = interop.get(framework)
    except (ValueError, TypeError):
        adapter = None
    if adapter is None or not adapter.device_arrays:
        detail = (
            f"{framework!r} has no device arrays"
            if adapter is not None
            else f"registered: {', '.join(interop.names())}"
        )
        raise ValueError(
            "framework must be 'view', None or the name of a registered framework of device "
            f"arrays ({detail}), got {framework!r}"
        )
    return adapter


# -- the probe ----------------------------------------------------------------------------
def uva_unavailable_reason(device: Any = None) -> str | None:
    """None when :class:`UvaBuffer` works on ``device``, else one sentence saying why not.

    Cached per device. UVA is unavailable when the device's driver is, when the GPU runs in
    confidential-computing mode (the device then reads garbage from pinned host memory, as
    vLLM found), when pinned allocation fails, or when the device view does not alias the
    host memory (a byte pattern written through one is not read back through the other).
    """
    return _uva_unavailable_reason(default_device() if device is None else as_device(device))


def is_uva_available(device: Any = None) -> bool:
    """True when :func:`uva_unavailable_reason` is None for ``device``."""
    return uva_unavailable_reason(device) is None


@functools.lru_cache(maxsize=None)
def _uva_unavailable_reason(device: Device) -> str | None:
    try:
        driver = get_vmm_driver(device)
    except (RuntimeError, ValueError) as error:
        return str(error)
    probe = getattr(driver, "confidential_computing_reason", None)
    reason = probe() if probe is not None else None
    if reason is not None:
        return reason
    return _probe_aliasing(driver, device.index)


def _probe_aliasing(driver: VmmDriver, device_index: int, size: int = 4096) -> str | None:
    """Write through the host pointer, read through the device pointer (and back)."""
    try:
        host_ptr, device_ptr = driver.host_alloc(size, device_index)
    except DriverError as error:
        return f"pinned host allocation failed: {error}"
    try:
        check_ptr, _ = driver.host_alloc(size, device_index)
    except DriverError as error:
        driver.host_free(host_ptr)
        return f"pinned host allocation failed: {error}"
    try:
        host = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(host_ptr))
        check = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(check_ptr))
        pattern = (np.arange(size, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)
        host[:] = pattern
        check[:] = ~pattern
        driver.copy(check_ptr, device_ptr, size, device_index)  # read through the device
        driver.synchronize(device_index)
        if not np.array_equal(check, pattern):
            return "the device view of pinned host memory does not alias it (read mismatch)"
        driver.memset(device_ptr, 0x5A, size, device_index)  # write through the device
        driver.synchronize(device_index)
        if not (host == 0x5A).all():
            return "the device view of pinned host memory does not alias it (write mismatch)"
    except DriverError as error:
        return f"access to pinned host memory through its device pointer failed: {error}"
    finally:
        driver.host_free(check_ptr)
        driver.host_free(host_ptr)
    return None


# -- pinned memory ------------------------------------------------------------------------
class _PinnedHostMemory:
    """One ``host_alloc`` block; the owner of every view and array over it.

    Frees itself when the last reference goes (numpy arrays and torch tensors made from
    its views hold one); :meth:`free` frees it at once. No driver call at interpreter exit:
    the driver may already be torn down, and the process is ending anyway.
    """

    __slots__ = ("host_ptr", "device_ptr", "nbytes", "device", "_driver")

    def __init__(self, driver: VmmDriver, nbytes: int, device: Device) -> None:
        self.host_ptr = 0
        self._driver = driver
        # host_alloc refuses 0 bytes; an empty buffer still gets a valid pointer.
        self.host_ptr, self.device_ptr = driver.host_alloc(max(nbytes, 1), device.index)
        self.nbytes = nbytes
        self.device = device

    # -- the owner contract (jaxbuf._owner.MemoryOwner) ------------------------------------
    @property
    def driver(self) -> VmmDriver:
        return self._driver

    @property
    def ready_event(self) -> None:
        """Always None: host writes are synchronous, there is nothing to wait for."""
        return None

    def check_exportable(self) -> None:
        if not self.host_ptr:
            raise RuntimeError("the pinned host memory (of a UvaBuffer) is freed")

    @property
    def export_anchor(self) -> object:
        return self

    def free(self) -> None:
        # The pointer is dropped only once host_free succeeded, so a retry frees it.
        ptr = self.host_ptr
        if ptr:
            self._driver.host_free(ptr)
            self.host_ptr = 0

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "host_ptr", 0):
            _release(self.free, "pinned host memory")


class _BufferBase:
    """What :class:`UvaBuffer` and :class:`NonUvaBuffer` share: shape, dtype, the lazy
    framework arrays and the per-length caches the pool's hot path reads."""

    shape: tuple[int, ...]
    dtype: DType
    device: Device
    nbytes: int
    np: np.ndarray
    _device_view: BufferView
    _row_bytes: int

    def _init_common(self, shape: tuple[int, ...], dtype: DType, device: Device) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self._row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self.nbytes = shape[0] * self._row_bytes
        if self.nbytes >= 1 << 63:
            raise ValueError(f"size {shape} of {dtype} is {self.nbytes} bytes, past 2**63")
        self._arrays: dict[str, Any] = {}
        # framework ("view" or an adapter name) -> {rows: array over the first rows of the
        # device memory}
        self._caches: defaultdict[str, dict[int, Any]] = defaultdict(dict)
        self._ready_event: Any = None
        self._closed = False

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        name = type(self).__name__
        return f"{name}(shape={self.shape}, dtype={self.dtype}, device={self.device}{state})"

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{type(self).__name__} is freed")

    # -- the owner contract (jaxbuf._owner.MemoryOwner) --------------------------------------
    @property
    def driver(self) -> VmmDriver:
        return self._driver

    @property
    def ready_event(self) -> Any:
        """The driver event after the last host-to-device copy (NonUvaBuffer), or None."""
        return self._ready_event

    def check_exportable(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {type(self).__name__} is freed")

    @property
    def export_anchor(self) -> object:
        return self

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

    def _drop_arrays(self) -> None:
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

    Invariants: the pointers never change; ``free()`` (or ``close()``, or leaving a ``with``
    block) releases the memory once, and is safe to call again; arrays made from the buffer
    keep it alive until they go (torch and numpy hold a reference; JAX arrays cannot, so
    keep the buffer alive while a JAX array over it is in use).

    Not thread-safe: one thread writes ``np`` and hands out views; the views themselves may
    be exported from any thread.

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

    def __init__(self, size: Any, dtype: Any, device: Any = None, *,
                 driver: VmmDriver | None = None) -> None:  # fmt: skip
        self._memory: _PinnedHostMemory | None = None
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        device, driver = resolve(device, driver)
        self._init_common(shape, dtype, device)
        self._driver = driver
        self._memory = memory = _PinnedHostMemory(driver, self.nbytes, device)
        host_view = BufferView(memory.host_ptr, max(self.nbytes, 1), dtype, shape, device,
                               memory, K_DL_CPU)  # fmt: skip
        self._pinned_host_view = BufferView(memory.host_ptr, max(self.nbytes, 1), dtype, shape,
                                            device, memory, driver.dlpack_host_device_type)
        self._device_view = BufferView(memory.device_ptr, max(self.nbytes, 1), dtype, shape,
                                       device, memory, driver.dlpack_device_type)  # fmt: skip
        self.np = host_view.to_numpy()

    @property
    def host_ptr(self) -> int:
        self._check_open()
        return self._memory.host_ptr

    @property
    def device_ptr(self) -> int:
        self._check_open()
        return self._memory.device_ptr

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

    @property
    def export_anchor(self) -> object:
        """The pinned block (the owner of this buffer's views), which holds the memory."""
        return self._memory

    def free(self) -> None:
        """Release the pinned memory. Safe to call more than once; arrays made from the
        buffer must not be used afterwards."""
        memory = self._memory
        if self._closed or memory is None:
            return
        memory.free()  # a driver failure leaves the buffer open and usable; retry frees it
        self._closed = True
        self._drop_arrays()
        self.np = np.empty((0, *self.shape[1:]), self.dtype.numpy)



class NonUvaBuffer(_BufferBase):
    """Explicit-copy fallback: host memory plus a separate device allocation.

    Same interface as :class:`UvaBuffer`: ``np`` (pageable host memory, the source),
    ``cpu``, ``view``, ``torch_device_tensor``, ``jax_device_array``. The device memory is a
    small :class:`~jaxbuf.extensible.ExtensibleTensor`. :meth:`uva` copies the first ``n``
    rows host-to-device on the driver's producer stream and returns the device view; DLPack
    consumers that pass their stream wait for that copy. There is no pinned memory, so
    ``jax_pinned_host_array`` raises ``BufferError``.

    Not thread-safe. ``free()``/``close()`` are idempotent.
    """

    def __init__(self, size: Any, dtype: Any, device: Any = None, *,
                 driver: VmmDriver | None = None) -> None:  # fmt: skip
        from .extensible import ExtensibleTensor

        self._device_memory = None
        self._ready_event = None
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        device, driver = resolve(device, driver)
        self._init_common(shape, dtype, device)
        self._driver = driver
        self.np = np.zeros(shape, dtype.numpy)
        allocation = max(self.nbytes, 1)
        memory = ExtensibleTensor(allocation, device=device, driver=driver)
        try:
            memory.resize_per_segment_(allocation, zero_new=True)
        except BaseException:
            # Freed now, not when the error (whose traceback holds this object) goes.
            memory.free()
            raise
        self._device_memory = memory
        # Views are owned by this buffer: it carries the ready event of the last copy.
        self._device_view = BufferView(self._device_memory.base_ptr, allocation, dtype, shape,
                                       device, self, driver.dlpack_device_type)  # fmt: skip

    def uva(self, n: int | None = None) -> BufferView:
        """Copy the first ``n`` rows (all when None) to the device; return their view."""
        n = self._check_rows(n)
        self._copy_rows(n)
        return self._cached("view", n)

    @property
    def jax_pinned_host_array(self) -> Any:
        raise BufferError("NonUvaBuffer has no pinned host memory; use jax_device_array")

    def _copy_rows(self, n: int) -> None:
        self._check_open()
        nbytes = n * self._row_bytes
        if nbytes:
            driver, index = self._driver, self.device.index
            driver.copy(self._device_view.ptr, self.np.ctypes.data, nbytes, index)
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
        if adapter is not None and self._ready_event is not None:
            # The array was imported before this copy was enqueued and its consumer passes no
            # stream to a view: wait for the copy.
            self._driver.event_synchronize(self._ready_event)
        return array

    def _set_ready_event(self, event: Any) -> None:
        previous, self._ready_event = self._ready_event, event
        if previous is not None:
            self._driver.destroy_event(previous)

    def free(self) -> None:
        """Release the device memory. Safe to call more than once."""
        memory = self._device_memory
        if memory is None:
            return
        if not self._closed:
            # Closed first: a failing free may already have unmapped the device memory.
            self._closed = True
            self._drop_arrays()
            self._set_ready_event(None)
        memory.free()  # idempotent; after a driver failure a retry frees what is left

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "_device_memory", None) is not None:
            _release(self.free, "a NonUvaBuffer")


def _check_buffer_cls(buffer_cls: Any) -> type:
    if not (isinstance(buffer_cls, type) and issubclass(buffer_cls, (UvaBuffer, NonUvaBuffer))):
        raise TypeError(f"buffer_cls must be UvaBuffer or NonUvaBuffer, got {buffer_cls!r}")
    return buffer_cls


# -- the pool -----------------------------------------------------------------------------
class UvaBufferPool:
    """Round-robin slots of pinned memory; each grows its first dimension as needed.

    Each :meth:`copy_to_uva` takes the next of ``max_concurrency`` slots, writes ``x`` into
    its host memory and returns the device-visible first ``len(x)`` rows, as the pool's
    ``framework`` says: a :class:`BufferView` (``"view"``, the default), a torch tensor
    (``"torch"``), a JAX array (``"jax"``) or the array of any framework registered with
    :func:`jaxbuf.interop.register`. Views and torch tensors (arrays of mutable frameworks)
    are made once per slot and length and reused, so a step pays no DLPack import; the same
    object comes back for the same slot and length, so do not change its metadata in place
    (``resize_``, ``unsqueeze_``). JAX arrays are imported afresh on every call (about 40 µs
    on a GPU): JAX treats arrays as immutable and caches their host value, so a reused one
    reads stale.
    A slot whose input is longer than it is is replaced by one whose first dimension is
    the next power of two.

    **Reuse.** A slot is written again ``max_concurrency`` calls later. By default (as in
    the seed) callers must retire the slot's device readers before that, growth included.
    With ``guarded="wait"`` (or True) the pool instead records a device event on the
    consumer stream at each call, covering the readers of the slot handed out by the
    previous call, and waits for it before writing that slot again; ``guarded="raise"``
    raises ``RuntimeError`` instead (nothing written), to find too-small pools in tests.
    The consumer stream is the ``stream`` argument, else the pool framework's current
    stream, else the first loaded framework's that has one (torch's once torch has
    initialised CUDA: :func:`jaxbuf.interop.current_stream`), else the legacy default
    stream; enqueue a slot's readers on it
    before the next call. On the CPU there is no asynchronous work and guarding is free.

    Not thread-safe: one thread drives a pool.

    Parameters
    ----------
    size : int or sequence of int
        Initial slot shape; inputs must match its trailing dimensions.
    dtype : dtype or str
    max_concurrency : int, optional
        Number of slots, at least 1. None means :data:`DEFAULT_MAX_CONCURRENCY` (2).
    device : device spec, optional
    buffer_cls : type, optional
        :class:`UvaBuffer` or :class:`NonUvaBuffer`; default: UvaBuffer when
        :func:`is_uva_available`, else NonUvaBuffer (with a logged warning).
    framework : {"view", "torch", "jax"} or a registered adapter's name, optional
        What the hot path returns; None means "view". ``ImportError`` naming the extra when
        the framework is not installed.
    guarded : bool or {"wait", "raise"}
    driver : VmmDriver, optional
    """

    def __init__(
        self,
        size: Any,
        dtype: Any,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        buffer_cls: type | None = None,
        framework: str | None = None,
        guarded: bool | str = False,
        driver: VmmDriver | None = None,
    ) -> None:
        self._slots: list[Any] = []
        self._closed = False
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        if max_concurrency is None:
            max_concurrency = DEFAULT_MAX_CONCURRENCY
        max_concurrency = as_count(max_concurrency, "max_concurrency")
        framework = "view" if framework is None else framework
        adapter = _pool_adapter(framework)
        if not isinstance(guarded, (bool, str)) or guarded not in _GUARD_MODES:
            raise ValueError(f"guarded must be False, True, 'wait' or 'raise', got {guarded!r}")
        device, driver = resolve(device, driver)
        if buffer_cls is None:
            reason = uva_unavailable_reason(device) if driver is get_vmm_driver(device) else None
            buffer_cls = UvaBuffer if reason is None else NonUvaBuffer
            if reason is not None:
                _logger.warning("UVA is unavailable on %s (%s); UvaBufferPool copies "
                                "explicitly instead", device, reason)  # fmt: skip
        self._buffer_cls = _check_buffer_cls(buffer_cls)
        self.size = shape
        self.dtype = dtype
        self.device = device
        self.max_concurrency = max_concurrency
        self.framework = framework
        self._adapter = adapter  # None for "view"
        self.guarded = _GUARD_MODES[guarded]
        self._driver = driver
        self._row_shape = shape[1:]
        self._np_dtype = dtype.numpy
        self._castable: dict[np.dtype, bool] = {self._np_dtype: True}
        try:
            for _ in range(max_concurrency):
                self._slots.append(buffer_cls(shape, dtype, device, driver=driver))
        except BaseException:
            self.close()
            raise
        self._hosts = [slot.np for slot in self._slots]
        self._host_ptrs = [slot.np.ctypes.data for slot in self._slots]
        self._row_bytes = math.prod(self._row_shape) * dtype.itemsize
        # Input type -> the adapter recognising it, so a foreign array costs one dict lookup.
        self._input_adapters: dict[type, interop.FrameworkAdapter] = {}
        self._capacities = [shape[0]] * max_concurrency
        self._uva = buffer_cls is not NonUvaBuffer and issubclass(buffer_cls, UvaBuffer)
        # Guarded mode: per-slot event covering its readers; the slot handed out last.
        self._events: list[Any] = [None] * max_concurrency
        self._unrecorded: int | None = None
        # Seed order: the first call uses slot 1 (or 0 when there is one slot).
        self._curr = 0

    # -- the hot path -------------------------------------------------------------------
    def copy_to_uva(self, x: Any, stream: Any = None) -> Any:
        """Write ``x`` (list, tuple, numpy, CPU torch or JAX array) into the next slot and
        return the device-visible first ``len(x)`` rows, as the pool's ``framework`` says.

        ``x`` must have the slot's trailing dimensions and a dtype that casts to the
        pool's within its kind (numpy ``same_kind``: ints to ints, floats to floats, bools
        anywhere); anything else raises before a byte is written. ``stream`` (a
        ``torch.cuda.Stream`` or a DLPack stream number) names the consumer stream for
        guarded pools.
        """
        n = self._write(x, stream)
        slot = self._slots[self._curr]
        if self._uva:
            array = slot._caches[self.framework].get(n)
            return array if array is not None else slot._cached(self.framework, n)
        return slot._publish(self.framework, n)

    def copy_to_gpu(self, x: Any, out: Any = None, stream: Any = None) -> Any:
        """A device copy of ``x``: written into ``out`` and returned, or a new array.

        ``out`` may be an array of any framework of device arrays (a torch tensor, a JAX
        array). A mutable one (torch) is written by the framework on its current stream,
        non-blocking, so ordered with the stream's other work. Arrays a framework treats as
        immutable (JAX) are overwritten in place: the copy goes into ``out``'s buffer on the
        driver's stream and is waited for, so only pass an ``out`` that no pending JAX
        computation reads. Without ``out``: a copy made by the pool's framework (a torch
        clone for a "view" pool), on that framework's stream.
        """
        if out is not None:
            adapter = interop.adapter_for(out)
            if adapter is None or not adapter.device_arrays:
                raise TypeError(
                    "out must be an array of a framework of device arrays (a torch tensor, a "
                    f"JAX array), got {type(out).__name__}"
                )
            self._check_out_device(adapter.array_device(out), out)
            if adapter.mutable_arrays:
                return adapter.copy_into(out, self._copy_as(adapter.name, x, stream))
            return self._copy_into_buffer(adapter, x, out, stream)
        adapter = self._adapter or interop.get("torch")
        return adapter.clone(self._copy_as(adapter.name, x, stream))

    def _check_out_device(self, framework_device: Any, out: Any) -> None:
        """``out`` must live on the pool's device: checked before any slot is written."""
        device = as_device(framework_device)
        if device != self.device:
            raise ValueError(f"out is on {device}, but this pool copies to {self.device}")

    def _write(self, x: Any, stream: Any) -> int:
        """Validate ``x``, take the next slot (growing it), copy ``x`` into its host memory.

        Returns the row count; ``self._curr`` is the slot written.
        """
        ptr = None  # the address of a foreign host array to copy with one memmove
        if type(x) is np.ndarray:
            source = x
        else:
            source, ptr = self._as_source(x)
        shape = source.shape
        if shape[1:] != self._row_shape or not shape:
            raise ValueError(
                f"input of shape {shape} does not match the pool's rows of shape "
                f"{self._row_shape}: expected (n, *{self._row_shape})"
            )
        if ptr is None:  # numpy data: a foreign array with a pointer has the pool's dtype
            castable = self._castable.get(source.dtype)
            if castable is None:
                castable = self._castable[source.dtype] = bool(
                    np.can_cast(source.dtype, self._np_dtype, casting="same_kind")
                )
            if not castable:
                raise TypeError(f"cannot write {source.dtype} data into a {self.dtype} pool")
        n = shape[0]
        i = self._curr + 1
        if i == self.max_concurrency:
            i = 0
        if self.guarded is not None:
            self._guard(i, stream)
        if n > self._capacities[i]:
            self._grow(i, n)
        if ptr is None:
            self._hosts[i][:n] = source
        else:  # a C-contiguous host array of the pool's dtype (a CPU torch tensor): one memmove
            ctypes.memmove(self._host_ptrs[i], ptr, n * self._row_bytes)
        self._curr = i
        return n

    def _copy_as(self, framework: str, x: Any, stream: Any) -> Any:
        """:meth:`copy_to_uva` returning ``framework``'s array, whatever the pool's."""
        n = self._write(x, stream)
        return self._slots[self._curr]._publish(framework, n)

    def _copy_into_buffer(
        self, adapter: interop.FrameworkAdapter, x: Any, out: Any, stream: Any
    ) -> Any:
        """Write ``x`` into the buffer of ``out``, an immutable framework array, through the
        driver, and wait for the copy."""
        if tuple(out.shape[1:]) != self._row_shape or canonical_dtype(out.dtype) != self.dtype:
            raise ValueError(
                f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected rows of "
                f"shape {self._row_shape} and dtype {self.dtype}"
            )
        if out.shape[0] != len(x):
            raise ValueError(f"out has {out.shape[0]} rows, the input {len(x)}")
        view = self._copy_as("view", x, stream)
        nbytes = math.prod(view.shape) * self.dtype.itemsize
        if nbytes:
            driver, index = self._driver, self.device.index
            driver.copy(adapter.buffer_pointer(out), view.ptr, nbytes, index)
            event = driver.record_ready_event(index)
            if event is not None:
                try:
                    driver.event_synchronize(event)
                finally:
                    driver.destroy_event(event)
        return out

    # -- helpers ------------------------------------------------------------------------
    def _as_source(self, x: Any) -> tuple[Any, int | None]:
        """``(numpy array, None)`` for ``x``, or ``(x, address)`` when ``x`` is a foreign host
        array of the pool's dtype that can be copied in place (a contiguous CPU torch
        tensor): ``_write`` then copies it with one memmove, skipping numpy."""
        if isinstance(x, (list, tuple)):
            if len(x) == 0:
                return np.empty((0, *self._row_shape), self._np_dtype), None
            try:
                return np.asarray(x), None
            except ValueError as error:
                raise ValueError(f"cannot convert the input to an array: {error}") from None
        if isinstance(x, np.ndarray):
            return x, None
        adapter = self._input_adapters.get(type(x))
        if adapter is None:
            adapter = interop.adapter_for(x)
            if adapter is None:
                raise TypeError(
                    "copy_to_uva takes a list, tuple, numpy array, CPU torch tensor, JAX array "
                    f"or another registered framework's array, got {type(x).__name__}"
                )
            self._input_adapters[type(x)] = adapter
        ptr = adapter.host_pointer(x, self.dtype)
        if ptr is not None:
            return x, ptr
        return adapter.to_numpy(x, device_copy=False), None

    def _consumer_stream(self, stream: Any) -> int:
        if stream is None:
            return interop.current_stream(self.device, self._adapter)
        return interop.as_dlpack_stream(stream)

    def _guard(self, i: int, stream: Any) -> None:
        """Record the previous hand-out's event; wait for (or refuse) slot ``i``'s."""
        driver = self._driver
        previous = self._unrecorded
        if previous is not None:
            event = driver.record_event(self._consumer_stream(stream), self.device.index)
            self._set_event(previous, event)
            self._unrecorded = None
        event = self._events[i]
        if event is not None and not driver.event_query(event):
            if self.guarded == "raise":
                raise RuntimeError(
                    f"UvaBufferPool slot {i} is reused while the device still reads it "
                    f"(max_concurrency={self.max_concurrency}); nothing was written"
                )
            driver.event_synchronize(event)
        self._set_event(i, None)
        self._unrecorded = i

    def record_readers(self, stream: Any = None) -> None:
        """Guarded pools: mark the readers of the slot handed out last as enqueued on
        ``stream`` now (the next :meth:`copy_to_uva` does this by itself)."""
        if self.guarded is not None and self._unrecorded is not None:
            event = self._driver.record_event(self._consumer_stream(stream), self.device.index)
            self._set_event(self._unrecorded, event)
            self._unrecorded = None

    def _set_event(self, i: int, event: Any) -> None:
        previous, self._events[i] = self._events[i], event
        if previous is not None:
            self._driver.destroy_event(previous)

    def _grow(self, i: int, n: int) -> None:
        if self._closed:
            raise ValueError("UvaBufferPool is closed")
        capacity = 1 << (n - 1).bit_length()
        old = self._slots[i]
        slot = self._buffer_cls((capacity, *self._row_shape), self.dtype, self.device,
                                driver=self._driver)  # fmt: skip
        self._slots[i] = slot
        self._hosts[i] = slot.np
        self._host_ptrs[i] = slot.np.ctypes.data
        self._capacities[i] = capacity
        # Arrays handed out from the old slot keep its memory alive (torch, numpy); the
        # device is done with it (guarded) or the caller promised so (unguarded).
        del old

    # -- introspection and lifetime -----------------------------------------------------
    @property
    def buffer_cls(self) -> type:
        return self._buffer_cls

    @property
    def slots(self) -> tuple[Any, ...]:
        """The slot buffers (for inspection and benchmarks; do not free them)."""
        return tuple(self._slots)

    @property
    def current_slot(self) -> int:
        """Index of the slot the last :meth:`copy_to_uva` wrote."""
        return self._curr

    def close(self) -> None:
        """Free every slot (waiting for guarded readers first). Safe to call twice.

        Best effort: a slot whose free fails stays in the pool (closed) and the next
        ``close()`` retries it; the first error is raised, the others attached as notes."""
        self._closed = True
        # Every length now exceeds every capacity, so the hot path reaches _grow's check.
        self._capacities = [-1] * len(getattr(self, "_capacities", ()))
        self._hosts = [None] * len(self._capacities)
        events = getattr(self, "_events", [])
        for index, event in enumerate(events):
            if event is not None:
                self._driver.event_synchronize(event)
                self._set_event(index, None)
        cleanup = Cleanup("UvaBufferPool.close")
        self._slots = [slot for slot in self._slots if not cleanup.run(slot.free)]
        cleanup.raise_first()

    free = close

    def __enter__(self) -> UvaBufferPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "_slots", None):
            _release(self.close, "a UvaBufferPool")


class UvaBackedTensor:
    """A host array (``np``, the source of truth) published to the device through a pool.

    Mutate ``np`` (or ``cpu``, a torch view of it) freely; :meth:`copy_to_uva` copies its
    first ``n`` rows into the next pool slot and returns the device view, also kept as
    ``gpu``. Not thread-safe.
    """

    def __init__(
        self,
        size: Any,
        dtype: Any,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        framework: str | None = None,
        guarded: bool | str = False,
        buffer_cls: type | None = None,
        driver: VmmDriver | None = None,
    ) -> None:
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        self.dtype = dtype
        self._cpu = None
        # The pool first: it validates everything (a huge size included) before allocating.
        self.pool = UvaBufferPool(shape, dtype, max_concurrency, device, buffer_cls=buffer_cls,
                                  framework=framework, guarded=guarded, driver=driver)
        self.np = np.zeros(shape, dtype.numpy)
        self.max_concurrency = self.pool.max_concurrency
        self.gpu = self.pool.copy_to_uva(self.np)

    @property
    def cpu(self) -> Any:
        """A torch CPU tensor sharing ``np``'s memory (made on first use)."""
        if self._cpu is None:
            self._cpu = interop.get("torch").host_array(self.np)
        return self._cpu

    def copy_to_uva(self, n: int | None = None, stream: Any = None) -> Any:
        if n is not None:
            n = as_int(n, "n")
            if not 0 <= n <= len(self.np):
                raise IndexError(f"n={n!r} out of range for a tensor of {len(self.np)} rows")
        self.gpu = self.pool.copy_to_uva(self.np if n is None else self.np[:n], stream)
        return self.gpu

    def close(self) -> None:
        self.pool.close()


def async_copy_to_device(x: Any, device: Any = None, dtype: Any = None,
                         framework: str = "torch") -> Any:  # fmt: skip
    """Host data (list, numpy, CPU torch) to a new device array without blocking the host.

    The seed's ``async_tensor_h2d``, through the ``framework`` adapter's own staging: torch
    (``pin_memory()`` + non-blocking copy; torch's host allocator keeps the staging block
    until the copy is done), JAX (``jax.device_put``) or any registered framework. For
    repeated small copies a :class:`UvaBufferPool` is faster.
    """
    adapter = interop.get(framework)
    device = default_device() if device is None else as_device(device)
    dtype = None if dtype is None else canonical_dtype(dtype)
    return adapter.to_device(x, device, dtype)
