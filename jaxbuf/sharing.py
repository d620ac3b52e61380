"""Sharing an :class:`~jaxbuf.ExtensibleTensor`'s memory with other processes, zero-copy.

The owner exports each committed chunk as a POSIX file descriptor (CUDA:
``cuMemExportToShareableHandle``; CPU: the chunk's ``memfd``) plus a JSON-able *layout*
(reservation size, segments, committed sizes, chunk offsets). Another process receives both
over a Unix socket (``SCM_RIGHTS``), reserves address space of the same size and maps every
chunk at the same offset: :class:`ImportedBuffer`. Both processes then read and write the
same bytes. When the owner grows, it sends again with ``since=`` the previous layout, which
carries descriptors for the new chunks only, and the importer maps just those
(:meth:`ImportedBuffer.refresh`).

Protocol (one message, any ``AF_UNIX`` stream socket): a 16-byte header
(``b"JXB1"``, payload length, descriptor count), the layout as UTF-8 JSON, then the
descriptors in batches of at most 250 (the kernel's ``SCM_MAX_FD`` is 253), each batch
attached to one ``b"F"`` byte. Descriptors are received close-on-exec.

Trust model
-----------
A descriptor is a capability: whoever receives the descriptors can read the whole buffer and,
unless it was sent ``read_only=True``, write it, and nothing the owner does later takes that
back. A peer that received descriptors (or left them unread in its socket) keeps that memory
alive until it closes them and unmaps it: that is how descriptors work; the owner's ``free()``
only drops the owner's share. So check who is at the other end: :func:`send_buffer` and
:func:`recv_buffer` refuse a peer whose uid (``SO_PEERCRED``, :func:`peer_credentials`) is not
in ``allowed_uids`` (default: this process's effective uid only), and :func:`listen_unix`
creates its socket file with mode 0600.

What a hostile peer cannot do:

- truncate the memory under the owner (or under an importer) so that an access dies with
  ``SIGBUS``: CPU chunks are memfds sealed ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``, and
  an importer refuses a descriptor that is not sealed against shrinking (CUDA allocations
  cannot be resized at all);
- make an importer map outside its reservation or over its own memory: the whole received
  layout is validated before anything is mapped, and a malformed message of any kind (bad
  JSON, wrong types, missing keys, a chunk not in ``all_chunks``, overlapping or misaligned
  chunks, committed sizes no chunk backs, as many descriptors as chunks) raises a
  ``ValueError`` naming the entry, with every received descriptor closed;
- block the other side forever: sending and receiving take ``timeout`` (seconds, default
  :data:`DEFAULT_TIMEOUT`; ``None`` blocks), and raise ``TimeoutError`` when the message did
  not get through in time. Descriptors already queued in the socket stay there, pinning their
  chunks, until the peer reads them or the socket is closed: after a ``TimeoutError`` (or any
  error in the middle of a message) the connection is out of step, close it.

Read-only export (CPU only): ``send_buffer(..., read_only=True)`` sends ``O_RDONLY``
descriptors (reopened through ``/proc/self``); the importer maps them ``PROT_READ`` and cannot
add write access (``mprotect`` fails, ``write``/``ftruncate``/``fallocate`` on the descriptor
fail), and :attr:`ImportedBuffer.read_only` is True: its views give numpy arrays that are not
writeable, but torch tensors and DLPack consumers get no such flag, and a write through them
faults (``SIGSEGV``). The chunk's file is mode 0600, so a
peer of another uid cannot reopen it read-write either; a peer running as the owner's uid (or
root) can reopen ``/proc/<pid>/fd/N`` read-write, so against it read-only guards against
mistakes, not malice: give untrusted peers their own uid. CUDA cannot export read-only
(``cuMemExportToShareableHandle`` grants the importer read/write; which access an importer
grants itself with ``cuMemSetAccess`` is its own choice), so ``read_only=True`` raises
``ValueError`` there.

Ordering across processes is the caller's: :func:`send_buffer` waits for the owner's
pending device work first; after that, who writes when is up to the two programs.

Between two messages the importer keeps the chunks it has: when the owner drops chunks
(``release_physical``, ``defragment``), the importer's pages stay valid (the memory lives
while either side maps it) but stop being the owner's bytes until the next
:meth:`ImportedBuffer.refresh`. Send after every grow, release or defragment.

Chunk identity: each chunk of a buffer has a number that is never reused (a chunk recreated
at the same offset, by ``release_physical`` and a grow or by ``defragment``, gets a new one),
so the importer unmaps chunks the owner no longer has and maps their replacements.

Examples
--------
>>> import socket, jaxbuf
>>> from jaxbuf.sharing import send_buffer, recv_buffer
>>> owner = jaxbuf.ExtensibleTensor(8 << 20, device="cpu")
>>> owner.resize_per_segment_(4096)
>>> a, b = socket.socketpair()
>>> layout = send_buffer(a, owner)       # in the owner process
>>> imported = recv_buffer(b)            # in the importer process (here: the same one)
>>> imported.segment_view(0).to_numpy()[0] = 7
>>> int(owner.segment_view(0).to_numpy()[0])
7
>>> imported.close(); owner.free(); a.close(); b.close()

Two unrelated processes meet at a socket file (the owner checks the peer's uid):

>>> server = listen_unix("/run/user/1000/jaxbuf.sock")             # doctest: +SKIP
>>> conn, _ = server.accept()                                       # doctest: +SKIP
>>> send_buffer(conn, owner, read_only=True, allowed_uids={1000})   # doctest: +SKIP
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import secrets
import socket
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from jaxbuf._errors import Cleanup
from jaxbuf._intervals import IntervalSet
from jaxbuf._lifetime import release_when_collected
from jaxbuf._resolve import resolve
from jaxbuf._segments import SegmentedReservation
from jaxbuf.devices import Device, as_device
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.views import BufferView

__all__ = [
    "DEFAULT_TIMEOUT",
    "ImportedBuffer",
    "PeerCredentials",
    "export_layout",
    "listen_unix",
    "peer_credentials",
    "recv_buffer",
    "recv_layout",
    "send_buffer",
    "send_layout",
]

LAYOUT_VERSION = 1
_MAGIC = b"JXB1"
_HEADER = struct.Struct("!4sQI")  # magic, payload bytes, descriptor count
_FDS_PER_BATCH = 250
_MAX_PAYLOAD = 1 << 30
_MAX_FDS = 1 << 20  # a header asking for more is not from send_layout
_MAX_BYTES = 1 << 62  # sizes and offsets of a layout (ctypes passes them as size_t)
DEFAULT_TIMEOUT = 60.0
"""Seconds that :func:`send_buffer` / :func:`recv_buffer` (and the lower-level calls) wait
for a whole message by default; ``timeout=None`` waits forever."""
_NOT_COPYABLE = (
    "an ImportedBuffer cannot be copied or pickled: it owns its reservation and the mappings "
    "of the received chunks, and a copy would unmap and free them a second time (use the one "
    "object, or have the owner send_buffer to each importer)"
)


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
    removes ``path`` when done."""
    path = os.fspath(path)
    private = tempfile.mkdtemp(prefix=".jaxbuf-", dir=os.path.dirname(os.path.abspath(path)))
    staged = os.path.join(private, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(staged)
        os.chmod(staged, 0o600)
        sock.listen(backlog)
        os.link(staged, path)  # the last step: nothing to undo at path if it fails
    except BaseException:
        sock.close()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        os.rmdir(private)
    return sock


# -- the owner side ---------------------------------------------------------------------
def _owner_token(buffer: Any) -> str:
    """A random name for one reservation of the owner: layouts of different buffers (or of
    a buffer freed and another created at the same address) never mix."""
    token = getattr(buffer, "_sharing_token", None)
    if token is None:
        token = buffer._sharing_token = f"{os.getpid()}-{secrets.token_hex(8)}"
    return token


def export_layout(
    tensor: Any, since: dict | None = None, *, read_only: bool = False
) -> tuple[dict, list[int]]:
    """The layout of ``tensor`` and new descriptors for its chunks.

    Returns ``(layout, fds)``: ``layout`` is a JSON-able dict (``reserved_size``,
    ``granularity``, ``segment_capacities``, ``segment_offsets``, ``committed_sizes``,
    ``device``, ``all_chunks`` as ``[offset, size, chunk_id]`` of every mapped chunk, and
    ``chunks``, the ones whose descriptors ``fds`` carries, in the same order). The caller
    owns ``fds`` and closes them (:func:`send_buffer` does).

    With ``since`` (a layout this function returned earlier for the same tensor), only
    chunks that are not in ``since`` get a descriptor. The importer must have received
    ``since`` (or a later layout) for that to be complete.

    ``read_only``: the descriptors are read-only (CPU only; see the module docstring) and
    the layout says so (``"read_only": true``); ``since`` must have been exported the same way.

    Raises ``ValueError`` when ``since`` belongs to another buffer or was exported with
    another ``read_only``, or when the driver cannot export read-only (CUDA), and
    ``DriverError`` when a chunk cannot be exported (no descriptor is left open then).
    """
    if not isinstance(read_only, bool):
        raise TypeError(f"read_only must be a bool, got {read_only!r}")
    buffer = tensor._live_buffer()
    token = _owner_token(buffer)
    driver = tensor.driver
    device: Device = tensor.device
    export = driver.export_handle
    if read_only:
        export = getattr(driver, "export_read_only_handle", None)
        if export is None:
            raise ValueError(
                f"read_only=True is not supported on {device}: the {device.platform} driver "
                "cannot make a read-only descriptor (CUDA's cuMemExportToShareableHandle "
                "always grants the importer read/write access)"
            )
    known: set[int] = set()
    if since is not None:
        if not isinstance(since, dict) or since.get("owner") != token:
            raise ValueError(
                "since must be a layout exported from this same buffer, got one of "
                f"owner {since.get('owner') if isinstance(since, dict) else since!r}"
            )
        if since.get("read_only", False) != read_only:
            raise ValueError(
                f"since was exported with read_only={since.get('read_only', False)}, this "
                f"export asks for read_only={read_only}: an importer keeps one access mode"
            )
        known = {int(chunk[2]) for chunk in since["all_chunks"]}
    records = buffer.chunk_records()
    layout = {
        "version": LAYOUT_VERSION,
        "owner": token,
        "platform": device.platform,
        "device": str(device),
        "device_index": device.index,
        "reserved_size": buffer.reserved_size,
        "granularity": buffer.granularity,
        "segment_capacities": tensor.segment_capacities,
        "segment_offsets": tensor.segment_offsets,
        "committed_sizes": tensor.committed_sizes,
        "all_chunks": [[offset, size, chunk_id] for offset, size, _, chunk_id in records],
        "chunks": [],
        "read_only": read_only,
    }
    fds: list[int] = []
    try:
        driver.ensure_context(device.index)
        for offset, size, handle, chunk_id in records:
            if chunk_id in known:
                continue
            fds.append(export(handle))
            layout["chunks"].append([offset, size, chunk_id])
    except BaseException:
        _close_all(fds)
        raise
    return layout, fds


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
    payload = json.dumps(layout, separators=(",", ":")).encode()
    with _deadline(sock, timeout, "sending a jaxbuf layout") as arm:
        arm()
        sock.sendall(_HEADER.pack(_MAGIC, len(payload), len(fds)) + payload)
        for start in range(0, len(fds), _FDS_PER_BATCH):
            arm()
            socket.send_fds(sock, [b"F"], list(fds[start : start + _FDS_PER_BATCH]))


def send_buffer(
    sock: socket.socket,
    tensor: Any,
    since: dict | None = None,
    *,
    read_only: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
    allowed_uids: Iterable[int] | None = None,
) -> dict:
    """Export ``tensor`` (:func:`export_layout`) and send it over the Unix socket ``sock``.

    First checks the peer (:func:`peer_credentials`): ``PermissionError``, before anything
    is exported, unless its uid is in ``allowed_uids`` (default: this process's effective
    uid only). Waits for the owner's pending device work (a ``zero_new`` memset), so the
    importer reads settled bytes. Returns the layout sent: pass it as ``since`` next time
    to send only new chunks. ``read_only``: see :func:`export_layout`. ``timeout``: seconds
    for the whole message (``None``: wait forever), then ``TimeoutError``.

    The descriptors are closed here in every case; those the peer already has (or that are
    queued in the socket) keep their chunks alive until it closes them (module docstring).
    """
    timeout = _check_timeout(timeout)
    allowed = _allowed_uids(allowed_uids)
    _check_peer(sock, allowed)
    layout, fds = export_layout(tensor, since, read_only=read_only)
    try:
        tensor.driver.synchronize(tensor.device.index)
        send_layout(sock, layout, fds, timeout=timeout)
    finally:
        _close_all(fds)
    return layout


# -- the importer side ------------------------------------------------------------------
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


def _recv_fd_batch(sock: socket.socket, count: int) -> list[int]:
    """One ``b"F"`` byte and the ``count`` descriptors attached to it (close-on-exec)."""
    itemsize = array.array("i").itemsize
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    data, ancillary, msg_flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(count * itemsize), flags)
    fds: list[int] = []
    for level, kind, cmsg in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(cmsg[: len(cmsg) - len(cmsg) % itemsize])
            fds.extend(received)
    if data != b"F" or msg_flags & getattr(socket, "MSG_CTRUNC", 0) or len(fds) != count:
        _close_all(fds)
        if not data:
            raise ConnectionError("socket closed while receiving descriptors")
        raise ValueError(
            f"malformed descriptor batch: expected {count} descriptors with b'F', got "
            f"{len(fds)} with {data!r} (flags {msg_flags:#x})"
        )
    return fds


