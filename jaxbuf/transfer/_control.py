"""The same-host control plane: one listening socket per endpoint, serving every tensor the
endpoint publishes, and the initiator's link to it.

Frames, both ways: a 13-byte header (the kind, one byte of :class:`Frame`; a request id,
u64; the payload's length, u32; network order), then the payload.

============  =========  ============================================================
frame         direction  payload
============  =========  ============================================================
``HELLO``     to owner   the sender's endpoint name; the first frame, id 0
``LAYOUT``    to owner   empty, with a fresh id: "the chunks of every tensor you
                         published last"
``NOTIFY``    to owner   a notification (at most 64 KiB), id 0
``LAYOUT``    to peer    the request's id; epoch (u64), tensor count (u32), the owner's
                         endpoint name; then one :mod:`jaxbuf.sharing` message per
                         tensor, its descriptors attached
``ERROR``     to peer    the request's id; why the owner cannot answer (UTF-8)
============  =========  ============================================================

The owner's side is :class:`~jaxbuf.transfer._control_server.ControlServer`.

The initiator's side (:class:`ControlLink`) is thread-safe (one exchange at a time), and an
exchange cut short by anything (an error, a timeout, an interrupt) closes the connection,
so the next exchange starts on a new one: no answer left on the old one is ever read as
the answer to a later request. Ids check the same thing on the wire. Every descriptor is
recorded the instant it is received (:func:`jaxbuf.sharing._wire.recv_layout`'s ``held``).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from jaxbuf._errors import ClosedError
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf.sharing._wire import (
    _close_all,
    _recv_exact,
    connect_abstract,
    recv_layout,
)

__all__ = ["ControlLink", "Frame", "Inbox", "Limits", "ServedAnswer", "frame"]

FRAME_HEADER = struct.Struct("!cQI")  # kind, request id, payload length
ANSWER_HEADER = struct.Struct("!QI")  # epoch, tensor count (then the owner's name)
MAX_NAME = 256
MAX_NOTIFICATION = 1 << 16
_MAX_REASON = 4096
_WAIT_SLICE = 0.05  # seconds an interrupt of a wait for a notification may be held back


class Frame(bytes, enum.Enum):
    """The kinds of frame on a control connection (see the module docstring)."""

    HELLO = b"H"
    LAYOUT = b"L"
    NOTIFY = b"N"
    ERROR = b"E"


def frame(kind: Frame, request_id: int = 0, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    return FRAME_HEADER.pack(kind.value, request_id, len(payload)) + payload


@dataclass(frozen=True)
class Limits:
    """What one peer may cost the owner's control thread.

    ``output_deadline``: seconds an answer may wait for the peer to read it before the
    connection is dropped. ``hello_deadline``: seconds a new connection has to say who it
    is. ``max_connections``: connections kept at once (more are closed as accepted).
    ``queued_notifications``: notifications kept per sender before the oldest are dropped.
    ``io_timeout``: seconds the initiator waits for an answer, or to send a frame."""

    output_deadline: float = 5.0
    hello_deadline: float = 10.0
    max_connections: int = 1024
    queued_notifications: int = 1 << 16
    io_timeout: float = 30.0


class Inbox:
    """Notifications by sender, filled by the control thread (and NIXL's poll) and taken by
    the endpoint's waits; one lock, and a condition that wakes a waiter when one arrives.
    Nothing is moved between containers on its way out, so an interrupt never loses one."""

    def __init__(self, per_sender: int) -> None:
        self._queues: dict[str, collections.deque[bytes]] = {}
        self._per_sender = per_sender
        self.changed = threading.Condition()
        self._closed_owner: str | None = None  # set by close(): waits end with ClosedError

    def put(self, sender: str, messages: list[bytes]) -> None:
        with self.changed:
            queue = self._queues.get(sender)
            if queue is None:
                queue = self._queues[sender] = collections.deque(maxlen=self._per_sender)
            queue.extend(messages)
            self.changed.notify_all()

    def _take(self, sender: str, message: bytes) -> bool:
        """Remove the oldest ``message`` from ``sender`` (the caller holds the lock)."""
        queue = self._queues.get(sender)
        if not queue:
            return False
        try:
            queue.remove(message)
        except ValueError:
            return False
        return True

    def wait_for(self, sender: str, message: bytes, timeout: float, poll: Any = None) -> bool:
        """Take ``message`` from ``sender`` once it is here, waiting up to ``timeout``
        seconds (calling ``poll()`` first each round, every millisecond at most, for a
        source that does not wake the condition); whether it came. An interrupt as it is
        taken puts it back."""
        deadline = time.monotonic() + timeout
        taken = False
        try:
            with self.changed:
                while True:
                    if self._closed_owner is not None:
                        raise ClosedError(
                            self._closed_owner, "closed", "while waiting for a notification"
                        )
                    if poll is not None:
                        poll()
                    with deferred_interrupts():
                        taken = self._take(sender, message)
                    if taken:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    # An interrupt landing inside Condition.wait, between its release and
                    # its try, leaves the lock released ("cannot release un-acquired lock"
                    # instead of the KeyboardInterrupt): wait in slices, interrupts held.
                    with deferred_interrupts():
                        self.changed.wait(min(left, 1e-3 if poll is not None else _WAIT_SLICE))
        except BaseException:
            # Taken, then interrupted on the way out (the lock's release included): the
            # message goes back, so the caller's next wait finds it.
            if taken:
                with self.changed:
                    self._queues.setdefault(
                        sender, collections.deque(maxlen=self._per_sender)
                    ).appendleft(message)
            raise
        return True

    def close(self, owner: str) -> None:
        """End every wait, now and later, with ``ClosedError`` naming ``owner``."""
        with self.changed:
            self._closed_owner = owner
            self.changed.notify_all()

    def drain(self) -> dict[str, list[bytes]]:
        """Everything queued, by sender, and forget it."""
        with deferred_interrupts(), self.changed:
            drained = {sender: list(queue) for sender, queue in self._queues.items() if queue}
            self._queues.clear()
        return drained

    def wait(self, timeout: float) -> None:
        """Sleep until something arrives or ``timeout`` seconds pass."""
        with self.changed:
            self.changed.wait(timeout)


@dataclass
class ServedAnswer:
    """What a peer's control server answered: the publication's ``epoch``, the owner's
    endpoint ``name``, and per tensor ``(layout, fds)`` (the fds are the caller's)."""

    epoch: int
    name: str
    tensors: list[tuple[dict, list[int]]]


class ControlLink:
    """This process's connection to one peer's :class:`ControlServer`.

    Thread-safe: one exchange at a time, so frames never interleave. An exchange cut short
    (an error, a timeout, an interrupt) closes the connection; the next one opens a new
    connection (the server then answers with every chunk again). Descriptors received are
    recorded in :attr:`held` at once, and leave it only when handed over (:meth:`handover`)
    or closed.
    """

    def __init__(self, address: str, name: str, peer_name: str, timeout: float) -> None:
        self.address, self.name, self.peer_name, self.timeout = address, name, peer_name, timeout
        self.held: list[int] = []
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 1

    def _connected(self) -> socket.socket:
        if self._sock is None:
            with deferred_interrupts():  # the socket and its record: one step
                self._sock = sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC
                )
            connect_abstract(self.address, timeout=self.timeout, sock=sock)
            sock.sendall(frame(Frame.HELLO, 0, self.name.encode()))
        return self._sock

    def _disconnect(self) -> None:
        with deferred_interrupts():
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            fds, self.held[:] = list(self.held), []
            _close_all(fds)

    @contextlib.contextmanager
    def _exchange(self) -> Any:
        with self._lock:
            try:
                yield self._connected()
            except BaseException:
                self._disconnect()
                raise

    def request_layouts(self, held_chunks: list[int]) -> ServedAnswer:
        """Ask for every tensor's chunks; the answer (its descriptors stay in :attr:`held`
        until :meth:`handover`). ``held_chunks``: per tensor, the chunks mapped here already
        (what an answer may list without a descriptor: it bounds what is read). The whole
        exchange is bounded by :attr:`timeout`, whatever the owner sends. ``ValueError``
        when the owner refuses or answers out of protocol (another tensor count, a later
        request's id); ``ConnectionError`` / ``TimeoutError`` when it is gone or silent."""
        with self._exchange() as sock:
            deadline = time.monotonic() + self.timeout
            request_id = self._next_id
            self._next_id += 1
            sock.sendall(frame(Frame.LAYOUT, request_id))
            while True:
                kind, answered, payload = self._recv_frame(sock, deadline)
                if answered > request_id:
                    raise ValueError(
                        f"the same-host peer {self.peer_name!r} answered request {answered}, "
                        f"which was never sent (the last is {request_id})"
                    )
                if kind == Frame.ERROR.value:
                    if answered != request_id:
                        continue  # an earlier request's refusal
                    reason = payload.decode("utf-8", "replace")
                    raise ValueError(f"the same-host peer {self.peer_name!r} refused: {reason}")
                if kind != Frame.LAYOUT.value or len(payload) < ANSWER_HEADER.size:
                    raise ValueError(
                        f"the same-host peer {self.peer_name!r} sent a {kind!r} frame, not a layout"
                    )
                epoch, count = ANSWER_HEADER.unpack_from(payload)
                if count != len(held_chunks):  # before any descriptor is received
                    raise ValueError(
                        f"the same-host peer {self.peer_name!r} serves {count} tensor(s), "
                        f"this endpoint {len(held_chunks)}"
                    )
                answer = [
                    recv_layout(sock, timeout=_left(deadline), held_chunks=chunks, held=self.held)
                    for chunks in held_chunks
                ]
                if answered == request_id:
                    served = payload[ANSWER_HEADER.size :].decode("utf-8", "replace")
                    return ServedAnswer(epoch, served, answer)
                # The answer to an earlier request: never this one's.
                for _, fds in answer:
                    self.release(fds)

    def _recv_frame(self, sock: socket.socket, deadline: float) -> tuple[bytes, int, bytes]:
        def arm() -> None:
            sock.settimeout(_left(deadline))

        kind, request_id, size = FRAME_HEADER.unpack(_recv_exact(sock, FRAME_HEADER.size, arm))
        if size > _MAX_REASON:
            raise ValueError(f"the same-host peer {self.peer_name!r} sent a frame of {size} bytes")
        return kind, request_id, _recv_exact(sock, size, arm)

    def handover(self, fds: list[int]) -> list[int]:
        """Take ``fds`` out of :attr:`held` for a callee that closes them in every case;
        call it and the callee in one ``deferred_interrupts`` block."""
        taken = set(fds)
        self.held[:] = [fd for fd in self.held if fd not in taken]
        return fds

    def release(self, fds: list[int]) -> None:
        """Close those of ``fds`` still held (received, not handed over) and forget them."""
        with deferred_interrupts():
            held = set(self.held)
            _close_all(self.handover([fd for fd in fds if fd in held]))

    def notify(self, message: bytes) -> None:
        """Send one notification (whole, never interleaved with another thread's)."""
        with self._exchange() as sock:
            sock.sendall(frame(Frame.NOTIFY, 0, message))

    def close(self) -> None:
        """Close the connection and every descriptor still held. Safe to call twice."""
        with self._lock:
            self._disconnect()


def _left(deadline: float) -> float:
    """Seconds left until ``deadline``; ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the same-host peer did not answer in time")
    return left
