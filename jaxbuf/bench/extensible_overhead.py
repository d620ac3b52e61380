"""Host-side overheads of :class:`jaxbuf.ExtensibleTensor`, baselines in the same run.

Suites (registered after those of :mod:`jaxbuf.bench.extensible`, whose names they share):

* ``extensible.bookkeeping``: the per-grow cost of the buffer logic alone (a no-op driver)
  at 100 and 10,000 committed granules, jaxbuf's intervals against the seed's granule walk.
* ``extensible.views``: DLPack capsule, torch view and JAX view of a buffer, against torch's
  own exports and a seed-style ctypes capsule builder.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from jaxbuf.bench import Row, Sizes, format_bytes, suite
from jaxbuf.bench._extensible_baselines import _NoOpDriver, _seed_style_capsule, _SeedStyleTensor
from jaxbuf.bench._timing import measure, measure_per_call
from jaxbuf.bench.extensible import _FLAT_TARGET, _skip_reason
from jaxbuf.extensible import ExtensibleTensor, granule_size

MiB = 1 << 20

_CAPSULE_TARGET_S = 2e-6
_TORCH_VIEW_TARGET_S = 4e-6


@suite("extensible.bookkeeping")
def bookkeeping(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Per-grow buffer bookkeeping at few and many committed granules (no-op driver)."""
    del device  # the no-op driver stands in for the platform
    granule = 2 * MiB
    counts = (100, 10_000)
    yield Sizes(f"{counts[0]:,} and {counts[1]:,} granules of {format_bytes(granule)}")
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

        return (
            buffer,
            lambda: measure(grows, setup=setup, repeat=repeat // rounds, warmup=1).samples_s,
        )

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
            f"{label}: grow at {counts[1]:,} granules",
            results[label, counts[1]],
            f"{label}: grow at {counts[0]:,} granules",
            results[label, counts[0]],
            notes="bookkeeping only (no-op driver)",
            params={"kind": "bookkeeping", "implementation": label},
        )
        if label == "jaxbuf":
            result.target = f"<= {_FLAT_TARGET:g}x"
            result.met = result.ratio is not None and result.ratio <= _FLAT_TARGET
        yield result
    yield Row(
        f"jaxbuf: grow at {counts[1]:,} granules",
        results["jaxbuf", counts[1]],
        f"seed-style: grow at {counts[1]:,} granules",
        results["seed-style", counts[1]],
        notes="bookkeeping only (no-op driver)",
        params={"kind": "bookkeeping", "implementation": "both"},
    )


@suite("extensible.views")
def views(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """DLPack capsule, torch view, JAX view against torch's exports and the seed's builder."""
    # The CPU's calls are slower and its run must stay short: fewer calls per batch there.
    number, repeat = (500, 5) if quick else ((5000, 15) if device.is_cuda else (2000, 9))
    yield Sizes(f"a 1 MiB view, {repeat} batches of {number:,} calls")
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
        yield Row(
            "capsule: view.__dlpack__()",
            capsule_s,
            "seed-style ctypes capsule",
            seed_capsule_s,
            target=f"<= {_CAPSULE_TARGET_S * 1e6:g} µs",
            met=capsule_s <= _CAPSULE_TARGET_S,
        )

        try:
            import torch
        except ImportError as error:
            yield Row("torch view: view.to_torch()", None, notes=_skip_reason(error))
        else:
            native = torch.empty(1 * MiB, dtype=torch.uint8, device=device.torch())
            yield Row(
                "capsule: view.__dlpack__()",
                capsule_s,
                "torch: tensor.__dlpack__()",
                per_call(native.__dlpack__),
            )
            torch_view_s = per_call(view.to_torch)
            yield Row(
                "torch view: view.to_torch()",
                torch_view_s,
                "torch.from_dlpack(native tensor)",
                per_call(lambda: torch.from_dlpack(native)),
                target=f"<= {_TORCH_VIEW_TARGET_S * 1e6:g} µs",
                met=torch_view_s <= _TORCH_VIEW_TARGET_S,
            )
            yield Row(
                "torch view: view.to_torch()",
                torch_view_s,
                "seed-style capsule + torch.from_dlpack",
                per_call(
                    lambda: torch.from_dlpack(
                        _seed_style_capsule(view.ptr, view.nbytes, device_type, device.index)
                    )
                ),
            )
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
                yield Row(
                    "JAX view: view.to_jax()",
                    jax_view_s,
                    "jax.dlpack.from_dlpack(torch tensor)",
                    per_call(lambda: jax.dlpack.from_dlpack(native), jax_calls),
                )
    finally:
        buffer.free()
