"""Fault injection: every driver call of every public operation fails once, in turn.

Each public operation that calls the driver is run under a
:class:`jaxbuf.testing.FaultInjectingDriver` once unfaulted (to count its calls), then once
per call position ``k`` with the ``k``-th call failing. After each fault: the error is the
injected :class:`DriverError`; the driver's invariants hold (nothing mapped without access,
handles created - released == live chunks, ...); the object's data is what was last written;
a retry without the fault succeeds; after ``free`` nothing is left (``assert_clean``).

Faults fired inside garbage collection (a ``__del__`` freeing what a caller dropped) cannot
reach a caller: there jaxbuf warns (``ResourceWarning``) and the allocation leaks, as
documented; the sweep checks exactly that.

A hypothesis state machine then runs random sequences of public operations with faults armed at
random positions, against a numpy model. The number of faults injected is printed at the end
(``-s``) and kept in ``FaultInjectingDriver.total_faults_injected``.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from jaxbuf._reservation import VirtualBuffer
from jaxbuf.drivers import DriverError, get_vmm_driver
from jaxbuf.extensible import ExtensibleTensor
from jaxbuf.testing import FaultInjectingDriver
from jaxbuf.uva import NonUvaBuffer, UvaBuffer, UvaBufferPool

MiB = 1 << 20
G = 2 * MiB

SWEEP_STATS = {"operations": 0, "positions": 0}


@pytest.fixture(scope="module", autouse=True)
def _report_faults():
    before = FaultInjectingDriver.total_faults_injected
    yield
    injected = FaultInjectingDriver.total_faults_injected - before
    print(
        f"\n[test_faults] {SWEEP_STATS['operations']} operations swept over "
        f"{SWEEP_STATS['positions']} call positions; {injected} faults injected"
    )


def new_driver(device: str, simulate_events: bool = True) -> FaultInjectingDriver:
    return FaultInjectingDriver(get_vmm_driver(device), simulate_events=simulate_events)


# -- reading and writing -------------------------------------------------------------------
def read_view(view, device: str) -> np.ndarray:
    if view.nbytes == 0 or view.shape and 0 in view.shape:
        return np.empty(view.shape, view.dtype.numpy)
    if device == "cpu":
        return view.to_numpy().copy()
    return view.to_torch().cpu().numpy()


def read_segment(buf: ExtensibleTensor, i: int) -> np.ndarray:
    return read_view(buf.segment_view(i), buf.device.platform)


def write_segment(buf: ExtensibleTensor, i: int, start: int, data: np.ndarray) -> None:
    view = buf.segment_view(i)
    if buf.device.platform == "cpu":
        view.to_numpy()[start : start + len(data)] = data
    else:
        import torch

        view.to_torch()[start : start + len(data)].copy_(torch.from_numpy(data))


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + seed) % 251 + 1).astype(np.uint8)


class BufModel:
    """An ExtensibleTensor and what its committed bytes must read back."""

    def __init__(self, driver: FaultInjectingDriver, device: str, capacities: list[int]):
        self.driver = driver
        self.buf = ExtensibleTensor(
            sum(capacities), device=device, segment_capacities=capacities, driver=driver
        )
        self.model = [np.zeros(c, np.uint8) for c in capacities]
        self.known = [np.zeros(c, bool) for c in capacities]

    def grow(self, sizes: list[int], zero_new: bool = True) -> None:
        old = self.buf.committed_sizes
        self.buf.resize_segments_(sizes, zero_new=zero_new)
        for i, (a, b) in enumerate(zip(old, sizes)):
            self.known[i][a:b] = zero_new
            self.model[i][a:b] = 0

    def write(self, i: int, start: int, data: np.ndarray) -> None:
        write_segment(self.buf, i, start, data)
        self.model[i][start : start + len(data)] = data
        self.known[i][start : start + len(data)] = True

    def forget(self) -> None:
        for known in self.known:
            known[:] = False

    def check(self) -> None:
        check_buffer(self.buf, self.driver)
        for i, size in enumerate(self.buf.committed_sizes):
            data = read_segment(self.buf, i)
            assert len(data) == size
            mask = self.known[i][:size]
            np.testing.assert_array_equal(data[mask], self.model[i][:size][mask])


def check_buffer(buf: ExtensibleTensor, driver: FaultInjectingDriver) -> None:
    """The buffer's bookkeeping agrees with the driver's ground truth."""
    driver.check_invariants()
    if buf.base_ptr == 0:
        assert buf.physical_bytes == 0
        return
    inner = buf._buffer
    mapped = driver.mapped_bytes(buf.base_ptr, buf.capacity_bytes)
    assert buf.physical_bytes == mapped == sum(size for _, size, _ in inner._chunks)
    assert buf.num_physical_chunks == sum(
        1 for p in driver.mapped if buf.base_ptr <= p < buf.base_ptr + buf.capacity_bytes
    )
    # Every committed prefix is backed by the buffer's chunks.
    for offset, size in zip(buf.segment_offsets, buf.committed_sizes):
        if size:
            assert inner._committed.covers(offset, offset + size)


def handles_match_chunks(driver: FaultInjectingDriver, *bufs: ExtensibleTensor) -> None:
    """Handles created - released == live chunks (plus handles whose release failed and
    that the next release_physical retries)."""
    # A StagedWriteTensor's target is a bare VirtualBuffer; a tensor holds one in _buffer.
    inners = [b if isinstance(b, VirtualBuffer) else b._buffer for b in bufs]
    unreleased = sum(len(inner._unreleased) for inner in inners if inner is not None)
    assert driver.created - driver.released == len(driver.mapped) + unreleased


# -- the sweep -------------------------------------------------------------------------------
def sweep(
    device: str,
    setup: Callable[[FaultInjectingDriver], Any],
    operation: Callable[[Any], None],
    after_fault: Callable[[Any, FaultInjectingDriver], None],
    after_retry: Callable[[Any, FaultInjectingDriver], None],
    cleanup: Callable[[Any], None],
    *,
    gc_faults: tuple[str, ...] = (),
    simulate_events: bool = True,
) -> int:
    """Fail each driver call of ``operation`` in turn; returns the number of positions.

    ``gc_faults``: kinds of call that may fail inside garbage collection (no exception reaches
    the caller; a ResourceWarning must say so).
    """
    driver = new_driver(device, simulate_events)
    state = setup(driver)
    n = driver.count_calls(lambda: operation(state))
    after_retry(state, driver)
    cleanup(state)
    gc.collect()
    driver.assert_clean()
    assert n > 0, "the operation made no driver call"
    for k in range(n):
        driver = new_driver(device, simulate_events)
        state = setup(driver)
        driver.fail_at(driver.call_count + k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                operation(state)
                gc.collect()
            except DriverError as error:
                assert driver.faults_injected == 1, (k, driver.calls)
                assert str(error).startswith(driver.injected[0].message), error
                assert "INJECTED_FAULT" in str(error)
                del error
            else:
                # The fault fired where no caller could see it (inside __del__).
                assert driver.faults_injected == 1, f"position {k} of {n} was never reached"
                kind = driver.injected[0].kind
                assert kind in gc_faults, f"fault in {kind} at position {k} was swallowed"
                assert any(issubclass(w.category, ResourceWarning) for w in caught), caught
                leak_gc_fault(driver)
        driver.check_invariants()
        after_fault(state, driver)
        driver.disarm()
        operation(state)  # the retry succeeds
        after_retry(state, driver)
        cleanup(state)
        gc.collect()
        driver.assert_clean()
    SWEEP_STATS["operations"] += 1
    SWEEP_STATS["positions"] += n
    return n


def leak_gc_fault(driver: FaultInjectingDriver) -> None:
    """Free (through the real driver) the allocation a GC-path fault leaked, so
    ``assert_clean`` checks everything else."""
    for ptr in list(driver.pinned):
        alive = any(
            ptr == getattr(o, "host_ptr", None)
            for o in gc.get_objects()
            if type(o).__name__ == "_PinnedHostMemory"
        )
        if not alive:
            driver.inner.host_free(ptr)
            del driver.pinned[ptr]


# -- ExtensibleTensor --------------------------------------------------------------------------
CAPACITIES = [G + G // 2, 3 * G, G // 2 + 2 * G]  # a granule shared by segments 0 and 1
FIRST = [G, 0, G // 4]
SECOND = [G + G // 2, 3 * G, 2 * G]


def _grown_buffer(device):
    def setup(driver):
        m = BufModel(driver, device, CAPACITIES)
        m.grow(FIRST)
        for i, size in enumerate(FIRST):
            m.write(i, 0, pattern(size, i))
        return m

    return setup


def _free(m):
    m.buf.free()


def test_sweep_extensible_constructor(device):
    state: dict = {}

    def operation(s):
        s["buf"] = ExtensibleTensor(
            sum(CAPACITIES), device=device, segment_capacities=CAPACITIES, driver=s["driver"]
        )

    def setup(driver):
        state.clear()
        state["driver"] = driver
        return state

    def after_fault(s, driver):
        assert "buf" not in s
        gc.collect()
        driver.assert_clean()  # a failed constructor leaves nothing

    def after_retry(s, driver):
        s["buf"].resize_per_segment_(0)
        check_buffer(s["buf"], driver)

    sweep(device, setup, operation, after_fault, after_retry, lambda s: s["buf"].free())


def test_sweep_resize_segments_zero_new(device):
    def operation(m):
        m.grow(SECOND, zero_new=True)

    def after_fault(m, driver):
        assert m.buf.committed_sizes in (FIRST, SECOND)
        m.check()
        handles_match_chunks(driver, m.buf)

    def after_retry(m, driver):
        assert m.buf.committed_sizes == SECOND
        m.check()
        handles_match_chunks(driver, m.buf)
        for i, (old, new) in enumerate(zip(FIRST, SECOND)):
            assert not read_segment(m.buf, i)[old:new].any()

    sweep(device, _grown_buffer(device), operation, after_fault, after_retry, _free)


def test_sweep_resize_without_zeroing(device):
    def operation(m):
        m.grow(SECOND, zero_new=False)

    def after_fault(m, driver):
        m.check()
        handles_match_chunks(driver, m.buf)

    sweep(device, _grown_buffer(device), operation, after_fault, after_fault, _free)


def test_sweep_release_physical(device):
    def operation(m):
        m.buf.release_physical()
        m.forget()

    def after_fault(m, driver):
        m.forget()  # release_physical always drops the committed sizes (documented)
        assert m.buf.committed_sizes == [0, 0, 0]
        m.check()
        handles_match_chunks(driver, m.buf)

    def after_retry(m, driver):
        assert m.buf.physical_bytes == 0 and not driver.mapped and not driver.live_handles
        m.grow(SECOND)  # recommit: all zero
        m.check()
        for i in range(3):
            assert not read_segment(m.buf, i).any()

    sweep(device, _grown_buffer(device), operation, after_fault, after_retry, _free)


def test_sweep_free(device):
    def operation(m):
        m.buf.free()

    def after_fault(m, driver):
        check_buffer(m.buf, driver)
        handles_match_chunks(driver, m.buf)

    def after_retry(m, driver):
        assert m.buf.base_ptr == 0
        with pytest.raises(RuntimeError, match="freed"):
            m.buf.resize_per_segment_(0)

    sweep(device, _grown_buffer(device), operation, after_fault, after_retry, _free)


# -- UVA buffers and pools ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", [UvaBuffer, NonUvaBuffer])
def test_sweep_buffer_create_and_free(device, cls):
    def setup(driver):
        return {"driver": driver}

    def create(s):
        s["buf"] = cls((5, 3), "int32", device, driver=s["driver"])

    def after_create_fault(s, driver):
        assert "buf" not in s
        gc.collect()
        driver.assert_clean()

    def after_create(s, driver):
        s["buf"].np[:] = np.arange(15, dtype=np.int32).reshape(5, 3)
        got = read_view(s["buf"].uva(4), device)
        np.testing.assert_array_equal(got, np.arange(12).reshape(4, 3))

    def free(s):
        s["buf"].free()

    sweep(device, setup, create, after_create_fault, after_create, free)

    def setup_free(driver):
        s = setup(driver)
        create(s)
        after_create(s, driver)
        return s

    def after_free_fault(s, driver):
        # Either nothing happened (still usable) or the buffer is closed (NonUvaBuffer:
        # its device memory may be half released); a retry frees it.
        if s["buf"]._closed:
            with pytest.raises(ValueError, match="freed"):
                s["buf"].uva(1)
        else:
            after_create(s, driver)

    def after_free(s, driver):
        gc.collect()
        driver.assert_clean()

    sweep(device, setup_free, free, after_free_fault, after_free, free)


def _pool(device, driver, guarded=False, buffer_cls=UvaBuffer):
    return UvaBufferPool(
        (2, 3), "int32", 3, device, buffer_cls=buffer_cls, guarded=guarded, driver=driver
    )


@pytest.mark.parametrize("buffer_cls", [UvaBuffer, NonUvaBuffer])
def test_sweep_pool_construct_and_close(device, buffer_cls):
    def setup(driver):
        return {"driver": driver}

    def construct(s):
        s["pool"] = _pool(device, s["driver"], guarded=True, buffer_cls=buffer_cls)

    def after_construct_fault(s, driver):
        assert "pool" not in s
        gc.collect()
        driver.assert_clean()

    def after_construct(s, driver):
        got = read_view(s["pool"].copy_to_uva(np.ones((2, 3), np.int32)), device)
        np.testing.assert_array_equal(got, np.ones((2, 3)))

    def close(s):
        s["pool"].close()

    sweep(device, setup, construct, after_construct_fault, after_construct, close)

    def setup_close(driver):
        s = setup(driver)
        construct(s)
        after_construct(s, driver)
        return s

    def after_close(s, driver):
        gc.collect()
        driver.assert_clean()

    sweep(device, setup_close, close, lambda s, d: d.check_invariants(), after_close, close)


@pytest.mark.parametrize("buffer_cls", [UvaBuffer, NonUvaBuffer])
@pytest.mark.parametrize("guarded", [False, "wait"])
def test_sweep_pool_copy_with_growth(device, buffer_cls, guarded):
    def setup(driver):
        pool = _pool(device, driver, guarded=guarded, buffer_cls=buffer_cls)
        for step in range(3):  # every slot used once
            pool.copy_to_uva(np.full((2, 3), step, np.int32))
        return {"pool": pool, "step": 10}

    def operation(s):
        s["step"] += 1
        x = np.arange(21, dtype=np.int32).reshape(7, 3) + s["step"]  # grows the slot to 8 rows
        s["view"] = s["pool"].copy_to_uva(x)
        s["x"] = x

    def after_fault(s, driver):
        pool = s["pool"]
        # The pool still works: a copy that fits is exact.
        got = read_view(pool.copy_to_uva(np.full((1, 3), 5, np.int32)), device)
        np.testing.assert_array_equal(got, np.full((1, 3), 5))

    def after_retry(s, driver):
        np.testing.assert_array_equal(read_view(s["view"], device), s["x"])

    def close(s):
        s.pop("view", None)
        s["pool"].close()

    sweep(device, setup, operation, after_fault, after_retry, close, gc_faults=("host_free",))


# -- staged writes -----------------------------------------------------------------------------
def _backend(device: str) -> str:
    return "numpy" if device == "cpu" else "triton"


def _read_staged(swt, device) -> np.ndarray:
    if device == "cpu":
        return swt.to_numpy().copy()
    return swt.to_torch().cpu().numpy()


# On CUDA an apply's event is destroyed when the last tensor or slot lets go of it, which can
# be inside a finalizer (a ResourceWarning then says the event leaks); the CPU has no events.
_STAGED_GC_FAULTS = ("host_free", "destroy_event")


@pytest.mark.parametrize("uva", [False, True])
def test_sweep_staged_construct_and_free(device, uva):
    from jaxbuf.staged import StagedWriteTensor

    def setup(driver):
        return {"driver": driver}

    def construct(s):
        s["swt"] = StagedWriteTensor(
            (4, 5),
            "int32",
            device,
            uva_instead_of_gpu=uva,
            backend=_backend(device),
            driver=s["driver"],
        )

    def after_construct_fault(s, driver):
        assert "swt" not in s
        gc.collect()
        driver.assert_clean()

    def after_construct(s, driver):
        swt = s["swt"]
        assert not _read_staged(swt, device).any()
        swt.stage_write(1, 1, [1, 2, 3])
        swt.apply_write()
        assert _read_staged(swt, device)[1].tolist() == [0, 1, 2, 3, 0]

    def free(s):
        s["swt"].free()

    sweep(
        device,
        setup,
        construct,
        after_construct_fault,
        after_construct,
        free,
        gc_faults=_STAGED_GC_FAULTS,
    )

    def setup_free(driver):
        s = setup(driver)
        construct(s)
        after_construct(s, driver)
        return s

    def after_free(s, driver):
        gc.collect()
        driver.assert_clean()

    sweep(
        device,
        setup_free,
        free,
        lambda s, d: d.check_invariants(),
        after_free,
        free,
        gc_faults=_STAGED_GC_FAULTS,
    )


def _apply_sweep(device, backend, fused):
    from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor

    def setup(driver):
        tensors = [
            StagedWriteTensor((4, 6), dtype, device, backend=backend, driver=driver)
            for dtype in ("int32", "float16")
        ]
        writer = FusedStagedWriter(device, 2, backend=backend, driver=driver) if fused else None
        models = [np.zeros((4, 6), t.dtype.numpy) for t in tensors]
        s = {"tensors": tensors, "writer": writer, "models": models}
        _stage(s, 0)
        _apply(s)  # the first apply makes the first slot
        _stage(s, 1)
        return s

    def _stage(s, step):
        for j, (t, model) in enumerate(zip(s["tensors"], s["models"])):
            for row in range(4):
                # a large write on step 1 grows the staging slot
                n = 6 if step else 2
                values = np.arange(n) + 10 * step + row + j
                t.stage_write(row, 0, values)
                s.setdefault("pending", []).append((model, row, values))
            if not fused:
                break  # apply_write: one tensor

    def _apply(s):
        if fused:
            s["writer"].apply(s["tensors"])
        else:
            s["tensors"][0].apply_write()
        for model, row, values in s.pop("pending", []):
            model[row, : len(values)] = values

    def after_fault(s, driver):
        if driver.injected and driver.injected[0].kind == "record_event":
            # The launch was enqueued before the event failed: the writes are applied and
            # no longer staged (the error says so), and the retry has nothing to apply.
            for model, row, values in s["pending"]:
                model[row, : len(values)] = values
            s["pending"] = []
            expected_staged = 0
        else:
            # Nothing applied, nothing lost: targets as before, the writes still staged.
            expected_staged = 4
        for t, model in zip(s["tensors"], s["models"]):
            np.testing.assert_array_equal(_read_staged(t, device), model)
        assert s["tensors"][0].num_staged_writes == expected_staged

    def after_retry(s, driver):
        for t, model in zip(s["tensors"], s["models"]):
            np.testing.assert_array_equal(_read_staged(t, device), model)
            assert t.num_staged_writes == 0

    def cleanup(s):
        if s["writer"] is not None:
            s["writer"].close()
        for t in s["tensors"]:
            t.free()

    return sweep(
        device, setup, _apply, after_fault, after_retry, cleanup, gc_faults=_STAGED_GC_FAULTS
    )


@pytest.mark.parametrize("fused", [False, True])
def test_sweep_staged_apply(device, fused):
    _apply_sweep(device, _backend(device), fused)


def test_sweep_staged_apply_triton_interpreter():
    pytest.importorskip("triton")
    _apply_sweep("cpu", "triton", fused=True)


# -- regressions: one per bug the sweeps found ---------------------------------------------------
def test_regression_extensible_free_failure_leaves_no_committed_size_over_unmapped_memory():
    # free() failing half-way (an unmap after others succeeded) used to keep the committed
    # sizes, so a segment view covered unmapped memory (reading it was a SIGSEGV on the CPU).
    driver = new_driver("cpu")
    m = BufModel(driver, "cpu", CAPACITIES)
    m.grow(SECOND)
    driver.fail_on("unmap", 2)
    with pytest.raises(DriverError, match="INJECTED_FAULT"):
        m.buf.free()
    assert m.buf.committed_sizes == [0, 0, 0]
    check_buffer(m.buf, driver)
    m.buf.free()
    driver.assert_clean()


def test_regression_uva_buffer_free_failure_is_retried():
    # A failing host_free used to mark the buffer closed and drop the pointer: a leak that
    # free() could never retry.
    driver = new_driver("cpu")
    buf = UvaBuffer(16, "int32", "cpu", driver=driver)
    driver.fail_on("host_free")
    with pytest.raises(DriverError):
        buf.free()
    buf.np[:] = 3  # still open and usable
    assert read_view(buf.uva(), "cpu").tolist() == [3] * 16
    buf.free()
    driver.assert_clean()


def test_regression_pinned_memory_free_failure_in_gc_warns():
    # A host_free failing inside __del__ used to print "Exception ignored", then leaked with a
    # ResourceWarning; now the warning says the release is queued, and the next pinned
    # allocation on the driver retries it.
    driver = new_driver("cpu")
    buf = UvaBuffer(16, "int32", "cpu", driver=driver)
    driver.fail_on("host_free")
    with pytest.warns(ResourceWarning, match="retried"):
        del buf
        gc.collect()
    assert driver.pinned, "the failed release was dropped, not queued"
    again = UvaBuffer(16, "int32", "cpu", driver=driver)
    del again
    gc.collect()
    driver.assert_clean()


def test_regression_non_uva_buffer_constructor_failure_frees_its_device_memory():
    # A failed zeroing in NonUvaBuffer() used to leave its ExtensibleTensor alive for as long
    # as the error's traceback (which holds the half-built object) lived.
    driver = new_driver("cpu")
    driver.fail_on("memset")
    with pytest.raises(DriverError) as info:
        NonUvaBuffer(16, "int32", "cpu", driver=driver)
    assert info.value.__traceback__ is not None  # the traceback is still alive here
    driver.assert_clean()


def test_regression_non_uva_buffer_free_failure_is_retried():
    # free() used to mark the buffer closed before freeing: after a driver error a retry
    # did nothing, and the device memory stayed until garbage collection.
    driver = new_driver("cpu")
    buf = NonUvaBuffer(16, "int32", "cpu", driver=driver)
    driver.fail_on("free_reserved")
    with pytest.raises(DriverError):
        buf.free()
    with pytest.raises(ValueError, match="freed"):
        buf.uva()  # closed: its device memory may be half released
    buf.free()
    driver.assert_clean()


def test_regression_pool_close_failure_keeps_unfreed_slots():
    # close() used to take the slots out of the pool before freeing them: one failure lost
    # the rest (freed only by garbage collection), and a retry did nothing.
    driver = new_driver("cpu")
    pool = _pool("cpu", driver)
    driver.fail_on("host_free", 2)
    with pytest.raises(DriverError) as info:
        pool.close()
    del info
    assert len(driver.pinned) == 1 and len(pool.slots) == 1
    pool.close()
    driver.assert_clean()


def test_regression_staged_free_failure_is_retried():
    # free() used to mark the tensor freed and drop its writer and target before freeing
    # them: after a driver error a retry did nothing.
    from jaxbuf.staged import StagedWriteTensor

    driver = new_driver("cpu")
    swt = StagedWriteTensor((4, 4), "int32", "cpu", backend="numpy", driver=driver)
    swt.stage_write(0, 0, [1, 2])
    swt.apply_write()
    driver.fail_on("host_free")  # the writer's staging slot
    with pytest.raises(DriverError):
        swt.free()
    assert driver.pinned and swt.freed
    swt.free()
    driver.assert_clean()


def test_regression_fused_writer_close_failure_is_retried():
    from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor

    driver = new_driver("cpu")
    tensors = [
        StagedWriteTensor(4, "int32", "cpu", backend="numpy", driver=driver) for _ in range(2)
    ]
    writer = FusedStagedWriter("cpu", 1, backend="numpy", driver=driver)
    for step in range(2):  # both slots made
        for t in tensors:
            t.stage_write_elem(step, step + 1)
        writer.apply(tensors)
    driver.fail_on("host_free")
    with pytest.raises(DriverError):
        writer.close()
    with pytest.raises(ValueError, match="closed"):
        tensors[0].stage_write_elem(0, 1)
        writer.apply(tensors)
    writer.close()
    for t in tensors:
        t.free()
    driver.assert_clean()


@pytest.mark.parametrize("failing", ["memset", "record_ready_event"])
def test_regression_failed_zeroing_synchronizes_before_raising(device, failing):
    # Found by the CUDA stateful test: a grow whose second memset (or whose event record)
    # failed raised with the memsets already issued still pending and no event ordering them
    # before later consumers, so a late memset could overwrite a later write.
    driver = new_driver(device)
    granule = driver.granularity(0)
    buf = ExtensibleTensor(4 * granule, device=device, num_segments=2, driver=driver)
    driver.fail_on(failing, 2 if failing == "memset" else 1)
    syncs = driver.calls["synchronize"]
    with pytest.raises(DriverError):
        buf.resize_per_segment_(granule, zero_new=True)
    assert driver.calls["synchronize"] == syncs + 1, "the issued memsets were not waited for"
    assert buf.committed_sizes == [0, 0]
    buf.resize_per_segment_(granule, zero_new=True)  # the retry zeroes and claims
    assert np.count_nonzero(read_segment(buf, 0)) == np.count_nonzero(read_segment(buf, 1)) == 0
    buf.free()
    gc.collect()
    driver.assert_clean()


@pytest.mark.gpu
def test_regression_apply_whose_event_fails_is_applied_not_restaged(cuda_device):
    # The H200 sweep found it: when cuEventRecord failed after the launch, the apply raised
    # with the writes still staged although the kernel had already applied them.
    from jaxbuf.staged import StagedWriteTensor

    driver = new_driver(cuda_device)
    swt = StagedWriteTensor((2, 4), "int32", cuda_device, driver=driver)
    swt.stage_write(1, 0, [5, 6, 7])
    driver.fail_on("record_event")
    with pytest.raises(DriverError) as info:
        swt.apply_write()
    assert "are applied" in " ".join(getattr(info.value, "__notes__", []))
    del info
    assert swt.num_staged_writes == 0
    np.testing.assert_array_equal(_read_staged(swt, cuda_device), [[0, 0, 0, 0], [5, 6, 7, 0]])
    swt.stage_write(0, 1, [9])  # usable afterwards
    swt.apply_write()
    np.testing.assert_array_equal(_read_staged(swt, cuda_device), [[0, 9, 0, 0], [5, 6, 7, 0]])
    swt.free()
    gc.collect()
    driver.assert_clean()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ensure_context", "copy_on_stream", "launch_kernel"])
def test_a_failed_copy_or_launch_leaves_the_writes_staged(cuda_device, kind):
    """copy_and_launch's contract on the GPU: a fault in any of its three calls (the context
    check, the slot's device copy, the direct launch) raises, applies nothing and keeps the
    writes staged; the retry applies them, and the slot is reused safely."""
    from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor

    driver = new_driver(cuda_device)
    swt = StagedWriteTensor((2, 4), "int32", cuda_device, driver=driver)
    writer = FusedStagedWriter(cuda_device, 4, driver=driver)
    for round_ in range(3):  # past both staging slots
        swt.stage_write(round_ % 2, 0, [round_ + 1, 7])
        driver.fail_on(kind)
        with pytest.raises(DriverError):
            writer.apply([swt])
        assert swt.num_staged_writes == 1
        assert driver.injected[-1].kind == kind
        writer.apply([swt])
        assert swt.num_staged_writes == 0
    np.testing.assert_array_equal(_read_staged(swt, cuda_device), [[3, 7, 0, 0], [2, 7, 0, 0]])
    assert driver.calls["copy_on_stream"] and driver.calls["launch_kernel"]
    writer.close()
    swt.free()
    gc.collect()
    driver.assert_clean()


# -- the invariant check itself ----------------------------------------------------------------
def _check_dropping_at_line(driver: FaultInjectingDriver, dropped: list, line: int) -> list[str]:
    """``driver.problems()``, with ``dropped`` (the last reference of a buffer) cleared at
    the check's ``line``-th line event: its ``__del__`` releases it there, as a finalizer run
    by a garbage collection the check triggered does. ``dropped`` is left as it was when the
    check has fewer lines."""
    testing_file = sys.modules[FaultInjectingDriver.__module__].__file__
    countdown = line

    def in_the_check(frame, event, arg):
        nonlocal countdown
        if event == "line" and dropped:
            if countdown == 0:
                dropped.clear()
            countdown -= 1
        return in_the_check

    def trace(frame, event, arg):
        return in_the_check if frame.f_code.co_filename == testing_file else None

    previous = sys.gettrace()  # a coverage tracer, when one runs
    sys.settrace(trace)
    try:
        return driver.problems()
    finally:
        sys.settrace(previous)


def test_a_release_by_a_finalizer_during_the_check_is_no_violation(device):
    """The check allocates, so a garbage collection may run in it, and a finalizer there
    releases a buffer dropped in a reference cycle (unmap, release, free_reserved: all
    recorded). The books must be judged before or after that release, never a mix: the check
    once read a chunk as mapped, then its handle and reservation as gone, and reported
    "mapped but its handle was released", "lies outside every reservation" (the stateful
    model's flaky failure). The release lands at each line the check runs, in turn."""
    driver = new_driver(device)
    kept = ExtensibleTensor(G, device, driver=driver)  # a live chunk the check must see
    kept.resize_per_segment_(G)
    line = 0
    while True:
        buffer = ExtensibleTensor(G, device, driver=driver)
        buffer.resize_per_segment_(G)
        dropped = [buffer]
        del buffer
        found = _check_dropping_at_line(driver, dropped, line)
        assert found == [], f"a release at line {line} of the check: {found}"
        if dropped:  # the check ended first: every line was tried
            break
        assert len(driver.mapped) == 1, "the dropped buffer was released"
        line += 1
    assert line > 10
    dropped.clear()
    kept.free()
    driver.assert_clean()


# -- random sequences of public operations, faults armed at random positions -------------------
def _state_machine(device: str):
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

    from jaxbuf.staged import StagedWriteTensor

    # None (no fault) about one time in four; else the k-th driver call of the operation.
    faults = st.integers(-2, 7).map(lambda k: None if k < 0 else k)
    segment = st.integers(0, len(CAPACITIES) - 1)
    fraction = st.floats(0, 1)
    ROWS, COLS = 6, 8

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.driver = new_driver(device)
            self.m = BufModel(self.driver, device, CAPACITIES)
            self.pool = UvaBufferPool(
                (2, 4), "int32", 2, device, buffer_cls=UvaBuffer, driver=self.driver
            )
            self.swt = StagedWriteTensor(
                (ROWS, COLS), "int32", device, backend=_backend(device), driver=self.driver
            )
            self.target = np.zeros((ROWS, COLS), np.int32)
            self.finalizer_faults = 0

        # Runs ``operation`` with a fault armed ``fault`` calls ahead; True when it raised
        # the injected DriverError (a fault past the operation's last call is disarmed).
        def run(self, fault, operation) -> bool:
            driver = self.driver
            before = driver.faults_injected
            if fault is not None:
                driver.fail_at(driver.call_count + fault)
            try:
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    operation()
            except DriverError as error:
                assert driver.faults_injected == before + 1, error
                assert "INJECTED_FAULT" in str(error)
                return True
            finally:
                driver.disarm()
            if driver.faults_injected != before:  # fired inside a finalizer
                assert driver.injected[-1].kind in _STAGED_GC_FAULTS, driver.injected[-1]
                # That block leaks by design (a ResourceWarning says so); teardown frees it
                # through the real driver once its owner is gone, and checks all else.
                self.finalizer_faults += 1
                leak_gc_fault(driver)
            return False

        @rule(i=segment, f=fraction, zero_new=st.booleans(), fault=faults)
        def grow(self, i, f, zero_new, fault):
            sizes = self.m.buf.committed_sizes
            sizes[i] = max(sizes[i], int(f * CAPACITIES[i]))
            if self.run(fault, lambda: self.m.grow(sizes, zero_new)):
                self.m.check()
                self.m.grow(sizes, zero_new)  # the retry succeeds
            assert self.m.buf.committed_sizes == sizes

        @rule(fs=st.lists(fraction, min_size=3, max_size=3), fault=faults)
        def recommit(self, fs, fault):
            sizes = [
                max(s, int(f * c)) for s, f, c in zip(self.m.buf.committed_sizes, fs, CAPACITIES)
            ]
            if self.run(fault, lambda: self.m.grow(sizes, True)):
                self.m.grow(sizes, True)

        @rule(i=segment, a=fraction, b=fraction, value=st.integers(1, 255))
        def write(self, i, a, b, value):
            size = self.m.buf.committed_sizes[i]
            start, end = sorted((int(a * size), int(b * size)))
            if start < end:
                self.m.write(i, start, np.full(end - start, value, np.uint8))

        @rule(i=segment, how=st.sampled_from(["torch", "jax"]))
        def view(self, i, how):
            size = self.m.buf.committed_sizes[i]
            if size == 0:
                return
            v = self.m.buf.segment_view(i)
            if how == "torch":
                torch = pytest.importorskip("torch")
                data = torch.from_dlpack(v).cpu().numpy()
            else:
                jax = pytest.importorskip("jax")
                data = np.asarray(jax.dlpack.from_dlpack(v))
            mask = self.m.known[i][:size]
            np.testing.assert_array_equal(data[mask], self.m.model[i][:size][mask])

        @rule(fault=faults)
        def release_physical(self, fault):
            if self.run(fault, self.m.buf.release_physical):
                self.m.forget()  # sizes drop to 0 even when it fails (documented)
                self.m.check()
                self.m.buf.release_physical()
            self.m.forget()
            assert self.m.buf.physical_bytes == 0

        @rule(fault=faults, fault2=faults)
        def free_and_recreate(self, fault, fault2):
            buf = self.m.buf
            if self.run(fault, buf.free):
                self.m.forget()
                check_buffer(buf, self.driver)
                buf.free()
            assert buf.base_ptr == 0 and buf.physical_bytes == 0
            state = {}

            def create():
                state["m"] = BufModel(self.driver, device, CAPACITIES)

            if self.run(fault2, create):
                create()
            self.m = state["m"]

        @rule(n=st.integers(0, 9), seed=st.integers(0, 1000), fault=faults)
        def pool_copy(self, n, seed, fault):
            x = np.arange(n * 4, dtype=np.int32).reshape(n, 4) + seed
            out = {}

            def copy():
                out["view"] = self.pool.copy_to_uva(x)

            if self.run(fault, copy):
                copy()
            np.testing.assert_array_equal(read_view(out["view"], device), x)

        @rule(
            writes=st.lists(
                st.tuples(
                    st.integers(0, ROWS - 1),
                    st.integers(0, COLS - 1),
                    st.integers(1, COLS),
                    st.integers(-99, 99),
                ),
                min_size=1,
                max_size=6,
            ),
            fault=faults,
        )
        def stage_and_apply(self, writes, fault):
            expected = self.target.copy()
            for row, start, n, value in writes:
                n = min(n, COLS - start)
                values = np.arange(n, dtype=np.int32) + value
                self.swt.stage_write(row, start, values)
                expected[row, start : start + n] = values
            if self.run(fault, self.swt.apply_write):
                if self.driver.injected[-1].kind == "record_event":
                    # The launch was enqueued before its event failed: applied, unstaged.
                    assert self.swt.num_staged_writes == 0
                else:
                    np.testing.assert_array_equal(_read_staged(self.swt, device), self.target)
                    assert self.swt.num_staged_writes == len(writes)
                self.swt.apply_write()
            self.target = expected
            np.testing.assert_array_equal(_read_staged(self.swt, device), self.target)

        @invariant()
        def consistent(self):
            self.driver.check_invariants()
            self.m.check()
            handles_match_chunks(self.driver, self.m.buf, self.swt._allocation.buffer)

        def teardown(self):
            self.pool.close()
            self.swt.free()
            self.m.buf.free()
            gc.collect()
            if self.finalizer_faults:
                leak_gc_fault(self.driver)
            self.driver.assert_clean()

    return Machine


def test_random_operations_with_faults(device):
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    # The cyclic collector stays off for the run (teardown collects explicitly): a fault must
    # land in an operation's own calls, not in a finalizer the collector happens to run then,
    # which made the outcome depend on the garbage earlier tests left. Faults in finalizers
    # have tests of their own (test_regression_pinned_memory_free_failure_in_gc_warns).
    # JAXBUF_NO_SHRINK=1 reports the first failing sequence as found: shrinking one on a GPU
    # can take minutes of device time.
    phases = list(Phase)
    if os.environ.get("JAXBUF_NO_SHRINK") == "1":
        phases.remove(Phase.shrink)
    gc.collect()
    gc.disable()
    try:
        run_state_machine_as_test(
            _state_machine(device),
            settings=settings(
                max_examples=40,
                stateful_step_count=12,
                deadline=None,
                derandomize=True,
                database=None,
                print_blob=True,
                phases=phases,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        gc.enable()
