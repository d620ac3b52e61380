"""The same-host transport: a peer's chunks imported through :mod:`jaxbuf.sharing`, block
transfers as driver copies in this process.

NIXL's UCX opens a peer's GPU memory with legacy CUDA IPC handles, which ``cuMemCreate``
memory has none of, or with fabric handles, which most single hosts refuse: between two
processes of one host it moves jaxbuf memory through TCP loopback. This transport does what
UCX cannot: the owner serves its chunks as POSIX descriptors (``SCM_RIGHTS``) on an abstract
Unix socket, the initiator maps them at the owner's offsets (an
:class:`~jaxbuf.sharing.ImportedBuffer`), and a transfer is one
:meth:`~jaxbuf.drivers.base.VmmDriver.copy_batch` between its own buffer and that import:
one call for a whole block list, stream-ordered on CUDA, a ``memcpy`` loop in C on the CPU.

Pieces:

* :class:`LocalServer` (the owner's side): a thread that accepts peers of this uid, serves
  the descriptors of the chunks published at the last :meth:`LocalServer.publish` (the
  endpoint's ``metadata()``), and queues notifications peers send. It is a mapping listener
  of the buffer: a chunk about to be unmapped is dropped from what it serves, at once.
* :class:`LocalLink` (the initiator's side, one per peer): the connection to a peer's server
  and the import of its buffer, refreshed when a newer metadata message arrives.
* :class:`LocalTransfer`: one posted copy; :meth:`~LocalTransfer.wait` as for NIXL.

Frames on a connection (initiator to owner): a 5-byte header (a kind byte, a 4-byte length,
network order) then the payload: ``H`` hello (the sender's endpoint name, the first frame),
``L`` a layout request (empty), ``N`` a notification. The owner answers ``L`` only, with
``L`` carrying its endpoint name (the initiator checks it is the peer its metadata named)
followed by one :func:`~jaxbuf.sharing.send_layout` message, or ``E`` and the reason.
A malformed frame closes that connection alone; the server and every other peer go on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
from typing import Any

import numpy as np

from jaxbuf.sharing import ImportedBuffer, export_layout, peer_credentials, recv_layout
from jaxbuf.sharing._wire import _close_all, send_layout
from jaxbuf.sharing._wire import _recv_exact as _recv_socket_exact
from jaxbuf.transfer._transfer import Transfer

__all__ = ["LocalLink", "LocalServer", "LocalTransfer", "host_identity"]

_log = logging.getLogger(__name__)
_FRAME = struct.Struct("!cI")
_MAX_NAME = 256
_MAX_NOTIFICATION = 1 << 16
_MAX_QUEUED = 1 << 16  # notifications queued per sender before the oldest are dropped
#: Seconds the server waits for a peer to take a layout, and a peer for the answer.
SERVE_TIMEOUT = 30.0


@functools.cache
def host_identity() -> tuple[str, int]:
    """``(boot_id, uid)``: what two processes compare to know they share a host and a user.
    The boot id changes at every boot and differs between hosts (containers of one host
    share it; their network namespaces may still keep them apart: connecting says)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
        return file.read().strip(), os.geteuid()


def _abstract(address: str) -> str:
    return "\0" + address


