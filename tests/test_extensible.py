"""ExtensibleTensor: growth, segments, bad input, release, driver faults, lifetime.

Most tests run on every ``device`` (conftest: the CPU driver always, CUDA where present) with
the real driver wrapped in :class:`TrackingDriver`, which checks the VMM rules the CUDA driver
enforces (whole-chunk access, nothing mapped without access, no leaked handle) and injects
failures. A memory-less :class:`FakeDriver` serves the bookkeeping-cost test, whose reservation
is far larger than this machine's memory.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import textwrap
import time

import _forkserver
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbuf._lifetime import release_when_collected
from jaxbuf.devices import Device, as_device
from jaxbuf.drivers import DriverError, get_vmm_driver
from jaxbuf.drivers.base import K_DL_CPU, VmmDriver
from jaxbuf.extensible import ExtensibleTensor, _VirtualBuffer, granule_size
from jaxbuf.testing import FaultInjectingDriver

MiB = 1 << 20
G = 2 * MiB  # the granule on every supported driver (the floor)


# -- drivers for the tests ------------------------------------------------------------------
class TrackingDriver(FaultInjectingDriver):
    """:class:`jaxbuf.testing.FaultInjectingDriver` under the names these tests use.

    ``arm("map", 2)`` makes the second ``map`` call from now on raise a ``DriverError``
    before reaching the wrapped driver (a failed call changes nothing, as the seam says).
    Events are simulated on the CPU, so ``destroy_event`` bookkeeping is checked there too.
    """

    def __init__(self, inner: VmmDriver) -> None:
        super().__init__(inner, simulate_events=True)

    def arm(self, call: str, nth: int = 1) -> None:
        self.fail_on(call, nth)

    def check_consistent(self) -> None:
        self.check_invariants()


class FakeDriver(VmmDriver):
    """Address space without memory: for bookkeeping at sizes no machine could back."""

    platform = "cpu"
    dlpack_device_type = K_DL_CPU

    def __init__(self) -> None:
        self.next_address = 1 << 44
        self.calls = 0

    def unavailable_reason(self):
        return None

    def device_count(self):
        return 1

    def ensure_context(self, device_index):
        pass

    def granularity(self, device_index):
        return 4096

    def reserve(self, size, alignment=0):
        base, self.next_address = self.next_address, self.next_address + size + (1 << 30)
        return base

    def free_reserved(self, ptr, size):
        pass

    def create(self, size, device_index):
        self.calls += 1
        return object()

    def release(self, handle):
        self.calls += 1

    def map(self, ptr, size, handle):
        self.calls += 1

    def unmap(self, ptr, size):
        self.calls += 1

    def set_access(self, ptr, size, device_index):
        self.calls += 1

    def memset(self, ptr, value, size, device_index):
        pass

    def copy(self, dst, src, size, device_index):
        pass

    def synchronize(self, device_index):
        pass

    def host_alloc(self, size, device_index):
        raise NotImplementedError

    def host_free(self, host_ptr):
        raise NotImplementedError


@pytest.fixture
def tracked(device) -> TrackingDriver:
    """The real driver of ``device`` wrapped in a TrackingDriver; checked at teardown."""
    driver = TrackingDriver(get_vmm_driver(device))
    yield driver
    gc.collect()
    driver.check_consistent()


def make(device, driver, *args, **kwargs) -> ExtensibleTensor:
    return ExtensibleTensor(*args, device=device, driver=driver, **kwargs)


# -- reading and writing through views -------------------------------------------------------
def read_segment(buf: ExtensibleTensor, index: int) -> np.ndarray:
    view = buf.segment_view(index)
    if buf.device.platform == "cpu":
        return view.to_numpy().copy()
    return view.to_torch().cpu().numpy()


def write_segment(buf: ExtensibleTensor, index: int, offset: int, data: np.ndarray) -> None:
    view = buf.segment_view(index)
    if buf.device.platform == "cpu":
        view.to_numpy()[offset : offset + len(data)] = data
    else:
        import torch

        view.to_torch()[offset : offset + len(data)].copy_(torch.from_numpy(data))


def pattern(length: int, seed: int = 0) -> np.ndarray:
    return ((np.arange(length, dtype=np.int64) * 7 + seed) % 251 + 1).astype(np.uint8)


def snapshot(buf: ExtensibleTensor) -> tuple:
    return (buf.committed_sizes, buf.physical_bytes, buf.num_physical_chunks, buf.base_ptr)


# -- growth ------------------------------------------------------------------------------
def test_growth_keeps_pointer_and_data(device, tracked):
    with make(device, tracked, 64 * MiB) as buf:
        base = buf.base_ptr
        assert buf.granularity == granule_size(device) == G
        assert buf.capacity_bytes == 64 * MiB and buf.num_bytes == 0
        buf.resize_per_segment_(1000)
        data = pattern(1000)
        write_segment(buf, 0, 0, data)
        for size in (G, G + 1, 5 * G + 17, 64 * MiB):
            buf.resize_per_segment_(size)
            assert buf.base_ptr == base
            assert buf.segment_view(0).ptr == base
            assert buf.segment_view(0).nbytes == size == buf.bytes_per_segment
            np.testing.assert_array_equal(read_segment(buf, 0)[:1000], data)
        assert buf.physical_bytes == 64 * MiB
        # 4 grows that each needed new granules: 4 chunks (1000 -> G stayed in granule 0).
        assert buf.num_physical_chunks == 4
        assert buf.full_view().nbytes == 64 * MiB


def test_views_work_with_torch_and_jax(device, framework, tracked):
    with make(device, tracked, 4 * MiB) as buf:
        buf.resize_per_segment_(4096, zero_new=True)
        write_segment(buf, 0, 0, pattern(4096))
        view = buf.segment_view(0)
        if framework == "torch":
            array = view.to_torch()
            assert array.data_ptr() == view.ptr
            host = array.cpu().numpy()
        else:
            array = view.to_jax()
            assert array.unsafe_buffer_pointer() == view.ptr
            host = np.asarray(array)
        np.testing.assert_array_equal(host, pattern(4096))
        del array


def test_shrink_and_overflow_raise_and_change_nothing(device, tracked):
    with make(device, tracked, 8 * MiB, num_segments=2) as buf:
        buf.resize_per_segment_(512)
        before = snapshot(buf)
        with pytest.raises(ValueError, match="cannot resize from 512 to 256 bytes per segment"):
            buf.resize_per_segment_(256)
        with pytest.raises(ValueError, match="exceeds the segment capacity 4194304"):
            buf.resize_per_segment_(4 * MiB + 1)
        # The second size is bad: the first (valid) one must not be committed either.
        with pytest.raises(ValueError, match="cannot resize from 512 to 0"):
            buf.resize_segments_([3 * MiB, 0])
        assert snapshot(buf) == before
        assert tracked.calls["create"] == 2  # one granule per segment, from the first grow


def test_segments_grow_in_lockstep_with_zeroing(device, tracked):
    with make(device, tracked, 16 * MiB, num_segments=4) as buf:
        assert buf.segment_capacity_bytes == 4 * MiB
        assert buf.segment_offsets == [0, 4 * MiB, 8 * MiB, 12 * MiB]
        buf.resize_per_segment_(100, zero_new=True)
        for i in range(4):
            write_segment(buf, i, 0, pattern(100, seed=i))
        buf.resize_per_segment_(3 * MiB, zero_new=True)
        assert buf.bytes_per_segment == 3 * MiB and buf.num_bytes == 12 * MiB
        for i in range(4):
            data = read_segment(buf, i)
            np.testing.assert_array_equal(data[:100], pattern(100, seed=i))
            assert not data[100:].any(), "new bytes must be zero"
        assert buf._ready_event is not None
        assert len(tracked.live_events) == 1  # the previous event was destroyed


def test_zero_new_zeroes_only_new_bytes_within_a_shared_granule(device, tracked):
    with make(device, tracked, 4 * MiB) as buf:
        buf.resize_per_segment_(10)
        write_segment(buf, 0, 0, pattern(10))
        buf.resize_per_segment_(20, zero_new=True)  # same granule: nothing mapped
        data = read_segment(buf, 0)
        np.testing.assert_array_equal(data[:10], pattern(10))
        assert not data[10:].any()
        assert tracked.calls["create"] == 1


def test_granule_straddling_two_segments_is_mapped_once(device, tracked):
    # Four segments of 0.5 MiB all live in granule 0.
    with make(device, tracked, 2 * MiB, num_segments=4) as buf:
        buf.resize_segments_([1, 0, 0, 0])
        buf.resize_per_segment_(512 * 1024)
        assert buf.num_physical_chunks == 1 and buf.physical_bytes == G
        assert tracked.calls["create"] == 1
    # Unequal segments: the boundary granule [2, 4) MiB is shared by segments 0 and 1.
    with make(device, tracked, 6 * MiB, segment_capacities=[3 * MiB, 3 * MiB]) as buf:
        buf.resize_segments_([3 * MiB, 0])
        buf.resize_segments_([3 * MiB, 2 * MiB])  # needs [2, 4) (mapped) and [4, 6)
        assert buf.physical_bytes == 6 * MiB
        assert buf.num_physical_chunks == 2  # [0, 4) and [4, 6)
        assert buf.segments_backed_by_one_chunk([3 * MiB, 2 * MiB]) == [True, False]
        assert buf.segments_backed_by_one_chunk([3 * MiB, 1 * MiB]) == [True, True]


def test_unequal_segments(device, tracked):
    capacities = [1 * MiB, 5 * MiB, 2 * MiB]
    with make(device, tracked, 8 * MiB, segment_capacities=capacities) as buf:
        assert buf.segment_capacities == capacities
        assert buf.segment_offsets == [0, 1 * MiB, 6 * MiB]
        with pytest.raises(ValueError, match="segments differ"):
            buf.segment_capacity_bytes
        buf.resize_segments_([1 * MiB, 4 * MiB, 100], zero_new=True)
        assert buf.committed_sizes == [1 * MiB, 4 * MiB, 100]
        with pytest.raises(ValueError, match="segments differ"):
            buf.bytes_per_segment
        for i, size in enumerate(buf.committed_sizes):
            assert buf.segment_view(i).nbytes == size
            assert buf.segment_view(i).ptr == buf.base_ptr + buf.segment_offsets[i]
            write_segment(buf, i, 0, pattern(size, seed=i))
        buf.resize_segments_([1 * MiB, 5 * MiB, 2 * MiB])
        for i, size in enumerate([1 * MiB, 4 * MiB, 100]):
            np.testing.assert_array_equal(read_segment(buf, i)[:size], pattern(size, seed=i))
        assert buf.physical_bytes == 8 * MiB


def test_messages_about_the_size_limit_do_not_contradict_themselves():
    # 2**63 - 1 is below 2**63: the message names the real bound, which it is not below.
    with pytest.raises(ValueError) as caught:
        ExtensibleTensor(2**63 - 1, device="cpu")
    message = str(caught.value)
    assert "below 2**63 - 2 MiB = 9223372036852678656" in message and str(2**63 - 1) in message
    assert "must be below 2**63 (" not in message


@pytest.mark.parametrize(
    "capacities, offsets",
    [
        ([1 * MiB, 5 * MiB, 2 * MiB], [0, 1 * MiB, 6 * MiB]),  # multiples of 256: no gaps
        ([1000, 3000, 96, 4 * MiB - 4096], [0, 1024, 4096, 4352]),  # 1000 -> 1024, ...
        ([1] * 4, [0, 256, 512, 768]),
    ],
)
def test_segments_start_aligned_so_every_view_imports_zero_copy(capacities, offsets):
    """Segment starts are rounded up to 256 bytes (JAX imports host memory in place only at
    64-byte alignment); capacities stay the user's, the reservation covers the gaps."""
    with ExtensibleTensor(sum(capacities), device="cpu", segment_capacities=capacities) as buf:
        assert buf.segment_offsets == offsets and buf.segment_capacities == capacities
        assert buf.capacity_bytes >= offsets[-1] + capacities[-1]
        assert buf.full_view().nbytes == offsets[-1] + capacities[-1]
        buf.resize_segments_(capacities, zero_new=True)
        for i in range(len(capacities)):
            view = buf.segment_view(i)
            assert view.ptr == buf.base_ptr + offsets[i] and view.ptr % 256 == 0
            view.to_numpy()[:] = i + 1
        for i in range(len(capacities)):  # segments do not overlap
            assert (buf.segment_view(i).to_numpy() == i + 1).all()
        jax = pytest.importorskip("jax")
        for i in range(len(capacities)):
            view = buf.segment_view(i)
            array = view.to_jax()
            assert array.unsafe_buffer_pointer() == view.ptr  # in place, never a copy
            assert int(jax.numpy.max(array)) == i + 1
            del array


