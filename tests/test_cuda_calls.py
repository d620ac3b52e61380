"""The CUDA driver's hot calls in C (jaxbuf.drivers._cuda_calls), on the CPU: the driver
functions are ctypes callbacks standing in for libcuda's, so every argument the C code
passes, and every CUresult the driver turns into an error, is checked without a GPU. On a
GPU, the real driver must have them on (or say why not)."""

from __future__ import annotations

import ctypes

import pytest

from jaxbuf.drivers.base import DriverError
from jaxbuf.drivers.cuda import CudaVmmDriver

calls_module = pytest.importorskip("jaxbuf.drivers._cuda_calls")
cu = pytest.importorskip("cuda.bindings.driver")

_P = ctypes.c_void_p
_U = ctypes.c_uint
_SIGNATURES = {
    "cuCtxGetCurrent": (ctypes.c_int, ctypes.POINTER(_P)),
    "cuCtxSetCurrent": (ctypes.c_int, _P),
    "cuLaunchKernel": (ctypes.c_int, _P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P),
    "cuEventRecord": (ctypes.c_int, _P, _P),
    "cuEventQuery": (ctypes.c_int, _P),
    "cuMemcpyAsync": (ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, _P),
}
NOT_READY = int(cu.CUresult.CUDA_ERROR_NOT_READY)
INVALID_VALUE = int(cu.CUresult.CUDA_ERROR_INVALID_VALUE)


class FakeLibcuda:
    """ctypes callbacks for SYMBOLS: each logs its arguments and returns ``results[name]``
    (default 0, CUDA_SUCCESS); ``current`` is the context cuCtxGetCurrent reports."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.results: dict[str, int] = {}
        self.current = 0x1234
        self._callbacks = []  # the C side holds raw pointers: keep the callbacks alive
        for name in calls_module.SYMBOLS:
            self._callbacks.append(ctypes.CFUNCTYPE(*_SIGNATURES[name])(self._handler(name)))

    def _handler(self, name):
        def handler(*args):
            if name == "cuCtxGetCurrent":
                args[0][0] = self.current
                self.log.append((name,))
            else:
                if name == "cuCtxSetCurrent":
                    self.current = args[0]
                self.log.append((name, *(a or 0 for a in args)))
            return self.results.get(name, 0)

        return handler

    @property
    def addresses(self) -> list[int]:
        return [ctypes.cast(c, ctypes.c_void_p).value for c in self._callbacks]


@pytest.fixture
def fake():
    return FakeLibcuda()


@pytest.fixture
def driver(fake, monkeypatch):
    """A CUDA driver that believes device 0's context is 0x1234, calling ``fake`` from C."""
    driver = CudaVmmDriver()
    driver._unavailable_reason, driver._device_count = None, 1
    driver._primary_contexts[0] = (cu.CUcontext(0x1234), 0x1234)
    driver._calls = calls_module.EntryPoints(fake.addresses)
    driver._not_ready = NOT_READY
    return driver


def test_symbols_match_the_signatures_mirrored_here():
    assert set(calls_module.SYMBOLS) == set(_SIGNATURES)
    assert calls_module.CUDA_VERSION == 12000


def test_entry_points_refuse_bad_tables(fake):
    with pytest.raises(ValueError, match="6 functions"):
        calls_module.EntryPoints(fake.addresses[:-1])
    with pytest.raises(ValueError, match="no address for cuLaunchKernel"):
        calls_module.EntryPoints([*fake.addresses[:2], 0, *fake.addresses[3:]])
    with pytest.raises(TypeError):
        calls_module.EntryPoints(5)
    with pytest.raises(TypeError):
        calls_module.EntryPoints(["not an address"] * len(fake.addresses))


def test_methods_check_their_arguments(fake):
    calls = calls_module.EntryPoints(fake.addresses)
    with pytest.raises(TypeError, match="launch takes 10 arguments, got 2"):
        calls.launch(1, 2)
    with pytest.raises(OverflowError):
        calls.launch(1, 2**32, 1, 1, 128, 1, 1, 0, 0, 0)
    with pytest.raises(OverflowError):
        calls.launch(1, -1, 1, 1, 128, 1, 1, 0, 0, 0)
    with pytest.raises(TypeError):
        calls.record(None, 0)
    with pytest.raises(OverflowError):
        calls.copy(0, 0, -1, 0)
    assert fake.log == []  # nothing reached the driver


