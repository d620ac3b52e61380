"""NIXL registrations of an :class:`~jaxbuf.ExtensibleTensor` that follow its memory.

A :class:`Registration` is a :class:`~jaxbuf._reservation.MappingListener` of the tensor: every
chunk the tensor maps (a grow, a recommit, the one chunk of a defragmented segment) is
registered with the agent as its own NIXL registration, and deregistered before the tensor
unmaps it (``release_physical``, ``defragment``, ``free``). A grow registers only the chunks it
mapped, so its cost does not depend on what is committed already.

Nothing stays registered over unmapped memory: the buffer tells the registration before it
unmaps, and a registration that cannot deregister (a NIXL error) or that has a local transfer
in flight past ``release_timeout`` refuses, which refuses the release itself before anything
changes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from jaxbuf._checks import as_int, as_seconds
from jaxbuf._errors import Rollback
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf._intervals import IntervalSet
from jaxbuf.devices import as_device
from jaxbuf.transfer._nixl import Agent, memory_type_of

__all__ = ["Registration", "TransferInFlight"]

DEFAULT_RELEASE_TIMEOUT = 10.0
"""Seconds a release waits for this process's transfers over the memory before refusing."""


class TransferInFlight(RuntimeError):
    """A release, defragment or free was refused: a transfer over the memory is still in
    flight after the registration's ``release_timeout``."""


