"""CudaVmmDriver against a real GPU (marked ``gpu``), plus CPU checks of its probe and of
its retry logic on a stand-in binding module."""

from __future__ import annotations

import ctypes
import pathlib
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest

from jaxbuf.drivers import cuda as cuda_driver
from jaxbuf.drivers._cuda_streams import MAX_SPARE_EVENTS
from jaxbuf.drivers.base import K_DL_CUDA, K_DL_CUDA_HOST, DriverError
from jaxbuf.drivers.cuda import COPY_BATCH_STREAM, CudaVmmDriver
from jaxbuf.testing import FaultInjectingDriver

_REASON = CudaVmmDriver().unavailable_reason()
needs_cuda = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
def driver() -> CudaVmmDriver:
    driver = CudaVmmDriver()
    driver.ensure_context(0)
    return driver


@pytest.fixture
def chunk(driver):
    """One granule reserved (with room for a second), created, mapped and accessible."""
    size = driver.granularity(0)
    base = driver.reserve(2 * size)
    handle = driver.create(size, 0)
    driver.map(base, size, handle)
    driver.set_access(base, size, 0)
    yield base, size
    driver.synchronize(0)
    driver.unmap(base, size)
    driver.release(handle)
    driver.free_reserved(base, 2 * size)


@pytest.fixture
def pinned(driver, chunk):
    _, size = chunk
    host_ptr, device_ptr = driver.host_alloc(size, 0)
    yield host_ptr, device_ptr
    driver.host_free(host_ptr)


