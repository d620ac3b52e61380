"""Block transfers of one tensor in a KV cache's own terms: :class:`KVEndpoint`.

A :class:`KVLayout` says how a buffer holds a cache: blocks of ``block_bytes`` bytes from the
start of each of its segments (segments as K and V, or as layers). A :class:`KVEndpoint` is one
side: a buffer, its :class:`~jaxbuf.transfer.Registration` and its layout. Peers exchange
:meth:`KVEndpoint.metadata` once and again after growth; :meth:`KVEndpoint.read` and
:meth:`KVEndpoint.write` move lists of block ids (block ``local[i]`` of every chosen segment
here <-> block ``remote[i]`` of the same segment there) over the transport the peer got when
it connected (:mod:`jaxbuf.transfer._plane`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxbuf._checks import as_int
from jaxbuf._segments import SegmentedReservation
from jaxbuf.dtypes import uint8
from jaxbuf.transfer._blocks import KVLayout
from jaxbuf.transfer._control import Limits
from jaxbuf.transfer._nixl import Agent
from jaxbuf.transfer._plane import TRANSPORTS, Peer, TransferPlane
from jaxbuf.transfer._registration import DEFAULT_RELEASE_TIMEOUT, Registration
from jaxbuf.transfer._transfer import Transfer, TransferError
from jaxbuf.transfer._transport import Operation
from jaxbuf.transfer._wire import RemoteLayout, decode, encode
from jaxbuf.views import BufferView

__all__ = [
    "TRANSPORTS",
    "KVEndpoint",
    "KVLayout",
    "Peer",
    "Transfer",
    "TransferError",
    "block_view",
]


class KVEndpoint(TransferPlane):
    """One side of block transfers: ``tensor`` registered with ``agent``, seen as ``layout``.

    Invariants: the prepared descriptor lists (local and each peer's) always describe the
    current registrations of their side (made again when its epoch or committed sizes
    change, before a transfer uses them); everything this endpoint made (NIXL objects, the
    control thread and socket, imported chunks, descriptors) is released by :meth:`close`.
    Safe to use from several threads.

    Parameters
    ----------
    agent : Agent or str
        A NIXL :class:`~jaxbuf.transfer.Agent`, or a name (the same-host transport only).
    tensor : ExtensibleTensor
    layout : KVLayout
    transport : {"auto", "local", "nixl"}
        See :data:`~jaxbuf.transfer.TRANSPORTS`.
    registration : Registration, optional
        Default: a new one over the layout's segments, closed with the endpoint.
    release_timeout : float
        For the registration this endpoint makes (see :class:`Registration`).
    limits : Limits, optional
        What one peer may cost this endpoint's control thread.
    """

    kind = "KVEndpoint"

    def __init__(
        self,
        agent: Agent | str,
        tensor: Any,
        layout: KVLayout,
        *,
        transport: str = "auto",
        registration: Registration | None = None,
        release_timeout: float = DEFAULT_RELEASE_TIMEOUT,
        limits: Limits | None = None,
    ) -> None:
        spec = (tensor, layout) if registration is None else (tensor, layout, registration)
        super().__init__(
            agent, [spec], transport=transport, release_timeout=release_timeout, limits=limits
        )
        side = self.sides[0]
        self.tensor, self.layout, self.registration = tensor, layout, side.registration
        self.segments, self.segment_starts = side.segments, list(side.starts)

    def __repr__(self) -> str:
        return f"KVEndpoint(name={self.name!r}, peers={sorted(self.peers)})"

    def remote_layout(self) -> RemoteLayout:
        """What a peer learns about this side now (see :mod:`jaxbuf.transfer._wire`), under
        a new epoch."""
        return self.layouts()[0]

    def metadata(self) -> bytes:
        """The message to send to peers now, and again after this side grows, releases or
        defragments (its epoch says which is newer). Unless ``transport="nixl"``, it also
        offers this buffer to same-host peers (:meth:`TransferPlane.layouts`)."""
        return encode(self.layouts()[0])

    def connect(self, message: bytes) -> Peer:
        """Learn a peer from its :meth:`metadata` message, or learn a known peer's growth.

        The message is validated first (:func:`~jaxbuf.transfer._wire.decode`; ValueError),
        against this layout (same block size and segment count) and, for a known peer,
        against its last message (newer epoch, same reservation); a peer restarted under
        its name replaces the old one once the old one's transfers are done. A refused
        message changes nothing."""
        return self.connect_layouts([decode(message)])

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
        positions = (self.positions(segments),)
        return self.post(Operation.READ, peer, local_blocks, remote_blocks, positions, notification)

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
        positions = (self.positions(segments),)
        return self.post(
            Operation.WRITE, peer, local_blocks, remote_blocks, positions, notification
        )

    def block_view(self, segment: int, first: int, count: int = 1) -> BufferView:
        """A uint8 view over ``count`` blocks from block ``first`` of buffer segment
        ``segment``: what arrived, zero-copy through ``to_jax`` / ``to_torch`` /
        ``to_numpy`` (``.view(dtype, shape)`` to reinterpret)."""
        return block_view(self, 0, segment, first, count)

    def __enter__(self) -> KVEndpoint:
        return self


def block_view(
    plane: TransferPlane, tensor: int, segment: int, first: int, count: int
) -> BufferView:
    """A uint8 view of ``count`` committed blocks from ``first`` of buffer segment
    ``segment`` of the plane's tensor ``tensor``; IndexError outside what is committed."""
    side = plane.sides[tensor]
    if segment not in side.segments or isinstance(segment, bool):
        raise IndexError(f"segment {segment!r} is not in the layout {list(side.segments)}")
    first, count = as_int(first, "first"), as_int(count, "count")
    blocks = side.tensor.committed_sizes[segment] // side.block_bytes
    if first < 0 or count < 1 or first + count > blocks:
        raise IndexError(
            f"blocks [{first}, {first + count}) are outside the {blocks} committed block(s) "
            f"of segment {segment}"
        )
    # The neutral method: a face's tensor (jaxbuf.torch) returns framework arrays.
    view = SegmentedReservation.segment_view(side.tensor, segment)
    return BufferView(
        view.ptr + first * side.block_bytes,
        count * side.block_bytes,
        uint8,
        None,
        view.device,
        view.owner,
        view.dlpack_device_type,
    )
