"""Round-robin pools of UVA buffers (:class:`UvaBufferPool`).

Ownership: a pool owns its slots (:class:`~jaxbuf.uva.UvaBuffer` or
:class:`~jaxbuf.uva.NonUvaBuffer`); every array it hands out holds its slot's memory (the
slot's lifetime anchor), so a slot replaced by growth, a closed pool and a pool dropped
without ``close()`` all keep a slot's memory, mapped at its address, while an array over it
lives: no later allocation can alias it. Nothing a slot holds points back at the pool.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from typing import Any

import numpy as np

from .. import interop
from .._checks import as_max_concurrency
from .._convert import convert_any
from .._interrupts import deferred_interrupts
from .._lifetime import release_when_collected
from .._resolve import resolve
from ..devices import as_device
from ..drivers import get_vmm_driver
from ..drivers.base import VmmDriver
from ..dtypes import canonical_dtype
from ._buffers import NonUvaBuffer, UvaBuffer, _as_shape
from ._memory import _check_host_bytes, _refuse_copy
from ._probe import uva_unavailable_reason
from ._slots import UNRECORDED, DeviceEvent, PinnedSlot, PinnedSlotRing

_logger = logging.getLogger("jaxbuf.uva")

_GUARD_MODES = {False: None, True: "wait", "wait": "wait", "raise": "raise"}
# How an input dtype is written into the pool's (the values of _write's cache).
_REFUSED, _SAFE, _NARROWING = 0, 1, 2


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


def _finite_bounds(dtype: np.dtype) -> tuple[Any, Any] | None:
    """The lowest and highest finite value of ``dtype``; None where numpy has no info
    (bfloat16: every narrowing input then takes the full conversion)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min, info.max
    if dtype.kind == "f":
        finfo = np.finfo(dtype)
        return float(finfo.min), float(finfo.max)
    return None


def _check_buffer_cls(buffer_cls: Any) -> type:
    if not (isinstance(buffer_cls, type) and issubclass(buffer_cls, (UvaBuffer, NonUvaBuffer))):
        raise TypeError(f"buffer_cls must be UvaBuffer or NonUvaBuffer, got {buffer_cls!r}")
    return buffer_cls