def _send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(_FRAME.pack(kind, len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``, within the socket's own timeout."""
    return _recv_socket_exact(sock, size, _no_deadline)


def _no_deadline() -> None:
    """The socket's timeout (:data:`SERVE_TIMEOUT`) bounds each read: nothing to arm."""


class _Client:
    """One accepted connection: its name (after hello) and the chunk ids it was sent."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.name: str | None = None
        self.buffer = b""
        self.sent: set[int] | None = None  # None: nothing sent yet (first answer is whole)


class LocalServer:
    """Serves one buffer's chunks to peers of this uid on this host.

    Invariants: :attr:`_fds` holds one descriptor per chunk published and still mapped,
    and nothing else (a chunk is dropped, its descriptor closed, in :meth:`unmapping`,
    before the buffer unmaps it); a peer receives descriptors only of chunks in
    :attr:`_fds`, and only once per connection; :meth:`close` joins the thread and closes
    every socket and descriptor. ``publish`` and the listener run on the owner's thread;
    the server thread only reads the published state, under :attr:`_lock`.
    """

    def __init__(self, tensor: Any, name: str) -> None:
        self.tensor, self.name = tensor, name
        self.address = f"jaxbuf-{os.getpid()}-{secrets.token_hex(8)}"
        self._lock = threading.Lock()
        self._layout: dict | None = None  # the last published layout, fds as in _fds
        self._fds: dict[int, tuple[int, int, int]] = {}  # chunk id -> (offset, size, fd)
        self._unavailable: str | None = None
        self._inbox: dict[str, list[bytes]] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self._listener.bind(_abstract(self.address))
            self._listener.listen(16)
            self._listener.setblocking(False)
            tensor.add_mapping_listener(self)
        except BaseException:
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            raise
        self._closed = False
        self._thread = threading.Thread(
            target=self._serve, name=f"jaxbuf-local-{name}", daemon=True
        )
        self._thread.start()

    # -- the owner's thread -------------------------------------------------------------
    def publish(self) -> bool:
        """Export the chunks mapped now (new ones only) for peers to import; whether this
        buffer can be served (a driver that cannot export descriptors cannot: the reason is
        :attr:`unavailable`)."""
        previous = self._layout
        try:
            layout, fds = export_layout(self.tensor, previous)
        except Exception as error:  # noqa: BLE001 - a transport choice, reported in the message
            self._unavailable = f"{type(error).__name__}: {error}"
            return False
        self._unavailable = None
        live = {chunk[2] for chunk in layout["all_chunks"]}
        with self._lock:
            stale = [c for c in self._fds if c not in live]
            dropped = [self._fds.pop(c)[2] for c in stale]
            for (offset, size, chunk_id), fd in zip(layout["chunks"], fds):
                self._fds[chunk_id] = (offset, size, fd)
            layout["chunks"] = []
            self._layout = layout
        _close_all(dropped)
        return True

    @property
    def unavailable(self) -> str | None:
        """Why the last :meth:`publish` could not export this buffer, or None."""
        return self._unavailable

    def mapped(self, chunks: list[tuple[int, int]]) -> None:
        """New chunks are published by the next :meth:`publish` (the owner's metadata)."""

    def unmapping(self, chunks: list[tuple[int, int]]) -> None:
        """Stop serving the chunks at these offsets, and what was published with them: a
        peer asking before the next :meth:`publish` is told to wait for that message."""
        offsets = {offset for offset, _ in chunks}
        with self._lock:
            gone = [c for c, (offset, _, _) in self._fds.items() if offset in offsets]
            dropped = [self._fds.pop(c)[2] for c in gone]
            if gone:
                self._layout = None
        _close_all(dropped)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications peers sent since the last call, by sender name."""
        with self._lock:
            inbox, self._inbox = self._inbox, {}
        return inbox

    def close(self) -> None:
        """Stop the thread, close every connection and descriptor. Safe to call twice, and
        again after an interrupt: each step is done once, and marked done only after."""
        if self._closed:
            return
        if self._thread.is_alive():
            with contextlib.suppress(OSError):  # the thread closed the socket pair already
                self._wake_w.send(b"x")
            self._thread.join()
        with contextlib.suppress(ValueError):  # detached already: the tensor was freed
            if not self.tensor.released:
                self.tensor.remove_mapping_listener(self)
        with self._lock:
            while self._fds:  # each descriptor forgotten once closed
                chunk_id, (_, _, fd) = next(iter(self._fds.items()))
                os.close(fd)
                del self._fds[chunk_id]
            self._layout = None
        self._closed = True

    # -- the server thread --------------------------------------------------------------
    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        clients: dict[socket.socket, _Client] = {}
        try:
            while True:
                for key, _ in selector.select():
                    sock = key.fileobj
                    if sock is self._wake_r:
                        return
                    if sock is self._listener:
                        self._accept(selector, clients)
                        continue
                    client = clients[sock]  # type: ignore[index]
                    try:
                        self._read(client)
                    except Exception as error:  # noqa: BLE001 - that peer's connection alone
                        _log.debug("jaxbuf: dropping same-host peer %s: %r", client.name, error)
                        selector.unregister(sock)
                        del clients[sock]  # type: ignore[arg-type]
                        sock.close()  # type: ignore[union-attr]
        finally:
            for sock in clients:
                sock.close()
            selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _accept(self, selector: selectors.BaseSelector, clients: dict) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if peer_credentials(sock).uid != os.geteuid():
            sock.close()  # another user: never a descriptor of this memory
            return
        sock.setblocking(False)
        clients[sock] = _Client(sock)
        selector.register(sock, selectors.EVENT_READ, None)

    def _read(self, client: _Client) -> None:
        data = client.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("closed by the peer")
        client.buffer += data
        while len(client.buffer) >= _FRAME.size:
            kind, size = _FRAME.unpack_from(client.buffer)
            limit = _MAX_NOTIFICATION if kind == b"N" else _MAX_NAME
            if size > limit:
                raise ValueError(f"a {kind!r} frame of {size} bytes is over {limit}")
            if len(client.buffer) < _FRAME.size + size:
                return
            payload = client.buffer[_FRAME.size : _FRAME.size + size]
            client.buffer = client.buffer[_FRAME.size + size :]
            self._handle(client, kind, payload)

    def _handle(self, client: _Client, kind: bytes, payload: bytes) -> None:
        if client.name is None:
            if kind != b"H":
                raise ValueError(f"the first frame must be a hello, got {kind!r}")
            client.name = payload.decode("utf-8")
            if not client.name:
                raise ValueError("an empty endpoint name")
        elif kind == b"N":
            with self._lock:
                queue = self._inbox.setdefault(client.name, [])
                queue.append(payload)
                del queue[:-_MAX_QUEUED]
        elif kind == b"L":
            self._answer_layout(client)
        else:
            raise ValueError(f"unknown frame kind {kind!r}")

    def _answer_layout(self, client: _Client) -> None:
        with self._lock:
            layout = self._layout
            if layout is not None:
                sent = client.sent or set()
                new = [
                    (chunk_id, entry)
                    for chunk_id, entry in self._fds.items()
                    if chunk_id not in sent
                ]
                # Duplicates: the owner's thread may close the originals once the lock is
                # released; these stay ours until sent.
                fds = [os.dup(entry[2]) for _, entry in new]
        sock = client.sock
        sock.setblocking(True)
        sock.settimeout(SERVE_TIMEOUT)
        try:
            if layout is None:
                reason = "the owner changed its memory since its last metadata(); wait for the next"
                _send_frame(sock, b"E", reason.encode())
                return
            try:
                answer = dict(layout)
                answer["chunks"] = [[o, n, c] for c, (o, n, _) in new]
                _send_frame(sock, b"L", self.name.encode())
                send_layout(sock, answer, fds, timeout=SERVE_TIMEOUT)
            finally:
                _close_all(fds)
            client.sent = {chunk[2] for chunk in layout["all_chunks"]}
        finally:
            sock.setblocking(False)


class LocalLink:
    """This process's connection to one same-host peer and its buffer mapped here.

    Invariants: :attr:`imported` maps exactly the chunks the peer served at the last
    :meth:`refresh` (its committed sizes are what those chunks back: facts, not what the
    peer's message claims); :meth:`close` unmaps it and closes the connection.
    """

    def __init__(self, address: str, name: str, device: Any, peer_name: str) -> None:
        self.address, self.peer_name = address, peer_name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(SERVE_TIMEOUT)
            sock.connect(_abstract(address))
            if peer_credentials(sock).uid != os.geteuid():
                raise PermissionError(f"the same-host peer at {address!r} runs as another user")
            _send_frame(sock, b"H", name.encode())
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._device = device
        self.imported: ImportedBuffer | None = None

    def refresh(self) -> ImportedBuffer:
        """Ask the peer for its chunks now and map the new ones (unmapping those it
        dropped); the import. ``ValueError`` when it cannot say (it changed since its last
        message) or sends a layout that does not fit."""
        sock = self._sock
        _send_frame(sock, b"L")
        kind, size = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
        if kind == b"E":
            reason = _recv_exact(sock, min(size, _MAX_NAME * 4)).decode("utf-8", "replace")
            raise ValueError(f"the same-host peer at {self.address!r} refused: {reason}")
        if kind != b"L" or size > _MAX_NAME * 4:
            raise ValueError(f"the same-host peer sent a {kind!r} frame, not a layout")
        served = _recv_exact(sock, size).decode("utf-8", "replace")
        if served != self.peer_name:
            raise ValueError(
                f"the socket at {self.address!r} serves endpoint {served!r}, the metadata names "
                f"{self.peer_name!r}"
            )
        layout, fds = recv_layout(sock, timeout=SERVE_TIMEOUT)
        if self.imported is None:
            self.imported = ImportedBuffer(layout, fds, device=self._device)
        else:
            self.imported.update(layout, fds)
        return self.imported

    def notify(self, message: bytes) -> None:
        _send_frame(self._sock, b"N", message)

    def close(self) -> None:
        """Unmap the import, then close the connection; an interrupted close is finished by
        the next call (the import is forgotten only once closed)."""
        if self.imported is not None:
            self.imported.close()
            self.imported = None
        self._sock.close()


class LocalTransfer(Transfer):
    """One copy posted on the same-host transport. On the CPU it is done when posted (no
    event); on CUDA :meth:`settle` waits for the event recorded after the copies."""

    def __init__(self, driver: Any, event: Any, request: tuple, registration: Any) -> None:
        self._driver, self._event = driver, event
        self._request = request
        self._registration = registration
        self.error = None
        self.finished = event is None
        if not self.finished:
            registration.track(self)

    def _release(self) -> None:
        if self._event is not None:
            self._driver.destroy_event(self._event)
            self._event = None

    def settle(self, timeout: float) -> bool:
        if self.finished:
            return True
        if timeout > 0:
            # Block in the driver rather than spin: the copy is on the device's queue, and a
            # device copy always completes (the timeout bounds NIXL's transfers, not these).
            try:
                self._driver.event_synchronize(self._event)
            except Exception as error:  # noqa: BLE001 - the transfer's failure, for wait()
                self._finish(repr(error))
                return True
            self._finish(None)
            return True
        try:
            done = self._driver.event_query(self._event)
        except Exception as error:  # noqa: BLE001 - as above
            self._finish(repr(error))
            return True
        if done:
            self._finish(None)
        return done


def copy_triples(
    local_starts: list[int],
    remote_starts: list[int],
    block_bytes: int,
    segments: list[int],
    local_blocks: np.ndarray,
    remote_blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(local addresses, remote addresses, sizes)`` of the copies moving block
    ``local_blocks[i]`` <-> ``remote_blocks[i]`` of every chosen segment (``*_starts``: each
    layout segment's address on that side), uint64. Adjacent blocks are not merged: the
    kernel cuts every copy into pieces anyway, and a ``memcpy`` of one run costs what the
    ``memcpy`` of its blocks does; each numpy call costs microseconds on this path."""
    if len(local_blocks) == 1 and len(segments) == 1:  # the common small transfer
        s = segments[0]
        return (
            np.array([local_starts[s] + int(local_blocks[0]) * block_bytes], np.uint64),
            np.array([remote_starts[s] + int(remote_blocks[0]) * block_bytes], np.uint64),
            np.array([block_bytes], np.uint64),
        )
    local_offsets = local_blocks * block_bytes
    remote_offsets = remote_blocks * block_bytes
    if len(segments) == 1:
        here = local_offsets + local_starts[segments[0]]
        there = remote_offsets + remote_starts[segments[0]]
    else:
        here = np.concatenate([local_offsets + local_starts[s] for s in segments])
        there = np.concatenate([remote_offsets + remote_starts[s] for s in segments])
    # Addresses and offsets are below 2**63 (checked when a peer's layout is decoded).
    return here.view(np.uint64), there.view(np.uint64), np.full(len(here), block_bytes, np.uint64)
