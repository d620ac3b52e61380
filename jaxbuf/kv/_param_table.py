"""Per-request scalars at a fixed device address, uploaded only when they change
(:class:`DeviceParamTable`)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import interop
from .._checks import as_count, as_max_concurrency
from .._errors import Cleanup, ClosedError, Rollback
from .._interrupts import deferred_interrupts
from .._lifetime import release_or_retry_later
from .._resolve import resolve
from ..devices import Device, DeviceLike, as_device
from ..drivers.base import VmmDriver
from ..dtypes import DType, canonical_dtype
from ..extensible import ExtensibleTensor
from ..uva import UvaBuffer
from ..uva._slots import UNRECORDED, DeviceEvent, PinnedSlot, PinnedSlotRing
from ..views import BufferView

__all__ = ["FIELD_ALIGNMENT", "DeviceParamTable", "ParamField"]

_NOTHING_HELD = contextlib.nullcontext()

#: Every field starts at a multiple of this many bytes of the table: 8 is what any scalar
#: needs; 64 is what JAX needs to import host memory (the CPU driver's) without a copy.
FIELD_ALIGNMENT = 64


class ParamField:
    """One column of a :class:`DeviceParamTable`: ``np`` (the host values, the source of
    truth, written freely) and ``gpu`` (a :class:`~jaxbuf.BufferView` of the same column in
    device memory: what the last :meth:`DeviceParamTable.sync` uploaded). Both have
    :attr:`shape`: ``(num_rows,)``, or ``(num_rows, width)`` for a field given a width
    (row-major: a request's row is contiguous).

    ``np`` is always the table's own column: ``field.np = values`` writes ``values`` into it
    (as ``field.np[...] = values`` does: an array of :attr:`shape` or a scalar; ``ValueError``
    naming the field for any other shape, and for integers outside an integer field's range;
    a value that fails to convert changes nothing), so the next :meth:`~DeviceParamTable.sync`
    uploads them; it never rebinds the name to an array the table does not see. ``gpu``
    cannot be rebound."""

    __slots__ = ("name", "dtype", "offset", "_np", "_gpu")

    def __init__(self, name: str, dtype: DType, offset: int, host: np.ndarray, gpu: BufferView):
        self.name, self.dtype, self.offset = name, dtype, offset
        self._np = host
        self._gpu = gpu

    @property
    def np(self) -> np.ndarray:
        return self._np

    @np.setter
    def np(self, values: Any) -> None:
        host = self._np
        if values is host:
            return  # field.np += 1 rebinds the column to itself
        array = np.asarray(values)
        if array.shape not in ((), host.shape):
            held = (
                f"{len(host)} values"
                if host.ndim == 1
                else f"{host.shape[0]} rows of {host.shape[1]} values"
            )
            raise ValueError(
                f"field {self.name!r} holds {held}; got an array of shape {array.shape}"
            )
        # Converted whole before the column is touched: a value that fails to convert
        # changes nothing (numpy's assignment writes the values before it).
        converted = array.astype(host.dtype)
        integers = host.dtype.kind in "iu" and array.dtype.kind in "iu"
        if integers and not np.array_equal(converted, array):  # numpy wraps, silently
            raise ValueError(
                f"field {self.name!r} holds {host.dtype}; got values outside its range "
                f"({array.min()} to {array.max()})"
            )
        host[...] = converted

    @property
    def gpu(self) -> BufferView:
        return self._gpu

    @property
    def shape(self) -> tuple[int, ...]:
        """``(num_rows,)``, or ``(num_rows, width)`` for a field given a width."""
        return self._np.shape

    def __repr__(self) -> str:
        return f"ParamField({self.name!r}, {self.dtype}, shape={self.shape}, offset={self.offset})"


class _TableOwner:
    """Owner of the field views (:class:`jaxbuf._owner.MemoryOwner`): the device table's
    memory, ordered after the last upload (its ``ready_event``)."""

    __slots__ = ("tensor", "event", "closed")

    def __init__(self, tensor: ExtensibleTensor) -> None:
        self.tensor = tensor
        self.event: DeviceEvent | None = None  # the last upload's
        self.closed = False

    @property
    def device(self) -> Device:
        return as_device(self.tensor.device)

    @property
    def driver(self) -> VmmDriver:
        return self.tensor.driver

    @property
    def ready_event(self) -> Any:
        event = self.event
        return self.tensor.ready_event if event is None else event.handle

    def check_exportable(self) -> None:
        if self.closed:
            raise ClosedError("DeviceParamTable", "closed")
        self.tensor.check_exportable()

    @property
    def export_anchor(self) -> Any:
        return None if self.closed else self.tensor.export_anchor

    def committed_ranges(self, ptr: int, nbytes: int) -> list[tuple[int, int]]:
        return self.tensor.committed_ranges(ptr, nbytes)


class _StagingSlot(PinnedSlot):
    """A pinned snapshot of the host table; ``host`` is its numpy array (None when freed)."""

    __slots__ = ("host",)

    def __init__(self) -> None:
        super().__init__()
        self.host: Any = None

    def refresh(self) -> None:
        self.host = None if self.buffer is None else self.buffer.np


def _check_fields(fields: Any) -> list[tuple[str, DType, tuple[int, ...]]]:
    """``[(name, DType, row_shape)]`` from a mapping or a sequence of pairs, each value a
    dtype (``row_shape`` ``()``) or a ``(dtype, width)`` pair (``(width,)``); ValueError
    naming a bad or repeated name, an unknown dtype or a width that is not a positive int."""
    items = fields.items() if isinstance(fields, Mapping) else fields
    if isinstance(items, (str, bytes)):
        raise TypeError(f"fields must map names to dtypes, got {fields!r}")
    try:
        pairs = [tuple(item) for item in items]
    except TypeError:
        raise TypeError(f"fields must map names to dtypes, got {fields!r}") from None
    checked: list[tuple[str, DType, tuple[int, ...]]] = []
    for pair in pairs:
        if len(pair) != 2:
            raise TypeError(f"a field must be a (name, dtype) pair, got {pair!r}")
        name, spec = pair
        if not isinstance(name, str) or not name:
            raise ValueError(f"field names must be non-empty strings, got {name!r}")
        if any(name == seen for seen, _, _ in checked):
            raise ValueError(f"field {name!r} is named twice")
        dtype, row_shape = spec, ()
        if isinstance(spec, (tuple, list)):  # (dtype, width): a column of rows of width values
            if len(spec) != 2:
                raise ValueError(
                    f"field {name!r}: expected a dtype or (dtype, width), got {spec!r}"
                )
            dtype, width = spec
            try:
                row_shape = (as_count(width, "its width"),)
            except (TypeError, ValueError) as error:
                raise ValueError(f"field {name!r}: {error}") from None
        try:
            checked.append((name, canonical_dtype(dtype), row_shape))
        except TypeError as error:
            raise ValueError(f"field {name!r}: {error}") from None
    if not checked:
        raise ValueError("a DeviceParamTable needs at least one field")
    return checked


def _layout(
    num_rows: int, fields: list[tuple[str, DType, tuple[int, ...]]]
) -> tuple[list[int], int]:
    """Each field's byte offset (a multiple of :data:`FIELD_ALIGNMENT`) and the table size."""
    offsets, end = [], 0
    for _, dtype, row_shape in fields:
        start = -(-end // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
        offsets.append(start)
        end = start + num_rows * math.prod(row_shape) * dtype.itemsize
    return offsets, -(-end // FIELD_ALIGNMENT) * FIELD_ALIGNMENT


def _check_host_bytes(nbytes: int) -> None:
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not Linux/macOS
        return
    if nbytes > limit:
        raise ValueError(
            f"the table needs {nbytes} bytes of host memory (its values, staging copies), "
            f"more than this host's {limit} bytes"
        )


class SyncedValues:
    """The table's values as its last completed :meth:`DeviceParamTable.sync` left them,
    shared with the frameworks that take values rather than aliases (the JAX wing).

    ``state`` is ``(changed_syncs, values)``: how many syncs have uploaded a change, and the
    table's bytes then (immutable ``bytes``; zeros before the first). Replaced as one
    attribute, so a reader sees either the old pair or the new one. ``closed`` once the
    table is."""

    __slots__ = ("state", "closed")

    def __init__(self, nbytes: int) -> None:
        self.state: tuple[int, bytes] = (0, bytes(nbytes))
        self.closed = False


def _device_wait(driver: VmmDriver, device: Device) -> None:
    """The ring's fallback: the frameworks' pending work, then the whole device."""
    interop.quiesce(device)
    driver.synchronize(device.index)


class DeviceParamTable:
    """Per-request scalars (sampling parameters) and short rows (block tables) in one device
    buffer at a fixed address.

    ``fields`` maps each name to a dtype, or to ``(dtype, width)`` for a row of ``width``
    values per request (a mapping, or ``(name, spec)`` pairs, in order); each field is a
    column of shape ``(num_rows,)`` or ``(num_rows, width)``, row-major, starting at a
    multiple of :data:`FIELD_ALIGNMENT` bytes. ``table[name].np`` is the host source of
    truth (a numpy array, written freely); ``table[name].gpu`` the device column (a
    :class:`~jaxbuf.BufferView`, for ``to_torch`` / DLPack), which never moves, so a torch
    step imports it once (:meth:`arrays`).

    :meth:`sync` uploads the whole table with one copy on the driver's stream, and only when
    a host value changed since the last upload: a step that admits no request copies
    nothing. Changes are found by comparing the host table with the last snapshot uploaded
    (one ``memcmp`` of the table's bytes). The snapshot sits in one of ``max_concurrency``
    pinned staging slots, rewritten only once its copy is done (an event). A step in flight
    keeps reading the old values: on CUDA the copy goes on the driver's producer stream (the
    legacy default stream, as every jaxbuf producer write), ordered after the work already
    enqueued on blocking streams (torch's default stream is one) and before what they
    enqueue later; a consumer on a non-blocking stream exports the field again
    (``gpu.to_torch()`` orders it after the last upload).

    JAX gets values, not the device table: ``arrays("jax")`` holds immutable JAX arrays of
    the last sync's values, uploaded afresh (one transfer, one dispatch) at the first access
    after a changed sync, so a step in flight keeps its old arrays and a sync never waits
    for JAX. ``gpu.to_jax()`` instead aliases the device table: such an array changes value
    at a sync, and a step dispatched with it may read the old or the new values (a race);
    ``arrays("jax")`` is the ordered way.

    Not thread-safe. Not picklable or copyable. :meth:`close` (or ``free``) means done;
    arrays over the device table keep its memory while they live.
    """

    def __init__(
        self,
        num_rows: int,
        fields: Any,
        device: DeviceLike | None = None,
        max_concurrency: int | None = None,
        *,
        driver: VmmDriver | None = None,
    ) -> None:
        self._closed = True  # until everything is made
        self._fields: dict[str, ParamField] = {}
        num_rows = as_count(num_rows, "num_rows")
        checked = _check_fields(fields)
        count = as_max_concurrency(max_concurrency)
        offsets, nbytes = _layout(num_rows, checked)
        _check_host_bytes((2 + count) * nbytes)
        device, driver = resolve(device, driver)
        self.num_rows, self.nbytes, self.max_concurrency = num_rows, nbytes, count
        self.device, self._driver = device, driver
        self._host = np.zeros(nbytes, np.uint8)
        with Rollback("DeviceParamTable") as undo:  # a failure frees what was made
            tensor = ExtensibleTensor(nbytes, device, driver=driver)
            undo.push(tensor.free)
            tensor.resize_per_segment_(nbytes, zero_new=True)
            self._tensor = tensor
            self._owner = _TableOwner(tensor)
            base = tensor.full_view()
            self._device_ptr = base.ptr
            for (name, dtype, row_shape), offset in zip(checked, offsets):
                shape = (num_rows, *row_shape)
                field_bytes = math.prod(shape) * dtype.itemsize
                host = self._host[offset : offset + field_bytes].view(dtype.numpy)
                gpu = BufferView(
                    base.ptr + offset,
                    field_bytes,
                    dtype,
                    shape,
                    device,
                    self._owner,
                    base.dlpack_device_type,
                )
                self._fields[name] = ParamField(name, dtype, offset, host.reshape(shape), gpu)
            self._ring = PinnedSlotRing(
                count,
                functools.partial(UvaBuffer, dtype="uint8", device=device, driver=driver),
                UvaBuffer.free,
                functools.partial(_device_wait, driver, device),
                mode="wait",
                owns_guards=False,  # the last upload's event is also the views' ready event
                slot_type=_StagingSlot,
                name="DeviceParamTable",
            )
            undo.push(self._ring.close)
            for slot in self._ring.slots:  # every slot now: the first uploads stay cheap
                self._ring.grow(slot, nbytes)
            # Whether the driver's copies run asynchronously (a platform with events).
            with deferred_interrupts():  # made and destroyed as one step
                probe = driver.record_ready_event(device.index)
                self._asynchronous = probe is not None
                if probe is not None:
                    destroy = functools.partial(driver.destroy_event, probe)
                    release_or_retry_later(destroy, "an event", driver)
        # The bytes the device holds (zeros until the first upload); None: unknown, after a
        # failed upload, so the next sync uploads whatever the host holds. Compared as
        # bytes: one copy and a memcmp, faster than numpy's comparisons at table sizes.
        self._uploaded: bytes | None = bytes(nbytes)
        self._synced = SyncedValues(nbytes)
        self._next = 0
        self._arrays: dict[str, Mapping[str, Any]] = {}
        self._closed = False

    # -- access ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParamField:
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; fields: {', '.join(self._fields)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    @property
    def fields(self) -> dict[str, ParamField]:
        return dict(self._fields)

    def arrays(self, framework: str) -> Mapping[str, Any]:
        """Each field as an array of ``framework`` (``"torch"``, ``"jax"``, ...): a mapping
        made on the first call, the same object after. Never donate its arrays to a jitted
        step.

        * A framework of mutable arrays (torch, numpy): a dict of arrays over the device
          columns, imported once; they alias the device table, so a step reads what the last
          :meth:`sync` uploaded, with no import or host transfer per step.
        * A framework of immutable arrays (JAX): a live mapping whose items hold the values
          of the last :meth:`sync`, uploaded afresh on the first access after a changed sync
          (the same array objects until then). It is a JAX pytree whose leaves are those
          arrays, so ``step(caches, table.arrays("jax"))`` passes each step the current
          values, ordered by JAX's own dependencies: a step in flight keeps the arrays it
          was dispatched with. Hold the mapping, not its items, across syncs."""
        self._check_open()
        arrays = self._arrays.get(framework)
        if arrays is None:
            adapter = interop.get(framework)
            if adapter.mutable_arrays:
                arrays = {name: adapter.from_view(f.gpu) for name, f in self._fields.items()}
            else:
                from ._jax_table import JaxParamArrays  # the JAX wing: JAX only once asked

                arrays = JaxParamArrays(self._synced, self._fields.values(), self.device)
            self._arrays[framework] = arrays
        return arrays

    @property
    def device_ptr(self) -> int:
        """Address of the device table (fixed until :meth:`close`)."""
        return self._device_ptr

    # -- upload ---------------------------------------------------------------------------
    def changed(self) -> bool:
        """Whether a host value differs from what the device holds (what :meth:`sync`
        would upload)."""
        return self._host.tobytes() != self._uploaded

    def sync(self) -> bool:
        """Upload the whole table if a host value changed since the last upload; return
        whether it copied. One copy, stream-ordered on the driver's stream after the work
        already enqueued (see the class docstring); it waits only when every staging slot
        still feeds a copy in flight."""
        self._check_open()
        current = self._host.tobytes()
        if current == self._uploaded:
            return False
        self._uploaded = None  # until the copy is enqueued: a failure leaves it unknown
        self._upload(current)
        # JAX's values before the record of the upload: an interrupt between the two leaves
        # the upload unrecorded, so the next sync repeats both (never the device table new
        # and JAX's values old with nothing left to sync).
        changed_syncs, _ = self._synced.state
        self._synced.state = (changed_syncs + 1, current)  # what JAX's next access uploads
        self._uploaded = current
        return True

    def _upload(self, current: bytes) -> None:
        ring, index = self._ring, self._next
        slot = ring.slots[index]
        # The slot's event is held through the wait and destroyed here, unless it is still
        # the views' ready event: a failure, or an interrupt as it is destroyed, reaches the
        # caller (dropped, a finalizer would destroy it, and report the interrupt as ignored).
        guard = slot.guard
        ring.wait(slot, index)
        if isinstance(guard, DeviceEvent) and guard is not self._owner.event:
            guard.release()
        slot.host[:] = np.frombuffer(current, np.uint8)
        driver, device = self._driver, self.device
        slot.guard = UNRECORDED  # the copy may read it from now on
        # No wait for JAX: its steps read snapshots (arrays("jax")), never the device table,
        # so a step in flight cannot see this copy. Torch's default stream is ordered with it.
        driver.copy(self._device_ptr, slot.host.ctypes.data, self.nbytes, device.index)
        # Recorded as it is made: an interrupt cannot leak it (the CPU makes none: no block).
        with deferred_interrupts() if self._asynchronous else _NOTHING_HELD:
            handle = driver.record_ready_event(device.index)
            event = None if handle is None else DeviceEvent(driver, handle, 1)
            slot.guard = event
            self._owner.event = event
        self._next = (index + 1) % len(ring.slots)

    # -- lifetime -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("DeviceParamTable", "closed")

    def close(self) -> None:
        """Done: waits for the uploads in flight, frees the staging slots and the device
        table (which arrays over it keep while they live). Safe to call twice."""
        if getattr(self, "_ring", None) is None:
            return
        self._closed = True
        self._owner.closed = True
        self._synced.closed = True
        self._arrays = {}
        cleanup = Cleanup("DeviceParamTable.close")
        # The upload events (each a slot's guard and, the last one, the views' ready event)
        # are held here while the ring closes and destroyed by close() itself, not by a
        # finalizer: a failure, or an interrupt as one is destroyed, reaches the caller.
        holders = [self._owner.event, *(slot.guard for slot in self._ring.slots)]
        events = {id(e): e for e in holders if isinstance(e, DeviceEvent)}
        cleanup.run(self._ring.close)
        self._owner.event = None
        # A slot the ring could not settle (its close failed) keeps its event for the retry.
        for slot in self._ring.slots:
            events.pop(id(slot.guard), None)
        with deferred_interrupts(collect=cleanup.errors):  # each destroyed and forgotten
            for event in events.values():
                cleanup.run(event.release)
        cleanup.run(self._tensor.free)
        cleanup.raise_first()

    free = close

    def __enter__(self) -> DeviceParamTable:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a DeviceParamTable cannot be pickled or copied: it owns device and pinned "
            "memory; make a new one and copy the host values (table[name].np)"
        )

    __copy__ = __deepcopy__ = __reduce_ex__

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        names = ", ".join(
            f"{n}: {f.dtype}" if len(f.shape) == 1 else f"{n}: ({f.dtype}, {f.shape[1]})"
            for n, f in self._fields.items()
        )
        return (
            f"DeviceParamTable({self.num_rows} rows, {{{names}}}, device={self.device}, "
            f"nbytes={self.nbytes}, {state})"
        )
