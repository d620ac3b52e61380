"""Where a JAX pack spends its host time, part by part, and what a JAX call costs to dispatch.

    python3 tools/experiments/pack_parts.py   # any machine; the dispatch part wants a GPU

For 256 and 4,096 disjoint writes of 16 int32 (the ``jax.staged`` workload): the C stager's
``stage_many``, ``resolve``, ``write_columns`` and the element expansion; a numpy allocation
and fill of the packed length (the memory traffic alone); a pack into a ``PackRing`` slot.
Then the jitted apply's dispatch and wait with the packed writes three ways: a ring slot
(imported pinned memory), a buffer already on the device, and a fresh numpy buffer (one
transfer per call). The numbers behind "where the remaining time goes" (BENCHMARKS.md, third
session).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxbuf  # noqa: E402
from jaxbuf.bench._timing import measure  # noqa: E402
from jaxbuf.bench.jax_staged import _SHAPE, _workload  # noqa: E402
from jaxbuf.jax_ops import PackRing, StagedWrites, pack_writes  # noqa: E402
from jaxbuf.kernels import jax_ring, jax_staged  # noqa: E402


def median_us(fn, n=60, setup=None) -> float:
    """Median µs of ``fn()`` over ``n`` calls after 10 untimed ones (``setup()`` untimed
    before each): :func:`jaxbuf.bench._timing.measure`, the benches' timer."""
    call = (lambda _: fn()) if setup is not None else fn
    return round(measure(call, repeat=n, warmup=10, setup=setup).median_s * 1e6, 1)


def pack_parts(device, n: int) -> dict[str, float]:
    rows, starts, values = _workload(n)
    staged = StagedWrites(*_SHAPE, "int32")
    stager = staged._staging.stager
    parts = {
        "stage_many": median_us(
            lambda: staged.stage_writes(rows, starts, values), setup=staged.clear
        )
    }
    staged.stage_writes(rows, starts, values)
    parts["resolve"] = median_us(stager.resolve)
    packed = staged.pack(clear=False)
    words = packed.buffer.shape[0]
    columns = packed.buffer[: 4 * packed.num_writes].reshape(4, packed.num_writes)
    value_words = jax_staged._value_words(packed.num_values, packed.dtype)
    value_bytes = packed.buffer[4 * packed.num_writes : 4 * packed.num_writes + value_words]
    parts["write_columns"] = median_us(
        lambda: stager.write_columns(*columns, value_bytes.view(np.uint8))
    )
    parts["expand elements"] = median_us(lambda: jax_staged._expand_elements(packed))
    parts["np.empty + fill, packed length"] = median_us(lambda: np.empty(words, np.int32).fill(0))
    with PackRing(device=device) as ring:
        ring.pack(staged, clear=False)
        parts["ring.pack"] = median_us(lambda: ring.pack(staged, clear=False))
    return parts


def dispatch_parts(device, n: int) -> dict[str, float]:
    """Dispatch and wait of the ring's cached jitted apply, per kind of packed buffer."""
    rows, starts, values = _workload(n)
    step = jax_ring._jitted_apply(None)
    jax_device = device.jax()
    host_packed = pack_writes(
        rows, starts, values, "int32", shape=_SHAPE, expand=not device.is_cuda
    )
    resident = jax.device_put(host_packed, jax_device)
    times: dict[str, list[float]] = {}
    with PackRing(device=device) as ring:
        array = jax.device_put(np.zeros(_SHAPE, np.int32), jax_device)
        for i in range(60):
            for label in ("ring slot", "on the device", "numpy buffer"):
                if label == "ring slot":
                    packed = pack_writes(rows, starts, values, "int32", shape=_SHAPE, ring=ring)
                else:
                    packed = resident if label == "on the device" else host_packed
                start = time.perf_counter()
                array, token = step(array, packed)
                dispatched = time.perf_counter()
                array.block_until_ready()
                done = time.perf_counter()
                if label == "ring slot":
                    ring.consumed_by(token)
                if i >= 10:
                    times.setdefault(f"{label}: dispatch", []).append(dispatched - start)
                    times.setdefault(f"{label}: wait", []).append(done - dispatched)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}


def main() -> None:
    device = jaxbuf.default_device()
    for n in (256, 4096):
        print(n, "pack:", pack_parts(device, n), flush=True)
        print(n, "apply:", dispatch_parts(device, n), flush=True)


if __name__ == "__main__":
    main()
