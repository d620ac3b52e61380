"""Block transfers in a KV cache's own terms, between two endpoints over NIXL.

A :class:`KVLayout` says how a buffer holds a cache: blocks of ``block_bytes`` bytes from the
start of each of its segments (segments as K and V, or as layers). A :class:`KVEndpoint` is one
side: a buffer, its :class:`~jaxbuf.transfer.Registration` and its layout. Peers exchange
:meth:`KVEndpoint.metadata` once and again after growth; :meth:`KVEndpoint.read` and
:meth:`KVEndpoint.write` move lists of block ids (block ``local[i]`` of every chosen segment
here <-> block ``remote[i]`` of the same segment there).

Descriptors never span two registrations: NIXL refuses one that does (``NIXL_ERR_NOT_FOUND``).
Blocks that lie inside one registration on both sides go through prepared descriptor lists
(``prep_xfer_dlist`` once per layout epoch, ``make_prepped_xfer`` per transfer: NIXL's fast
path); a request with a block that crosses a registration boundary on either side (a block
that spans growth, a block size that does not divide the chunk) is split at the boundaries of
both sides and built by hand. Either way the same bytes move, and a block outside what a side
registered is refused with an error naming it before NIXL is called.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from jaxbuf._checks import as_int
from jaxbuf.dtypes import uint8
from jaxbuf.transfer._blocks import (
    BlockTable,
    KVLayout,
    block_ids,
    split_pairs,
)
from jaxbuf.transfer._device_copy import BlockCopier
from jaxbuf.transfer._local import (
    LocalLink,
    LocalServer,
    host_identity,
)
from jaxbuf.transfer._nixl import LOCAL_AGENT, Agent, metadata_agent_name
from jaxbuf.transfer._registration import DEFAULT_RELEASE_TIMEOUT, Registration
from jaxbuf.transfer._same_host import link_peer, post_local
from jaxbuf.transfer._transfer import Transfer, TransferError
from jaxbuf.transfer._wire import LocalAddress, RemoteLayout, check_update, decode, encode
from jaxbuf.views import BufferView

__all__ = ["TRANSPORTS", "KVEndpoint", "KVLayout", "Peer", "Transfer", "TransferError"]

TRANSPORTS = ("auto", "local", "nixl")
"""``transport=`` choices: ``"local"`` the same-host transport (chunks imported through
:mod:`jaxbuf.sharing`, driver copies), ``"nixl"`` NIXL, ``"auto"`` the same-host transport
for a peer on this host under this uid whose socket answers, NIXL otherwise."""


class Peer:
    """The other endpoint as this one knows it: its validated
    :class:`~jaxbuf.transfer._wire.RemoteLayout`, the :attr:`transport` that moves its
    blocks (``"local"`` or ``"nixl"``), and for NIXL the prepared descriptor list of its
    blocks (made again when its metadata changes), for the same-host transport the
    :attr:`link` holding its imported buffer and the buffer segments of its layout
    (:attr:`segments`)."""

    def __init__(self, layout: RemoteLayout) -> None:
        self.layout = layout
        self.name = layout.agent
        self.table: BlockTable | None = None
        self.dlist: Any = None
        self.link: LocalLink | None = None
        self.segments: tuple[int, ...] = ()
        self.segment_starts: list[int] = []
        self.aligned = False  # every same-host block 8-byte aligned on both sides

    @property
    def transport(self) -> str:
        """``"local"`` (the same-host transport) or ``"nixl"``."""
        return "nixl" if self.link is None else "local"


def wait_for_notification(
    poll: Any, pending: dict[str, list[bytes]], name: str, message: bytes, timeout: float
) -> None:
    """Poll ``poll()`` (``{sender: [messages]}`` arrived since the last call) into ``pending``
    until ``message`` from ``name`` is there, and take it; TimeoutError naming both after
    ``timeout`` seconds. Other notifications stay in ``pending`` for later waits."""
    deadline = time.monotonic() + timeout
    while True:
        for sender, messages in poll().items():
            pending.setdefault(sender, []).extend(messages)
        queue = pending.get(name, [])
        if message in queue:
            queue.remove(message)
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no notification {message!r} from {name!r} within {timeout} s")
        time.sleep(1e-4)


class KVEndpoint:
    """One side of block transfers: ``tensor`` registered with ``agent``, seen as ``layout``.

    Invariants: the prepared descriptor lists (local and each peer's) always describe the
    current registrations of their side (they are made again when its epoch or committed
    sizes change, before a transfer uses them); every NIXL object this endpoint made is
    released by :meth:`close` (``agent.live_dlists`` and ``live_transfers`` return to what
    they were).

    Parameters
    ----------
    agent : Agent
    tensor : ExtensibleTensor
    layout : KVLayout
    registration : Registration, optional
        Default: a new one over the layout's segments, closed with the endpoint.
    release_timeout : float
        For the registration this endpoint makes (see :class:`Registration`).
    """

    def __init__(
        self,
        agent: Agent | str,
        tensor: Any,
        layout: KVLayout,
        *,
        transport: str = "auto",
        registration: Registration | None = None,
        release_timeout: float = DEFAULT_RELEASE_TIMEOUT,
    ) -> None:
        if isinstance(agent, str):
            if not agent or len(agent) > 256:
                raise ValueError(f"an endpoint name must be 1-256 characters, got {agent!r}")
            name, nixl_agent = agent, None
        elif isinstance(agent, Agent):
            name, nixl_agent = agent.name, agent
        else:
            raise TypeError(
                f"agent must be a jaxbuf.transfer.Agent (NIXL) or a name (same-host transport "
                f"only), got {type(agent).__name__}"
            )
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "nixl" and nixl_agent is None:
            raise ValueError("transport='nixl' needs a jaxbuf.transfer.Agent, not a name")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {layout!r}")
        if not hasattr(tensor, "num_segments"):
            raise TypeError(f"tensor must be an ExtensibleTensor, got {tensor!r:.100}")
        self.segments = layout.segments_of(tensor)
        # Where each layout segment starts: the reservation never moves.
        self.segment_starts = [tensor.base_ptr + tensor.segment_offsets[s] for s in self.segments]
        self.layout, self.agent, self.tensor = layout, nixl_agent, tensor
        self.name, self.transport = name, transport
        self._owns_registration = registration is None
        if registration is None:
            registration = Registration(
                nixl_agent, tensor, self.segments, release_timeout=release_timeout
            )
        elif registration.tensor is not tensor or registration.agent is not nixl_agent:
            raise ValueError("the registration is of another tensor or agent")
        self.registration = registration
        self.peers: dict[str, Peer] = {}
        self._table: BlockTable | None = None
        self._table_key: tuple | None = None
        self._dlist: Any = None
        self._pending_notifications: dict[str, list[bytes]] = {}
        self._all_segments = list(range(len(self.segments)))
        # The same-host server starts with the first metadata(): an endpoint that never
        # publishes runs no thread.
        self._server: LocalServer | None = None
        self.copier = BlockCopier(tensor.driver, tensor.device)  # the same-host copies
        # The version of the last remote_layout(): every message is newer than the last.
        self._layout_version = 0
        self.closed = False

    def __repr__(self) -> str:
        return f"KVEndpoint(name={self.name!r}, peers={sorted(self.peers)})"

    # -- metadata ---------------------------------------------------------------------
    def remote_layout(self) -> RemoteLayout:
        """What a peer learns about this side (see :mod:`jaxbuf.transfer._wire`).

        Its ``epoch`` is this side's layout version, one more with every layout made: not
        the registration epoch, since growth inside a mapped chunk changes no registration
        yet a peer must learn it, and a layout sent again after nothing changed must not be
        refused as stale either."""
        tensor, registration = self.tensor, self.registration
        offsets, capacities = tensor.segment_offsets, tensor.segment_capacities
        committed = tuple(tensor.committed_sizes[s] for s in self.segments)
        self._layout_version += 1
        return RemoteLayout(
            agent=self.name,
            epoch=self._layout_version,
            mem_type=registration.mem_type,
            device_id=registration.device_id,
            base=tensor.base_ptr,
            capacity=tensor.capacity_bytes,
            block_bytes=self.layout.block_bytes,
            segment_offsets=tuple(offsets[s] for s in self.segments),
            segment_capacities=tuple(capacities[s] for s in self.segments),
            committed=committed,
            registrations=tuple(registration.registered_ranges()),
            nixl_metadata=self.agent.metadata() if self.agent is not None else b"",
        )

    def metadata(self) -> bytes:
        """The message to send to peers now, and again after this side grows, releases or
        defragments (its epoch says which is newer).

        Unless ``transport="nixl"``, it also offers this buffer to same-host peers: the
        host's boot id, this uid and the address of a socket that serves the chunks mapped
        now (chunks unmapped later are withdrawn at once, before they are unmapped). Where
        the driver cannot export them (on the CPU, a mapped chunk is reopened through
        ``/proc/self/map_files``, which needs ``CAP_SYS_ADMIN`` or
        ``CAP_CHECKPOINT_RESTORE``), ``"auto"`` offers NIXL alone and ``"local"`` raises
        ``RuntimeError`` saying why."""
        self._check_open()
        layout = self.remote_layout()
        if self.transport != "nixl":
            if self._server is None:
                self._server = LocalServer(self.tensor, self.name)
            if self._server.publish():
                boot_id, uid = host_identity()
                layout = dataclasses.replace(
                    layout, local=LocalAddress(boot_id, uid, self._server.address)
                )
            elif self.transport == "local":
                raise RuntimeError(
                    f"this buffer cannot be served to same-host peers: {self._server.unavailable}"
                )
        return encode(layout)

    def connect(self, message: bytes) -> Peer:
        """Learn a peer from its :meth:`metadata` message, or learn a known peer's growth.

        The message is validated first (:func:`~jaxbuf.transfer._wire.decode`; ValueError),
        against this layout (same block size and segment count) and, for a known peer,
        against its last message (newer epoch, same reservation). A peer that dropped
        registrations is forgotten by NIXL and loaded again, so no stale registration of it
        stays usable here.

        A refused message changes nothing: every check (the NIXL metadata's own agent name
        included, read without loading it) comes before NIXL is touched, and a NIXL load
        that fails after all puts back the peer's last metadata.
        """
        self._check_open()
        layout = decode(message)
        known = self.peers.get(layout.agent)
        if known is not None:
            check_update(known.layout, layout)
        if layout.block_bytes != self.layout.block_bytes:
            raise ValueError(
                f"peer {layout.agent!r} uses blocks of {layout.block_bytes} bytes, this "
                f"endpoint {self.layout.block_bytes}"
            )
        if len(layout.segment_offsets) != len(self.segments):
            raise ValueError(
                f"peer {layout.agent!r} has {len(layout.segment_offsets)} segment(s) in its "
                f"layout, this endpoint {len(self.segments)}"
            )
        if layout.agent == self.name:
            raise ValueError(f"peer {layout.agent!r} has this endpoint's own agent name")
        if layout.nixl_metadata:  # empty from a peer without NIXL
            owner = metadata_agent_name(layout.nixl_metadata)
            if owner != layout.agent:
                raise ValueError(
                    f"the NIXL metadata is of agent {owner!r}, the layout names {layout.agent!r}"
                )
        linked = link_peer(self.transport, self.name, self.tensor.device, layout, known)
        if linked is not None:  # the same-host transport: NIXL is not involved
            peer = known if known is not None else Peer(layout)
            if known is not None:
                self._drop_peer_dlist(known)
            peer.layout, (peer.link, peer.segments) = layout, linked
            imported = peer.link.imported
            peer.segment_starts = [
                imported.base_ptr + imported.segment_offsets[s] for s in peer.segments
            ]
            # Whether every block on both sides is 8-byte aligned (the copy kernel's int64
            # moves): known once here, so a transfer checks no address.
            starts = (*self.segment_starts, *peer.segment_starts, self.layout.block_bytes)
            peer.aligned = not any(start % 8 for start in starts)
            self.peers[peer.name] = peer
            return peer
        if self.agent is None:
            raise ValueError(
                f"peer {layout.agent!r} is not reachable on this host and this endpoint has no "
                "NIXL agent"
            )
        if not layout.nixl_metadata:
            raise ValueError(
                f"peer {layout.agent!r} offers no NIXL metadata (it runs without NIXL), and "
                "the same-host transport does not reach it"
            )
        previous = None  # a peer that dropped registrations is forgotten first, and put back
        if known is not None:  # should its new metadata fail to load
            self._drop_peer_dlist(known)
            if known.layout.registrations.missing_from(layout.registrations):
                previous = known.layout.nixl_metadata
        self.agent.load_remote(layout.agent, layout.nixl_metadata, previous=previous)
        peer = known if known is not None else Peer(layout)
        peer.layout = layout
        self.peers[peer.name] = peer
        return peer

    # -- tables and prepared lists ------------------------------------------------------
    def _local(self) -> tuple[BlockTable, Any]:
        tensor, registration = self.tensor, self.registration
        committed = tensor.committed_sizes
        key = (registration.epoch, tuple(committed))
        if key != self._table_key:
            self._release_local_dlist()
            table = BlockTable(
                tensor.base_ptr,
                [tensor.segment_offsets[s] for s in self.segments],
                [committed[s] for s in self.segments],
                self.layout.block_bytes,
                registration.registered_ranges(),
                registration.device_id,
            )
            if len(table.rows):
                self._dlist = self.agent.prep_dlist(LOCAL_AGENT, table.rows, registration.mem_type)
            self._table, self._table_key = table, key
        return self._table, self._dlist  # type: ignore[return-value]

    def _remote(self, peer: Peer) -> tuple[BlockTable, Any]:
        if peer.table is None:
            layout = peer.layout
            table = BlockTable(
                layout.base,
                layout.segment_offsets,
                layout.committed,
                layout.block_bytes,
                layout.registrations,
                layout.device_id,
            )
            if len(table.rows):
                peer.dlist = self.agent.prep_dlist(peer.name, table.rows, layout.mem_type)
            peer.table = table
        return peer.table, peer.dlist

    def _release_local_dlist(self) -> None:
        dlist, self._dlist, self._table, self._table_key = self._dlist, None, None, None
        if dlist is not None:
            self.agent.release_dlist(dlist)

    def _drop_peer_dlist(self, peer: Peer) -> None:
        dlist, peer.dlist, peer.table = peer.dlist, None, None
        if dlist is not None:
            self.agent.release_dlist(dlist)

    # -- transfers ------------------------------------------------------------------------
    def read(
        self,
        peer: Peer | str,
        local_blocks: Any,
        remote_blocks: Any,
        *,
        segments: Sequence[int] | None = None,
        notification: bytes = b"",
    ) -> Transfer:
        """Post a READ of the peer's ``remote_blocks`` into this side's ``local_blocks``."""
        return self._post("READ", peer, local_blocks, remote_blocks, segments, notification)

    def write(
        self,
        peer: Peer | str,
        local_blocks: Any,
        remote_blocks: Any,
        *,
        segments: Sequence[int] | None = None,
        notification: bytes = b"",
    ) -> Transfer:
        """Post a WRITE of this side's ``local_blocks`` into the peer's ``remote_blocks``."""
        return self._post("WRITE", peer, local_blocks, remote_blocks, segments, notification)

    def _post(
        self,
        operation: str,
        peer: Peer | str,
        local_blocks: Any,
        remote_blocks: Any,
        segments: Sequence[int] | None,
        notification: bytes,
    ) -> Transfer:
        self._check_open()
        peer = self._peer(peer)
        local = block_ids(local_blocks, "local_blocks")
        remote = block_ids(remote_blocks, "remote_blocks")
        if len(local) != len(remote):
            raise ValueError(
                f"{len(local)} local block(s) but {len(remote)} remote block(s): they pair up"
            )
        if len(local) == 0:
            raise ValueError("no blocks to transfer")
        chosen = self._chosen_segments(segments)
        if not isinstance(notification, bytes):
            raise TypeError(f"notification must be bytes, got {type(notification).__name__}")
        if peer.link is not None:
            return post_local(self, peer, operation, local, remote, chosen, notification)
        local_table, local_dlist = self._local()
        remote_table, remote_dlist = self._remote(peer)
        # Both sides' ranges are checked (IndexError) before either path is taken.
        local_index = local_table.prepared_indices(local, "local", chosen)
        remote_index = remote_table.prepared_indices(remote, f"{peer.name}'s", chosen)
        if local_index is not None and remote_index is not None:
            handle = self.agent.make_prepped(
                operation, local_dlist, local_index, remote_dlist, remote_index, notification
            )
        else:
            pairs = split_pairs(local_table, remote_table, chosen, local, remote, peer.name)
            handle = self.agent.make_transfer(
                operation,
                pairs[0],
                pairs[1],
                peer.name,
                (self.registration.mem_type, peer.layout.mem_type),
            )
        try:
            state = self.agent.post(handle, notification)
        except BaseException:
            self.agent.release_transfer(handle)
            raise
        transfer = Transfer(
            self.agent, handle, (operation, local, peer.name, remote), self.registration, state
        )
        if transfer.error is not None:
            transfer.wait(0.0)  # raises TransferError naming the blocks
        return transfer

    def _peer(self, peer: Peer | str) -> Peer:
        name = peer.name if isinstance(peer, Peer) else peer
        known = self.peers.get(name) if isinstance(name, str) else None
        if known is None:
            raise ValueError(f"{peer!r} is not a connected peer (call connect with its metadata)")
        return known

    def _chosen_segments(self, segments: Sequence[int] | None) -> list[int]:
        """Positions in this layout's segments (which are buffer segment indices)."""
        if segments is None:
            return self._all_segments
        chosen = []
        for segment in segments:
            index = as_int(segment, "segment")
            if index not in self.segments:
                raise IndexError(f"segment {segment!r} is not in the layout {list(self.segments)}")
            chosen.append(self.segments.index(index))
        if not chosen:
            raise ValueError("segments must not be empty")
        return chosen

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sending agent (over either
        transport)."""
        arrived = self.agent.notifications() if self.agent is not None else {}
        if self._server is not None:
            for sender, messages in self._server.notifications().items():
                arrived.setdefault(sender, []).extend(messages)
        return arrived

    def wait_notification(self, peer: Peer | str, message: bytes, timeout: float) -> None:
        """Wait until ``peer`` sends ``message`` (with a transfer, or alone); TimeoutError
        naming both after ``timeout`` seconds. Other notifications stay queued for
        :meth:`wait_notification`."""
        name = peer.name if isinstance(peer, Peer) else peer
        wait_for_notification(
            self.notifications, self._pending_notifications, name, message, timeout
        )

    def notify(self, peer: Peer | str, message: bytes) -> None:
        """Send ``message`` to ``peer`` alone (no transfer)."""
        known = self._peer(peer)
        if not isinstance(message, bytes):
            raise TypeError(f"message must be bytes, got {type(message).__name__}")
        if known.link is not None:
            known.link.notify(message)
        else:
            self.agent.notify(known.name, message)

    # -- views ----------------------------------------------------------------------------
    def block_view(self, segment: int, first: int, count: int = 1) -> BufferView:
        """A uint8 view over ``count`` blocks from block ``first`` of buffer segment
        ``segment``: what arrived, zero-copy through ``to_jax`` / ``to_torch`` /
        ``to_numpy`` (``.view(dtype, shape)`` to reinterpret)."""
        index = self._chosen_segments([segment])[0]
        first, count = as_int(first, "first"), as_int(count, "count")
        blocks = self.tensor.committed_sizes[self.segments[index]] // self.layout.block_bytes
        if first < 0 or count < 1 or first + count > blocks:
            raise IndexError(
                f"blocks [{first}, {first + count}) are outside the {blocks} committed block(s) "
                f"of segment {segment}"
            )
        view = self.tensor.segment_view(self.segments[index])
        block_bytes = self.layout.block_bytes
        return BufferView(
            view.ptr + first * block_bytes,
            count * block_bytes,
            uint8,
            None,
            view.device,
            view.owner,
            view.dlpack_device_type,
        )

    # -- closing --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the KVEndpoint is closed")

    def close(self) -> None:
        """Release the prepared lists, forget the peers, close the registration this endpoint
        made. Safe to call twice."""
        if self.closed:
            return
        self._release_local_dlist()
        for peer in list(self.peers.values()):
            self._drop_peer_dlist(peer)
            if peer.link is not None:
                peer.link.close()
                peer.link = None
            if self.agent is not None and peer.name in self.agent.remote_agents:
                self.agent.remove_remote(peer.name)
        self.peers.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.copier.close()
        if self._owns_registration:
            self.registration.close()
        self.closed = True

    def __enter__(self) -> KVEndpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
