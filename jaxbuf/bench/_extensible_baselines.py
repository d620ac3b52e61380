"""The baselines of the :mod:`jaxbuf.bench.extensible` suites that are not timing code.

* :class:`_SeedStyleTensor` (over :class:`_SeedStyleVirtualBuffer`): the seed's algorithm
  (vLLM's ``extensible_tensor.py``) re-implemented over a jaxbuf driver, so that a
  comparison with :class:`~jaxbuf.ExtensibleTensor` measures the bookkeeping alone;
* :func:`_seed_style_capsule`: the seed's ctypes DLPack capsule builder;
* :class:`_NoOpDriver`: a driver whose every call succeeds at once, to time a buffer's
  bookkeeping without the platform.

They are baselines: keep them as the seed does things, do not "fix" them.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import Any

from jaxbuf import _dlpack
from jaxbuf._capsule import DESTRUCTOR_ADDRESS
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import K_DL_CPU, VmmDriver
from jaxbuf.extensible import granule_size

MiB = 1 << 20


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# --------------------------------------------------------------------------------------
# The seed's algorithm, driving a jaxbuf driver (the baseline; do not "fix" it).
# --------------------------------------------------------------------------------------
class _SeedStyleVirtualBuffer:
    """The seed's ``_VirtualBuffer``: a Python set of mapped granule indices, and a walk
    over every granule of a range plus the ``_run_bounds`` walk over the whole contiguous
    mapped run on each commit. Same driver calls as jaxbuf; only the bookkeeping differs."""

    def __init__(
        self, max_bytes: int, device_index: int, driver: VmmDriver, granularity: int
    ) -> None:
        self._driver = driver
        driver.ensure_context(device_index)
        self.device_index = device_index
        self.granularity = granularity
        self.reserved_size = _round_up(max(max_bytes, 1), granularity)
        self.base_ptr = driver.reserve(self.reserved_size, granularity)
        self._mapped_granules: set[int] = set()
        self._handles: list[tuple[Any, int, int]] = []
        self._freed = False

    @property
    def committed_bytes(self) -> int:
        return len(self._mapped_granules) * self.granularity

    def ensure_committed_range(self, start: int, end: int) -> None:
        if not 0 <= start <= end:
            raise ValueError(f"Invalid range [{start}, {end}).")
        if end > self.reserved_size:
            raise ValueError(f"Requested range end {end} exceeds reserved capacity.")
        if start == end:
            return
        first = start // self.granularity
        last = (end + self.granularity - 1) // self.granularity  # exclusive
        run_start: int | None = None
        for g in range(first, last + 1):
            unmapped = g < last and g not in self._mapped_granules
            if unmapped and run_start is None:
                run_start = g
            elif not unmapped and run_start is not None:
                self._map_chunk_at(run_start * self.granularity, (g - run_start) * self.granularity)
                self._grant_access(*self._run_bounds(run_start, g))
                self._mapped_granules.update(range(run_start, g))
                run_start = None

    def _run_bounds(self, first: int, last: int) -> tuple[int, int]:
        while first - 1 in self._mapped_granules:
            first -= 1
        while last in self._mapped_granules:
            last += 1
        return first, last

    def _grant_access(self, first: int, last: int) -> None:
        self._driver.set_access(
            self.base_ptr + first * self.granularity,
            (last - first) * self.granularity,
            self.device_index,
        )

    def _map_chunk_at(self, offset: int, size: int) -> None:
        driver = self._driver
        driver.ensure_context(self.device_index)
        handle = driver.create(size, self.device_index)
        try:
            driver.map(self.base_ptr + offset, size, handle)
        except RuntimeError:
            driver.release(handle)
            raise
        self._handles.append((handle, offset, size))

    def release_physical(self) -> None:
        driver = self._driver
        driver.ensure_context(self.device_index)
        if self._handles:
            driver.synchronize(self.device_index)
        for handle, offset, size in self._handles:
            driver.unmap(self.base_ptr + offset, size)
            driver.release(handle)
        self._handles = []
        self._mapped_granules = set()

    def free(self) -> None:
        if self._freed:
            return
        self._freed = True
        self.release_physical()
        self._driver.free_reserved(self.base_ptr, self.reserved_size)
        self.base_ptr = 0


class _SeedStyleTensor:
    """The seed's ``ExtensibleTensor.resize_segments_`` over :class:`_SeedStyleVirtualBuffer`."""

    def __init__(
        self,
        max_num_bytes: int,
        device: Any,
        driver: VmmDriver | None = None,
        num_segments: int = 1,
    ) -> None:
        driver = driver if driver is not None else get_vmm_driver(device)
        self._segment_capacities = [max_num_bytes // num_segments] * num_segments
        self._segment_offsets = list(itertools.accumulate([0, *self._segment_capacities[:-1]]))
        self._committed = [0] * num_segments
        self._buffer = _SeedStyleVirtualBuffer(
            max_num_bytes, device.index, driver, granule_size(device, driver)
        )

    @property
    def num_segments(self) -> int:
        return len(self._segment_capacities)

    def resize_per_segment_(self, bytes_per_segment: int) -> None:
        self.resize_segments_([bytes_per_segment] * self.num_segments)

    def resize_segments_(self, sizes: Sequence[int]) -> None:
        if len(sizes) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(sizes)}.")
        for old, new, capacity in zip(self._committed, sizes, self._segment_capacities):
            if new < old:
                raise ValueError(f"cannot resize from {old} to {new} bytes per segment.")
            if new > capacity:
                raise ValueError(f"Requested {new} bytes exceeds the capacity {capacity}.")
        grown = [
            (start + old, start + new)
            for start, old, new in zip(self._segment_offsets, self._committed, sizes)
            if new > old
        ]
        for start, end in grown:
            self._buffer.ensure_committed_range(start, end)
        self._committed = list(sizes)

    def release_physical(self) -> None:
        self._buffer.release_physical()
        self._committed = [0] * self.num_segments

    def free(self) -> None:
        self._buffer.free()