# -- on the GPU -------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
class TestOnGpu:
    def test_available(self):
        driver = CudaVmmDriver()
        assert driver.unavailable_reason() is None
        assert driver.device_count() >= 1
        assert driver.platform == "cuda"
        assert driver.dlpack_device_type == K_DL_CUDA == 2
        assert driver.dlpack_host_device_type == K_DL_CUDA_HOST == 3

    def test_granularity_is_a_power_of_two(self, driver):
        granularity = driver.granularity(0)
        assert granularity >= 4096
        assert granularity & (granularity - 1) == 0
        assert driver.granularity(0) == granularity

    def test_memset_and_copy_round_trip(self, driver, chunk, pinned):
        base, size = chunk
        host_ptr, device_ptr = pinned
        driver.memset(base, 0xAB, size, 0)
        driver.copy(device_ptr, base, size, 0)
        driver.synchronize(0)
        assert ctypes.string_at(host_ptr, size) == b"\xab" * size

        # host -> device -> host again, through the device chunk, with a pattern.
        pattern = bytes(range(256)) * (size // 256)
        ctypes.memmove(host_ptr, pattern, size)
        driver.copy(base, device_ptr, size, 0)
        driver.memset(device_ptr, 0, size, 0)
        driver.copy(device_ptr, base, size, 0)
        driver.synchronize(0)
        assert ctypes.string_at(host_ptr, size) == pattern

    def test_host_alloc_pointers(self, driver):
        host_ptr, device_ptr = driver.host_alloc(4096, 0)
        try:
            assert isinstance(host_ptr, int) and isinstance(device_ptr, int)
            assert host_ptr != 0 and device_ptr != 0
            ctypes.memset(host_ptr, 7, 4096)  # the host pointer is writable memory
        finally:
            driver.host_free(host_ptr)

    def test_reserve_returns_aligned_int(self, driver):
        size = driver.granularity(0)
        base = driver.reserve(4 * size, alignment=2 * size)
        try:
            assert isinstance(base, int)
            assert base % (2 * size) == 0
        finally:
            driver.free_reserved(base, 4 * size)

    def test_out_of_memory_names_call_and_error(self, driver):
        with pytest.raises(DriverError) as info:
            driver.create(2**50, 0)
        message = str(info.value)
        assert "cuMemCreate" in message and "OUT_OF_MEMORY" in message
        assert f"size={2**50}" in message
        assert info.value.out_of_memory

    def test_map_of_unaligned_size_fails(self, driver):
        size = driver.granularity(0)
        base = driver.reserve(2 * size)
        handle = driver.create(size, 0)
        try:
            with pytest.raises(DriverError) as info:
                driver.map(base, size + 1, handle)
            assert info.value.call == "cuMemMap"
            assert info.value.error_name.startswith("CUDA_ERROR_")
            assert "cuMemMap(" in str(info.value)
        finally:
            driver.release(handle)
            driver.free_reserved(base, 2 * size)

    def test_set_access_over_part_of_a_chunk_fails(self, driver):
        # cuMemSetAccess documents that the range must cover whole mapped allocations.
        granularity = driver.granularity(0)
        size = 2 * granularity
        base = driver.reserve(size)
        handle = driver.create(size, 0)
        driver.map(base, size, handle)
        try:
            with pytest.raises(DriverError) as info:
                driver.set_access(base, granularity, 0)
            assert info.value.call == "cuMemSetAccess"
            assert info.value.error_name == "CUDA_ERROR_INVALID_VALUE"
        finally:
            driver.unmap(base, size)
            driver.release(handle)
            driver.free_reserved(base, size)

    def test_ensure_context_in_a_fresh_thread(self, driver):
        from cuda.bindings import driver as cu

        seen: dict[str, object] = {}

        def work() -> None:
            try:
                seen["before"] = int(cu.cuCtxGetCurrent()[1])
                driver.ensure_context(0)
                driver.ensure_context(0)  # the fast path
                seen["after"] = int(cu.cuCtxGetCurrent()[1])
                seen["device"] = int(cu.cuCtxGetDevice()[1])
                driver.synchronize(0)
            except BaseException as error:  # reported in the main thread
                seen["error"] = error

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert "error" not in seen, seen.get("error")
        assert seen["before"] == 0
        assert seen["after"] == int(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
        assert seen["device"] == 0
        cu.cuDevicePrimaryCtxRelease(cu.cuDeviceGet(0)[1])

    def test_ensure_context_rejects_bad_index(self, driver):
        with pytest.raises(IndexError, match="99"):
            driver.ensure_context(99)

    def test_ready_event_and_stream_wait(self, driver, chunk):
        from cuda.bindings import driver as cu

        base, size = chunk
        driver.memset(base, 1, size, 0)
        error, stream = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        assert error == cu.CUresult.CUDA_SUCCESS
        event = driver.record_ready_event(0)
        try:
            for dlpack_stream in (1, 2, int(stream)):
                driver.stream_wait_event(dlpack_stream, event, 0)
            assert cu.cuStreamSynchronize(stream)[0] == cu.CUresult.CUDA_SUCCESS
            with pytest.raises(ValueError, match="0"):
                driver.stream_wait_event(0, event, 0)
        finally:
            driver.destroy_event(event)
            cu.cuStreamDestroy(stream)

    def test_works_before_any_framework(self):
        # A fresh interpreter where neither torch nor JAX has touched the device.
        script = textwrap.dedent(
            """
            import ctypes, sys
            from jaxbuf.drivers.cuda import CudaVmmDriver
            driver = CudaVmmDriver()
            driver.ensure_context(0)
            size = driver.granularity(0)
            base = driver.reserve(size)
            handle = driver.create(size, 0)
            driver.map(base, size, handle)
            driver.set_access(base, size, 0)
            host_ptr, device_ptr = driver.host_alloc(size, 0)
            driver.memset(base, 0x5A, size, 0)
            driver.copy(device_ptr, base, size, 0)
            driver.synchronize(0)
            assert ctypes.string_at(host_ptr, size) == b"\\x5a" * size
            driver.host_free(host_ptr)
            driver.unmap(base, size)
            driver.release(handle)
            driver.free_reserved(base, size)
            assert "torch" not in sys.modules and "jax" not in sys.modules
            print("ok")
            """
        )
        repo_root = pathlib.Path(__file__).resolve().parents[1]
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=repo_root,  # `python -c` puts the working directory on sys.path
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "ok"

    # -- copy_batch -------------------------------------------------------------------
    @pytest.mark.parametrize("method", ["default", "c_loop", "bindings"])
    @pytest.mark.parametrize("count", [1, 64, 1024])
    def test_copy_batch_between_two_allocations(self, driver, method, count):
        # The KV transfer's shape: blocks of one device allocation copied into another, in a
        # shuffled order, some short, one empty; checked against numpy through pinned memory.
        _use_copy_batch_method(driver, method)
        size = 2 << 20
        a, b = driver.device_alloc(size, 0), driver.device_alloc(size, 0)
        host_ptr, device_ptr = driver.host_alloc(size, 0)
        try:
            host = _host_array(host_ptr, size)
            rng = np.random.default_rng(count)
            host[:] = rng.integers(0, 256, size, dtype=np.uint8)
            pattern = host.copy()
            driver.copy(a.ptr, device_ptr, size, 0)
            driver.memset(b.ptr, 0, size, 0)
            block = size // count
            order = rng.permutation(count)
            lengths = rng.integers(1, block + 1, count)
            lengths[count // 2] = 0 if count > 1 else lengths[0]
            dsts = (b.ptr + order * block).astype(np.uint64)
            srcs = (a.ptr + np.arange(count) * block).astype(np.uint64)
            sizes = lengths.astype(np.uint64)
            event = driver.copy_batch(dsts, srcs, sizes, 0)
            assert event is not None
            driver.event_synchronize(event)
            assert driver.event_query(event)
            driver.destroy_event(event)
            expected = np.zeros(size, np.uint8)
            for i in range(count):
                start = order[i] * block
                expected[start : start + lengths[i]] = pattern[i * block : i * block + lengths[i]]
            host[:] = 0xEE
            driver.copy(device_ptr, b.ptr, size, 0)
            driver.synchronize(0)
            np.testing.assert_array_equal(host, expected)
        finally:
            driver.host_free(host_ptr)
            a.release()
            b.release()

    @pytest.mark.parametrize("method", ["default", "c_loop", "bindings"])
    def test_copy_batch_between_host_and_device(self, driver, method):
        _use_copy_batch_method(driver, method)
        size, count = 1 << 20, 64
        block = size // count
        memory = driver.device_alloc(size, 0)
        host_ptr, device_ptr = driver.host_alloc(2 * size, 0)
        try:
            host = _host_array(host_ptr, 2 * size)
            host[:size] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
            host[size:] = 0
            offsets = np.arange(count, dtype=np.uint64) * block
            sizes = np.full(count, block, np.uint64)
            up = driver.copy_batch(memory.ptr + offsets[::-1], device_ptr + offsets, sizes, 0)
            down = driver.copy_batch(device_ptr + size + offsets, memory.ptr + offsets, sizes, 0)
            driver.event_synchronize(down)  # one stream: the upload is done too
            for event in (up, down):
                driver.destroy_event(event)
            blocks = host[:size].reshape(count, block)
            np.testing.assert_array_equal(host[size:].reshape(count, block), blocks[::-1])
        finally:
            driver.host_free(host_ptr)
            memory.release()

    def test_copy_batch_is_ordered_with_the_producer_stream(self, driver):
        # The batch stream (per-thread default) waits for the memset on the legacy stream,
        # and a copy enqueued there afterwards waits for the batch: no event needed.
        size = 4 << 20
        a, b = driver.device_alloc(size, 0), driver.device_alloc(size, 0)
        host_ptr, device_ptr = driver.host_alloc(size, 0)
        try:
            driver.memset(a.ptr, 0x11, size, 0)
            arrays = [np.array([value], np.uint64) for value in (b.ptr, a.ptr, size)]
            event = driver.copy_batch(*arrays, 0)
            driver.copy(device_ptr, b.ptr, size, 0)
            driver.synchronize(0)
            driver.destroy_event(event)
            assert (_host_array(host_ptr, size) == 0x11).all()
        finally:
            driver.host_free(host_ptr)
            a.release()
            b.release()

    def test_copy_batch_empty_and_bad_input(self, driver, chunk, pinned):
        base, size = chunk
        host_ptr, _ = pinned
        empty = np.zeros(0, np.uint64)
        event = driver.copy_batch(empty, empty, empty, 0)
        driver.event_synchronize(event)
        assert driver.event_query(event)
        driver.destroy_event(event)
        driver.memset(base, 0x22, size, 0)
        driver.synchronize(0)
        good = [np.array([value], np.uint64) for value in (base, host_ptr, 16)]
        for arguments, error in (
            ((good[0], good[1], np.zeros(2, np.uint64)), ValueError),
            ((good[0].astype(np.int64), good[1], good[2]), TypeError),
            ((good[0], [host_ptr], good[2]), TypeError),
            (
                (np.repeat(good[0], 4)[::2], np.repeat(good[1], 2), np.repeat(good[2], 2)),
                ValueError,
            ),
        ):
            with pytest.raises(error):
                driver.copy_batch(*arguments, 0)
        with pytest.raises(IndexError):
            driver.copy_batch(*good, 99)
        driver.copy(host_ptr, base, size, 0)
        driver.synchronize(0)
        assert ctypes.string_at(host_ptr, size) == b"\x22" * size  # nothing was copied

    def test_copy_batch_method_on_this_machine(self, driver):
        from cuda.bindings import driver as cu

        method = driver.copy_batch_method
        print(f"copy_batch: {method}")
        _, version = cu.cuDriverGetVersion()
        if driver._calls is None:
            assert method == "cuMemcpyAsync per copy through cuda.bindings"
        elif version >= 13000:
            assert method == "cuMemcpyBatchAsync (ABI 13000) from C"
        elif version >= 12080:
            assert method == "cuMemcpyBatchAsync (ABI 12080) from C"
        else:
            assert method == "cuMemcpyAsync per copy from C"

    def test_copy_batch_through_the_fault_injecting_driver(self, driver, chunk, pinned):
        base, size = chunk
        host_ptr, _ = pinned
        faulty = FaultInjectingDriver(driver)
        arrays = [np.array([value], np.uint64) for value in (host_ptr, base, size)]
        faulty.fail_on("copy_batch")
        with pytest.raises(DriverError, match="cuMemcpyBatchAsync.*INJECTED_FAULT"):
            faulty.copy_batch(*arrays, 0)
        event = faulty.copy_batch(*arrays, 0)
        assert id(event) in faulty.live_events
        faulty.event_synchronize(event)
        faulty.destroy_event(event)
        assert not faulty.live_events and not faulty.violations

    def test_confidential_computing_reason_is_none_or_sentence(self):
        reason = CudaVmmDriver().confidential_computing_reason()
        assert reason is None or (isinstance(reason, str) and reason.endswith("."))


# -- on the CPU -------------------------------------------------------------------------
def test_unavailable_reason_is_a_sentence_without_gpu():
    if _REASON is None:
        pytest.skip("a usable CUDA GPU is present")
    driver = CudaVmmDriver()
    reason = driver.unavailable_reason()
    assert isinstance(reason, str) and reason.strip() and reason.endswith(".")
    assert driver.unavailable_reason() is reason  # cached
    assert driver.device_count() == 0
    with pytest.raises(DriverError, match="CUDA unavailable"):
        driver.ensure_context(0)


def _stand_in_binding(monkeypatch, **calls):
    """Replace the binding's named calls (the rest stay real) for logic-only tests."""
    cu = pytest.importorskip("cuda.bindings.driver")
    fake = types.SimpleNamespace(**{name: getattr(cu, name) for name in dir(cu)})
    fake.cuGetErrorName = lambda error: (cu.CUresult.CUDA_SUCCESS, error.name.encode())
    for name, call in calls.items():
        setattr(fake, name, call)
    monkeypatch.setattr(cuda_driver, "_cu", fake)
    return cu


def _driver_with_context(cu) -> CudaVmmDriver:
    driver = CudaVmmDriver()
    driver._unavailable_reason = None
    driver._device_count = 1
    driver._primary_contexts[0] = (cu.CUcontext(0x1234), 0x1234)
    return driver


def test_check_unpacks_results_and_names_errors(monkeypatch):
    cu = _stand_in_binding(monkeypatch)
    ok = cu.CUresult.CUDA_SUCCESS
    check = CudaVmmDriver()._check  # the driver holds its binding: the stand-in, made after it
    assert check((ok,), "cuX") is None
    assert check((ok, 5), "cuX") == 5
    assert check((ok, 5, 6), "cuX") == (5, 6)
    with pytest.raises(DriverError) as info:
        check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemCreate", size=8)
    assert str(info.value) == "cuMemCreate(size=8) failed: CUDA_ERROR_OUT_OF_MEMORY"
    assert info.value.out_of_memory


def test_create_retries_once_after_torch_empties_its_cache(monkeypatch):
    created = []

    def cu_mem_create(size, prop, flags):
        created.append(size)
        if len(created) == 1:
            return (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        return (cu.CUresult.CUDA_SUCCESS, cu.CUmemGenericAllocationHandle(99))

    cu = _stand_in_binding(
        monkeypatch,
        cuMemCreate=cu_mem_create,
        cuCtxGetCurrent=lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(0x1234)),
        cuDeviceGetAttribute=lambda attribute, device: (cu.CUresult.CUDA_SUCCESS, 1),
    )
    emptied = []
    fake_cuda = types.SimpleNamespace(
        is_initialized=lambda: True, empty_cache=lambda: emptied.append(1)
    )
    fake_torch = types.SimpleNamespace(cuda=fake_cuda)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)

    driver = _driver_with_context(cu)
    handle = driver.create(2 << 20, 0)
    assert int(handle) == 99
    assert created == [2 << 20, 2 << 20]
    assert emptied == [1]


def test_create_out_of_memory_without_frameworks_raises(monkeypatch):
    calls = []

    def cu_mem_create(size, prop, flags):
        calls.append(size)
        return (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)

    cu = _stand_in_binding(
        monkeypatch,
        cuMemCreate=cu_mem_create,
        cuCtxGetCurrent=lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(0x1234)),
        cuDeviceGetAttribute=lambda attribute, device: (cu.CUresult.CUDA_SUCCESS, 1),
    )
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    driver = _driver_with_context(cu)
    with pytest.raises(DriverError, match=r"cuMemCreate\(size=4096, device=0\).*OUT_OF_MEMORY"):
        driver.create(4096, 0)
    assert calls == [4096]


def test_create_falls_back_when_handle_export_is_refused(monkeypatch):
    requested = []

    def cu_mem_create(size, prop, flags):
        requested.append(prop.requestedHandleTypes)
        if prop.requestedHandleTypes != types_.CU_MEM_HANDLE_TYPE_NONE:
            return (cu.CUresult.CUDA_ERROR_NOT_SUPPORTED, None)
        return (cu.CUresult.CUDA_SUCCESS, cu.CUmemGenericAllocationHandle(7))

    cu = _stand_in_binding(
        monkeypatch,
        cuMemCreate=cu_mem_create,
        cuCtxGetCurrent=lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(0x1234)),
        cuDeviceGetAttribute=lambda attribute, device: (cu.CUresult.CUDA_SUCCESS, 1),
    )
    types_ = cu.CUmemAllocationHandleType
    driver = _driver_with_context(cu)
    assert int(driver.create(4096, 0)) == 7
    assert int(driver.create(4096, 0)) == 7
    posix, none = types_.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, types_.CU_MEM_HANDLE_TYPE_NONE
    assert requested == [posix, none, none]  # the refusal is remembered