def recv_layout(
    sock: socket.socket, *, timeout: float | None = DEFAULT_TIMEOUT
) -> tuple[dict, list[int]]:
    """Receive one message from :func:`send_layout`: ``(layout, fds)``; the caller owns
    the descriptors (on error, none is left open).

    Checks the framing only (header, JSON object, descriptor batches): :class:`ImportedBuffer`
    validates the layout itself. A malformed message raises ``ValueError``; the payload is
    parsed before any descriptor is accepted, so a bad one leaves the descriptors queued in
    the socket (closing it drops them). ``TimeoutError`` after ``timeout`` seconds for the
    whole message (``None``: wait forever), ``ConnectionError`` when the peer hangs up. After
    any error the connection is out of step: close it.
    """
    timeout = _check_timeout(timeout)
    fds: list[int] = []
    with _deadline(sock, timeout, "receiving a jaxbuf layout") as arm:
        magic, payload_size, count = _HEADER.unpack(_recv_exact(sock, _HEADER.size, arm))
        if magic != _MAGIC or payload_size > _MAX_PAYLOAD or count > _MAX_FDS:
            raise ValueError(
                f"not a jaxbuf layout message (header {magic!r}, {payload_size} bytes, "
                f"{count} descriptors)"
            )
        payload = _recv_exact(sock, payload_size, arm)
        try:
            layout = json.loads(payload)
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"malformed jaxbuf layout message: {error}") from None
        if not isinstance(layout, dict):
            raise ValueError(f"malformed jaxbuf layout message: not a JSON object: {layout!r:.100}")
        try:
            while len(fds) < count:
                arm()
                fds.extend(_recv_fd_batch(sock, min(_FDS_PER_BATCH, count - len(fds))))
        except BaseException:
            _close_all(fds)
            raise
    return layout, fds