def test_launch_passes_every_argument(driver, fake):
    driver.launch_kernel(0xF00D, (256, 2, 3), (128, 1, 1), 4096, 0x5000, 0x1234)
    assert fake.log == [("cuLaunchKernel", 0xF00D, 256, 2, 3, 128, 1, 1, 4096, 0x5000, 0x1234, 0)]
    fake.results["cuLaunchKernel"] = INVALID_VALUE
    with pytest.raises(DriverError, match=r"cuLaunchKernel\(grid=\(3, 1, 1\).*INVALID_VALUE"):
        driver.launch_kernel(0xF00D, (3, 1, 1), (128, 1, 1), 0, 0, 0x1234)


def test_ensure_context_sets_only_when_another_is_current(driver, fake):
    driver.ensure_context(0)
    assert fake.log == [("cuCtxGetCurrent",)]
    fake.current = 0  # another library left no context current
    driver.ensure_context(0)
    assert fake.log[1:] == [("cuCtxGetCurrent",), ("cuCtxSetCurrent", 0x1234)]
    fake.results["cuCtxSetCurrent"], fake.current = INVALID_VALUE, 0x9999
    with pytest.raises(DriverError, match="cuCtxSetCurrent.*INVALID_VALUE"):
        driver.ensure_context(0)


def test_event_query_maps_done_pending_and_errors(driver, fake):
    event = cu.CUevent(0xE1)
    assert driver.event_query(event) is True
    fake.results["cuEventQuery"] = NOT_READY
    assert driver.event_query(event) is False
    fake.results["cuEventQuery"] = INVALID_VALUE
    with pytest.raises(DriverError, match="cuEventQuery.*INVALID_VALUE"):
        driver.event_query(event)
    assert [entry[1] for entry in fake.log] == [0xE1] * 3


def test_record_event_records_on_the_mapped_stream_and_keeps_the_event_on_failure(
    driver, fake, monkeypatch
):
    made = iter(range(0x100, 0x200))

    def create(flags):
        return cu.CUresult.CUDA_SUCCESS, cu.CUevent(next(made))

    monkeypatch.setattr(driver, "_cu", _binding_with(cuEventCreate=create))
    event = driver.record_event(1, 0)  # DLPack 1: the legacy default stream, CUstream 1
    assert ("cuEventRecord", int(event), int(cu.CU_STREAM_LEGACY)) in fake.log
    driver.destroy_event(event)
    fake.results["cuEventRecord"] = INVALID_VALUE
    with pytest.raises(DriverError, match="cuEventRecord.*INVALID_VALUE"):
        driver.record_event(0x7F00, 0)
    assert ("cuEventRecord", int(event), 0x7F00) in fake.log  # the spare event was reused
    assert driver._spare_events[0] == [event]  # and given back after the failed record


def test_record_in_checks_the_context_then_records(fake):
    calls = calls_module.EntryPoints(fake.addresses)
    assert calls.record_in(0x1234, 0xE1, 0x7F00) == 0
    assert fake.log == [("cuCtxGetCurrent",), ("cuEventRecord", 0xE1, 0x7F00)]
    fake.log.clear()
    fake.current = 0
    fake.results["cuCtxSetCurrent"] = INVALID_VALUE
    assert calls.record_in(0x1234, 0xE1, 0x7F00) == ("cuCtxSetCurrent", INVALID_VALUE)
    assert fake.log[-1][0] == "cuCtxSetCurrent"  # no record after the failed context
    fake.results["cuCtxSetCurrent"] = 0
    fake.results["cuEventRecord"] = INVALID_VALUE
    assert calls.record_in(0x1234, 0xE1, 0x7F00) == ("cuEventRecord", INVALID_VALUE)
    with pytest.raises(TypeError, match="record_in takes 3 arguments"):
        calls.record_in(0xE1, 0x7F00)