def test_release_and_recommit(device, tracked):
    with make(device, tracked, 8 * MiB, num_segments=2) as buf:
        buf.resize_per_segment_(3 * MiB)
        base, chunks_before = buf.base_ptr, buf.num_physical_chunks
        view = buf.segment_view(0)
        syncs = tracked.calls.get("synchronize", 0)
        buf.release_physical()
        assert tracked.calls["synchronize"] == syncs + 1
        assert buf.num_bytes == 0 and buf.physical_bytes == 0 and buf.num_physical_chunks == 0
        assert not tracked.mapped and tracked.released == tracked.created == chunks_before
        buf.resize_per_segment_(2 * MiB, zero_new=True)
        assert buf.base_ptr == base and buf.segment_view(0).ptr == view.ptr
        assert not read_segment(buf, 0).any()
        write_segment(buf, 1, 0, pattern(2 * MiB))
        np.testing.assert_array_equal(read_segment(buf, 1), pattern(2 * MiB))


def test_free_is_idempotent_and_later_use_raises(device, tracked):
    buf = make(device, tracked, 4 * MiB)
    buf.resize_per_segment_(MiB, zero_new=True)
    buf.free()
    buf.free()
    buf.close()
    assert buf.base_ptr == 0 and buf.physical_bytes == 0 and buf.num_bytes == 0
    assert tracked.calls["free_reserved"] == 1 and not tracked.live_events
    with pytest.raises(RuntimeError, match="freed"):
        buf.resize_per_segment_(2 * MiB)
    with pytest.raises(RuntimeError, match="freed"):
        buf.segment_view(0)
    with pytest.raises(RuntimeError, match="freed"):
        buf.release_physical()


