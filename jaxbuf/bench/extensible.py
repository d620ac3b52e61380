"""Benchmarks of :class:`jaxbuf.ExtensibleTensor` (issue 2, section 6), baselines in-process.

Suites:

* ``extensible.growth``: one grow of a small step (2 MiB) and of a large step (1 GiB) onto
  1, 8 and 48 GiB already committed, against realloc+copy of a torch tensor and of a JAX
  array to the same size, and against a seed-style buffer that keeps a per-granule set.
  On the CPU the sizes are scaled down (host RAM); the table names the sizes used.
* ``extensible.bookkeeping``: the per-grow cost of the buffer logic alone (a no-op driver)
  at 100 and 10,000 committed granules, jaxbuf's intervals against the seed's granule walk.
* ``extensible.views``: DLPack capsule, torch view and JAX view of a buffer, against torch's
  own exports and a seed-style ctypes capsule builder.
* ``extensible.release``: ``release_physical`` + recommit of 8 GiB (scaled on the CPU).

The seed-style baselines re-implement the seed's algorithm (``seeds/extensible_tensor.txt``)
over the same jaxbuf driver, so the difference measured is the bookkeeping alone.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from jaxbuf import _dlpack
from jaxbuf._capsule import DESTRUCTOR_ADDRESS
from jaxbuf.bench import Row, format_bytes, suite
from jaxbuf.bench._timing import (
    Timing,
    device_event_timer,
    device_synchronizer,
    measure,
    measure_per_call,
    release_torch_memory,
)
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import K_DL_CPU, VmmDriver
from jaxbuf.extensible import ExtensibleTensor, granule_size

MiB = 1 << 20
GiB = 1 << 30

_SPEEDUP_TARGET = 1000.0  # +2 MiB onto the largest size vs realloc+copy
_FLAT_TARGET = 1.5  # largest vs smallest committed size, and 10,000 vs 100 granules
_CAPSULE_TARGET_S = 2e-6
_TORCH_VIEW_TARGET_S = 4e-6


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# --------------------------------------------------------------------------------------
# The seed's algorithm, driving a jaxbuf driver (the baseline; do not "fix" it).
# --------------------------------------------------------------------------------------
class _SeedStyleVirtualBuffer:
    """The seed's ``_VirtualBuffer``: a Python set of mapped granule indices, and a walk
    over every granule of a range plus the ``_run_bounds`` walk over the whole contiguous
    mapped run on each commit. Same driver calls as jaxbuf; only the bookkeeping differs."""

    def __init__(self, max_bytes: int, device_index: int, driver: VmmDriver,
                 granularity: int) -> None:  # fmt: skip
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
                self._map_chunk_at(run_start * self.granularity,
                                   (g - run_start) * self.granularity)  # fmt: skip
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
        self._driver.set_access(self.base_ptr + first * self.granularity,
                                (last - first) * self.granularity, self.device_index)  # fmt: skip

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

    def __init__(self, max_num_bytes: int, device: Any, driver: VmmDriver | None = None,
                 num_segments: int = 1) -> None:  # fmt: skip
        driver = driver if driver is not None else get_vmm_driver(device)
        self._segment_capacities = [max_num_bytes // num_segments] * num_segments
        self._segment_offsets = list(
            itertools.accumulate([0, *self._segment_capacities[:-1]])
        )
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
        grown = [(start + old, start + new)
                 for start, old, new in zip(self._segment_offsets, self._committed, sizes)
                 if new > old]  # fmt: skip
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


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError) or getattr(error, "out_of_memory", False):
        return True
    text = str(error)
    return "out of memory" in text.lower() or "RESOURCE_EXHAUSTED" in text


def _skip_reason(error: BaseException) -> str:
    if isinstance(error, ImportError):
        return f"skipped: {error.name or 'a framework'} is not installed"
    if _is_out_of_memory(error):
        return "skipped: out of memory"
    raise error


def _timed_growth(make, committed: int, step: int, repeat: int, warmup: int) -> Timing:
    """Median time of one ``resize_per_segment_`` by ``step`` from ``committed`` upwards.

    Each sample grows by one more step; the reservation holds them all. The committed size
    drifts by ``(warmup + repeat) * step`` over the samples: small against the sizes.
    """
    buffer = make(committed + (warmup + repeat) * step)
    try:
        buffer.resize_per_segment_(committed)
        size = [committed]

        def grow() -> None:
            size[0] += step
            buffer.resize_per_segment_(size[0])

        return measure(grow, repeat=repeat, warmup=warmup)
    finally:
        buffer.free()


def _torch_realloc(device: Any, committed: int, step: int, repeat: int) -> Timing:
    import torch

    torch_device = device.torch()
    sync = device_synchronizer(device)
    old = torch.ones(committed, dtype=torch.uint8, device=torch_device)
    try:

        def realloc():
            new = torch.empty(committed + step, dtype=torch.uint8, device=torch_device)
            new[:committed].copy_(old)
            return new

        # Each grow is to a size never allocated before, so a real realloc misses the
        # caching allocator: return the new block to the driver after every sample.
        return measure(realloc, repeat=repeat, warmup=1, synchronize=sync,
                       teardown=lambda: release_torch_memory(device),
                       device_timer=device_event_timer(device))  # fmt: skip
    finally:
        del old
        release_torch_memory(device)


def _jax_realloc(device: Any, committed: int, step: int, repeat: int) -> Timing:
    import jax
    import jax.numpy as jnp

    jax_device = device.jax()
    grow = jax.jit(lambda x: jnp.concatenate([x, jnp.zeros((step,), x.dtype)]))
    with jax.default_device(jax_device):
        old = jnp.ones((committed,), jnp.uint8)
    try:
        return measure(lambda: grow(old).block_until_ready(), repeat=repeat, warmup=1)
    finally:
        old.delete()


def _growth_plan(device: Any, quick: bool) -> tuple[list[int], list[int], int, int]:
    """(committed sizes, steps, small-step repeats, large-step repeats)."""
    if device.is_cuda:
        if quick:
            return [256 * MiB, 1 * GiB, 4 * GiB], [2 * MiB, 256 * MiB], 5, 2
        return [1 * GiB, 8 * GiB, 48 * GiB], [2 * MiB, 1 * GiB], 20, 3
    # Host RAM: scaled down so that realloc+copy (twice the size) fits a small machine.
    if quick:
        return [8 * MiB, 32 * MiB, 128 * MiB], [2 * MiB, 8 * MiB], 5, 2
    return [64 * MiB, 256 * MiB, 1 * GiB], [2 * MiB, 64 * MiB], 10, 3


# --------------------------------------------------------------------------------------
# Suites
# --------------------------------------------------------------------------------------
@suite("extensible.growth")
def growth(device: Any, quick: bool) -> Iterator[Row]:
    """One grow onto 1/8/48 GiB committed against realloc+copy (torch, JAX) and the seed."""
    committed_sizes, steps, small_repeat, large_repeat = _growth_plan(device, quick)
    realloc_repeat = 2 if quick else 3
    scaled = "" if device.is_cuda and not quick else "; sizes scaled down for this run"
    rows: list[Row] = []  # yielded at the end, ordered by step, size, baseline
    jaxbuf_s: dict[tuple[int, int], float] = {}
    seed_s: dict[tuple[int, int], float] = {}

    def make_jaxbuf(capacity: int) -> ExtensibleTensor:
        return ExtensibleTensor(capacity, device=device)

    def make_seed(capacity: int) -> _SeedStyleTensor:
        return _SeedStyleTensor(capacity, device)

    def row(committed: int, step: int, baseline: str, baseline_s: float | None,
            notes: str = "", **extra: Any) -> Row:  # fmt: skip
        name = f"+{format_bytes(step)} onto {format_bytes(committed)}"
        result = Row(name, jaxbuf_s[committed, step], baseline, baseline_s,
                     notes=notes, params={"committed_bytes": committed,
                     "step_bytes": step, "baseline_kind": extra.pop("kind")})  # fmt: skip
        if step == steps[0] and committed == committed_sizes[-1] and "realloc" in baseline:
            result.target = f">= {_SPEEDUP_TARGET:g}x"
            result.met = result.ratio is not None and result.ratio >= _SPEEDUP_TARGET
        for key, value in extra.items():
            setattr(result, key, value)
        return result

    for committed in committed_sizes:
        for step in steps:
            repeat = small_repeat if step == steps[0] else large_repeat
            jaxbuf_s[committed, step] = _timed_growth(make_jaxbuf, committed, step, repeat,
                                                      1).median_s  # fmt: skip
            seed_s[committed, step] = _timed_growth(make_seed, committed, step, repeat,
                                                    1).median_s  # fmt: skip
            rows.append(row(committed, step, "seed-style (granule set)",
                            seed_s[committed, step], kind="seed"))  # fmt: skip
        for step in steps:
            try:
                timing = _torch_realloc(device, committed, step, realloc_repeat)
                rows.append(row(committed, step, "torch realloc+copy", timing.median_s,
                                kind="torch",
                                baseline_device_median_s=timing.device_median_s))
            except Exception as error:  # noqa: BLE001 - only skips are swallowed
                rows.append(row(committed, step, "torch realloc+copy", None,
                                notes=_skip_reason(error), kind="torch"))  # fmt: skip

    # JAX last and largest first: JAX's allocator keeps what it took, so the big
    # reservation is made once and reused by the smaller sizes.
    for committed in reversed(committed_sizes):
        for step in steps:
            try:
                timing = _jax_realloc(device, committed, step, realloc_repeat)
                rows.append(row(committed, step, "JAX realloc+copy", timing.median_s,
                                kind="jax"))  # fmt: skip
            except Exception as error:  # noqa: BLE001 - only skips are swallowed
                rows.append(row(committed, step, "JAX realloc+copy", None,
                                notes=_skip_reason(error), kind="jax"))  # fmt: skip

    order = {"seed": 0, "torch": 1, "jax": 2}
    rows.sort(key=lambda r: (r.params["step_bytes"], r.params["committed_bytes"],
                             order[r.params["baseline_kind"]]))  # fmt: skip
    yield from rows

    small, large = committed_sizes[0], committed_sizes[-1]
    for label, times in (("jaxbuf", jaxbuf_s), ("seed-style", seed_s)):
        result = Row(
            f"{label}: +{format_bytes(steps[0])} onto {format_bytes(large)}",
            times[large, steps[0]],
            f"{label}: +{format_bytes(steps[0])} onto {format_bytes(small)}",
            times[small, steps[0]],
            notes="same grow at the smallest committed size" + scaled,
            params={"kind": "flatness", "implementation": label},
        )
        if label == "jaxbuf":
            result.target = f"<= {_FLAT_TARGET:g}x slower"
            result.met = result.ratio is not None and result.ratio >= 1 / _FLAT_TARGET
        yield result


@suite("extensible.bookkeeping")
def bookkeeping(device: Any, quick: bool) -> Iterator[Row]:
    """Per-grow buffer bookkeeping at 100 vs 10,000 committed granules (no-op driver)."""
    del device  # the no-op driver stands in for the platform
    granule = 2 * MiB
    counts = (100, 10_000)
    grows_per_sample = 10
    rounds = 5
    repeat = 20 if quick else 60
    results: dict[tuple[str, int], float] = {}

    def per_grow_samples(make, count: int) -> tuple[Any, Any]:
        """A buffer at ``count`` granules and the timed batch of grows on it."""
        buffer = make((count + grows_per_sample) * granule, _NoOpDriver(granule))
        base = count * granule

        def setup() -> None:
            buffer.release_physical()
            buffer.resize_per_segment_(base)

        def grows(_: None) -> None:
            for i in range(1, grows_per_sample + 1):
                buffer.resize_per_segment_(base + i * granule)

        return buffer, lambda: measure(grows, setup=setup, repeat=repeat // rounds,
                                       warmup=1).samples_s  # fmt: skip

    from jaxbuf.devices import Device

    cpu = Device("cpu")
    makers = {
        "jaxbuf": lambda size, driver: ExtensibleTensor(size, device=cpu, driver=driver),
        "seed-style": lambda size, driver: _SeedStyleTensor(size, cpu, driver),
    }
    # Rounds alternate between the configurations, so that a drifting clock or a noisy
    # neighbour affects all of them alike.
    buffers, timers = {}, {}
    try:
        for label, make in makers.items():
            for count in counts:
                buffers[label, count], timers[label, count] = per_grow_samples(make, count)
        samples: dict[tuple[str, int], list[float]] = {key: [] for key in timers}
        for _ in range(rounds):
            for key, timer in timers.items():
                samples[key].extend(timer())
    finally:
        for buffer in buffers.values():
            buffer.free()
    for key, values in samples.items():
        results[key] = statistics.median(values) / grows_per_sample
    for label in makers:
        result = Row(
            f"{label}: grow at {counts[1]:,} granules", results[label, counts[1]],
            f"{label}: grow at {counts[0]:,} granules", results[label, counts[0]],
            notes="bookkeeping only (no-op driver)",
            params={"kind": "bookkeeping", "implementation": label},
        )  # fmt: skip
        if label == "jaxbuf":
            result.target = f"<= {_FLAT_TARGET:g}x slower"
            result.met = result.ratio is not None and result.ratio >= 1 / _FLAT_TARGET
        yield result
    yield Row(
        f"jaxbuf: grow at {counts[1]:,} granules", results["jaxbuf", counts[1]],
        f"seed-style: grow at {counts[1]:,} granules", results["seed-style", counts[1]],
        notes="bookkeeping only (no-op driver)",
        params={"kind": "bookkeeping", "implementation": "both"},
    )  # fmt: skip


@suite("extensible.views")
def views(device: Any, quick: bool) -> Iterator[Row]:
    """DLPack capsule, torch view, JAX view against torch's exports and the seed's builder."""
    number, repeat = (500, 5) if quick else (5000, 15)
    buffer = ExtensibleTensor(2 * granule_size(device), device=device)
    try:
        buffer.resize_per_segment_(1 * MiB)
        view = buffer.segment_view(0)
        device_type = buffer.driver.dlpack_device_type

        def per_call(fn, calls: int = number) -> float:
            return measure_per_call(fn, number=calls, repeat=repeat).median_s

        capsule_s = per_call(view.__dlpack__)
        seed_capsule_s = per_call(
            lambda: _seed_style_capsule(view.ptr, view.nbytes, device_type, device.index)
        )
        yield Row("capsule: view.__dlpack__()", capsule_s, "seed-style ctypes capsule",
                  seed_capsule_s, target=f"<= {_CAPSULE_TARGET_S * 1e6:g} µs",
                  met=capsule_s <= _CAPSULE_TARGET_S)  # fmt: skip

        try:
            import torch
        except ImportError as error:
            yield Row("torch view: view.to_torch()", None, notes=_skip_reason(error))
        else:
            native = torch.empty(1 * MiB, dtype=torch.uint8, device=device.torch())
            yield Row("capsule: view.__dlpack__()", capsule_s, "torch: tensor.__dlpack__()",
                      per_call(native.__dlpack__))  # fmt: skip
            torch_view_s = per_call(view.to_torch)
            yield Row("torch view: view.to_torch()", torch_view_s,
                      "torch.from_dlpack(native tensor)",
                      per_call(lambda: torch.from_dlpack(native)),
                      target=f"<= {_TORCH_VIEW_TARGET_S * 1e6:g} µs",
                      met=torch_view_s <= _TORCH_VIEW_TARGET_S)  # fmt: skip
            yield Row("torch view: view.to_torch()", torch_view_s,
                      "seed-style capsule + torch.from_dlpack",
                      per_call(lambda: torch.from_dlpack(_seed_style_capsule(
                          view.ptr, view.nbytes, device_type, device.index))))  # fmt: skip
        try:
            import jax.dlpack
        except ImportError as error:
            yield Row("JAX view: view.to_jax()", None, notes=_skip_reason(error))
        else:
            jax_calls = max(number // 20, 20)
            jax_view_s = per_call(view.to_jax, jax_calls)
            try:
                import torch

                native = torch.empty(1 * MiB, dtype=torch.uint8, device=device.torch())
            except ImportError as error:
                yield Row("JAX view: view.to_jax()", jax_view_s, notes=_skip_reason(error))
            else:
                yield Row("JAX view: view.to_jax()", jax_view_s,
                          "jax.dlpack.from_dlpack(torch tensor)",
                          per_call(lambda: jax.dlpack.from_dlpack(native), jax_calls))
    finally:
        buffer.free()


@suite("extensible.release")
def release(device: Any, quick: bool) -> Iterator[Row]:
    """release_physical + recommit of 8 GiB, against the seed-style buffer."""
    if device.is_cuda:
        size = 1 * GiB if quick else 8 * GiB
    else:
        size = 32 * MiB if quick else 256 * MiB
    repeat = 3 if quick else 5
    sync = device_synchronizer(device)

    def timed(make) -> float:
        buffer = make(size)
        try:
            buffer.resize_per_segment_(size)

            def cycle() -> None:
                buffer.release_physical()
                buffer.resize_per_segment_(size)

            return measure(cycle, repeat=repeat, warmup=1, synchronize=sync).median_s
        finally:
            buffer.free()

    jaxbuf_s = timed(lambda n: ExtensibleTensor(n, device=device))
    seed_s = timed(lambda n: _SeedStyleTensor(n, device))
    granules = math.ceil(size / granule_size(device))
    yield Row(f"release_physical + recommit {format_bytes(size)}", jaxbuf_s,
              "seed-style (granule set)", seed_s,
              notes=f"{granules:,} granules" + ("" if device.is_cuda and not quick
                                                else "; size scaled down"),
              params={"size_bytes": size})  # fmt: skip