def test_record_event_with_a_spare_event_is_one_c_call(driver, fake, monkeypatch):
    """The apply's record: a spare event, the context check and cuEventRecord in one C call
    (no ensure_context from Python); a failure gives the event back to the spares."""
    event = cu.CUevent(0xE7)
    driver._spare_events[0] = [event]
    driver._event_devices[0xE7] = 0
    monkeypatch.setattr(driver, "ensure_context", None)  # not called on this path
    assert driver.record_event(0x7F00, 0) is event
    assert fake.log == [("cuCtxGetCurrent",), ("cuEventRecord", 0xE7, 0x7F00)]
    driver.destroy_event(event)
    fake.current, fake.results["cuCtxSetCurrent"] = 0, INVALID_VALUE
    with pytest.raises(DriverError, match=r"cuCtxSetCurrent\(stream=0x7f00, device=0\)"):
        driver.record_event(0x7F00, 0)
    assert driver._spare_events[0] == [event]


def test_an_unknown_cuda_result_is_still_a_driver_error(driver, fake):
    fake.results["cuLaunchKernel"] = 123456  # no CUresult member has this value
    with pytest.raises(DriverError, match="cuLaunchKernel.*CUresult 123456"):
        driver.launch_kernel(0xF00D, (1, 1, 1), (32, 1, 1), 0, 0, 0x1234)


def test_copy_on_stream(driver, fake):
    driver.copy_on_stream(0xD000, 0xA000, 65536, 0x7F00)
    assert fake.log == [("cuMemcpyAsync", 0xD000, 0xA000, 65536, 0x7F00)]
    fake.results["cuMemcpyAsync"] = INVALID_VALUE
    with pytest.raises(DriverError, match="cuMemcpyAsync.*INVALID_VALUE"):
        driver.copy_on_stream(0xD000, 0xA000, 65536, 0)


def test_copy_and_launch_makes_the_three_calls_in_one(fake):
    calls = calls_module.EntryPoints(fake.addresses)
    args = (0x1234, 0xD000, 0xA000, 4096, 0xF00D, 256, 128, 64, 0x7F00, 0x4321)
    assert calls.copy_and_launch(*args) == 0
    assert fake.log == [
        ("cuCtxGetCurrent",),
        ("cuMemcpyAsync", 0xD000, 0xA000, 4096, 0x7F00),
        ("cuLaunchKernel", 0xF00D, 256, 1, 1, 128, 1, 1, 64, 0x7F00, 0x4321, 0),
    ]
    # Another context current: set first. No bytes: no copy. No programs: no launch.
    fake.log.clear()
    fake.current = 0x9999
    assert calls.copy_and_launch(0x1234, 0, 0, 0, 0xF00D, 0, 128, 0, 0, 0x4321) == 0
    assert fake.log == [("cuCtxGetCurrent",), ("cuCtxSetCurrent", 0x1234)]


@pytest.mark.parametrize("step", calls_module.COPY_AND_LAUNCH_STEPS)
def test_copy_and_launch_stops_at_the_failed_step_and_names_it(fake, step):
    calls = calls_module.EntryPoints(fake.addresses)
    fake.current = 0  # so cuCtxSetCurrent is called
    fake.results[step] = INVALID_VALUE
    failure = calls.copy_and_launch(0x1234, 0xD000, 0xA000, 64, 0xF00D, 4, 128, 0, 0, 0x4321)
    index = calls_module.COPY_AND_LAUNCH_STEPS.index(step)
    assert failure == (step, INVALID_VALUE)
    made = [entry[0] for entry in fake.log]
    assert made[-1] == step  # nothing after the failed step
    assert made == ["cuCtxGetCurrent", *calls_module.COPY_AND_LAUNCH_STEPS[: index + 1]]