def test_ensure_context_fast_path_and_switch(monkeypatch):
    set_to = []
    current = {"ctx": 0x1234}
    cu = _stand_in_binding(
        monkeypatch,
        cuCtxGetCurrent=lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(current["ctx"])),
        cuCtxSetCurrent=lambda ctx: (set_to.append(int(ctx)), (cu.CUresult.CUDA_SUCCESS,))[1],
    )
    driver = _driver_with_context(cu)
    driver.ensure_context(0)
    assert set_to == []
    current["ctx"] = 0  # another library left no (or another) context current
    driver.ensure_context(0)
    assert set_to == [0x1234]


def test_stream_wait_event_maps_dlpack_streams(monkeypatch):
    waited = []
    cu = _stand_in_binding(
        monkeypatch,
        cuCtxGetCurrent=lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(0x1234)),
        cuStreamWaitEvent=lambda stream, event, flags: (
            waited.append(int(stream)),
            (cu.CUresult.CUDA_SUCCESS,),
        )[1],
    )
    driver = _driver_with_context(cu)
    for stream in (1, 2, 0x7F00DEAD):
        driver.stream_wait_event(stream, cu.CUevent(), 0)
    assert waited == [int(cu.CU_STREAM_LEGACY), int(cu.CU_STREAM_PER_THREAD), 0x7F00DEAD]
    for bad in (0, -1, None):
        with pytest.raises(ValueError):
            driver.stream_wait_event(bad, cu.CUevent(), 0)


