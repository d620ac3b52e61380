"""Benchmarks of :mod:`jaxbuf.uva`, every baseline in the same run.

Suites:

* ``uva.copy_to_uva``: host time per :meth:`UvaBufferPool.copy_to_uva` of 1 K and 64 K
  int32 elements (4 KiB, 256 KiB) from numpy, for pools returning torch tensors and
  :class:`BufferView` s, against a seed-style pool (:class:`_SeedStyleUvaPool`,
  re-implementing vLLM's ``vllm/v1/worker/gpu/buffer_utils.py``), ``pin_memory()`` + a
  non-blocking copy, and a plain device copy.
  On the CPU there is no pinned memory and no device copy: the baselines become ``np.copyto``
  into a preallocated array and ``torch.from_numpy(x).clone()``.
* ``uva.read``: a kernel (``t.sum()``) reading 4 KiB to 64 MiB through the UVA device view
  against the same kernel on a device-memory copy, and against copy-then-read, to show where
  reading in place stops paying. On the CPU both are host memory (ratio about 1), kept so
  the suite runs everywhere.

Samples of the configurations being compared alternate round by round, so a drifting clock
or a noisy neighbour affects them alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, format_bytes, ratio_spread, suite, time_spread
from jaxbuf.bench._timing import (
    device_event_timer,
    device_synchronizer,
    measure,
    release_torch_memory,
)
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.uva import UvaBuffer, UvaBufferPool
from jaxbuf.views import BufferView

KiB = 1 << 10
MiB = 1 << 20

_HOST_TARGET_S = 2e-6  # copy_to_uva of 4 KiB, host time
_SEED_TARGET = 1.0  # never slower than the seed-style pool: jaxbuf ÷ seed-style <= 1
_COPY_ELEMENTS = (1024, 65536)  # int32: 4 KiB, 256 KiB


# --------------------------------------------------------------------------------------
# The seed's pool, over pinned torch tensors (the baseline; do not "fix" it).
# --------------------------------------------------------------------------------------
class _SeedStyleUvaBuffer:
    """The seed's ``UvaBuffer``: a pinned torch CPU tensor, its numpy view, and a torch
    device tensor made once from the pinned memory's pointer (the seed's
    ``get_accelerator_view_from_cpu_tensor``), sliced per call.

    The device tensor is built through jaxbuf's :class:`BufferView` over the same pointer
    with the driver's device type (``kDLCUDA`` on CUDA, where pinned memory's host pointer
    is its device pointer under UVA). On the CPU driver torch cannot pin: the tensor is
    pageable and the "device" tensor is a CPU tensor over it.
    """

    def __init__(self, size: tuple[int, ...], dtype: Any, device: Any) -> None:
        import torch

        pin = bool(device.is_cuda)
        self.cpu = torch.zeros(size, dtype=dtype, device="cpu", pin_memory=pin)
        self.np = self.cpu.numpy()
        device_type = get_vmm_driver(device).dlpack_device_type
        view = BufferView(
            self.cpu.data_ptr(),
            max(self.cpu.nbytes, 1),
            str(self.np.dtype),
            tuple(self.cpu.shape),
            device,
            self.cpu,
            device_type,
        )
        self._uva = view.to_torch()

    def uva(self, n: int | None = None) -> Any:
        return self._uva if n is None else self._uva[:n]


class _SeedStyleUvaPool:
    """The seed's ``UvaBufferPool.copy_to_uva``: round robin, grow to the next power of two,
    ``buf.np[:n] = x`` (``buf.cpu`` for torch inputs), return ``buf.uva(n)``."""

    def __init__(self, size: int, dtype: Any, device: Any, max_concurrency: int = 2) -> None:
        self.size = (size,)
        self.dtype = dtype
        self.device = device
        self.max_concurrency = max_concurrency
        self._uva_bufs = [
            _SeedStyleUvaBuffer(self.size, dtype, device) for _ in range(max_concurrency)
        ]
        self._curr = 0

    def copy_to_uva(self, x: Any) -> Any:
        import torch

        self._curr = (self._curr + 1) % self.max_concurrency
        buf = self._uva_bufs[self._curr]
        n = len(x)
        if n > buf.cpu.shape[0]:
            capacity = 1 << (n - 1).bit_length()
            buf = _SeedStyleUvaBuffer((capacity, *buf.cpu.shape[1:]), self.dtype, self.device)
            self._uva_bufs[self._curr] = buf
        dst = buf.cpu if isinstance(x, torch.Tensor) else buf.np
        dst[:n] = x
        return buf.uva(n)

    def close(self) -> None:
        self._uva_bufs = []


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
def _interleaved_per_call(
    candidates: dict[str, Callable[[], Any]],
    *,
    number: int,
    rounds: int,
    synchronize: Callable[[], None],
) -> dict[str, list[float]]:
    """Per-call host time of each candidate in each of ``rounds`` batches of ``number``
    calls, the candidates alternating batch by batch (the i-th samples share a round). The
    device is idle before each batch (untimed) and is not waited for inside it: host time,
    as a step's launch path sees it."""

    def batch_of(fn: Callable[[], Any]) -> Callable[[Any], None]:
        def batch(_: Any) -> None:
            for _ in range(number):
                fn()

        return batch

    batches = {key: batch_of(fn) for key, fn in candidates.items()}
    samples: dict[str, list[float]] = {key: [] for key in candidates}
    for batch in batches.values():  # warm caches, allocators and lazy imports
        measure(batch, repeat=1, warmup=0, setup=synchronize)
    for _ in range(rounds):
        for key, batch in batches.items():
            samples[key].extend(measure(batch, repeat=1, warmup=0, setup=synchronize).samples_s)
    synchronize()
    return {key: [value / number for value in values] for key, values in samples.items()}


