"""A whole KV cache as one side of block transfers: :class:`KVCacheEndpoint` over
:class:`~jaxbuf.ExtensibleKVCacheBuffers`.

An engine addresses its cache by block id: block ``b`` is block ``b`` of every layer, so one
request of block ids moves those blocks in every KV-cache tensor (as vLLM's NIXL connector
does). The endpoint holds one :class:`~jaxbuf.transfer.KVEndpoint` per tensor, each with the
tensor's own layout (``KVLayout(bytes_per_block_per_segment)`` over all its segments), and
pairs them with the peer's tensors in order. Each per-tensor endpoint follows its tensor as
before (its registration and same-host server are mapping listeners of the tensor), so the
cache's ``commit``, ``release_physical``, ``recommit`` and ``defragment=True`` need nothing
here beyond sending :meth:`KVCacheEndpoint.metadata` again afterwards.

Metadata message (every integer in network order)::

    b"JXKC"  protocol (u32)  tensor count (u32)  then per tensor: length (u32), a
    :mod:`jaxbuf.transfer._wire` message of that tensor's endpoint

Every per-tensor message is decoded and checked against this cache (tensor count, block
sizes, one agent name) before any peer state changes.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any

from jaxbuf._checks import as_seconds
from jaxbuf._errors import Cleanup, ClosedError
from jaxbuf.kv import ExtensibleKVCacheBuffers
from jaxbuf.transfer._blocks import KVLayout
from jaxbuf.transfer._endpoint import TRANSPORTS, KVEndpoint, Peer, wait_for_notification
from jaxbuf.transfer._nixl import Agent
from jaxbuf.transfer._registration import DEFAULT_RELEASE_TIMEOUT
from jaxbuf.transfer._transfer import DEFAULT_TIMEOUT, Transfer
from jaxbuf.transfer._wire import decode
from jaxbuf.views import BufferView

__all__ = ["KVCacheEndpoint", "KVCachePeer", "KVCacheTransfer"]

_MAGIC = b"JXKC"
_HEADER = struct.Struct("!4sII")  # magic, protocol, tensor count
_LENGTH = struct.Struct("!I")
PROTOCOL = 1
_MAX_TENSORS = 1 << 12  # a few KV-cache tensors per layer, as the per-tensor segment bound
_MAX_MESSAGE = 1 << 30


def _encode(messages: Sequence[bytes]) -> bytes:
    parts = [_HEADER.pack(_MAGIC, PROTOCOL, len(messages))]
    for message in messages:
        parts += [_LENGTH.pack(len(message)), message]
    return b"".join(parts)


def _split(message: Any) -> list[bytes]:
    """The per-tensor messages of a cache message; ValueError naming what is malformed."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise TypeError(f"metadata must be bytes, got {type(message).__name__}")
    message = bytes(message)
    if not _HEADER.size <= len(message) <= _MAX_MESSAGE:
        raise ValueError(f"a KV cache metadata message of {len(message)} bytes is malformed")
    magic, protocol, count = _HEADER.unpack_from(message)
    if magic != _MAGIC:
        raise ValueError(
            f"not a KV cache metadata message (magic {magic!r}): a KVEndpoint's message goes "
            "to a KVEndpoint"
        )
    if protocol != PROTOCOL:
        raise ValueError(f"KV cache metadata protocol {protocol} is not {PROTOCOL}")
    if not 0 < count <= _MAX_TENSORS:
        raise ValueError(f"KV cache metadata must list 1 to {_MAX_TENSORS} tensors, got {count}")
    parts, offset = [], _HEADER.size
    for index in range(count):
        if offset + _LENGTH.size > len(message):
            raise ValueError(f"KV cache metadata ends before tensor {index}'s length")
        (length,) = _LENGTH.unpack_from(message, offset)
        offset += _LENGTH.size
        if offset + length > len(message):
            raise ValueError(f"KV cache metadata ends inside tensor {index}'s message")
        parts.append(message[offset : offset + length])
        offset += length
    if offset != len(message):
        raise ValueError(f"KV cache metadata has {len(message) - offset} trailing byte(s)")
    return parts


