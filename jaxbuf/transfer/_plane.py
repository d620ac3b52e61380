"""The machinery behind both endpoints: one control plane, one copy per request.

A :class:`TransferPlane` serves one or more tensors (:class:`~jaxbuf.transfer._transport.Side`
values: :class:`~jaxbuf.transfer.KVEndpoint` has one, :class:`~jaxbuf.transfer.KVCacheEndpoint`
one per tensor of the cache) through

* one control server (:mod:`jaxbuf.transfer._control`: one socket, one thread, whatever
  the tensor count), started by the first ``metadata()``;
* per peer, one :class:`~jaxbuf.transfer._transport.Link` over the transport chosen when
  it connected, so a request is one operation over every tensor;
* one inbox of notifications, from either transport.

Thread-safe: connecting, posting, notifying, forgetting and closing hold one lock (a post
holds it across its copy, so no connect can unmap a peer's chunks under it); waits for a
notification do not. Every check comes before any state changes, so bad input, a stale
message or a refused request changes nothing.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from jaxbuf._checks import as_int, as_seconds
from jaxbuf._errors import Cleanup, ClosedError, Rollback
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf.devices import as_device
from jaxbuf.drivers.base import DriverError
from jaxbuf.transfer._blocks import KVLayout, block_ids
from jaxbuf.transfer._control import MAX_NOTIFICATION, Inbox, Limits
from jaxbuf.transfer._control_server import ControlServer
from jaxbuf.transfer._device_copy import BlockCopier
from jaxbuf.transfer._local import SameHostLink, host_identity, same_host_refusal
from jaxbuf.transfer._nixl import Agent, metadata_agent_name
from jaxbuf.transfer._nixl_link import NixlLink, NixlLocal
from jaxbuf.transfer._registration import DEFAULT_RELEASE_TIMEOUT, Registration
from jaxbuf.transfer._transfer import Transfer
from jaxbuf.transfer._transport import Link, Operation, Request, Side
from jaxbuf.transfer._wire import LocalAddress, RemoteLayout, check_update

__all__ = ["TRANSPORTS", "Peer", "TransferPlane"]

TRANSPORTS = ("auto", "local", "nixl")
"""``transport=`` choices: ``"local"`` the same-host transport (chunks imported through
:mod:`jaxbuf.sharing`, driver copies), ``"nixl"`` NIXL, ``"auto"`` the same-host transport
for a peer on this host under this uid whose socket answers and whose chunks map here, NIXL
otherwise."""


class Peer:
    """The other endpoint as this one knows it: its validated layouts (:attr:`layouts`, one
    per tensor; :attr:`layout` the first), the :class:`~jaxbuf.transfer._transport.Link`
    that moves its blocks, and its transfers in flight (a restarted peer replaces it only
    once they have finished)."""

    def __init__(self, name: str, layouts: list[RemoteLayout], link: Link) -> None:
        self.name, self.layouts, self.link = name, layouts, link
        self._in_flight: dict[int, Transfer] = {}

    @property
    def layout(self) -> RemoteLayout:
        return self.layouts[0]

    @property
    def transport(self) -> str:
        """``"local"`` (the same-host transport) or ``"nixl"``."""
        return self.link.transport

    def track(self, transfer: Transfer) -> None:
        self._in_flight[id(transfer)] = transfer

    def untrack(self, transfer: Transfer) -> None:
        self._in_flight.pop(id(transfer), None)

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for its transfers; whether all have finished."""
        deadline = time.monotonic() + timeout
        return all(
            transfer.settle(max(deadline - time.monotonic(), 0.0))
            for transfer in list(self._in_flight.values())
        )

    @property
    def transfers_in_flight(self) -> int:
        return len(self._in_flight)

    def __repr__(self) -> str:
        return f"Peer({self.name!r}, {len(self.layouts)} tensor(s), {self.transport})"


def _finite_seconds(value: Any, name: str) -> float:
    seconds = as_seconds(value, name)
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    return seconds