# --------------------------------------------------------------------------------------
# Suites
# --------------------------------------------------------------------------------------
@suite("uva.copy_to_uva")
def copy_to_uva(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Host time per copy_to_uva against the seed-style pool and copies."""
    number, rounds = (50, 5) if quick else ((200, 25) if device.is_cuda else (100, 15))
    sizes = ", ".join(format_bytes(elements * 4) for elements in _COPY_ELEMENTS)
    yield Sizes(f"{sizes} of int32 from numpy, {rounds} batches of {number} calls")
    sync = device_synchronizer(device)
    try:
        import torch
    except ImportError as error:
        yield from _copy_to_uva_without_torch(device, number, rounds, sync, error)
        return

    cuda = device.is_cuda
    if cuda:
        torch_device = device.torch()
        baseline_names = {
            "pinned": "pin_memory() + .to(non_blocking=True)",
            "device": "torch.as_tensor(x).to(device)",
        }
        platform_notes = ""
    else:
        baseline_names = {
            "pinned": "np.copyto (preallocated)",
            "device": "torch.from_numpy(x).clone()",
        }
        platform_notes = (
            "CPU: no pinned memory or device copy, so the baselines are "
            "np.copyto and from_numpy().clone(); seed-style pool pageable"
        )

    for elements in _COPY_ELEMENTS:
        nbytes = elements * 4
        x = np.arange(elements, dtype=np.int32)
        pools: dict[str, Any] = {}
        try:
            for framework in ("torch", "view"):
                pools[framework] = UvaBufferPool(elements, "int32", 2, device, framework=framework)
            pools["seed"] = _SeedStyleUvaPool(elements, torch.int32, device)
            # Every candidate binds this iteration's x (default arguments): the functions
            # are timed within the iteration, but must not depend on that.
            candidates: dict[str, Callable[[], Any]] = {
                "torch": lambda pool=pools["torch"], x=x: pool.copy_to_uva(x),
                "view": lambda pool=pools["view"], x=x: pool.copy_to_uva(x),
                "seed": lambda pool=pools["seed"], x=x: pool.copy_to_uva(x),
            }
            if cuda:
                candidates["pinned"] = lambda x=x: (
                    torch.from_numpy(x).pin_memory().to(torch_device, non_blocking=True)
                )
                candidates["device"] = lambda x=x: torch.as_tensor(x).to(torch_device)
            else:
                destination = np.empty_like(x)
                candidates["pinned"] = lambda x=x, out=destination: np.copyto(out, x)
                candidates["device"] = lambda x=x: torch.from_numpy(x).clone()
            # Check the pools before timing them: both return x's values.
            for key in ("torch", "seed"):
                got = candidates[key]().cpu().numpy()
                if not np.array_equal(got, x):
                    raise RuntimeError(f"{key} pool returned wrong values")
            samples = _interleaved_per_call(
                candidates, number=number, rounds=rounds, synchronize=sync
            )
            medians = {key: statistics.median(values) for key, values in samples.items()}
        finally:
            for pool in pools.values():
                pool.close()
            pools.clear()
            release_torch_memory(device)

        size = format_bytes(nbytes)
        for framework in ("torch", "view"):
            name = f"copy_to_uva {size} (jaxbuf, framework={framework!r})"
            params = {
                "size_bytes": nbytes,
                "elements": elements,
                "framework": framework,
                "calls_per_sample": number,
                "samples": rounds,
            }
            median = medians[framework]
            if elements == _COPY_ELEMENTS[0]:  # the host time's own target, a row of its own
                yield Row(
                    name,
                    median,
                    notes=platform_notes,
                    target=f"<= {_HOST_TARGET_S * 1e6:g} µs",
                    met=median <= _HOST_TARGET_S,
                    limit=_HOST_TARGET_S,
                    spread=time_spread(samples[framework]),
                    params=params,
                )
            seed_row = Row(
                name,
                median,
                "seed-style pool (pinned torch, sliced view)",
                medians["seed"],
                notes=platform_notes,
                target=f"<= {_SEED_TARGET:g}x",
                limit=_SEED_TARGET,
                spread=ratio_spread(samples[framework], samples["seed"], paired=True),
                params={**params, "baseline_kind": "seed"},
            )
            seed_row.met = seed_row.ratio is not None and seed_row.ratio <= _SEED_TARGET
            yield seed_row
            for kind in ("pinned", "device"):
                yield Row(
                    name,
                    median,
                    baseline_names[kind],
                    medians[kind],
                    notes=platform_notes,
                    params={**params, "baseline_kind": kind},
                )


def _copy_to_uva_without_torch(
    device: Any, number: int, rounds: int, sync: Callable[[], None], error: ImportError
) -> Iterator[Row]:
    """torch missing: the view pool against np.copyto only."""
    for elements in _COPY_ELEMENTS:
        x = np.arange(elements, dtype=np.int32)
        destination = np.empty_like(x)
        pool = UvaBufferPool(elements, "int32", 2, device, framework="view")
        try:
            candidates = {
                "view": lambda pool=pool, x=x: pool.copy_to_uva(x),
                "copyto": lambda x=x, out=destination: np.copyto(out, x),
            }
            samples = _interleaved_per_call(
                candidates, number=number, rounds=rounds, synchronize=sync
            )
            medians = {key: statistics.median(values) for key, values in samples.items()}
        finally:
            pool.close()
        yield Row(
            f"copy_to_uva {format_bytes(elements * 4)} (jaxbuf, framework='view')",
            medians["view"],
            "np.copyto (preallocated)",
            medians["copyto"],
            notes=f"skipped torch baselines: {error.name or 'torch'} is not installed",
            params={
                "size_bytes": elements * 4,
                "elements": elements,
                "framework": "view",
                "baseline_kind": "copyto",
            },
        )


def _time_alternating(
    functions: dict[str, Callable[[], Any]],
    *,
    repeat: int,
    setup: Callable[[], None],
    synchronize: Callable[[], None],
    device_timer: Any,
) -> dict[str, tuple[float, float | None]]:
    """``key -> (host median, device median or None)`` of single calls, the functions
    alternating sample by sample; ``setup`` runs untimed before each sample."""
    for fn in functions.values():  # warm-up: kernels loaded, allocator primed
        measure(fn, repeat=2, warmup=0, synchronize=synchronize)
    host: dict[str, list[float]] = {key: [] for key in functions}
    device: dict[str, list[float]] = {key: [] for key in functions}
    for _ in range(repeat):
        for key, fn in functions.items():
            timing = measure(
                lambda _state, fn=fn: fn(),
                repeat=1,
                warmup=0,
                setup=setup,
                synchronize=synchronize,
                device_timer=device_timer,
            )
            host[key].extend(timing.samples_s)
            if timing.device_median_s is not None:
                device[key].append(timing.device_median_s)
    return {
        key: (statistics.median(host[key]), statistics.median(device[key]) if device[key] else None)
        for key in functions
    }


def _nothing() -> None:
    pass


def _read_sizes(device: Any, quick: bool) -> list[int]:
    if quick:
        return [4 * KiB, 256 * KiB, 4 * MiB] if device.is_cuda else [4 * KiB, 64 * KiB, 1 * MiB]
    return [4 * KiB << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB


@suite(
    "uva.read",
    requires=("torch",),
    gpu_only="on the CPU, UVA and device memory are both host RAM; the crossover is a CUDA "
    "measurement",
)
def read(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A kernel reading in place from UVA against the same kernel on device memory."""
    import torch

    repeat = 5 if quick else 20
    yield Sizes(", ".join(map(format_bytes, _read_sizes(device, quick))))
    sync = device_synchronizer(device)
    timer = device_event_timer(device)
    cuda = device.is_cuda
    setup = _nothing
    if cuda:
        # Repeated reads of device memory up to the L2 size (50 MiB on an H200) would be
        # served from L2; writing a larger scratch tensor before each sample evicts them.
        scratch = torch.empty(128 * MiB, dtype=torch.uint8, device=device.torch())

        def flush_l2() -> None:
            scratch.zero_()
            sync()

        setup = flush_l2
        notes = {
            "device": "median: device time (CUDA events), L2 flushed before each sample; "
            "ratio > 1 expected at large sizes: UVA reads cross the host link, "
            "device memory reads HBM; no target",
            "copy": "median: device time (CUDA events); the copy engine's H2D copy then "
            "the read: UVA pays off while the ratio is <= 1; no target",
        }
    else:
        scratch = None
        cpu_note = (
            "CPU: UVA and 'device' memory are both host RAM (ratio ~1, host time); "
            "the crossover is a CUDA measurement; no target"
        )
        notes = {"device": cpu_note, "copy": cpu_note}
    try:
        for nbytes in _read_sizes(device, quick):
            elements = nbytes // 4
            buffer = UvaBuffer(elements, "int32", device)
            uva = device_copy = host_source = copy_then_read = functions = None
            try:
                buffer.np[:] = np.arange(elements, dtype=np.int32) % 7
                uva = buffer.torch_device_tensor
                device_copy = torch.empty_like(uva)
                device_copy.copy_(uva)
                sync()
                expected = int(buffer.np.sum(dtype=np.int64))
                if int(uva.sum()) != expected or int(device_copy.sum()) != expected:
                    raise RuntimeError(f"read of {nbytes} bytes returned a wrong sum")
                host_source = buffer.cpu

                def copy_then_read(dst=device_copy, src=host_source):
                    dst.copy_(src, non_blocking=True)
                    return dst.sum()

                functions = {"uva": uva.sum, "device": device_copy.sum, "copy": copy_then_read}
                timings = _time_alternating(
                    functions, repeat=repeat, setup=setup, synchronize=sync, device_timer=timer
                )
            finally:
                # Drop every tensor over the pinned memory before freeing it.
                functions = copy_then_read = host_source = uva = device_copy = None
                buffer.free()
                release_torch_memory(device)

            size = format_bytes(nbytes)

            def primary(key: str, timings: dict = timings) -> float:
                host_s, device_s = timings[key]
                return device_s if device_s is not None else host_s

            for key, baseline in (
                ("device", f"read {size} from device memory"),
                ("copy", f"copy {size} to device memory + read"),
            ):
                yield Row(
                    f"read {size} from UVA",
                    primary("uva"),
                    baseline,
                    primary(key),
                    notes=notes[key],
                    target=None,  # type: ignore[arg-type]
                    device_median_s=timings["uva"][1],
                    baseline_device_median_s=timings[key][1],
                    params={
                        "size_bytes": nbytes,
                        "kernel": "sum",
                        "baseline_kind": key,
                        "host_median_s": timings["uva"][0],
                        "baseline_host_median_s": timings[key][0],
                        "samples": repeat,
                    },
                )
    finally:
        scratch = None  # drop the L2-flushing tensor before returning torch's cache
        release_torch_memory(device)
