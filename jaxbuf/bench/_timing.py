"""Timing helpers for the benchmark suites: medians of repeated ``perf_counter_ns`` samples.

Host time is wall-clock time on the calling thread, stopped only after the device is idle
(``synchronize``) when the timed code queues device work. Device time, where asked for, comes
from CUDA events recorded on torch's current stream around the timed call; it differs from
host time when the host waits on other things (driver calls, Python).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DeviceEventTimer",
    "Timing",
    "device_event_timer",
    "device_synchronizer",
    "measure",
    "measure_per_call",
    "round_by_round",
    "round_by_round_samples",
]

_NS = 1e-9


@dataclass
class Timing:
    """Samples in seconds and their medians (``device_median_s`` None when not measured)."""

    median_s: float
    samples_s: list[float]
    device_median_s: float | None = None


def device_synchronizer(device: Any) -> Callable[[], None]:
    """A no-argument function that waits until ``device`` is idle (through its driver)."""
    from jaxbuf.drivers import get_vmm_driver

    driver = get_vmm_driver(device)
    index = device.index
    return lambda: driver.synchronize(index)


class DeviceEventTimer:
    """Device time of asynchronous work through ``torch.cuda.Event`` on the current stream.

    ``token = start()`` before the work, ``stop(token)`` right after queueing it (before the
    host waits), ``seconds(token)`` once the device has caught up.
    """

    def __init__(self, device_index: int) -> None:
        import torch

        self._torch = torch
        self._index = device_index

    def start(self) -> Any:
        torch = self._torch
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record(torch.cuda.current_stream(self._index))
        return begin, end

    def stop(self, token: Any) -> None:
        token[1].record(self._torch.cuda.current_stream(self._index))

    def seconds(self, token: Any) -> float:
        begin, end = token
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3  # milliseconds -> seconds


def device_event_timer(device: Any) -> DeviceEventTimer | None:
    """A :class:`DeviceEventTimer` for a CUDA ``device``; None on the CPU or without
    torch's CUDA."""
    if not getattr(device, "is_cuda", False):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return DeviceEventTimer(device.index)


def measure(
    fn: Callable[..., Any],
    *,
    repeat: int,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[], None] | None = None,
    synchronize: Callable[[], None] | None = None,
    device_timer: DeviceEventTimer | None = None,
) -> Timing:
    """Time ``repeat`` calls of ``fn`` (after ``warmup`` untimed ones); return the medians.

    With ``setup``, each call is ``fn(setup())`` and only ``fn`` is timed. What ``fn``
    returns is dropped after each sample, then ``teardown()`` runs, untimed (return cached
    memory there, so samples do not pile memory up). ``synchronize`` runs inside the timed
    region, after ``fn``: use it when ``fn`` queues device work. ``device_timer`` adds
    device-side samples (CUDA events around ``fn``), reported as ``device_median_s``. The
    garbage collector is paused while timing.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be positive, got {repeat}")
    samples: list[float] = []
    device_samples: list[float] = []
    gc_was_enabled = gc.isenabled()
    try:
        for i in range(warmup + repeat):
            state = setup() if setup is not None else None
            gc.disable()
            token = device_timer.start() if device_timer is not None else None
            start = time.perf_counter_ns()
            result = fn(state) if setup is not None else fn()
            if token is not None:
                device_timer.stop(token)  # type: ignore[union-attr]
            if synchronize is not None:
                synchronize()
            stop = time.perf_counter_ns()
            if gc_was_enabled:
                gc.enable()
            if token is not None and i >= warmup:
                device_samples.append(device_timer.seconds(token))  # type: ignore[union-attr]
            if i >= warmup:
                samples.append((stop - start) * _NS)
            del result, state
            if teardown is not None:
                teardown()
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(
        statistics.median(samples),
        samples,
        statistics.median(device_samples) if device_samples else None,
    )


def measure_per_call(fn: Callable[[], Any], *, number: int, repeat: int, warmup: int = 1) -> Timing:
    """Median per-call time of a fast ``fn``: ``repeat`` batches of ``number`` calls each.

    For microsecond operations (a DLPack capsule, a view), where one ``perf_counter_ns``
    pair would dominate. Results are dropped inside the batch, so their destructors count.
    """
    if number < 1 or repeat < 1:
        raise ValueError(f"number and repeat must be positive, got {number}, {repeat}")
    loop = range(number)
    samples: list[float] = []
    gc_was_enabled = gc.isenabled()
    try:
        gc.disable()
        for i in range(warmup + repeat):
            start = time.perf_counter_ns()
            for _ in loop:
                fn()
            stop = time.perf_counter_ns()
            if i >= warmup:
                samples.append((stop - start) * _NS / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(statistics.median(samples), samples)


def round_by_round_samples(
    calls: dict[str, Callable[[], Any]], repeat: int
) -> dict[str, list[float]]:
    """Seconds of each of ``calls`` (already warmed up) in each of ``repeat`` rounds: every
    round calls each once, in an order reversed every other round, so that drift of the
    machine's speed falls on all alike. The i-th samples of two calls share a round: their
    ratios pair up (:func:`jaxbuf.bench.ratio_spread` with ``paired=True``)."""
    samples: dict[str, list[float]] = {label: [] for label in calls}
    labels = list(calls)
    for i in range(repeat):
        for label in labels if i % 2 == 0 else reversed(labels):
            start = time.perf_counter()
            calls[label]()
            samples[label].append(time.perf_counter() - start)
    return samples


def round_by_round(calls: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median seconds of each of ``calls`` (already warmed up), sampled round by round
    (:func:`round_by_round_samples`): the candidates of one target, compared as a ratio."""
    samples = round_by_round_samples(calls, repeat)
    return {label: statistics.median(times) for label, times in samples.items()}


def release_torch_memory(device: Any) -> None:
    """Return torch's cached device and pinned host memory."""
    try:
        import torch
    except ImportError:
        return
    if device.is_cuda and torch.cuda.is_available():
        torch.cuda.synchronize(device.index)
        torch.cuda.empty_cache()
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()
