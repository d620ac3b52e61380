"""Benchmark of JAX imports of jaxbuf memory, baselines in the same run.

Suite ``jax.views``: host time of one ``BufferView.to_jax()`` (the JAX adapter's DLPack import,
the array dropped inside the timed batch so its deleter counts), as bytes and reinterpreted as
a 2-D float32 array, against ``jax.dlpack.from_dlpack`` of a torch tensor of the same size on
the same device (the import a torch + JAX user writes) and of a JAX array (JAX's own export,
imported back). Also the per-step metadata path of a
decode loop: ``UvaBufferPool(framework="jax").copy_to_uva`` of a small int32 array against
``jax.device_put`` of it (host time; the device_put copy itself completes asynchronously).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, format_bytes, suite
from jaxbuf.bench._timing import measure_per_call

_VIEW_BYTES = 1 << 20
_META_SHAPE = (32, 2)  # a decode step's metadata: (length, slot) per sequence


@suite("jax.views", requires=("jax",))
def views_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """JAX imports of a jaxbuf view against jax.dlpack.from_dlpack of torch and JAX arrays,
    and the UVA pool's JAX metadata against jax.device_put."""
    import jax
    import jax.dlpack

    from jaxbuf import ExtensibleTensor, UvaBufferPool, granule_size

    # An import costs about a microsecond on a GPU host and about a millisecond with JAX's CPU
    # client: fewer calls per batch on the CPU keep its run short.
    number, repeat = (100, 11) if quick else ((2000, 15) if device.is_cuda else (100, 9))
    shape_2d = (_VIEW_BYTES // 4 // 1024, 1024)
    yield Sizes(
        f"a {format_bytes(_VIEW_BYTES)} view (uint8, and float32 {shape_2d[0]} x {shape_2d[1]}), "
        f"{_META_SHAPE[0]} x {_META_SHAPE[1]} int32 metadata; {repeat} batches of "
        f"{number:,} calls"
    )
    jax_device = device.jax()

    def per_call(**fns: Any) -> dict[str, float]:
        """Median per call of each function; rounds alternate between them, so that a noisy
        neighbour or a drifting clock affects all alike."""
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for round_ in range(repeat + 1):  # the first round warms up
            for name, fn in fns.items():
                sample = measure_per_call(fn, number=number, repeat=1, warmup=0).median_s
                if round_:
                    samples[name].append(sample)
        return {name: statistics.median(values) for name, values in samples.items()}

    buffer = ExtensibleTensor(granule_size(device), device=device)
    pool = None
    try:
        buffer.resize_per_segment_(_VIEW_BYTES, zero_new=True)
        view = buffer.segment_view(0)
        jax_native = jax.device_put(np.zeros(_VIEW_BYTES, np.uint8), jax_device)
        fns = {
            "view": view.to_jax,
            "reshaped": lambda: view.to_jax(dtype="float32", shape=shape_2d),
            "jax": lambda: jax.dlpack.from_dlpack(jax_native),
        }
        torch_note = ""
        try:
            import torch
        except ImportError as error:
            torch_note = f"skipped: torch is not installed ({error})"
        else:
            native = torch.zeros(_VIEW_BYTES, dtype=torch.uint8, device=device.torch())
            native_2d = native.view(torch.float32).view(shape_2d)
            fns["torch"] = lambda: jax.dlpack.from_dlpack(native)
            fns["torch_2d"] = lambda: jax.dlpack.from_dlpack(native_2d)
        medians = per_call(**fns)
        fns.clear()  # drops the torch tensors and the JAX array
        torch_name = "jax.dlpack.from_dlpack(torch tensor)"
        yield Row(
            "view.to_jax()",
            medians["view"],
            torch_name,
            medians.get("torch"),
            notes=torch_note,
            params={"kind": "jax-view", "baseline_kind": "torch"},
        )
        yield Row(
            "view.to_jax()",
            medians["view"],
            "jax.dlpack.from_dlpack(JAX array)",
            medians["jax"],
            notes="JAX's own DLPack export of a JAX array, imported back",
            params={"kind": "jax-view", "baseline_kind": "jax"},
        )
        yield Row(
            "view.to_jax('float32', 2-D)",
            medians["reshaped"],
            f"{torch_name}, float32 2-D",
            medians.get("torch_2d"),
            notes=torch_note or "the view reinterpreted (a new view) and imported",
            params={"kind": "jax-view-reshaped", "baseline_kind": "torch"},
        )

        pool = UvaBufferPool(_META_SHAPE, "int32", device=device, framework="jax")
        meta = np.arange(np.prod(_META_SHAPE), dtype=np.int32).reshape(_META_SHAPE)
        medians = per_call(
            pool=lambda: pool.copy_to_uva(meta), put=lambda: jax.device_put(meta, jax_device)
        )
        yield Row(
            "UvaBufferPool(framework='jax').copy_to_uva(metadata)",
            medians["pool"],
            "jax.device_put(metadata)",
            medians["put"],
            notes="host time; device_put's copy completes asynchronously",
            params={"kind": "jax-metadata"},
        )
    finally:
        if pool is not None:
            pool.close()
        buffer.free()
