"""HostVmmDriver: the CUDA VMM model on mmap/memfd (Linux only)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbuf.drivers import K_DL_CPU, DriverError, HostVmmDriver, get_vmm_driver
from jaxbuf.drivers import host as host_module
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.drivers.host import HostChunk
from jaxbuf.testing import FaultInjectingDriver

PAGE = mmap.PAGESIZE

pytestmark = pytest.mark.skipif(
    HostVmmDriver().unavailable_reason() is not None,
    reason=str(HostVmmDriver().unavailable_reason()),
)


@pytest.fixture(params=[False, True], ids=["normal", "debug"])
def driver(request) -> HostVmmDriver:
    """Each driver test in both modes: the same calls, only uncommitted ranges differ."""
    return HostVmmDriver(debug=request.param)


def reserved(driver: HostVmmDriver) -> set[str]:
    """The permissions of an uncommitted range: readable zeros, or none in debug mode."""
    return {"---p"} if driver.debug else {"r--p"}


def maps_permissions(ptr: int, size: int) -> set[str]:
    """The permission strings of /proc/self/maps covering every byte of [ptr, ptr + size)."""
    end, covered, perms = ptr + size, 0, set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, mode = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            overlap = min(high, end) - max(low, ptr)
            if overlap > 0:
                covered += overlap
                perms.add(mode)
    assert covered == size, f"[{ptr:#x}, {end:#x}) not fully mapped"
    return perms


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_identity(driver):
    assert driver.platform == "cpu"
    assert driver.dlpack_device_type == K_DL_CPU == 1
    assert driver.dlpack_host_device_type == K_DL_CPU
    assert driver.unavailable_reason() is None
    assert driver.device_count() == 1
    assert driver.granularity(0) == PAGE
    driver.ensure_context(0)
    driver.synchronize(0)
    assert driver.record_ready_event(0) is None


def test_other_device_index_is_rejected(driver):
    with pytest.raises(DriverError, match="ENODEV") as info:
        driver.create(PAGE, 1)
    assert info.value.details == {"device": 1}


def test_reserve_map_write_read_unmap_release(driver):
    size = 4 * PAGE
    base = driver.reserve(size)
    assert maps_permissions(base, size) == reserved(driver)
    first, second = driver.create(2 * PAGE, 0), driver.create(2 * PAGE, 0)
    driver.map(base, 2 * PAGE, first)
    driver.map(base + 2 * PAGE, 2 * PAGE, second)
    driver.set_access(base, size, 0)
    assert maps_permissions(base, size) == {"rw-s"}
    assert ctypes.string_at(base, size) == bytes(size)  # fresh chunks read as zeros

    driver.memset(base, 0xAB, 2 * PAGE, 0)
    driver.memset(base + 2 * PAGE, 0xCD, 2 * PAGE, 0)
    driver.unmap(base, 2 * PAGE)
    assert maps_permissions(base, 2 * PAGE) == reserved(driver)
    assert ctypes.string_at(base + 2 * PAGE, 2 * PAGE) == b"\xcd" * (2 * PAGE)

    driver.release(first)
    driver.unmap(base + 2 * PAGE, 2 * PAGE)
    driver.release(second)  # after unmap, as the buffer layer does
    assert maps_permissions(base, size) == reserved(driver)
    driver.free_reserved(base, size)


def test_data_round_trips_through_copy(driver):
    base = driver.reserve(PAGE)
    chunk = driver.create(PAGE, 0)
    driver.map(base, PAGE, chunk)
    host_ptr, _ = driver.host_alloc(PAGE, 0)
    payload = bytes(range(256)) * (PAGE // 256)
    ctypes.memmove(host_ptr, payload, PAGE)

    driver.copy(base, host_ptr, PAGE, 0)
    driver.memset(host_ptr, 0, PAGE, 0)
    driver.copy(host_ptr, base, PAGE, 0)
    assert ctypes.string_at(host_ptr, PAGE) == payload
    assert ctypes.string_at(base, PAGE) == payload

    driver.host_free(host_ptr)
    driver.unmap(base, PAGE)
    driver.release(chunk)
    driver.free_reserved(base, PAGE)


def test_remap_after_unmap_sees_fresh_zero_pages(driver):
    base = driver.reserve(PAGE)
    old = driver.create(PAGE, 0)
    driver.map(base, PAGE, old)
    driver.memset(base, 0xFF, PAGE, 0)
    driver.unmap(base, PAGE)
    driver.release(old)
    new = driver.create(PAGE, 0)
    driver.map(base, PAGE, new)
    assert ctypes.string_at(base, PAGE) == bytes(PAGE)
    driver.unmap(base, PAGE)
    driver.release(new)
    driver.free_reserved(base, PAGE)


def test_mapped_chunks_hold_no_file_descriptors(driver):
    count = 2000
    base = driver.reserve(count * PAGE)
    before = open_fd_count()
    chunks = []
    for i in range(count):
        chunk = driver.create(PAGE, 0)
        driver.map(base + i * PAGE, PAGE, chunk)
        chunks.append(chunk)
    assert open_fd_count() == before
    assert all(chunk.fd == -1 for chunk in chunks)
    driver.memset(base, 1, count * PAGE, 0)
    driver.unmap(base, count * PAGE)  # one call unmaps many chunks
    for chunk in chunks:
        driver.release(chunk)
    assert open_fd_count() == before
    assert maps_permissions(base, count * PAGE) == reserved(driver)
    driver.free_reserved(base, count * PAGE)


def test_unmapped_chunk_holds_one_descriptor_until_released(driver):
    before = open_fd_count()
    chunk = driver.create(PAGE, 0)
    assert open_fd_count() == before + 1
    driver.release(chunk)
    assert open_fd_count() == before


@pytest.mark.parametrize("alignment", [0, PAGE, 3 * PAGE, 2 << 20, 64 << 20])
def test_reserve_honours_alignment(driver, alignment):
    size = 5 * PAGE
    base = driver.reserve(size, alignment)
    assert base % max(alignment, PAGE) == 0
    assert maps_permissions(base, size) == reserved(driver)
    chunk = driver.create(PAGE, 0)
    driver.map(base + size - PAGE, PAGE, chunk)  # the last page belongs to the reservation
    driver.unmap(base + size - PAGE, PAGE)
    driver.release(chunk)
    driver.free_reserved(base, size)


@pytest.mark.parametrize("alignment", [-PAGE, PAGE // 2, PAGE + 1])
def test_reserve_rejects_bad_alignment(driver, alignment):
    with pytest.raises(DriverError, match="EINVAL"):
        driver.reserve(PAGE, alignment)


def test_reserve_failure_names_call_error_and_size(driver):
    with pytest.raises(DriverError) as info:
        driver.reserve(2**62)
    error = info.value
    assert error.call == "mmap"
    assert error.error_name == "ENOMEM"
    assert error.out_of_memory
    assert "mmap(" in str(error) and f"size={2**62}" in str(error) and "ENOMEM" in str(error)


@pytest.mark.parametrize(
    "call",
    [
        lambda d: d.reserve(0),
        lambda d: d.reserve(PAGE + 1),
        lambda d: d.create(-PAGE, 0),
        lambda d: d.map(PAGE + 1, PAGE, HostChunk(-1, PAGE)),
        lambda d: d.unmap(PAGE, PAGE // 2),
        lambda d: d.set_access(PAGE + 8, PAGE, 0),
        lambda d: d.free_reserved(PAGE, 0),
        lambda d: d.memset(PAGE, 0, -1, 0),
        lambda d: d.copy(PAGE, PAGE, -1, 0),
        lambda d: d.host_alloc(0, 0),
    ],
)
def test_bad_arguments_raise_einval(driver, call):
    with pytest.raises(DriverError, match="EINVAL"):
        call(driver)


def test_release_twice_raises(driver):
    chunk = driver.create(PAGE, 0)
    driver.release(chunk)
    with pytest.raises(DriverError, match=r"release\(.*\) failed: EBADF"):
        driver.release(chunk)


def test_chunk_maps_once(driver):
    base = driver.reserve(2 * PAGE)
    chunk = driver.create(PAGE, 0)
    driver.map(base, PAGE, chunk)
    with pytest.raises(DriverError, match="state=mapped"):
        driver.map(base + PAGE, PAGE, chunk)
    driver.unmap(base, PAGE)
    driver.release(chunk)
    with pytest.raises(DriverError, match="state=released"):
        driver.map(base, PAGE, chunk)
    driver.free_reserved(base, 2 * PAGE)


def test_failed_map_leaves_chunk_owned_and_releasable(driver):
    before = open_fd_count()
    base = driver.reserve(2 * PAGE)
    chunk = driver.create(PAGE, 0)
    with pytest.raises(DriverError, match="chunk_size"):
        driver.map(base, 2 * PAGE, chunk)  # not the whole chunk
    # Beyond the user address space: the kernel itself refuses the mapping.
    with pytest.raises(DriverError) as info:
        driver.map(1 << 63, PAGE, chunk)
    assert info.value.call == "mmap" and "ptr=0x8000000000000000" in str(info.value)
    assert fd_is_open(chunk.fd) and not chunk.mapped
    driver.map(base, PAGE, chunk)  # still usable after the failures
    driver.unmap(base, PAGE)
    driver.release(chunk)
    driver.free_reserved(base, 2 * PAGE)
    assert open_fd_count() == before


def test_host_alloc_round_trip(driver):
    host_ptr, device_ptr = driver.host_alloc(3 * PAGE + 5, 0)
    assert host_ptr == device_ptr and host_ptr % PAGE == 0
    assert maps_permissions(host_ptr, 3 * PAGE + 5) == {"rw-p"}
    driver.memset(host_ptr, 0x5A, 3 * PAGE + 5, 0)
    assert ctypes.string_at(host_ptr, 3 * PAGE + 5) == b"\x5a" * (3 * PAGE + 5)
    driver.host_free(host_ptr)
    with pytest.raises(DriverError, match="not from host_alloc"):
        driver.host_free(host_ptr)


def test_get_vmm_driver_caches_one_cpu_driver():
    from jaxbuf.devices import Device

    driver = get_vmm_driver("cpu")
    assert isinstance(driver, HostVmmDriver)
    assert get_vmm_driver(Device("cpu", 0)) is driver


def test_get_vmm_driver_rejects_unknown_devices():
    with pytest.raises(ValueError, match="tpu"):
        get_vmm_driver("tpu")
    with pytest.raises(ValueError, match="cpu"):
        get_vmm_driver("cpu:1")


# -- copy_batch ---------------------------------------------------------------------------
BATCH_PATHS = ["c", "ctypes"]


@contextlib.contextmanager
def batch_path(path: str):
    """copy_batch through the C extension ("c", skipped when it is not built) or through the
    ctypes fallback ("ctypes": the extension patched away)."""
    if path == "c":
        if host_module._host_calls is None:
            pytest.skip("jaxbuf.drivers._host_calls is not built")
        yield
        return
    saved, host_module._host_calls = host_module._host_calls, None
    try:
        yield
    finally:
        host_module._host_calls = saved


def batch(*columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.asarray(column, dtype=np.uint64) for column in columns)


def address(array: np.ndarray, offset: int = 0) -> int:
    return array.ctypes.data + offset


@contextlib.contextmanager
def two_mapped_buffers(driver, size):
    """Two chunks mapped side by side in one reservation: a "local" and a "peer" buffer."""
    base = driver.reserve(2 * size)
    chunks = [driver.create(size, 0), driver.create(size, 0)]
    for index, chunk in enumerate(chunks):
        driver.map(base + index * size, size, chunk)
    driver.set_access(base, 2 * size, 0)
    try:
        yield base, base + size
    finally:
        for index, chunk in enumerate(chunks):
            driver.unmap(base + index * size, size)
            driver.release(chunk)
        driver.free_reserved(base, 2 * size)


SPAN = 1 << 16
triples = st.lists(
    st.tuples(st.integers(0, SPAN - 1), st.integers(0, SPAN - 1), st.integers(0, 4096)),
    max_size=64,
)


@pytest.mark.parametrize("path", BATCH_PATHS)
@settings(max_examples=60, deadline=None)
@given(triples=triples, seed=st.integers(0, 2**32 - 1))
def test_copy_batch_matches_numpy(path, triples, seed):
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, SPAN, dtype=np.uint8)
    target = rng.integers(0, 256, SPAN, dtype=np.uint8)
    triples = [(d, s, min(n, SPAN - d, SPAN - s)) for d, s, n in triples]
    expected = target.copy()
    for dst, src, size in triples:  # in order: later copies win where destinations overlap
        expected[dst : dst + size] = source[src : src + size]
    dsts, srcs, sizes = batch(
        [address(target, d) for d, _, _ in triples],
        [address(source, s) for _, s, _ in triples],
        [n for _, _, n in triples],
    )
    with batch_path(path):
        assert HostVmmDriver().copy_batch(dsts, srcs, sizes, 0) is None
    np.testing.assert_array_equal(target, expected)


@pytest.mark.parametrize("path", BATCH_PATHS)
def test_copy_batch_between_two_mappings(driver, path):
    size = 16 * PAGE
    with two_mapped_buffers(driver, size) as (local, peer):
        pattern = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        ctypes.memmove(peer, pattern.ctypes.data, size)
        blocks = np.random.default_rng(2).permutation(16)  # peer block i -> local block p[i]
        dsts, srcs, sizes = batch(
            local + blocks * PAGE, peer + np.arange(16) * PAGE, np.full(16, PAGE)
        )
        with batch_path(path):
            driver.copy_batch(dsts, srcs, sizes, 0)
        copied = np.frombuffer(ctypes.string_at(local, size), np.uint8).reshape(16, PAGE)
        np.testing.assert_array_equal(copied[blocks], pattern.reshape(16, PAGE))


@pytest.mark.parametrize("path", BATCH_PATHS)
def test_copy_batch_of_64_mib_in_one_copy(driver, path):
    size = 64 << 20
    source = np.frombuffer(np.random.default_rng(3).bytes(size), np.uint8)
    target = np.zeros(size, np.uint8)
    with batch_path(path):
        driver.copy_batch(*batch([address(target)], [address(source)], [size]), 0)
    assert np.array_equal(target, source)


STREAMED = 40 << 20  # over the C copy's streaming threshold (32 MiB a batch)


@settings(max_examples=8, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=24),
    shifts=st.lists(st.integers(0, 63), min_size=24, max_size=24),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_batch_large_enough_to_stream_matches_numpy(sizes, shifts, seed):
    """A batch of 32 MiB or more goes through streaming stores in C: every size (below and
    above the 4 KiB streaming minimum, not a multiple of the 256-byte stride), every
    alignment of both sides, overlapping copies in order, byte for byte as numpy."""
    if host_module._host_calls is None:
        pytest.skip("jaxbuf.drivers._host_calls is not built")
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, STREAMED, dtype=np.uint8)
    target = rng.integers(0, 256, STREAMED, dtype=np.uint8)
    expected = target.copy()
    triples = [(0, 0, 32 << 20)]  # one large copy makes the batch stream
    cursor = 32 << 20
    for size, shift in zip(sizes, shifts):
        dst = min(cursor + shift, STREAMED - size)
        src = int(rng.integers(0, STREAMED - size + 1))
        triples.append((dst, src, size))
        cursor = dst + size // 2  # the next copy may overlap this one's destination
    for dst, src, size in triples:  # in order: later copies win where they overlap
        expected[dst : dst + size] = source[src : src + size]
    dsts, srcs, lengths = batch(
        [address(target, d) for d, _, _ in triples],
        [address(source, s) for _, s, _ in triples],
        [n for _, _, n in triples],
    )
    HostVmmDriver().copy_batch(dsts, srcs, lengths, 0)
    np.testing.assert_array_equal(target, expected)


def test_a_streamed_copy_within_one_buffer_overlapping_itself_is_a_memmove():
    """A copy whose own source and destination overlap never streams (it is a memmove),
    even in a batch large enough to."""
    if host_module._host_calls is None:
        pytest.skip("jaxbuf.drivers._host_calls is not built")
    data = np.arange(STREAMED, dtype=np.uint8)
    expected = data.copy()
    expected[4096 : (36 << 20) + 4096] = data[: 36 << 20].copy()
    HostVmmDriver().copy_batch(*batch([address(data, 4096)], [address(data)], [36 << 20]), 0)
    np.testing.assert_array_equal(data, expected)


@pytest.mark.parametrize("path", BATCH_PATHS)
def test_copy_batch_empty_and_zero_sizes(driver, path):
    target, source = np.zeros(8, np.uint8), np.arange(8, dtype=np.uint8)
    with batch_path(path):
        assert driver.copy_batch(*batch([], [], []), 0) is None
        # Copies of size 0 touch nothing, even at address 0.
        driver.copy_batch(*batch([0, address(target, 2)], [0, address(source, 5)], [0, 3]), 0)
    assert target.tolist() == [0, 0, 5, 6, 7, 0, 0, 0]


def _bad_batches(target, source):
    good = batch([address(target)], [address(source)], [4])
    dsts, srcs, sizes = good
    two = np.zeros(2, np.uint64)
    return [
        ((two, srcs, sizes), ValueError, "one length, got 2, 1 and 1"),
        ((dsts, srcs, np.zeros(0, np.uint64)), ValueError, "one length"),
        ((dsts.astype(np.int64), srcs, sizes), TypeError, "dsts must have dtype uint64.*int64"),
        ((dsts, srcs.astype(np.uint32), sizes), TypeError, "srcs must have dtype uint64.*uint32"),
        ((dsts, srcs, sizes.astype(np.float64)), TypeError, "sizes must have dtype uint64"),
        ((dsts, srcs, sizes.astype(">u8")), TypeError, "sizes must have dtype uint64 \\(native"),
        (([address(target)], srcs, sizes), TypeError, "dsts must be a 1-D numpy array.*list"),
        ((dsts, None, sizes), TypeError, "srcs must be a 1-D numpy array.*NoneType"),
        ((dsts, srcs, int(sizes[0])), TypeError, "sizes must be a 1-D numpy array.*int"),
        ((dsts.reshape(1, 1), srcs, sizes), ValueError, "dsts must be 1-D, got shape \\(1, 1\\)"),
        ((dsts, np.uint64(srcs[0]), sizes), ValueError, "srcs must be 1-D, got shape \\(\\)"),
        ((np.repeat(dsts, 2)[::2], srcs, sizes), None, None),  # one entry: contiguous anyway
        ((dsts, srcs, np.repeat(sizes, 4)[::2]), ValueError, "sizes must be C-contiguous"),
    ]


@pytest.mark.parametrize("path", BATCH_PATHS)
def test_copy_batch_bad_input_changes_nothing(driver, path):
    target, source = np.zeros(8, np.uint8), np.arange(1, 9, dtype=np.uint8)
    with batch_path(path):
        for arguments, error, message in _bad_batches(target, source):
            target[:] = 0
            if error is None:  # the control: the same batch, well formed, copies
                driver.copy_batch(*arguments, 0)
                assert target.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
                continue
            with pytest.raises(error, match=message):
                driver.copy_batch(*arguments, 0)
            assert not target.any(), arguments
        with pytest.raises(DriverError, match="copy_batch.*ENODEV"):
            driver.copy_batch(*batch([address(target)], [address(source)], [4]), 1)
        assert not target.any()


def test_copy_batch_uses_the_c_extension_when_built():
    module = pytest.importorskip("jaxbuf.drivers._host_calls")
    assert host_module._host_calls is module


def test_host_calls_copy_batch_checks_its_arguments():
    module = pytest.importorskip("jaxbuf.drivers._host_calls")
    target, source = np.zeros(4, np.uint8), np.arange(1, 5, dtype=np.uint8)
    dsts, srcs, sizes = batch([address(target)], [address(source)], [4])
    with pytest.raises(TypeError, match="3 arguments"):
        module.copy_batch(dsts, srcs)
    with pytest.raises(TypeError, match="srcs must be a 1-D numpy array of uint64"):
        module.copy_batch(dsts, [1], sizes)
    with pytest.raises(TypeError, match="sizes must have dtype uint64"):
        module.copy_batch(dsts, srcs, sizes.astype(np.int64))
    with pytest.raises(TypeError, match="dsts must have dtype uint64"):
        module.copy_batch(dsts.astype(">u8"), srcs, sizes)
    with pytest.raises(ValueError, match="srcs must be 1-D"):
        module.copy_batch(dsts, srcs.reshape(1, 1), sizes)
    with pytest.raises(ValueError, match="dsts must be C-contiguous"):
        two = np.repeat(srcs, 2)
        module.copy_batch(np.repeat(dsts, 4)[::2], two, np.repeat(sizes, 2))
    with pytest.raises(ValueError, match="one length"):
        module.copy_batch(np.repeat(dsts, 2), srcs, sizes)
    empty = np.zeros(0, np.uint64)
    module.copy_batch(empty, empty, empty)  # an empty batch reads nothing
    assert not target.any()
    module.copy_batch(dsts, srcs, sizes)
    assert target.tolist() == [1, 2, 3, 4]


def test_copy_batch_releases_the_gil():
    # A thread spinning in Python makes progress while a batch of 128 MiB of copies runs in C.
    # The switch interval is raised to 10 s, so the main thread never hands the GIL over on a
    # timer: the spinner can run during the call only if the C loop released the GIL.
    module = pytest.importorskip("jaxbuf.drivers._host_calls")
    import sys
    import threading
    import time

    size, count = 4 << 20, 32
    source, target = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    dsts, srcs, sizes = batch([address(target)] * count, [address(source)] * count, [size] * count)
    arguments = (dsts, srcs, sizes)
    ready, done, ticks = threading.Event(), threading.Event(), [0]

    def spin():
        ready.set()
        while not done.is_set():
            ticks[0] += 1
            if ticks[0] % 4096 == 0:
                time.sleep(0)  # hands the GIL back now and then (the call must get it back)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    thread = threading.Thread(target=spin)
    try:
        thread.start()
        ready.wait()
        before = ticks[0]
        module.copy_batch(*arguments)
        during = ticks[0] - before
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert target.all()
    assert during > 0


def test_the_base_class_default_copies_one_triple_at_a_time(driver):
    target, source = np.zeros(6, np.uint8), np.arange(1, 7, dtype=np.uint8)
    dsts, srcs, sizes = batch(
        [address(target), address(target, 3)], [address(source, 3), address(source)], [3, 3]
    )
    counting = FaultInjectingDriver(driver)
    assert VmmDriver.copy_batch(counting, dsts, srcs, sizes, 0) is None
    assert target.tolist() == [4, 5, 6, 1, 2, 3]
    assert counting.calls["copy"] == 2 and counting.calls["record_ready_event"] == 1
    with pytest.raises(ValueError, match="one length"):
        VmmDriver.copy_batch(counting, dsts, srcs[:1], sizes, 0)
    assert counting.calls["copy"] == 2


def test_fault_injecting_driver_counts_and_fails_copy_batch(driver):
    target, source = np.zeros(4, np.uint8), np.arange(1, 5, dtype=np.uint8)
    arrays = batch([address(target)], [address(source)], [4])
    faulty = FaultInjectingDriver(driver, record_calls=True)
    faulty.fail_on("copy_batch")
    with pytest.raises(DriverError, match="copy_batch.*INJECTED_FAULT") as info:
        faulty.copy_batch(*arrays, 0)
    assert info.value.details["count"] == 1
    assert not target.any()  # a fault fires before the copy
    assert faulty.copy_batch(*arrays, 0) is None
    assert target.tolist() == [1, 2, 3, 4]
    assert faulty.calls["copy_batch"] == 2 and faulty.calls["copy"] == 0
    assert [call.kind for call in faulty.log] == ["copy_batch", "copy_batch"]

    # With simulated events the batch returns one, tracked until destroyed.
    simulated = FaultInjectingDriver(driver, simulate_events=True)
    event = simulated.copy_batch(*arrays, 0)
    assert event is not None and id(event) in simulated.live_events
    assert simulated.event_query(event)
    simulated.destroy_event(event)
    assert not simulated.live_events and not simulated.violations
