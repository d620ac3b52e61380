"""Device time per apply of the JAX scatter written several ways: does telling XLA that the
indices are unique, or scattering into the flat array, make it cheaper?

    python3 tools/experiments/scatter_variants.py   # on a GPU (runs anywhere, slowly)

The same workload and chained-jit timing as ``expand_variants.py``. The packer resolves
overlaps (no two kept values share a target), so ``unique_indices=True`` is a true promise for
every kept value; padding gets distinct out-of-range targets so that it holds for all of them.
The last variant is jaxbuf's scatter as shipped (uniform packs: a division, no search).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from expand_variants import best_per_apply_us, search_indices  # noqa: E402

from jaxbuf.bench.jax_staged import _SHAPE, _plain_indices, _workload  # noqa: E402
from jaxbuf.jax_ops import pack_writes  # noqa: E402
from jaxbuf.kernels import jax_staged  # noqa: E402

DROPPED = np.iinfo(np.int32).max


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
        rows, starts, values = _workload(n)
        full = pack_writes(rows, starts, values, "int32", shape=_SHAPE)
        lean = pack_writes(rows, starts, values, "int32", shape=_SHAPE, expand=False)
        plain = _plain_indices(rows, starts, values)
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
            "division unique (jaxbuf)": (jax_staged._apply_scatter, (lean,)),
        }
        assert lean.uniform
        print(n, best_per_apply_us(variants, device, rounds=3), flush=True)


if __name__ == "__main__":
    main()
