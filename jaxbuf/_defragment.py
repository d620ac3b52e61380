"""Defragmenting a virtual buffer: each segment's committed prefix remapped as one chunk.

RDMA registration (UCX, ibverbs with dma-buf, GPUDirect) registers one driver allocation, not a
region spanning several, so :meth:`~jaxbuf.extensible.ExtensibleTensor.defragment` replaces the
chunks under each committed segment by one chunk with the same bytes at the same addresses.
:class:`Defragmenting` is the mechanism (a mixin of :class:`~jaxbuf._reservation.VirtualBuffer`:
one span at a time, all or nothing); :func:`defragment_segments` is the policy (which spans,
validated before anything changes).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from jaxbuf._errors import attempt, raise_first
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf.drivers.base import VmmDriver

__all__ = ["Defragmenting", "defragment_segments"]

Chunk = tuple[int, int, Any]  # (offset or address, size, driver handle)


def defragment_segments(
    buffer: Defragmenting, offsets: list[int], committed: list[int]
) -> list[int]:
    """Remap each committed segment (``offsets[i]``, ``committed[i]`` bytes) of ``buffer`` as
    one chunk; return the indices of the segments remapped.

    Everything is validated first: ValueError when two committed segments share a granule (a
    granule is never split between chunks) or a chunk crosses a segment's span; then segment
    by segment, each all or nothing (see :meth:`Defragmenting.defragment_span`).
    """
    granularity = buffer.granularity
    spans: list[tuple[int, int, int]] = []  # (segment, first, last)
    for i, (offset, size) in enumerate(zip(offsets, committed)):
        if size == 0:
            continue
        first = offset // granularity * granularity
        last = -(-(offset + size) // granularity) * granularity
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
    return [i for i, first, last in spans if buffer.defragment_span(first, last)]


class Defragmenting:
    """Defragmenting over the state of :class:`~jaxbuf._reservation.VirtualBuffer` (which
    mixes this in): its sorted ``_chunks`` and ``_chunk_offsets``, its driver and access
    devices. Temporary reservations whose cleanup failed are kept in
    ``_stray_reservations`` and retried by ``release_physical``.
    """

    _driver: VmmDriver
    _chunks: list[Chunk]
    _chunk_offsets: list[int]
    _unreleased: list[Any]
    _stranded: str | None
    _stray_reservations: list[tuple[int, int, list[Chunk]]]
    device_index: int
    granularity: int
    base_ptr: int
    access_devices: tuple[int, ...]

    _listeners: tuple[Any, ...]

    # Implemented by the virtual buffer.
    def _notify_mapped(self, chunks: list[tuple[int, int]]) -> None: ...
    def _notify_unmapping(self, chunks: list[tuple[int, int]]) -> None: ...
    def _check_alive(self) -> None: ...
    def _check_not_telling(self, what: str) -> None: ...
    def _insert_chunk(self, chunk: Chunk) -> None: ...
    def _remove_chunk(self, offset: int) -> None: ...
    def _release_noting(self, handle: Any, error: BaseException) -> bool: ...

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
        self._check_not_telling("defragment")
        if self._stranded is not None:
            raise RuntimeError(f"cannot defragment: {self._stranded}; call release_physical()")
        old = self.chunks_tiling(first, last)
        if len(old) == 1:
            return False
        driver, device_index, granularity = self._driver, self.device_index, self.granularity
        size, base = last - first, self.base_ptr
        old_ranges = [(offset, chunk_size) for offset, chunk_size, _ in old]
        if self._listeners:
            # Registrations go before the old chunks move out; a refusal changes nothing.
            self._notify_unmapping(old_ranges)
        # Pending work (a consumer's kernel, on the owner or a peer) may still write the
        # old chunks.
        for access_device in self.access_devices:
            driver.synchronize(access_device)
        driver.ensure_context(device_index)
        new_tmp: int | None = None  # the temporary reservation the new chunk is built in
        handle: Any = None
        new_at: int | None = None  # address the new chunk is mapped at
        old_tmp: int | None = None
        moved_out: list[tuple[int, int, Any]] = []
        copying = False  # the copy into the new chunk is enqueued, not known to be done
        try:
            # Each acquisition and each move recorded as it is made (an interrupt landing as
            # a call returns is delivered at the block's end, and rolls back what is
            # recorded); the copy between them stays interruptible.
            with deferred_interrupts():
                new_tmp = driver.reserve(size, granularity)
                handle = driver.create(size, device_index)
                driver.map(new_tmp, size, handle)
                new_at = new_tmp
                driver.set_access(new_tmp, size, device_index)
            copying = True
            driver.copy(new_tmp, base + first, size, device_index)
            driver.synchronize(device_index)
            copying = False
            with deferred_interrupts():
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
            if copying and not attempt(
                error,
                "defragment rollback: waiting for the copy into the new chunk",
                driver.synchronize,
                device_index,
            ):
                # The copy may still be writing the new chunk: unmapping it now would fault
                # the device. It stays mapped in its temporary reservation, a stray that
                # release_physical() frees after its own wait.
                self._stray_reservations.append((new_tmp, size, [(new_tmp, size, handle)]))
                raise
            self._undo_defragment(error, first, last, new_tmp, handle, new_at, old_tmp, moved_out)
            if self._listeners and self._stranded is None:
                # The old chunks are back in place: the registrations follow them again.
                attempt(error, "re-registering the old chunks", self._notify_mapped, old_ranges)
            raise
        # Committed: the bookkeeping now names the new chunk (the committed runs are
        # unchanged), then the old chunks and the temporary reservations go; as one step, so
        # an interrupt never leaves the books half-swapped or the old chunks untracked.
        with deferred_interrupts():
            for offset, _, _ in old:
                self._remove_chunk(offset)
            self._insert_chunk((first, size, handle))
            errors = self._cleanup_temporary(
                old_tmp, size, [(old_tmp + o - first, n, h) for o, n, h in old]
            )
            errors += self._cleanup_temporary(new_tmp, size, [])
        if self._listeners:
            try:
                self._notify_mapped([(first, size)])
            except BaseException as error:  # noqa: BLE001 - raised below, after the cleanup
                error.add_note(
                    "defragment completed (the span is one chunk) but a registration of the "
                    "new chunk failed: the span is registered with no listener"
                )
                errors.insert(0, error)
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
        new_tmp: int | None,
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
        if new_tmp is not None:  # else nothing was reserved, created or mapped
            for cleanup_error in self._cleanup_temporary(new_tmp, size, mapped_new):
                error.add_note(f"defragment rollback: {cleanup_error!r}")
        if handle is not None and new_at is None:
            self._release_noting(handle, error)

    def _cleanup_temporary(
        self, ptr: int, size: int, mapped: list[tuple[int, int, Any]]
    ) -> list[BaseException]:
        """Unmap and release the chunks ``mapped`` in the temporary reservation at ``ptr``,
        then free it. What fails, or is interrupted (Ctrl-C), is kept in
        :attr:`_stray_reservations` and the rest still done; returns the errors (the caller
        raises an interrupt first)."""
        # Each release and its record as one step: an interrupt held back until both ran.
        with deferred_interrupts():
            errors: list[BaseException] = []
            left: list[tuple[int, int, Any]] = []
            for chunk_ptr, chunk_size, handle in mapped:
                try:
                    self._driver.unmap(chunk_ptr, chunk_size)
                except BaseException as error:  # noqa: BLE001 - returned to the caller, interrupts too
                    errors.append(error)
                    left.append((chunk_ptr, chunk_size, handle))
                    continue
                try:
                    self._driver.release(handle)
                except BaseException as error:  # noqa: BLE001 - returned to the caller, interrupts too
                    errors.append(error)
                    self._unreleased.append(handle)
            if left:
                self._stray_reservations.append((ptr, size, left))
                return errors
            try:
                self._driver.free_reserved(ptr, size)
            except BaseException as error:  # noqa: BLE001 - returned to the caller, interrupts too
                errors.append(error)
                self._stray_reservations.append((ptr, size, []))
            return errors

    def _retry_stray_reservations(self) -> list[BaseException]:
        stray, self._stray_reservations = self._stray_reservations, []
        if not stray:
            return []
        # A stray may be the target of device work a failed wait left pending: wait first,
        # and keep them all while the device cannot be waited for.
        try:
            for device_index in self.access_devices:
                self._driver.synchronize(device_index)
        except BaseException as error:  # noqa: BLE001 - returned to the caller, interrupts too
            self._stray_reservations = stray + self._stray_reservations
            return [error]
        errors: list[BaseException] = []
        for ptr, size, mapped in stray:
            errors += self._cleanup_temporary(ptr, size, mapped)
        return errors
