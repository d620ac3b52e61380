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

import pytest

from jaxbuf.drivers import cuda as cuda_driver
from jaxbuf.drivers._cuda_streams import MAX_SPARE_EVENTS
from jaxbuf.drivers.base import K_DL_CUDA, K_DL_CUDA_HOST, DriverError
from jaxbuf.drivers.cuda import CudaVmmDriver

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