def recv_buffer(
    sock: socket.socket,
    device: Any = None,
    driver: VmmDriver | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    allowed_uids: Iterable[int] | None = None,
) -> ImportedBuffer:
    """Receive a buffer sent by :func:`send_buffer` and map it: an :class:`ImportedBuffer`.

    ``device``: where the importer uses the memory (default: the owner's device, e.g.
    ``"cuda:0"``). On CUDA it may be another GPU than the one holding the memory
    (``"cuda:1"``), when that GPU has peer access to it.

    ``allowed_uids``: the sender's uid must be one of them (default: this process's
    effective uid only), else ``PermissionError`` before anything is read. ``timeout``:
    seconds for the whole message (``None``: wait forever), then ``TimeoutError``.
    Malformed messages and layouts raise ``ValueError`` (see the module docstring).
    """
    timeout = _check_timeout(timeout)
    _check_peer(sock, _allowed_uids(allowed_uids))
    layout, fds = recv_layout(sock, timeout=timeout)
    return ImportedBuffer(layout, fds, device=device, driver=driver)


class ImportedBuffer(SegmentedReservation):
    """Another process's :class:`~jaxbuf.ExtensibleTensor`, mapped into this one.

    It owns its reservation (the owner's ``reserved_size``) and maps each received chunk at
    the owner's offset, so segment ``i`` starts at ``base_ptr + segment_offsets[i]`` here
    as there. Views (:meth:`segment_view`, :meth:`full_view`) are zero-copy, as the
    owner's are.

    Invariants between calls: every chunk in ``_chunks`` is mapped and granted to
    :attr:`device`, inside the reservation, overlapping no other; a segment's committed size
    only claims bytes those chunks cover; no received descriptor stays open (each chunk's is
    closed once mapped: no descriptor per chunk); with :attr:`read_only`, every chunk came
    from a read-only descriptor and is mapped read-only. Every layout is validated whole
    before anything is mapped (see the module docstring). Not thread-safe.

    Not copyable or picklable (``TypeError``): it owns its mappings, which a copy would
    unmap a second time.

    Parameters
    ----------
    layout, fds : from :func:`export_layout` / :func:`recv_layout`
        The descriptors are taken over: closed here whether the import succeeds or not.
    device : device spec, optional
        Where the memory is used; default the owner's device.
    driver : VmmDriver, optional
        Default: ``jaxbuf.drivers.get_vmm_driver(device)``.
    """

    def __init__(
        self,
        layout: dict,
        fds: Sequence[int],
        device: Any = None,
        driver: VmmDriver | None = None,
    ) -> None:
        self.base_ptr = 0
        self._ready_event: Any = None
        self._chunks: dict[int, tuple[int, int, Any]] = {}  # chunk_id -> (offset, size, h)
        try:
            _check_layout(layout, len(fds))
            self._read_only: bool = layout.get("read_only", False)
            if device is None:
                device = layout["device"]
            self._device = as_device(device)
            if self._device.platform != layout["platform"]:
                raise ValueError(
                    f"device {self._device} cannot import memory of platform "
                    f"{layout['platform']!r}"
                )
            self._device, self._driver = resolve(self._device, driver)
            self._owner = layout["owner"]
            self._reserved_size = int(layout["reserved_size"])
            self._segment_capacities = [int(c) for c in layout["segment_capacities"]]
            self._segment_offsets = [int(o) for o in layout["segment_offsets"]]
            self._committed = [0] * len(self._segment_capacities)
            driver_granularity = self._driver.granularity(self._device.index)
            alignment = max(int(layout["granularity"]), driver_granularity)
            if alignment % driver_granularity or self._reserved_size % driver_granularity:
                raise ValueError(
                    f"the owner's granularity {layout['granularity']} and reservation "
                    f"{self._reserved_size} are not multiples of this device's "
                    f"granularity {driver_granularity}"
                )
            self._driver.ensure_context(self._device.index)
            self.base_ptr = self._driver.reserve(self._reserved_size, alignment)
        except BaseException:
            _close_all(fds)
            raise
        try:
            self.update(layout, fds)
        except BaseException:
            try:
                self.close()
            except Exception as error:  # noqa: BLE001 - the import error is the one raised
                warnings.warn(f"jaxbuf: cleaning up a failed import failed: {error!r}",
                              ResourceWarning, stacklevel=2)  # fmt: skip
            raise

    # -- updating ---------------------------------------------------------------------
    def refresh(self, sock: socket.socket, *, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Receive the owner's next :func:`send_buffer` message (within ``timeout``
        seconds, see :func:`recv_layout`) and :meth:`update`."""
        layout, fds = recv_layout(sock, timeout=timeout)
        self.update(layout, fds)

    def update(self, layout: dict, fds: Sequence[int]) -> None:
        """Follow the owner to ``layout``: unmap chunks it no longer has, map the chunks
        of ``layout["chunks"]`` (descriptors ``fds``) that are not mapped yet, and take its
        committed sizes. Closes ``fds`` in every case.

        A layout that is malformed or does not fit this import (another owner, reservation,
        segments or access mode; a chunk we hold listed at another place; a chunk neither
        held nor sent) raises ``ValueError`` before anything changes.

        On failure the chunks mapped so far stay (each mapped and granted), and every
        segment keeps the larger of its old and new committed size that the mapped chunks
        cover (else 0), so a view never reaches unmapped memory.
        """
        try:
            self._check_alive()
            _check_layout(layout, len(fds))
            if layout["owner"] != self._owner:
                raise ValueError(
                    f"layout of owner {layout['owner']!r:.100} does not belong to this import "
                    f"(owner {self._owner!r})"
                )
            if (
                layout["reserved_size"] != self._reserved_size
                or layout["segment_capacities"] != self._segment_capacities
                or layout["segment_offsets"] != self._segment_offsets
            ):
                raise ValueError("the owner's reservation or segments changed shape")
            if layout.get("read_only", False) != self._read_only:
                raise ValueError(
                    f"layout has read_only={layout.get('read_only', False)}, this import "
                    f"read_only={self._read_only}: the access mode cannot change"
                )
            for offset, size, chunk_id in layout["all_chunks"]:
                held = self._chunks.get(chunk_id)
                if held is not None and held[:2] != (offset, size):
                    raise ValueError(
                        f"layout: all_chunks entry {[offset, size, chunk_id]} puts chunk "
                        f"{chunk_id} at another place than where it is mapped here "
                        f"([{held[0]}, {held[1]}])"
                    )
            live = {chunk[2] for chunk in layout["all_chunks"]}
            offered = {chunk[2] for chunk in layout["chunks"]}
            missing = live - offered - set(self._chunks)
            if missing:
                raise ValueError(
                    f"layout lists chunks {sorted(missing)} that were never sent here (was "
                    "it exported with since= a layout this importer did not receive?)"
                )
        except BaseException:
            _close_all(fds)
            raise
        new_sizes = [int(s) for s in layout["committed_sizes"]]
        try:
            driver, index = self._driver, self._device.index
            driver.ensure_context(index)
            stale = [chunk_id for chunk_id in self._chunks if chunk_id not in live]
            if stale:
                # The device may still read the old chunks (this process's kernels).
                driver.synchronize(index)
                for chunk_id in stale:  # first: a replacement may overlap them
                    self._unmap_chunk(chunk_id)
            for (offset, size, chunk_id), fd in zip(layout["chunks"], fds):
                chunk_id = int(chunk_id)
                if chunk_id not in self._chunks:
                    self._map_chunk(chunk_id, int(offset), int(size), fd)
        finally:
            _close_all(fds)
            self._settle_committed(new_sizes)

    def _map_chunk(self, chunk_id: int, offset: int, size: int, fd: int) -> None:
        driver, index = self._driver, self._device.index
        ptr = self.base_ptr + offset
        handle = driver.import_handle(fd, size, index)
        try:
            # The driver's word, not the layout's: views must never offer writes into a
            # read-only mapping (a fault), nor claim read-only over a writable one.
            if getattr(handle, "read_only", False) != self._read_only:
                raise ValueError(
                    f"chunk {chunk_id} came with a "
                    f"{'read-only' if not self._read_only else 'writable'} descriptor but the "
                    f"layout says read_only={self._read_only}"
                )
            driver.map(ptr, size, handle)
        except BaseException:
            driver.release(handle)
            raise
        try:
            driver.set_access(ptr, size, index)
        except BaseException as error:
            try:
                driver.unmap(ptr, size)
                driver.release(handle)
            except Exception as rollback_error:  # noqa: BLE001 - reported as a note
                error.add_note(f"rollback failed too: {rollback_error!r}; the chunk stays "
                               "tracked and close() retries it")  # fmt: skip
                self._chunks[chunk_id] = (offset, size, handle)
            raise
        self._chunks[chunk_id] = (offset, size, handle)

    def _unmap_chunk(self, chunk_id: int) -> None:
        offset, size, handle = self._chunks[chunk_id]
        self._driver.unmap(self.base_ptr + offset, size)
        del self._chunks[chunk_id]
        self._driver.release(handle)

    def _settle_committed(self, new_sizes: list[int]) -> None:
        covered = IntervalSet()
        for offset, size, _ in self._chunks.values():
            covered.add(offset, offset + size)
        settled = []
        for start, old, new in zip(self._segment_offsets, self._committed, new_sizes):
            size = next((s for s in (new, old) if covered.covers(start, start + s)), 0)
            settled.append(size)
        self._committed = settled

    # -- views ------------------------------------------------------------------------
    def _live_base_ptr(self) -> int:
        self._check_alive()
        return self.base_ptr

    def full_view(self) -> BufferView:
        """Uint8 view over the whole reservation (only committed bytes may be touched)."""
        return self._view(0, self._reserved_size)

    # -- properties -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._reserved_size

    @property
    def num_physical_chunks(self) -> int:
        return len(self._chunks)

    @property
    def closed(self) -> bool:
        return not self.base_ptr

    @property
    def read_only(self) -> bool:
        """Whether the owner sent read-only descriptors: the chunks are mapped read-only
        here, so numpy arrays from views are not writeable, and a write through any other
        consumer (torch, DLPack) faults."""
        return self._read_only

    # -- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and release every chunk and free the reservation. Safe to call twice.

        Best effort: the first error is raised with the others as notes; what failed
        stays tracked, so a second call retries it.
        """
        if not self.base_ptr:
            return
        driver, index = self._driver, self._device.index
        driver.ensure_context(index)
        driver.synchronize(index)
        cleanup = Cleanup("ImportedBuffer.close")
        for chunk_id in list(self._chunks):
            cleanup.run(self._unmap_chunk, chunk_id)
        self._committed = [0] * len(self._committed)
        if not cleanup.errors and cleanup.run(
            driver.free_reserved, self.base_ptr, self._reserved_size
        ):
            self.base_ptr = 0
        cleanup.raise_first()

    def __enter__(self) -> ImportedBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __copy__(self) -> ImportedBuffer:
        raise TypeError(_NOT_COPYABLE)

    def __deepcopy__(self, memo: dict) -> ImportedBuffer:
        raise TypeError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPYABLE)

    def _check_alive(self) -> None:
        if not self.base_ptr:
            raise RuntimeError("the ImportedBuffer is closed")

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "base_ptr", 0):
            _release(self.close, "an ImportedBuffer")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"committed={self._committed}"
        if getattr(self, "_read_only", False):
            state += ", read-only"
        return (f"ImportedBuffer(device={getattr(self, '_device', None)}, "
                f"chunks={len(self._chunks)}, {state})")  # fmt: skip


