"""The fused writer: the staged writes of many tensors, applied with one kernel launch.

:class:`FusedStagedWriter` (re-exported by :mod:`jaxbuf.staged`) turns the staged writes of
several :class:`~jaxbuf.staged.StagedWriteTensor` into one launch. An apply:

1. looks up the *layout* of its list of targets (the kernel's group table), cached by the
   targets' addresses, strides and item sizes;
2. takes the next of ``max_concurrency`` pinned (UVA) staging *slots*, waiting (when guarded)
   until the device is done reading its previous apply;
3. *packs* the tables and values there with the packer chosen at construction
   (:mod:`jaxbuf.staged._packing`: C, or numpy without the extension). The packed write table is
   already *resolved*: where writes overlap, the later one's elements are the only ones left
   (earlier writes dropped or split into their visible pieces, from the row index the C stager
   keeps as writes are staged), so no two entries overlap;
4. *submits*: the launcher chosen at construction (:mod:`jaxbuf.staged._launch`) runs the kernel, in
   parallel (one program per entry, in any order: the result is the in-order result); on CUDA
   on a stream, followed by an event that becomes every written tensor's ready event and
   guards the slot; on the CPU to completion.

A writer (with its packer) sees a tensor only through ``tensor.staging``, the tensor's
:class:`~jaxbuf.staged._host.StagingState`.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import interop
from .._checks import as_int as as_index
from .._errors import Cleanup, attempt
from .._interrupts import deferred_interrupts
from .._lifetime import release_when_collected
from .._resolve import resolve
from ..devices import Device
from ..drivers.base import VmmDriver
from ..kernels.reference import StagedLaunch
from ..uva._slots import UNRECORDED, PinnedSlot, PinnedSlotRing
from ._host import (
    GROUP_FIELDS,
    WRITE_FIELDS,
    FreedError,
    StagingState,
    check_backend,
    check_max_concurrency,
)
from ._launch import AppliedEvent, make_launcher, raw_stream
from ._packing import new_packer

__all__ = ["FusedStagedWriter"]

_MAX_CACHED_LAYOUTS = 64
# StagedLaunch's fields without its Python-level __new__: the apply builds one per call, and
# tuple.__new__ over a literal costs less than the tuple it replaced did to unpack.
_new_launch = tuple.__new__
#: On CUDA an apply that packs at least this many bytes is first copied into device memory by
#: one ``cuMemcpyAsync`` on the launch stream, and the kernel reads that copy: its programs
#: then read device memory instead of making dependent reads of pinned host memory across
#: the bus. That wins at every size measured, so every CUDA apply copies (H200, one process,
#: CUPTI kernel times: 256 writes, kernel 27 µs reading in place against 3.7 µs copy + 1.6 µs
#: kernel, end to end 58 -> 39 µs; 4,096 writes, 54 µs against 23 + 4 µs, 108 -> 84 µs). A
#: driver without ``copy_on_stream`` reads in place.
DEVICE_COPY_MIN_BYTES = 0


class _Layout:
    """What a writer caches per distinct list of targets: the group table and item sizes."""

    __slots__ = (
        "group_table",
        "group_bytes",
        "group_ids",
        "itemsizes",
        "itemsize_list",
        "uniform_itemsize",
    )

    def __init__(self, entries: Sequence[tuple]) -> None:
        # entries: (out_ptr, row_stride, elem_size, num_rows, device) per group
        self.group_table = np.array([e[:3] for e in entries], dtype=np.int64).reshape(-1)
        self.group_bytes = self.group_table.tobytes()
        self.group_ids = np.arange(len(entries), dtype=np.int64)
        self.itemsize_list = [e[2] for e in entries]
        self.itemsizes = np.array(self.itemsize_list, dtype=np.int64)
        self.uniform_itemsize = self.itemsize_list[0] if len(set(self.itemsize_list)) == 1 else 0


class _StagingSlot(PinnedSlot):
    """One staging slot of the writer's :class:`~jaxbuf.uva._slots.PinnedSlotRing`: pinned
    memory (``buffer``, a :class:`~jaxbuf.uva.UvaBuffer` of ``capacity`` bytes, None until
    first used) the packer fills; the kernel reads it, or on CUDA a device copy of it.

    ``host`` / ``ptr`` are its host and device-visible addresses, ``i64`` an int64 numpy view
    of it; its ``guard`` the :class:`~jaxbuf.staged._launch.AppliedEvent` after the last launch
    that read it (CUDA; UNRECORDED from the launch until that event is recorded, so a failed
    record costs a device-wide wait before reuse). ``device_copy``: device memory of
    ``capacity`` bytes that large applies are copied into (see :data:`DEVICE_COPY_MIN_BYTES`;
    None until one needs it), guarded by the same event, since the launch that reads it follows
    the copy on one stream.
    """

    __slots__ = ("i64", "host", "ptr", "device_copy")

    def __init__(self) -> None:
        super().__init__()
        self.i64: np.ndarray | None = None
        self.host = self.ptr = 0
        self.device_copy: Any = None

    def refresh(self) -> None:
        buffer = self.buffer
        if buffer is None:
            self.i64, self.host, self.ptr = None, 0, 0
        else:
            self.i64 = buffer.np.view(np.int64)
            self.host, self.ptr = buffer.host_ptr, buffer.device_ptr


def _new_staging_buffer(device: Device, driver: VmmDriver, nbytes: int) -> Any:
    from ..uva import UvaBuffer

    return UvaBuffer(nbytes, "uint8", device, driver=driver)


def _free_buffer(buffer: Any) -> None:
    buffer.free()


class FusedStagedWriter:
    """Applies the staged writes of several :class:`StagedWriteTensor` with one launch.

    Each apply builds the kernel's tables and packs every tensor's staged bytes into the next
    of ``max_concurrency`` pinned (UVA) staging slots (on CUDA copied to device memory on the
    launch stream, see :data:`DEVICE_COPY_MIN_BYTES`, else read in place); a slot
    grows (to a power of two) when an apply needs more. Tensors may have different dtypes.

    **Slot reuse.** A slot is written again ``max_concurrency`` applies later. With
    ``guarded=True`` (the default) the host first waits for the event recorded after that
    slot's launch, so a deep queue of applies stalls the host instead of corrupting an
    in-flight read (the check costs one event query). With ``guarded=False`` (the seed's
    contract) callers must not have more than ``max_concurrency`` applies in flight.

    Thread-safety: not thread-safe; one thread drives a writer. A writer cannot be pickled
    or copied (its slots are pinned memory of this process).

    Parameters
    ----------
    device : device spec or None
        The seed's order, ``(device, max_writes, max_concurrency)``; None means
        :func:`jaxbuf.default_device`.
    max_writes : int
        Writes per apply the slots are first sized for (they grow beyond).
    max_concurrency : int, optional
        Number of staging slots; default 2.
    backend : {"triton", "numpy"}
        ``"triton"``: the Triton kernel (compiled on CUDA, under Triton's interpreter on the
        CPU). ``"numpy"``: :func:`jaxbuf.kernels.apply_staged_writes_numpy`, CPU only; it is
        never chosen silently.
    guarded : bool
    driver : VmmDriver, optional
    device_copy_min_bytes : int or None
        CUDA: an apply that packs at least this many bytes is copied to device memory first
        (default :data:`DEVICE_COPY_MIN_BYTES`: every apply); None reads every slot in place.
    """

    def __init__(
        self,
        device: Any,
        max_writes: int,
        max_concurrency: int | None = None,
        *,
        backend: str = "triton",
        guarded: bool = True,
        driver: VmmDriver | None = None,
        device_copy_min_bytes: int | None = DEVICE_COPY_MIN_BYTES,
    ) -> None:
        self._ring: PinnedSlotRing | None = None
        self._slots: list[_StagingSlot] = []
        self._closed = True
        if _is_device_like(max_writes):
            raise TypeError(
                f"max_writes must be an integer, got {max_writes!r}: the arguments are "
                "(device, max_writes, max_concurrency), as in vLLM"
            )
        max_writes = as_index(max_writes, "max_writes")
        if not 1 <= max_writes < 1 << 31:  # one launch counts its writes in int32
            raise ValueError(f"max_writes must be in [1, 2**31), got {max_writes}")
        if device_copy_min_bytes is not None:
            device_copy_min_bytes = as_index(device_copy_min_bytes, "device_copy_min_bytes")
            if device_copy_min_bytes < 0:
                raise ValueError(
                    f"device_copy_min_bytes must be >= 0 or None, got {device_copy_min_bytes}"
                )
        max_concurrency = check_max_concurrency(max_concurrency)
        device, driver = resolve(device, driver)
        self.backend = check_backend(backend, device)
        self._device = device
        self.max_writes = max_writes
        self.max_concurrency = max_concurrency
        self.guarded = bool(guarded)
        self._driver = driver
        # Room for the tables plus ~16 four-byte elements per write; slots grow beyond.
        self._initial_slot_bytes = 1 << (max_writes * (WRITE_FIELDS * 8 + 64) + 4095).bit_length()
        # Slots get their memory on first use (and regrow). Guarded or not, a slot grows
        # only once its reader is done (its memory is freed); its guard is not owned (the
        # event is also the written tensors' ready event).
        self._ring = PinnedSlotRing(
            max_concurrency,
            functools.partial(_new_staging_buffer, device, driver),
            _free_buffer,
            functools.partial(driver.synchronize, device.index),
            mode="wait" if self.guarded else None,
            slot_type=_StagingSlot,
            name="FusedStagedWriter",
        )
        self._slots = self._ring.slots
        self._curr = max_concurrency - 1
        self._layouts: dict[tuple, _Layout] = {}
        # The strategies, each chosen once: how to pack, how to launch, how to submit.
        packer = new_packer()
        self._pack, self._clear = packer.pack, packer.clear
        self._launch = make_launcher(self.backend, device, driver)
        self._submit = self._submit_on_stream if device.is_cuda else self._submit_now
        copies = device.is_cuda and type(driver).copy_on_stream is not VmmDriver.copy_on_stream
        self._device_copy_min = device_copy_min_bytes if copies else None
        self._closed = False

    # -- the hot path ------------------------------------------------------------------------
    def apply(
        self,
        tensors: Sequence[Any],
        output_ptrs: Any = None,
        output_strides: Any = None,
        stream: Any = None,
    ) -> None:
        """Apply and clear the staged writes of ``tensors`` with one kernel launch.

        ``tensors`` may repeat no tensor; those with nothing staged cost nothing. As in the
        seed, ``output_ptrs`` / ``output_strides`` (sequences of ints, one per tensor) may
        redirect each tensor's writes to another address and row stride (in elements) of the
        same dtype; the caller then vouches for the bounds, and that no two targets overlap
        (overlaps are resolved within each tensor's writes). On CUDA the launch is enqueued on
        ``stream`` (a ``torch.cuda.Stream`` or a CUDA stream handle int) or torch's current
        stream, and every written tensor's ready event is recorded there, so DLPack consumers
        that pass their stream see the writes. Writes staged earlier take effect first; where
        two overlap the later wins. A tensor's staged writes are cleared only once the launch
        was enqueued. A freed tensor among ``tensors`` raises
        :class:`~jaxbuf.staged.FreedError` (a ``RuntimeError``) and nothing is applied, unless
        nothing at all is staged. ``tensors`` may be any iterable (a generator is read once);
        anything in it that is not a ``StagedWriteTensor`` (a JAX ``StagedWrites`` included:
        apply those with ``jaxbuf.jax_ops.apply_staged_writes``) is a ``TypeError``.
        """
        if (output_ptrs is None) != (output_strides is None):
            raise ValueError("output_ptrs and output_strides go together; pass both or neither")
        if type(tensors) is not list and type(tensors) is not tuple:
            tensors = _as_sequence(tensors)  # a generator is read once, here
        try:
            staged_bytes = [len(t.staging.records) for t in tensors]
        except AttributeError:
            raise _not_tensors(tensors) from None
        if not sum(staged_bytes):
            return
        if self._closed:
            raise FreedError("FusedStagedWriter", "closed", "make a new writer to apply again")
        if output_ptrs is None:
            key = tuple([t.staging.group_entry for t in tensors])
        else:
            key = self._external_key(tensors, output_ptrs, output_strides)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._new_layout(tensors, key)
        num_groups = len(staged_bytes)

        i = self._curr + 1
        if i == self.max_concurrency:
            i = 0
        slot = self._slots[i]
        if slot.guard is not None and self.guarded:
            self._ring.wait(slot)  # the device may still read this slot's previous apply
        pack = self._pack
        num_writes, contents_start, total = pack(tensors, staged_bytes, layout, slot)
        if total > slot.capacity:  # nothing was packed: grow the slot and pack again
            self._grow(slot, total)
            num_writes, contents_start, total = pack(tensors, staged_bytes, layout, slot)
        self._curr = i

        ptr = slot.ptr
        copy = None
        threshold = self._device_copy_min
        if threshold is not None and total >= threshold:
            copy = (self._device_copy(slot), ptr, total)
            ptr = copy[0]
        # The table is resolved (no two entries overlap): always the parallel launch.
        launch = _new_launch(
            StagedLaunch,
            (ptr + num_groups * GROUP_FIELDS * 8, ptr, ptr + contents_start, num_writes),
        )
        self._submit(tensors, staged_bytes, i, launch, stream, copy)

    def _submit_now(
        self,
        tensors: Sequence[Any],
        staged_bytes: Sequence[int],
        i: int,
        launch: StagedLaunch,
        stream: Any,
        copy: Any = None,
    ) -> None:
        """The CPU: the launch runs to completion here; no stream, no event (no copy)."""
        self._launch(launch, 0, self._tables(i, len(staged_bytes), launch.num_writes))
        self._clear()

    def _submit_on_stream(
        self,
        tensors: Sequence[Any],
        staged_bytes: Sequence[int],
        i: int,
        launch: StagedLaunch,
        stream: Any,
        copy: Any = None,
    ) -> None:
        """CUDA: enqueue the launch on ``stream`` after the targets' earlier writes (and after
        ``copy``, ``(device_dst, slot_src, size)``, when the kernel reads a device copy), then
        record the event that orders consumers and guards the slot."""
        driver, index = self._driver, self._device.index
        raw = raw_stream(stream, self._device)
        dlpack_stream = raw or 1  # DLPack and CUDA agree on 1 (legacy) and 2
        # A tensor last written on another stream: order this launch after those writes.
        for t in tensors:
            applied = t.staging.applied
            if applied is not None and applied.stream != dlpack_stream:
                driver.stream_wait_event(dlpack_stream, applied.handle, index)
        # The launcher makes the device's context current (a fresh thread has none) and
        # enqueues the copy before the launch: one C call (driver.copy_and_launch). When it
        # raises, nothing was launched and the copy is done: the writes stay staged.
        self._launch(launch, raw, None, copy)
        # Enqueued: the device reads the slot until the event below says otherwise; the
        # writes are applied whatever fails next, so no longer staged.
        slot = self._slots[i]
        slot.guard = UNRECORDED
        self._clear()
        with deferred_interrupts():  # recorded as it is made: an interrupt cannot leak it
            try:
                handle = driver.record_event(dlpack_stream, index)
            except BaseException as error:
                self._synchronize_without_event(tensors, error)
                raise
            event = AppliedEvent(driver, handle, dlpack_stream)
            slot.guard = event
        for t, n in zip(tensors, staged_bytes):
            if n:
                t.staging.applied = event

    def _synchronize_without_event(self, tensors: Sequence[Any], error: BaseException) -> None:
        """The launch is enqueued but its event could not be recorded. With no event to wait
        on, the device is synchronized here so that the targets are safe to reuse; the slot
        stays UNRECORDED (its reuse synchronizes again, should this fail too); ``error`` gets
        notes saying so."""
        for t in tensors:
            t.staging.applied = None
        what = "synchronizing after the failed event record"
        attempt(error, what, self._driver.synchronize, self._device.index)
        error.add_note("the staged writes were launched and are applied; they are no longer staged")

    def _tables(self, i: int, num_groups: int, num_writes: int) -> tuple[np.ndarray, np.ndarray]:
        """Numpy views of slot ``i``'s write table and group table."""
        i64, table_start = self._slots[i].i64, num_groups * GROUP_FIELDS
        write_table = i64[table_start : table_start + num_writes * WRITE_FIELDS]
        return (
            write_table.reshape(num_writes, WRITE_FIELDS),
            i64[:table_start].reshape(num_groups, GROUP_FIELDS),
        )

    # -- slots -----------------------------------------------------------------------------
    def _grow(self, slot: _StagingSlot, nbytes: int) -> None:
        """Replace ``slot``'s memory by at least ``nbytes`` (a power of two)."""
        self._ring.grow(slot, max(self._initial_slot_bytes, 1 << (nbytes - 1).bit_length()))

    def _device_copy(self, slot: _StagingSlot) -> int:
        """The address of ``slot``'s device copy, (re)made at the slot's capacity."""
        copy = slot.device_copy
        if copy is None or copy.reserved_size < slot.capacity:
            from .._reservation import committed_buffer

            # Releasing the old copy synchronizes the device first: no reader is left.
            new = committed_buffer(
                self._driver, slot.capacity, self._device.index, "FusedStagedWriter staging copy"
            )
            slot.device_copy = new
            if copy is not None:
                copy.release()
            copy = new
        return copy.base_ptr

    # -- layouts ---------------------------------------------------------------------------
    def _external_key(
        self,
        tensors: Sequence[Any],
        output_ptrs: Any,
        output_strides: Any,
    ) -> tuple:
        ptrs = [as_index(p, "output_ptrs entry") for p in _host_ints(output_ptrs)]
        strides = [as_index(s, "output_strides entry") for s in _host_ints(output_strides)]
        if not len(ptrs) == len(strides) == len(tensors):
            raise ValueError(
                f"{len(tensors)} tensors but {len(ptrs)} output_ptrs and "
                f"{len(strides)} output_strides"
            )
        entries = []
        for t, ptr, stride in zip(tensors, ptrs, strides):
            entry = t.staging.group_entry
            if entry is None:
                raise FreedError("StagedWriteTensor", "freed", f"cannot apply {t!r}")
            if ptr % entry[2] or stride < 0:
                raise ValueError(
                    f"output pointer {ptr:#x} / stride {stride} do not suit {t.dtype} elements"
                )
            entries.append((ptr, stride, *entry[2:]))
        return tuple(entries)

    def _new_layout(self, tensors: Sequence[Any], key: tuple) -> _Layout:
        seen = set()
        for t in tensors:
            state = t.staging
            if not isinstance(state, StagingState):
                raise _not_tensors([t])
            if state.group_entry is None:
                raise FreedError("StagedWriteTensor", "freed", f"cannot apply {t!r}")
            if t.device != self._device:
                raise ValueError(f"{t!r} is on {t.device}; this writer applies on {self._device}")
            if id(t) in seen:
                raise ValueError(f"{t!r} appears twice in one apply")
            seen.add(id(t))
        if len(self._layouts) >= _MAX_CACHED_LAYOUTS:
            self._layouts.clear()
        layout = self._layouts[key] = _Layout(key)
        return layout

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight applies, free the staging slots. Idempotent.

        Best effort: a slot whose free fails (a driver error) stays, and the next
        ``close()`` retries it; the first error is raised, the others attached as notes."""
        ring = self._ring
        if ring is None:
            return
        copies = any(s.device_copy is not None for s in ring.slots)
        if self._closed and not ring.held and not copies:
            return
        self._closed = True
        cleanup = Cleanup("FusedStagedWriter.close")
        # The ring first: it waits for each slot's reader (the device copy's too).
        cleanup.run(ring.close)
        for slot in ring.slots:
            if slot.device_copy is None:
                continue
            with deferred_interrupts(collect=cleanup.errors):  # released and recorded at once
                if cleanup.run(slot.device_copy.release):
                    slot.device_copy = None
        cleanup.raise_first()

    free = close

    def __enter__(self) -> FusedStagedWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def device(self) -> Device:
        """Where the writes are applied, a :class:`~jaxbuf.Device` (the faces give their
        framework's device here; library code reads :func:`~jaxbuf.as_device` of it)."""
        return self._device

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """The pinned staging bytes the slots hold now (0 before the first apply)."""
        return sum(max(slot.capacity, 0) for slot in self._slots)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"nbytes={self.nbytes}"
        return (
            f"FusedStagedWriter(device={self._device}, max_writes={self.max_writes}, "
            f"max_concurrency={self.max_concurrency}, backend={self.backend!r}, {state})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a FusedStagedWriter cannot be pickled or copied: its staging slots are pinned "
            "memory of this process, and its in-flight applies are tracked by events there; "
            "make a new writer instead"
        )

    def __del__(self, _release: Any = release_when_collected) -> None:
        if not getattr(self, "_closed", True):
            _release(self.close, "a FusedStagedWriter", driver=getattr(self, "_driver", None))


def _is_device_like(value: Any) -> bool:
    """Whether ``value`` can only be a device spec, never a write count: a string, a
    :class:`~jaxbuf.Device`, or a framework's device object (``torch.device``, a JAX
    device). Refused as ``max_writes`` with the argument order named."""
    if isinstance(value, (str, Device)):
        return True
    if isinstance(value, (int, np.integer)) or value is None:
        return False
    return hasattr(value, "platform") or hasattr(value, "type")


def _as_sequence(tensors: Any) -> tuple:
    """``tensors`` (an iterable other than a list or tuple) as a tuple, read once."""
    if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__"):
        raise _not_tensors(tensors)
    return tuple(tensors)


def _not_tensors(tensors: Any) -> TypeError:
    """The TypeError for ``tensors`` that are not all StagedWriteTensor, naming the first
    item that is not one."""
    bad = tensors
    if isinstance(tensors, (list, tuple)):
        bad = next((t for t in tensors if not hasattr(t, "staging")), tensors)
    hint = ""
    if type(bad).__name__ == "StagedWrites":
        hint = "; a JAX StagedWrites is applied with jaxbuf.jax_ops.apply_staged_writes"
    return TypeError(
        f"tensors must be an iterable of StagedWriteTensor, got {reprlib.repr(bad)} "
        f"({type(bad).__name__}){hint}"
    )


def _host_ints(values: Any) -> list:
    """A sequence, numpy array or framework array (torch, JAX, any device) as a list."""
    if type(values) is list or type(values) is tuple:
        return list(values)
    adapter = interop.adapter_for(values)
    if adapter is not None:
        return adapter.to_numpy(values).tolist()
    return list(values)