def test_copy_and_launch_checks_its_arguments(fake):
    calls = calls_module.EntryPoints(fake.addresses)
    with pytest.raises(TypeError, match="copy_and_launch takes 10 arguments, got 3"):
        calls.copy_and_launch(1, 2, 3)
    with pytest.raises(OverflowError):  # grid past an unsigned int
        calls.copy_and_launch(0x1234, 0, 0, 0, 0xF00D, 2**32, 128, 0, 0, 0)
    with pytest.raises(OverflowError):  # a negative size
        calls.copy_and_launch(0x1234, 0, 0, -1, 0xF00D, 1, 128, 0, 0, 0)
    with pytest.raises(TypeError):
        calls.copy_and_launch(0x1234, "0", 0, 0, 0xF00D, 1, 128, 0, 0, 0)
    assert fake.log == []  # nothing reached the driver


def test_driver_copy_and_launch_in_one_c_call(driver, fake, monkeypatch):
    monkeypatch.setattr(driver, "copy_on_stream", None)  # the separate calls are not made
    monkeypatch.setattr(driver, "launch_kernel", None)
    driver.copy_and_launch(0, 0x7F00, (0xD000, 0xA000, 64), 0xF00D, (9, 1, 1), (128, 1, 1), 0, 7)
    assert [entry[0] for entry in fake.log] == [
        "cuCtxGetCurrent",
        "cuMemcpyAsync",
        "cuLaunchKernel",
    ]


@pytest.mark.parametrize("step", calls_module.COPY_AND_LAUNCH_STEPS)
def test_driver_copy_and_launch_failures(driver, fake, monkeypatch, step):
    """Each failed step is the DriverError of its call; a failed launch after the copy waits
    for the device first (the contract: the copy's source may then be rewritten)."""
    synchronized = []
    monkeypatch.setattr(driver, "synchronize", synchronized.append)
    fake.current = 0
    fake.results[step] = INVALID_VALUE
    with pytest.raises(DriverError, match=f"{step}.*INVALID_VALUE"):
        driver.copy_and_launch(
            0, 0x7F00, (0xD000, 0xA000, 64), 0xF00D, (9, 1, 1), (128, 1, 1), 0, 7
        )
    assert synchronized == ([0] if step == "cuLaunchKernel" else [])


def test_a_failed_launch_without_a_copy_waits_for_nothing(driver, fake, monkeypatch):
    synchronized = []
    monkeypatch.setattr(driver, "synchronize", synchronized.append)
    fake.results["cuLaunchKernel"] = INVALID_VALUE
    with pytest.raises(DriverError, match="cuLaunchKernel"):
        driver.copy_and_launch(0, 0x7F00, None, 0xF00D, (9, 1, 1), (128, 1, 1), 0, 7)
    assert synchronized == []


def test_driver_copy_and_launch_falls_back_to_the_separate_calls(driver, fake):
    """A multi-dimensional grid (which the C call does not take) goes through the separate
    calls, still in C."""
    driver.copy_and_launch(0, 0x7F00, (0xD000, 0xA000, 64), 0xF00D, (9, 2, 1), (128, 1, 1), 0, 7)
    assert fake.log == [
        ("cuCtxGetCurrent",),
        ("cuMemcpyAsync", 0xD000, 0xA000, 64, 0x7F00),
        ("cuLaunchKernel", 0xF00D, 9, 2, 1, 128, 1, 1, 0, 0x7F00, 7, 0),
    ]


def test_a_stand_in_binding_keeps_every_call_in_the_binding():
    import types

    fake = types.SimpleNamespace(**{name: getattr(cu, name) for name in dir(cu)})
    driver = CudaVmmDriver(binding=fake)
    driver.unavailable_reason()
    assert driver._calls is None
    assert driver.c_calls_reason


@pytest.mark.gpu
def test_the_real_driver_calls_from_c():
    driver = CudaVmmDriver()
    if driver.unavailable_reason() is not None:
        pytest.skip(driver.unavailable_reason())
    assert driver.c_calls_reason is None
    driver.ensure_context(0)
    event = driver.record_event(1, 0)
    driver.event_synchronize(event)
    assert driver.event_query(event) is True
    driver.destroy_event(event)


def _binding_with(**calls):
    import types

    fake = types.SimpleNamespace(**{name: getattr(cu, name) for name in dir(cu)})
    fake.cuGetErrorName = lambda error: (cu.CUresult.CUDA_SUCCESS, error.name.encode())
    for name, call in calls.items():
        setattr(fake, name, call)
    return fake
