"""HostVmmDriver: the CUDA VMM model on mmap/memfd (Linux only)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from jaxbuf.drivers import K_DL_CPU, DriverError, HostVmmDriver, get_vmm_driver
from jaxbuf.drivers.host import HostChunk

PAGE = mmap.PAGESIZE

pytestmark = pytest.mark.skipif(
    HostVmmDriver().unavailable_reason() is not None,
    reason=str(HostVmmDriver().unavailable_reason()),
)


@pytest.fixture
def driver() -> HostVmmDriver:
    return HostVmmDriver()


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
    assert maps_permissions(base, size) == {"r--p"}
    first, second = driver.create(2 * PAGE, 0), driver.create(2 * PAGE, 0)
    driver.map(base, 2 * PAGE, first)
    driver.map(base + 2 * PAGE, 2 * PAGE, second)
    driver.set_access(base, size, 0)
    assert maps_permissions(base, size) == {"rw-s"}
    assert ctypes.string_at(base, size) == bytes(size)  # fresh chunks read as zeros

    driver.memset(base, 0xAB, 2 * PAGE, 0)
    driver.memset(base + 2 * PAGE, 0xCD, 2 * PAGE, 0)
    driver.unmap(base, 2 * PAGE)
    assert maps_permissions(base, 2 * PAGE) == {"r--p"}
    assert ctypes.string_at(base + 2 * PAGE, 2 * PAGE) == b"\xcd" * (2 * PAGE)

    driver.release(first)
    driver.unmap(base + 2 * PAGE, 2 * PAGE)
    driver.release(second)  # after unmap, as the buffer layer does
    assert maps_permissions(base, size) == {"r--p"}
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
    assert maps_permissions(base, count * PAGE) == {"r--p"}
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
    assert maps_permissions(base, size) == {"r--p"}
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
