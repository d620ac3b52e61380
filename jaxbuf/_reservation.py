"""The virtual buffer: one address reservation, and the physical chunks mapped into it.

This is the allocation under an :class:`~jaxbuf.extensible.ExtensibleTensor` (and under a
device copy made for ``BufferView.__dlpack__(copy=True)``): it reserves address space once,
commits byte ranges by creating, mapping and granting chunks (all or nothing: a failure rolls
back what the call created), drops them again (:meth:`VirtualBuffer.release_physical`) and
gives everything back (:meth:`VirtualBuffer.release`, or its ``__del__``). Segments, views and
the ownership rules live above it; defragmenting is mixed in from :mod:`jaxbuf._defragment`.

It imports the driver seam and leaf helpers only, so any layer above the drivers may allocate
through it without importing a buffer module.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any, Protocol

from jaxbuf._defragment import Defragmenting
from jaxbuf._errors import ClosedError, attempt, raise_first
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf._intervals import IntervalSet
from jaxbuf._lifetime import release_when_collected, retry_deferred
from jaxbuf.drivers.base import VmmDriver

__all__ = [
    "MIN_GRANULARITY",
    "MappingListener",
    "VirtualBuffer",
    "commit_granule",
    "committed_buffer",
    "round_up",
]

# Commit granule floor. Committing in 2 MiB units keeps the number of driver
# allocations (and mappings) small, and matches the large-page size on x86 and the
# CUDA granularity on most GPUs.
MIN_GRANULARITY = 2 * 1024 * 1024


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def commit_granule(driver: VmmDriver, device_index: int) -> int:
    """The commit granule on ``device_index``: the driver granularity floored at
    :data:`MIN_GRANULARITY` (rounded up to a multiple of the driver granularity)."""
    driver_granularity = driver.granularity(device_index)
    return round_up(max(driver_granularity, MIN_GRANULARITY), driver_granularity)


class MappingListener(Protocol):
    """What another engine's registration (NIXL, UCX, NCCL) implements to follow the memory.

    Both methods receive ``(offset, size)`` pairs: whole chunks, byte offsets from the
    buffer's ``base_ptr`` (which never moves), sorted by offset.

    ``mapped(chunks)``
        Called after the chunks were created, mapped *and* granted access (a grow, a
        recommit after :meth:`VirtualBuffer.release_physical`, the one chunk a defragment
        made, old chunks a failed defragment put back). Raising undoes a grow: the chunks are
        unmapped again (listeners notified before are told ``unmapping`` first) and the error
        propagates, so no memory is committed that a listener could not follow.
    ``unmapping(chunks)``
        Called before the chunks are unmapped (release, defragment, free). Raising refuses
        the operation before anything changes (a transfer still in flight over the chunks),
        so nothing ever stays registered over unmapped memory.
    """

    def mapped(self, chunks: list[tuple[int, int]]) -> None: ...

    def unmapping(self, chunks: list[tuple[int, int]]) -> None: ...


class VirtualBuffer(Defragmenting):
    """One reservation and the physical chunks mapped into it: the allocation an
    :class:`~jaxbuf.extensible.ExtensibleTensor` owns (its ``OwnedAllocation``, see
    :mod:`jaxbuf._owner`), kept alive by the tensor and by every export of its memory.

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

    Released by :meth:`release` (explicitly, or from ``__del__`` when the last reference goes:
    the owner's, or the last export's once the owner was freed). Not copyable: it owns driver
    resources.
    """

    def __init__(
        self,
        max_bytes: int,
        device_index: int,
        driver: VmmDriver,
        granularity: int,
        what: str = "ExtensibleTensor",
    ) -> None:
        # What messages call the owner of this memory ("the ExtensibleTensor has been freed").
        self.what = what
        self._driver = driver
        self.device_index = device_index
        self.granularity = granularity
        self.reserved_size = round_up(max(max_bytes, 1), granularity)
        self.base_ptr = 0
        self._committed = IntervalSet()
        self._chunks: list[tuple[int, int, Any]] = []  # (offset, size, handle)
        self._chunk_offsets: list[int] = []
        self._physical_bytes = 0
        # Handles unmapped but whose release failed; retried by release_physical.
        self._unreleased: list[Any] = []
        # Set after a double fault left a chunk mapped that could not be unmapped.
        self._stranded: str | None = None
        self._released = False
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
        # Registrations following the memory (see MappingListener). Empty for almost every
        # buffer: each notification site tests this tuple first, so they cost nothing then.
        self._listeners: tuple[MappingListener, ...] = ()
        # The listener being told, while one is: the buffer refuses to change meanwhile.
        self._telling: MappingListener | None = None
        driver.ensure_context(device_index)
        retry_deferred(driver)  # releases that failed in a finalizer: retried at next use
        with deferred_interrupts():  # reserved and recorded as one step (the finalizer frees it)
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
        reserved = self.reserved_size
        for start, end in ranges:
            if not 0 <= start <= end <= reserved:
                raise ValueError(
                    f"range [{start}, {end}) is outside the reservation of {reserved} bytes"
                )
        if self._released:
            self._check_alive()  # raises, naming the owner
        self._check_not_telling("commit memory in")
        if self._stranded is not None:
            raise RuntimeError(f"cannot commit: {self._stranded}; call release_physical() first")
        granularity = self.granularity
        new_chunks: list[tuple[int, int, Any]] = []
        gaps, commit_gap = self._committed.gaps, self._commit_gap
        self._driver.ensure_context(self.device_index)
        try:
            for start, end in ranges:
                if start == end:
                    continue
                # Whole granules. Ranges of neighbouring segments may share one; gaps are
                # taken against the runs recorded so far, so a shared granule is mapped once.
                first = start - start % granularity
                last = -(-end // granularity) * granularity
                for gap_start, gap_end in gaps(first, last):
                    new_chunks.append(commit_gap(gap_start, gap_end))
            if self._listeners and new_chunks:
                self._notify_mapped([(offset, size) for offset, size, _ in new_chunks])
        except BaseException as error:
            for chunk in reversed(new_chunks):
                self._rollback_chunk(chunk, error)
            raise

    # -- listeners (registrations that follow the memory) ---------------------------
    def add_mapping_listener(self, listener: MappingListener) -> None:
        """Attach ``listener``: it is told ``mapped`` of every chunk mapped now, then of
        every chunk mapped later, and ``unmapping`` before any is unmapped.

        If the first ``mapped`` call raises, the listener is not attached.
        """
        self._check_alive()
        if any(existing is listener for existing in self._listeners):
            raise ValueError(f"{listener!r} is already attached to this {self.what}")
        self._check_not_telling("attach a listener to")
        if self._chunks:
            self._tell(listener, "mapped", self.mapped_chunks())
        self._listeners = (*self._listeners, listener)

    def remove_mapping_listener(self, listener: MappingListener) -> None:
        """Detach ``listener``, telling it ``unmapping`` of every chunk mapped now first
        (it raises to refuse, and stays attached). A listener not attached: ValueError."""
        if not any(existing is listener for existing in self._listeners):
            raise ValueError(f"{listener!r} is not attached to this {self.what}")
        self._check_not_telling("detach a listener from")
        if self._chunks:
            self._tell(listener, "unmapping", self.mapped_chunks())
        self._listeners = tuple(item for item in self._listeners if item is not listener)

    def remove_all_mapping_listeners(self) -> None:
        """Detach every listener as :meth:`remove_mapping_listener` does, in reverse order of
        attaching; the first refusal propagates and leaves the rest attached."""
        for listener in reversed(self._listeners):
            self.remove_mapping_listener(listener)

    def mapped_chunks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every mapped chunk, sorted by offset."""
        return [(offset, size) for offset, size, _ in self._chunks]

    def _tell(self, listener: MappingListener, event: str, chunks: list[tuple[int, int]]) -> None:
        """``listener.<event>(chunks)``, during which this buffer refuses to change."""
        telling, self._telling = self._telling, listener
        try:
            getattr(listener, event)(chunks)
        finally:
            self._telling = telling

    def _check_not_telling(self, what: str) -> None:
        """RuntimeError when a listener, told of a change, calls back to change the buffer
        (a ``release_physical`` from ``mapped``): the buffer is half-way through that change,
        and the call would leave it committed over nothing."""
        if self._telling is not None:
            raise RuntimeError(
                f"cannot {what} this {self.what} from its mapping listener "
                f"{self._telling!r}: a listener is told of a change while it is being made"
            )

    def _notify_mapped(self, chunks: list[tuple[int, int]]) -> None:
        """Tell every listener ``mapped``; if one raises, those told before it are told
        ``unmapping`` (failures there become notes) and the error propagates."""
        self._notify(chunks, "mapped", "unmapping")

    def _notify_unmapping(self, chunks: list[tuple[int, int]]) -> None:
        """Tell every listener ``unmapping``; if one refuses, those told before it are told
        ``mapped`` again (failures there become notes) and the refusal propagates."""
        self._notify(chunks, "unmapping", "mapped")

    def _notify(self, chunks: list[tuple[int, int]], event: str, undo: str) -> None:
        """Call ``listener.<event>(chunks)`` on every listener, all or none: on a failure the
        listeners already told get ``<undo>(chunks)``, newest first."""
        told: list[MappingListener] = []
        try:
            for listener in self._listeners:
                self._tell(listener, event, chunks)
                told.append(listener)
        except BaseException as error:
            for listener in reversed(told):
                attempt(error, f"undoing {listener!r}.{event}", self._tell, listener, undo, chunks)
            raise

    def _commit_gap(self, offset: int, size_end: int) -> tuple[int, int, Any]:
        """Create, map and grant one chunk over ``[offset, size_end)``; record it.

        Acquired and recorded as one step: an interrupt (a Ctrl-C during a slow create or
        map, delivered as the call returns) is held back until the chunk is recorded or
        rolled back, so it is never taken for a failure of a call that succeeded (a mapped
        chunk released and forgotten, its range freed under the mapping later)."""
        with deferred_interrupts():
            return self._commit_gap_now(offset, size_end)

    def _commit_gap_now(self, offset: int, size_end: int) -> tuple[int, int, Any]:
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
        # at 48 GiB committed on an H200). Existing mappings are never touched, so
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
        offset = chunk[0]
        self._chunk_ids[offset] = next(self._chunk_id_counter)
        offsets = self._chunk_offsets
        if not offsets or offset > offsets[-1]:  # a grow appends: no search, no splice
            offsets.append(offset)
            self._chunks.append(chunk)
        else:
            i = bisect_left(offsets, offset)
            offsets.insert(i, offset)
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
        # A chunk whose unmap fails stays recorded (it is mapped and accessible). Unmapped
        # and forgotten as one step: an interrupt between them would unmap it twice.
        with deferred_interrupts():
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
        self._check_not_telling("grant access to")
        if not device_indices:
            return
        driver = self._driver
        driver.ensure_context(self.device_index)
        # Runs are unions of whole chunks, as set_access requires.
        for start, end in list(self._committed):
            driver.set_access_many(self.base_ptr + start, end - start, device_indices)
        self.access_devices = self.access_devices + tuple(device_indices)

    # -- releasing ------------------------------------------------------------------
    def tell_unmapping(self) -> None:
        """Tell the listeners ``unmapping`` of every mapped chunk (a refusal raises with
        nothing changed): the first step of :meth:`release_physical`, for a caller that
        must know a refusal from a driver failure."""
        self._check_not_telling("release the memory of")
        if self._listeners and self._chunks:
            self._notify_unmapping(self.mapped_chunks())

    def release_physical(self, *, listeners_told: bool = False) -> None:
        """Unmap and release every chunk, keeping the reservation.

        The listeners are told first (unless ``listeners_told``: the caller did
        :meth:`tell_unmapping`); one that refuses raises with nothing changed. Best effort
        over all chunks: a chunk whose unmap fails stays tracked (and committed); the first
        error is raised with the others attached as notes. An interrupt (Ctrl-C) in the
        middle is treated like a failure of that one step: every other chunk is still
        released and forgotten, the bookkeeping matches the memory, and the interrupt is
        raised at the end (nothing released twice by the next call, nothing leaked).
        """
        if self._released:
            return
        self._check_not_telling("release the memory of")
        if not listeners_told:
            # Before anything is waited for or unmapped: a refusal changes nothing.
            self.tell_unmapping()
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
        # An interrupt is held back from the first release to the last record of one: one
        # landing after a call returned would leave a released chunk tracked, released
        # again by the retry.
        with deferred_interrupts():
            unreleased, self._unreleased = self._unreleased, []
            for handle in unreleased:
                try:
                    driver.release(handle)
                except BaseException as error:  # noqa: BLE001 - re-raised below, an interrupt first
                    errors.append(error)
                    self._unreleased.append(handle)
            for chunk in self._chunks:
                offset, size, handle = chunk
                try:
                    driver.unmap(self.base_ptr + offset, size)
                except BaseException as error:  # noqa: BLE001 - re-raised below, an interrupt first
                    errors.append(error)
                    still_mapped.append(chunk)
                    continue
                try:
                    driver.release(handle)
                except BaseException as error:  # noqa: BLE001 - re-raised below, an interrupt first
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
            if self._listeners and still_mapped and errors:
                # Chunks that could not be unmapped stay mapped: the listeners follow them.
                attempt(
                    errors[0],
                    "re-registering the chunks still mapped",
                    self._notify_mapped,
                    [(offset, size) for offset, size, _ in still_mapped],
                )
            if not still_mapped:
                self._stranded = None
            raise_first(errors, "release_physical")

    def release(self) -> None:
        """Release the physical memory and the reservation. Idempotent.

        The devices with access are synchronized before anything is unmapped (their pending
        kernels may still touch the pages). A driver failure propagates with what is left
        still tracked, so a second call finishes the release.
        """
        if self._released:
            return
        self._check_not_telling("free")
        retry_deferred(self._driver)
        self.release_physical()
        with deferred_interrupts():  # freed and recorded as one step
            if self.base_ptr:
                self._driver.free_reserved(self.base_ptr, self.reserved_size)
            self.base_ptr = 0
            self._released = True

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has completed (nothing of the allocation is left)."""
        return self._released

    def _check_alive(self) -> None:
        if self._released:
            raise ClosedError(self.what)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"the {self.what}'s memory cannot be pickled or copied: it is a driver "
            "reservation with physical chunks mapped into it, owned by this process"
        )

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "base_ptr", 0):
            # With the driver: a failure is queued, retried at its next use and at exit.
            _release(self.release, f"the {self.what}'s memory", driver=self._driver)


def committed_buffer(driver: VmmDriver, nbytes: int, device_index: int, what: str) -> VirtualBuffer:
    """``nbytes`` (at least 1) of memory on ``device_index``, committed at once: plain device
    memory for an owner that needs no segments and no growth (the copy a
    ``BufferView.__dlpack__(copy=True)`` makes on a device, a fixed-size target).

    All or nothing: a failure releases what was reserved and propagates. ``release()`` (or
    the buffer's ``__del__``) synchronizes the device and frees it; it calls into no
    framework, so it is safe from a finalizer or a DLPack deleter (unlike
    ``ExtensibleTensor.free()``, which first waits for the frameworks).
    """
    granularity = driver.granularity(device_index)
    memory = VirtualBuffer(max(nbytes, 1), device_index, driver, granularity, what)
    try:
        memory.ensure_committed_ranges([(0, max(nbytes, 1))])
    except BaseException as error:
        attempt(error, f"releasing the {what}'s reservation", memory.release)
        raise
    return memory
