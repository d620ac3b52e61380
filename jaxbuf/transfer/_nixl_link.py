"""The NIXL transport: one descriptor list per request over every tensor and segment.

Descriptors never span two registrations: NIXL refuses one that does
(``NIXL_ERR_NOT_FOUND``). Blocks that lie inside one registration on both sides go through
prepared descriptor lists (:class:`NixlLocal` prepares this endpoint's blocks of every
tensor as one list, :class:`NixlLink` the peer's, each once per layout epoch;
``make_prepped_xfer`` per request: NIXL's fast path). A request with a block that crosses a
registration boundary on either side (a block that spans growth, a block size that does not
divide the chunk) is cut at the boundaries of both sides and built by hand, contiguous runs
merged where no boundary of either side lies between them. Either way the whole request is
one NIXL transfer, and a block outside what a side registered is refused with an error
naming it before NIXL is called.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxbuf.transfer._blocks import BlockTable, split_pairs
from jaxbuf.transfer._nixl import LOCAL_AGENT, Agent
from jaxbuf.transfer._transfer import Transfer
from jaxbuf.transfer._transport import Link, Request, Side
from jaxbuf.transfer._wire import RemoteLayout

__all__ = ["NixlLink", "NixlLocal", "NixlTransfer", "merge_runs"]

# Poll without sleeping this long: small transfers finish in microseconds, and a sleep costs
# a scheduler round trip (tens of microseconds, far more on a loaded machine).
_SPIN_SECONDS = 2e-3


class NixlTransfer(Transfer):
    """One request posted to NIXL; its handle is released once it has finished."""

    def __init__(
        self, request: Request, trackers: list[Any], agent: Agent, handle: Any, state: str
    ) -> None:
        super().__init__(request, trackers)
        self._agent, self._handle = agent, handle
        if state == "PROC":
            self._track()
        else:  # done (or failed) in the post itself, as small transfers often are
            self._finish(None if state == "DONE" else f"NIXL reported {state}")

    def _release(self) -> None:
        if self._handle is not None:
            self._agent.release_transfer(self._handle)
            self._handle = None

    def settle(self, timeout: float) -> bool:
        if self.finished:
            return True
        start = time.monotonic()
        while True:
            state = self._agent.state(self._handle)
            if state != "PROC":
                self._finish(None if state == "DONE" else f"NIXL reported {state}")
                return True
            waited = time.monotonic() - start
            if waited >= timeout:
                return False
            if waited > _SPIN_SECONDS:
                time.sleep(min(1e-4, timeout - waited))


class NixlLocal:
    """This endpoint's blocks of every tensor as NIXL sees them: one :class:`BlockTable`
    per tensor and one prepared descriptor list over all their rows.

    Invariant: the list describes the current registrations and committed sizes of every
    tensor (made again, the old one released, when either changes, before a request uses
    it); :meth:`close` releases it."""

    def __init__(self, agent: Agent, sides: list[Side]) -> None:
        self.agent, self.sides = agent, sides
        self.tables: list[BlockTable] = []
        self.row_bases: list[int] = []
        self.dlist: Any = None
        self._key: tuple | None = None

    def current(self) -> NixlLocal:
        sides = self.sides
        key = tuple((side.registration.epoch, tuple(side.tensor.committed_sizes)) for side in sides)
        if key != self._key:
            self.close()
            self.tables = [
                BlockTable(
                    side.tensor.base_ptr,
                    [side.tensor.segment_offsets[s] for s in side.segments],
                    [side.tensor.committed_sizes[s] for s in side.segments],
                    side.block_bytes,
                    side.registration.registered_ranges(),
                    side.registration.device_id,
                )
                for side in sides
            ]
            self.row_bases, self.dlist = _prepare(
                self.agent, LOCAL_AGENT, self.tables, sides[0].registration.mem_type
            )
            self._key = key
        return self

    def close(self) -> None:
        dlist, self.dlist, self._key = self.dlist, None, None
        if dlist is not None:
            self.agent.release_dlist(dlist)


def _prepare(
    agent: Agent, name: str, tables: list[BlockTable], mem_type: str
) -> tuple[list[int], Any]:
    """Where each table's rows start in one list of all of them, and that list prepared
    (None when there is nothing to prepare, or a table is too large to)."""
    bases, count = [], 0
    for table in tables:
        bases.append(count)
        count += len(table.rows)
    if not count or not all(table.prepared for table in tables):
        return bases, None
    rows = np.concatenate([table.rows for table in tables]) if len(tables) > 1 else tables[0].rows
    return bases, agent.prep_dlist(name, rows, mem_type)


class NixlLink(Link):
    """A peer reached through NIXL: its metadata loaded into the agent, its blocks of every
    tensor as tables and one prepared list (made again when its metadata changes)."""

    transport = "nixl"

    def __init__(self, agent: Agent, local: NixlLocal, layouts: list[RemoteLayout]) -> None:
        self.agent, self.local = agent, local
        self.peer = layouts[0].agent
        self.layouts: list[RemoteLayout] = []
        self._tables: list[BlockTable] | None = None
        self._row_bases: list[int] = []
        self._dlist: Any = None
        self.update(layouts)

    def update(self, layouts: list[RemoteLayout]) -> None:
        """Load the peer's newer NIXL metadata. A peer that dropped registrations is
        forgotten first and loaded again (so none of its stale registrations stays usable
        here); a load that fails puts back its last metadata."""
        if not layouts[0].nixl_metadata:
            raise ValueError(
                f"peer {self.peer!r} offers no NIXL metadata (it runs without NIXL), and "
                "NIXL moves its blocks"
            )
        self._drop_tables()
        previous = None
        if self.layouts and any(
            old.registrations.missing_from(new.registrations)
            for old, new in zip(self.layouts, layouts)
        ):
            previous = self.layouts[0].nixl_metadata
        self.agent.load_remote(self.peer, layouts[0].nixl_metadata, previous=previous)
        self.layouts = layouts

    def _drop_tables(self) -> None:
        dlist, self._dlist, self._tables = self._dlist, None, None
        if dlist is not None:
            self.agent.release_dlist(dlist)

    def _remote(self) -> list[BlockTable]:
        if self._tables is None:
            tables = [
                BlockTable(
                    layout.base,
                    layout.segment_offsets,
                    layout.committed,
                    layout.block_bytes,
                    layout.registrations,
                    layout.device_id,
                )
                for layout in self.layouts
            ]
            self._row_bases, self._dlist = _prepare(
                self.agent, self.peer, tables, self.layouts[0].mem_type
            )
            self._tables = tables
        return self._tables

    def post(self, request: Request, trackers: list[Any]) -> NixlTransfer:
        """Check every tensor's blocks on both sides (IndexError), then post the whole
        request as one NIXL transfer."""
        local = self.local.current()
        remote_tables = self._remote()
        local_indices, remote_indices = [], []
        for t, positions in enumerate(request.positions):
            positions_list = list(positions)
            mine = local.tables[t].prepared_indices(request.local, "local", positions_list)
            theirs = remote_tables[t].prepared_indices(request.remote, self.peer, positions_list)
            local_indices.append(None if mine is None else np.asarray(mine) + local.row_bases[t])
            remote_indices.append(
                None if theirs is None else np.asarray(theirs) + self._row_bases[t]
            )
        operation = request.operation.value
        prepared = local.dlist is not None and self._dlist is not None
        if prepared and all(i is not None for i in (*local_indices, *remote_indices)):
            handle = self.agent.make_prepped(
                operation,
                local.dlist,
                _joined(local_indices),
                self._dlist,
                _joined(remote_indices),
                request.notification,
            )
        else:
            mine_rows, their_rows = [], []
            for t, positions in enumerate(request.positions):
                pairs = split_pairs(
                    local.tables[t],
                    remote_tables[t],
                    list(positions),
                    request.local,
                    request.remote,
                    self.peer,
                )
                mine_rows.append(pairs[0])
                their_rows.append(pairs[1])
            mine, theirs = merge_runs(
                np.concatenate(mine_rows),
                np.concatenate(their_rows),
                _boundaries(local.tables),
                _boundaries(remote_tables),
            )
            handle = self.agent.make_transfer(
                operation,
                mine,
                theirs,
                self.peer,
                (self.local.sides[0].registration.mem_type, self.layouts[0].mem_type),
            )
        try:
            state = self.agent.post(handle, request.notification)
        except BaseException:
            self.agent.release_transfer(handle)
            raise
        transfer = NixlTransfer(request, trackers, self.agent, handle, state)
        if transfer.error is not None:
            transfer.wait(0.0)  # raises TransferError naming the blocks
        return transfer

    def notify(self, message: bytes) -> None:
        self.agent.notify(self.peer, message)

    def close(self) -> None:
        self._drop_tables()
        if self.peer in self.agent.remote_agents:
            self.agent.remove_remote(self.peer)


def _joined(indices: list[Any]) -> Any:
    return indices[0] if len(indices) == 1 else np.concatenate(indices)


def _boundaries(tables: list[BlockTable]) -> np.ndarray:
    """Every address where a registered piece of these tables starts or ends, sorted."""
    edges = [
        np.concatenate([table.starts, table.ends]) + table.base
        for table in tables
        if len(table.starts)
    ]
    return np.unique(np.concatenate(edges)) if edges else np.empty(0, np.int64)


def merge_runs(
    local: np.ndarray, remote: np.ndarray, local_edges: np.ndarray, remote_edges: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor pairs (``(N, 3)`` rows of address, nbytes, device id on each side) with
    every run of consecutive pairs that is contiguous on both sides merged into one, except
    where a registration boundary of either side (``*_edges``: sorted addresses) lies
    between two of them: a merged descriptor never spans two registrations."""
    if len(local) < 2:
        return local, remote
    ends_here = local[:-1, 0].astype(np.int64) + local[:-1, 1].astype(np.int64)
    ends_there = remote[:-1, 0].astype(np.int64) + remote[:-1, 1].astype(np.int64)
    joins = (
        (ends_here == local[1:, 0].astype(np.int64))
        & (ends_there == remote[1:, 0].astype(np.int64))
        & ~np.isin(ends_here, local_edges)
        & ~np.isin(ends_there, remote_edges)
    )
    if not joins.any():
        return local, remote
    firsts = np.flatnonzero(np.concatenate(([True], ~joins)))  # the first pair of each run
    sizes = np.add.reduceat(local[:, 1], firsts)
    merged_here, merged_there = local[firsts].copy(), remote[firsts].copy()
    merged_here[:, 1] = sizes
    merged_there[:, 1] = sizes
    return merged_here, merged_there