class KVCachePeer:
    """The other cache as this endpoint knows it: its name, :attr:`transport` and one
    :class:`~jaxbuf.transfer.Peer` per tensor (:attr:`peers`, in tensor order)."""

    def __init__(self, name: str, peers: list[Peer]) -> None:
        self.name, self.peers = name, peers

    @property
    def transport(self) -> str:
        """``"local"`` (the same-host transport) or ``"nixl"``: every tensor takes the one
        the first took (a peer's tensors share its host, uid and agent)."""
        return self.peers[0].transport

    def __repr__(self) -> str:
        return f"KVCachePeer({self.name!r}, {len(self.peers)} tensor(s), {self.transport})"


class KVCacheTransfer:
    """One request of block ids over every tensor of the cache: a :class:`Transfer` per
    tensor, done when all are. :meth:`wait` raises the first failure (TransferError) after
    settling every part, so no part stays in flight unnoticed."""

    def __init__(self, parts: list[Transfer]) -> None:
        self.parts = parts

    @property
    def what(self) -> str:
        return f"{self.parts[0].what} in {len(self.parts)} tensor(s)"

    def __repr__(self) -> str:
        return f"KVCacheTransfer({self.what})"

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every part; whether all have finished."""
        deadline = time.monotonic() + timeout
        return all(part.settle(max(deadline - time.monotonic(), 0.0)) for part in list(self.parts))

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Wait for every part; TimeoutError (those unfinished stay in flight) or the first
        part's TransferError."""
        timeout = as_seconds(timeout, "timeout")
        if not self.settle(timeout):
            raise TimeoutError(f"{self.what} did not finish within {timeout} s")
        for part in self.parts:
            part.wait(0.0)

    @property
    def done(self) -> bool:
        """Whether every part has finished, checked now."""
        return self.settle(0.0)