def test_the_binding_is_held_per_instance():
    # A HIP driver is a subclass passing its own binding: every call goes through it, and the
    # module-level default (cuda.bindings.driver) stays untouched for other instances.
    cu = pytest.importorskip("cuda.bindings.driver")
    mapped = []
    fake = types.SimpleNamespace(**{name: getattr(cu, name) for name in dir(cu)})
    fake.cuMemMap = lambda *args: (mapped.append(args), (cu.CUresult.CUDA_SUCCESS,))[1]
    driver = CudaVmmDriver(binding=fake)
    driver.map(0x1000, 4096, 7)
    assert mapped == [(0x1000, 4096, 0, 7, 0)]
    assert CudaVmmDriver()._cu is cuda_driver._cu is cu


def _event_binding(monkeypatch, record_error=None):
    """A stand-in binding whose events are numbered; returns (cu, log of calls)."""
    log = {"created": [], "destroyed": [], "recorded": []}
    counter = iter(range(0x100, 0x10000))

    def create(flags):
        event = cu.CUevent(next(counter))
        log["created"].append(int(event))
        return cu.CUresult.CUDA_SUCCESS, event

    def record(event, stream):
        log["recorded"].append((int(event), int(stream)))
        return ((record_error or cu.CUresult.CUDA_SUCCESS),)

    cu = _stand_in_binding(
        monkeypatch,
        cuCtxGetCurrent=lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(0x1234)),
        cuEventCreate=create,
        cuEventRecord=record,
        cuEventDestroy=lambda event: (
            log["destroyed"].append(int(event)),
            (cu.CUresult.CUDA_SUCCESS,),
        )[1],
    )
    return cu, log