def test_zero_sized_reservation(device, tracked):
    with make(device, tracked, 0) as buf:
        assert buf.capacity_bytes == G and buf.segment_capacities == [0]
        buf.resize_per_segment_(0)
        assert buf.segment_view(0).nbytes == 0 and buf.num_physical_chunks == 0


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_num_bytes": -1}, ValueError, "-1"),
        ({"max_num_bytes": 1.5}, TypeError, "1.5"),
        ({"max_num_bytes": "4096"}, TypeError, "'4096'"),
        ({"max_num_bytes": None}, TypeError, "None"),
        ({"max_num_bytes": True}, TypeError, "True"),
        ({"max_num_bytes": 100, "num_segments": 3}, ValueError, r"\(100\).*\(3\)"),
        ({"max_num_bytes": 100, "num_segments": 0}, ValueError, "0"),
        ({"max_num_bytes": 100, "num_segments": 2.0}, TypeError, "2.0"),
        ({"max_num_bytes": 100, "segment_capacities": [50, 40]}, ValueError, "sum to 90"),
        ({"max_num_bytes": 100, "segment_capacities": [100, 0]}, ValueError, r"\[100, 0\]"),
        ({"max_num_bytes": 100, "segment_capacities": [50, -50, 100]}, ValueError, "-50"),
        ({"max_num_bytes": 0, "segment_capacities": []}, ValueError, "non-empty"),
        ({"max_num_bytes": 100, "segment_capacities": [50.0, 50]}, TypeError, "50.0"),
        ({"max_num_bytes": 100, "segment_capacities": "ab"}, TypeError, "'ab'"),
        (
            {"max_num_bytes": 100, "segment_capacities": [50, 50], "num_segments": 3},
            ValueError,
            "num_segments \\(3\\)",
        ),
        ({"max_num_bytes": 2**63 - 1}, ValueError, "below 2\\*\\*63 - 2 MiB .*9223372036854775807"),
        ({"max_num_bytes": 2**63 - 2 * MiB}, ValueError, str(2**63 - 2 * MiB)),
        (
            {"max_num_bytes": 2**63 - 2 * MiB - 1, "segment_capacities": [1, 2**63 - 2 * MiB - 2]},
            ValueError,
            "each starting at a multiple of 256",
        ),  # the alignment gap overflows
        ({"max_num_bytes": 100, "device": "tpu"}, ValueError, "tpu"),
        ({"max_num_bytes": 100, "device": "cpu:1"}, ValueError, "cpu"),
    ],
)
def test_invalid_constructor_arguments_touch_no_driver(kwargs, error, match):
    driver = TrackingDriver(get_vmm_driver("cpu"))
    kwargs.setdefault("device", "cpu")
    with pytest.raises(error, match=match):
        ExtensibleTensor(driver=driver, **kwargs)
    assert not any(driver.calls.values()), driver.calls


