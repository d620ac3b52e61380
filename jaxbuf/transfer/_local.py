"""The same-host transport: a peer's chunks imported through :mod:`jaxbuf.sharing`, and a
whole request moved as one driver copy in this process.

NIXL's UCX opens a peer's GPU memory with legacy CUDA IPC handles, which ``cuMemCreate``
memory has none of, or with fabric handles, which most single hosts refuse: between two
processes of one host it moves jaxbuf memory through TCP loopback. This transport does what
UCX cannot: the owner's control plane (:mod:`jaxbuf.transfer._control`) serves the chunks of
every tensor as POSIX descriptors, this side maps them at the owner's offsets (one
:class:`~jaxbuf.sharing.ImportedBuffer` per tensor), and a request is one copy of a list of
``(destination, source, size)`` triples over every tensor and segment:
:class:`~jaxbuf.transfer._device_copy.BlockCopier` (one launch on CUDA, one C loop on the
CPU).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import numpy as np

from jaxbuf._interrupts import deferred_interrupts
from jaxbuf.devices import as_device
from jaxbuf.drivers.base import DriverError
from jaxbuf.sharing import ImportedBuffer
from jaxbuf.transfer._blocks import check_block_range
from jaxbuf.transfer._control import ControlLink
from jaxbuf.transfer._transfer import Transfer, TransferError
from jaxbuf.transfer._transport import Link, Operation, Request, Side
from jaxbuf.transfer._wire import LocalAddress, RemoteLayout

__all__ = ["LocalTransfer", "SameHostLink", "host_identity", "same_host_refusal"]


@functools.cache
def host_identity() -> tuple[str, int]:
    """``(boot_id, uid)``: what two processes compare to know they share a host and a user.
    The boot id changes at every boot and differs between hosts (containers of one host
    share it; their network namespaces may still keep them apart: connecting says)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
        return file.read().strip(), os.geteuid()


def same_host_refusal(address: LocalAddress | None) -> str | None:
    """Why a peer offering ``address`` cannot be reached on this host, or None."""
    boot_id, uid = host_identity()
    if address is None:
        return "its metadata offers no same-host address"
    if address.boot_id != boot_id:
        return "it runs on another host (another boot id)"
    if address.uid != uid:
        return f"it runs as uid {address.uid}, this process as {uid}"
    return None


_FEW_PAIRS = 16
"""Block pairs (of all chosen segments) up to which the copy list is built in Python."""


class _Columns(NamedTuple):
    """The chosen segments of a request: ``rows`` of ``(start here, start there, block
    size)``, and the same as ``(S, 1)`` int64 columns for numpy."""

    rows: list[tuple[int, int, int]]
    here: np.ndarray
    there: np.ndarray
    sizes: np.ndarray


class LocalTransfer(Transfer):
    """One copy posted on the same-host transport. On the CPU it is done when posted (no
    event); on CUDA it finishes when the event recorded after the copy has, and its
    notification is sent then (by whichever :meth:`settle` sees it first)."""

    def __init__(
        self,
        request: Request,
        trackers: list[Any],
        driver: Any,
        event: Any,
        link: SameHostLink,
    ) -> None:
        super().__init__(request, trackers)
        self._driver, self._event, self._link = driver, event, link
        self._notification = request.notification
        if event is None:
            self.finished = True
        else:
            self._track()

    def _release(self) -> None:
        if self._event is not None:
            with deferred_interrupts():
                self._driver.destroy_event(self._event)
                self._event = None

    def send_notification(self) -> None:
        """Send the notification of a finished copy (once)."""
        message, self._notification = self._notification, b""
        if message and self.error is None:
            self._link.notify(message)

    def settle(self, timeout: float) -> bool:
        if not self.finished:
            try:
                # Block in the driver rather than spin: the copy is on the device's queue,
                # and a device copy always completes.
                if timeout > 0:
                    self._driver.event_synchronize(self._event)
                elif not self._driver.event_query(self._event):
                    return False
            except Exception as error:  # noqa: BLE001 - the transfer's failure, for wait()
                self._finish(repr(error))
                return True
            self._finish(None)
        if self._notification:
            self.send_notification()
        return True


