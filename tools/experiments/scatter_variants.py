"""Device time per apply of the JAX scatter written several ways: does telling XLA that the
indices are unique, or scattering into the flat array, make it cheaper?

    python3 tools/experiments/scatter_variants.py   # on a GPU (runs anywhere, slowly)

The ``jax.staged`` bench's workload and chained-jit timing (``workload.py``). The packer resolves
overlaps (no two kept values share a target), so ``unique_indices=True`` is a true promise for
every kept value; padding gets distinct out-of-range targets so that it holds for all of them.
The last variant is jaxbuf's scatter as shipped (``apply_staged_writes``' default: on uniform
packs a division, no search). Rerun it after a JAX upgrade to check the default still wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from workload import (  # noqa: E402
    DROPPED,
    SHAPE,
    best_per_apply_us,
    disjoint_writes,
    plain_indices,
    search_indices,
)

from jaxbuf.jax_ops import apply_staged_writes, pack_writes  # noqa: E402


def distinct_padding(rows, cols):
    """Padding (row == DROPPED) gets column = its position, so every (row, col) pair differs."""
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    return rows, jnp.where(rows == DROPPED, position, cols)


def scatter2d(indices, unique):
    def apply(array, packed):
        rows, cols = indices(packed)
        if unique:
            rows, cols = distinct_padding(rows, cols)
        return array.at[rows, cols].set(packed.values, mode="drop", unique_indices=unique)

    return apply


def scatter_flat(indices):
    def apply(array, packed):
        rows, cols = indices(packed)
        width = array.shape[1]
        position = jnp.arange(rows.shape[0], dtype=jnp.int32)
        # Padding: distinct targets past the end.
        flat = jnp.where(rows == DROPPED, array.size + position, rows * width + cols)
        out = array.reshape(-1).at[flat].set(packed.values, mode="drop", unique_indices=True)
        return out.reshape(array.shape)

    return apply


def expanded(packed):
    return packed.element_rows, packed.element_cols


def unrolled(packed):
    return search_indices(packed, "scan_unrolled")


def main() -> None:
    device = jax.devices()[0]
    for n in (256, 4096):
        rows, starts, values = disjoint_writes(n)
        full = pack_writes(rows, starts, values, "int32", shape=SHAPE)
        lean = pack_writes(rows, starts, values, "int32", shape=SHAPE, expand=False)
        plain = plain_indices(rows, starts, values)
        variants = {
            "plain": (lambda a, r, c, v: a.at[r, c].set(v), plain),
            "plain unique": (lambda a, r, c, v: a.at[r, c].set(v, unique_indices=True), plain),
            "expanded": (scatter2d(expanded, False), (full,)),
            "expanded unique": (scatter2d(expanded, True), (full,)),
            "expanded flat": (scatter_flat(expanded), (full,)),
            "unrolled": (scatter2d(unrolled, False), (lean,)),
            "unrolled unique": (scatter2d(unrolled, True), (lean,)),
            "unrolled flat": (scatter_flat(unrolled), (lean,)),
            # jaxbuf's scatter as shipped: every write has 16 values, so the pack is uniform
            # and each value's write is found by a division.
            "division unique (jaxbuf)": (apply_staged_writes, (lean,)),
        }
        assert lean.uniform
        print(n, best_per_apply_us(variants, device, rounds=3), flush=True)


if __name__ == "__main__":
    main()