class TransferPlane:
    """One side of block transfers over ``tensors`` (``(tensor, KVLayout)`` pairs, or
    ``(tensor, KVLayout, Registration)`` to use a registration the caller owns).

    Invariants: every NIXL object, thread, socket, descriptor and mapping this endpoint
    made is released by :meth:`close`; a peer's link always reflects the last message of
    it that was accepted; :attr:`closed` is set only once everything is released (an
    interrupted close is finished by calling it again).
    """

    kind = "KVEndpoint"

    def __init__(
        self,
        agent: Agent | str,
        tensors: Sequence[tuple[Any, ...]],
        *,
        transport: str = "auto",
        release_timeout: float = DEFAULT_RELEASE_TIMEOUT,
        limits: Limits | None = None,
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
        self.limits = limits if limits is not None else Limits()
        self.name, self.agent, self.transport = name, nixl_agent, transport
        self.instance = secrets.token_hex(16)  # a restarted endpoint is another instance
        self.sides: list[Side] = []
        self._owned: list[Registration] = []  # the registrations this endpoint made
        with Rollback(self.kind) as undo:
            for spec in tensors:
                self.sides.append(self._side(*spec, release_timeout=release_timeout, undo=undo))
            devices = {as_device(side.tensor.device) for side in self.sides}
            if len(devices) != 1:
                raise ValueError(f"an endpoint's tensors must share one device, got {devices}")
        first = self.sides[0].tensor
        self.copier = BlockCopier(first.driver, as_device(first.device))  # the same-host copies
        self._nixl_local = NixlLocal(nixl_agent, self.sides) if nixl_agent is not None else None
        self.inbox = Inbox(self.limits.queued_notifications)
        self.peers: dict[str, Peer] = {}
        self._server: ControlServer | None = None  # started by the first metadata()
        self._version = 0  # the epoch of the last layouts made
        self._lock = threading.RLock()
        self.closed = False

    def _side(
        self,
        tensor: Any,
        layout: KVLayout,
        registration: Registration | None = None,
        *,
        release_timeout: float,
        undo: Rollback,
    ) -> Side:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {layout!r}")
        if not hasattr(tensor, "segment_offsets") or not hasattr(tensor, "add_mapping_listener"):
            raise TypeError(
                f"tensor must be an ExtensibleTensor (jaxbuf), got {type(tensor).__name__}"
            )
        segments = layout.segments_of(tensor)
        if registration is None:
            with deferred_interrupts():  # made and recorded in one step
                registration = Registration(
                    self.agent, tensor, segments, release_timeout=release_timeout
                )
                self._owned.append(registration)
            undo.push(registration.close)
        elif registration.tensor is not tensor or registration.agent is not self.agent:
            raise ValueError("the registration is of another tensor or agent")
        # Where each layout segment starts: the reservation never moves.
        starts = tuple(tensor.base_ptr + tensor.segment_offsets[s] for s in segments)
        return Side(tensor, layout.block_bytes, segments, starts, registration)

    # -- metadata ---------------------------------------------------------------------
    def layouts(self) -> list[RemoteLayout]:
        """What a peer learns about this side now, one layout per tensor, under a new
        epoch; unless ``transport="nixl"``, the chunks mapped now are served to same-host
        peers as this epoch's publication (the control server starts with the first call).

        Where the driver cannot export the chunks (on the CPU, a mapped chunk is reopened
        through ``/proc/self/map_files``, which needs ``CAP_SYS_ADMIN`` or
        ``CAP_CHECKPOINT_RESTORE``), ``"auto"`` offers NIXL alone and ``"local"`` raises
        ``RuntimeError`` saying why."""
        with self._lock:
            self._check_open()
            self._version += 1
            local = None
            if self.transport != "nixl":
                with deferred_interrupts():  # the thread and its record: one step
                    if self._server is None:
                        self._server = ControlServer(
                            self.name, [side.tensor for side in self.sides], self.inbox, self.limits
                        )
                if self._server.publish(self._version):
                    boot_id, uid = host_identity()
                    local = LocalAddress(boot_id, uid, self._server.address)
                elif self.transport == "local":
                    raise RuntimeError(
                        "this buffer cannot be served to same-host peers: "
                        f"{self._server.unavailable}"
                    )
            nixl = self.agent.metadata() if self.agent is not None else b""
            return [
                self._layout(side, local, nixl if i == 0 else b"")
                for i, side in enumerate(self.sides)
            ]

    def _layout(self, side: Side, local: LocalAddress | None, nixl: bytes) -> RemoteLayout:
        tensor, registration = side.tensor, side.registration
        offsets, capacities = tensor.segment_offsets, tensor.segment_capacities
        return RemoteLayout(
            agent=self.name,
            instance=self.instance,
            epoch=self._version,
            mem_type=registration.mem_type,
            device_id=registration.device_id,
            base=tensor.base_ptr,
            capacity=tensor.capacity_bytes,
            block_bytes=side.block_bytes,
            segment_offsets=tuple(offsets[s] for s in side.segments),
            segment_capacities=tuple(capacities[s] for s in side.segments),
            committed=tuple(tensor.committed_sizes[s] for s in side.segments),
            registrations=tuple(registration.registered_ranges()),
            nixl_metadata=nixl,
            local=local,
        )

    def check_layouts(self, layouts: list[RemoteLayout]) -> None:
        """ValueError unless ``layouts`` (decoded) fit this endpoint: one per tensor, the
        same block sizes and segment counts, one agent and instance, another name than
        this one's, NIXL metadata of that agent; and for a known peer of the same instance,
        each newer than the last accepted. Changes nothing."""
        if len(layouts) != len(self.sides):
            raise ValueError(
                f"the peer has {len(layouts)} tensor(s), this endpoint {len(self.sides)}"
            )
        first = layouts[0]
        for index, (layout, side) in enumerate(zip(layouts, self.sides)):
            which = f"the peer's tensor {index}" if len(layouts) > 1 else f"peer {layout.agent!r}"
            if (layout.agent, layout.instance, layout.local) != (
                first.agent,
                first.instance,
                first.local,
            ):
                raise ValueError(
                    f"the peer's tensors name several agents, instances or addresses: "
                    f"{first.agent!r} and {layout.agent!r}"
                )
            if layout.block_bytes != side.block_bytes:
                raise ValueError(
                    f"{which} has blocks of {layout.block_bytes} bytes, this endpoint "
                    f"{side.block_bytes}"
                )
            if len(layout.segment_offsets) != len(side.segments):
                raise ValueError(
                    f"{which} has {len(layout.segment_offsets)} segment(s) in its layout, "
                    f"this endpoint {len(side.segments)}"
                )
        if first.agent == self.name:
            raise ValueError(f"peer {first.agent!r} has this endpoint's own agent name")
        if first.nixl_metadata:  # empty from a peer without NIXL
            owner = metadata_agent_name(first.nixl_metadata)
            if owner != first.agent:
                raise ValueError(
                    f"the NIXL metadata is of agent {owner!r}, the layout names {first.agent!r}"
                )
        known = self.peers.get(first.agent)
        if known is not None and known.layout.instance == first.instance:
            for index, (old, new) in enumerate(zip(known.layouts, layouts)):
                try:
                    check_update(old, new)
                except ValueError as error:
                    if len(layouts) == 1:
                        raise
                    raise ValueError(f"tensor {index}'s metadata: {error}") from None

    def connect_layouts(self, layouts: list[RemoteLayout]) -> Peer:
        """Learn a peer from its layouts, or learn a known peer's change (see the
        endpoints' ``connect``). A known peer of another instance (restarted under its
        name) replaces the old one once the old one's transfers have finished; until then
        ``ValueError`` says so (or :meth:`forget` it first)."""
        with self._lock:
            self._check_open()
            self.check_layouts(layouts)
            name = layouts[0].agent
            known = self.peers.get(name)
            if known is not None and known.layout.instance != layouts[0].instance:
                if not known.settle(0.0):
                    raise ValueError(
                        f"peer {name!r} restarted (its metadata is of a new instance) while "
                        f"{known.transfers_in_flight} transfer(s) with its old instance are "
                        f"in flight: wait for them, or forget({name!r}), then connect again"
                    )
                self._drop(known)
                known = None
            if known is not None:
                known.link.update(layouts)
                known.layouts = layouts
                return known
        # A new peer: its same-host link (a connection, then a wait for the peer's answer
        # of up to the io_timeout) is opened without the lock, so a silent or slow peer
        # never holds up transfers to the others; it is recorded once the lock is back.
        local: Link | None = None
        try:
            local, reason = self._same_host_link(layouts)
            with self._lock:
                self._check_open()
                if name in self.peers:
                    raise ValueError(
                        f"peer {name!r} was connected by another thread meanwhile; connect "
                        "again to follow it to this metadata"
                    )
                link = local if local is not None else self._nixl_link(layouts, reason)
                peer = Peer(name, layouts, link)
                self.peers[name] = peer
                return peer
        except BaseException:
            recorded = self.peers.get(name)
            if local is not None and (recorded is None or recorded.link is not local):
                local.close()
            raise

    def _same_host_link(self, layouts: list[RemoteLayout]) -> tuple[Link | None, str | None]:
        """The same-host link to a new peer, or None and why not (``transport="local"``,
        or no NIXL agent to fall back to: ``ValueError`` instead)."""
        name = layouts[0].agent
        if self.transport == "nixl":
            return None, "transport='nixl'"
        reason = same_host_refusal(layouts[0].local)
        if reason is None:
            try:
                link = SameHostLink(
                    self.name, self.sides, self.copier, layouts, self.limits.io_timeout
                )
                return link, None
            except (OSError, ValueError, DriverError) as error:
                if self.transport == "local" or self.agent is None:
                    raise ValueError(
                        f"peer {name!r} cannot use the same-host transport: {error}"
                    ) from error
                reason = f"{type(error).__name__}: {error}"
        if self.transport == "local":
            raise ValueError(f"peer {name!r} cannot use the same-host transport: {reason}")
        return None, reason

    def _nixl_link(self, layouts: list[RemoteLayout], reason: str | None) -> Link:
        """The NIXL link to a new peer the same-host transport does not reach (``reason``)."""
        name = layouts[0].agent
        if self.agent is None or self._nixl_local is None:
            raise ValueError(
                f"peer {name!r} is not reachable on this host ({reason}) and this endpoint "
                "has no NIXL agent"
            )
        if not layouts[0].nixl_metadata:
            raise ValueError(
                f"peer {name!r} offers no NIXL metadata (it runs without NIXL), and "
                f"the same-host transport does not reach it ({reason})"
            )
        return NixlLink(self.agent, self._nixl_local, layouts)

    # -- transfers --------------------------------------------------------------------
    def post(
        self,
        operation: Operation,
        peer: Any,
        local_blocks: Any,
        remote_blocks: Any,
        positions: tuple[tuple[int, ...], ...],
        notification: bytes,
    ) -> Transfer:
        """Check the request on both sides (every tensor), then post it as one operation."""
        local = block_ids(local_blocks, "local_blocks")
        remote = block_ids(remote_blocks, "remote_blocks")
        if len(local) != len(remote):
            raise ValueError(
                f"{len(local)} local block(s) but {len(remote)} remote block(s): they pair up"
            )
        if len(local) == 0:
            raise ValueError("no blocks to transfer")
        _check_message(notification, "notification")
        with self._lock:
            self._check_open()
            known = self.peer(peer)
            for side, chosen in zip(self.sides, positions):
                side.check(local, chosen)
            request = Request(operation, known.name, local, remote, positions, notification)
            trackers = [*(side.registration for side in self.sides), known]
            return known.link.post(request, trackers)

    def peer(self, peer: Any) -> Peer:
        """The connected :class:`Peer` of ``peer`` (a Peer or a name); ValueError if none."""
        name = getattr(peer, "name", peer)
        known = self.peers.get(name) if isinstance(name, str) else None
        if known is None:
            raise ValueError(f"{peer!r} is not a connected peer (call connect with its metadata)")
        return known

    def positions(self, segments: Sequence[int] | None) -> tuple[int, ...]:
        """Layout positions of the single tensor's buffer ``segments`` (None: all)."""
        side = self.sides[0]
        if segments is None:
            return tuple(range(len(side.segments)))
        chosen = []
        for segment in segments:
            index = as_int(segment, "segment")
            if index not in side.segments:
                raise IndexError(f"segment {segment!r} is not in the layout {list(side.segments)}")
            chosen.append(side.segments.index(index))
        if not chosen:
            raise ValueError("segments must not be empty")
        return tuple(chosen)

    # -- notifications ----------------------------------------------------------------
    def _poll(self) -> None:
        """Take NIXL's new notifications into the inbox (the take and its record: one
        step), and send those of finished same-host copies."""
        if self.agent is not None:
            with deferred_interrupts():
                arrived = self.agent.notifications()
                for sender, messages in arrived.items():
                    self.inbox.put(sender, messages)
        for peer in list(self.peers.values()):
            if peer.transfers_in_flight:
                peer.settle(0.0)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sender (over either
        transport)."""
        self._poll()
        return self.inbox.drain()

    def wait_notification(self, peer: Any, message: bytes, timeout: float) -> None:
        """Wait until ``peer`` sends ``message`` (with a transfer, or alone); TimeoutError
        naming both after ``timeout`` seconds (a finite, non-negative number);
        ``ClosedError`` at once when another thread closes the endpoint meanwhile. Other
        notifications stay queued. An interrupt never loses one that arrived."""
        name = getattr(peer, "name", peer)
        if not isinstance(name, str):
            raise TypeError(f"peer must be a peer or its name, got {peer!r}")
        _check_message(message, "message")
        timeout = _finite_seconds(timeout, "timeout")
        self._check_open()
        if not self.inbox.wait_for(name, message, timeout, self._poll if self.agent else None):
            raise TimeoutError(f"no notification {message!r} from {name!r} within {timeout} s")

    def notify(self, peer: Any, message: bytes) -> None:
        """Send ``message`` to ``peer`` alone (no transfer)."""
        _check_message(message, "message")
        with self._lock:
            self._check_open()
            self.peer(peer).link.notify(message)

    # -- peers and closing ------------------------------------------------------------
    def forget(self, peer: Any, timeout: float = DEFAULT_RELEASE_TIMEOUT) -> None:
        """Forget a connected peer: wait up to ``timeout`` seconds for its transfers in
        flight (``TimeoutError`` if they do not finish: nothing changes), then release
        what this endpoint holds of it (its imported chunks, its NIXL metadata). A peer
        restarted under its name is then connected as new."""
        timeout = _finite_seconds(timeout, "timeout")
        with self._lock:
            self._check_open()
            known = self.peer(peer)
            if not known.settle(timeout):
                raise TimeoutError(
                    f"peer {known.name!r} has {known.transfers_in_flight} transfer(s) in "
                    f"flight after {timeout} s; it is not forgotten"
                )
            self._drop(known)

    def _drop(self, peer: Peer) -> None:
        """Close the peer's link, then forget it (an interrupted close is resumed by the
        next one: the peer stays recorded until its link is closed)."""
        peer.link.close()
        del self.peers[peer.name]

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(self.kind, "closed")
        for side in self.sides:
            if side.tensor.released:
                raise ClosedError(
                    "ExtensibleTensor", "freed", f"the {self.kind}'s tensor cannot transfer"
                )

    def close(self) -> None:
        """Forget every peer, stop the control server, release the prepared lists, the
        copier and the registrations this endpoint made. Safe to call twice.

        Every step runs whatever the others raise, an interrupt included; the first
        failure is raised with the others as notes, and the endpoint stays open so that
        ``close()`` again finishes (each step is idempotent)."""
        if self.closed:
            return
        with self._lock:
            cleanup = Cleanup(f"{self.kind}.close")
            for peer in list(self.peers.values()):
                cleanup.run(self._drop, peer)
            if self._server is not None:
                cleanup.run(self._server.close)
            if self._nixl_local is not None:
                cleanup.run(self._nixl_local.close)
            cleanup.run(self.copier.close)
            for registration in self._owned:
                cleanup.run(registration.close)
            if not cleanup.errors:
                self.closed = True
                self.inbox.close(self.kind)  # a wait in another thread ends now
            cleanup.raise_first()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_message(message: Any, name: str) -> None:
    if not isinstance(message, bytes):
        raise TypeError(f"{name} must be bytes, got {type(message).__name__}")
    if len(message) > MAX_NOTIFICATION:
        raise ValueError(f"a {name} of {len(message)} bytes is over {MAX_NOTIFICATION}")
