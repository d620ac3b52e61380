"""Cross-process sharing (jaxbuf.sharing): export/import over a Unix socket, growth picked up
by refresh, defragment and release followed, no descriptor leaked on either side.

The two-process tests start the importer with ``subprocess`` and hand it both ends of two
socket pairs with ``pass_fds``: one carries layouts and descriptors (SCM_RIGHTS), the other
JSON control lines. The same script serves the CPU, one GPU, and the two-GPU case (importer
on ``cuda:1`` mapping memory that lives on ``cuda:0``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import CUDA_REASON

from jaxbuf import sharing
from jaxbuf.devices import as_device
from jaxbuf.drivers import DriverError, get_vmm_driver
from jaxbuf.extensible import ExtensibleTensor
from jaxbuf.sharing import (
    ImportedBuffer,
    export_layout,
    recv_buffer,
    recv_layout,
    send_buffer,
    send_layout,
)

MiB = 1 << 20
G = 2 * MiB


def open_fds() -> set[str]:
    """Open descriptors of this process, without the one that listed them."""
    names = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the directory listing's own descriptor, closed by now
            continue
        names.add(name)
    return names


def pattern(seed: int, size: int, start: int = 0) -> np.ndarray:
    return ((np.arange(start, start + size, dtype=np.int64) * 7 + seed * 13) % 251).astype(np.uint8)


# -- host <-> device bytes through the driver (works on the CPU and on CUDA) -------------------
def read_bytes(owner, view) -> np.ndarray:
    out = np.empty(view.nbytes, dtype=np.uint8)
    driver = owner.driver if hasattr(owner, "driver") else owner._driver
    if view.nbytes:
        driver.copy(out.ctypes.data, view.ptr, view.nbytes, view.device.index)
        driver.synchronize(view.device.index)
    return out


def write_bytes(owner, view, offset: int, values: np.ndarray) -> None:
    values = np.ascontiguousarray(values, dtype=np.uint8)
    driver = owner.driver if hasattr(owner, "driver") else owner._driver
    driver.copy(view.ptr + offset, values.ctypes.data, values.nbytes, view.device.index)
    driver.synchronize(view.device.index)


# -- the importer process ----------------------------------------------------------------------
IMPORTER = textwrap.dedent(
    r"""
    import json, os, socket, sys
    import numpy as np
    from jaxbuf.devices import as_device
    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.sharing import recv_buffer

    data = socket.socket(fileno=int(sys.argv[1]))
    control = socket.socket(fileno=int(sys.argv[2])).makefile("rw")
    device = sys.argv[3]

    def say(**message):
        control.write(json.dumps(message) + "\n")
        control.flush()

    def hear():
        return json.loads(control.readline())

    def pattern(seed, size, start=0):
        return ((np.arange(start, start + size, dtype=np.int64) * 7 + seed * 13) % 251
                ).astype(np.uint8)

    def read(buffer, i):
        view = buffer.segment_view(i)
        out = np.empty(view.nbytes, dtype=np.uint8)
        buffer._driver.copy(out.ctypes.data, view.ptr, view.nbytes, view.device.index)
        buffer._driver.synchronize(view.device.index)
        return out

    def write(buffer, i, offset, values):
        view = buffer.segment_view(i)
        values = np.ascontiguousarray(values, dtype=np.uint8)
        buffer._driver.copy(view.ptr + offset, values.ctypes.data, values.nbytes,
                            view.device.index)
        buffer._driver.synchronize(view.device.index)

    def check(buffer, seeds):
        bad = []
        for i, seed in enumerate(seeds):
            got = read(buffer, i)
            if not np.array_equal(got, pattern(seed, got.size)):
                bad.append(i)
        return bad

    # Initialising the platform opens descriptors of its own (CUDA: /dev/nvidia*); do it
    # before the baseline so that the deltas count only received chunks.
    get_vmm_driver(device).ensure_context(as_device(device).index)
    before = os.listdir("/proc/self/fd")
    buffer = recv_buffer(data, device=device)
    after_import = os.listdir("/proc/self/fd")
    say(step="imported", sizes=buffer.committed_sizes, chunks=buffer.num_physical_chunks,
        bad=check(buffer, [1, 2]), fd_delta=len(after_import) - len(before),
        device=str(buffer.device))
    # Writes the owner must see.
    write(buffer, 0, 0, np.arange(200, 216))
    write(buffer, 1, buffer.committed_sizes[1] - 1, np.array([77]))
    say(step="written")
    while True:
        command = hear()
        if command["do"] == "refresh":
            buffer.refresh(data)
            say(step="refreshed", sizes=buffer.committed_sizes,
                chunks=buffer.num_physical_chunks, bad=check(buffer, command["seeds"]),
                fd_delta=len(os.listdir("/proc/self/fd")) - len(before))
        elif command["do"] == "write":
            write(buffer, command["segment"], command["offset"], np.array(command["values"]))
            say(step="written")
        else:
            buffer.close()
            say(step="closed", fd_delta=len(os.listdir("/proc/self/fd")) - len(before))
            data.close()
            break
    """
)


class Importer:
    """The importer process and the owner's ends of its two sockets."""

    def __init__(self, device: str) -> None:
        self.data, child_data = socket.socketpair()
        control, child_control = socket.socketpair()
        control.settimeout(120)
        self.control_socket = control
        self.control = control.makefile("rw")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                IMPORTER,
                str(child_data.fileno()),
                str(child_control.fileno()),
                device,
            ],
            pass_fds=(child_data.fileno(), child_control.fileno()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        child_data.close()
        child_control.close()

    def hear(self) -> dict:
        line = self.control.readline()
        if not line:
            out, err = self.process.communicate(timeout=60)
            raise AssertionError(f"importer died (rc={self.process.returncode}):\n{err}{out}")
        return json.loads(line)

    def say(self, **message) -> None:
        self.control.write(json.dumps(message) + "\n")
        self.control.flush()

    def finish(self) -> None:
        out, err = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, err + out
        self.control.close()
        self.control_socket.close()
        self.data.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def fill(tensor, seeds) -> None:
    for i, seed in enumerate(seeds):
        view = tensor.segment_view(i)
        write_bytes(tensor, view, 0, pattern(seed, view.nbytes))


def two_process_round_trip(owner_device: str, importer_device: str) -> None:
    # The platform's own descriptors (CUDA: /dev/nvidia*) open at its first use, not ours.
    get_vmm_driver(owner_device).ensure_context(as_device(owner_device).index)
    fds_before = open_fds()
    tensor = ExtensibleTensor(16 * G, device=owner_device, num_segments=2)
    importer = Importer(importer_device)
    try:
        tensor.resize_per_segment_(G + 123)
        fill(tensor, [1, 2])
        during = open_fds()
        layout = send_buffer(importer.data, tensor)
        assert open_fds() == during, "send_buffer left exported descriptors open"
        reply = importer.hear()
        assert reply["step"] == "imported", reply
        assert reply["sizes"] == [G + 123, G + 123]
        assert reply["chunks"] == tensor.num_physical_chunks == 2
        assert reply["bad"] == [], "the importer read other bytes than the owner wrote"
        assert reply["fd_delta"] == 0, "the importer kept received descriptors open"
        assert reply["device"] == importer_device
        assert importer.hear()["step"] == "written"
        # The importer's writes are the owner's bytes.
        seg0 = read_bytes(tensor, tensor.segment_view(0))
        seg1 = read_bytes(tensor, tensor.segment_view(1))
        assert list(seg0[:16]) == list(range(200, 216))
        assert seg1[-1] == 77
        fill(tensor, [1, 2])  # restore the patterns

        # The owner grows: only the new chunks travel; the importer picks them up.
        chunks_before = tensor.num_physical_chunks
        tensor.resize_per_segment_(3 * G + 7)
        fill(tensor, [1, 2])
        layout = send_buffer(importer.data, tensor, since=layout)
        assert len(layout["chunks"]) == tensor.num_physical_chunks - chunks_before == 2
        importer.say(do="refresh", seeds=[1, 2])
        reply = importer.hear()
        assert reply["sizes"] == [3 * G + 7, 3 * G + 7]
        assert reply["chunks"] == 4 and reply["bad"] == [] and reply["fd_delta"] == 0

        # Defragment: the importer drops the old chunks and maps the one new per segment.
        assert tensor.defragment() == [0, 1]
        layout = send_buffer(importer.data, tensor, since=layout)
        assert len(layout["chunks"]) == 2
        importer.say(do="refresh", seeds=[1, 2])
        reply = importer.hear()
        assert reply["chunks"] == 2 and reply["bad"] == [] and reply["fd_delta"] == 0
        importer.say(do="write", segment=1, offset=5, values=[9, 8, 7])
        assert importer.hear()["step"] == "written"
        assert list(read_bytes(tensor, tensor.segment_view(1))[5:8]) == [9, 8, 7]

        importer.say(do="close")
        reply = importer.hear()
        assert reply == {"step": "closed", "fd_delta": 0}
        importer.finish()
    finally:
        importer.kill()
        tensor.free()
    assert open_fds() == fds_before, "the owner leaked descriptors"


# -- CPU: two processes ----------------------------------------------------------------------
def test_two_processes_cpu():
    two_process_round_trip("cpu", "cpu")


# -- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_two_processes_one_gpu():
    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    two_process_round_trip("cuda:0", "cuda:0")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_processes_importer_on_other_gpu():
    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    driver = get_vmm_driver("cuda:0")
    if driver.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {driver.device_count()}")
    if not driver.can_access_peer(1, 0):
        pytest.skip("GPU 1 has no peer access to GPU 0")
    two_process_round_trip("cuda:0", "cuda:1")


@pytest.mark.gpu
def test_cuda_export_import_in_process():
    """The driver pair alone: export a chunk, import it, map it at a second address."""
    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    tensor = ExtensibleTensor(4 * G, device="cuda:0")
    tensor.resize_per_segment_(G)
    write_bytes(tensor, tensor.segment_view(0), 0, pattern(3, G))
    layout, fds = export_layout(tensor)
    try:
        imported = ImportedBuffer(layout, list(fds))
        assert imported.base_ptr != tensor.base_ptr
        assert np.array_equal(read_bytes(imported, imported.segment_view(0)), pattern(3, G))
        imported.close()
    finally:
        tensor.free()


# -- in-process (CPU): the protocol and the bookkeeping ---------------------------------------
@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_layout_is_json_and_names_the_chunks():
    tensor = ExtensibleTensor(8 * G, device="cpu", segment_capacities=[4 * G, 4 * G])
    tensor.resize_segments_([G, 2 * G + 1])
    layout, fds = export_layout(tensor)
    try:
        assert json.loads(json.dumps(layout)) == layout
        assert layout["reserved_size"] == tensor.capacity_bytes
        assert layout["segment_offsets"] == [0, 4 * G]
        assert layout["committed_sizes"] == [G, 2 * G + 1]
        assert [c[:2] for c in layout["chunks"]] == [[0, G], [4 * G, 3 * G]]
        assert len(fds) == 2 and all(
            os.fstat(fd).st_size == c[1] for fd, c in zip(fds, layout["chunks"])
        )
    finally:
        for fd in fds:
            os.close(fd)
        tensor.free()


def test_since_sends_only_new_chunks_and_rejects_other_buffers():
    a = ExtensibleTensor(8 * G, device="cpu")
    b = ExtensibleTensor(8 * G, device="cpu")
    try:
        a.resize_per_segment_(G)
        first, fds = export_layout(a)
        for fd in fds:
            os.close(fd)
        again, fds = export_layout(a, since=first)
        assert fds == [] and again["chunks"] == [] and again["all_chunks"] == first["all_chunks"]
        a.resize_per_segment_(3 * G)
        grown, fds = export_layout(a, since=first)
        for fd in fds:
            os.close(fd)
        assert [c[:2] for c in grown["chunks"]] == [[G, 2 * G]]
        with pytest.raises(ValueError, match="same buffer"):
            export_layout(b, since=first)
    finally:
        a.free()
        b.free()


def test_owner_release_and_regrow_is_followed(pair):
    a, b = pair
    tensor = ExtensibleTensor(8 * G, device="cpu")
    tensor.resize_per_segment_(2 * G)
    layout = send_buffer(a, tensor)
    with recv_buffer(b) as imported:
        tensor.release_physical()
        tensor.resize_per_segment_(2 * G)  # new chunk at the same offset and size
        tensor.segment_view(0).to_numpy()[:4] = [1, 2, 3, 4]
        layout = send_buffer(a, tensor, since=layout)
        assert len(layout["chunks"]) == 1  # recognised as a new chunk
        imported.refresh(b)
        assert list(imported.segment_view(0).to_numpy()[:4]) == [1, 2, 3, 4]
        assert imported.num_physical_chunks == 1
    assert imported.closed
    tensor.free()


def test_many_descriptors_go_in_batches(pair, monkeypatch):
    monkeypatch.setattr(sharing._wire, "_FDS_PER_BATCH", 3)
    a, b = pair
    tensor = ExtensibleTensor(16 * G, device="cpu")
    for n in range(1, 9):
        tensor.resize_per_segment_(n * G)
    before = open_fds()
    send_buffer(a, tensor)
    imported = recv_buffer(b)
    assert imported.num_physical_chunks == 8
    assert open_fds() == before
    tensor.segment_view(0).to_numpy()[-1] = 5
    assert imported.segment_view(0).to_numpy()[-1] == 5
    imported.close()
    imported.close()  # twice is fine
    tensor.free()


def test_bad_messages_leave_no_descriptor_open(pair):
    a, b = pair
    tensor = ExtensibleTensor(4 * G, device="cpu")
    tensor.resize_per_segment_(G)
    layout, fds = export_layout(tensor)
    before = open_fds()
    # One descriptor too many for the layout: refused, and every descriptor closed.
    extra = os.dup(fds[0])
    send_layout(a, layout, fds + [extra])
    got_layout, got_fds = recv_layout(b)
    with pytest.raises(ValueError, match="1 chunks but 2 descriptors"):
        ImportedBuffer(got_layout, got_fds)
    os.close(extra)
    for fd in fds:
        os.close(fd)
    assert open_fds() <= before
    # A layout the importer cannot complete (chunks it never received) is refused.
    imported = ImportedBuffer(*export_layout(tensor))
    tensor.resize_per_segment_(3 * G)
    grown, fds = export_layout(tensor)
    with pytest.raises(ValueError, match="never sent"):
        imported.update({**grown, "chunks": []}, [])
    for fd in fds:
        os.close(fd)
    assert imported.committed_sizes == [G]  # unchanged, still readable
    imported.segment_view(0).to_numpy()[0] = 1
    imported.close()
    tensor.free()
    with pytest.raises(ValueError, match="not a jaxbuf layout"):
        ImportedBuffer({"version": 99}, [])


def test_export_without_map_files_permission_says_why(monkeypatch):
    tensor = ExtensibleTensor(4 * G, device="cpu")
    tensor.resize_per_segment_(G)
    real_open = os.open

    def refusing_open(path, *args, **kwargs):
        if str(path).startswith("/proc/self/map_files/"):
            raise PermissionError(1, "Operation not permitted")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    before = open_fds()
    with pytest.raises(DriverError, match="CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE"):
        export_layout(tensor)
    assert open_fds() == before
    monkeypatch.undo()
    tensor.free()


def test_import_on_another_platform_is_refused():
    tensor = ExtensibleTensor(4 * G, device="cpu")
    tensor.resize_per_segment_(G)
    layout, fds = export_layout(tensor)
    before = open_fds()
    with pytest.raises(ValueError):
        ImportedBuffer({**layout, "platform": "cuda"}, fds)  # device "cpu" != platform
    assert open_fds() == before - {str(fd) for fd in fds}
    tensor.free()


def test_host_driver_export_import_pair():
    driver = get_vmm_driver("cpu")
    handle = driver.create(G, 0)
    fd = driver.export_handle(handle)  # created, not mapped yet: a dup
    with pytest.raises(DriverError, match="EINVAL"):
        driver.import_handle(fd, 2 * G, 0)  # wrong size
    imported = driver.import_handle(fd, G, 0)
    os.close(fd)  # the caller keeps its descriptor; the handle has its own
    a = driver.reserve(2 * G)
    driver.map(a, G, handle)
    driver.map(a + G, G, imported)
    driver.memset(a, 9, G, 0)
    out = np.zeros(1, dtype=np.uint8)
    driver.copy(out.ctypes.data, a + G, 1, 0)  # the same memfd, seen at the second address
    assert out[0] == 9
    for ptr, h in ((a, handle), (a + G, imported)):
        driver.unmap(ptr, G)
        driver.release(h)
    driver.free_reserved(a, 2 * G)
    with pytest.raises(DriverError, match="EBADF"):
        driver.export_handle(handle)


def test_host_chunks_are_sealed_0600_and_export_read_only():
    import fcntl
    import stat

    driver = get_vmm_driver("cpu")
    before = open_fds()
    handle = driver.create(G, 0)  # its descriptor is closed once mapped
    seals = fcntl.fcntl(handle.fd, fcntl.F_GET_SEALS)
    wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    assert seals & wanted == wanted
    assert stat.S_IMODE(os.fstat(handle.fd).st_mode) == 0o600
    a = driver.reserve(2 * G)
    try:
        for mapped in (False, True):  # reopened via /proc/self/fd, then /proc/self/map_files
            if mapped:
                driver.map(a, G, handle)
            fd = driver.export_read_only_handle(handle)
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            imported = driver.import_handle(fd, G, 0)
            os.close(fd)
            assert imported.read_only
            with pytest.raises(DriverError, match="EACCES"):
                driver.export_handle(imported)  # never upgraded to read-write
            if mapped:
                driver.map(a + G, G, imported)
                with open("/proc/self/maps") as maps:
                    line = next(m for m in maps if m.startswith(f"{a + G:x}-"))
                assert line.split()[1] == "r--s"
                driver.memset(a, 3, 1, 0)
                out = np.zeros(1, dtype=np.uint8)
                driver.copy(out.ctypes.data, a + G, 1, 0)
                assert out[0] == 3  # the owner's write, read through the read-only mapping
                driver.unmap(a + G, G)
            driver.release(imported)
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(unsealed, G)
        with pytest.raises(DriverError, match="F_SEAL_SHRINK"):
            driver.import_handle(unsealed, G, 0)
        os.close(unsealed)
    finally:
        driver.unmap(a, G)
        driver.release(handle)
        driver.free_reserved(a, 2 * G)
    assert open_fds() == before


def test_bench_sharing_rows():
    import math

    from jaxbuf.bench import load_suites

    rows = list(load_suites()["sharing.import"].run(as_device("cpu"), True))
    assert [row.params["chunks"] for row in rows] == [1, 8]  # --quick sizes
    for row in rows:
        assert math.isfinite(row.median_s) and row.median_s > 0
        assert row.baseline_median_s and row.baseline_median_s > 0
        row.to_json()


# -- ownership: arrays exported from an import outlive its close() -----------------------------
CLOSING_IMPORTER = textwrap.dedent(
    r"""
    import gc, json, os, socket, sys
    import numpy as np
    from jaxbuf.sharing import recv_buffer

    data = socket.socket(fileno=int(sys.argv[1]))
    framework, ending = sys.argv[2], sys.argv[3]
    to_numpy = {
        "numpy": lambda view: view.to_numpy(),
        "torch": lambda view: view.to_torch(),
        "jax": lambda view: view.to_jax(),
    }[framework]
    if framework != "numpy":
        __import__(framework)  # its own descriptors and mappings open before the baseline
    if framework == "jax":
        import jax

        jax.devices()  # backends start lazily; on a GPU machine CUDA opens descriptors too

    def shared_mappings(start, end):
        # Shared (file-backed: the chunks' memfds) mappings inside [start, end).
        count = 0
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                count += lo < end and hi > start and perms.endswith("s")
        return count

    fds_before = len(os.listdir("/proc/self/fd"))
    imported = recv_buffer(data)
    start = imported.base_ptr
    end = start + imported.capacity_bytes
    mapped = shared_mappings(start, end)
    view = imported.segment_view(0)
    array = to_numpy(view)
    exports = imported.live_exports
    if ending == "close":
        imported.close()
        state = dict(closed=imported.closed, released=imported.released,
                     live_exports=imported.live_exports)
        refused = []
        for what, call in (("view", lambda: imported.segment_view(0)),
                           ("export", lambda: view.to_numpy()),
                           ("dlpack", lambda: view.__dlpack__()),
                           ("update", lambda: imported.update({}, []))):
            try:
                call()
                refused.append(what + ": allowed")
            except RuntimeError as error:
                refused.append(str(error))
    else:  # the handle dropped without close(): the same, through the allocation's __del__
        del imported
        gc.collect()
        state, refused = {}, []
    mapped_while_exported = shared_mappings(start, end)
    after_close = np.asarray(array).tobytes()  # a read after close: must not fault
    del array, view
    gc.collect()
    if ending == "close":
        state.update(released_after=imported.released,
                     exports_after=imported.live_exports)
    print(json.dumps(dict(
        mapped=mapped, exports=exports, state=state, refused=refused,
        mapped_while_exported=mapped_while_exported,
        intact=after_close == bytes(range(256)) * (len(after_close) // 256),
        mapped_after=shared_mappings(start, end),
        fd_delta=len(os.listdir("/proc/self/fd")) - fds_before,
    )))
    """
)


def _closing_importer(framework: str, ending: str) -> dict:
    """Owner here, importer in a child (a read of unmapped memory would kill it, not us)."""
    if framework != "numpy":
        pytest.importorskip(framework)
    tensor = ExtensibleTensor(4 * G, device="cpu", num_segments=2)
    tensor.resize_per_segment_(G)
    tensor.segment_view(0).to_numpy()[:] = np.tile(np.arange(256, dtype=np.uint8), G // 256)
    data, child_data = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", CLOSING_IMPORTER, str(child_data.fileno()), framework, ending],
            pass_fds=(child_data.fileno(),),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        child_data.close()
        send_buffer(data, tensor)
        out, err = process.communicate(timeout=120)
    finally:
        data.close()
        tensor.free()
    assert process.returncode == 0, f"importer died (rc={process.returncode}):\n{err}{out}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_arrays_exported_from_an_import_outlive_close(framework):
    result = _closing_importer(framework, "close")
    assert result["mapped"] == 2 and result["exports"] == 1
    # close(): closed, not released while the array lives; nothing new may be made.
    assert result["state"] == {
        "closed": True,
        "released": False,
        "live_exports": 1,
        "released_after": True,
        "exports_after": 0,
    }
    assert len(result["refused"]) == 4
    for message in result["refused"]:
        assert "ImportedBuffer has been closed" in message, message
    assert result["mapped_while_exported"] == 2  # the array keeps the mappings...
    assert result["intact"]  # ...and reads the owner's bytes after close()
    assert result["mapped_after"] == 0  # gone with the last array
    assert result["fd_delta"] == 0


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_arrays_exported_from_an_import_outlive_its_handle(framework):
    result = _closing_importer(framework, "drop")
    assert result["mapped_while_exported"] == 2 and result["intact"]
    assert result["mapped_after"] == 0 and result["fd_delta"] == 0


def test_close_releases_at_once_without_exports_and_refuses_later_use(pair):
    a, b = pair
    tensor = ExtensibleTensor(4 * G, device="cpu")
    tensor.resize_per_segment_(G)
    layout = send_buffer(a, tensor)
    imported = recv_buffer(b)
    view = imported.segment_view(0)
    assert not imported.closed and not imported.released and imported.live_exports == 0
    imported.close()
    assert imported.closed and imported.released and imported.live_exports == 0
    assert imported.num_physical_chunks == 0 and "closed" in repr(imported)
    with pytest.raises(RuntimeError, match="closed"):
        imported.check_exportable()
    with pytest.raises(RuntimeError, match="closed"):
        view.to_numpy()  # a view taken before close()
    with pytest.raises(RuntimeError, match="closed"):
        imported.full_view()
    # refresh refuses before receiving: the owner's next message stays in the socket.
    tensor.resize_per_segment_(2 * G)
    send_buffer(a, tensor, since=layout)
    with pytest.raises(RuntimeError, match="closed"):
        imported.refresh(b)
    layout, fds = recv_layout(b)
    before = open_fds()
    with pytest.raises(RuntimeError, match="closed"):
        imported.update(layout, fds)
    assert open_fds() == before - {str(fd) for fd in fds}  # update closed them anyway
    imported.close()  # twice is fine
    tensor.free()


def test_a_failed_release_is_retried_by_the_next_close(pair):
    from jaxbuf.testing import FaultInjectingDriver

    a, b = pair
    tensor = ExtensibleTensor(4 * G, device="cpu")
    tensor.resize_per_segment_(G)
    send_buffer(a, tensor)
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    imported = recv_buffer(b, driver=driver)
    driver.fail_on("free_reserved")
    with pytest.raises(DriverError):
        imported.close()
    assert imported.closed and not imported.released
    imported.close()
    assert imported.released
    assert not driver.problems()
    tensor.free()
