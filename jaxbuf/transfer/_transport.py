"""The transport interface: what an endpoint asks of the machinery that moves its blocks.

An endpoint holds :class:`Side` values (one per tensor it serves: the segments its layout
moves and where they start) and, per connected peer, one :class:`Link` over one transport:
:class:`~jaxbuf.transfer._local.SameHostLink` (the peer's chunks imported here, driver
copies) or :class:`~jaxbuf.transfer._nixl_link.NixlLink` (NIXL). Both take the same
:class:`Request` and behave the same way: every block of every tensor is checked on both
sides before anything moves, the whole request is posted as one operation, and a
notification is sent after its last byte without blocking the caller.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from jaxbuf.transfer._blocks import check_block_range, describe

if TYPE_CHECKING:
    from jaxbuf.transfer._registration import Registration
    from jaxbuf.transfer._transfer import Transfer
    from jaxbuf.transfer._wire import RemoteLayout

__all__ = ["Link", "Operation", "Request", "Side"]


class Operation(enum.Enum):
    """Which way the bytes go: ``READ`` from the peer, ``WRITE`` to it."""

    READ = "READ"
    WRITE = "WRITE"


@dataclass(frozen=True)
class Side:
    """One tensor of an endpoint: blocks of ``block_bytes`` from the start of each of
    ``segments`` (buffer segment indices), which start at ``starts`` (addresses: a
    reservation never moves); its :class:`~jaxbuf.transfer.Registration`."""

    tensor: Any
    block_bytes: int
    segments: tuple[int, ...]
    starts: tuple[int, ...]
    registration: Registration

    def committed_blocks(self, positions: tuple[int, ...]) -> int:
        """Blocks committed in every one of the layout positions ``positions``."""
        committed = self.tensor.committed_sizes
        return min(committed[self.segments[p]] for p in positions) // self.block_bytes

    def check(self, blocks: np.ndarray, positions: tuple[int, ...]) -> None:
        """IndexError naming the first local block of ``blocks`` not committed."""
        check_block_range(blocks, self.committed_blocks(positions), "local", self.block_bytes)


@dataclass(frozen=True)
class Request:
    """Block ``local[i]`` here <-> block ``remote[i]`` there, in layout positions
    ``positions[t]`` of every tensor ``t``; ``notification`` after the last byte."""

    operation: Operation
    peer: str
    local: np.ndarray
    remote: np.ndarray
    positions: tuple[tuple[int, ...], ...]
    notification: bytes

    def words(self) -> str:
        """The request in words: ``WRITE of blocks [0, 1] <-> peer:blocks [4, 5]``."""
        tensors = f" in {len(self.positions)} tensors" if len(self.positions) > 1 else ""
        return (
            f"{self.operation.value} of {describe(self.local)} <-> "
            f"{self.peer}:{describe(self.remote)}{tensors}"
        )


class Link(abc.ABC):
    """One connected peer over one transport.

    Invariants: :meth:`post` checks every block of the request against what the peer
    committed (and, for memory mapped here, what is mapped) before it moves any byte,
    then posts the whole request as one operation; :meth:`close` releases everything the
    link holds and is safe to call twice."""

    transport: ClassVar[str]
    """``"local"`` (the same-host transport) or ``"nixl"``."""

    @abc.abstractmethod
    def update(self, layouts: list[RemoteLayout]) -> None:
        """Follow the peer to its newer metadata (``layouts``: one per tensor)."""

    @abc.abstractmethod
    def post(self, request: Request, trackers: list[Any]) -> Transfer:
        """Check and post ``request``; the transfer is tracked by ``trackers`` (objects
        with ``track``/``untrack``) until it finishes."""

    @abc.abstractmethod
    def notify(self, message: bytes) -> None:
        """Send ``message`` to the peer alone."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the link holds."""
