"""Sharing against a hostile peer: every peer below is a real second process.

This file is also a script: ``python test_sharing_hostile.py ROLE ARGS...`` runs one side of a
conversation (see ``ROLES`` at the end). The tests make socket pairs, start the roles with
``subprocess`` (each gets its socket ends through ``pass_fds``) and assert that every process
that could die by a signal (SIGSEGV, SIGBUS) exits normally with code 0; the roles report what
happened as one JSON line on stdout.

- A malformed-message matrix: a hostile sender sends one bad message per case (chunks not in
  ``all_chunks``, overlapping, misaligned or out-of-range chunks, non-int entries, truncated or
  non-JSON payloads, descriptor counts that do not match, unsealed or foreign descriptors) and
  a victim importer must raise ``ValueError`` (descriptors: ``DriverError``; a hang-up:
  ``ConnectionError``) naming the entry, with no descriptor left open and its own memory intact.
- A peer that ``ftruncate``s the descriptors it received: refused by the seals; the owner keeps
  reading and writing all its memory (the bug: the owner died with SIGBUS).
- Read-only export: the importer's mapping is ``PROT_READ``, cannot be made writable, numpy
  arrays over it are not writeable, and a process of another uid cannot reopen the descriptor
  read-write.
- The uid check (``SO_PEERCRED``), ``listen_unix`` socket files (0600), timeouts against a peer
  that never reads or never sends, and copy/pickle of an ``ImportedBuffer`` refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

G = 2 << 20  # the CPU driver's chunk granularity for ExtensibleTensor
HERE = os.path.abspath(__file__)
NOBODY = 65534
ROOT_REASON = None if os.geteuid() == 0 else "needs root to run a peer under another uid"


# -- shared by both sides --------------------------------------------------------------------
def open_fds() -> set[str]:
    """Open descriptors of this process, without the one that listed them."""
    names = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            os.readlink(f"/proc/self/fd/{name}")
            names.add(name)
    return names


def pattern(seed: int, size: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.int64) * 7 + seed * 13) % 251).astype(np.uint8)


def make_owner(seed: int = 1):
    """A CPU tensor of 2 segments (4 MiB each), 1 MiB committed in each (one chunk each),
    filled with ``pattern(seed + i)``."""
    from jaxbuf.extensible import ExtensibleTensor

    tensor = ExtensibleTensor(4 * G, device="cpu", num_segments=2)
    tensor.resize_per_segment_(G // 2)
    for i in range(2):
        view = tensor.segment_view(i).to_numpy()
        view[:] = pattern(seed + i, view.size)
    return tensor


def owner_intact(tensor, seed: int = 1) -> bool:
    """Every committed byte still reads as written, and can be written and read again."""
    for i in range(tensor.num_segments):
        view = tensor.segment_view(i).to_numpy()
        if not np.array_equal(view, pattern(seed + i, view.size)):
            return False
        view[:] = 255 - view
        if not np.array_equal(view, 255 - pattern(seed + i, view.size)):
            return False
        view[:] = pattern(seed + i, view.size)
    return True


def report(**message) -> None:
    print(json.dumps(message), flush=True)


def errno_of(call, *args) -> str:
    """Name of the errno ``call(*args)`` fails with, or "ok"."""
    try:
        call(*args)
    except OSError as error:
        return errno.errorcode.get(error.errno, str(error.errno))
    return "ok"


def send_raw(sock: socket.socket, payload: bytes, fds=(), count=None, magic=b"JXB1") -> None:
    """A message framed like send_layout's, with any payload and header."""
    count = len(fds) if count is None else count
    sock.sendall(struct.pack("!4sQI", magic, len(payload), count) + payload)
    if fds:
        socket.send_fds(sock, [b"F"], list(fds))


# -- the malformed-message matrix: the hostile sender's cases -----------------------------------
def _chunks(layout, entries):
    return {**layout, "all_chunks": entries, "chunks": entries}


def _edit(**changes):
    return lambda layout: {**layout, **changes}


