"""A whole KV cache as one side of block transfers: :class:`KVCacheEndpoint` over
:class:`~jaxbuf.ExtensibleKVCacheBuffers`.

An engine addresses its cache by block id: block ``b`` is block ``b`` of every layer, so one
request of block ids moves those blocks in every KV-cache tensor (as vLLM's NIXL connector
does). Every tensor has its own layout (``KVLayout(bytes_per_block_per_segment)`` over all
its segments) and pairs with the peer's tensor of the same index; the endpoint has one
control plane (one socket, one thread, whatever the layer count) and posts a request as one
operation over every tensor and segment: one copy on the same-host transport, one
descriptor list over NIXL (:mod:`jaxbuf.transfer._plane`). Registrations and the served
chunks follow each tensor, so the cache's ``commit``, ``release_physical``, ``recommit`` and
``defragment=True`` need nothing here beyond sending :meth:`KVCacheEndpoint.metadata` again
afterwards.

Metadata message (every integer in network order)::

    b"JXKC"  protocol (u32)  tensor count (u32)  then per tensor: length (u32), a
    :mod:`jaxbuf.transfer._wire` message of that tensor's endpoint

Every per-tensor message is decoded and checked against this cache (tensor count, block
sizes, one agent name) before any peer state changes. Only the first carries the NIXL agent
metadata (it is the agent's, not a tensor's).
"""

from __future__ import annotations

import struct
from typing import Any

from jaxbuf.kv import ExtensibleKVCacheBuffers
from jaxbuf.transfer._blocks import KVLayout
from jaxbuf.transfer._control import Limits
from jaxbuf.transfer._endpoint import block_view
from jaxbuf.transfer._nixl import Agent
from jaxbuf.transfer._plane import Peer, TransferPlane
from jaxbuf.transfer._registration import DEFAULT_RELEASE_TIMEOUT
from jaxbuf.transfer._transfer import Transfer
from jaxbuf.transfer._transport import Operation
from jaxbuf.transfer._wire import decode, encode
from jaxbuf.views import BufferView

__all__ = ["KVCacheEndpoint", "KVCachePeer", "KVCacheTransfer"]

_MAGIC = b"JXKC"
_HEADER = struct.Struct("!4sII")  # magic, protocol, tensor count
_LENGTH = struct.Struct("!I")
PROTOCOL = 1
_MAX_TENSORS = 1 << 12  # a few KV-cache tensors per layer, as the per-tensor segment bound
_MAX_MESSAGE = 1 << 30


def _encode(messages: list[bytes]) -> bytes:
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


KVCachePeer = Peer
"""A connected peer cache: a :class:`~jaxbuf.transfer.Peer` with one layout per tensor."""

KVCacheTransfer = Transfer
"""One request over every tensor of the cache: one :class:`~jaxbuf.transfer.Transfer`."""


class KVCacheEndpoint(TransferPlane):
    """One side of block transfers of a whole :class:`~jaxbuf.ExtensibleKVCacheBuffers`:
    block ids address every tensor at once.

    Invariants: one layout per tensor of the cache, in order, over all the tensor's
    segments with blocks of its ``bytes_per_block_per_segment``; a connected peer has as
    many tensors with the same block sizes, tensor ``i`` here pairing with tensor ``i``
    there; a request is checked on both sides for every tensor before any byte moves,
    then posted as one operation; :meth:`close` releases everything. Safe to use from
    several threads.

    The cache may grow, release, recommit and defragment while the endpoint is open:
    registrations follow at once (a release waits for transfers in flight,
    ``release_timeout``); a peer learns the change from :meth:`metadata` sent again.

    Parameters
    ----------
    agent : Agent or str
        A NIXL :class:`~jaxbuf.transfer.Agent` (one per process, as an engine has), or a
        name (the same-host transport only).
    cache : ExtensibleKVCacheBuffers
    transport : {"auto", "local", "nixl"}
        See :data:`~jaxbuf.transfer.TRANSPORTS`.
    release_timeout : float
        For each tensor's registration.
    limits : Limits, optional
        What one peer may cost this endpoint's control thread.
    """

    kind = "KVCacheEndpoint"

    def __init__(
        self,
        agent: Agent | str,
        cache: ExtensibleKVCacheBuffers,
        *,
        transport: str = "auto",
        release_timeout: float = DEFAULT_RELEASE_TIMEOUT,
        limits: Limits | None = None,
    ) -> None:
        if not isinstance(cache, ExtensibleKVCacheBuffers):
            raise TypeError(f"cache must be an ExtensibleKVCacheBuffers, got {cache!r}")
        if cache.freed or not len(cache):
            raise ValueError("the KV cache is freed or holds no tensor")
        tensors = [(tensor, KVLayout(block_bytes)) for tensor, block_bytes in cache.buffers]
        super().__init__(
            agent, tensors, transport=transport, release_timeout=release_timeout, limits=limits
        )
        self.cache = cache
        self._all = tuple(tuple(range(len(side.segments))) for side in self.sides)

    def __repr__(self) -> str:
        return (
            f"KVCacheEndpoint(name={self.name!r}, {len(self.sides)} tensor(s), "
            f"peers={sorted(self.peers)})"
        )

    # -- metadata -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """The message to send to peers now, and again after the cache commits, releases,
        recommits or defragments."""
        return _encode([encode(layout) for layout in self.layouts()])

    def connect(self, message: bytes) -> KVCachePeer:
        """Learn a peer cache from its :meth:`metadata`, or learn its change.

        Every per-tensor message is decoded and checked first (ValueError: malformed,
        another tensor count or block size, several agent names, a stale or moved layout of
        a known peer), so a refused message changes nothing; a peer restarted under its
        name replaces the old one once the old one's transfers are done."""
        layouts = []
        for index, part in enumerate(_split(message)):
            try:
                layouts.append(decode(part))
            except ValueError as error:
                raise ValueError(f"tensor {index}'s metadata: {error}") from None
        return self.connect_layouts(layouts)

    # -- transfers ------------------------------------------------------------------------
    def read(
        self, peer: KVCachePeer | str, local_blocks: Any, remote_blocks: Any, *,
        notification: bytes = b"",
    ) -> KVCacheTransfer:  # fmt: skip
        """Post a READ of the peer's ``remote_blocks`` into ``local_blocks``, every tensor."""
        return self.post(Operation.READ, peer, local_blocks, remote_blocks, self._all, notification)

    def write(
        self, peer: KVCachePeer | str, local_blocks: Any, remote_blocks: Any, *,
        notification: bytes = b"",
    ) -> KVCacheTransfer:  # fmt: skip
        """Post a WRITE of ``local_blocks`` into the peer's ``remote_blocks``, every tensor.
        A ``notification`` is sent after the last byte of every tensor: the peer may read
        them once it arrives."""
        return self.post(
            Operation.WRITE, peer, local_blocks, remote_blocks, self._all, notification
        )

    # -- views ----------------------------------------------------------------------------
    def block_view(self, tensor: int, segment: int, first: int, count: int = 1) -> BufferView:
        """Uint8 view of ``count`` committed blocks from ``first`` of ``segment`` of tensor
        ``tensor``."""
        if (
            isinstance(tensor, bool)
            or not isinstance(tensor, int)
            or not 0 <= tensor < len(self.sides)
        ):
            raise IndexError(f"tensor {tensor!r} out of range for {len(self.sides)}")
        return block_view(self, tensor, segment, first, count)

    def __enter__(self) -> KVCacheEndpoint:
        return self
