"""Growable device byte buffers whose base pointer never moves.

An :class:`ExtensibleTensor` reserves address space for its maximum size once, then backs
it with physical memory on demand through a :class:`~jaxbuf.drivers.base.VmmDriver`
(CUDA virtual memory management on a GPU, ``mmap``/``memfd`` on the CPU). Views taken
before a grow stay valid after it, so a CUDA graph captured over the buffer keeps working.
"""

from __future__ import annotations

import itertools
import operator
import sys
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from jaxbuf import drivers as _drivers
from jaxbuf._intervals import IntervalSet
from jaxbuf.devices import Device, as_device, default_device
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.dtypes import uint8
from jaxbuf.views import BufferView

__all__ = ["ExtensibleTensor", "granule_size"]

# Commit granule floor. Committing in 2 MiB units keeps the number of driver
# allocations (and mappings) small, and matches the large-page size on x86 and the
# CUDA granularity on most GPUs.
_MIN_GRANULARITY = 2 * 1024 * 1024


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _as_int(value: Any, name: str) -> int:
    """``value`` as a Python int; TypeError naming it for bool, float, str, None, ..."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {value!r} of type {type(value).__name__}"
        ) from None


def _as_size(value: Any, name: str) -> int:
    """A non-negative int, or TypeError / ValueError naming ``value``."""
    size = _as_int(value, name)
    if size < 0:
        raise ValueError(f"{name} must be non-negative, got {size}")
    return size


def _as_size_list(values: Any, name: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {values!r}")
    return [_as_size(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _resolve_device_and_driver(
    device: Any, driver: VmmDriver | None
) -> tuple[Device, VmmDriver]:
    if device is None:
        device = default_device()
        if driver is not None and device.platform != driver.platform:
            device = Device(driver.platform, 0)
    else:
        device = as_device(device)
    if driver is None:
        driver = _drivers.get_vmm_driver(device)
    elif not isinstance(driver, VmmDriver):
        raise TypeError(f"driver must be a VmmDriver, got {driver!r}")
    if driver.platform != device.platform:
        raise ValueError(
            f"device {device} does not match the driver's platform {driver.platform!r}"
        )
    count = driver.device_count()
    if not 0 <= device.index < count:
        reason = driver.unavailable_reason()
        detail = f" ({reason})" if reason else ""
        raise ValueError(
            f"device {device} is out of range: {count} {device.platform} device(s)"
            f" available{detail}"
        )
    return device, driver


def granule_size(device: Any = None, driver: VmmDriver | None = None) -> int:
    """Commit granule of ``device``: the driver granularity, floored at 2 MiB.

    The result is a multiple of the driver granularity (the floor is rounded up to one).

    Examples
    --------
    >>> import jaxbuf
    >>> jaxbuf.granule_size("cpu") % (2 * 1024 * 1024)
    0
    """
    device, driver = _resolve_device_and_driver(device, driver)
    return _granule_size(driver, device.index)


def _granule_size(driver: VmmDriver, device_index: int) -> int:
    driver_granularity = driver.granularity(device_index)
    return _round_up(max(driver_granularity, _MIN_GRANULARITY), driver_granularity)


class _VirtualBuffer:
    """One reservation and the physical chunks mapped into it.

    Invariants (between calls):

    * ``_chunks`` is sorted by offset, chunks are disjoint, each was created, mapped and
      granted access as a whole; ``_chunk_offsets`` mirrors their offsets for bisection.
    * ``_committed`` (granule-aligned byte offsets) is exactly the union of the chunks,
      so no granule is mapped without access, and no recorded granule lacks memory.
    * ``_physical_bytes`` equals the summed chunk sizes.

    The one exception is a double fault (a rollback ``unmap`` that itself fails): the
    chunk stays tracked (in ``_chunks`` and ``_committed``, so nothing maps over it), the
    buffer refuses to grow (``_stranded`` names why) until :meth:`release_physical`
    unmaps it, and the original error carries the rollback failure as a note.
    """

    def __init__(
        self, max_bytes: int, device_index: int, driver: VmmDriver, granularity: int
    ) -> None:
        self._driver = driver
        self.device_index = device_index
        self.granularity = granularity
        self.reserved_size = _round_up(max(max_bytes, 1), granularity)
        self.base_ptr = 0
        self._committed = IntervalSet()
        self._chunks: list[tuple[int, int, Any]] = []  # (offset, size, handle)
        self._chunk_offsets: list[int] = []
        self._physical_bytes = 0
        # Handles unmapped but whose release failed; retried by release_physical.
        self._unreleased: list[Any] = []
        # Set after a double fault left a chunk mapped that could not be unmapped.
        self._stranded: str | None = None
        self._freed = False
        driver.ensure_context(device_index)
        self.base_ptr = driver.reserve(self.reserved_size, granularity)

    # -- queries --------------------------------------------------------------------
    @property
    def physical_bytes(self) -> int:
        return self._physical_bytes

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def chunk_containing(self, offset: int, size: int) -> bool:
        """Whether ``[offset, offset + size)`` lies within one chunk."""
        i = bisect_right(self._chunk_offsets, offset) - 1
        if i < 0:
            return False
        chunk_offset, chunk_size, _ = self._chunks[i]
        return offset + size <= chunk_offset + chunk_size

    # -- committing -----------------------------------------------------------------
    def ensure_committed_ranges(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Back every byte range ``[start, end)`` of ``ranges`` with physical memory.

        All or nothing: on any driver failure the chunks created by this call are
        unmapped and released again, and the original error propagates.
        """
        for start, end in ranges:
            if not 0 <= start <= end <= self.reserved_size:
                raise ValueError(
                    f"range [{start}, {end}) is outside the reservation of "
                    f"{self.reserved_size} bytes"
                )
        self._check_alive()
        if self._stranded is not None:
            raise RuntimeError(
                f"cannot commit: {self._stranded}; call release_physical() first"
            )
        granularity = self.granularity
        new_chunks: list[tuple[int, int, Any]] = []
        self._driver.ensure_context(self.device_index)
        try:
            for start, end in ranges:
                if start == end:
                    continue
                first = start // granularity * granularity
                last = _round_up(end, granularity)
                # Ranges of neighbouring segments may share a granule; gaps are taken
                # against the runs recorded so far, so a shared granule is mapped once.
                for gap_start, gap_end in self._committed.gaps(first, last):
                    new_chunks.append(self._commit_gap(gap_start, gap_end))
        except BaseException as error:
            for chunk in reversed(new_chunks):
                self._rollback_chunk(chunk, error)
            raise

    def _commit_gap(self, offset: int, size_end: int) -> tuple[int, int, Any]:
        """Create, map and grant one chunk over ``[offset, size_end)``; record it."""
        driver = self._driver
        size = size_end - offset
        ptr = self.base_ptr + offset
        # Out of memory: the CUDA driver already returns framework caches and retries.
        handle = driver.create(size, self.device_index)
        try:
            driver.map(ptr, size, handle)
        except BaseException as error:
            self._release_noting(handle, error)
            raise
        # Grant access over the whole contiguous mapped run that now contains the chunk:
        # ROCm rejects a set-access range starting inside a mapped region, and CUDA wants
        # ranges made of whole chunks; a merged run of whole chunks satisfies both.
        run_start, run_end = self._committed.run_bounds(offset, size_end)
        try:
            driver.set_access(
                self.base_ptr + run_start, run_end - run_start, self.device_index
            )
        except BaseException as error:
            if not self._unmap_and_release_noting(ptr, size, handle, error):
                # Mapped without access and cannot be unmapped: track it so that
                # release_physical retries, and refuse to grow until then.
                self._committed.add(offset, size_end)
                self._insert_chunk((offset, size, handle))
            raise
        # Only now is the run recorded: later commits skip recorded granules, so a
        # recorded granule must be mapped *and* accessible.
        self._committed.add(offset, size_end)
        self._insert_chunk((offset, size, handle))
        return offset, size, handle

    def _insert_chunk(self, chunk: tuple[int, int, Any]) -> None:
        i = bisect_left(self._chunk_offsets, chunk[0])
        self._chunk_offsets.insert(i, chunk[0])
        self._chunks.insert(i, chunk)
        self._physical_bytes += chunk[1]

    def _remove_chunk(self, offset: int) -> None:
        i = bisect_left(self._chunk_offsets, offset)
        del self._chunk_offsets[i]
        _, size, _ = self._chunks.pop(i)
        self._physical_bytes -= size

    def _release_noting(self, handle: Any, error: BaseException) -> bool:
        """Release ``handle``; on failure note it on ``error`` and keep it for later."""
        try:
            self._driver.release(handle)
        except Exception as rollback_error:  # noqa: BLE001 - reported as a note
            error.add_note(f"rollback: release failed too: {rollback_error!r}")
            self._unreleased.append(handle)
            return False
        return True

    def _unmap_and_release_noting(
        self, ptr: int, size: int, handle: Any, error: BaseException
    ) -> bool:
        """Undo a mapping during rollback; False when the chunk is still mapped."""
        try:
            self._driver.unmap(ptr, size)
        except Exception as rollback_error:  # noqa: BLE001 - reported as a note
            error.add_note(
                f"rollback: unmap(ptr={ptr:#x}, size={size}) failed too: "
                f"{rollback_error!r}; the chunk stays tracked and is retried by "
                "release_physical()"
            )
            self._stranded = f"a chunk at offset {ptr - self.base_ptr} could not be unmapped"
            return False
        self._release_noting(handle, error)
        return True

    def _rollback_chunk(self, chunk: tuple[int, int, Any], error: BaseException) -> None:
        offset, size, handle = chunk
        # A chunk whose unmap fails stays recorded (it is mapped and accessible).
        if self._unmap_and_release_noting(self.base_ptr + offset, size, handle, error):
            self._committed.discard(offset, offset + size)
            self._remove_chunk(offset)

    # -- releasing ------------------------------------------------------------------
    def release_physical(self) -> None:
        """Unmap and release every chunk, keeping the reservation.

        Best effort over all chunks: a chunk whose unmap fails stays tracked (and
        committed); the first error is raised with the others attached as notes.
        """
        if self._freed:
            return
        driver = self._driver
        driver.ensure_context(self.device_index)
        if not self._chunks and not self._unreleased:
            return
        # Pending work (a memset, a consumer's kernel) may still touch the pages.
        driver.synchronize(self.device_index)
        errors: list[BaseException] = []
        still_mapped: list[tuple[int, int, Any]] = []
        unreleased, self._unreleased = self._unreleased, []
        for handle in unreleased:
            try:
                driver.release(handle)
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                self._unreleased.append(handle)
        for chunk in self._chunks:
            offset, size, handle = chunk
            try:
                driver.unmap(self.base_ptr + offset, size)
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                still_mapped.append(chunk)
                continue
            try:
                driver.release(handle)
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                self._unreleased.append(handle)
        self._chunks = []
        self._chunk_offsets = []
        self._physical_bytes = 0
        self._committed.clear()
        for chunk in still_mapped:
            self._committed.add(chunk[0], chunk[0] + chunk[1])
            self._insert_chunk(chunk)
        if not still_mapped:
            self._stranded = None
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"release_physical: also failed: {other!r}")
            raise first

    def free(self) -> None:
        """Release the physical memory and the reservation. Idempotent."""
        if self._freed:
            return
        self.release_physical()
        if self.base_ptr:
            self._driver.free_reserved(self.base_ptr, self.reserved_size)
        self.base_ptr = 0
        self._freed = True

    @property
    def freed(self) -> bool:
        return self._freed

    def _check_alive(self) -> None:
        if self._freed:
            raise RuntimeError("the ExtensibleTensor has been freed")

    def __del__(
        self, _is_finalizing: Any = sys.is_finalizing, _warn: Any = warnings.warn
    ) -> None:
        # Bound as defaults: module globals may be gone at interpreter exit. Once the
        # interpreter is finalizing, the process returns its mappings itself, and the
        # platform runtime may already be torn down (a driver call can abort there).
        if _is_finalizing() or not getattr(self, "base_ptr", 0):
            return
        try:
            self.free()
        except Exception as error:  # noqa: BLE001 - reported, never hidden
            _warn(
                f"jaxbuf: freeing an ExtensibleTensor during garbage collection "
                f"failed: {error!r}",
                ResourceWarning,
                stacklevel=2,
            )