def test_record_event_reuses_given_back_events(monkeypatch):
    # An apply records one event per launch: given-back events are recorded again instead of
    # being destroyed and created anew, per device (an event belongs to its context).
    cu, log = _event_binding(monkeypatch)
    driver = _driver_with_context(cu)
    first = driver.record_event(1, 0)
    driver.destroy_event(first)
    second = driver.record_event(0x7F00, 0)
    assert int(second) == int(first) and log["created"] == [int(first)]
    assert log["destroyed"] == []
    assert log["recorded"] == [(int(first), int(cu.CU_STREAM_LEGACY)), (int(first), 0x7F00)]
    # Two live events are two events; both come back and are reused, never shared.
    third = driver.record_event(1, 0)
    assert int(third) != int(second) and len(log["created"]) == 2
    for event in (second, third):
        driver.destroy_event(event)
    again = {int(driver.record_event(1, 0)), int(driver.record_event(1, 0))}
    assert again == {int(second), int(third)} and len(log["created"]) == 2


def test_spare_events_are_bounded(monkeypatch):
    cu, log = _event_binding(monkeypatch)
    driver = _driver_with_context(cu)
    events = [driver.record_event(1, 0) for _ in range(MAX_SPARE_EVENTS + 3)]
    for event in events:
        driver.destroy_event(event)
    assert len(log["destroyed"]) == 3  # beyond the bound they are destroyed
    assert len(driver._spare_events[0]) == MAX_SPARE_EVENTS