def test_numpy_integers_are_accepted(tracked, device):
    with make(device, tracked, np.int64(4 * MiB), num_segments=np.int32(2)) as buf:
        buf.resize_segments_(np.array([10, 20]))
        buf.resize_per_segment_(np.uint16(30))
        assert buf.committed_sizes == [30, 30] and type(buf.num_bytes) is int
        assert buf.segment_view(np.int8(1)).nbytes == 30


def test_unknown_cuda_device_names_it():
    from jaxbuf.drivers import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        # No CUDA here: the driver says why, naming the device.
        with pytest.raises(RuntimeError, match="cuda:99"):
            ExtensibleTensor(4 * MiB, device="cuda:99")
    else:
        with pytest.raises(ValueError, match="cuda:99"):
            ExtensibleTensor(4 * MiB, device="cuda:99")


def test_driver_platform_must_match_device(tracked):
    with pytest.raises(ValueError, match="platform"):
        ExtensibleTensor(4 * MiB, device=Device("cuda", 0), driver=FakeDriver())
    with pytest.raises(TypeError, match="VmmDriver"):
        ExtensibleTensor(4 * MiB, device="cpu", driver="host")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda b: b.resize_segments_([1, 2, 3]), ValueError, "Expected 2 sizes, got 3"),
        (lambda b: b.resize_segments_([1, -2]), ValueError, "-2"),
        (lambda b: b.resize_segments_([1, 2.5]), TypeError, "2.5"),
        (lambda b: b.resize_segments_([1, None]), TypeError, "None"),
        (lambda b: b.resize_segments_([1, False]), TypeError, "False"),
        (lambda b: b.resize_segments_("12"), TypeError, "'12'"),
        (lambda b: b.resize_segments_(5), TypeError, "5"),
        (lambda b: b.resize_per_segment_(-1), ValueError, "-1"),
        (lambda b: b.resize_per_segment_("1"), TypeError, "'1'"),
        (lambda b: b.resize_per_segment_(100), ValueError, "cannot resize from 200 to 100"),
        (lambda b: b.resize_per_segment_(2 * MiB + 1), ValueError, "2097153"),
        (lambda b: b.segment_view(2), IndexError, "2"),
        (lambda b: b.segment_view(-1), IndexError, "-1"),
        (lambda b: b.segment_view(True), TypeError, "True"),
        (lambda b: b.segment_view(0.0), TypeError, "0.0"),
        (lambda b: b.segment_view("0"), TypeError, "'0'"),
        (lambda b: b.segments_backed_by_one_chunk([1]), ValueError, "Expected 2 sizes"),
    ],
)
def test_invalid_calls_raise_and_change_nothing(device, tracked, call, error, match):
    with make(device, tracked, 4 * MiB, num_segments=2) as buf:
        buf.resize_per_segment_(200)
        before, calls = snapshot(buf), dict(tracked.calls)
        with pytest.raises(error, match=match):
            call(buf)
        assert snapshot(buf) == before and tracked.calls == calls


