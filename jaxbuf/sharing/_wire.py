"""The wire protocol of :mod:`jaxbuf.sharing`: one message, its framing and its descriptors.

A message on any ``AF_UNIX`` stream socket is a 16-byte header (``b"JXB1"``, payload length,
descriptor count), the layout as UTF-8 JSON, then the descriptors in batches of at most
:data:`_FDS_PER_BATCH` (the kernel's ``SCM_MAX_FD`` is 253), each batch attached to one
``b"F"`` byte. Descriptors are received close-on-exec.

This module knows sockets, descriptors, timeouts and peers; it does not look inside a layout
(that is :mod:`jaxbuf.sharing._layout`) and maps nothing (:mod:`jaxbuf.sharing._imported`).
Every function leaves no descriptor open on error: what it received it closes, what the caller
passed in stays the caller's.
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import select
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from jaxbuf._interrupts import deferred_interrupts

_MAGIC = b"JXB1"
_HEADER = struct.Struct("!4sQI")  # magic, payload bytes, descriptor count
_FDS_PER_BATCH = 250
_MAX_PAYLOAD = 1 << 30
# What a real layout needs: its scalars and segment lists (1 MiB holds thousands of
# segments), then one row of at most 64 bytes ("[offset,size,chunk_id]," of 2**62-sized
# ints) per chunk in "all_chunks" and again in "chunks". A payload beyond that is refused
# before it is read: parsed, 7 MiB of "[0,0,0]" rows grew a receiver by 115 MiB.
_LAYOUT_BYTES = 1 << 20
_ROW_BYTES = 64
_MAX_FDS = 1 << 20  # a header asking for more is not from send_layout
_SUN_PATH = 108  # bytes of sockaddr_un.sun_path on Linux, the terminating NUL included
DEFAULT_TIMEOUT = 60.0
"""Seconds that :func:`send_buffer` / :func:`recv_buffer` (and the lower-level calls) wait
for a whole message by default; ``timeout=None`` waits forever."""


# -- peers, timeouts ----------------------------------------------------------------------
class PeerCredentials(NamedTuple):
    """The process at the other end of a Unix socket, as the kernel recorded it."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """``(pid, uid, gid)`` of the peer of the connected ``AF_UNIX`` socket ``sock``
    (``SO_PEERCRED``): the process that called ``connect()`` (or ``listen()``), or for a
    ``socketpair()`` the process that created the pair, at that moment (a later ``setuid``
    of the peer does not change it)."""
    if not isinstance(sock, socket.socket) or sock.family != socket.AF_UNIX:
        raise ValueError(f"peer credentials need a connected AF_UNIX socket, got {sock!r}")
    size = struct.calcsize("3i")
    pid, uid, gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size)
    )
    return PeerCredentials(pid, uid, gid)


def _allowed_uids(allowed_uids: Iterable[int] | None) -> frozenset[int]:
    if allowed_uids is None:
        return frozenset((os.geteuid(),))
    if isinstance(allowed_uids, (str, bytes, int)):
        raise TypeError(f"allowed_uids must be a collection of uids, got {allowed_uids!r}")
    uids = frozenset(allowed_uids)
    for uid in uids:
        if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
            raise ValueError(f"allowed_uids must hold non-negative int uids, got {uid!r}")
    return uids


def _check_peer(sock: socket.socket, allowed: frozenset[int]) -> None:
    peer = peer_credentials(sock)
    if peer.uid not in allowed:
        raise PermissionError(
            f"refusing to share with pid {peer.pid}: it runs as uid {peer.uid}, not one of "
            f"allowed_uids {sorted(allowed)}"
        )


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    return float(timeout)


@contextlib.contextmanager
def _deadline(
    sock: socket.socket, timeout: float | None, what: str
) -> Iterator[Callable[[], None]]:
    """Yield ``arm()``, which sets ``sock``'s timeout to what is left of ``timeout`` before
    each blocking call, so that ``timeout`` bounds the whole message; the socket's own
    timeout is restored afterwards. A timeout becomes a ``TimeoutError`` saying what."""
    end = None if timeout is None else time.monotonic() + timeout
    previous = sock.gettimeout()

    def arm() -> None:
        if end is None:
            sock.settimeout(None)
            return
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)

    try:
        yield arm
    except TimeoutError:
        raise TimeoutError(
            f"{what} did not complete within {timeout} s (is the peer reading/sending?); the "
            "connection is out of step now: close it"
        ) from None
    finally:
        sock.settimeout(previous)


def listen_unix(path: str | os.PathLike[str], backlog: int = 8) -> socket.socket:
    """A listening ``AF_UNIX`` stream socket at the new file ``path``, mode 0600 from the
    moment it appears there: bound in a private (0700) directory beside ``path``, chmod-ed,
    then hard-linked into place (``FileExistsError`` if ``path`` exists). Only this uid
    and root can connect; :func:`send_buffer` still checks the peer's uid. The caller
    removes ``path`` when done.

    Any path the file system takes will do, however long: the socket is bound through
    ``/proc/self/fd/<the private directory>/s``, a name far shorter than ``sun_path``'s 108
    bytes at any depth, and ``link()`` has no such limit. :func:`connect_unix` reaches it."""
    path = os.fspath(path)
    private = tempfile.mkdtemp(prefix=".jaxbuf-", dir=os.path.dirname(os.path.abspath(path)))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory = -1
    try:
        directory = os.open(private, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        sock.bind(f"/proc/self/fd/{directory}/s")
        os.chmod("s", 0o600, dir_fd=directory)
        sock.listen(backlog)
        os.link("s", path, src_dir_fd=directory)  # the last step: nothing to undo at path
    except BaseException:
        sock.close()
        raise
    finally:
        if directory >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("s", dir_fd=directory)
            os.close(directory)
        os.rmdir(private)
    return sock


def connect_unix(
    path: str | os.PathLike[str], *, timeout: float | None = DEFAULT_TIMEOUT
) -> socket.socket:
    """A stream socket connected to the ``AF_UNIX`` socket file ``path`` (one that
    :func:`listen_unix` made, or any other), within ``timeout`` seconds (``None``: wait
    forever; then ``TimeoutError``). A path longer than ``sun_path`` allows is reached
    through ``/proc/self/fd/<an O_PATH descriptor of the socket file>``. The socket returned
    is blocking: the sharing calls take their own timeouts."""
    timeout = _check_timeout(timeout)
    path = os.fspath(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    target = -1
    try:
        sock.settimeout(timeout)
        if len(os.fsencode(path)) < _SUN_PATH:
            sock.connect(path)
        else:
            target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            sock.connect(f"/proc/self/fd/{target}")
        sock.settimeout(None)
    except TimeoutError:
        sock.close()
        raise TimeoutError(f"connecting to {path!r} did not complete within {timeout} s") from None
    except BaseException:
        sock.close()
        raise
    finally:
        if target >= 0:
            os.close(target)
    return sock


def listen_abstract(name: str, backlog: int = 64) -> socket.socket:
    """A listening, non-blocking, close-on-exec ``AF_UNIX`` stream socket bound to the
    abstract name ``"\\0" + name`` (no file: it goes when the socket closes). An abstract
    socket has no permissions: whoever accepts checks the peer (:func:`peer_credentials`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_abstract(
    name: str,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    allowed_uids: Iterable[int] | None = None,
    sock: socket.socket | None = None,
) -> socket.socket:
    """A stream socket connected to the abstract ``AF_UNIX`` name ``name`` within
    ``timeout`` seconds, whose listener runs as one of ``allowed_uids`` (default: this
    process's effective uid; ``PermissionError`` otherwise). Blocking, with ``timeout`` as
    its socket timeout. ``sock``: an unconnected ``AF_UNIX`` stream socket the caller
    already holds (it stays the caller's, on error too); default a new close-on-exec one,
    closed on error."""
    timeout = _check_timeout(timeout)
    allowed = _allowed_uids(allowed_uids)
    owned = sock is None
    if sock is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        _connect_waiting(sock, "\0" + name, timeout)
        _check_peer(sock, allowed)
    except BaseException:
        if owned:
            sock.close()
        raise
    return sock


def _connect_waiting(sock: socket.socket, address: str, timeout: float | None) -> None:
    """``sock.connect(address)``, waiting up to ``timeout`` seconds for room in the
    listener's backlog: a socket with a timeout is non-blocking underneath, and a full
    ``AF_UNIX`` backlog then fails at once (``EAGAIN``) where a blocking connect waits."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the listener at {address!r} had no room for a connection within {timeout} s"
                ) from None
            time.sleep(0.005)


# -- messages ---------------------------------------------------------------------------
def message_pieces(layout: dict, fds: Sequence[int]) -> list[tuple[bytes, list[int]]]:
    """The pieces :func:`send_layout` sends for one message, in order: ``(bytes, [])`` for
    the header and payload, then ``(b"F", batch)`` for each batch of descriptors. A sender
    on a non-blocking socket sends them one by one (a batch is one byte, so it goes whole or
    not at all); the caller still owns ``fds``."""
    payload = json.dumps(layout, separators=(",", ":")).encode()
    pieces = [(_HEADER.pack(_MAGIC, len(payload), len(fds)) + payload, [])]
    for start in range(0, len(fds), _FDS_PER_BATCH):
        pieces.append((b"F", list(fds[start : start + _FDS_PER_BATCH])))
    return pieces


def send_layout(
    sock: socket.socket,
    layout: dict,
    fds: Sequence[int],
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> None:
    """Send ``layout`` and ``fds`` as one message (the caller still owns ``fds``).

    ``TimeoutError`` when the peer has not taken the whole message within ``timeout``
    seconds (``None``: wait forever); the connection is then out of step (close it)."""
    timeout = _check_timeout(timeout)
    with _deadline(sock, timeout, "sending a jaxbuf layout") as arm:
        for data, batch in message_pieces(layout, fds):
            arm()
            if batch:
                socket.send_fds(sock, [data], batch)
            else:
                sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int, arm: Callable[[], None]) -> bytes:
    parts, left = [], size
    while left:
        arm()
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError(f"socket closed after {size - left} of {size} bytes")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _recv_fd_batch(
    sock: socket.socket, count: int, arm: Callable[[], None], held: list[int]
) -> None:
    """One ``b"F"`` byte and the ``count`` descriptors attached to it (close-on-exec),
    appended to ``held``.

    The wait for the batch may be interrupted; receiving it and recording it in ``held``
    is one step an interrupt cannot split (a descriptor received but not recorded would
    leak and pin the peer's memory): the batch is read only once the socket is readable,
    without blocking, with interrupts held back."""
    arm()
    # poll, not select: select() refuses a descriptor numbered 1024 or more.
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    timeout = sock.gettimeout()
    if not poller.poll(None if timeout is None else math.ceil(timeout * 1000)):
        raise TimeoutError
    itemsize = array.array("i").itemsize
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0) | socket.MSG_DONTWAIT
    fds: list[int] = []
    with deferred_interrupts():
        data, ancillary, msg_flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(count * itemsize), flags)
        for level, kind, cmsg in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(cmsg[: len(cmsg) - len(cmsg) % itemsize])
                fds.extend(received)
        held.extend(fds)
    if data != b"F" or msg_flags & getattr(socket, "MSG_CTRUNC", 0) or len(fds) != count:
        if not data:
            raise ConnectionError("socket closed while receiving descriptors")
        raise ValueError(
            f"malformed descriptor batch: expected {count} descriptors with b'F', got "
            f"{len(fds)} with {data!r} (flags {msg_flags:#x})"
        )


def recv_layout(
    sock: socket.socket,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    held_chunks: int = 0,
    held: list[int] | None = None,
) -> tuple[dict, list[int]]:
    """Receive one message from :func:`send_layout`: ``(layout, fds)``; the caller owns
    the descriptors (on error, none is left open).

    The payload may be as large as a layout of its descriptors' chunks and ``held_chunks``
    more needs (the chunks the receiver maps already, which an update lists without a
    descriptor; a first import holds none): a larger one is refused with ``ValueError``
    before it is read, so a peer cannot make the receiver parse, and hold, more.

    With ``held``, every descriptor is appended there the moment it is received, and
    stays there on error too: the caller owns them from that instant, whatever interrupts
    it (a ``KeyboardInterrupt`` cannot leak one), and closes or hands them over.

    Checks the framing only (header, JSON object, descriptor batches):
    :class:`~jaxbuf.sharing.ImportedBuffer` validates the layout itself. A malformed message
    raises ``ValueError``; the payload is parsed before any descriptor is accepted, so a bad
    one leaves the descriptors queued in the socket (closing it drops them). ``TimeoutError``
    after ``timeout`` seconds for the whole message (``None``: wait forever),
    ``ConnectionError`` when the peer hangs up. After any error the connection is out of
    step: close it.
    """
    timeout = _check_timeout(timeout)
    if isinstance(held_chunks, bool) or not isinstance(held_chunks, int) or held_chunks < 0:
        raise ValueError(f"held_chunks must be a non-negative int, got {held_chunks!r}")
    owned = held is None
    received: list[int] = [] if held is None else held
    first = len(received)
    with _deadline(sock, timeout, "receiving a jaxbuf layout") as arm:
        magic, payload_size, count = _HEADER.unpack(_recv_exact(sock, _HEADER.size, arm))
        if magic != _MAGIC or payload_size > _MAX_PAYLOAD or count > _MAX_FDS:
            raise ValueError(
                f"not a jaxbuf layout message (header {magic!r}, {payload_size} bytes, "
                f"{count} descriptors)"
            )
        needed = _LAYOUT_BYTES + 2 * _ROW_BYTES * (count + held_chunks)
        if payload_size > needed:
            raise ValueError(
                f"a jaxbuf layout of {count} sent and {held_chunks} held chunk(s) needs at "
                f"most {needed} bytes; the peer announced {payload_size}"
            )
        payload = _recv_exact(sock, payload_size, arm)
        try:
            layout = json.loads(payload.decode("utf-8"))  # never an encoding guessed
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"malformed jaxbuf layout message: {error}") from None
        if not isinstance(layout, dict):
            raise ValueError(f"malformed jaxbuf layout message: not a JSON object: {layout!r:.100}")
        try:
            while len(received) - first < count:
                batch = min(_FDS_PER_BATCH, count - (len(received) - first))
                _recv_fd_batch(sock, batch, arm, received)
        except BaseException:
            if owned:
                _close_all(received)
            raise
    return layout, received[first:]


def _close_all(fds: Sequence[int]) -> None:
    """Close every descriptor; the first error is raised after trying all."""
    first: OSError | None = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as error:
            first = first or error
    if first is not None:
        raise first
