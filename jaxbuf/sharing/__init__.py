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

Lifetime of an import: arrays exported from an :class:`ImportedBuffer`'s views keep its
mappings alive; :meth:`ImportedBuffer.close` means "I am done" (no new views or exports), and
the chunks are unmapped when the last such array is gone, at once when there is none
(:attr:`ImportedBuffer.live_exports`, :attr:`ImportedBuffer.released`).

Modules: :mod:`jaxbuf.sharing._wire` (framing, descriptors, timeouts, peer credentials),
:mod:`jaxbuf.sharing._layout` (exporting a layout, validating a received one),
:mod:`jaxbuf.sharing._imported` (:class:`ImportedBuffer`); this module joins them
(:func:`send_buffer`, :func:`recv_buffer`). Import the public names from here.

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

import socket
from collections.abc import Iterable
from typing import Any

from jaxbuf.devices import as_device
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.sharing._imported import ImportedBuffer
from jaxbuf.sharing._layout import LAYOUT_VERSION, export_layout
from jaxbuf.sharing._wire import (
    DEFAULT_TIMEOUT,
    PeerCredentials,
    _allowed_uids,
    _check_peer,
    _check_timeout,
    _close_all,
    connect_unix,
    listen_unix,
    peer_credentials,
    recv_layout,
    send_layout,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "LAYOUT_VERSION",
    "ImportedBuffer",
    "PeerCredentials",
    "connect_unix",
    "export_layout",
    "listen_unix",
    "peer_credentials",
    "recv_buffer",
    "recv_layout",
    "send_buffer",
    "send_layout",
]


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
        tensor.driver.synchronize(as_device(tensor.device).index)
        send_layout(sock, layout, fds, timeout=timeout)
    finally:
        _close_all(fds)
    return layout


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
