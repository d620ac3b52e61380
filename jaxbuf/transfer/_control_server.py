"""The owner's side of the same-host control plane (:mod:`jaxbuf.transfer._control` has the
frames and the initiator's side): one thread around a selector, serving the chunks of every
tensor an endpoint publishes.

Every socket is non-blocking: a peer that sends garbage, floods or stops reading costs that
peer its connection and nobody else a wait. Its output is bounded (one answer at a time:
its requests are not read while an answer is queued) and has a deadline; a connection that
says no hello in time is dropped; ``accept`` backs off when the process is out of
descriptors. Descriptors are attached at send time from what is published then (no
duplicate is held for a slow reader), and an answer whose publication was withdrawn
mid-send drops the connection: the peer never maps a chunk the owner stopped serving as
current.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from jaxbuf._interrupts import deferred_interrupts
from jaxbuf.sharing import export_layout, peer_credentials
from jaxbuf.sharing._wire import _close_all, listen_abstract, message_pieces
from jaxbuf.transfer._control import (
    ANSWER_HEADER,
    FRAME_HEADER,
    MAX_NAME,
    MAX_NOTIFICATION,
    Frame,
    Inbox,
    Limits,
    frame,
)

__all__ = ["ControlServer"]

_log = logging.getLogger(__name__)


class _ServedTensor:
    """The chunks of one tensor as published to peers: a mapping listener of the tensor.

    Invariants: :attr:`fds` holds one descriptor per chunk published and still mapped, and
    nothing else (a chunk about to be unmapped is dropped and its descriptor closed at once,
    before the tensor unmaps it); the server's lock guards both fields."""

    def __init__(self, tensor: Any, server: ControlServer) -> None:
        self.tensor, self._server = tensor, server
        self.layout: dict | None = None  # the last published layout, its "chunks" emptied
        self.fds: dict[int, tuple[int, int, int]] = {}  # chunk id -> (offset, size, fd)

    def publish(self) -> None:
        """Export the chunks mapped now that are not published yet (raises what
        :func:`~jaxbuf.sharing.export_layout` raises: the driver cannot export)."""
        with deferred_interrupts():  # the descriptors and their record: one step
            layout, fds = export_layout(self.tensor, self.layout)
            with self._server.lock:
                live = {chunk[2] for chunk in layout["all_chunks"]}
                stale = [self.fds.pop(c)[2] for c in list(self.fds) if c not in live]
                for (offset, size, chunk_id), fd in zip(layout["chunks"], fds):
                    self.fds[chunk_id] = (offset, size, fd)
                layout["chunks"] = []
                self.layout = layout
            _close_all(stale)

    def mapped(self, chunks: list[tuple[int, int]]) -> None:
        """New chunks are served from the owner's next ``metadata()``."""

    def unmapping(self, chunks: list[tuple[int, int]]) -> None:
        """Stop serving chunks at these offsets: the publication is withdrawn until the
        owner's next ``metadata()``."""
        offsets = {offset for offset, _ in chunks}
        with deferred_interrupts(), self._server.lock:
            gone = [c for c, (offset, _, _) in self.fds.items() if offset in offsets]
            if gone:
                self._server.withdraw()
            # Each descriptor forgotten once closed (an error leaves the rest recorded).
            for chunk_id in gone:
                os.close(self.fds[chunk_id][2])
                del self.fds[chunk_id]

    def close(self) -> None:
        with deferred_interrupts(), self._server.lock:
            while self.fds:
                chunk_id, (_, _, fd) = next(iter(self.fds.items()))
                os.close(fd)
                del self.fds[chunk_id]
            self.layout = None


@dataclass
class _FdBatch:
    """Descriptors of one answer, looked up when sent: tensor ``tensor``'s ``chunk_ids``,
    valid while the publication of ``epoch`` stands."""

    tensor: int
    chunk_ids: list[int]
    epoch: int


class _Stale(Exception):
    """The publication an answer was cut from was withdrawn while it was being sent."""


class _Connection:
    """One accepted connection: who it is, what it was sent, what waits to go out."""

    def __init__(self, sock: socket.socket, now: float, tensors: int) -> None:
        self.sock = sock
        self.name: str | None = None
        self.opened = now
        self.input = bytearray()
        self.output: collections.deque[bytes | _FdBatch] = collections.deque()
        self.output_since = 0.0
        self.sent: list[set[int]] | None = None  # chunk ids sent, per tensor (None: none yet)
        self.tensors = tensors