# -- driver failures -------------------------------------------------------------------------
# Three segments of 4 granules, with [G, 0, G] committed: growing to [3G, 2G, 3G] needs
# three gaps, so create/map/set_access each run three times. The unequal layout adds a
# granule shared by two segments and a set_access over a run merged with earlier chunks.
LAYOUTS = {
    "equal": ([4 * G] * 3, [G, 0, G], [3 * G, 2 * G, 3 * G]),
    "unequal": ([G + G // 2, 3 * G, G // 2 + 2 * G], [G, 0, G // 4], [G + G // 2, 3 * G, 2 * G]),
}


def _fault_cases():
    for layout, call in itertools.product(LAYOUTS, ["create", "map", "set_access", "memset"]):
        for nth in (1, 2, 3):
            if call == "memset" and nth > 1:
                continue
            yield layout, call, nth


@pytest.mark.parametrize("layout, call, nth", list(_fault_cases()))
def test_driver_failure_at_every_position_rolls_back(device, tracked, layout, call, nth):
    capacities, first, second = LAYOUTS[layout]
    with make(device, tracked, sum(capacities), segment_capacities=capacities) as buf:
        buf.resize_segments_(first, zero_new=True)
        for i, size in enumerate(first):
            write_segment(buf, i, 0, pattern(size, seed=i))
        before = snapshot(buf)
        tracked.arm(call, nth)
        with pytest.raises(DriverError, match="INJECTED_FAULT"):
            buf.resize_segments_(second, zero_new=True)
        if call == "memset":
            # The memory is committed (mapped, accessible, recorded); the sizes are not.
            assert buf.committed_sizes == before[0] and buf.base_ptr == before[3]
        else:
            assert snapshot(buf) == before
        tracked.check_consistent()
        assert tracked.created - tracked.released == buf.num_physical_chunks
        assert len(tracked.mapped) == buf.num_physical_chunks
        # A retry without the fault succeeds; old data is kept and new bytes are zero.
        tracked.disarm()
        buf.resize_segments_(second, zero_new=True)
        tracked.check_consistent()
        for i, (old, new) in enumerate(zip(first, second)):
            data = read_segment(buf, i)
            assert len(data) == new
            np.testing.assert_array_equal(data[:old], pattern(old, seed=i))
            assert not data[old:].any()


def test_rollback_failure_is_attached_as_a_note(device, tracked):
    with make(device, tracked, 8 * MiB, num_segments=2) as buf:
        buf.resize_per_segment_(MiB)
        before = snapshot(buf)
        tracked.arm("set_access", 2)  # the second segment's grow fails ...
        tracked.arm("release", 1)  # ... and so does releasing its chunk during rollback.
        with pytest.raises(DriverError, match="set_access.*INJECTED_FAULT") as info:
            buf.resize_per_segment_(3 * MiB)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "rollback" in notes and "release" in notes, notes
        assert snapshot(buf) == before  # the first segment's chunk was rolled back too
        tracked.disarm()
        # The handle whose release failed is retried by release_physical.
        buf.release_physical()
        buf.resize_per_segment_(3 * MiB)
    assert tracked.created == tracked.released


def test_failed_unmap_during_rollback_keeps_the_chunk_and_blocks_growth(device, tracked):
    with make(device, tracked, 8 * MiB, num_segments=2) as buf:
        buf.resize_per_segment_(MiB)
        tracked.arm("set_access", 1)
        tracked.arm("unmap", 1)
        with pytest.raises(DriverError, match="INJECTED_FAULT") as info:
            buf.resize_segments_([3 * MiB, MiB])
        assert any("unmap" in note for note in info.value.__notes__)
        assert buf.committed_sizes == [MiB, MiB]
        # The stranded chunk is tracked (nothing leaks), and growth refuses until released.
        assert len(tracked.mapped) == buf.num_physical_chunks == 3
        with pytest.raises(RuntimeError, match="release_physical"):
            buf.resize_segments_([3 * MiB, MiB])
        tracked.disarm()
        buf.release_physical()
        buf.resize_segments_([3 * MiB, MiB], zero_new=True)
        tracked.check_consistent()


def test_release_physical_failure_keeps_unreleased_chunks_tracked(device, tracked):
    with make(device, tracked, 8 * MiB, num_segments=2) as buf:
        buf.resize_per_segment_(3 * MiB)
        tracked.arm("unmap", 2)
        with pytest.raises(DriverError):
            buf.release_physical()
        assert buf.num_bytes == 0
        assert len(tracked.mapped) == buf.num_physical_chunks == 1
        tracked.check_consistent()
        buf.resize_per_segment_(4 * MiB, zero_new=True)  # around the surviving chunk
        tracked.check_consistent()
        assert not read_segment(buf, 1).any()


def test_reserve_failure_leaves_nothing(device, tracked):
    tracked.arm("reserve", 1)
    with pytest.raises(DriverError):
        make(device, tracked, 4 * MiB)
    gc.collect()
    assert not tracked.calls.get("free_reserved")


# -- lifetime --------------------------------------------------------------------------------
def test_del_frees_and_warns_when_free_fails(device, tracked):
    buf = make(device, tracked, 4 * MiB)
    buf.resize_per_segment_(MiB)
    del buf
    gc.collect()
    assert tracked.calls["free_reserved"] == 1 and not tracked.mapped

    buf = make(device, tracked, 4 * MiB)
    tracked.arm("free_reserved", 1)
    with pytest.warns(ResourceWarning, match="free_reserved"):
        del buf
        gc.collect()
    tracked.violations.clear()  # that reservation leaked on purpose


def test_no_driver_call_while_finalizing(device, tracked):
    buf = make(device, tracked, 4 * MiB)
    buf.resize_per_segment_(MiB)
    calls = dict(tracked.calls)
    buf._buffer.__del__(
        _release=lambda release, what, **kwargs: release_when_collected(
            release, what, _is_finalizing=lambda: True, **kwargs
        )
    )
    assert tracked.calls == calls
    buf.free()


_EXIT_SCRIPT = textwrap.dedent(
    """
    import gc, sys
    import jax, jax.numpy as jnp, torch
    from jaxbuf.extensible import ExtensibleTensor

    buf = ExtensibleTensor(8 << 20, device="cpu", num_segments=2)
    buf.resize_per_segment_(1 << 20, zero_new=True)
    tensor = torch.from_dlpack(buf.segment_view(0))
    tensor2 = buf.segment_view(1).to_torch(dtype=torch.float32)
    array = jax.dlpack.from_dlpack(buf.segment_view(1))
    array2 = buf.segment_view(0).to_jax(dtype=jnp.int32)
    tensor += 1
    assert int(array.sum()) == 0 and int(tensor.sum()) == 1 << 20
    cycle = [buf, tensor, array]
    cycle.append(cycle)
    # an unowned buffer with a view, dropped with the interpreter
    other = ExtensibleTensor(4 << 20, device="cpu")
    other.resize_per_segment_(4096)
    keep = other.segment_view(0).to_numpy()
    print("ok")
    """
)


def test_views_alive_at_interpreter_exit():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONWARNINGS="error::ResourceWarning")
    result = _forkserver.run([sys.executable, "-c", _EXIT_SCRIPT], env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "Exception ignored" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


# -- randomized, against a numpy model ------------------------------------------------------
segment_layouts = st.lists(
    st.integers(1, 5 * G // 4096).map(lambda pages: pages * 1024), min_size=1, max_size=4
)


@st.composite
def programs(draw):
    capacities = draw(segment_layouts)
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["grow", "grow", "grow", "write", "write", "release", "free"]))
        if kind == "grow":
            fractions = draw(
                st.lists(st.floats(0, 1), min_size=len(capacities), max_size=len(capacities))
            )
            steps.append(("grow", fractions, draw(st.booleans())))
        elif kind == "write":
            steps.append(
                (
                    "write",
                    draw(st.integers(0, len(capacities) - 1)),
                    draw(st.floats(0, 1)),
                    draw(st.floats(0, 1)),
                    draw(st.integers(1, 255)),
                )
            )
        else:
            steps.append((kind,))
    return capacities, steps


def _expected_physical_bytes(buf: ExtensibleTensor) -> int:
    granules = set()
    for offset, size in zip(buf.segment_offsets, buf.committed_sizes):
        if size:
            granules.update(range(offset // G, -(-(offset + size) // G)))
    return len(granules) * G


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(program=programs())
def test_random_operations_match_a_model(device, program):
    capacities, steps = program
    driver = TrackingDriver(get_vmm_driver(device))
    buf = ExtensibleTensor(
        sum(capacities), device=device, segment_capacities=capacities, driver=driver
    )
    model = [np.zeros(c, np.uint8) for c in capacities]
    known = [np.zeros(c, bool) for c in capacities]
    sizes = [0] * len(capacities)
    try:
        for step in steps:
            if step[0] == "grow":
                _, fractions, zero_new = step
                new = [max(s, int(f * c)) for s, f, c in zip(sizes, fractions, capacities)]
                buf.resize_segments_(new, zero_new=zero_new)
                for i, (old, size) in enumerate(zip(sizes, new)):
                    if zero_new:
                        model[i][old:size], known[i][old:size] = 0, True
                sizes = new
            elif step[0] == "write":
                _, i, a, b, value = step
                start, end = sorted((int(a * sizes[i]), int(b * sizes[i])))
                if start == end:
                    continue
                write_segment(buf, i, start, np.full(end - start, value, np.uint8))
                model[i][start:end], known[i][start:end] = value, True
            elif step[0] == "release":
                buf.release_physical()
                sizes = [0] * len(capacities)
                for mask in known:
                    mask[:] = False
            else:
                buf.free()
                with pytest.raises(RuntimeError, match="freed"):
                    buf.resize_per_segment_(0)
                assert buf.physical_bytes == 0 and not driver.mapped
                break
            assert buf.committed_sizes == sizes
            assert buf.physical_bytes == _expected_physical_bytes(buf)
            driver.check_consistent()
            for i, size in enumerate(sizes):
                data = read_segment(buf, i)
                assert len(data) == size
                mask = known[i][:size]
                np.testing.assert_array_equal(data[mask], model[i][:size][mask])
    finally:
        buf.free()
    driver.check_consistent()
    assert driver.created == driver.released


# -- bookkeeping cost ------------------------------------------------------------------------
def _seconds_per_grow(num_runs: int, grows: int = 300) -> float:
    """Best-of-5 mean cost of committing one new granule next to ``num_runs`` runs."""
    driver = FakeDriver()
    buffer = _VirtualBuffer(4 * (num_runs + 5 * grows) * G, 0, driver, G)
    for i in range(num_runs):  # runs at granules 0, 2, 4, ...: none merge
        buffer.ensure_committed_ranges([(2 * i * G, (2 * i + 1) * G)])
    assert buffer.num_chunks == num_runs
    best = float("inf")
    base = 2 * num_runs
    for attempt in range(5):
        offsets = [(base + 2 * (attempt * grows + k)) * G for k in range(grows)]
        calls = driver.calls
        begin = time.perf_counter()
        for offset in offsets:
            buffer.ensure_committed_ranges([(offset, offset + 1)])
        best = min(best, time.perf_counter() - begin)
        assert driver.calls - calls == 3 * grows  # create, map, set_access; nothing else
    assert buffer.physical_bytes == (num_runs + 5 * grows) * G
    return best / grows


def test_grow_cost_does_not_depend_on_what_is_committed():
    # A per-granule walk (the seed) grows ~100x from 100 to 10,000 runs; intervals do not.
    small, large = _seconds_per_grow(100), _seconds_per_grow(10_000)
    assert large < 4 * small, f"100 runs: {small * 1e6:.1f} us, 10,000: {large * 1e6:.1f} us"


def test_terabyte_reservation_bookkeeping():
    # 1 TiB of 2 MiB granules: one grow of the whole thing is one chunk, and growing by
    # one granule at the end costs the same as at the start.
    with ExtensibleTensor(1 << 40, device="cpu", num_segments=2, driver=FakeDriver()) as buf:
        buf.resize_segments_([G, 0])
        buf.resize_segments_([(1 << 39) - G, G])
        assert buf.num_physical_chunks == 3 and buf.physical_bytes == (1 << 39)
        assert buf.segments_backed_by_one_chunk([G, G]) == [True, True]
        assert buf.segments_backed_by_one_chunk([2 * G, G]) == [False, True]


def test_granule_size():
    assert granule_size("cpu") == G
    assert granule_size(as_device("cpu"), FakeDriver()) == G

    class Big(FakeDriver):
        def granularity(self, device_index):
            return 3 * MiB

    assert granule_size("cpu", Big()) == 3 * MiB