def test_record_event_failure_reports_and_keeps_the_event(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    cu, log = _event_binding(monkeypatch, record_error=real.CUresult.CUDA_ERROR_INVALID_HANDLE)
    driver = _driver_with_context(cu)
    with pytest.raises(DriverError, match="cuEventRecord.*CUDA_ERROR_INVALID_HANDLE"):
        driver.record_event(1, 0)
    assert len(driver._spare_events[0]) == 1  # not leaked: the next record reuses it
    for bad in (0, -1, None, "1"):
        with pytest.raises(ValueError):
            driver.record_event(bad, 0)


# -- copy_batch on the CPU: stand-ins for libcuda ----------------------------------------------
def _host_array(ptr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


def _use_copy_batch_method(driver, method: str) -> None:
    """Make ``driver.copy_batch`` take one path: "default" (what the machine has), "c_loop"
    (the C calls without cuMemcpyBatchAsync) or "bindings" (no C calls)."""
    if method == "c_loop":
        if driver._calls is None:
            pytest.skip(f"the C calls are off: {driver.c_calls_reason}")
        driver._calls = driver._load_calls()
        assert driver._calls.memcpy_batch_version == 0
    elif method == "bindings":
        driver._calls = None


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes_v1
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_U64P = ctypes.POINTER(ctypes.c_uint64)
_SIZEP = ctypes.POINTER(ctypes.c_size_t)
_STAND_IN_SIGNATURES = {
    "cuCtxGetCurrent": (ctypes.c_int, ctypes.POINTER(_P)),
    "cuCtxSetCurrent": (ctypes.c_int, _P),
    "cuLaunchKernel": (ctypes.c_int, _P, *[ctypes.c_uint] * 7, _P, _P, _P),
    "cuEventRecord": (ctypes.c_int, _P, _P),
    "cuEventQuery": (ctypes.c_int, _P),
    "cuMemcpyAsync": (ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, _P),
}
_BATCH_ARGUMENTS = (_U64P, _U64P, _SIZEP, ctypes.c_size_t, ctypes.POINTER(_Attributes), _SIZEP)
_BATCH_SIGNATURES = {
    12080: (ctypes.c_int, *_BATCH_ARGUMENTS, ctypes.c_size_t, _SIZEP, _P),
    13000: (ctypes.c_int, *_BATCH_ARGUMENTS, ctypes.c_size_t, _P),
}


class _StandInLibcuda:
    """ctypes callbacks standing in for the driver functions ``_cuda_calls`` calls: copies are
    real ``memmove``s on host memory, every call is logged, ``results[name]`` is returned
    (default 0), and the 12.8 batch reports ``fail_index`` when it fails."""

    def __init__(self, calls_module) -> None:
        self.log: list[tuple] = []
        self.results: dict[str, int] = {}
        self.fail_index: int | None = None
        self._callbacks = {}
        for name in calls_module.SYMBOLS:
            handler = getattr(self, "_" + name, None) or self._logged(name)
            self._callbacks[name] = ctypes.CFUNCTYPE(*_STAND_IN_SIGNATURES[name])(handler)
        for version, signature in _BATCH_SIGNATURES.items():
            self._callbacks[version] = ctypes.CFUNCTYPE(*signature)(self._batch(version))
        self.entry_points = calls_module.EntryPoints(
            [self.address(name) for name in calls_module.SYMBOLS]
        )

    def address(self, key) -> int:
        return ctypes.cast(self._callbacks[key], ctypes.c_void_p).value

    def _logged(self, name):
        def handler(*args):
            self.log.append((name,))
            return self.results.get(name, 0)

        return handler

    def _cuCtxGetCurrent(self, out):
        out[0] = 0x1234
        return 0

    def _cuMemcpyAsync(self, dst, src, size, stream):
        self.log.append(("cuMemcpyAsync", dst, src, size, stream or 0))
        result = self.results.get("cuMemcpyAsync", 0)
        if not result:
            ctypes.memmove(dst, src, size)
        return result

    def _batch(self, version):
        def handler(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, *rest):
            fail_idx, stream = (rest[0], rest[1]) if version == 12080 else (None, rest[0])
            attributes = attrs[0]
            self.log.append(
                (
                    f"cuMemcpyBatchAsync_{version}",
                    [(dsts[i], srcs[i], sizes[i]) for i in range(count)],
                    (
                        attributes.srcAccessOrder,
                        (attributes.srcLocHint.type, attributes.srcLocHint.id),
                        (attributes.dstLocHint.type, attributes.dstLocHint.id),
                        attributes.flags,
                    ),
                    attrs_idxs[0],
                    num_attrs,
                    stream or 0,
                )
            )
            result = self.results.get("cuMemcpyBatchAsync", 0)
            if result:
                if fail_idx and self.fail_index is not None:
                    fail_idx[0] = self.fail_index
                return result
            for i in range(count):
                ctypes.memmove(dsts[i], srcs[i], sizes[i])
            return 0

        return handler


ABIS = [13000, 12080, 0]  # 0: no cuMemcpyBatchAsync, the C loop of cuMemcpyAsync


@pytest.fixture
def stand_in(monkeypatch):
    """(driver, libcuda stand-in, log of synchronize calls): a CUDA driver that believes device
    0's context is 0x1234, making its C calls into ``_StandInLibcuda`` and its events through
    a stand-in binding."""
    calls_module = pytest.importorskip("jaxbuf.drivers._cuda_calls")
    cu, _ = _event_binding(monkeypatch)
    driver = _driver_with_context(cu)
    libcuda = _StandInLibcuda(calls_module)
    driver._calls = libcuda.entry_points
    synchronized = []
    monkeypatch.setattr(driver, "synchronize", synchronized.append)
    return driver, libcuda, synchronized


def _with_abi(driver, libcuda, abi):
    if abi:
        driver._calls = libcuda.entry_points.with_memcpy_batch(libcuda.address(abi), abi)
    assert driver._calls.memcpy_batch_version == abi


def _blocks(count, block=16, seed=0):
    """(target, source, dsts, srcs, sizes, expected) for ``count`` shuffled blocks."""
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, count * block, dtype=np.uint8)
    target = np.zeros(count * block, np.uint8)
    order = rng.permutation(count)
    dsts = (target.ctypes.data + order * block).astype(np.uint64)
    srcs = (source.ctypes.data + np.arange(count) * block).astype(np.uint64)
    sizes = np.full(count, block, np.uint64)
    expected = np.zeros_like(target).reshape(count, block)
    expected[order] = source.reshape(count, block)
    return target, source, dsts, srcs, sizes, expected.ravel()


@pytest.mark.parametrize("abi", ABIS)
@pytest.mark.parametrize("count", [1, 64, 1024])
def test_copy_batch_from_c(stand_in, abi, count):
    driver, libcuda, synchronized = stand_in
    _with_abi(driver, libcuda, abi)
    target, source, dsts, srcs, sizes, expected = _blocks(count)
    event = driver.copy_batch(dsts, srcs, sizes, 0)
    np.testing.assert_array_equal(target, expected)
    copies = [entry for entry in libcuda.log if entry[0].startswith("cuMemcpy")]
    per_thread = COPY_BATCH_STREAM  # CU_STREAM_PER_THREAD: the legacy stream is refused
    if abi and count > 1:  # one copy alone is a cuMemcpyAsync: the batch call costs more
        (batch,) = copies
        name, triples, attributes, first_copy, num_attrs, stream = batch
        assert name == f"cuMemcpyBatchAsync_{abi}" and len(triples) == count
        assert triples == list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist()))
        # One attribute entry for every copy: sources read in stream order, no hints.
        assert attributes == (1, (0, 0), (0, 0), 0)
        assert (first_copy, num_attrs, stream) == (0, 1, per_thread)
    else:
        assert len(copies) == count and {entry[4] for entry in copies} == {per_thread}
    assert ("cuEventRecord",) in libcuda.log  # the event is recorded after the copies
    assert event is not None and not synchronized


