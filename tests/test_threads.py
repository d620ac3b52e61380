"""Threads: what jaxbuf supports from several threads, tested; what it does not,
documented.

Supported: separate objects driven by separate threads at once. Every thread here owns its
:class:`StagedWriteTensor`, :class:`UvaBufferPool` and :class:`ExtensibleTensor`; they share
the process-wide driver (``get_vmm_driver``), which is thread-safe. Results are checked
against a numpy model per thread.

Not supported: one object driven by several threads (staging into one StagedWriteTensor,
copying through one pool, growing one ExtensibleTensor). Callers serialize those; the class
docstrings say so, which :func:`test_thread_safety_is_documented` checks. No race is tested:
an unsynchronized race is not a behaviour to pin down.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jaxbuf
from jaxbuf.drivers import _posix as posix
from jaxbuf.drivers import get_vmm_driver

THREADS = 4
ROUNDS = 25


def _read(view_or_tensor, device: str) -> np.ndarray:
    if device == "cpu":
        return np.array(view_or_tensor.to_numpy(), copy=True)
    return view_or_tensor.to_torch().cpu().numpy()


def _run_threads(worker, n: int = THREADS) -> None:
    """Start ``n`` threads on ``worker(index, barrier)`` together; re-raise the first error."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def target(index: int) -> None:
        try:
            worker(index, barrier)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(i,), name=f"jaxbuf-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def test_threads_stage_and_apply_separate_tensors(device):
    backend = "numpy" if device == "cpu" else "triton"
    shape = (16, 24)

    def worker(index: int, barrier: threading.Barrier) -> None:
        rng = np.random.default_rng(index)
        dtype = (np.int32, np.float32, np.int64, np.float16)[index % 4]
        model = np.zeros(shape, dtype)
        with jaxbuf.StagedWriteTensor(shape, dtype, device=device, backend=backend) as swt:
            barrier.wait()
            for _ in range(ROUNDS):
                for _ in range(int(rng.integers(1, 12))):
                    row = int(rng.integers(shape[0]))
                    start = int(rng.integers(shape[1]))
                    length = int(rng.integers(1, shape[1] - start + 1))
                    values = rng.integers(-100, 100, length).astype(dtype)
                    swt.stage_write(row, start, values)
                    model[row, start : start + length] = values
                swt.stage_write_elem(index, index + 1)
                model[index, 0] = index + 1
                swt.apply_write()
                np.testing.assert_array_equal(_read(swt, device), model)

    _run_threads(worker)


def test_threads_use_separate_pools(device):
    def worker(index: int, barrier: threading.Barrier) -> None:
        rng = np.random.default_rng(100 + index)
        with jaxbuf.UvaBufferPool((4, 8), "int32", max_concurrency=2, device=device) as pool:
            barrier.wait()
            for step in range(ROUNDS):
                n = int(rng.integers(1, 40))  # past 4 rows a slot grows (a new pinned block)
                x = rng.integers(-1000, 1000, (n, 8), dtype=np.int32) + index * 10_000
                view = pool.copy_to_uva(x)
                np.testing.assert_array_equal(_read(view, device), x)
                if step % 5 == 0:
                    out = pool.copy_to_gpu(x)
                    np.testing.assert_array_equal(out.cpu().numpy(), x)

    pytest.importorskip("torch")
    _run_threads(worker)