class ExtensibleTensor:
    """A device byte buffer that grows without moving its base pointer.

    The reservation is divided into contiguous segments whose committed bytes form a
    prefix of each: ``num_segments`` equal segments by default, or the explicit
    ``segment_capacities`` (in bytes, summing to ``max_num_bytes``).

    Invariants kept between calls:

    * ``base_ptr`` never changes until :meth:`free`; views stay valid across grows.
    * each segment's committed size only grows (until :meth:`release_physical`), never
      beyond its capacity, and its prefix is backed by mapped, accessible memory;
    * committed memory is tracked as sorted runs of granules, so the cost of a grow does
      not depend on how much is already committed;
    * a failed call (bad input or a driver error) leaves sizes and mappings as they were:
      chunks a failing grow created are unmapped and released again.

    Not thread-safe: callers serialize mutation (resizes, release, free).

    Parameters
    ----------
    max_num_bytes : int
        Bytes of address space to reserve (rounded up to the granule).
    device : str, int, torch.device, jax.Device or Device, optional
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ... Default: :func:`jaxbuf.devices.default_device`.
    num_segments : int
        Number of equal segments; must divide ``max_num_bytes``.
    segment_capacities : sequence of int, optional
        Explicit positive segment sizes summing to ``max_num_bytes``.
    driver : VmmDriver, optional
        Default: ``jaxbuf.drivers.get_vmm_driver(device)``.

    Examples
    --------
    >>> import jaxbuf
    >>> buf = jaxbuf.ExtensibleTensor(8 << 20, device="cpu", num_segments=2)
    >>> buf.resize_per_segment_(1024, zero_new=True)
    >>> buf.segment_view(1).nbytes
    1024
    >>> ptr = buf.base_ptr
    >>> buf.resize_segments_([4096, 2048])
    >>> buf.base_ptr == ptr, buf.num_bytes
    (True, 6144)
    >>> buf.free()
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: Any = None,
        num_segments: int = 1,
        segment_capacities: Sequence[int] | None = None,
        driver: VmmDriver | None = None,
    ) -> None:
        self._buffer: _VirtualBuffer | None = None
        self._ready_event: Any = None
        # Validate everything before the first driver call.
        max_num_bytes = _as_size(max_num_bytes, "max_num_bytes")
        num_segments = _as_int(num_segments, "num_segments")
        if num_segments < 1:
            raise ValueError(f"num_segments must be positive, got {num_segments}")
        if segment_capacities is None:
            if max_num_bytes % num_segments != 0:
                raise ValueError(
                    f"max_num_bytes ({max_num_bytes}) must be divisible by "
                    f"num_segments ({num_segments})"
                )
            capacities = [max_num_bytes // num_segments] * num_segments
        else:
            capacities = _as_size_list(segment_capacities, "segment_capacities")
            if not capacities or any(c <= 0 for c in capacities):
                raise ValueError(
                    f"segment_capacities must be non-empty and positive, got {capacities}"
                )
            if num_segments not in (1, len(capacities)):
                raise ValueError(
                    f"num_segments ({num_segments}) does not match the "
                    f"{len(capacities)} segment_capacities"
                )
            if sum(capacities) != max_num_bytes:
                raise ValueError(
                    f"segment_capacities sum to {sum(capacities)}, not "
                    f"max_num_bytes ({max_num_bytes})"
                )
        self._device, self._driver = _resolve_device_and_driver(device, driver)

        self._max_num_bytes = max_num_bytes
        self._segment_capacities = capacities
        self._segment_offsets = list(itertools.accumulate([0, *capacities[:-1]]))
        self._committed = [0] * len(capacities)
        self._buffer = _VirtualBuffer(
            max_num_bytes,
            self._device.index,
            self._driver,
            _granule_size(self._driver, self._device.index),
        )

    # -- views ----------------------------------------------------------------------
    def _view(self, offset: int, nbytes: int) -> BufferView:
        return BufferView(
            ptr=self._live_buffer().base_ptr + offset,
            nbytes=nbytes,
            dtype=uint8,
            shape=(nbytes,),
            device=self._device,
            owner=self,
            dlpack_device_type=self._driver.dlpack_device_type,
        )

    def full_view(self) -> BufferView:
        """Uint8 view spanning the whole reservation (only committed bytes may be
        touched)."""
        return self._view(0, self._max_num_bytes)

    def segment_view(self, index: int) -> BufferView:
        """Uint8 view over one segment's committed prefix, sized exactly to it."""
        i = _as_int(index, "segment index")
        if not 0 <= i < self.num_segments:
            raise IndexError(
                f"segment index {index!r} out of range for {self.num_segments} segment(s)"
            )
        return self._view(self._segment_offsets[i], self._committed[i])

    # -- growing --------------------------------------------------------------------
    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> None:
        """Grow every segment's committed prefix to ``bytes_per_segment``."""
        size = _as_size(bytes_per_segment, "bytes_per_segment")
        self.resize_segments_([size] * self.num_segments, zero_new)

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Grow each segment's committed prefix to ``sizes[i]`` bytes.

        Grow-only. With ``zero_new`` only the newly committed bytes are zeroed (on the
        driver's producer stream; a view's ``__dlpack__(stream=...)`` orders the
        consumer after it). All sizes are validated before anything is committed.

        On a driver error the sizes stay as they were. A failure while committing
        unmaps and releases every chunk this call created; a failure while zeroing
        leaves the new memory committed (mapped and accessible) but unclaimed, so a
        retry only zeroes.
        """
        new_sizes = _as_size_list(sizes, "sizes")
        if len(new_sizes) != self.num_segments:
            raise ValueError(f"expected {self.num_segments} sizes, got {len(new_sizes)}")
        for old, new, capacity in zip(self._committed, new_sizes, self._segment_capacities):
            if new < old:
                raise ValueError(
                    f"ExtensibleTensor is grow-only: cannot resize from {old} "
                    f"to {new} bytes per segment"
                )
            if new > capacity:
                raise ValueError(
                    f"requested {new} bytes per segment exceeds the segment "
                    f"capacity {capacity}"
                )
        buffer = self._live_buffer()
        grown = [
            (start + old, start + new)
            for start, old, new in zip(self._segment_offsets, self._committed, new_sizes)
            if new > old
        ]
        if not grown:
            return
        buffer.ensure_committed_ranges(grown)
        if zero_new:
            driver, index = self._driver, self._device.index
            for start, end in grown:
                driver.memset(buffer.base_ptr + start, 0, end - start, index)
            self._set_ready_event(driver.record_ready_event(index))
        self._committed = new_sizes

    def _set_ready_event(self, event: Any) -> None:
        previous, self._ready_event = self._ready_event, event
        if previous is not None:
            self._driver.destroy_event(previous)

    # -- releasing ------------------------------------------------------------------
    def release_physical(self) -> None:
        """Drop all physical pages but keep the reservation and its views.

        Waits for the device first. Every segment's committed size becomes 0.
        """
        buffer = self._live_buffer()
        try:
            buffer.release_physical()
        finally:
            self._committed = [0] * self.num_segments

    def free(self) -> None:
        """Release the memory and the reservation. Safe to call more than once."""
        buffer = self._buffer
        if buffer is None or buffer.freed:
            return
        buffer.free()
        self._committed = [0] * self.num_segments
        self._set_ready_event(None)

    close = free

    def __enter__(self) -> ExtensibleTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def _live_buffer(self) -> _VirtualBuffer:
        buffer = self._buffer
        if buffer is None or buffer.freed:
            raise RuntimeError("the ExtensibleTensor has been freed")
        return buffer

    # -- properties -----------------------------------------------------------------
    @property
    def num_bytes(self) -> int:
        """Current committed size in bytes, summed over all segments."""
        return sum(self._committed)

    @property
    def bytes_per_segment(self) -> int:
        """Committed prefix size of each segment (ValueError when they differ)."""
        return self._uniform(self._committed)

    @property
    def committed_sizes(self) -> list[int]:
        """Committed prefix size of every segment."""
        return list(self._committed)

    @property
    def num_segments(self) -> int:
        return len(self._segment_capacities)

    @property
    def segment_capacity_bytes(self) -> int:
        """Maximum size of each segment (ValueError when they differ)."""
        return self._uniform(self._segment_capacities)

    @property
    def segment_capacities(self) -> list[int]:
        return list(self._segment_capacities)

    @property
    def segment_offsets(self) -> list[int]:
        """Byte offset of each segment within the reservation."""
        return list(self._segment_offsets)

    @staticmethod
    def _uniform(values: list[int]) -> int:
        if any(v != values[0] for v in values):
            raise ValueError(f"segments differ: {values}")
        return values[0]

    @property
    def capacity_bytes(self) -> int:
        """Reserved bytes (``max_num_bytes`` rounded up to the granule)."""
        return self._buffer.reserved_size  # type: ignore[union-attr]

    @property
    def physical_bytes(self) -> int:
        """Physically mapped bytes, including granule rounding."""
        return 0 if self._buffer is None else self._buffer.physical_bytes

    @property
    def num_physical_chunks(self) -> int:
        """Number of driver allocations currently mapped into the reservation."""
        return 0 if self._buffer is None else self._buffer.num_chunks

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """Whether each segment's first ``sizes[i]`` bytes lie within a single driver
        allocation, as RDMA registration of the segment requires."""
        checked = _as_size_list(sizes, "sizes")
        if len(checked) != self.num_segments:
            raise ValueError(f"expected {self.num_segments} sizes, got {len(checked)}")
        buffer = self._live_buffer()
        return [
            buffer.chunk_containing(offset, size)
            for offset, size in zip(self._segment_offsets, checked)
        ]

    @property
    def granularity(self) -> int:
        """Commit granule in bytes (see :func:`granule_size`)."""
        return self._buffer.granularity  # type: ignore[union-attr]

    @property
    def base_ptr(self) -> int:
        """Address of the reservation (0 once freed)."""
        return 0 if self._buffer is None else self._buffer.base_ptr

    @property
    def device(self) -> Device:
        return self._device

    @property
    def driver(self) -> VmmDriver:
        return self._driver

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(device={self._device}, capacity={self._max_num_bytes}, "
            f"committed={self._committed}, physical_bytes={self.physical_bytes})"
        )