class _PoolSlot(PinnedSlot):
    """A pool slot: its buffer (:class:`UvaBuffer` or :class:`NonUvaBuffer`, ``capacity``
    rows), and the buffer's host array and address the hot path writes through (None and 0
    once the buffer is released)."""

    __slots__ = ("host", "host_ptr")

    def __init__(self) -> None:
        super().__init__()
        self.host: Any = None
        self.host_ptr = 0

    def refresh(self) -> None:
        buffer = self.buffer
        self.host = None if buffer is None else buffer.np
        self.host_ptr = 0 if buffer is None else buffer.np.ctypes.data


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

    **Lifetime.** Every array handed out (torch, JAX, numpy from a view, any DLPack
    consumer) keeps its slot's memory alive and mapped until it goes, even once growth has
    replaced the slot, after :meth:`close`, or when the pool is dropped without it; no later
    allocation can alias it. A replaced slot, and every slot at ``close()``, is freed
    ("done"): views handed out from it raise at export, and its memory goes with the last
    array over it.

    Not thread-safe: one thread drives a pool. Not picklable or copyable (``TypeError``).

    Parameters
    ----------
    size : int or sequence of int
        Initial slot shape; inputs must match its trailing dimensions.
    dtype : dtype or str
    max_concurrency : int, optional
        Number of slots, 1 to :data:`MAX_CONCURRENCY`. None means
        :data:`DEFAULT_MAX_CONCURRENCY` (2).
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
        self._ring: PinnedSlotRing | None = None
        self._closed = False
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        max_concurrency = as_max_concurrency(max_concurrency)
        slot_bytes = math.prod(shape) * dtype.itemsize
        what = f"a UvaBufferPool of {max_concurrency} slots of size {shape} of {dtype}"
        _check_host_bytes(max_concurrency * slot_bytes, what)
        framework = "view" if framework is None else framework
        adapter = _pool_adapter(framework)
        if not isinstance(guarded, (bool, str)) or guarded not in _GUARD_MODES:
            raise ValueError(f"guarded must be False, True, 'wait' or 'raise', got {guarded!r}")
        device, driver = resolve(device, driver)
        if buffer_cls is None:
            reason = uva_unavailable_reason(device) if driver is get_vmm_driver(device) else None
            buffer_cls = UvaBuffer if reason is None else NonUvaBuffer
            if reason is not None:
                _logger.warning(
                    "UVA is unavailable on %s (%s); UvaBufferPool copies explicitly instead",
                    device,
                    reason,
                )
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
        # Input dtype -> _SAFE, _NARROWING (same kind, narrower: values are range-checked)
        # or _REFUSED; the pool's own dtype is the hot path's one dict lookup.
        self._castable: dict[np.dtype, int] = {self._np_dtype: _SAFE}
        self._bounds = _finite_bounds(self._np_dtype)
        # The slots and their one reuse guard: in guarded mode a slot handed out is
        # UNRECORDED until the next call (or record_readers) records the event after its
        # readers on the consumer stream; the event is the pool's alone (owns_guards).
        self._ring = PinnedSlotRing(
            max_concurrency,
            # No reference back to the pool (the ring's callables hold none): a pool dropped
            # without close() is collected at once, not by the cycle collector.
            functools.partial(_new_slot_buffer, buffer_cls, shape[1:], dtype, device, driver),
            _free_without_quiesce,
            lambda: driver.synchronize(device.index),
            mode=self.guarded,
            owns_guards=True,
            slot_type=_PoolSlot,
            name="UvaBufferPool",
        )
        self._slots: list[_PoolSlot] = self._ring.slots
        try:
            for slot in self._slots:
                self._ring.grow(slot, shape[0])
        except BaseException:
            self.close()
            raise
        self._row_bytes = math.prod(self._row_shape) * dtype.itemsize
        # Input type -> the adapter recognising it, so a foreign array costs one dict lookup.
        self._input_adapters: dict[type, interop.FrameworkAdapter] = {}
        self._uva = buffer_cls is not NonUvaBuffer and issubclass(buffer_cls, UvaBuffer)
        # Seed order: the first call uses slot 1 (or 0 when there is one slot).
        self._curr = 0
        self._no_events = False  # until a record returned None (see _record)

    # -- the hot path -------------------------------------------------------------------
    def copy_to_uva(self, x: Any, stream: Any = None) -> Any:
        """Write ``x`` (list, tuple, numpy, CPU torch or JAX array) into the next slot and
        return the device-visible first ``len(x)`` rows, as the pool's ``framework`` says.

        ``x`` must have the slot's trailing dimensions and a dtype that casts to the
        pool's within its kind (numpy ``same_kind``: ints to ints, floats to floats, bools
        anywhere), and from a wider dtype its values must fit the pool's (as
        :meth:`~jaxbuf.StagedWriteTensor.stage_write` checks: an int64 ``2**31`` is refused
        by an int32 pool, a finite float64 that overflows float32 by a float32 pool);
        anything else raises before a byte is written. ``stream`` (a
        ``torch.cuda.Stream`` or a DLPack stream number) names the consumer stream for
        guarded pools.
        """
        n = self._write(x, stream)
        slot = self._slots[self._curr].buffer
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
                castable = self._castable[source.dtype] = self._cast_kind(source.dtype)
            if castable != _SAFE:
                source = self._narrowed(source, castable)
        n = shape[0]
        i = self._curr + 1
        if i == self.max_concurrency:
            i = 0
        slot = self._slots[i]
        if self.guarded is not None:
            self._guard(slot, i, n, stream)
        elif n > slot.capacity:
            self._grow(slot, n)
        if ptr is None:
            slot.host[:n] = source
        else:  # a C-contiguous host array of the pool's dtype (a CPU torch tensor): one memmove
            ctypes.memmove(slot.host_ptr, ptr, n * self._row_bytes)
        self._curr = i
        return n

    def _copy_as(self, framework: str, x: Any, stream: Any) -> Any:
        """:meth:`copy_to_uva` returning ``framework``'s array, whatever the pool's."""
        n = self._write(x, stream)
        return self._slots[self._curr].buffer._publish(framework, n)

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
    def _cast_kind(self, dtype: np.dtype) -> int:
        target = self._np_dtype
        if np.can_cast(dtype, target, casting="safe"):
            return _SAFE
        if np.can_cast(dtype, target, casting="same_kind"):
            return _NARROWING
        return _REFUSED

    def _narrowed(self, source: np.ndarray, castable: int) -> np.ndarray:
        """``source`` when its values fit the pool's dtype (the slot assignment casts it),
        else TypeError / ValueError naming what does not fit.

        A min/max pre-check costs about 2 µs per 4 KiB and only runs for inputs of a wider
        dtype; anything outside it goes to the staged writes' conversion (``convert_any``), the
        one place that decides what fits (a float that rounds to the largest finite value
        does; NaN does) and names the first value that does not."""
        if castable == _REFUSED:
            raise TypeError(f"cannot write {source.dtype} data into a {self.dtype} pool")
        bounds = self._bounds
        if not source.size or (
            bounds is not None and bounds[0] <= source.min() and source.max() <= bounds[1]
        ):
            return source
        flat = convert_any(source.reshape(-1), self._np_dtype, self.dtype.name)
        return flat.reshape(source.shape)

    def _as_source(self, x: Any) -> tuple[Any, int | None]:
        """``(numpy array, None)`` for ``x``, or ``(x, address)`` when ``x`` is a foreign host
        array of the pool's dtype that can be copied in place (a contiguous CPU torch
        tensor): ``_write`` then copies it with one memmove, skipping numpy."""
        if isinstance(x, (list, tuple)):
            if len(x) == 0:
                if self._row_shape:
                    # No rows, so no row shape to check: refused as the seed's numpy
                    # assignment refuses it (vLLM's tests match this message).
                    raise ValueError(
                        "could not broadcast input array from shape (0,) into shape "
                        f"{(0, *self._row_shape)}: an empty list has no row shape; pass an "
                        f"empty array of shape {(0, *self._row_shape)}"
                    )
                return np.empty(0, self._np_dtype), None
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

    def _guard(self, slot: _PoolSlot, i: int, n: int, stream: Any) -> None:
        """Guarded modes: record the previous hand-out's event, wait for (or refuse) slot
        ``i``'s, grow it to ``n`` rows if needed, and mark it handed out (UNRECORDED)."""
        previous = self._slots[self._curr]
        if previous.guard is UNRECORDED:
            self._record(previous, stream)
        if slot.guard is not None:
            self._ring.wait(slot, i)
        if n > slot.capacity:
            self._grow(slot, n)
        slot.guard = UNRECORDED

    def record_readers(self, stream: Any = None) -> None:
        """Guarded pools: mark the readers of the slot handed out last as enqueued on
        ``stream`` now (the next :meth:`copy_to_uva` does this by itself)."""
        previous = self._slots[self._curr]
        if previous.guard is UNRECORDED:
            self._record(previous, stream)

    def _record(self, slot: _PoolSlot, stream: Any) -> None:
        """Guard ``slot`` by an event recorded now on the consumer stream (none on a platform
        without asynchronous work). A failed record leaves it UNRECORDED: the next call
        records again, and reusing it before that costs a device-wide wait, never less."""
        consumer = self._consumer_stream(stream)
        if self._no_events:  # the CPU: nothing is made, so nothing to hold an interrupt for
            self._driver.record_event(consumer, self.device.index)
            slot.guard = None
            return
        with deferred_interrupts():  # recorded as it is made: an interrupt cannot leak it
            handle = self._driver.record_event(consumer, self.device.index)
            slot.guard = None if handle is None else DeviceEvent(self._driver, handle, 0)
        # A platform without asynchronous work never records one (1.4 µs a block saved).
        self._no_events = handle is None

    def _grow(self, slot: _PoolSlot, n: int) -> None:
        # The old slot is freed by the ring, not left to the collector (a driver failure
        # reaches the caller, with the pool already consistent): "done", like close(). Arrays
        # handed out from it keep its memory until they go; views of it raise at export. The
        # device is done with it (guarded) or the caller promised so (unguarded): no quiesce.
        self._ring.grow(slot, 1 << (n - 1).bit_length())

    # -- introspection and lifetime -----------------------------------------------------
    @property
    def buffer_cls(self) -> type:
        return self._buffer_cls

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """The bytes the slots hold now (each grows past ``size`` when a copy needs it)."""
        return sum(slot.buffer.nbytes for slot in self._held_slots() if slot.buffer is not None)

    def _held_slots(self) -> list[_PoolSlot]:
        ring = getattr(self, "_ring", None)
        return [] if ring is None else ring.slots

    def __repr__(self) -> str:
        if getattr(self, "_ring", None) is None:
            return "<UvaBufferPool: construction failed>"
        state = "closed" if self._closed else f"nbytes={self.nbytes}"
        return (
            f"UvaBufferPool(size={self.size}, dtype={self.dtype}, device={self.device}, "
            f"max_concurrency={self.max_concurrency}, buffer_cls={self._buffer_cls.__name__}, "
            f"{state})"
        )

    @property
    def slots(self) -> tuple[Any, ...]:
        """The slot buffers (for inspection and benchmarks; do not free them)."""
        return tuple(slot.buffer for slot in self._slots if slot.buffer is not None)

    @property
    def current_slot(self) -> int:
        """Index of the slot the last :meth:`copy_to_uva` wrote."""
        return self._curr

    def close(self) -> None:
        """Free every slot (waiting for guarded readers first): "done", as
        :meth:`UvaBuffer.free`; arrays handed out keep their slot's memory until they go.
        Safe to call twice.

        Best effort: a slot whose free fails stays in the pool and the next ``close()``
        retries it; the first error is raised, the others attached as notes."""
        self._close(quiesce=True)

    def _close(self, quiesce: bool) -> None:
        self._closed = True
        ring = getattr(self, "_ring", None)
        if ring is None:
            return
        if quiesce and any(slot.buffer is not None for slot in ring.slots):
            interop.quiesce(self.device)  # once for every slot
        # Recorded readers are waited for; an UNRECORDED slot's are covered by the quiesce
        # (or, from the collector, by the arrays' hold on the memory).
        ring.close(settle_unrecorded=False)

    free = close
    __reduce_ex__ = _refuse_copy

    def __enter__(self) -> UvaBufferPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _release: Any = release_when_collected) -> None:
        # No framework call on behalf of the collector (quiesce=False); arrays handed out
        # still hold their slots' memory.
        ring = getattr(self, "_ring", None)
        if ring is not None and ring.held:
            _release(lambda: self._close(quiesce=False), "a UvaBufferPool", driver=self._driver)


def _new_slot_buffer(
    buffer_cls: type, row_shape: tuple, dtype: Any, device: Any, driver: Any, rows: int
) -> Any:
    return buffer_cls((rows, *row_shape), dtype, device, driver=driver)


def _free_without_quiesce(buffer: Any) -> None:
    """Free a replaced or closed slot's buffer: "done" (arrays keep its memory); the pool
    has made sure the device no longer reads it (or quiesced once for every slot)."""
    buffer._free(False)