class SameHostLink(Link):
    """A same-host peer: the control link to its server and its tensors mapped here.

    Invariants: ``imports[t]`` maps exactly the chunks the peer served for tensor ``t`` at
    the last :meth:`update` (its committed sizes are what those chunks back: facts, never
    what the peer's message claims), and a request is checked against those; every
    descriptor received is either mapped, closed, or held by :attr:`control` (closed by
    :meth:`close`).
    """

    transport = "local"

    def __init__(
        self,
        name: str,
        sides: list[Side],
        copier: Any,
        layouts: list[RemoteLayout],
        timeout: float,
    ) -> None:
        peer = layouts[0].agent
        address = layouts[0].local
        assert address is not None  # noqa: S101 - the caller checked same_host_refusal
        self.peer, self.sides, self.copier = peer, sides, copier
        self.driver = sides[0].tensor.driver
        self.device = as_device(sides[0].tensor.device)
        self.address = address.address
        self.control = ControlLink(self.address, name, peer, timeout=timeout)
        self.imports: list[ImportedBuffer | None] = [None] * len(layouts)
        self.segments: list[tuple[int, ...]] = []  # per tensor, the import's segments
        self._column_cache: dict[tuple, _Columns] = {}
        self.starts: list[np.ndarray] = []  # per tensor, each layout segment's address here
        self.aligned = False
        try:
            self.update(layouts)
        except BaseException:
            self.close()
            raise

    # -- following the peer -------------------------------------------------------------
    def update(self, layouts: list[RemoteLayout]) -> None:
        """Ask the peer for its chunks now and map the new ones (unmapping those it
        dropped). ``ValueError`` naming the peer when it answers for another publication
        than ``layouts`` (it changed since: use its newer metadata), names another
        endpoint, or sends what this process cannot map; ``ConnectionError`` when it is
        gone."""
        peer = self.peer
        address = layouts[0].local
        if address is None or address.address != self.address:
            moved = None if address is None else address.address
            raise ValueError(
                f"peer {peer!r}'s same-host address changed from {self.address!r} to {moved!r}"
            )
        try:
            held = [0 if i is None else i.num_physical_chunks for i in self.imports]
            answer = self.control.request_layouts(held)
        except OSError as error:
            raise ConnectionError(f"same-host peer {peer!r} is unreachable: {error}") from error
        try:
            if answer.name != peer:
                raise ValueError(
                    f"the socket at {self.address!r} serves endpoint {answer.name!r}, the "
                    f"metadata names {peer!r}"
                )
            if answer.epoch != layouts[0].epoch:
                raise ValueError(
                    f"peer {peer!r} serves its publication {answer.epoch}, not the "
                    f"metadata's {layouts[0].epoch}: it changed since; connect with its "
                    "newer metadata"
                )
            for index, (layout, fds) in enumerate(answer.tensors):
                self._import(index, layout, fds)
        finally:
            for _, fds in answer.tensors:
                self.control.release(fds)  # what was not handed over
        self._column_cache = {}  # the starts below may change
        self.segments = [self._segments(index, layout) for index, layout in enumerate(layouts)]
        self.starts = [
            np.array([self.imports[index].base_ptr + o for o in layout.segment_offsets], np.int64)  # type: ignore[union-attr]
            for index, layout in enumerate(layouts)
        ]
        # Whether every block on both sides is 8-byte aligned (the copy kernel's int64
        # moves): known once here, so a transfer checks no address.
        addresses = [int(a) for starts in self.starts for a in starts]
        addresses += [a for side in self.sides for a in (*side.starts, side.block_bytes)]
        self.aligned = not any(a % 8 for a in addresses)

    def _import(self, index: int, layout: dict, fds: list[int]) -> None:
        """Map tensor ``index``'s chunks (the descriptors handed over, closed in every
        case); what the driver refuses is the peer's fault, named as such."""
        try:
            with deferred_interrupts():  # the import and its record: one step
                handed = self.control.handover(fds)
                if self.imports[index] is None:
                    self.imports[index] = ImportedBuffer(layout, handed, device=self.device)
                else:
                    self.imports[index].update(layout, handed)  # type: ignore[union-attr]
        except DriverError as error:
            raise ValueError(
                f"same-host peer {self.peer!r} sent tensor {index}'s chunks as descriptors "
                f"this process cannot map: {error}"
            ) from error
        except ValueError as error:
            raise ValueError(f"same-host peer {self.peer!r}, tensor {index}: {error}") from error

    def _segments(self, index: int, layout: RemoteLayout) -> tuple[int, ...]:
        """The segments of tensor ``index``'s import that the peer's layout names (by
        offset and capacity); ValueError when the import and the message disagree."""
        imported = self.imports[index]
        assert imported is not None  # noqa: S101 - mapped by update
        where = {
            (offset, capacity): segment
            for segment, (offset, capacity) in enumerate(
                zip(imported.segment_offsets, imported.segment_capacities)
            )
        }
        segments = []
        for offset, capacity in zip(layout.segment_offsets, layout.segment_capacities):
            segment = where.get((offset, capacity))
            if segment is None:
                raise ValueError(
                    f"peer {layout.agent!r}'s served tensor {index} has no segment at offset "
                    f"{offset} of {capacity} bytes, which its metadata names"
                )
            segments.append(segment)
        return tuple(segments)

    # -- transfers ----------------------------------------------------------------------
    def post(self, request: Request, trackers: list[Any]) -> LocalTransfer:
        """Check every tensor's blocks against what is mapped here, then one copy of the
        whole request; the notification goes once the copy is done."""
        for index, positions in enumerate(request.positions):
            imported = self.imports[index]
            assert imported is not None  # noqa: S101 - mapped by update
            committed = imported.committed_sizes
            segments = self.segments[index]
            block_bytes = self.sides[index].block_bytes
            limit = min(committed[segments[p]] for p in positions) // block_bytes
            check_block_range(request.remote, limit, self.peer, block_bytes)
        here, there, sizes = self._triples(request)
        writing = request.operation is Operation.WRITE
        destinations, sources = (there, here) if writing else (here, there)
        try:
            event = self.copier.copy(destinations, sources, sizes, aligned=self.aligned)
        except Exception as error:  # a driver failure of the copy, named with the request
            raise TransferError(f"{request.words()} failed: {error}") from error
        transfer = LocalTransfer(request, trackers, self.driver, event, self)
        if transfer.finished:
            transfer.send_notification()
        return transfer

    def _columns(self, positions: tuple[tuple[int, ...], ...]) -> _Columns:
        """Per chosen segment of every tensor: where it starts here and there, and its
        block size; made once per choice of segments (they only change with an update)."""
        columns = self._column_cache.get(positions)
        if columns is None:
            rows = [
                (side.starts[p], int(starts[p]), side.block_bytes)
                for side, starts, chosen in zip(self.sides, self.starts, positions)
                for p in chosen
            ]
            array = np.array(rows, np.int64).reshape(-1, 3)
            columns = _Columns(rows, array[:, 0:1], array[:, 1:2], array[:, 2:3])
            self._column_cache[positions] = columns
        return columns

    def _triples(self, request: Request) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(addresses here, addresses there, sizes)`` of every block pair in every chosen
        segment of every tensor, uint64, segment after segment. Adjacent blocks are not
        merged: the kernel cuts every copy into pieces anyway, and a ``memcpy`` of a run
        costs what the ``memcpy`` of its blocks does. A few pairs are computed in Python:
        numpy's per-call cost is most of a small request's post."""
        columns = self._columns(request.positions)
        local, remote = request.local, request.remote
        # Addresses and offsets are below 2**63 (checked when a peer's layout is decoded).
        if len(local) * len(columns.rows) <= _FEW_PAIRS:
            here_ids, there_ids = local.tolist(), remote.tolist()
            here, there, sizes = [], [], []
            for start_here, start_there, size in columns.rows:
                here += [start_here + block * size for block in here_ids]
                there += [start_there + block * size for block in there_ids]
                sizes += [size] * len(here_ids)
            return (
                np.array(here, np.uint64),
                np.array(there, np.uint64),
                np.array(sizes, np.uint64),
            )
        here_all = columns.here + local[None, :] * columns.sizes
        there_all = columns.there + remote[None, :] * columns.sizes
        count = here_all.size
        return (
            here_all.reshape(count).view(np.uint64),
            there_all.reshape(count).view(np.uint64),
            np.repeat(columns.sizes.reshape(-1), len(local)).view(np.uint64),
        )

    def notify(self, message: bytes) -> None:
        try:
            self.control.notify(message)
        except OSError as error:
            raise ConnectionError(
                f"same-host peer {self.peer!r} is unreachable: {error}"
            ) from error

    def close(self) -> None:
        """Unmap every import, then close the connection; each import is forgotten only
        once closed, so an interrupted close is finished by the next call."""
        for index, imported in enumerate(self.imports):
            if imported is not None:
                imported.close()
                self.imports[index] = None
        self.control.close()
