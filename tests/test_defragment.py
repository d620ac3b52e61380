"""ExtensibleTensor.defragment: one chunk per segment (RDMA registration), contents and
base_ptr kept, and every single driver fault rolled back (or, after the swap, cleaned up later)
with the tensor consistent.

Runs on every ``device`` (conftest: the CPU driver, and CUDA where present) with the real
driver wrapped in :class:`CountingDriver`, which fails the k-th call of any kind and checks
the VMM rules: nothing mapped without access, no handle or reservation leaked.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from jaxbuf.drivers import DriverError, get_vmm_driver
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.extensible import ExtensibleTensor

MiB = 1 << 20
G = 2 * MiB


class CountingDriver(VmmDriver):
    """Wraps a real driver; ``fail_at = k`` makes the k-th counted call (any kind) raise a
    ``DriverError`` before reaching the real driver (a failed call changes nothing)."""

    COUNTED = {
        "reserve",
        "free_reserved",
        "create",
        "release",
        "map",
        "unmap",
        "set_access",
        "move_mapping",
        "copy",
        "memset",
        "synchronize",
    }

    def __init__(self, inner: VmmDriver) -> None:
        self.inner = inner
        self.platform = inner.platform
        self.dlpack_device_type = inner.dlpack_device_type
        self.dlpack_host_device_type = inner.dlpack_host_device_type
        self.count = 0
        self.fail_at: int | None = None
        self.fail_calls: set[int] = set()  # more call numbers to fail
        self.log: list[str] = []
        self.live_handles: dict[int, Any] = {}
        self.reservations: dict[int, int] = {}
        self.mapped: dict[int, list] = {}  # ptr -> [size, handle id, accessible]

    def _enter(self, call: str) -> None:
        self.count += 1
        self.log.append(call)
        if self.fail_at == self.count or self.count in self.fail_calls:
            raise DriverError(call, "INJECTED_FAULT", n=self.count)

    # probing: never failed
    def unavailable_reason(self):
        return self.inner.unavailable_reason()

    def device_count(self):
        return self.inner.device_count()

    def ensure_context(self, device_index):
        self.inner.ensure_context(device_index)

    def granularity(self, device_index):
        return self.inner.granularity(device_index)

    def can_access_peer(self, device_index, peer_index):
        return self.inner.can_access_peer(device_index, peer_index)

    # virtual memory
    def reserve(self, size, alignment=0):
        self._enter("reserve")
        ptr = self.inner.reserve(size, alignment)
        self.reservations[ptr] = size
        return ptr

    def free_reserved(self, ptr, size):
        self._enter("free_reserved")
        assert not any(ptr <= p < ptr + size for p in self.mapped), "freed with chunks mapped"
        self.inner.free_reserved(ptr, size)
        del self.reservations[ptr]

    def create(self, size, device_index):
        self._enter("create")
        handle = self.inner.create(size, device_index)
        self.live_handles[id(handle)] = handle
        return handle

    def release(self, handle):
        self._enter("release")
        assert id(handle) in self.live_handles, "release of an unknown handle"
        self.inner.release(handle)
        del self.live_handles[id(handle)]

    def map(self, ptr, size, handle):
        self._enter("map")
        self.inner.map(ptr, size, handle)
        self.mapped[ptr] = [size, id(handle), False]

    def unmap(self, ptr, size):
        self._enter("unmap")
        assert self.mapped.get(ptr, [None])[0] == size, "unmap of something not one chunk"
        self.inner.unmap(ptr, size)
        del self.mapped[ptr]

    def move_mapping(self, handle, src_ptr, dst_ptr, size):
        self._enter("move_mapping")
        assert self.mapped.get(src_ptr, [None, None])[1] == id(handle)
        self.inner.move_mapping(handle, src_ptr, dst_ptr, size)
        del self.mapped[src_ptr]
        # CUDA grants no access to a new mapping; the caller must grant it again.
        self.mapped[dst_ptr] = [size, id(handle), False]

    def set_access(self, ptr, size, device_index):
        self._enter("set_access")
        self.inner.set_access(ptr, size, device_index)
        cursor = ptr
        while cursor < ptr + size:
            assert cursor in self.mapped, f"set_access over unmapped {cursor:#x}"
            self.mapped[cursor][2] = True
            cursor += self.mapped[cursor][0]
        assert cursor == ptr + size, "set_access splits a chunk"

    # work
    def memset(self, ptr, value, size, device_index):
        self._enter("memset")
        self.inner.memset(ptr, value, size, device_index)

    def copy(self, dst, src, size, device_index):
        self._enter("copy")
        self.inner.copy(dst, src, size, device_index)

    def synchronize(self, device_index):
        self._enter("synchronize")
        self.inner.synchronize(device_index)

    def host_alloc(self, size, device_index):
        return self.inner.host_alloc(size, device_index)

    def host_free(self, host_ptr):
        self.inner.host_free(host_ptr)

    # checks
    def check_tensor(self, tensor: ExtensibleTensor) -> None:
        """Every chunk the tensor records is mapped here, whole, with access."""
        buffer = tensor._buffer
        for offset, size, handle, _ in buffer.chunk_records():
            entry = self.mapped.get(tensor.base_ptr + offset)
            assert entry is not None, f"recorded chunk at {offset} is not mapped"
            assert entry[0] == size and entry[1] == id(handle)
            assert entry[2], f"recorded chunk at {offset} has no access"
            assert id(handle) in self.live_handles


def host_write(tensor, offset: int, data: np.ndarray) -> None:
    driver, index = tensor.driver, tensor.device.index
    driver.copy(tensor.base_ptr + offset, data.ctypes.data, data.nbytes, index)
    driver.synchronize(index)


def host_read(tensor, offset: int, size: int) -> np.ndarray:
    out = np.empty(size, dtype=np.uint8)
    driver, index = tensor.driver, tensor.device.index
    driver.copy(out.ctypes.data, tensor.base_ptr + offset, size, index)
    driver.synchronize(index)
    return out


def fragmented(device: str, driver=None, sizes=(G + 7, 2 * G, 3 * G + 100)):
    """Two segments grown in steps (two chunks each), filled with random bytes."""
    tensor = ExtensibleTensor(16 * G, device=device, num_segments=2, driver=driver)
    for size in sizes:
        tensor.resize_per_segment_(size)
    rng = np.random.default_rng(7)
    contents = []
    for offset, size in zip(tensor.segment_offsets, tensor.committed_sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        host_write(tensor, offset, data)
        contents.append(data)
    return tensor, contents


def check_contents(tensor, contents) -> None:
    for offset, data in zip(tensor.segment_offsets, contents):
        assert np.array_equal(host_read(tensor, offset, data.size), data)


def test_defragment_makes_one_chunk_per_segment(device):
    tensor, contents = fragmented(device)
    base = tensor.base_ptr
    views = [tensor.segment_view(i) for i in range(2)]
    sizes = tensor.committed_sizes
    assert tensor.num_physical_chunks == 4
    assert tensor.segments_backed_by_one_chunk(sizes) == [False, False]
    assert tensor.defragment() == [0, 1]
    assert tensor.base_ptr == base
    assert tensor.num_physical_chunks == 2
    assert tensor.segments_backed_by_one_chunk(sizes) == [True, True]
    assert tensor.physical_bytes == 2 * 4 * G
    check_contents(tensor, contents)
    assert [v.ptr for v in views] == [tensor.segment_view(i).ptr for i in range(2)]
    # Nothing left to do: no driver work at all.
    assert tensor.defragment() == []
    # Growth after defragment adds chunks again; a second defragment merges them.
    tensor.resize_per_segment_(5 * G)
    extra = np.full(G, 9, dtype=np.uint8)
    host_write(tensor, 4 * G, extra)
    assert tensor.segments_backed_by_one_chunk(tensor.committed_sizes) == [False, False]
    assert tensor.defragment() == [0, 1]
    assert tensor.segments_backed_by_one_chunk(tensor.committed_sizes) == [True, True]
    check_contents(tensor, contents)
    assert np.array_equal(host_read(tensor, 4 * G, G), extra)
    tensor.free()


def test_defragment_skips_empty_and_single_chunk_segments(device):
    driver = CountingDriver(get_vmm_driver(device))
    tensor = ExtensibleTensor(12 * G, device=device, num_segments=3, driver=driver)
    tensor.resize_segments_([3 * G, 0, G])
    before = driver.count
    assert tensor.defragment() == []
    assert driver.count == before  # nothing to do: no driver call at all
    tensor.resize_segments_([3 * G, 0, 2 * G])
    assert tensor.defragment() == [2]
    assert tensor.segments_backed_by_one_chunk([3 * G, 0, 2 * G]) == [True, False, True]
    tensor.free()


def test_segments_sharing_a_granule_are_refused_by_name(device):
    # The boundary at 1.5 granules: both segments' committed bytes live in granule 1.
    tensor = ExtensibleTensor(3 * G, device=device, segment_capacities=[3 * G // 2, 3 * G // 2])
    tensor.resize_segments_([G + 10, 10])
    chunks = tensor.num_physical_chunks
    with pytest.raises(ValueError, match="segments 0 and 1 share the granule"):
        tensor.defragment()
    assert tensor.num_physical_chunks == chunks
    # With one of them empty there is no conflict.
    tensor.free()
    tensor = ExtensibleTensor(3 * G, device=device, segment_capacities=[3 * G // 2, 3 * G // 2])
    tensor.resize_segments_([G, 0])
    tensor.resize_segments_([G + 10, 0])
    assert tensor.defragment() == [0]
    assert tensor.segments_backed_by_one_chunk([G + 10, 0])[0]
    tensor.free()


def test_defragment_after_free_raises(device):
    tensor, _ = fragmented(device)
    tensor.free()
    with pytest.raises(RuntimeError, match="freed"):
        tensor.defragment()


def _calls_of_a_clean_defragment(device: str) -> int:
    driver = CountingDriver(get_vmm_driver(device))
    tensor, _ = fragmented(device, driver)
    start = driver.count
    tensor.defragment()
    calls = driver.count - start
    tensor.free()
    assert not driver.live_handles and not driver.reservations
    return calls


def test_a_failed_wait_for_the_copy_never_unmaps_what_the_device_may_still_write(device):
    """The copy into the new chunk is asynchronous on a GPU. When the wait for it fails and
    the rollback's own wait fails too, the device may still be writing the new chunk, so the
    rollback must not unmap it (the H200 faulted with CUDA_ERROR_ILLEGAL_ADDRESS on such an
    unmap): it stays mapped in its temporary reservation, a stray that release_physical frees
    after a successful wait. The tensor itself is untouched and usable meanwhile."""
    clean = CountingDriver(get_vmm_driver(device))
    tensor, _ = fragmented(device, clean)
    start = clean.count
    tensor.defragment()
    wait_after_copy = clean.log[start:].index("copy") + 2  # the synchronize that follows it
    assert clean.log[start + wait_after_copy - 1] == "synchronize"
    tensor.free()

    driver = CountingDriver(get_vmm_driver(device))
    tensor, contents = fragmented(device, driver)
    base, sizes, at = tensor.base_ptr, tensor.committed_sizes, driver.count + wait_after_copy
    driver.fail_calls = {at, at + 1}  # the wait, then the rollback's wait
    with pytest.raises(DriverError) as info:
        tensor.defragment()
    assert any("waiting for the copy" in note for note in info.value.__notes__)
    driver.fail_calls = set()
    stray = tensor._buffer._stray_reservations
    assert len(stray) == 1 and stray[0][0] in driver.mapped  # still mapped: not unmapped
    assert tensor.base_ptr == base and tensor.committed_sizes == sizes
    driver.check_tensor(tensor)
    check_contents(tensor, contents)
    tensor.resize_per_segment_(4 * G)  # usable
    check_contents(tensor, contents)
    tensor.free()  # release_physical waits, then frees the stray
    assert not driver.live_handles and not driver.reservations and not driver.mapped


def test_every_single_fault_leaves_the_tensor_consistent(device):
    total = _calls_of_a_clean_defragment(device)
    assert total > 20  # two segments: reserve, create, map, ..., moves, cleanup
    outcomes = {}
    for k in range(1, total + 1):
        driver = CountingDriver(get_vmm_driver(device))
        tensor, contents = fragmented(device, driver)
        base, sizes = tensor.base_ptr, tensor.committed_sizes
        driver.fail_at = driver.count + k
        try:
            tensor.defragment()
            outcome = "ok"
        except DriverError as error:
            assert error.error_name == "INJECTED_FAULT", error
            outcome = error.call
        driver.fail_at = None
        outcomes[k] = outcome
        # Consistent: same base, same sizes, every recorded chunk mapped with access,
        # contents intact.
        assert tensor.base_ptr == base and tensor.committed_sizes == sizes, k
        driver.check_tensor(tensor)
        check_contents(tensor, contents)
        # Usable: a retry completes it, growth works.
        tensor.defragment()
        assert tensor.segments_backed_by_one_chunk(sizes) == [True, True], k
        check_contents(tensor, contents)
        tensor.resize_per_segment_(4 * G)
        driver.check_tensor(tensor)
        # Nothing leaked: after free, no handle and no reservation is left.
        tensor.free()
        assert not driver.live_handles, (k, outcome)
        assert not driver.reservations, (k, outcome)
        assert not driver.mapped, (k, outcome)
    # Every kind of call of the sequence was failed at least once.
    assert {
        "reserve",
        "create",
        "map",
        "set_access",
        "copy",
        "move_mapping",
        "unmap",
        "release",
        "free_reserved",
        "synchronize",
    } <= set(outcomes.values())


# -- the driver primitive ------------------------------------------------------------------------
def test_move_mapping_keeps_bytes_and_leaves_the_source_reserved(device):
    driver = get_vmm_driver(device)
    index = 0
    driver.ensure_context(index)
    src = driver.reserve(G, G)
    dst_reservation = driver.reserve(2 * G, G)
    dst = dst_reservation + G
    handle = driver.create(G, index)
    driver.map(src, G, handle)
    driver.set_access(src, G, index)
    data = np.random.default_rng(1).integers(0, 256, G, dtype=np.uint8)
    driver.copy(src, data.ctypes.data, G, index)
    driver.synchronize(index)
    driver.move_mapping(handle, src, dst, G)
    driver.set_access(dst, G, index)
    out = np.empty(G, dtype=np.uint8)
    driver.copy(out.ctypes.data, dst, G, index)
    driver.synchronize(index)
    assert np.array_equal(out, data)
    # The source range is still reserved: another chunk maps there.
    other = driver.create(G, index)
    driver.map(src, G, other)
    driver.set_access(src, G, index)
    driver.memset(src, 3, G, index)
    driver.synchronize(index)
    driver.copy(out.ctypes.data, dst, G, index)  # the moved chunk is untouched
    driver.synchronize(index)
    assert np.array_equal(out, data)
    if device == "cpu":
        assert handle.ptr == dst
        fd = driver.export_handle(handle)  # reopened at its new address
        try:
            assert os.fstat(fd).st_size == G
        finally:
            os.close(fd)
    for ptr, h in ((src, other), (dst, handle)):
        driver.unmap(ptr, G)
        driver.release(h)
    driver.free_reserved(src, G)
    driver.free_reserved(dst_reservation, 2 * G)


def test_move_mapping_refuses_a_chunk_not_at_the_source():
    driver = get_vmm_driver("cpu")
    src = driver.reserve(2 * G)
    handle = driver.create(G, 0)
    driver.map(src, G, handle)
    with pytest.raises(DriverError, match="EINVAL"):
        driver.move_mapping(handle, src + G, src, G)  # wrong source address
    driver.unmap(src, G)
    driver.release(handle)
    with pytest.raises(DriverError, match="EINVAL"):
        driver.move_mapping(handle, src, src + G, G)  # released
    driver.free_reserved(src, 2 * G)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_defragment_keeps_peer_access(cuda_device):
    driver = get_vmm_driver("cuda:0")
    if driver.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {driver.device_count()}")
    if not driver.can_access_peer(1, 0):
        pytest.skip("GPU 1 has no peer access to GPU 0")
    tensor = ExtensibleTensor(16 * G, device="cuda:0", num_segments=2, peer_devices=["cuda:1"])
    for size in (G, 3 * G):
        tensor.resize_per_segment_(size)
    data = np.random.default_rng(3).integers(0, 256, 3 * G, dtype=np.uint8)
    host_write(tensor, 0, data)
    assert tensor.defragment() == [0, 1]
    # Read on GPU 1 (its context, its copy engine): the new chunk is granted to the peer too.
    out = np.empty(3 * G, dtype=np.uint8)
    driver.copy(out.ctypes.data, tensor.base_ptr, 3 * G, 1)
    driver.synchronize(1)
    assert np.array_equal(out, data)
    tensor.free()