class ControlServer:
    """The owner's control plane: serves the chunks of ``tensors`` to peers of this uid on
    this host, and queues the notifications they send into ``inbox``.

    Invariants: the thread is started and recorded in one step (an interrupt cannot leak
    it); :meth:`close` joins it and closes every socket and published descriptor; only the
    thread touches connections; the published state is shared under :attr:`lock`. An
    accepted peer of another uid is closed at once (it never sees a descriptor).
    """

    def __init__(self, name: str, tensors: list[Any], inbox: Inbox, limits: Limits) -> None:
        self.name, self.inbox, self.limits = name, inbox, limits
        self.address = f"jaxbuf-{os.getpid()}-{secrets.token_hex(8)}"
        self.lock = threading.Lock()
        self._epoch: int | None = None  # the publication's epoch; None: withdrawn
        self._served = [_ServedTensor(tensor, self) for tensor in tensors]
        self._listening: list[Any] = []
        self.unavailable: str | None = None
        self._closed = False
        self._listener = listen_abstract(self.address)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            for served in self._served:
                served.tensor.add_mapping_listener(served)
                self._listening.append(served)
            with deferred_interrupts():
                self._thread: threading.Thread | None = threading.Thread(
                    target=self._serve, name=f"jaxbuf-control-{name}", daemon=True
                )
                self._thread.start()
        except BaseException:
            self._thread = None
            self.close()
            raise

    # -- the owner's threads ------------------------------------------------------------
    def publish(self, epoch: int) -> bool:
        """Serve the chunks mapped now as the publication of ``epoch``; whether this
        endpoint's memory can be served (if not, :attr:`unavailable` says why)."""
        try:
            for served in self._served:
                served.publish()
        except Exception as error:  # noqa: BLE001 - a transport choice, reported in words
            self.unavailable = f"{type(error).__name__}: {error}"
            with self.lock:
                self._epoch = None
            return False
        self.unavailable = None
        with self.lock:
            self._epoch = epoch
        return True

    def withdraw(self) -> None:
        """Answer no layout request until the next :meth:`publish` (the caller holds
        :attr:`lock`)."""
        self._epoch = None

    def close(self) -> None:
        """Stop the thread, close every connection and descriptor, stop following the
        tensors. Safe to call twice, and again after an interrupt: each step is done once."""
        if self._closed:
            return
        thread = self._thread
        # Interrupts held back (the thread exits at once when woken): CPython's is_alive()
        # or join() interrupted at the wrong instant marks a live thread stopped, and the
        # next close would leave it running on closed sockets.
        with deferred_interrupts():
            if thread is not None and thread.is_alive():
                with contextlib.suppress(OSError):  # the thread closed the pair already
                    self._wake_w.send(b"x")
                thread.join()
        while self._listening:
            served = self._listening[-1]
            with contextlib.suppress(ValueError):  # detached already: the tensor was freed
                if not served.tensor.released:
                    served.tensor.remove_mapping_listener(served)
            self._listening.pop()
        for served in self._served:
            served.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._closed = True

    # -- the control thread -------------------------------------------------------------
    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        selector.register(self._listener, selectors.EVENT_READ)
        connections: dict[socket.socket, _Connection] = {}
        accept_resumes = 0.0  # while out of descriptors: when accept is tried again
        backoff = 0.0
        try:
            while True:
                now = time.monotonic()
                if accept_resumes and now >= accept_resumes:
                    accept_resumes = 0.0
                    selector.register(self._listener, selectors.EVENT_READ)
                timeout = self._expire(selector, connections, now)
                if accept_resumes:
                    timeout = min(timeout, accept_resumes - now)
                for key, events in selector.select(max(timeout, 0.0)):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        return
                    if sock is self._listener:
                        pause = self._accept(selector, connections)
                        if pause:
                            backoff = min(max(backoff * 2, 0.01), 1.0)
                            selector.unregister(self._listener)
                            accept_resumes = time.monotonic() + backoff
                        else:
                            backoff = 0.0
                        continue
                    connection = connections[sock]  # type: ignore[index]
                    try:
                        if events & selectors.EVENT_WRITE:
                            self._flush(connection)
                        if events & selectors.EVENT_READ:
                            self._receive(connection)
                        self._process(connection)
                        self._watch(selector, connection)
                    except Exception as error:  # noqa: BLE001 - that peer's connection alone
                        self._drop(selector, connections, connection, error)
        finally:
            for sock in connections:
                sock.close()
            selector.close()

    def _expire(self, selector: Any, connections: dict, now: float) -> float:
        """Drop connections past a deadline; seconds until the next deadline."""
        limits, soonest = self.limits, 3600.0
        for connection in list(connections.values()):
            if connection.output:
                deadline = connection.output_since + limits.output_deadline
                what = "did not read its answer"
            elif connection.name is None:
                deadline = connection.opened + limits.hello_deadline
                what = "said no hello"
            else:
                continue
            if now >= deadline:
                error = TimeoutError(f"{what} within its deadline")
                self._drop(selector, connections, connection, error)
            else:
                soonest = min(soonest, deadline - now)
        return soonest

    def _accept(self, selector: Any, connections: dict) -> bool:
        """Accept one connection; True when the process is out of descriptors (accept
        pauses and backs off rather than spin or die)."""
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return False
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                _log.warning("jaxbuf: control plane %r cannot accept: %s", self.name, error)
                return True
            if error.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                return False
            raise
        try:
            if (
                len(connections) >= self.limits.max_connections
                or peer_credentials(sock).uid != os.geteuid()
            ):
                sock.close()  # another user never sees a descriptor of this memory
                return False
            sock.setblocking(False)
        except OSError:
            sock.close()
            return False
        connection = _Connection(sock, time.monotonic(), len(self._served))
        connections[sock] = connection
        selector.register(sock, selectors.EVENT_READ, None)
        return False

    def _drop(self, selector: Any, connections: dict, connection: _Connection, error: Any) -> None:
        _log.debug("jaxbuf: dropping same-host peer %s: %r", connection.name, error)
        selector.unregister(connection.sock)
        del connections[connection.sock]
        connection.sock.close()

    def _watch(self, selector: Any, connection: _Connection) -> None:
        """Wait for the peer to read while output is queued, else for its next frame."""
        events = selectors.EVENT_WRITE if connection.output else selectors.EVENT_READ
        if selector.get_key(connection.sock).events != events:
            selector.modify(connection.sock, events)

    def _receive(self, connection: _Connection) -> None:
        """Read what the peer sent (only asked while no answer of its is queued, so its
        buffer holds at most one read beyond a partial frame)."""
        data = connection.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("closed by the peer")
        connection.input += data

    def _process(self, connection: _Connection) -> None:
        """Handle the whole frames received, until one queues an answer."""
        buffer = connection.input
        while len(buffer) >= FRAME_HEADER.size and not connection.output:
            kind, request_id, size = FRAME_HEADER.unpack_from(buffer)
            limit = MAX_NOTIFICATION if kind == Frame.NOTIFY.value else MAX_NAME
            if size > limit:
                raise ValueError(f"a {kind!r} frame of {size} bytes is over {limit}")
            if len(buffer) < FRAME_HEADER.size + size:
                return
            payload = bytes(buffer[FRAME_HEADER.size : FRAME_HEADER.size + size])
            del buffer[: FRAME_HEADER.size + size]
            self._handle(connection, kind, request_id, payload)

    def _handle(
        self, connection: _Connection, kind: bytes, request_id: int, payload: bytes
    ) -> None:
        if connection.name is None:
            if kind != Frame.HELLO.value or not payload:
                raise ValueError(f"the first frame must be a hello with a name, got {kind!r}")
            connection.name = payload.decode("utf-8")
        elif kind == Frame.NOTIFY.value:
            self.inbox.put(connection.name, [payload])
        elif kind == Frame.LAYOUT.value:
            self._answer(connection, request_id)
        else:
            raise ValueError(f"unexpected frame kind {kind!r}")

    def _answer(self, connection: _Connection, request_id: int) -> None:
        """Queue the answer to a layout request: every tensor's layout, with the chunks this
        connection was not sent yet (descriptors attached when sent)."""
        with self.lock:
            epoch = self._epoch
            if epoch is None:
                reason = "the owner changed its memory since its last metadata(); wait for the next"
                self._queue(connection, [frame(Frame.ERROR, request_id, reason.encode())])
                return
            sent = connection.sent or [set() for _ in self._served]
            header = ANSWER_HEADER.pack(epoch, len(self._served)) + self.name.encode()
            pieces: list[bytes | _FdBatch] = [frame(Frame.LAYOUT, request_id, header)]
            for index, (served, old) in enumerate(zip(self._served, sent)):
                new = [(c, entry) for c, entry in served.fds.items() if c not in old]
                answer = dict(served.layout)  # type: ignore[arg-type]
                answer["chunks"] = [[offset, size, c] for c, (offset, size, _) in new]
                fds = [fd for _, (_, _, fd) in new]
                for data, batch in message_pieces(answer, fds):
                    if batch:
                        ids = [c for c, _ in new[: len(batch)]]
                        new = new[len(batch) :]
                        pieces.append(_FdBatch(index, ids, epoch))
                    else:
                        pieces.append(data)
            connection.sent = [
                {chunk[2] for chunk in served.layout["all_chunks"]}  # type: ignore[index]
                for served in self._served
            ]
        self._queue(connection, pieces)

    def _queue(self, connection: _Connection, pieces: list) -> None:
        connection.output.extend(pieces)
        connection.output_since = time.monotonic()
        self._flush(connection)

    def _flush(self, connection: _Connection) -> None:
        """Send what the socket takes now, never waiting."""
        sock, output = connection.sock, connection.output
        while output:
            piece = output[0]
            try:
                if isinstance(piece, _FdBatch):
                    with self.lock:
                        fds = self._descriptors(piece)
                        socket.send_fds(sock, [b"F"], fds)
                    output.popleft()
                    continue
                sent = sock.send(piece)
            except BlockingIOError:
                return
            if sent == len(piece):
                output.popleft()
            else:
                output[0] = piece[sent:]
                return

    def _descriptors(self, batch: _FdBatch) -> list[int]:
        if self._epoch != batch.epoch:
            raise _Stale("the publication was withdrawn while its answer was being sent")
        fds = self._served[batch.tensor].fds
        try:
            return [fds[chunk_id][2] for chunk_id in batch.chunk_ids]
        except KeyError:
            raise _Stale("a chunk was dropped while its answer was being sent") from None
