"""Device time per apply of the JAX scatter with each way of finding every value's target.

    python3 tools/experiments/expand_variants.py   # on a GPU (runs anywhere, slowly)

256 and 4,096 disjoint writes of 16 int32 into a 4096 x 4096 int32 array: plain JAX's scatter
from host indices, the host-expanded pack, and an unexpanded pack whose value-to-write map is
computed inside ``jit`` by a prefix sum of marks or by ``jnp.searchsorted`` (``scan``,
``scan_unrolled``, ``compare_all`` at 256 only, ``sort``). 50 applies are chained in one jitted
function (unrolled) over inputs on the device; the minimum of two rounds per apply is printed,
and every variant's result is checked against the first's. The numbers behind
``jaxbuf.kernels.jax_staged._element_indices`` (BENCHMARKS.md, third session).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxbuf.bench.jax_staged import _SHAPE, _plain_indices, _workload  # noqa: E402
from jaxbuf.jax_ops import pack_writes  # noqa: E402
from jaxbuf.kernels import jax_staged  # noqa: E402

CHAIN = 50
DROPPED = jax_staged._DROPPED_INDEX


def search_indices(packed, method: str):
    """Each value's target row and column, its write found by ``jnp.searchsorted``."""
    element = jnp.arange(packed.num_values, dtype=jnp.int32)
    write = jnp.searchsorted(packed.offsets, element, side="right", method=method)
    write = write.astype(jnp.int32) - 1
    table = jnp.stack([packed.rows, packed.starts, packed.offsets, packed.lengths], axis=1)
    row, start, offset, length = table[jnp.maximum(write, 0)].T
    within = element - offset
    valid = (write >= 0) & (within < length)
    return jnp.where(valid, row, DROPPED), jnp.where(valid, start + within, DROPPED)


def scatter_with(indices):
    def apply(array, packed):
        rows, cols = indices(packed)
        return array.at[rows, cols].set(packed.values, mode="drop")

    return apply


def per_apply_us(apply, inputs, device) -> tuple[float, np.ndarray]:
    """Median time of one chained call divided by CHAIN, and the resulting array."""

    def chain(array, *xs):
        for _ in range(CHAIN):
            array = apply(array, *xs)
        return array

    chained = jax.jit(chain, donate_argnums=0)
    inputs = jax.device_put(inputs, device)
    holder = [jax.device_put(np.zeros(_SHAPE, np.int32), device)]
    times = []
    for i in range(17):
        start = time.perf_counter()
        holder[0] = chained(holder[0], *inputs)
        holder[0].block_until_ready()
        if i >= 2:  # compile, warm up
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / CHAIN, np.asarray(holder[0])


def best_per_apply_us(variants: dict, device, rounds: int) -> dict[str, float]:
    """``{name: µs}``: each variant ``(apply, inputs)``'s least :func:`per_apply_us` over
    ``rounds`` rounds (all variants once per round); every result must equal the first
    variant's (plain JAX's)."""
    best: dict[str, float] = {}
    expected = None
    for _ in range(rounds):
        for name, (apply, inputs) in variants.items():
            us, result = per_apply_us(apply, inputs, device)
            best[name] = min(best.get(name, us), us)
            if expected is None:
                expected = result
            if not np.array_equal(result, expected):
                raise AssertionError(f"{name} differs from plain JAX")
    return {name: round(us, 2) for name, us in best.items()}


def main() -> None:
    device = jax.devices()[0]
    for n in (256, 4096):
        rows, starts, values = _workload(n)
        expanded = pack_writes(rows, starts, values, "int32", shape=_SHAPE)
        lean = pack_writes(rows, starts, values, "int32", shape=_SHAPE, expand=False)
        # As a mixed-length pack: the variants here search (or sum); uniform packs divide
        # (scatter_variants.py measures that).
        lean = jax_staged.PackedWrites._wrap(
            lean.buffer, lean.num_writes, lean.num_values, lean.dtype, False, False
        )
        variants = {
            "plain": (lambda a, r, c, v: a.at[r, c].set(v), _plain_indices(rows, starts, values)),
            "expanded": (jax_staged._apply_scatter, (expanded,)),
            "prefix sum": (scatter_with(lambda p: jax_staged._element_indices(p, "cpu")), (lean,)),
        }
        methods = ["scan", "scan_unrolled", "sort"] + (["compare_all"] if n <= 256 else [])
        for method in methods:
            indices = lambda p, method=method: search_indices(p, method)  # noqa: E731
            variants[f"search {method}"] = (scatter_with(indices), (lean,))
        print(n, best_per_apply_us(variants, device, rounds=2), flush=True)


if __name__ == "__main__":
    main()
