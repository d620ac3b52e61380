"""The staged-write tensor: a 2-D target whose row writes are staged on the host and applied in
one launch (:class:`StagedWriteTensor`; the package docstring of :mod:`jaxbuf.staged` says how).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .. import interop
from .._convert import convert
from .._lifetime import release_when_collected
from .._owner import Lifetime
from .._reservation import VirtualBuffer, committed_buffer
from .._resolve import resolve
from ..devices import Device
from ..drivers.base import VmmDriver
from ..views import BufferView
from ._fused import FusedStagedWriter
from ._host import (
    RECORD_BYTES,
    STRUCT_CODES,
    FreedError,
    StagingState,
    as_index,
    check_backend,
    check_dtype,
    check_max_concurrency,
    pack_record,
    target_shape,
)

__all__ = ["StagedWriteTensor"]

_ndarray = np.ndarray
_NOT_COPYABLE = (
    "a StagedWriteTensor cannot be pickled or copied: it owns memory mapped in this process "
    "and writes staged against it; copy its contents instead (to_numpy().copy(), "
    "to_torch().clone())"
)


class _Target:
    """The allocation of a :class:`StagedWriteTensor` (:class:`jaxbuf._owner.OwnedAllocation`):
    the memory the writes land in, a :class:`~jaxbuf.uva.UvaBuffer` or an
    :class:`~jaxbuf.extensible.ExtensibleTensor` that nothing else exports.

    The tensor's :class:`~jaxbuf._owner.Lifetime` anchors it, so framework arrays keep it
    (and only it: not the tensor, its staging or its writer) alive after ``free()``; the last
    one to go releases it through ``__del__``.
    """

    __slots__ = ("buffer", "device", "driver", "__weakref__")

    def __init__(self, buffer: Any, device: Device, driver: VmmDriver) -> None:
        self.buffer = buffer
        self.device = device
        self.driver = driver

    @property
    def released(self) -> bool:
        return self.buffer is None

    def release(self) -> None:
        """Free the memory; raises on a driver failure (a retry frees it)."""
        buffer = self.buffer
        if buffer is None:
            return
        if self.device.is_cuda:
            # A consumer's kernel may still read it on any stream (the last array was just
            # dropped; torch's allocator does not wait either): finish before unmapping.
            self.driver.synchronize(self.device.index)
        # Never a framework call here: this may run in a DLPack deleter on a framework's
        # thread. The owner's free() waited for the frameworks before an immediate release.
        if isinstance(buffer, VirtualBuffer):
            buffer.release()
        else:
            buffer._free(quiesce=False)  # a UvaBuffer this object alone owns
        self.buffer = None

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "buffer", None) is not None:
            _release(self.release, "a StagedWriteTensor's memory", driver=self.driver)


class StagedWriteTensor:
    """A 2-D target whose row writes are staged on the host and applied in one launch.

    Invariants: the target (``gpu``) never moves and starts zeroed; staged writes are in
    bounds and already converted to the target dtype (a rejected write raises and stages
    nothing); writes take effect at the next apply, in staging order (later wins where they
    overlap).

    ``size`` is ``(num_rows, row_len)``, or an int ``n``: a 1-D target of ``n`` elements
    that is ``n`` rows of one element, as in the seed, so ``stage_write_elem(i, v)`` sets
    element ``i``. The target is device memory (an :class:`~jaxbuf.extensible.ExtensibleTensor`,
    committed whole, so it occupies at least one 2 MiB granule) or, with
    ``uva_instead_of_gpu``, pinned host memory the device reads in place (a
    :class:`~jaxbuf.uva.UvaBuffer`; slower to read, spares device memory).

    ``gpu`` is a :class:`~jaxbuf.views.BufferView` of the target, consumable through DLPack:
    ``torch.from_dlpack(swt.gpu)`` and ``jax.dlpack.from_dlpack(swt.gpu)`` (or
    :meth:`to_torch` / :meth:`to_jax` / :meth:`to_numpy`) alias the memory, and a consumer
    that passes its stream is ordered after the applied writes. Such an array keeps the memory
    alive (:attr:`live_exports` counts them).

    Lifetime: :meth:`free` (or :meth:`close`, or leaving a ``with`` block) means "I am done".
    It drops the staged writes, waits for the applied ones, frees the staging slots, and
    releases the memory at once when no exported array is alive, else when the last one goes
    (:attr:`released` says which). Every later use (``stage_write``, ``apply_write``, ``gpu``,
    a view's export) raises :class:`FreedError`, a ``RuntimeError`` (and a ``ValueError``,
    as before). Idempotent; after a driver error a second call frees what is left. A tensor
    cannot be pickled or copied.

    Thread-safety: one tensor is not thread-safe (one thread stages and applies it); separate
    tensors may be staged from separate threads.

    ``staging`` is the :class:`~jaxbuf.staged._host.StagingState` of the tensor: the one
    object a writer (:class:`FusedStagedWriter`, its packer) reads or changes, never the
    tensor's own attributes. It is the writers' contract, not for user code.

    Parameters
    ----------
    size : int or (int, int)
    dtype : int32, int64, float32, float16 or bfloat16 (numpy, torch, JAX dtype or str)
    device : device spec, optional
        Default: :func:`jaxbuf.devices.default_device`.
    max_concurrency : int, optional
        Staging slots of the tensor's own writer (:meth:`apply_write`); default 2.
    uva_instead_of_gpu : bool
    backend : {"triton", "numpy"}
        How :meth:`apply_write` launches; ``"numpy"`` only on the CPU.
    driver : VmmDriver, optional
    """

    __slots__ = (
        "shape",
        "dtype",
        "device",
        "num_rows",
        "row_len",
        "max_concurrency",
        "backend",
        "uva_instead_of_gpu",
        "_driver",
        "_np_dtype",
        "staging",
        "_stage_record",
        "_stage_contents",
        "_stage_fast",
        "_pack",
        "_code",
        "_packers",
        "_allocation",
        "_lifetime",
        "_view",
        "_writer",
        "__weakref__",
    )

    def __init__(
        self,
        size: Any,
        dtype: Any,
        device: Any = None,
        max_concurrency: int | None = None,
        uva_instead_of_gpu: bool = False,
        *,
        backend: str = "triton",
        driver: VmmDriver | None = None,
    ) -> None:
        self._lifetime = None  # set last: until then there is nothing for free() to do
        self._allocation = None
        self._writer = None
        shape, num_rows, row_len = target_shape(size)
        dtype = check_dtype(dtype)
        max_concurrency = check_max_concurrency(max_concurrency)
        device, driver = resolve(device, driver)
        backend = check_backend(backend, device)
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.num_rows = num_rows
        self.row_len = row_len
        self.max_concurrency = max_concurrency
        self.backend = backend
        self.uva_instead_of_gpu = bool(uva_instead_of_gpu)
        self._driver = driver
        self._np_dtype = dtype.numpy
        code = STRUCT_CODES.get(dtype.name)
        self._code = code
        self._pack = struct.Struct(code).pack if code is not None else None
        self._packers: dict[int, Any] = {}
        staging = self.staging = StagingState(num_rows, row_len, self._np_dtype)
        # Bound once: staging clears these buffers in place, and a call through a bound method
        # skips two attribute lookups on the hot path.
        self._stage_record = staging.records.extend
        self._stage_contents = staging.contents.extend
        self._stage_fast = None if staging.stager is None else staging.stager.stage

        nbytes = max(num_rows * row_len * dtype.itemsize, 1)
        if self.uva_instead_of_gpu:
            from ..uva import UvaBuffer

            buffer = UvaBuffer(nbytes, "uint8", device, driver=driver)  # zeroed
            ptr = buffer.device_ptr
        else:
            buffer = committed_buffer(driver, nbytes, device.index, "StagedWriteTensor target")
            try:
                driver.memset(buffer.base_ptr, 0, nbytes, device.index)
                # The zeroing ran on the driver's stream; applies run on torch's. Finish it
                # once here rather than ordering every apply after it.
                driver.synchronize(device.index)
            except BaseException:
                buffer.release()
                raise
            ptr = buffer.base_ptr
        self._allocation = _Target(buffer, device, driver)
        view = BufferView(ptr, nbytes, dtype, shape, device, self, driver.dlpack_device_type)
        view._pack_versioned()  # as this owner's; then kept ownerless, so as to refer to no
        # handle: a StagedWriteTensor dropped without free() goes at once (no cycle)
        self._view = view._with_owner(None)
        # What the fused writer's group table needs, and what makes its cache key unique.
        staging.group_entry = (ptr, row_len, dtype.itemsize, num_rows, device)
        self._lifetime = Lifetime(self._allocation)

    # -- staging ---------------------------------------------------------------------------
    def stage_write(self, row: int, start: int, values: Any) -> None:
        """Stage ``target[row, start:start + len(values)] = values``.

        ``values``: a list, tuple, range, generator, numpy array, torch tensor (a CUDA one is
        copied to the host) or JAX array, 1-D. A 1-D C-contiguous numpy array of the target's
        dtype (with ``row`` and ``start`` Python ints) takes the fast path, one C call; a list
        or tuple is packed by ``struct``.
        Other inputs are converted through numpy. Values are refused (``ValueError`` /
        ``TypeError``, nothing staged) where conversion would change them beyond a float's
        rounding: integers out of the dtype's range; non-integral, NaN or infinite floats to
        an integer dtype (integral floats such as ``3.0`` are accepted); finite values that
        overflow a float dtype; complex, string or object values. Integers and floats to a
        float dtype round to the nearest representable value; bools are 0 and 1.

        ``IndexError`` (nothing staged) unless ``0 <= row < num_rows``, ``start >= 0`` and
        ``start + len(values) <= row_len``. An empty ``values`` stages nothing.
        :class:`FreedError` once the tensor is freed.
        """
        fast = self._stage_fast
        if fast is not None and fast(row, start, values):
            return  # staged by C: exact ints, a contiguous 1-D buffer of the dtype, in bounds
        kind = type(values)
        if kind is _ndarray and values.dtype is self._np_dtype and values.ndim == 1:
            n = len(values)
        elif (kind is list or kind is tuple) and self._code is not None:
            n = len(values)
            values = self._pack_sequence(values, n)
        else:
            values = convert(values, self._np_dtype, self.dtype.name)
            n = len(values)
        if type(row) is not int or type(start) is not int:
            row, start = as_index(row, "row"), as_index(start, "start")
        # A freed tensor has num_rows 0: every write fails here, and _bounds_error says why.
        if row < 0 or row >= self.num_rows or start < 0 or start + n > self.row_len:
            raise self._bounds_error(row, start, n)
        if not n:
            return
        try:
            self._stage_contents(values)  # the raw bytes, through the buffer protocol
        except TypeError:  # a non-contiguous array; nothing was appended
            self._stage_contents(np.ascontiguousarray(values))
        self._stage_record(pack_record(0, row, start, 0, n))

    def _pack_sequence(self, values: list | tuple, n: int) -> Any:
        """A list or tuple as the target's bytes, range-checked by ``struct`` (C speed);
        anything ``struct`` refuses goes through the full conversion for its verdict."""
        pack = self._packers.get(n)
        if pack is None:
            pack = struct.Struct(f"={n}{self._code[1]}").pack
            if len(self._packers) < 4096:
                self._packers[n] = pack
        try:
            return pack(*values)
        except (struct.error, OverflowError, TypeError):
            return convert(values, self._np_dtype, self.dtype.name)

    def stage_write_elem(self, row: int, value: Any) -> None:
        """Stage ``target[row, 0] = value`` (the seed's semantics; for a 1-D target, element
        ``row``). ``value`` is converted under the rules of :meth:`stage_write`."""
        pack = self._pack
        kind = type(value)
        if pack is not None and (kind is int or (kind is float and self.dtype.name[0] == "f")):
            try:
                data = pack(value)
            except (struct.error, OverflowError):
                data = convert([value], self._np_dtype, self.dtype.name).tobytes()
        else:
            if kind is _ndarray or np.isscalar(value) or getattr(value, "ndim", None) == 0:
                adapter = interop.adapter_for(value)
                items = np.asarray(value) if adapter is None else adapter.to_numpy(value)
                items = items.reshape(1)
            else:
                raise TypeError(
                    f"value must be one number, got {type(value).__name__}; use stage_write "
                    "for a sequence"
                )
            data = convert(items, self._np_dtype, self.dtype.name).tobytes()
        if type(row) is not int:
            row = as_index(row, "row")
        if row < 0 or row >= self.num_rows or self.row_len < 1:
            raise self._bounds_error(row, 0, 1)
        self._stage_contents(data)
        self._stage_record(pack_record(0, row, 0, 0, 1))

    def _bounds_error(self, row: int, start: int, length: int) -> Exception:
        if self.freed:
            return self._freed_error("stage a write")
        if not 0 <= row < self.num_rows:
            return IndexError(f"row {row} out of range for a tensor of {self.num_rows} rows")
        return IndexError(
            f"write of {length} element(s) at start {start} does not fit in row {row} of "
            f"length {self.row_len}"
        )

    def clear_staged_writes(self) -> None:
        """Drop every write staged since the last apply."""
        self.staging.clear()

    @property
    def num_staged_writes(self) -> int:
        return len(self.staging.records) // RECORD_BYTES

    @property
    def nbytes(self) -> int:
        """The target's size in bytes (``num_rows * row_len * itemsize``; 0 once freed)."""
        return self.num_rows * self.row_len * self.dtype.itemsize

    # -- applying --------------------------------------------------------------------------
    def apply_write(self, stream: Any = None) -> None:
        """Apply and clear the staged writes with one launch (see :meth:`FusedStagedWriter.apply`).

        Uses the tensor's own writer (made on first use), whose ``max_concurrency`` staging
        slots bound how many applies may be in flight; with the default guard the host waits
        rather than overwrite a slot the device still reads. Its slots are sized for the
        writes staged, and grow to the next power of two when an apply needs more (never for
        the whole target: one write to a tall tensor stages a few bytes).
        :class:`FreedError` once the tensor is freed (its staged writes were dropped by
        ``free()``).
        """
        if self._lifetime.anchor is None:
            raise self._freed_error("apply writes")
        if not self.staging.records:
            return
        writer = self._writer
        if writer is None:
            writer = self._writer = FusedStagedWriter(
                self.device,
                self.num_staged_writes,
                self.max_concurrency,
                backend=self.backend,
                driver=self._driver,
            )
        writer.apply((self,), stream=stream)

    # -- the owner contract of ``gpu`` (jaxbuf._owner.MemoryOwner) ----------------------------
    @property
    def driver(self) -> VmmDriver:
        return self._driver

    @property
    def ready_event(self) -> Any:
        """The event after the last applied writes (a consumer stream waits on it)."""
        applied = self.staging.applied
        return None if applied is None else applied.handle

    def check_exportable(self) -> None:
        if self._lifetime.anchor is None:
            raise self._freed_error("export its memory")

    @property
    def export_anchor(self) -> object:
        """What an export keeps alive: the anchor over the target memory (not this tensor)."""
        return self._lifetime.anchor

    @property
    def live_exports(self) -> int:
        """Framework arrays made from ``gpu`` (DLPack capsules, numpy arrays) still alive."""
        return self._lifetime.live_exports

    @property
    def released(self) -> bool:
        """Whether the target memory is gone (after :meth:`free`, once the last exported
        array is)."""
        return self._lifetime.released

    # -- the target ------------------------------------------------------------------------
    @property
    def gpu(self) -> BufferView:
        """The target as a DLPack-consumable view (shape ``size``, dtype ``dtype``)."""
        if self._lifetime.anchor is None:
            raise self._freed_error("view its memory")
        return self._view._with_owner(self)

    def to_torch(self) -> Any:
        """A torch tensor aliasing the target, ordered after the applied writes; it keeps the
        memory alive."""
        return self.gpu.to_torch()

    def to_jax(self) -> Any:
        """A JAX array aliasing the target; it keeps the memory alive."""
        return self.gpu.to_jax()

    def to_numpy(self) -> np.ndarray:
        """A numpy array aliasing the target: CPU targets only (``BufferError`` on a GPU); it
        keeps the memory alive."""
        return self.gpu.to_numpy()

    @staticmethod
    def _freed_error(action: str) -> FreedError:
        return FreedError(
            "StagedWriteTensor",
            "freed",
            f"cannot {action} (arrays exported before free() keep the memory until they are gone)",
        )

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` was called (see :attr:`released` for the memory)."""
        return self._lifetime.anchor is None

    def free(self) -> None:
        """Say "I am done"; see the class docstring. Idempotent."""
        lifetime = self._lifetime
        if lifetime is None:  # the constructor failed; its parts free themselves
            return
        if not lifetime.closed:
            self.staging.close()
            self.num_rows = 0  # every later stage_write fails its bounds check (and says why)
            if lifetime.close(self._release):
                return
        if lifetime.live_exports:
            # Exported arrays use the memory (also after a free() interrupted right after the
            # close): the last to go releases it (_Target.__del__). Ours are only the writes
            # in flight and the writer's slots.
            self._allocation = None
        self._release(self._allocation)  # also the retry after a failed free()

    def _release(self, allocation: _Target | None) -> None:
        """Wait for the applied writes, free the writer's slots, then release ``allocation``
        after the frameworks' pending work on the device (None: the exports' to release).
        Each part is dropped only once it is freed: after a driver error, ``free()`` again
        frees what is left."""
        staging = self.staging
        applied = staging.applied
        if applied is not None:
            applied.wait()  # raising here releases nothing: the device may still write
            staging.applied = None
        try:
            writer = self._writer
            if writer is not None:
                writer.close()
                self._writer = None
        finally:
            if allocation is not None:
                interop.quiesce(self.device)
                allocation.release()
            self._allocation = None

    close = free

    def __enter__(self) -> StagedWriteTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def __copy__(self) -> StagedWriteTensor:
        raise TypeError(_NOT_COPYABLE)

    def __deepcopy__(self, memo: dict) -> StagedWriteTensor:
        raise TypeError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPYABLE)

    def __del__(self, _release: Any = release_when_collected) -> None:
        lifetime = getattr(self, "_lifetime", None)
        if lifetime is not None and lifetime.anchor is not None:
            _release(self.free, "a StagedWriteTensor", driver=getattr(self, "_driver", None))

    def __repr__(self) -> str:
        lifetime = getattr(self, "_lifetime", None)
        if lifetime is None:
            return "<StagedWriteTensor: construction failed>"
        if not lifetime.closed:
            state = f"staged={self.num_staged_writes}"
        elif lifetime.released:
            state = "freed"
        else:
            state = f"freed, {lifetime.live_exports} live export(s)"
        return (
            f"StagedWriteTensor(shape={self.shape}, dtype={self.dtype}, "
            f"device={self.device}, {state})"
        )