_LAYOUT_KEYS = (
    "owner",
    "platform",
    "device",
    "reserved_size",
    "granularity",
    "segment_capacities",
    "segment_offsets",
    "committed_sizes",
    "all_chunks",
    "chunks",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layout_int(value: Any, name: str, minimum: int = 0) -> int:
    if not _is_int(value) or not minimum <= value < _MAX_BYTES:
        raise ValueError(f"layout: {name} must be an int in [{minimum}, 2**62), got {value!r:.100}")
    return value


def _layout_list(layout: dict, key: str) -> list:
    value = layout[key]
    if not isinstance(value, list):
        raise ValueError(f"layout: {key} must be a list, got {value!r:.100}")
    return value


def _chunk_entry(entry: Any, name: str) -> tuple[int, int, int]:
    if not (isinstance(entry, list) and len(entry) == 3 and all(map(_is_int, entry))):
        raise ValueError(
            f"layout: {name} must be [offset, size, chunk_id] ints, got {entry!r:.100}"
        )
    return entry[0], entry[1], entry[2]


def _check_layout(layout: Any, num_fds: int) -> None:
    """Validate a layout whole, before anything is mapped; ``ValueError`` naming the first bad
    entry. Afterwards: every documented key is present with its type (ints are ints, not
    bools), segments are ordered, disjoint and inside the reservation with committed sizes
    within their capacities; every ``all_chunks`` entry is aligned to ``granularity``,
    inside the reservation, overlaps no other and has a unique id; every ``chunks`` entry is
    one of ``all_chunks`` (once) with one descriptor each; and every committed prefix is
    backed by ``all_chunks``. Whether they fit *this* import is :meth:`ImportedBuffer.update`'s
    check."""
    version = layout.get("version") if isinstance(layout, dict) else None
    if not (_is_int(version) and version == LAYOUT_VERSION):
        raise ValueError(f"not a jaxbuf layout of version {LAYOUT_VERSION}: {layout!r:.200}")
    missing = [key for key in _LAYOUT_KEYS if key not in layout]
    if missing:
        raise ValueError(f"layout: missing key(s) {', '.join(missing)}")
    for key in ("owner", "platform", "device"):
        if not isinstance(layout[key], str):
            raise ValueError(f"layout: {key} must be a string, got {layout[key]!r:.100}")
    if not isinstance(layout.get("read_only", False), bool):
        raise ValueError(f"layout: read_only must be a bool, got {layout['read_only']!r:.100}")
    reserved = _layout_int(layout["reserved_size"], "reserved_size", 1)
    granularity = _layout_int(layout["granularity"], "granularity", 1)
    if reserved % granularity:
        raise ValueError(
            f"layout: reserved_size {reserved} is not a multiple of the granularity {granularity}"
        )
    columns = {
        key: [_layout_int(v, f"{key}[{i}]") for i, v in enumerate(_layout_list(layout, key))]
        for key in ("segment_capacities", "segment_offsets", "committed_sizes")
    }
    capacities, offsets, committed = columns.values()
    if not len(capacities) == len(offsets) == len(committed):
        raise ValueError(
            "layout: segment_capacities, segment_offsets and committed_sizes differ in length "
            f"({len(capacities)}, {len(offsets)}, {len(committed)})"
        )
    previous_end = 0
    for i, (offset, capacity, size) in enumerate(zip(offsets, capacities, committed)):
        if offset < previous_end or offset + capacity > reserved:
            raise ValueError(
                f"layout: segment {i} [{offset}, +{capacity}) overlaps segment {i - 1} or "
                f"leaves the reservation of {reserved} bytes"
            )
        if size > capacity:
            raise ValueError(
                f"layout: committed_sizes[{i}] = {size} exceeds the segment's capacity {capacity}"
            )
        previous_end = offset + capacity

    places: dict[int, tuple[int, int]] = {}  # chunk_id -> (offset, size)
    spans: list[tuple[int, int, str]] = []
    for i, entry in enumerate(_layout_list(layout, "all_chunks")):
        name = f"all_chunks[{i}] = {entry!r:.100}"
        offset, size, chunk_id = _chunk_entry(entry, name)
        if offset % granularity or size % granularity:
            raise ValueError(f"layout: {name} is not aligned to the granularity {granularity}")
        if offset < 0 or size <= 0 or offset + size > reserved or chunk_id < 0:
            raise ValueError(f"layout: {name} is outside the reservation of {reserved} bytes")
        if chunk_id in places:
            raise ValueError(f"layout: {name} repeats chunk id {chunk_id}")
        places[chunk_id] = (offset, size)
        spans.append((offset, offset + size, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"layout: {second} overlaps {first}")
    sent: set[int] = set()
    chunks = _layout_list(layout, "chunks")
    for i, entry in enumerate(chunks):
        name = f"chunks[{i}] = {entry!r:.100}"
        offset, size, chunk_id = _chunk_entry(entry, name)
        if places.get(chunk_id) != (offset, size):
            raise ValueError(f"layout: {name} is not listed in all_chunks")
        if chunk_id in sent:
            raise ValueError(f"layout: {name} is sent twice")
        sent.add(chunk_id)
    if len(chunks) != num_fds:
        raise ValueError(f"layout names {len(chunks)} chunks but {num_fds} descriptors came")
    backed = IntervalSet()
    for start, end, _ in spans:
        backed.add(start, end)
    for i, (offset, size) in enumerate(zip(offsets, committed)):
        if size and not backed.covers(offset, offset + size):
            raise ValueError(
                f"layout: committed_sizes[{i}] = {size} reaches bytes of segment {i} that no "
                "chunk of all_chunks backs"
            )


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