class KVCacheEndpoint:
    """One side of block transfers of a whole :class:`~jaxbuf.ExtensibleKVCacheBuffers`:
    block ids address every tensor at once.

    Invariants: :attr:`endpoints` holds one :class:`~jaxbuf.transfer.KVEndpoint` per tensor
    of the cache, in order, each over all the tensor's segments with blocks of its
    ``bytes_per_block_per_segment``; a connected peer has as many tensors with the same
    block sizes, tensor ``i`` here pairing with tensor ``i`` there; :meth:`close` closes
    every per-tensor endpoint (their registrations and servers with them).

    The cache may grow, release, recommit and defragment while the endpoint is open, as a
    tensor may under a :class:`~jaxbuf.transfer.KVEndpoint`: registrations follow at once
    (a release waits for transfers in flight, ``release_timeout``); a peer learns the change
    from :meth:`metadata` sent again. A transfer is bounded by what both sides have
    committed, and a block outside it raises IndexError before anything moves.

    Parameters
    ----------
    agent : Agent or str
        A NIXL :class:`~jaxbuf.transfer.Agent` (shared by the tensors: one NIXL agent per
        process, as an engine has), or a name (the same-host transport only).
    cache : ExtensibleKVCacheBuffers
    transport : {"auto", "local", "nixl"}
        As :class:`~jaxbuf.transfer.KVEndpoint`'s, for every tensor.
    release_timeout : float
        For each tensor's registration.
    """

    def __init__(
        self,
        agent: Agent | str,
        cache: ExtensibleKVCacheBuffers,
        *,
        transport: str = "auto",
        release_timeout: float = DEFAULT_RELEASE_TIMEOUT,
    ) -> None:
        if not isinstance(cache, ExtensibleKVCacheBuffers):
            raise TypeError(f"cache must be an ExtensibleKVCacheBuffers, got {cache!r}")
        if cache.freed or not len(cache):
            raise ValueError("the KV cache is freed or holds no tensor")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.cache = cache
        self.endpoints: list[KVEndpoint] = []
        try:
            for tensor, block_bytes in cache.buffers:
                self.endpoints.append(
                    KVEndpoint(
                        agent,
                        tensor,
                        KVLayout(block_bytes),
                        transport=transport,
                        release_timeout=release_timeout,
                    )
                )
        except BaseException:
            for endpoint in self.endpoints:
                endpoint.close()
            raise
        self.name = self.endpoints[0].name
        self.agent = self.endpoints[0].agent
        self.transport = transport
        self.peers: dict[str, KVCachePeer] = {}
        self._pending: dict[str, list[bytes]] = {}
        self.closed = False

    def __repr__(self) -> str:
        return (
            f"KVCacheEndpoint(name={self.name!r}, {len(self.endpoints)} tensor(s), "
            f"peers={sorted(self.peers)})"
        )

    # -- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """The message to send to peers now, and again after the cache commits, releases,
        recommits or defragments: every tensor's :meth:`KVEndpoint.metadata`."""
        self._check_open()
        return _encode([endpoint.metadata() for endpoint in self.endpoints])

    def connect(self, message: bytes) -> KVCachePeer:
        """Learn a peer cache from its :meth:`metadata`, or learn its change.

        Every per-tensor message is decoded and checked first (ValueError: malformed, another
        tensor count or block size, several agent names, a stale or moved layout of a known
        peer), so a refused message changes nothing. Each tensor is then connected in turn
        (:meth:`KVEndpoint.connect`); a failure there (a socket that stops answering, NIXL
        refusing the metadata) leaves the tensors before it updated and raises.
        """
        self._check_open()
        parts = _split(message)
        if len(parts) != len(self.endpoints):
            raise ValueError(
                f"the peer's KV cache has {len(parts)} tensor(s), this one {len(self.endpoints)}"
            )
        names = set()
        for index, (part, endpoint) in enumerate(zip(parts, self.endpoints)):
            try:
                layout = decode(part)
            except ValueError as error:
                raise ValueError(f"tensor {index}'s metadata: {error}") from None
            known = endpoint.peers.get(layout.agent)
            if known is not None:
                try:
                    decode(part, previous=known.layout)
                except ValueError as error:
                    raise ValueError(f"tensor {index}'s metadata: {error}") from None
            if layout.block_bytes != endpoint.layout.block_bytes:
                raise ValueError(
                    f"the peer's tensor {index} has blocks of {layout.block_bytes} bytes per "
                    f"segment, this cache's {endpoint.layout.block_bytes}"
                )
            names.add(layout.agent)
        if len(names) != 1:
            raise ValueError(f"the peer's tensors name several agents: {sorted(names)}")
        (name,) = names
        # A NIXL peer reloaded by one tensor's connect is reloaded agent-wide: every tensor's
        # prepared list of it is released first, while the agent still knows it.
        for endpoint in self.endpoints:
            known = endpoint.peers.get(name)
            if known is not None:
                endpoint._drop_peer_dlist(known)
        peers = [endpoint.connect(part) for endpoint, part in zip(self.endpoints, parts)]
        peer = self.peers.get(name)
        if peer is None:
            peer = self.peers[name] = KVCachePeer(name, peers)
        else:
            peer.peers = peers
        return peer

    # -- transfers ------------------------------------------------------------------------
    def read(
        self, peer: KVCachePeer | str, local_blocks: Any, remote_blocks: Any, *,
        notification: bytes = b"",
    ) -> KVCacheTransfer:  # fmt: skip
        """Post a READ of the peer's ``remote_blocks`` into ``local_blocks``, every tensor."""
        return self._post("read", peer, local_blocks, remote_blocks, notification)

    def write(
        self, peer: KVCachePeer | str, local_blocks: Any, remote_blocks: Any, *,
        notification: bytes = b"",
    ) -> KVCacheTransfer:  # fmt: skip
        """Post a WRITE of ``local_blocks`` into the peer's ``remote_blocks``, every tensor.
        With a ``notification``, every part is waited for before it is sent (one message,
        after the last byte of every layer): the peer may read them once it arrives."""
        return self._post("write", peer, local_blocks, remote_blocks, notification)

    def _post(
        self, verb: str, peer: Any, local: Any, remote: Any, notification: bytes
    ) -> KVCacheTransfer:
        self._check_open()
        known = self._peer(peer)
        if not isinstance(notification, bytes):
            raise TypeError(f"notification must be bytes, got {type(notification).__name__}")
        # Every part checks the ids against both sides' committed blocks before it posts.
        # The cache commits its tensors in lockstep, so a bad request is refused by the
        # first part, before any byte moves; parts posted before a later refusal are
        # settled, never left in flight.
        parts: list[Transfer] = []
        try:
            for endpoint, part in zip(self.endpoints, known.peers):
                parts.append(getattr(endpoint, verb)(part, local, remote))
        except BaseException:
            KVCacheTransfer(parts).settle(DEFAULT_TIMEOUT)  # none left in flight unnoticed
            raise
        transfer = KVCacheTransfer(parts)
        if notification:
            transfer.wait()
            self.endpoints[0].notify(known.peers[0], notification)
        return transfer

    def _peer(self, peer: KVCachePeer | str) -> KVCachePeer:
        name = peer.name if isinstance(peer, KVCachePeer) else peer
        known = self.peers.get(name) if isinstance(name, str) else None
        if known is None:
            raise ValueError(f"{peer!r} is not a connected peer (call connect with its metadata)")
        return known

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sender (any tensor, either
        transport)."""
        arrived: dict[str, list[bytes]] = {}
        for endpoint in self.endpoints:
            for sender, messages in endpoint.notifications().items():
                arrived.setdefault(sender, []).extend(messages)
        return arrived

    def wait_notification(self, peer: KVCachePeer | str, message: bytes, timeout: float) -> None:
        """Wait until ``peer`` sends ``message``; TimeoutError after ``timeout`` seconds.
        Other notifications stay queued for later waits."""
        name = peer.name if isinstance(peer, KVCachePeer) else peer
        wait_for_notification(self.notifications, self._pending, name, message, timeout)

    def notify(self, peer: KVCachePeer | str, message: bytes) -> None:
        """Send ``message`` to ``peer`` alone (no transfer)."""
        known = self._peer(peer)
        self.endpoints[0].notify(known.peers[0], message)

    # -- views ----------------------------------------------------------------------------
    def block_view(self, tensor: int, segment: int, first: int, count: int = 1) -> BufferView:
        """Uint8 view of ``count`` committed blocks from ``first`` of ``segment`` of tensor
        ``tensor`` (:meth:`KVEndpoint.block_view`)."""
        if not 0 <= tensor < len(self.endpoints):
            raise IndexError(f"tensor {tensor!r} out of range for {len(self.endpoints)}")
        return self.endpoints[tensor].block_view(segment, first, count)

    # -- closing --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("KVCacheEndpoint", "closed")

    def close(self) -> None:
        """Close every per-tensor endpoint (before the cache is freed). Safe to call twice.

        Every endpoint is closed whatever the others raise, an interrupt included; the first
        failure is raised with the others as notes, and the endpoint stays open so that
        ``close()`` again finishes (each per-tensor close is idempotent)."""
        if self.closed:
            return
        cleanup = Cleanup("KVCacheEndpoint.close")
        for endpoint in self.endpoints:
            cleanup.run(endpoint.close)
        self.peers.clear()
        if not cleanup.errors:
            self.closed = True
        cleanup.raise_first()

    def __enter__(self) -> KVCacheEndpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
