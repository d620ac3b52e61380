"""The endpoint's side of the same-host transport: choosing it for a peer (:func:`link_peer`)
and posting a block transfer over it (:func:`post_local`). The mechanics (the server, the
link, the copy) are in :mod:`jaxbuf.transfer._local`."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxbuf.transfer._blocks import bounds
from jaxbuf.transfer._local import LocalLink, LocalTransfer, copy_triples, host_identity
from jaxbuf.transfer._transfer import TransferError, request_words
from jaxbuf.transfer._wire import RemoteLayout

__all__ = ["link_peer", "post_local"]


def link_peer(
    transport: str, name: str, device: Any, layout: RemoteLayout, known: Any
) -> tuple[LocalLink, tuple[int, ...]] | None:
    """The same-host link to the peer of ``layout`` (``known``: its :class:`Peer` if
    connected before), its import refreshed now, and the buffer segments of its layout;
    None when NIXL moves its blocks (``transport="nixl"``, or ``"auto"`` with a peer on
    another host, of another user, or whose socket does not answer). ``ValueError`` when
    ``"local"`` cannot be had, or the link of a peer linked before fails; nothing about the
    peer changes then."""
    if transport == "nixl":
        return None
    link = known.link if known is not None else None
    address = layout.local
    boot_id, uid = host_identity()
    if address is None:
        reason = "its metadata offers no same-host address"
    elif address.boot_id != boot_id:
        reason = "it runs on another host (another boot id)"
    elif address.uid != uid:
        reason = f"it runs as uid {address.uid}, this process as {uid}"
    elif link is not None and link.address != address.address:
        reason = f"its same-host address changed from {link.address!r} to {address.address!r}"
    else:
        reason = None
    if reason is None:
        fresh = link is None
        try:
            if link is None:
                link = LocalLink(address.address, name, device, layout.agent)  # type: ignore[union-attr]
            imported = link.refresh()
            return link, imported_segments(imported, layout)
        except (OSError, ValueError) as error:
            if fresh and link is not None:
                link.close()
            reason = f"its socket failed: {error}"
    if transport == "local" or (known is not None and known.link is not None):
        raise ValueError(f"peer {layout.agent!r} cannot use the same-host transport: {reason}")
    return None


def imported_segments(imported: Any, layout: RemoteLayout) -> tuple[int, ...]:
    """The segments of the peer's imported buffer that its layout names (by offset and
    capacity); ValueError when the import and the message disagree."""
    where = {
        (offset, capacity): index
        for index, (offset, capacity) in enumerate(
            zip(imported.segment_offsets, imported.segment_capacities)
        )
    }
    segments = []
    for offset, capacity in zip(layout.segment_offsets, layout.segment_capacities):
        index = where.get((offset, capacity))
        if index is None:
            raise ValueError(
                f"peer {layout.agent!r}'s served buffer has no segment at offset {offset} of "
                f"{capacity} bytes, which its metadata names"
            )
        segments.append(index)
    return tuple(segments)


def post_local(
    endpoint: Any,
    peer: Any,
    operation: str,
    local: np.ndarray,
    remote: np.ndarray,
    chosen: list[int],
    notification: bytes,
) -> LocalTransfer:
    """One driver copy of every block pair (runs merged) between ``endpoint``'s buffer and
    ``peer``'s import. Bounds are what is mapped on both sides now: this buffer's committed
    sizes, and what the peer's imported chunks back (never what its message claims). With a
    ``notification``, the copy is waited for and the notification sent before returning:
    the peer may read the bytes once it arrives."""
    tensor, block_bytes = endpoint.tensor, endpoint.layout.block_bytes
    ours, theirs = endpoint.segments, peer.segments
    imported = peer.link.imported
    committed, remote_committed = tensor.committed_sizes, imported.committed_sizes
    local_limit = min([committed[ours[s]] for s in chosen]) // block_bytes
    remote_limit = min([remote_committed[theirs[s]] for s in chosen]) // block_bytes
    _check_range(local, local_limit, "local", block_bytes)
    _check_range(remote, remote_limit, peer.name, block_bytes)
    # Segment starts never move (a reservation's base, an import's base, fixed offsets).
    here, there, sizes = copy_triples(
        endpoint.segment_starts, peer.segment_starts, block_bytes, chosen, local, remote
    )
    dsts, srcs = (there, here) if operation == "WRITE" else (here, there)
    request = (operation, local, peer.name, remote)
    try:
        event = endpoint.copier.copy(dsts, srcs, sizes, aligned=peer.aligned)
    except Exception as error:  # a driver failure of the copy, named with the request
        raise TransferError(f"{request_words(request)} failed: {error}") from error
    transfer = LocalTransfer(tensor.driver, event, request, endpoint.registration)
    if notification:
        transfer.wait()
        peer.link.notify(notification)
    return transfer


def _check_range(blocks: np.ndarray, limit: int, side: str, block_bytes: int) -> None:
    """IndexError naming the first block of ``blocks`` outside ``[0, limit)`` (``side``:
    "local" or the peer's name)."""
    low, high = bounds(blocks)
    if low < 0 or high >= limit:
        bad = int(blocks[(blocks < 0) | (blocks >= limit)][0])
        whose = side if side == "local" else f"{side}'s"
        raise IndexError(
            f"{whose} block {bad} is out of range: {limit} block(s) of {block_bytes} bytes are "
            "committed (and mapped) in every segment transferred there"
        )