@pytest.mark.parametrize("abi", ABIS)
def test_copy_batch_skips_copies_of_size_zero(stand_in, abi):
    driver, libcuda, _ = stand_in
    _with_abi(driver, libcuda, abi)
    target, source, dsts, srcs, sizes, expected = _blocks(6)
    sizes[[1, 4, 5]] = 0
    expected = expected.reshape(6, 16)
    order = (dsts - target.ctypes.data) // 16
    expected[order[[1, 4, 5]].astype(int)] = 0
    driver.copy_batch(dsts, srcs, sizes, 0)
    np.testing.assert_array_equal(target, expected.ravel())
    copies = [entry for entry in libcuda.log if entry[0].startswith("cuMemcpy")]
    if abi:  # one batch per run of non-empty copies: [0], [2, 3]
        assert [len(entry[1]) for entry in copies] == [1, 2]
    else:
        assert len(copies) == 3


def test_copy_batch_of_nothing_records_an_event(stand_in):
    driver, libcuda, _ = stand_in
    _with_abi(driver, libcuda, 13000)
    empty = np.zeros(0, np.uint64)
    assert driver.copy_batch(empty, empty, empty, 0) is not None
    assert not [entry for entry in libcuda.log if entry[0].startswith("cuMemcpy")]
    assert ("cuEventRecord",) in libcuda.log


@pytest.mark.parametrize(
    "abi, fail_index, reported",
    [(12080, 2, 2), (12080, None, None), (13000, None, None), (0, None, 0)],
)
def test_copy_batch_failure_names_the_call_and_waits(stand_in, abi, fail_index, reported):
    real = pytest.importorskip("cuda.bindings.driver")
    driver, libcuda, synchronized = stand_in
    _with_abi(driver, libcuda, abi)
    call = "cuMemcpyBatchAsync" if abi else "cuMemcpyAsync"
    libcuda.results[call] = int(real.CUresult.CUDA_ERROR_INVALID_VALUE)
    libcuda.fail_index = fail_index
    _, _, dsts, srcs, sizes, _ = _blocks(4)
    with pytest.raises(DriverError, match=f"{call}.*CUDA_ERROR_INVALID_VALUE") as info:
        driver.copy_batch(dsts, srcs, sizes, 0)
    details = info.value.details
    assert details["count"] == 4 and details["device"] == 0
    assert details.get("index") == reported
    if reported is not None:
        assert details["dst"] == hex(int(dsts[reported])) and details["size"] == 16
    # Copies before the failed one may be in flight: the device is synchronized, and no
    # event is recorded.
    assert synchronized == [0]
    assert ("cuEventRecord",) not in libcuda.log


def test_copy_batch_checks_its_input_before_any_call(stand_in):
    driver, libcuda, _ = stand_in
    _with_abi(driver, libcuda, 13000)
    _, _, dsts, srcs, sizes, _ = _blocks(4)
    for arguments, error in (
        ((dsts, srcs, sizes[:3]), ValueError),
        ((dsts, srcs.astype(np.int64), sizes), TypeError),
        ((dsts, srcs, sizes.tolist()), TypeError),
        ((dsts[::2], srcs[::2], sizes[::2]), ValueError),
    ):
        with pytest.raises(error):
            driver.copy_batch(*arguments, 0)
    assert libcuda.log == []