class Registration:
    """The NIXL registrations of ``tensor`` (or of its ``segments``) with ``agent``.

    Invariants, between calls:

    * every chunk the tensor has mapped is registered (its part inside the chosen segments),
      each chunk as one registration, and nothing else is: :meth:`registered_ranges` lists
      them, sorted, as ``(offset, nbytes)`` from :attr:`base_ptr`;
    * :attr:`epoch` grows by one whenever the registered ranges change, so a prepared
      descriptor list made at one epoch is known stale at the next;
    * :attr:`mem_type` (``"VRAM"`` or ``"DRAM"``) and :attr:`device_id` come from the
      tensor's driver and device, never from the caller.

    A chunk that fails to register fails the grow that mapped it (the grow is undone); a
    deregistration that fails refuses the release (the chunk stays registered and mapped).
    :meth:`close` deregisters everything and detaches; ``tensor.free()`` does the same.

    Only this process's transfers are waited for: a transfer a *peer* posts into this memory
    is invisible here (NIXL tells the target nothing until its notification). Before
    releasing memory that peers write or read, quiesce them through the application's own
    protocol (a notification), then send them the new ``KVEndpoint.metadata()``: a peer's
    endpoint forgets every registration the newer message no longer lists, and refuses
    blocks beyond what it says is committed.

    Parameters
    ----------
    agent : Agent or None
        The :class:`~jaxbuf.transfer.Agent` to register with; None follows the chunks and
        the transfers in flight without NIXL (the same-host transport needs no
        registration: it imports the chunks themselves).
    tensor : ExtensibleTensor
        The buffer to follow.
    segments : sequence of int, optional
        Register only these segments (default: all).
    release_timeout : float
        Seconds a release waits for transfers in flight before refusing.
    """

    def __init__(
        self,
        agent: Agent | None,
        tensor: Any,
        segments: Iterable[int] | None = None,
        *,
        release_timeout: float = DEFAULT_RELEASE_TIMEOUT,
    ) -> None:
        if agent is not None and not isinstance(agent, Agent):
            raise TypeError(f"agent must be a jaxbuf.transfer.Agent or None, got {agent!r}")
        tensor.check_exportable()
        count = tensor.num_segments
        chosen = (
            list(range(count)) if segments is None else [as_int(s, "segment") for s in segments]
        )
        for segment in chosen:
            if not 0 <= segment < count:
                raise IndexError(f"segment {segment} out of range for {count} segment(s)")
        if len(set(chosen)) != len(chosen) or not chosen:
            raise ValueError(f"segments must be distinct and non-empty, got {chosen}")
        release_timeout = as_seconds(release_timeout, "release_timeout")
        self.agent = agent
        self.tensor = tensor
        self.segments = tuple(sorted(chosen))
        self.release_timeout = float(release_timeout)
        self.base_ptr = tensor.base_ptr
        self.mem_type = memory_type_of(tensor.driver.dlpack_device_type)
        self.device_id = as_device(tensor.device).index if self.mem_type == "VRAM" else 0
        offsets, capacities = tensor.segment_offsets, tensor.segment_capacities
        self._spans = IntervalSet()  # the chosen segments' bytes
        for segment in chosen:
            self._spans.add(offsets[segment], offsets[segment] + capacities[segment])
        # chunk offset -> (registered pieces, NIXL handle), and the sorted chunk offsets.
        self._chunks: dict[int, tuple[list[tuple[int, int]], Any]] = {}
        self._ranges: list[tuple[int, int]] | None = []
        # id -> transfer: untracking is O(1) however many un-waited transfers pile up.
        self._in_flight: dict[int, Any] = {}
        self.epoch = 0
        self.closed = False
        tensor.add_mapping_listener(self)

    def __repr__(self) -> str:
        return (
            f"Registration(agent={getattr(self.agent, 'name', None)!r}, "
            f"segments={list(self.segments)}, "
            f"chunks={len(self._chunks)}, epoch={self.epoch})"
        )

    # -- queries --------------------------------------------------------------------
    def registered_ranges(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of every registered piece, sorted by offset."""
        if self._ranges is None:
            self._ranges = sorted(piece for pieces, _ in self._chunks.values() for piece in pieces)
        return list(self._ranges)

    @property
    def num_registrations(self) -> int:
        """NIXL registrations held (one per registered chunk)."""
        return len(self._chunks)

    def _pieces(self, offset: int, size: int) -> list[tuple[int, int]]:
        """The parts of chunk ``[offset, offset + size)`` inside the chosen segments."""
        return [(low, high - low) for low, high in self._spans.intersection(offset, offset + size)]

    # -- the MappingListener protocol -----------------------------------------------
    def mapped(self, chunks: list[tuple[int, int]]) -> None:
        """Register each chunk (its part in the chosen segments); all or nothing. Each
        registration and its record are one step an interrupt cannot split."""
        agent, base = self.agent, self.base_ptr
        changed = False
        try:
            with Rollback("Registration.mapped") as undo:
                for offset, size in chunks:
                    pieces = self._pieces(offset, size)
                    if not pieces or offset in self._chunks:
                        continue
                    with deferred_interrupts():
                        handle = (
                            None
                            if agent is None
                            else agent.register(
                                [(base + start, nbytes) for start, nbytes in pieces],
                                self.mem_type,
                                self.device_id,
                            )
                        )
                        self._chunks[offset] = (pieces, handle)
                    changed = True
                    undo.push(self._deregister, offset)
        finally:
            if changed:
                self._changed()

    def _deregister(self, offset: int) -> None:
        """Deregister the chunk at ``offset``, then forget it (a failure keeps it recorded:
        :meth:`close` retries it)."""
        _, handle = self._chunks[offset]
        with deferred_interrupts():
            if self.agent is not None:
                self.agent.deregister(handle)
            del self._chunks[offset]

    def unmapping(self, chunks: list[tuple[int, int]]) -> None:
        """Wait for this process's transfers over the memory (refuse after
        ``release_timeout``), then deregister each chunk."""
        registered = [offset for offset, _ in chunks if offset in self._chunks]
        if not registered:
            return
        self._wait_in_flight()
        try:
            for offset in registered:
                self._deregister(offset)
        finally:
            self._changed()

    def _changed(self) -> None:
        self._ranges = None
        self.epoch += 1

    # -- transfers in flight ----------------------------------------------------------
    def track(self, transfer: Any) -> None:
        """Record a transfer over this memory until it finishes (see :meth:`untrack`)."""
        self._in_flight[id(transfer)] = transfer

    def untrack(self, transfer: Any) -> None:
        self._in_flight.pop(id(transfer), None)

    @property
    def transfers_in_flight(self) -> int:
        return len(self._in_flight)

    def _wait_in_flight(self) -> None:
        deadline = time.monotonic() + self.release_timeout
        for transfer in list(self._in_flight.values()):
            if not transfer.settle(max(deadline - time.monotonic(), 0.0)):
                raise TransferInFlight(
                    f"cannot unmap: {transfer} is still in flight over the memory after "
                    f"{self.release_timeout} s; wait for it (Transfer.wait) or cancel it"
                )

    # -- closing ----------------------------------------------------------------------
    def close(self) -> None:
        """Deregister everything and stop following the tensor. Safe to call twice; a
        transfer in flight past ``release_timeout`` refuses (:class:`TransferInFlight`)."""
        if self.closed:
            return
        if not self.tensor.released and self.tensor.base_ptr:
            self.tensor.remove_mapping_listener(self)
        elif self._chunks:  # the tensor was freed: it told us unmapping already
            self.unmapping([(offset, 0) for offset in sorted(self._chunks)])
        self.closed = True

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
