"""What the experiments here share: the ``jax.staged`` bench's workload, and two timers.

The workload: ``num_writes`` disjoint writes of :data:`WRITE_LEN` int32 at distinct 16-aligned
cells of a :data:`SHAPE` int32 array (the figures of ``python -m jaxbuf bench jax.staged``), and
the flat row / column / value arrays a JAX user would scatter them with. The timers:
:func:`median_us` (host time of a call) and :func:`best_per_apply_us` (device time per apply,
:data:`CHAIN` applies chained in one jitted function, the least of some rounds).

Everything goes through public names (``jaxbuf.jax_ops``), so the experiments keep working as
the library's insides change.
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

# The bench's own workload (re-exported here), so the experiments measure what it reports.
from jaxbuf.bench.jax_staged import SHAPE, WRITE_LEN, disjoint_writes  # noqa: F401

CHAIN = 50
DROPPED = np.iinfo(np.int32).max  # a target row out of range for any array: dropped


def plain_indices(rows: list[int], starts: list[int], values: list) -> tuple:
    """The flat row, column and value arrays of plain JAX's ``a.at[r, c].set(v)``."""
    lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
    flat = np.concatenate(values)
    offsets = np.cumsum(lengths) - lengths
    row_index = np.repeat(np.asarray(rows, np.int32), lengths)
    column_index = np.repeat(np.asarray(starts, np.int64) - offsets, lengths)
    column_index += np.arange(flat.shape[0])
    return row_index, column_index.astype(np.int32), flat


def median_us(fn, n: int = 300, setup=None) -> float:
    """Median µs of ``fn()`` over ``n`` calls after 20 untimed ones; ``setup()`` runs untimed
    before each. The garbage collector is paused while timing."""
    samples = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(20 + n):
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            if i >= 20:
                samples.append(time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    return round(statistics.median(samples) * 1e6, 1)


def per_apply_us(apply, inputs, device) -> tuple[float, np.ndarray]:
    """Median time of one call of CHAIN chained ``apply(array, *inputs)`` divided by CHAIN,
    and the resulting array."""
    import jax

    def chain(array, *xs):
        for _ in range(CHAIN):
            array = apply(array, *xs)
        return array

    chained = jax.jit(chain, donate_argnums=0)
    inputs = jax.device_put(inputs, device)
    holder = [jax.device_put(np.zeros(SHAPE, np.int32), device)]
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
    variant's."""
    best: dict[str, float] = {}
    expected = None
    for _ in range(rounds):
        for name, (apply, inputs) in variants.items():
            us, result = per_apply_us(apply, inputs, device)
            best[name] = min(best.get(name, us), us)
            if expected is None:
                expected = result
            if not np.array_equal(result, expected):
                raise AssertionError(f"{name} differs from the first variant")
    return {name: round(us, 2) for name, us in best.items()}


def search_indices(packed, method: str):
    """Each value's target row and column in an unexpanded pack, its write found by
    ``jnp.searchsorted`` over the write offsets (the GPU's way for mixed-length packs)."""
    import jax.numpy as jnp

    element = jnp.arange(packed.num_values, dtype=jnp.int32)
    write = jnp.searchsorted(packed.offsets, element, side="right", method=method)
    write = write.astype(jnp.int32) - 1
    table = jnp.stack([packed.rows, packed.starts, packed.offsets, packed.lengths], axis=1)
    row, start, offset, length = table[jnp.maximum(write, 0)].T
    within = element - offset
    valid = (write >= 0) & (within < length)
    return jnp.where(valid, row, DROPPED), jnp.where(valid, start + within, DROPPED)