# The seed's capsule builder: malloc + memset + field-by-field ctypes writes + PyCapsule_New.
# Differences from the seed, to keep the benchmark process healthy: the deleter is libc free
# (the seed's NULL deleter aborts under JAX and leaks), and unconsumed capsules are freed by
# jaxbuf's C destructor. Neither changes the per-capsule work being measured.
_SEED_CAPSULE_NAME = b"dltensor"  # kept alive by the module: the capsule borrows it
# A private prototype: setting argtypes on the shared ``ctypes.pythonapi.PyCapsule_New``
# would change them for jaxbuf._dlpack too.
_seed_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))
_seed_malloc = ctypes.CDLL(None).malloc
_seed_malloc.argtypes = [ctypes.c_size_t]
_seed_malloc.restype = ctypes.c_void_p


def _seed_style_capsule(ptr: int, num_bytes: int, device_type: int, device_index: int):
    managed_size = ctypes.sizeof(_dlpack.DLManagedTensor)
    addr = _seed_malloc(managed_size + ctypes.sizeof(ctypes.c_int64))
    if not addr:
        raise MemoryError("Failed to allocate a DLManagedTensor.")
    ctypes.memset(addr, 0, managed_size + ctypes.sizeof(ctypes.c_int64))
    shape_addr = addr + managed_size
    ctypes.c_int64.from_address(shape_addr).value = num_bytes
    managed = _dlpack.DLManagedTensor.from_address(addr)
    managed.dl_tensor.data = ctypes.c_void_p(ptr)
    managed.dl_tensor.device = _dlpack.DLDevice(device_type, device_index)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _dlpack.DLDataType(1, 8, 1)  # kDLUInt, 8 bits, 1 lane
    managed.dl_tensor.shape = ctypes.cast(shape_addr, ctypes.POINTER(ctypes.c_int64))
    managed.deleter = _dlpack.FREE_ADDRESS
    return _seed_capsule_new(addr, _SEED_CAPSULE_NAME, DESTRUCTOR_ADDRESS)


# --------------------------------------------------------------------------------------
# A driver that does nothing: times the buffer bookkeeping alone.
# --------------------------------------------------------------------------------------
class _NoOpDriver(VmmDriver):
    """Every call succeeds at once; addresses are fake and must never be touched."""

    platform = "cpu"
    dlpack_device_type = K_DL_CPU

    def __init__(self, granularity: int = 2 * MiB) -> None:
        self._granularity = granularity
        self._next_address = 1 << 44

    def unavailable_reason(self) -> str | None:
        return None

    def device_count(self) -> int:
        return 1

    def ensure_context(self, device_index: int) -> None:
        pass

    def granularity(self, device_index: int) -> int:
        return self._granularity

    def reserve(self, size: int, alignment: int = 0) -> int:
        address = self._next_address
        self._next_address += _round_up(size, self._granularity) + self._granularity
        return address

    def free_reserved(self, ptr: int, size: int) -> None:
        pass

    def create(self, size: int, device_index: int) -> Any:
        return size

    def release(self, handle: Any) -> None:
        pass

    def map(self, ptr: int, size: int, handle: Any) -> None:
        pass

    def unmap(self, ptr: int, size: int) -> None:
        pass

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        pass

    def memset(self, ptr: int, value: int, size: int, device_index: int) -> None:
        pass

    def copy(self, dst: int, src: int, size: int, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int) -> None:
        pass

    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        raise NotImplementedError("the no-op benchmark driver has no host memory")

    def host_free(self, host_ptr: int) -> None:
        raise NotImplementedError("the no-op benchmark driver has no host memory")
