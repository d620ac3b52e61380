"""The importer's side of sharing: :class:`ImportedBuffer`, another process's buffer mapped
into this one, and :class:`_Mappings`, the platform resources it owns.

Ownership follows the model of every jaxbuf owner (:mod:`jaxbuf._owner`): the reservation and
the mapped chunks are one allocation object (:class:`_Mappings`) held by a
:class:`~jaxbuf._owner.Lifetime`; every array exported from a view keeps it alive.
:meth:`ImportedBuffer.close` means "I am done": no new views or exports, and the mappings go
when the last exported array does (at once when there is none).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Sequence
from typing import Any

from jaxbuf import interop
from jaxbuf._checks import as_int
from jaxbuf._errors import Cleanup, ClosedError
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf._intervals import IntervalSet
from jaxbuf._lifetime import release_when_collected, retry_deferred
from jaxbuf._owner import Lifetime
from jaxbuf._resolve import resolve
from jaxbuf._segments import SegmentedReservation
from jaxbuf.devices import DeviceLike, as_device
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.sharing._layout import _check_layout
from jaxbuf.sharing._wire import DEFAULT_TIMEOUT, _close_all, recv_layout
from jaxbuf.views import BufferView

_NOT_COPYABLE = (
    "an ImportedBuffer cannot be copied or pickled: it owns its reservation and the mappings "
    "of the received chunks, and a copy would unmap and free them a second time (use the one "
    "object, or have the owner send_buffer to each importer)"
)


def _check_fds(fds: Any) -> None:
    """``TypeError`` / ``ValueError`` naming ``fds`` or its bad entry (``fds[i]``: a bool, a
    float, a negative number) unless it is a sequence of descriptor numbers."""
    if isinstance(fds, (str, bytes)) or not isinstance(fds, Sequence):
        raise TypeError(f"fds must be a sequence of file descriptors, got {fds!r:.100}")
    for i, fd in enumerate(fds):
        if as_int(fd, f"fds[{i}]") < 0:
            raise ValueError(f"fds[{i}] must be a file descriptor (>= 0), got {fd}")


def _check_open(fds: Sequence[int]) -> None:
    """``ValueError`` naming the first entry of ``fds`` that is not an open descriptor."""
    for i, fd in enumerate(fds):
        try:
            os.fstat(fd)
        except OSError as exc:
            raise ValueError(
                f"fds[{i}] = {fd} is not an open file descriptor ({exc.strerror})"
            ) from None


def _descriptors(fds: Any) -> list[int]:
    """The entries of ``fds`` a failed import closes: the descriptor numbers (never a bool,
    which would close stdout, or anything that is not a number)."""
    if isinstance(fds, (str, bytes)) or not isinstance(fds, Sequence):
        return []
    return [fd for fd in fds if isinstance(fd, int) and not isinstance(fd, bool) and fd >= 0]


def _close_after(error: BaseException, fds: Sequence[int]) -> None:
    """Close ``fds`` once ``error`` is on its way: a descriptor that will not close (a bad
    one the caller passed) is noted on ``error``, never raised in its place."""
    try:
        _close_all(fds)
    except OSError as close_error:
        error.add_note(f"closing the received descriptors failed too: {close_error!r}")


class _Mappings:
    """The platform resources of one import: the reservation of ``reserved_size`` bytes at
    ``base_ptr`` and the chunks mapped into it (an :class:`~jaxbuf._owner.OwnedAllocation`).

    Invariants: every entry of ``chunks`` (chunk_id -> ``(offset, size, handle)``) is mapped
    at ``base_ptr + offset`` and granted to device ``index``; ``base_ptr`` is 0 only once the
    reservation is freed, and then ``chunks`` is empty. :meth:`release` is best effort and
    retryable; an unreleased object releases itself when collected, which is how the last
    export of a closed :class:`ImportedBuffer` gives the memory back.
    """

    def __init__(
        self, driver: VmmDriver, index: int, reserved_size: int, alignment: int, read_only: bool
    ) -> None:
        self.driver = driver
        self.index = index
        self.reserved_size = reserved_size
        self.read_only = read_only
        self.chunks: dict[int, tuple[int, int, Any]] = {}
        # Chunks the owner dropped while arrays exported here were alive: still mapped (the
        # arrays read them), unmapped once no export is left (update, close, collection).
        self.retired: list[tuple[int, int, Any]] = []
        # Handles unmapped whose driver release failed: released again by the next release
        # step, never forgotten (a handle is dropped only once the driver released it).
        self.unreleased: list[Any] = []
        self.base_ptr = 0  # first: __del__ of a half-built object must find it
        driver.ensure_context(index)
        with deferred_interrupts():  # reserved and recorded as one step (the finalizer frees it)
            self.base_ptr = driver.reserve(reserved_size, alignment)

    @property
    def released(self) -> bool:
        return not self.base_ptr

    def map_chunk(self, chunk_id: int, offset: int, size: int, fd: int) -> None:
        """Import descriptor ``fd`` (the caller still closes it) and map it at ``offset``.

        Imported, mapped, granted and recorded as one step: an interrupt delivered as a call
        returns waits until the chunk is recorded or rolled back (never a mapped chunk taken
        for a failed one, its handle released under the mapping and forgotten)."""
        with deferred_interrupts():
            self._map_chunk_now(chunk_id, offset, size, fd)

    def _map_chunk_now(self, chunk_id: int, offset: int, size: int, fd: int) -> None:
        driver, index = self.driver, self.index
        ptr = self.base_ptr + offset
        handle = driver.import_handle(fd, size, index)
        try:
            # The driver's word, not the layout's: views must never offer writes into a
            # read-only mapping (a fault), nor claim read-only over a writable one.
            if getattr(handle, "read_only", False) != self.read_only:
                raise ValueError(
                    f"chunk {chunk_id} came with a "
                    f"{'read-only' if not self.read_only else 'writable'} descriptor but the "
                    f"layout says read_only={self.read_only}"
                )
            driver.map(ptr, size, handle)
        except BaseException as error:
            self._release_handle(handle, error)
            raise
        try:
            driver.set_access(ptr, size, index)
        except BaseException as error:
            try:
                driver.unmap(ptr, size)
            except Exception as rollback_error:  # noqa: BLE001 - reported as a note
                error.add_note(
                    f"rollback failed too: {rollback_error!r}; the chunk stays tracked and "
                    "its release retries it"
                )
                self.chunks[chunk_id] = (offset, size, handle)
            else:
                self._release_handle(handle, error)
            raise
        self.chunks[chunk_id] = (offset, size, handle)

    def _release_handle(self, handle: Any, error: BaseException) -> None:
        """Release an unmapped ``handle`` during a rollback; on failure keep it in
        ``unreleased`` (retried) and note the failure on ``error``."""
        try:
            self.driver.release(handle)
        except Exception as release_error:  # noqa: BLE001 - reported as a note, kept
            self.unreleased.append(handle)
            error.add_note(f"rollback: release failed too (retried later): {release_error!r}")

    def unmap_chunk(self, chunk_id: int) -> None:
        """Unmap a chunk, then release its handle: the handle is kept (``unreleased``) until
        the driver has released it, so a failed release is retried, never lost."""
        offset, size, handle = self.chunks[chunk_id]
        with deferred_interrupts():  # unmapped and recorded as one step
            self.driver.unmap(self.base_ptr + offset, size)
            del self.chunks[chunk_id]
            self.unreleased.append(handle)
        self.release_unreleased()

    def retire_chunk(self, chunk_id: int) -> None:
        """Stop following a chunk the owner dropped, leaving it mapped for live arrays."""
        self.retired.append(self.chunks.pop(chunk_id))

    def unmap_retired(self) -> None:
        """Unmap the retired chunks (no export may use them any more)."""
        while self.retired:
            offset, size, handle = self.retired[-1]
            with deferred_interrupts():  # unmapped and recorded as one step
                self.driver.unmap(self.base_ptr + offset, size)
                self.retired.pop()
                self.unreleased.append(handle)
        self.release_unreleased()

    def release_unreleased(self) -> None:
        """Release every handle in ``unreleased``; the first failure is raised (with the
        others as notes) and the failed handles stay."""
        cleanup = Cleanup("ImportedBuffer: releasing chunk handles")
        with deferred_interrupts(collect=cleanup.errors):  # each release and its record
            for handle in list(self.unreleased):
                if cleanup.run(self.driver.release, handle):
                    self.unreleased.remove(handle)
        cleanup.raise_first()

    def overlaps_retired(self, offset: int, size: int) -> bool:
        return any(o < offset + size and offset < o + n for o, n, _ in self.retired)

    def release(self) -> None:
        """Unmap and release every chunk, then free the reservation. Idempotent.

        Synchronizes the device first (this process's kernels may still read the memory).
        Best effort: the first error is raised with the others as notes; what failed stays
        tracked, so a second call retries it.
        """
        if not self.base_ptr:
            return
        driver, index = self.driver, self.index
        retry_deferred(driver)  # releases that failed in a finalizer: retried at next use
        driver.ensure_context(index)
        driver.synchronize(index)
        cleanup = Cleanup("ImportedBuffer.close")
        for chunk_id in list(self.chunks):
            cleanup.run(self.unmap_chunk, chunk_id)
        cleanup.run(self.unmap_retired)
        cleanup.run(self.release_unreleased)
        with deferred_interrupts(collect=cleanup.errors):  # freed and recorded as one step
            if not cleanup.errors and cleanup.run(
                driver.free_reserved, self.base_ptr, self.reserved_size
            ):
                self.base_ptr = 0
        cleanup.raise_first()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPYABLE)

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "base_ptr", 0):
            _release(self.release, "the mappings of an ImportedBuffer", driver=self.driver)


class ImportedBuffer(SegmentedReservation):
    """Another process's :class:`~jaxbuf.ExtensibleTensor`, mapped into this one.

    It owns its reservation (the owner's ``reserved_size``) and maps each received chunk at
    the owner's offset, so segment ``i`` starts at ``base_ptr + segment_offsets[i]`` here
    as there. Views (:meth:`segment_view`, :meth:`full_view`) are zero-copy, as the
    owner's are.

    Lifetime: arrays exported from its views (``to_numpy``, ``to_torch``, ``to_jax``, any
    DLPack consumer) keep the mappings alive. :meth:`close` means "I am done": no new views,
    exports, :meth:`refresh` or :meth:`update` (``RuntimeError``; views taken earlier raise
    at export), and the mappings are unmapped when the last exported array is gone, at once
    when there is none. :attr:`live_exports` counts those arrays, :attr:`released` says
    whether the memory is unmapped. Dropping the object without ``close()`` is the same.

    Invariants between calls, while open: every chunk in ``_chunks`` is mapped and granted to
    :attr:`device`, inside the reservation, overlapping no other; a segment's committed size
    only claims bytes those chunks cover; no received descriptor stays open (each chunk's is
    closed once mapped: no descriptor per chunk); with :attr:`read_only`, every chunk came
    from a read-only descriptor and is mapped read-only. Every layout is validated whole
    before anything is mapped (see :mod:`jaxbuf.sharing`). Not thread-safe.

    Not copyable or picklable (``TypeError``): it owns its mappings, which a copy would
    unmap a second time.

    Parameters
    ----------
    layout, fds : from :func:`~jaxbuf.sharing.export_layout` / :func:`~jaxbuf.sharing.recv_layout`
        The descriptors are taken over: closed here whether the import succeeds or not.
    device : device spec, optional
        Where the memory is used; default the owner's device.
    driver : VmmDriver, optional
        Default: ``jaxbuf.drivers.get_vmm_driver(device)``.
    """

    def __init__(
        self,
        layout: dict,
        fds: Sequence[int],
        device: DeviceLike | None = None,
        driver: VmmDriver | None = None,
    ) -> None:
        self.base_ptr = 0
        self._ready_event: Any = None
        self._mappings: _Mappings | None = None  # None once closed, unless a release failed
        try:
            _check_fds(fds)
            _check_layout(layout, len(fds))
            _check_open(fds)
            self._read_only: bool = layout.get("read_only", False)
            if device is None:
                device = layout["device"]
            self._device = as_device(device)
            if self._device.platform != layout["platform"]:
                raise ValueError(
                    f"device {self._device} cannot import memory of platform {layout['platform']!r}"
                )
            self._device, self._driver = resolve(self._device, driver)
            self._owner = layout["owner"]
            self._reserved_size = int(layout["reserved_size"])
            self._segment_capacities = [int(c) for c in layout["segment_capacities"]]
            self._segment_offsets = [int(o) for o in layout["segment_offsets"]]
            self._committed = [0] * len(self._segment_capacities)
            driver_granularity = self._driver.granularity(self._device.index)
            alignment = max(int(layout["granularity"]), driver_granularity)
            if alignment % driver_granularity or self._reserved_size % driver_granularity:
                raise ValueError(
                    f"the owner's granularity {layout['granularity']} and reservation "
                    f"{self._reserved_size} are not multiples of this device's "
                    f"granularity {driver_granularity}"
                )
            mappings = _Mappings(
                self._driver, self._device.index, self._reserved_size, alignment, self._read_only
            )
        except BaseException as error:
            _close_after(error, _descriptors(fds))
            raise
        self._mappings = mappings
        self._lifetime = Lifetime(mappings)
        self.base_ptr = mappings.base_ptr
        try:
            self.update(layout, fds)
        except BaseException:
            try:
                self.close()
            except Exception as error:  # noqa: BLE001 - the import error is the one raised
                warnings.warn(
                    f"jaxbuf: cleaning up a failed import failed: {error!r}",
                    ResourceWarning,
                    stacklevel=2,
                )
            raise

    # -- updating ---------------------------------------------------------------------
    def refresh(self, sock: socket.socket, *, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Receive the owner's next :func:`~jaxbuf.sharing.send_buffer` message (within
        ``timeout`` seconds, see :func:`~jaxbuf.sharing.recv_layout`) and :meth:`update`.
        ``RuntimeError`` after :meth:`close`, before anything is received."""
        self.check_exportable()
        mappings = self._open_mappings()
        # The chunks mapped here: the owner lists them again, without a descriptor.
        layout, fds = recv_layout(sock, timeout=timeout, held_chunks=len(mappings.chunks))
        self.update(layout, fds)

    def update(self, layout: dict, fds: Sequence[int]) -> None:
        """Follow the owner to ``layout``: unmap chunks it no longer has, map the chunks
        of ``layout["chunks"]`` (descriptors ``fds``) that are not mapped yet, and take its
        committed sizes. Closes ``fds`` in every case.

        ``RuntimeError`` after :meth:`close`. A layout that is malformed or does not fit this
        import (another owner, reservation, segments or access mode; a chunk we hold listed
        at another place; a chunk neither held nor sent) raises ``ValueError`` before
        anything changes.

        On failure the chunks mapped so far stay (each mapped and granted), and every
        segment keeps the larger of its old and new committed size that the mapped chunks
        cover (else 0), so a view never reaches unmapped memory.

        Arrays exported earlier keep their mappings: while any is alive, chunks the owner
        dropped stay mapped (unmapped by a later update, or by :meth:`close`, once none is
        left), and a layout that puts a new chunk where such a chunk is raises
        ``RuntimeError`` before anything changes. A failed driver ``release`` never loses a
        handle: it is retried by the next update and by :meth:`close`.
        """
        try:
            mappings = self._open_mappings()
            _check_fds(fds)
            _check_layout(layout, len(fds))
            _check_open(fds)
            if layout["owner"] != self._owner:
                raise ValueError(
                    f"layout of owner {layout['owner']!r:.100} does not belong to this import "
                    f"(owner {self._owner!r})"
                )
            if (
                layout["reserved_size"] != self._reserved_size
                or layout["segment_capacities"] != self._segment_capacities
                or layout["segment_offsets"] != self._segment_offsets
            ):
                raise ValueError("the owner's reservation or segments changed shape")
            if layout.get("read_only", False) != self._read_only:
                raise ValueError(
                    f"layout has read_only={layout.get('read_only', False)}, this import "
                    f"read_only={self._read_only}: the access mode cannot change"
                )
            for offset, size, chunk_id in layout["all_chunks"]:
                held = mappings.chunks.get(chunk_id)
                if held is not None and held[:2] != (offset, size):
                    raise ValueError(
                        f"layout: all_chunks entry {[offset, size, chunk_id]} puts chunk "
                        f"{chunk_id} at another place than where it is mapped here "
                        f"([{held[0]}, {held[1]}])"
                    )
            live = {chunk[2] for chunk in layout["all_chunks"]}
            offered = {chunk[2] for chunk in layout["chunks"]}
            missing = live - offered - set(mappings.chunks)
            if missing:
                raise ValueError(
                    f"layout lists chunks {sorted(missing)} that were never sent here (was "
                    "it exported with since= a layout this importer did not receive?)"
                )
        except BaseException as error:
            _close_after(error, _descriptors(fds))
            raise
        new_sizes = [int(s) for s in layout["committed_sizes"]]
        exported = self._lifetime.live_exports > 0
        stale = [chunk_id for chunk_id in mappings.chunks if chunk_id not in live]
        if exported:
            # Arrays exported earlier keep their mappings (the owner contract): chunks the
            # owner dropped stay mapped until the last export is gone, so a new chunk cannot
            # take their place before then.
            held = [mappings.chunks[c][:2] for c in stale]
            blocked = [
                (offset, chunk_id)
                for offset, size, chunk_id in layout["chunks"]
                if chunk_id not in mappings.chunks
                and (
                    mappings.overlaps_retired(offset, size)
                    or any(o < offset + size and offset < o + n for o, n in held)
                )
            ]
            if blocked:
                _close_all(fds)
                raise RuntimeError(
                    f"cannot follow the owner: {self._lifetime.live_exports} array(s) "
                    "exported from this import may still read chunks the owner dropped, "
                    f"where it now sends chunks {blocked} (offset, id); nothing changed: "
                    "drop those arrays, then have the owner send_buffer again"
                )
        try:
            driver, index = self._driver, self._device.index
            driver.ensure_context(index)
            if not exported and (stale or mappings.retired):
                # The device may still read the old chunks (this process's kernels).
                driver.synchronize(index)
                mappings.unmap_retired()
                for chunk_id in stale:  # first: a replacement may overlap them
                    mappings.unmap_chunk(chunk_id)
            for chunk_id in stale if exported else ():
                mappings.retire_chunk(chunk_id)
            for (offset, size, chunk_id), fd in zip(layout["chunks"], fds):
                if chunk_id not in mappings.chunks:
                    mappings.map_chunk(chunk_id, offset, size, fd)
        finally:
            _close_all(fds)
            self._settle_committed(new_sizes)

    def _settle_committed(self, new_sizes: list[int]) -> None:
        covered = IntervalSet()
        for offset, size, _ in self._chunks.values():
            covered.add(offset, offset + size)
        settled = []
        for start, old, new in zip(self._segment_offsets, self._committed, new_sizes):
            size = next((s for s in (new, old) if covered.covers(start, start + s)), 0)
            settled.append(size)
        self._committed = settled

    def _open_mappings(self) -> _Mappings:
        self.check_exportable()
        mappings = self._mappings
        if mappings is None:  # not while open; a clear error rather than an AttributeError
            raise ClosedError("ImportedBuffer", "closed")
        return mappings

    # -- views ------------------------------------------------------------------------
    def _live_base_ptr(self) -> int:
        self.check_exportable()
        return self.base_ptr

    def full_view(self) -> BufferView:
        """Uint8 view over the whole reservation: as :meth:`ExtensibleTensor.full_view
        <jaxbuf.ExtensibleTensor.full_view>`, only the committed prefixes may be touched (on
        the CPU the rest reads zeros, or faults in debug mode, a write faults); a copy reads
        committed bytes only."""
        return self._view(0, self._reserved_size)

    # -- the owner contract (jaxbuf._owner.MemoryOwner): hot path, one read each ----------
    def check_exportable(self) -> None:
        """:class:`~jaxbuf.ClosedError` once :meth:`close` was called: no new views or exports."""
        if self._lifetime.anchor is None:
            raise ClosedError(
                "ImportedBuffer",
                "closed",
                "no new views, exports or refreshes (arrays exported before close() keep "
                "their memory until they are gone)",
            )

    @property
    def export_anchor(self) -> object:
        """What an export keeps alive: the anchor over the mappings (not this handle)."""
        return self._lifetime.anchor

    # -- properties -------------------------------------------------------------------
    @property
    def _chunks(self) -> dict[int, tuple[int, int, Any]]:
        """chunk_id -> ``(offset, size, handle)`` of the chunks this handle still holds
        (empty once closed, unless a failed release left some for the next ``close()``)."""
        mappings = self._mappings
        return {} if mappings is None else mappings.chunks

    @property
    def capacity_bytes(self) -> int:
        return self._reserved_size

    @property
    def num_physical_chunks(self) -> int:
        return len(self._chunks)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the memory may still be mapped for live
        exports: see :attr:`released`)."""
        return self._lifetime.closed

    @property
    def released(self) -> bool:
        """Whether the mappings and the reservation are gone (after :meth:`close`, once the
        last exported array is)."""
        return self._lifetime.released

    @property
    def live_exports(self) -> int:
        """Framework arrays exported from this buffer's views that are still alive."""
        return self._lifetime.live_exports

    @property
    def read_only(self) -> bool:
        """Whether the owner sent read-only descriptors: the chunks are mapped read-only
        here, so numpy arrays from views are not writeable, and a write through any other
        consumer (torch, DLPack) faults."""
        return self._read_only

    # -- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Say "I am done": no new views, exports, refreshes or updates from now on.

        With no exported array alive, waits for the frameworks' pending work on this
        device (:func:`jaxbuf.interop.quiesce`) and the device, then unmaps every chunk and
        frees the reservation; otherwise the last exported array to go does that. Safe to
        call twice. Best effort: the first error is raised with the others as notes; what
        failed stays tracked, so a second call retries it.
        """
        try:
            if not self._lifetime.closed:
                # Either released now, or live exports hold the mappings and the last one
                # releases them: the handle lets go of them in both cases. A failing release
                # raises past this line and leaves them here for a retry.
                self._lifetime.close(self._release_now)
                self._mappings = None
                return
            mappings = self._mappings
            if mappings is not None and self._lifetime.live_exports:
                # A close() interrupted right after the close: the exports hold the mappings.
                self._mappings = None
            elif mappings is not None:  # closed, but the release failed: retry it
                self._release_now(mappings)
                self._mappings = None
        finally:
            # After the close, never before: a copy export on another thread that read the
            # sizes before the close then sees it (and refuses), instead of copying zeros.
            self.base_ptr = 0
            self._committed = [0] * len(self._committed)

    def _release_now(self, mappings: _Mappings) -> None:
        # Frameworks may still run work on this memory (JAX's asynchronous dispatch, a
        # donated step): let it finish before unmapping.
        interop.quiesce(self._device)
        mappings.release()

    def __enter__(self) -> ImportedBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __copy__(self) -> ImportedBuffer:
        raise TypeError(_NOT_COPYABLE)

    def __deepcopy__(self, memo: dict) -> ImportedBuffer:
        raise TypeError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPYABLE)

    def __repr__(self) -> str:
        lifetime = getattr(self, "_lifetime", None)
        if lifetime is None or not lifetime.closed:
            committed = getattr(self, "_committed", [])
            state = f"committed={committed}, nbytes={sum(committed)}, open"
        elif lifetime.released:
            state = "closed"
        else:
            state = f"closed, {lifetime.live_exports} live export(s)"
        if getattr(self, "_read_only", False):
            state += ", read-only"
        return (
            f"ImportedBuffer(device={getattr(self, '_device', None)}, dtype=uint8, "
            f"shape=({getattr(self, '_reserved_size', 0)},), chunks={len(self._chunks)}, "
            f"{state})"
        )
