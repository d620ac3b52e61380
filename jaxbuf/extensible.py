"""Growable device byte buffers whose base pointer never moves.

An :class:`ExtensibleTensor` reserves address space for its maximum size once, then backs
it with physical memory on demand through a :class:`~jaxbuf.drivers.base.VmmDriver`
(CUDA virtual memory management on a GPU, ``mmap``/``memfd`` on the CPU). Views taken
before a grow stay valid after it, so a CUDA graph captured over the buffer keeps working.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from jaxbuf._checks import as_int as _as_int
from jaxbuf._errors import attempt, raise_first
from jaxbuf._intervals import IntervalSet
from jaxbuf._lifetime import release_when_collected
from jaxbuf._resolve import resolve
from jaxbuf._segments import SegmentedReservation
from jaxbuf.devices import Device, as_device
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.views import BufferView

__all__ = ["ExtensibleTensor", "granule_size"]

# Commit granule floor. Committing in 2 MiB units keeps the number of driver
# allocations (and mappings) small, and matches the large-page size on x86 and the
# CUDA granularity on most GPUs.
_MIN_GRANULARITY = 2 * 1024 * 1024
# Sizes must fit DLPack's int64 shapes (and size_t, which ctypes would silently wrap).
_MAX_BYTES = (1 << 63) - _MIN_GRANULARITY


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


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


def _parse_peer_specs(peers: Any, owner_platform: str | None) -> list[Device]:
    """Device specs -> Devices, without touching a driver: a single spec or an iterable of
    them; TypeError / ValueError naming a bad spec, a platform other than the owner's
    (when known) or a duplicate."""
    if isinstance(peers, (str, bytes)) or not isinstance(peers, Iterable):
        peers = [peers]
    parsed: list[Device] = []
    for spec in peers:
        peer = as_device(spec)
        if owner_platform is not None and peer.platform != owner_platform:
            raise ValueError(
                f"peer device {peer} is not on the owner's platform {owner_platform!r}"
            )
        if peer in parsed:
            raise ValueError(f"peer device {peer} is given twice")
        parsed.append(peer)
    return parsed


def _check_peers(peers: list[Device], device: Device, driver: VmmDriver) -> None:
    """Each peer is distinct from ``device``, exists, and can access its memory."""
    count = driver.device_count()
    for peer in peers:
        if peer.platform != device.platform:
            raise ValueError(
                f"peer device {peer} is not on the owner's platform {device.platform!r}"
            )
        if peer == device:
            raise ValueError(f"peer device {peer} is the owner device itself")
        if not 0 <= peer.index < count:
            raise ValueError(
                f"peer device {peer} is out of range: {count} {device.platform} device(s)"
                " available"
            )
    for peer in peers:
        if not driver.can_access_peer(peer.index, device.index):
            raise ValueError(
                f"peer device {peer} cannot access memory on {device} (no peer-to-peer "
                "support between them: cuDeviceCanAccessPeer says no)"
            )


def granule_size(device: Any = None, driver: VmmDriver | None = None) -> int:
    """Commit granule of ``device``: the driver granularity, floored at 2 MiB.

    The result is a multiple of the driver granularity (the floor is rounded up to one).

    Examples
    --------
    >>> import jaxbuf
    >>> jaxbuf.granule_size("cpu") % (2 * 1024 * 1024)
    0
    """
    device, driver = resolve(device, driver)
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
        # Devices granted read/write on every committed run: the owner, then its peers.
        # Every set_access goes through this tuple (see grant_access).
        self.access_devices: tuple[int, ...] = (device_index,)
        # Chunk identity for cross-process sharing (jaxbuf.sharing): offset -> a number
        # never reused by this buffer, so an importer tells a recreated chunk from the old.
        self._chunk_ids: dict[int, int] = {}
        self._chunk_id_counter = itertools.count(1)
        # Temporary reservations that defragment could not clean up (an unmap or a
        # free_reserved failed): (ptr, size, [(ptr, size, handle) still mapped there]).
        # release_physical retries them.
        self._stray_reservations: list[tuple[int, int, list[tuple[int, int, Any]]]] = []
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
        # Grant the new chunk only, the owner and its peers in one call: a range of whole
        # chunks, as cuMemSetAccess requires (PyTorch's expandable segments grant the same
        # way). Recorded chunks keep the access they were granted; re-granting the merged
        # run, as the seed did, changes nothing and costs time growing with the run (0.7 ms
        # at 48 GiB committed on an H200, issue 15). Existing mappings are never touched, so
        # CUDA graphs captured over the reservation stay valid.
        try:
            driver.set_access_many(ptr, size, self.access_devices)
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

    def chunk_records(self) -> list[tuple[int, int, Any, int]]:
        """``(offset, size, handle, chunk_id)`` of every mapped chunk, by offset."""
        return [(o, n, h, self._chunk_ids[o]) for o, n, h in self._chunks]

    def _insert_chunk(self, chunk: tuple[int, int, Any]) -> None:
        self._chunk_ids[chunk[0]] = next(self._chunk_id_counter)
        i = bisect_left(self._chunk_offsets, chunk[0])
        self._chunk_offsets.insert(i, chunk[0])
        self._chunks.insert(i, chunk)
        self._physical_bytes += chunk[1]

    def _remove_chunk(self, offset: int) -> None:
        i = bisect_left(self._chunk_offsets, offset)
        del self._chunk_offsets[i]
        _, size, _ = self._chunks.pop(i)
        self._physical_bytes -= size
        self._chunk_ids.pop(offset, None)

    def _release_noting(self, handle: Any, error: BaseException) -> bool:
        """Release ``handle``; on failure note it on ``error`` and keep it for later."""
        if attempt(error, "rollback: release", self._driver.release, handle):
            return True
        self._unreleased.append(handle)
        return False

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

    def grant_access(self, device_indices: tuple[int, ...]) -> None:
        """Grant ``device_indices`` read/write on every committed run, then add them to
        :attr:`access_devices` so that later commits grant them too.

        On a driver failure :attr:`access_devices` is unchanged; runs granted before the
        failure stay accessible to the new devices (access is only ever added, and no
        recorded granule loses access).
        """
        self._check_alive()
        if not device_indices:
            return
        driver = self._driver
        driver.ensure_context(self.device_index)
        # Runs are unions of whole chunks, as set_access requires.
        for start, end in list(self._committed):
            driver.set_access_many(self.base_ptr + start, end - start, device_indices)
        self.access_devices = self.access_devices + tuple(device_indices)

    # -- defragmenting (one chunk per span, for RDMA registration) ---------------------
    def chunks_tiling(self, first: int, last: int) -> list[tuple[int, int, Any]]:
        """The chunks that exactly tile ``[first, last)`` (granule-aligned, committed).

        ValueError when a chunk crosses either end: it is shared with a neighbouring
        span, so ``[first, last)`` cannot become one chunk of its own.
        """
        lo = bisect_left(self._chunk_offsets, first)
        hi = bisect_left(self._chunk_offsets, last)
        chunks = self._chunks[lo:hi]
        cursor = first
        for offset, size, _ in chunks:
            if offset != cursor:
                break
            cursor += size
        if not chunks or chunks[0][0] != first or cursor != last:
            raise ValueError(
                f"bytes [{first}, {last}) are not exactly covered by whole chunks: a chunk "
                "is shared with a neighbouring segment"
            )
        return chunks

    def defragment_span(self, first: int, last: int) -> bool:
        """Replace the chunks tiling ``[first, last)`` by one chunk with the same bytes at
        the same addresses. False when one chunk already covers it.

        Steps: a new chunk is created and mapped at a temporary reservation, the bytes are
        copied into it (``driver.copy``), the old chunks are moved out of the way into a
        second temporary reservation (``driver.move_mapping``: the pages move, so a
        rollback moves them back intact), the new chunk is moved to ``first`` and granted
        access; only then are the old chunks unmapped and released.

        All or nothing: a driver failure before the new chunk is granted access puts the
        old chunks back (re-granted) and discards the new one. A failure while cleaning up
        after success leaves the span defragmented; what could not be cleaned up is kept
        for :meth:`release_physical` to retry, and the error is raised.
        """
        self._check_alive()
        if self._stranded is not None:
            raise RuntimeError(f"cannot defragment: {self._stranded}; call release_physical()")
        old = self.chunks_tiling(first, last)
        if len(old) == 1:
            return False
        driver, device_index, granularity = self._driver, self.device_index, self.granularity
        size, base = last - first, self.base_ptr
        # Pending work (a consumer's kernel, on the owner or a peer) may still write the
        # old chunks.
        for access_device in self.access_devices:
            driver.synchronize(access_device)
        driver.ensure_context(device_index)
        new_tmp = driver.reserve(size, granularity)
        handle: Any = None
        new_at: int | None = None  # address the new chunk is mapped at
        old_tmp: int | None = None
        moved_out: list[tuple[int, int, Any]] = []
        try:
            handle = driver.create(size, device_index)
            driver.map(new_tmp, size, handle)
            new_at = new_tmp
            driver.set_access(new_tmp, size, device_index)
            driver.copy(new_tmp, base + first, size, device_index)
            driver.synchronize(device_index)
            old_tmp = driver.reserve(size, granularity)
            for offset, chunk_size, old_handle in old:
                driver.move_mapping(
                    old_handle, base + offset, old_tmp + offset - first, chunk_size
                )
                moved_out.append((offset, chunk_size, old_handle))
            driver.move_mapping(handle, new_tmp, base + first, size)
            new_at = base + first
            # Only the moved chunk lost its access; the neighbouring chunks were never
            # touched and keep theirs, so the grant is the new chunk alone.
            driver.set_access_many(base + first, size, self.access_devices)
        except BaseException as error:
            self._undo_defragment(
                error, first, last, new_tmp, handle, new_at, old_tmp, moved_out
            )
            raise
        # Committed: the bookkeeping now names the new chunk (the committed runs are
        # unchanged), then the old chunks and the temporary reservations go.
        for offset, _, _ in old:
            self._remove_chunk(offset)
        self._insert_chunk((first, size, handle))
        errors = self._cleanup_temporary(
            old_tmp, size, [(old_tmp + o - first, n, h) for o, n, h in old]
        )
        errors += self._cleanup_temporary(new_tmp, size, [])
        if errors:
            errors[0].add_note(
                "defragment completed (the span is one chunk); cleaning up the old chunks "
                "failed and is retried by release_physical()"
            )
            raise_first(errors, "defragment cleanup")
        return True

    def _undo_defragment(
        self,
        error: BaseException,
        first: int,
        last: int,
        new_tmp: int,
        handle: Any,
        new_at: int | None,
        old_tmp: int | None,
        moved_out: list[tuple[int, int, Any]],
    ) -> None:
        """Roll a failed :meth:`defragment_span` back; rollback failures become notes."""
        driver, base, size = self._driver, self.base_ptr, last - first
        if new_at == base + first:
            moved_back = attempt(
                error,
                "defragment rollback: moving the new chunk back",
                driver.move_mapping,
                handle,
                base + first,
                new_tmp,
                size,
            )
            if not moved_back:
                self._stranded = f"defragment could not restore bytes [{first}, {last})"
                return
            new_at = new_tmp
        still_out: list[tuple[int, int, Any]] = []
        for offset, chunk_size, old_handle in reversed(moved_out):
            tmp_at = old_tmp + offset - first
            moved_back = attempt(
                error,
                "defragment rollback: moving a chunk back",
                driver.move_mapping,
                old_handle,
                tmp_at,
                base + offset,
                chunk_size,
            )
            if not moved_back:
                still_out.append((tmp_at, chunk_size, old_handle))
        if still_out:
            self._stranded = f"defragment could not restore bytes [{first}, {last})"
        # Else the old chunks are back in place and tile [first, last) exactly: whole chunks.
        elif moved_out and not attempt(
            error,
            "defragment rollback: re-granting access",
            driver.set_access_many,
            base + first,
            size,
            self.access_devices,
        ):
            self._stranded = f"bytes [{first}, {last}) may lack access after a rollback"
        if old_tmp is not None:
            for cleanup_error in self._cleanup_temporary(old_tmp, size, still_out):
                error.add_note(f"defragment rollback: {cleanup_error!r}")
        mapped_new = [(new_at, size, handle)] if new_at is not None else []
        for cleanup_error in self._cleanup_temporary(new_tmp, size, mapped_new):
            error.add_note(f"defragment rollback: {cleanup_error!r}")
        if handle is not None and new_at is None:
            self._release_noting(handle, error)

    def _cleanup_temporary(
        self, ptr: int, size: int, mapped: list[tuple[int, int, Any]]
    ) -> list[BaseException]:
        """Unmap and release the chunks ``mapped`` in the temporary reservation at ``ptr``,
        then free it. What fails is kept in :attr:`_stray_reservations`; returns the
        errors."""
        errors: list[BaseException] = []
        left: list[tuple[int, int, Any]] = []
        for chunk_ptr, chunk_size, handle in mapped:
            try:
                self._driver.unmap(chunk_ptr, chunk_size)
            except Exception as error:  # noqa: BLE001 - returned to the caller
                errors.append(error)
                left.append((chunk_ptr, chunk_size, handle))
                continue
            try:
                self._driver.release(handle)
            except Exception as error:  # noqa: BLE001 - returned to the caller
                errors.append(error)
                self._unreleased.append(handle)
        if left:
            self._stray_reservations.append((ptr, size, left))
            return errors
        try:
            self._driver.free_reserved(ptr, size)
        except Exception as error:  # noqa: BLE001 - returned to the caller
            errors.append(error)
            self._stray_reservations.append((ptr, size, []))
        return errors

    def _retry_stray_reservations(self) -> list[BaseException]:
        stray, self._stray_reservations = self._stray_reservations, []
        errors: list[BaseException] = []
        for ptr, size, mapped in stray:
            errors += self._cleanup_temporary(ptr, size, mapped)
        return errors

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
        errors: list[BaseException] = self._retry_stray_reservations()
        if not self._chunks and not self._unreleased:
            if errors:
                raise errors[0]
            return
        # Pending work (a memset, a consumer's kernel, on the owner or a peer device) may
        # still touch the pages.
        for device_index in self.access_devices:
            driver.synchronize(device_index)
        driver.ensure_context(self.device_index)
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
        self._chunk_ids = {}
        self._physical_bytes = 0
        self._committed.clear()
        for chunk in still_mapped:
            self._committed.add(chunk[0], chunk[0] + chunk[1])
            self._insert_chunk(chunk)
        if not still_mapped:
            self._stranded = None
        raise_first(errors, "release_physical")

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

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "base_ptr", 0):
            _release(self.free, "an ExtensibleTensor")


class ExtensibleTensor(SegmentedReservation):
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
    peer_devices : device spec or sequence of them, optional
        Other devices of the same platform granted read/write access to every committed
        run (now and after each grow); see :meth:`grant_access`. Each must exist, differ
        from ``device`` and be able to access it (CUDA: ``cuDeviceCanAccessPeer``).

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
        peer_devices: Any = (),
    ) -> None:
        self._buffer: _VirtualBuffer | None = None
        self._peer_devices: tuple[Device, ...] = ()
        self._ready_event: Any = None
        # Validate everything before the first driver call.
        max_num_bytes = _as_size(max_num_bytes, "max_num_bytes")
        if max_num_bytes >= _MAX_BYTES:
            raise ValueError(
                f"max_num_bytes must be below 2**63 (a DLPack shape is int64), got {max_num_bytes}"
            )
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
        peers = _parse_peer_specs(peer_devices, None)
        self._device, self._driver = resolve(device, driver)
        _check_peers(peers, self._device, self._driver)

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
        if peers:
            # Nothing is committed yet: this only records the peers for later commits.
            self._buffer.grant_access(tuple(peer.index for peer in peers))
            self._peer_devices = tuple(peers)

    # -- views ----------------------------------------------------------------------
    def _live_base_ptr(self) -> int:
        return self._live_buffer().base_ptr

    def full_view(self) -> BufferView:
        """Uint8 view spanning the whole reservation (only committed bytes may be
        touched)."""
        return self._view(0, self._max_num_bytes)

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
            try:
                for start, end in grown:
                    driver.memset(buffer.base_ptr + start, 0, end - start, index)
                event = driver.record_ready_event(index)
            except BaseException as error:
                # Memsets already issued would have no event ordering them before later
                # consumers (a grow without zeroing records none): let them finish here.
                attempt(error, "synchronizing after the failed zeroing", driver.synchronize, index)
                raise
            self._set_ready_event(event)
        self._committed = new_sizes

    # -- peer access ----------------------------------------------------------------
    def grant_access(self, devices: Any) -> None:
        """Grant other devices (one spec or a sequence) read/write access to every
        committed run, and to every run committed later.

        Devices that are already peers are skipped. All devices are validated before any
        grant (same platform, not the owner, existing, peer-capable). On a driver failure
        :attr:`peer_devices` is unchanged (runs granted before the failure stay readable
        by the new devices; later grows do not grant them).
        """
        parsed = _parse_peer_specs(devices, self._device.platform)
        new = [peer for peer in parsed if peer not in self._peer_devices]
        _check_peers(new, self._device, self._driver)
        buffer = self._live_buffer()
        if not new:
            return
        buffer.grant_access(tuple(peer.index for peer in new))
        self._peer_devices = self._peer_devices + tuple(new)

    @property
    def peer_devices(self) -> tuple[Device, ...]:
        """Devices other than :attr:`device` granted access (in the order granted)."""
        return self._peer_devices

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
        """Release the memory and the reservation. Safe to call more than once.

        Views (and arrays made from them) must not be used afterwards. On the CPU driver a
        stale access faults (``SIGSEGV``) rather than reading another allocation: the freed
        range stays reserved ``PROT_NONE`` in the driver's bounded quarantine (see
        :class:`~jaxbuf.drivers.host.HostVmmDriver`). On CUDA the address may be reused.
        After :meth:`release_physical` (not ``free``) views keep their address, touching
        them faults until a grow commits memory again, and then they work (fresh CPU
        memory reads zeros; CUDA memory is undefined without ``zero_new``).
        """
        buffer = self._buffer
        if buffer is None or buffer.freed:
            return
        try:
            buffer.free()
        finally:
            # As in release_physical: even a failed free may have unmapped chunks, so no
            # committed size may claim them (a view would read unmapped memory). A retry
            # frees what is left.
            self._committed = [0] * self.num_segments
        self._set_ready_event(None)

    close = free

    def __enter__(self) -> ExtensibleTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    @property
    def export_anchor(self) -> object:
        """What an export keeps alive: the virtual buffer holding the reservation and its
        chunks, not this handle. The handle has no ``__del__``; the virtual buffer frees the
        memory when collected, so an export keeps the memory, and a handle in a reference
        cycle with its own arrays (torch tensors, numpy arrays, both invisible to the cycle
        collector through their capsules) is still collected."""
        return self._live_buffer()

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
    def segment_capacity_bytes(self) -> int:
        """Maximum size of each segment (ValueError when they differ)."""
        return self._uniform(self._segment_capacities)

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
        for i, (size, capacity) in enumerate(zip(checked, self._segment_capacities)):
            if size > capacity:
                raise ValueError(
                    f"sizes[{i}] = {size} exceeds the segment capacity {capacity}"
                )
        buffer = self._live_buffer()
        return [
            buffer.chunk_containing(offset, size)
            for offset, size in zip(self._segment_offsets, checked)
        ]

    def defragment(self) -> list[int]:
        """Remap each segment's committed prefix as **one** driver allocation, keeping its
        bytes and :attr:`base_ptr`, as RDMA registration requires (UCX, ibverbs with
        dma-buf and GPUDirect register one allocation, not a region spanning several).

        Afterwards ``segments_backed_by_one_chunk(committed_sizes)`` is True for every
        committed segment. Returns the indices of the segments that were remapped (those
        already in one chunk, or empty, are skipped). Views stay valid; the device is
        synchronized first, and the call must not race consumers' kernels on the buffer.

        Rule: a granule (:attr:`granularity`) is never split between chunks, so two
        committed segments sharing a granule (a boundary that is not a granule multiple)
        cannot each be one chunk: ValueError names them, before anything changes. Later
        grows of a segment add chunks again; call ``defragment`` after the last grow.

        Failure semantics: segment by segment. A driver failure rolls the failing segment
        back (old chunks, bytes and access restored) and propagates; segments remapped
        before it stay remapped. Peak extra memory is one segment's committed size.
        """
        buffer = self._live_buffer()
        granularity = buffer.granularity
        spans: list[tuple[int, int, int]] = []  # (segment, first, last)
        for i, (offset, size) in enumerate(zip(self._segment_offsets, self._committed)):
            if size == 0:
                continue
            first = offset // granularity * granularity
            last = _round_up(offset + size, granularity)
            if spans and spans[-1][2] > first:
                previous = spans[-1][0]
                raise ValueError(
                    f"cannot defragment: segments {previous} and {i} share the granule at "
                    f"byte offset {first} (granularity {granularity}), so they cannot be "
                    "one chunk each; segment boundaries must be granule multiples"
                )
            spans.append((i, first, last))
        for i, first, last in spans:  # validate every span before changing anything
            try:
                buffer.chunks_tiling(first, last)
            except ValueError as error:
                raise ValueError(f"cannot defragment segment {i}: {error}") from None
        remapped = []
        for i, first, last in spans:
            if buffer.defragment_span(first, last):
                remapped.append(i)
        return remapped

    @property
    def granularity(self) -> int:
        """Commit granule in bytes (see :func:`granule_size`)."""
        return self._buffer.granularity  # type: ignore[union-attr]

    @property
    def base_ptr(self) -> int:
        """Address of the reservation (0 once freed)."""
        return 0 if self._buffer is None else self._buffer.base_ptr

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(device={self._device}, capacity={self._max_num_bytes}, "
            f"committed={self._committed}, physical_bytes={self.physical_bytes})"
        )