# name -> how the layout of make_owner() (chunks [0, G, a] and [2G, G, b]) is spoiled; the
# descriptors sent are the real ones, one per chunk, unless the name says otherwise.
LAYOUT_CASES = {
    "chunk_not_in_all_chunks": lambda lay: {
        **lay,
        "chunks": [lay["chunks"][0], [G, G, lay["chunks"][1][2]]],
    },
    "chunk_outside_reservation": lambda lay: _chunks(lay, [lay["all_chunks"][0], [4 * G, G, 9]]),
    "chunk_negative_offset": lambda lay: _chunks(lay, [lay["all_chunks"][0], [-G, G, 9]]),
    "chunk_misaligned_offset": lambda lay: _chunks(
        lay, [lay["all_chunks"][0], [2 * G + 4096, G, 9]]
    ),
    "chunk_misaligned_size": lambda lay: _chunks(lay, [lay["all_chunks"][0], [2 * G, G + 4096, 9]]),
    "chunks_overlap": lambda lay: _chunks(lay, [[0, G, 8], [0, G, 9]]),
    "chunk_id_repeated": lambda lay: _chunks(lay, [[0, G, 8], [2 * G, G, 8]]),
    "committed_unbacked": lambda lay: {**lay, "committed_sizes": [G // 2, G + 1]},
    "committed_over_capacity": lambda lay: {**lay, "committed_sizes": [2 * G + 1, G // 2]},
    "segments_overlap": _edit(segment_offsets=[0, G]),
    "offset_is_a_string": lambda lay: _chunks(lay, [["0", G, 8], lay["all_chunks"][1]]),
    "size_is_a_float": lambda lay: _chunks(lay, [[0, float(G), 8], lay["all_chunks"][1]]),
    "chunk_id_is_a_bool": lambda lay: _chunks(lay, [[0, G, True], lay["all_chunks"][1]]),
    "chunk_entry_too_short": lambda lay: _chunks(lay, [[0, G], lay["all_chunks"][1]]),
    "reserved_size_null": _edit(reserved_size=None),
    "reserved_size_huge": _edit(reserved_size=1 << 80),
    "version_is_a_bool": _edit(version=True),
    "capacities_not_a_list": _edit(segment_capacities={"0": 1}),
    "segment_lists_differ": _edit(committed_sizes=[G // 2]),
    "owner_not_a_string": _edit(owner=7),
    "read_only_not_a_bool": _edit(read_only="yes"),
    "missing_all_chunks": lambda lay: {k: v for k, v in lay.items() if k != "all_chunks"},
    "layout_names_more_chunks_than_fds": "fewer fds",
}

# name -> (exception type, fragment of its message) the victim must raise.
EXPECTED = {
    "chunk_not_in_all_chunks": ("ValueError", "chunks[1] = [2097152, 2097152, 2] is not listed"),
    "chunk_outside_reservation": ("ValueError", "all_chunks[1] = [8388608, 2097152, 9] is outside"),
    "chunk_negative_offset": ("ValueError", "all_chunks[1] = [-2097152, 2097152, 9] is outside"),
    "chunk_misaligned_offset": (
        "ValueError",
        "all_chunks[1] = [4198400, 2097152, 9] is not aligned",
    ),
    "chunk_misaligned_size": ("ValueError", "all_chunks[1] = [4194304, 2101248, 9] is not aligned"),
    "chunks_overlap": ("ValueError", "all_chunks[1] = [0, 2097152, 9] overlaps all_chunks[0]"),
    "chunk_id_repeated": ("ValueError", "all_chunks[1] = [4194304, 2097152, 8] repeats chunk id"),
    "committed_unbacked": ("ValueError", "committed_sizes[1] = 2097153 reaches bytes"),
    "committed_over_capacity": ("ValueError", "committed_sizes[0] = 4194305 exceeds"),
    "segments_overlap": ("ValueError", "segment 1 [2097152, +4194304) overlaps segment 0"),
    "offset_is_a_string": ("ValueError", "all_chunks[0] = ['0', 2097152, 8] must be [offset"),
    "size_is_a_float": ("ValueError", "all_chunks[0] = [0, 2097152.0, 8] must be [offset"),
    "chunk_id_is_a_bool": ("ValueError", "all_chunks[0] = [0, 2097152, True] must be [offset"),
    "chunk_entry_too_short": ("ValueError", "all_chunks[0] = [0, 2097152] must be [offset"),
    "reserved_size_null": ("ValueError", "reserved_size must be an int"),
    "reserved_size_huge": ("ValueError", "reserved_size must be an int in [1, 2**62)"),
    "version_is_a_bool": ("ValueError", "not a jaxbuf layout of version 1"),
    "capacities_not_a_list": ("ValueError", "segment_capacities must be a list"),
    "segment_lists_differ": ("ValueError", "differ in length"),
    "owner_not_a_string": ("ValueError", "owner must be a string"),
    "read_only_not_a_bool": ("ValueError", "read_only must be a bool"),
    "missing_all_chunks": ("ValueError", "missing key(s) all_chunks"),
    "layout_names_more_chunks_than_fds": ("ValueError", "2 chunks but 1 descriptors"),
    "header_promises_more_fds": ("ValueError", "malformed descriptor batch: expected 2"),
    "batch_carries_extra_fds": ("ValueError", "malformed descriptor batch: expected 1"),
    "fd_batch_without_marker": ("ValueError", "malformed descriptor batch"),
    "truncated_json": ("ValueError", "malformed jaxbuf layout message"),
    "payload_not_utf8": ("ValueError", "malformed jaxbuf layout message"),
    "payload_a_json_array": ("ValueError", "not a JSON object"),
    "payload_deeply_nested": ("ValueError", "malformed jaxbuf layout message"),
    "payload_nan_sizes": ("ValueError", "reserved_size must be an int"),
    "bad_magic": ("ValueError", "not a jaxbuf layout message"),
    "header_huge_payload": ("ValueError", "not a jaxbuf layout message"),
    "hang_up_mid_payload": ("ConnectionError", "socket closed after 10 of 1000 bytes"),
    "unsealed_memfd": ("DriverError", "not sealed with F_SEAL_SHRINK"),
    "pipe_instead_of_memfd": ("DriverError", "not a readable memfd"),
    "read_only_fd_in_writable_layout": ("ValueError", "came with a read-only descriptor"),
    "valid": ("imported", ""),
}


def send_case(name: str, sock: socket.socket, tensor) -> None:
    """Send case ``name``'s message on ``sock`` (then the caller closes it)."""
    from jaxbuf.sharing import export_layout, send_layout

    layout, fds = export_layout(tensor)
    try:
        spoil = LAYOUT_CASES.get(name)
        if callable(spoil):
            send_layout(sock, spoil(layout), fds)
        elif name == "layout_names_more_chunks_than_fds":
            send_layout(sock, layout, fds[:1])
        elif name == "valid":
            send_layout(sock, layout, fds)
        else:
            payload = json.dumps(layout).encode()
            one = _edit(
                chunks=layout["chunks"][:1],
                all_chunks=layout["all_chunks"][:1],
                committed_sizes=[G // 2, 0],
            )(layout)
            one_payload = json.dumps(one).encode()
            if name == "header_promises_more_fds":
                send_raw(sock, one_payload, fds[:1], count=2)
            elif name == "batch_carries_extra_fds":
                send_raw(sock, one_payload, fds, count=1)
            elif name == "fd_batch_without_marker":
                sock.sendall(struct.pack("!4sQI", b"JXB1", len(one_payload), 1) + one_payload)
                socket.send_fds(sock, [b"X"], fds[:1])
            elif name == "truncated_json":
                send_raw(sock, payload[: len(payload) // 2], fds)
            elif name == "payload_not_utf8":
                send_raw(sock, b"\xff\xfe\xfa" * 10)
            elif name == "payload_a_json_array":
                send_raw(sock, b"[1, 2, 3]")
            elif name == "payload_deeply_nested":
                send_raw(sock, b"[" * 200_000 + b"]" * 200_000)
            elif name == "payload_nan_sizes":
                send_raw(sock, payload.replace(b'"reserved_size":', b'"reserved_size":NaN,"x":'))
            elif name == "bad_magic":
                send_raw(sock, payload, magic=b"JXB9")
            elif name == "header_huge_payload":
                sock.sendall(struct.pack("!4sQI", b"JXB1", 1 << 40, 0))
            elif name == "hang_up_mid_payload":
                sock.sendall(struct.pack("!4sQI", b"JXB1", 1000, 0) + b"x" * 10)
            elif name == "unsealed_memfd":
                fd = os.memfd_create("hostile", os.MFD_CLOEXEC)
                os.ftruncate(fd, G)
                send_raw(sock, one_payload, [fd])
                os.close(fd)
            elif name == "pipe_instead_of_memfd":
                r, w = os.pipe()
                send_raw(sock, one_payload, [r])
                os.close(r)
                os.close(w)
            elif name == "read_only_fd_in_writable_layout":
                ro = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDONLY | os.O_CLOEXEC)
                send_raw(sock, one_payload, [ro])
                os.close(ro)
            else:
                raise AssertionError(f"unknown case {name}")
    finally:
        for fd in fds:
            os.close(fd)


def role_hostile_sender(*fd_numbers: str) -> None:
    tensor = make_owner()
    for name, number in zip(EXPECTED, fd_numbers):
        sock = socket.socket(fileno=int(number))
        send_case(name, sock, tensor)
        sock.close()  # what the victim did not read stays queued on its side
    tensor.free()
    report(sent=len(fd_numbers))


def role_victim(*fd_numbers: str) -> None:
    from jaxbuf.sharing import recv_buffer

    own = make_owner(seed=5)  # the victim's own memory, which no import may touch
    outcomes = {}
    for name, number in zip(EXPECTED, fd_numbers):
        sock = socket.socket(fileno=int(number))
        before = open_fds()
        try:
            imported = recv_buffer(sock, timeout=30)
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            outcome = [type(error).__name__, str(error)]
        else:
            ok = np.array_equal(imported.segment_view(1).to_numpy(), pattern(2, G // 2))
            imported.close()
            outcome = ["imported", "" if ok else "wrong bytes"]
        sock.close()
        leaked = sorted(open_fds() - before)
        outcomes[name] = [*outcome, leaked, owner_intact(own, seed=5)]
    own.free()
    report(outcomes=outcomes)


def spawn(role: str, *fds: int, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Run ``role`` of this script in a new process, handing it the descriptors ``fds``
    (their numbers come first on its command line, then ``args``)."""
    return subprocess.Popen(
        [sys.executable, HERE, role, *map(str, fds), *args],
        pass_fds=fds,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, what: str, timeout: float = 120) -> dict:
    """Wait for ``process``; assert it exited normally with 0 (not by a signal), return its
    last JSON line."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"{what} hung:\n{err[-3000:]}") from None
    rc = process.returncode
    died = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
    assert rc == 0, f"{what} did not exit normally ({died}):\n{err[-3000:]}{out[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def matrix() -> dict:
    """Run the hostile sender and the victim once, side by side, over one socket pair per
    case (both go through the cases in the same order, so a large message just waits)."""
    pairs = [socket.socketpair() for _ in EXPECTED]
    try:
        sender = spawn("hostile-sender", *(a.fileno() for a, _ in pairs))
        victim = spawn("victim", *(b.fileno() for _, b in pairs))
        for a, b in pairs:
            a.close()
            b.close()
        outcomes = finish(victim, "the victim importer")["outcomes"]
        assert finish(sender, "the hostile sender") == {"sent": len(EXPECTED)}
        return outcomes
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@pytest.mark.parametrize("case", list(EXPECTED))
def test_malformed_message_is_refused_by_name(matrix, case):
    kind, message, leaked, intact = matrix[case]
    want_kind, want_message = EXPECTED[case]
    assert (kind, want_message in message) == (want_kind, True), message
    assert leaked == [], f"descriptors left open after {case}: {leaked}"
    assert intact, "the victim's own memory changed"


def test_every_refusal_is_a_clear_exception_type(matrix):
    kinds = {kind for kind, *_ in matrix.values()}
    assert kinds <= {"ValueError", "DriverError", "ConnectionError", "imported"}, kinds


# -- a peer that truncates the descriptors it received ------------------------------------------
def role_owner_shares(number: str, read_only: str = "0") -> None:
    """Share make_owner() (optionally read-only), wait for the peer's report, then touch all
    the memory, write new bytes for the peer to see, and report."""
    from jaxbuf.sharing import send_buffer

    sock = socket.socket(fileno=int(number))
    tensor = make_owner()
    send_buffer(sock, tensor, read_only=read_only == "1")
    if read_only == "1":  # a second message, which the peer takes apart by hand
        send_buffer(sock, tensor, read_only=True)
    replies = sock.makefile()
    peer = json.loads(replies.readline())
    intact = owner_intact(tensor)
    tensor.segment_view(0).to_numpy()[:4] = [9, 8, 7, 6]
    sock.sendall(b"W")
    later = json.loads(replies.readline())
    # The owner grows and frees while the peer may still hold mappings: nothing faults.
    tensor.resize_per_segment_(2 * G)
    tensor.segment_view(1).to_numpy()[-1] = 1
    tensor.free()
    report(intact=intact, peer=peer, later=later)


def role_peer_truncates(number: str) -> None:
    from jaxbuf.sharing import recv_layout

    sock = socket.socket(fileno=int(number))
    layout, fds = recv_layout(sock)
    attempts = []
    for fd, (_, size, _) in zip(fds, layout["chunks"]):
        attempts.append(
            {  # in this order: unsealed, the file would end empty and the owner die (SIGBUS)
                "grow": errno_of(os.ftruncate, fd, 2 * size),
                "fallocate_grow": errno_of(os.posix_fallocate, fd, size, size),
                "add_write_seal": errno_of(fcntl.fcntl, fd, fcntl.F_ADD_SEALS, 0x8),
                "shrink_by_a_page": errno_of(os.ftruncate, fd, size - 4096),
                "shrink": errno_of(os.ftruncate, fd, 0),
                "size_after": os.fstat(fd).st_size == size,
                "mode": oct(stat.S_IMODE(os.fstat(fd).st_mode)),
            }
        )
    for fd in fds:
        os.close(fd)
    sock.sendall((json.dumps(attempts) + "\n").encode())
    assert sock.recv(1) == b"W"
    sock.sendall(b"{}\n")
    report(done=True)


def test_peer_cannot_truncate_the_owners_memory():
    a, b = socket.socketpair()
    owner = spawn("owner-shares", a.fileno())
    peer = spawn("peer-truncates", b.fileno())
    a.close()
    b.close()
    result = finish(owner, "the owner")  # the bug: the owner died with SIGBUS here
    assert finish(peer, "the truncating peer") == {"done": True}
    assert result["intact"], "the owner's bytes changed"
    assert len(result["peer"]) == 2  # one per chunk
    for attempts in result["peer"]:
        for name in ("shrink", "shrink_by_a_page", "grow", "fallocate_grow", "add_write_seal"):
            assert attempts[name] == "EPERM", (name, attempts)
        assert attempts["size_after"] and attempts["mode"] == "0o600"


# -- read-only export ------------------------------------------------------------------------
def _maps_permissions(start: int, end: int) -> set[str]:
    perms = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perm = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo < end and hi > start:
                perms.add(perm)
    return perms


def role_importer_read_only(number: str) -> None:
    from jaxbuf.drivers import DriverError, get_vmm_driver
    from jaxbuf.sharing import recv_buffer, recv_layout

    sock = socket.socket(fileno=int(number))
    imported = recv_buffer(sock)
    seg0 = imported.segment_view(0).to_numpy()
    start = imported.base_ptr
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rc = libc.mprotect(start, G, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        seg0[0] = 1
        numpy_write = "allowed"
    except ValueError as error:
        numpy_write = str(error)
    handle = next(iter(imported._chunks.values()))[2]
    try:
        get_vmm_driver("cpu").export_handle(handle)
        upgrade = "allowed"
    except DriverError as error:
        upgrade = error.error_name
    # The second message, taken apart by hand: what a raw read-only descriptor allows.
    layout, fds = recv_layout(sock)
    fd = fds[0]
    raw = {
        "flags": fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY,
        "write": errno_of(os.pwrite, fd, b"x", 0),
        "truncate": errno_of(os.ftruncate, fd, 0),
        "map_writable": errno_of(
            mmap.mmap, fd, G, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        ),
    }
    if os.geteuid() == 0:  # another uid may not reopen it read-write through /proc
        child = os.fork()
        if child == 0:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = errno_of(os.open, f"/proc/self/fd/{fd}", os.O_RDWR)
            os._exit(0 if code == "EACCES" else 1)
        raw["other_uid_reopen_refused"] = os.waitpid(child, 0)[1] == 0
    for received in fds:
        os.close(received)
    sock.sendall(
        (
            json.dumps(
                {
                    "read_only": imported.read_only,
                    "layout_read_only": layout["read_only"],
                    "perms": sorted(_maps_permissions(start, start + imported.capacity_bytes)),
                    "mprotect": errno.errorcode.get(ctypes.get_errno()) if rc else "ok",
                    "writeable": bool(seg0.flags.writeable),
                    "numpy_write": numpy_write,
                    "upgrade": upgrade,
                    "bytes_ok": bool(np.array_equal(seg0, pattern(1, seg0.size))),
                    "raw": raw,
                }
            )
            + "\n"
        ).encode()
    )
    assert sock.recv(1) == b"W"
    sock.sendall((json.dumps({"sees_owner_write": seg0[:4].tolist()}) + "\n").encode())
    imported.close()
    report(done=True)


def test_read_only_import_cannot_write():
    a, b = socket.socketpair()
    owner = spawn("owner-shares", a.fileno(), 1)
    importer = spawn("importer-read-only", b.fileno())
    a.close()
    b.close()
    result = finish(owner, "the owner")
    assert finish(importer, "the read-only importer") == {"done": True}
    assert result["intact"]
    peer = result["peer"]
    assert peer["read_only"] and peer["layout_read_only"]
    # Mapped PROT_READ where chunks are, the read-only zero reservation elsewhere: nothing "w".
    assert set(peer["perms"]) <= {"r--s", "r--p"} and "r--s" in peer["perms"], peer["perms"]
    assert peer["mprotect"] == "EACCES"  # the peer cannot make it writable
    assert not peer["writeable"] and "read-only" in peer["numpy_write"]
    assert peer["upgrade"] == "EACCES"  # and the driver will not re-export it read-write
    assert peer["bytes_ok"]
    raw = peer["raw"]
    assert raw["flags"] and raw["write"] == "EBADF" and raw["map_writable"] == "EACCES"
    assert raw["truncate"] in ("EINVAL", "EBADF")
    if ROOT_REASON is None:
        assert raw["other_uid_reopen_refused"]
    assert result["later"] == {"sees_owner_write": [9, 8, 7, 6]}


def test_read_only_export_is_refused_where_the_driver_cannot():
    from jaxbuf.drivers import HostVmmDriver
    from jaxbuf.extensible import ExtensibleTensor
    from jaxbuf.sharing import export_layout

    class NoReadOnlyDriver(HostVmmDriver):
        export_read_only_handle = None  # as the CUDA driver: no read-only descriptors

    tensor = ExtensibleTensor(4 * G, device="cpu", driver=NoReadOnlyDriver())
    tensor.resize_per_segment_(G)
    before = open_fds()
    with pytest.raises(ValueError, match="read_only=True is not supported on cpu"):
        export_layout(tensor, read_only=True)
    assert open_fds() == before
    layout, fds = export_layout(tensor)  # read-write still works
    for fd in fds:
        os.close(fd)
    tensor.free()
    other = make_owner()
    layout, fds = export_layout(other)
    for fd in fds:
        os.close(fd)
    with pytest.raises(ValueError, match="an importer keeps one access mode"):
        export_layout(other, since=layout, read_only=True)
    other.free()


@pytest.mark.gpu
def test_read_only_export_on_cuda_says_it_is_unsupported():
    from conftest import CUDA_REASON

    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    from jaxbuf.extensible import ExtensibleTensor
    from jaxbuf.sharing import export_layout

    tensor = ExtensibleTensor(4 * G, device="cuda:0")
    tensor.resize_per_segment_(G)
    try:
        with pytest.raises(ValueError, match="cuMemExportToShareableHandle"):
            export_layout(tensor, read_only=True)
    finally:
        tensor.free()


# -- who is at the other end --------------------------------------------------------------------
def test_peer_credentials_and_uid_check_refuse_before_exporting():
    from jaxbuf.sharing import peer_credentials, recv_buffer, send_buffer

    a, b = socket.socketpair()
    tensor = make_owner()
    try:
        assert peer_credentials(a) == (os.getpid(), os.getuid(), os.getgid())
        before = open_fds()
        with pytest.raises(PermissionError, match=f"uid {os.geteuid()}, not one of"):
            send_buffer(a, tensor, allowed_uids={os.geteuid() + 1})
        assert open_fds() == before  # nothing was exported
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # and nothing was sent
        b.setblocking(True)
        with pytest.raises(PermissionError, match="refusing to share"):
            recv_buffer(b, allowed_uids=[os.geteuid() + 1])
        with pytest.raises(ValueError, match="non-negative int uids"):
            send_buffer(a, tensor, allowed_uids=[-1])
        with pytest.raises(TypeError, match="collection of uids"):
            send_buffer(a, tensor, allowed_uids=0)
        with pytest.raises(ValueError, match="AF_UNIX"):
            peer_credentials(socket.socket(socket.AF_INET))
    finally:
        tensor.free()
        a.close()
        b.close()


def role_other_uid_peer(address: str, socket_file: str, open_file: str) -> None:
    """Run as uid 65534: connect to the owner's abstract socket and try to import; try the
    0600 socket file and a 0666 control file."""
    from jaxbuf.sharing import recv_buffer

    os.setgid(NOBODY)
    os.setuid(NOBODY)
    outcome = {}
    for name, path in (("file_0600", socket_file), ("file_0666", open_file)):
        probe = socket.socket(socket.AF_UNIX)
        outcome[name] = errno_of(probe.connect, path)
        probe.close()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect("\0" + address)
    try:
        recv_buffer(sock, timeout=30, allowed_uids={0})
        outcome["import"] = "imported"
    except ConnectionError:
        outcome["import"] = "hung up on"
    report(**outcome)


@pytest.mark.skipif(ROOT_REASON is not None, reason=ROOT_REASON or "")
def test_a_peer_of_another_uid_is_refused_and_cannot_reach_the_socket_file():
    from jaxbuf.sharing import listen_unix, send_buffer

    directory = tempfile.mkdtemp()
    os.chmod(directory, 0o755)  # reachable by the other uid: only the files' modes guard
    address = f"jaxbuf-hostile-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX)
    server.bind("\0" + address)
    server.listen(1)
    guarded = listen_unix(os.path.join(directory, "owner.sock"))
    control = socket.socket(socket.AF_UNIX)
    control.bind(os.path.join(directory, "open.sock"))
    os.chmod(os.path.join(directory, "open.sock"), 0o666)
    control.listen(1)
    tensor = make_owner()
    try:
        files = (os.path.join(directory, "owner.sock"), os.path.join(directory, "open.sock"))
        peer = spawn("other-uid-peer", args=(address, *files))
        server.settimeout(60)
        conn, _ = server.accept()
        with pytest.raises(PermissionError, match=f"uid {NOBODY}, not one of"):
            send_buffer(conn, tensor)
        conn.close()
        result = finish(peer, "the other-uid peer")
        assert result == {"file_0600": "EACCES", "file_0666": "ok", "import": "hung up on"}
    finally:
        tensor.free()
        for sock in (server, guarded, control):
            sock.close()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def test_listen_unix_creates_a_0600_socket_file(tmp_path):
    from jaxbuf.sharing import listen_unix, recv_buffer, send_buffer

    path = tmp_path / "jaxbuf.sock"
    server = listen_unix(path)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.listdir(tmp_path) == ["jaxbuf.sock"]  # the private staging dir is gone
        with pytest.raises(FileExistsError):
            listen_unix(path)
        assert os.listdir(tmp_path) == ["jaxbuf.sock"]
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(path))
        conn, _ = server.accept()
        tensor = make_owner()
        send_buffer(conn, tensor)
        with recv_buffer(client) as imported:
            assert np.array_equal(imported.segment_view(1).to_numpy(), pattern(2, G // 2))
        tensor.free()
        conn.close()
        client.close()
    finally:
        server.close()


# -- timeouts ---------------------------------------------------------------------------------
def role_sleeper(number: str) -> None:
    """Hold the socket and never read or write it, until stdin closes."""
    sock = socket.socket(fileno=int(number))
    sys.stdin.read()
    sock.close()
    report(slept=True)


def wake(sleeper: subprocess.Popen) -> dict:
    """End a sleeper: close its stdin, then :func:`finish` it."""
    sleeper.stdin.close()
    sleeper.stdin = None  # communicate() must not flush it again
    return finish(sleeper, "the sleeping peer")


def test_send_to_a_peer_that_never_reads_times_out():
    from jaxbuf.sharing import send_buffer

    a, b = socket.socketpair()
    sleeper = subprocess.Popen(
        [sys.executable, HERE, "sleeper", str(b.fileno())],
        pass_fds=(b.fileno(),),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    b.close()
    tensor = make_owner()
    try:
        a.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # what the peer left unread fills the socket
                a.send(b"\0" * 65536)
        a.setblocking(True)
        before = open_fds()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not complete within 0.5 s"):
            send_buffer(a, tensor, timeout=0.5)
        assert time.monotonic() - started < 10
        assert open_fds() == before, "the exported descriptors stayed open"
        assert a.gettimeout() is None  # the socket's own setting is restored
    finally:
        tensor.free()
        a.close()
        woken = wake(sleeper)
    assert woken == {"slept": True}


def test_recv_from_a_peer_that_never_sends_times_out():
    from jaxbuf.sharing import recv_buffer

    a, b = socket.socketpair()
    sleeper = subprocess.Popen(
        [sys.executable, HERE, "sleeper", str(a.fileno())],
        pass_fds=(a.fileno(),),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    a.close()
    try:
        b.settimeout(5.0)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="receiving a jaxbuf layout"):
            recv_buffer(b, timeout=0.3)
        assert time.monotonic() - started < 5
        assert b.gettimeout() == 5.0
    finally:
        b.close()
        woken = wake(sleeper)
    assert woken == {"slept": True}


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (True, TypeError),
    ],
)
def test_bad_timeouts_are_refused_before_anything_is_sent(timeout, error):
    from jaxbuf.sharing import recv_buffer, send_buffer

    a, b = socket.socketpair()
    tensor = make_owner()
    try:
        with pytest.raises(error, match="timeout"):
            send_buffer(a, tensor, timeout=timeout)
        with pytest.raises(error, match="timeout"):
            recv_buffer(b, timeout=timeout)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)
    finally:
        tensor.free()
        a.close()
        b.close()


# -- copying an ImportedBuffer ------------------------------------------------------------------
def role_copy_import() -> None:
    import copy
    import pickle

    from jaxbuf.sharing import recv_buffer, send_buffer

    a, b = socket.socketpair()
    tensor = make_owner()
    send_buffer(a, tensor)
    imported = recv_buffer(b)
    refused = {}
    for name, call in (("copy", copy.copy), ("deepcopy", copy.deepcopy), ("pickle", pickle.dumps)):
        try:
            call(imported)
            refused[name] = "allowed"
        except TypeError as error:
            refused[name] = str(error)
    ok = np.array_equal(imported.segment_view(1).to_numpy(), pattern(2, G // 2))
    imported.close()
    tensor.free()
    report(refused=refused, still_works=bool(ok))


def test_copy_and_pickle_of_an_imported_buffer_are_refused():
    result = finish(spawn("copy-import"), "the copying process")
    assert result["still_works"]
    for name, message in result["refused"].items():
        assert "cannot be copied or pickled" in message and "second time" in message, name


ROLES = {
    "hostile-sender": role_hostile_sender,
    "victim": role_victim,
    "owner-shares": role_owner_shares,
    "peer-truncates": role_peer_truncates,
    "importer-read-only": role_importer_read_only,
    "other-uid-peer": role_other_uid_peer,
    "sleeper": role_sleeper,
    "copy-import": role_copy_import,
}

_RSS_CHILD = r"""
import json, resource, socket, struct, sys, threading
from jaxbuf import sharing

rows = 7 * (1 << 20) // len("[0,0,0],")
payload = json.dumps({"version": 1, "all_chunks": [[0, 0, 0]] * rows, "chunks": []},
                     separators=(",", ":")).encode()
message = struct.pack("!4sQI", b"JXB1", len(payload), 0) + payload
mine, theirs = socket.socketpair()

def send():
    try:
        theirs.sendall(message)
    except OSError:
        pass  # the receiver refused and hung up

sender = threading.Thread(target=send)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sender.start()
try:
    sharing.recv_buffer(mine, timeout=30)
except ValueError as error:
    outcome = f"refused: {error}"
else:
    outcome = "imported"
mine.close()
sender.join()
theirs.close()
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print(json.dumps({"outcome": outcome, "grown_mib": grown, "payload_mib": len(payload) >> 20}))
"""


def test_a_bloated_layout_is_refused_before_it_is_parsed():
    """7 MiB of ``[0,0,0]`` rows with no descriptor: ``recv_buffer`` refuses it by its
    announced size, before reading it, and the receiver's peak RSS barely moves (parsed,
    it grew by 115 MiB). In a child, so the peak is this message's alone."""
    result = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["payload_mib"] >= 7, report
    assert report["outcome"].startswith("refused: a jaxbuf layout of 0 sent and 0 held"), report
    assert report["grown_mib"] < 16, report


def test_an_update_may_list_the_chunks_it_holds_without_descriptors():
    """The bound counts the chunks an importer holds: an update listing many held chunks
    and sending few descriptors still arrives (a model: one real tensor of many chunks)."""
    from unittest import mock

    import jaxbuf
    from jaxbuf import sharing

    owner = jaxbuf.ExtensibleTensor(64 << 20, "cpu")
    try:
        for i in range(1, 17):
            owner.resize_per_segment_(i * (2 << 20))  # 16 chunks
        mine, theirs = socket.socketpair()
        with mine, theirs:
            first, fds = sharing.export_layout(owner)
            sharing.send_layout(theirs, first, fds)
            for fd in fds:
                os.close(fd)
            imported = sharing.recv_buffer(mine)
            owner.resize_per_segment_(34 << 20)
            layout, fds = sharing.export_layout(owner, since=first)
            sharing.send_layout(theirs, layout, fds)
            for fd in fds:
                os.close(fd)
            with mock.patch.object(sharing._wire, "_LAYOUT_BYTES", 0):  # rows only
                imported.refresh(mine)
            assert imported.committed_sizes == owner.committed_sizes
            with mock.patch.object(sharing._wire, "_LAYOUT_BYTES", 0):
                layout, fds = sharing.export_layout(owner)
                sharing.send_layout(theirs, layout, fds)  # all 17 again, with descriptors
                for fd in fds:
                    os.close(fd)
                imported.refresh(mine)
            imported.close()
    finally:
        owner.free()


if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