def test_with_memcpy_batch_checks_its_arguments():
    calls_module = pytest.importorskip("jaxbuf.drivers._cuda_calls")
    libcuda = _StandInLibcuda(calls_module)
    entry_points = libcuda.entry_points
    assert calls_module.MEMCPY_BATCH_SYMBOL == "cuMemcpyBatchAsync"
    assert calls_module.MEMCPY_BATCH_VERSIONS == (13000, 12080)
    with pytest.raises(ValueError, match="no cuMemcpyBatchAsync ABI for version 12000"):
        entry_points.with_memcpy_batch(libcuda.address(13000), 12000)
    with pytest.raises(ValueError, match="no address"):
        entry_points.with_memcpy_batch(0, 13000)
    with pytest.raises(TypeError):
        entry_points.with_memcpy_batch(libcuda.address(13000))
    batched = entry_points.with_memcpy_batch(libcuda.address(12080), 12080)
    assert (batched.memcpy_batch_version, entry_points.memcpy_batch_version) == (12080, 0)
    empty = np.zeros(0, np.uint64)
    with pytest.raises(TypeError, match="5 arguments"):
        batched.copy_batch(0x1234, empty, empty, empty)
    assert batched.copy_batch(0x1234, empty, empty, empty, 2) == 0  # nothing to copy
    with pytest.raises(TypeError, match="srcs must be a 1-D numpy array of uint64"):
        batched.copy_batch(0x1234, empty, 0, empty, 2)
    with pytest.raises(ValueError, match="one length"):
        batched.copy_batch(0x1234, empty, np.zeros(1, np.uint64), empty, 2)


@pytest.mark.parametrize(
    "driver_version, found, expected",
    [
        (13020, {13000, 12080}, 13000),
        (13000, {12080}, 12080),  # a NULL answer for 13.0's ABI: 12.8's is asked next
        (12090, {13000, 12080}, 12080),  # never asks for an ABI newer than the driver
        (12040, {13000, 12080}, 0),
    ],
)
def test_memcpy_batch_is_asked_for_in_the_newest_abi_the_driver_has(
    monkeypatch, driver_version, found, expected
):
    calls_module = pytest.importorskip("jaxbuf.drivers._cuda_calls")
    libcuda = _StandInLibcuda(calls_module)
    asked = []

    def get_proc_address(symbol, version, flags):
        asked.append((symbol, version))
        return cu.CUresult.CUDA_SUCCESS, libcuda.address(version) if version in found else 0, 0

    cu = _stand_in_binding(
        monkeypatch,
        cuDriverGetVersion=lambda: (cu.CUresult.CUDA_SUCCESS, driver_version),
        cuGetProcAddress=get_proc_address,
    )
    calls = CudaVmmDriver()._with_memcpy_batch(libcuda.entry_points)
    assert calls.memcpy_batch_version == expected
    assert all(symbol == b"cuMemcpyBatchAsync" for symbol, _ in asked)
    assert all(version <= driver_version for _, version in asked)


def test_copy_batch_through_the_binding(monkeypatch):
    # Without the C calls: one cuMemcpyAsync per non-empty copy through cuda.bindings, on the
    # per-thread default stream, then the event.
    real = pytest.importorskip("cuda.bindings.driver")
    copies, failing = [], {"index": None}

    def memcpy(dst, src, size, stream):
        copies.append((dst, src, size, int(stream)))
        if len(copies) - 1 == failing["index"]:
            return (real.CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, src, size)
        return (real.CUresult.CUDA_SUCCESS,)

    cu, log = _event_binding(monkeypatch)
    cuda_driver._cu.cuMemcpyAsync = memcpy
    driver = _driver_with_context(cu)
    assert driver._calls is None
    assert driver.copy_batch_method == "cuMemcpyAsync per copy through cuda.bindings"
    target, source, dsts, srcs, sizes, expected = _blocks(8)
    sizes[3] = 0
    expected.reshape(8, 16)[(int(dsts[3]) - target.ctypes.data) // 16] = 0
    event = driver.copy_batch(dsts, srcs, sizes, 0)
    np.testing.assert_array_equal(target, expected)
    assert len(copies) == 7 and {stream for *_, stream in copies} == {COPY_BATCH_STREAM}
    assert log["recorded"] == [(int(event), COPY_BATCH_STREAM)]

    synchronized = []
    monkeypatch.setattr(driver, "synchronize", synchronized.append)
    copies.clear()
    failing["index"] = 1
    with pytest.raises(DriverError, match="cuMemcpyAsync.*CUDA_ERROR_INVALID_VALUE") as info:
        driver.copy_batch(dsts, srcs, sizes, 0)
    assert info.value.details["index"] == 1 and synchronized == [0]
    assert len(copies) == 2 and len(log["recorded"]) == 1


def test_fault_injecting_driver_names_the_batch_call_on_cuda():
    faulty = FaultInjectingDriver(CudaVmmDriver())
    faulty.fail_on("copy_batch")
    empty = np.zeros(0, np.uint64)
    with pytest.raises(DriverError, match="cuMemcpyBatchAsync.*INJECTED_FAULT"):
        faulty.copy_batch(empty, empty, empty, 0)
    assert faulty.calls["copy_batch"] == 1