def test_threads_grow_and_free_separate_extensible_tensors(device):
    """The shared driver under concurrent reserve/create/map/unmap/release/free_reserved."""
    driver = get_vmm_driver(device)

    def worker(index: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for step in range(ROUNDS):
            value = (index * 37 + step) % 251 + 1
            with jaxbuf.ExtensibleTensor(4 << 20, device=device, num_segments=2) as buf:
                for size in (4096, 256 << 10, 2 << 20):
                    buf.resize_per_segment_(size, zero_new=True)
                for offset in buf.segment_offsets:
                    driver.memset(buf.base_ptr + offset, value, 2 << 20, buf.device.index)
                for s in range(2):
                    got = _read(buf.segment_view(s), device)
                    assert got.size == 2 << 20 and (got == value).all(), (index, step, s)
                buf.release_physical()
                buf.resize_per_segment_(4096, zero_new=True)
                assert not _read(buf.segment_view(1), device).any()

    _run_threads(worker)


def test_threads_everything_at_once_cpu():
    """Staging, pool copies and grows interleaved across threads (CPU, numpy backend)."""

    def worker(index: int, barrier: threading.Barrier) -> None:
        rng = np.random.default_rng(200 + index)
        model = np.zeros((8, 8), np.int32)
        swt = jaxbuf.StagedWriteTensor((8, 8), "int32", device="cpu", backend="numpy")
        pool = jaxbuf.UvaBufferPool((2, 8), "int32", device="cpu")
        buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
        try:
            barrier.wait()
            for step in range(ROUNDS):
                row, value = int(rng.integers(8)), int(rng.integers(1 << 20))
                swt.stage_write(row, 0, [value] * 8)
                model[row] = value
                swt.apply_write()
                x = np.full((step % 7 + 1, 8), value, np.int32)
                np.testing.assert_array_equal(pool.copy_to_uva(x).to_numpy(), x)
                buf.resize_per_segment_(min(4096 * (step + 1), 2 << 20), zero_new=True)
                np.testing.assert_array_equal(swt.to_numpy(), model)
        finally:
            swt.free()
            pool.close()
            buf.free()

    _run_threads(worker, n=6)


#: Public classes and what their docstring must say about threads.
_THREAD_DOCS = {
    jaxbuf.ExtensibleTensor: "not thread-safe",
    jaxbuf.StagedWriteTensor: "not thread-safe",
    jaxbuf.FusedStagedWriter: "not thread-safe",
    jaxbuf.UvaBufferPool: "not thread-safe",
    jaxbuf.UvaBuffer: "not thread-safe",
    jaxbuf.NonUvaBuffer: "not thread-safe",
    jaxbuf.UvaBackedTensor: "not thread-safe",
    jaxbuf.BufferView: "several threads",
}


@pytest.mark.parametrize("cls", list(_THREAD_DOCS), ids=lambda cls: cls.__name__)
def test_thread_safety_is_documented(cls):
    """Sharing one object between threads is not supported (documented, not raced).

    E.g. two threads staging into one StagedWriteTensor could interleave a record with
    another write's contents; two threads copying through one UvaBufferPool could both take
    the same slot. Each class says so; a view is the exception (exported from any thread).
    """
    doc = " ".join((cls.__doc__ or "").split()).lower()
    expected = _THREAD_DOCS[cls]
    assert expected in doc, f"{cls.__name__}'s docstring does not say {expected!r}"


def test_drivers_document_thread_safety():
    from jaxbuf.drivers import HostVmmDriver

    for cls in (HostVmmDriver, type(get_vmm_driver("cpu"))):
        assert "thread-safe" in " ".join((cls.__doc__ or "").split()).lower(), cls
    try:
        from jaxbuf.drivers.cuda import CudaVmmDriver
    except ImportError:  # pragma: no cover - cuda-bindings missing
        return
    assert "thread-safe" in " ".join((CudaVmmDriver.__doc__ or "").split()).lower()


def test_host_free_race_with_host_alloc_reusing_the_address(monkeypatch):
    """Regression (found by test_threads_use_separate_pools): ``HostVmmDriver.host_free``
    deleted its record *after* ``munmap``; a ``host_alloc`` on another thread that got the
    same address in between had its record deleted, so its own ``host_free`` later failed
    ("not from host_alloc") and its block leaked. The interleaving is forced here: inside the
    ``munmap`` of block P, a ``host_alloc`` maps P again (MAP_FIXED, as the kernel may)."""
    from jaxbuf.drivers import host

    driver = host.HostVmmDriver()
    size = 8192
    ptr, _ = driver.host_alloc(size, 0)
    real_mmap, real_munmap = host.mmap_or_raise, host.munmap_or_raise
    reused: list[int] = []

    def mmap_at_ptr(addr, length, prot, flags, fd, **details):
        return real_mmap(ptr, length, prot, flags | posix.MAP_FIXED, fd, **details)

    def munmap_then_other_thread_allocates(p, n):
        real_munmap(p, n)
        if p == ptr and not reused:
            monkeypatch.setattr(host, "mmap_or_raise", mmap_at_ptr)
            try:
                reused.append(driver.host_alloc(size, 0)[0])  # "another thread"
            finally:
                monkeypatch.setattr(host, "mmap_or_raise", real_mmap)

    monkeypatch.setattr(host, "munmap_or_raise", munmap_then_other_thread_allocates)
    driver.host_free(ptr)
    monkeypatch.setattr(host, "munmap_or_raise", real_munmap)
    assert reused == [ptr]
    driver.host_free(reused[0])  # failed with "not from host_alloc" before the fix
    assert driver._host_allocations == {}


def test_frameworks_half_imported_by_another_thread_count_as_not_loaded(monkeypatch):
    # Found on the H200: Triton imported torch in one thread while a staged apply in another
    # looked torch up in sys.modules for its current stream and met the half-built module
    # ("partially initialized module 'torch' has no attribute 'cuda'").
    import importlib.machinery
    import sys
    import types

    from jaxbuf import interop
    from jaxbuf.devices import as_device

    half_built = types.ModuleType("torch")  # no Tensor, no cuda yet
    half_built.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    half_built.__spec__._initializing = True
    monkeypatch.setitem(sys.modules, "torch", half_built)
    torch_adapter = interop.get("torch")
    # As in a process where torch is not imported yet: the stream getter is bound only once
    # torch has initialised CUDA (another test may have bound it in this process).
    monkeypatch.setattr(torch_adapter, "_raw_stream", None)
    assert interop.loaded_module("torch") is None
    assert not torch_adapter.is_array(np.zeros(1))
    assert interop.adapter_for(np.zeros(1)) is interop.get("numpy")
    assert torch_adapter.current_stream(as_device("cuda:0")) is None
    assert interop.current_stream(as_device("cuda:0")) == 1  # the legacy stream
    half_built.__spec__._initializing = False  # done: now it is the module
    assert interop.loaded_module("torch") is half_built
