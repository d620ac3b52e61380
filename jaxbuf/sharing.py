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
"""

from __future__ import annotations

import array
import json
import os
import secrets
import socket
import struct
import warnings
from collections.abc import Sequence
from typing import Any

from jaxbuf._intervals import IntervalSet
from jaxbuf._lifetime import release_when_collected
from jaxbuf._segments import SegmentedReservation
from jaxbuf.devices import Device, as_device
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.views import BufferView

__all__ = ["ImportedBuffer", "export_layout", "recv_buffer", "recv_layout", "send_buffer",
           "send_layout"]  # fmt: skip

LAYOUT_VERSION = 1
_MAGIC = b"JXB1"
_HEADER = struct.Struct("!4sQI")  # magic, payload bytes, descriptor count
_FDS_PER_BATCH = 250
_MAX_PAYLOAD = 1 << 30


# -- the owner side ---------------------------------------------------------------------
def _owner_token(buffer: Any) -> str:
    """A random name for one reservation of the owner: layouts of different buffers (or of
    a buffer freed and another created at the same address) never mix."""
    token = getattr(buffer, "_sharing_token", None)
    if token is None:
        token = buffer._sharing_token = f"{os.getpid()}-{secrets.token_hex(8)}"
    return token


def export_layout(tensor: Any, since: dict | None = None) -> tuple[dict, list[int]]:
    """The layout of ``tensor`` and new descriptors for its chunks.

    Returns ``(layout, fds)``: ``layout`` is a JSON-able dict (``reserved_size``,
    ``granularity``, ``segment_capacities``, ``segment_offsets``, ``committed_sizes``,
    ``device``, ``all_chunks`` as ``[offset, size, chunk_id]`` of every mapped chunk, and
    ``chunks``, the ones whose descriptors ``fds`` carries, in the same order). The caller
    owns ``fds`` and closes them (:func:`send_buffer` does).

    With ``since`` (a layout this function returned earlier for the same tensor), only
    chunks that are not in ``since`` get a descriptor. The importer must have received
    ``since`` (or a later layout) for that to be complete.

    Raises ``ValueError`` when ``since`` belongs to another buffer, and ``DriverError``
    when a chunk cannot be exported (no descriptor is left open then).
    """
    buffer = tensor._live_buffer()
    token = _owner_token(buffer)
    known: set[int] = set()
    if since is not None:
        if not isinstance(since, dict) or since.get("owner") != token:
            raise ValueError(
                "since must be a layout exported from this same buffer, got one of "
                f"owner {since.get('owner') if isinstance(since, dict) else since!r}"
            )
        known = {int(chunk[2]) for chunk in since["all_chunks"]}
    records = buffer.chunk_records()
    device: Device = tensor.device
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
    }
    driver = tensor.driver
    fds: list[int] = []
    try:
        driver.ensure_context(device.index)
        for offset, size, handle, chunk_id in records:
            if chunk_id in known:
                continue
            fds.append(driver.export_handle(handle))
            layout["chunks"].append([offset, size, chunk_id])
    except BaseException:
        _close_all(fds)
        raise
    return layout, fds


def send_layout(sock: socket.socket, layout: dict, fds: Sequence[int]) -> None:
    """Send ``layout`` and ``fds`` as one message (the caller still owns ``fds``)."""
    payload = json.dumps(layout, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(_MAGIC, len(payload), len(fds)) + payload)
    for start in range(0, len(fds), _FDS_PER_BATCH):
        socket.send_fds(sock, [b"F"], list(fds[start:start + _FDS_PER_BATCH]))


def send_buffer(sock: socket.socket, tensor: Any, since: dict | None = None) -> dict:
    """Export ``tensor`` (:func:`export_layout`) and send it over the Unix socket ``sock``.

    Waits for the owner's pending device work first (a ``zero_new`` memset), so the
    importer reads settled bytes. Returns the layout sent: pass it as ``since`` next time
    to send only new chunks. The descriptors are closed here in every case.
    """
    layout, fds = export_layout(tensor, since)
    try:
        tensor.driver.synchronize(tensor.device.index)
        send_layout(sock, layout, fds)
    finally:
        _close_all(fds)
    return layout


# -- the importer side ------------------------------------------------------------------
def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(left)
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


def recv_layout(sock: socket.socket) -> tuple[dict, list[int]]:
    """Receive one message from :func:`send_layout`: ``(layout, fds)``; the caller owns
    the descriptors (on error, none is left open)."""
    magic, payload_size, count = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != _MAGIC or payload_size > _MAX_PAYLOAD:
        raise ValueError(f"not a jaxbuf layout message (header {magic!r}, {payload_size} bytes)")
    payload = _recv_exact(sock, payload_size)
    fds: list[int] = []
    try:
        while len(fds) < count:
            fds.extend(_recv_fd_batch(sock, min(_FDS_PER_BATCH, count - len(fds))))
        layout = json.loads(payload)
    except BaseException:
        _close_all(fds)
        raise
    return layout, fds


def recv_buffer(
    sock: socket.socket, device: Any = None, driver: VmmDriver | None = None
) -> ImportedBuffer:
    """Receive a buffer sent by :func:`send_buffer` and map it: an :class:`ImportedBuffer`.

    ``device``: where the importer uses the memory (default: the owner's device, e.g.
    ``"cuda:0"``). On CUDA it may be another GPU than the one holding the memory
    (``"cuda:1"``), when that GPU has peer access to it.
    """
    layout, fds = recv_layout(sock)
    return ImportedBuffer(layout, fds, device=device, driver=driver)


class ImportedBuffer(SegmentedReservation):
    """Another process's :class:`~jaxbuf.ExtensibleTensor`, mapped into this one.

    It owns its reservation (the owner's ``reserved_size``) and maps each received chunk at
    the owner's offset, so segment ``i`` starts at ``base_ptr + segment_offsets[i]`` here
    as there. Views (:meth:`segment_view`, :meth:`full_view`) are zero-copy, as the
    owner's are.

    Invariants between calls: every chunk in ``_chunks`` is mapped and granted to
    :attr:`device`; a segment's committed size only claims bytes those chunks cover; no
    received descriptor stays open (each chunk's is closed once mapped: no descriptor per
    chunk). Not thread-safe.

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
            if device is None:
                device = layout["device"]
            self._device = as_device(device)
            if self._device.platform != layout["platform"]:
                raise ValueError(
                    f"device {self._device} cannot import memory of platform "
                    f"{layout['platform']!r}"
                )
            self._driver = get_vmm_driver(self._device) if driver is None else driver
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
    def refresh(self, sock: socket.socket) -> None:
        """Receive the owner's next :func:`send_buffer` message and :meth:`update`."""
        layout, fds = recv_layout(sock)
        self.update(layout, fds)

    def update(self, layout: dict, fds: Sequence[int]) -> None:
        """Follow the owner to ``layout``: unmap chunks it no longer has, map the chunks
        of ``layout["chunks"]`` (descriptors ``fds``) that are not mapped yet, and take its
        committed sizes. Closes ``fds`` in every case.

        On failure the chunks mapped so far stay (each mapped and granted), and every
        segment keeps the larger of its old and new committed size that the mapped chunks
        cover (else 0), so a view never reaches unmapped memory.
        """
        try:
            self._check_alive()
            _check_layout(layout, len(fds))
            if layout["owner"] != self._owner:
                raise ValueError(
                    f"layout of owner {layout['owner']!r} does not belong to this import "
                    f"(owner {self._owner!r})"
                )
            if (
                int(layout["reserved_size"]) != self._reserved_size
                or [int(c) for c in layout["segment_capacities"]] != self._segment_capacities
            ):
                raise ValueError("the owner's reservation or segments changed shape")
            live = {int(chunk[2]) for chunk in layout["all_chunks"]}
            offered = {int(chunk[2]) for chunk in layout["chunks"]}
            missing = live - offered - set(self._chunks)
            if missing:
                raise ValueError(
                    f"layout lists chunks {sorted(missing)} that were never sent here (was "
                    "it exported with since= a layout this importer did not receive?)"
                )
            for offset, size, _ in layout["all_chunks"]:
                if not 0 <= offset < offset + size <= self._reserved_size:
                    raise ValueError(f"chunk [{offset}, +{size}) is outside the reservation")
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
        errors: list[BaseException] = []
        for chunk_id in list(self._chunks):
            try:
                self._unmap_chunk(chunk_id)
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
        self._committed = [0] * len(self._committed)
        if not errors:
            try:
                driver.free_reserved(self.base_ptr, self._reserved_size)
                self.base_ptr = 0
            except Exception as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"ImportedBuffer.close: also failed: {other!r}")
            raise errors[0]

    def __enter__(self) -> ImportedBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_alive(self) -> None:
        if not self.base_ptr:
            raise RuntimeError("the ImportedBuffer is closed")

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "base_ptr", 0):
            _release(self.close, "an ImportedBuffer")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"committed={self._committed}"
        return (f"ImportedBuffer(device={getattr(self, '_device', None)}, "
                f"chunks={len(self._chunks)}, {state})")  # fmt: skip


def _check_layout(layout: Any, num_fds: int) -> None:
    if not isinstance(layout, dict) or layout.get("version") != LAYOUT_VERSION:
        raise ValueError(f"not a jaxbuf layout of version {LAYOUT_VERSION}: {layout!r:.200}")
    if len(layout["chunks"]) != num_fds:
        raise ValueError(
            f"layout names {len(layout['chunks'])} chunks but {num_fds} descriptors came"
        )
    if len(layout["committed_sizes"]) != len(layout["segment_capacities"]):
        raise ValueError("layout: committed_sizes and segment_capacities differ in length")


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
