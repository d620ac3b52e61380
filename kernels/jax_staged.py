"""The JAX launcher of the staged writes: row writes applied to one 2-D array inside ``jit``.

The host packs a step's writes with :func:`pack_writes` into a :class:`PackedWrites` whose shapes
are bucketed (write count and content length rounded up to powers of two, at least 16), so a
steady decode loop reuses one compiled step. Inside ``jit``, :func:`apply_staged_writes` applies
them with a Pallas kernel that aliases the array to its output (a donated array is updated in
place) or with an XLA scatter. Overlapping writes are resolved on the host, later writes winning,
so both paths see disjoint writes and their result does not depend on execution order.

This is the JAX counterpart of :mod:`jaxbuf.kernels.staged_write` (the Triton launcher), and
like it a launcher that imports its framework (JAX, lazily, inside the functions that trace).
``jaxbuf.jax_ops`` re-exports it under its old name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxbuf.dtypes import canonical_dtype

from .reference import has_overlap

__all__ = [
    "PackedWrites",
    "pack_writes",
    "apply_staged_writes",
    "bucket_size",
    "PALLAS_BLOCK_SIZE",
    "MIN_BUCKET",
]

MIN_BUCKET = 16
# Elements one Pallas program copies per step. ``values`` carries this much padding past its
# bucket so a block read that starts inside the contents never leaves the array.
PALLAS_BLOCK_SIZE = 128
_DROPPED_INDEX = np.iinfo(np.int32).max  # out of range for any array: scatter drops it


class PackedWrites(NamedTuple):
    """Writes for one 2-D array, padded to buckets (a NamedTuple, hence a JAX pytree).

    Write ``i`` sets ``array[rows[i], starts[i] : starts[i] + lengths[i]]`` to
    ``values[offsets[i] : offsets[i] + lengths[i]]``. Invariants: the writes are pairwise
    disjoint; ``offsets`` is non-decreasing and the contents are packed back to back in write
    order; padding writes have length 0 and offset equal to the total content length;
    ``values`` has length ``bucket_size(total) + PALLAS_BLOCK_SIZE``.
    """

    rows: np.ndarray  # int32 [num_writes bucket]
    starts: np.ndarray  # int32 [num_writes bucket]
    lengths: np.ndarray  # int32 [num_writes bucket]
    offsets: np.ndarray  # int32 [num_writes bucket], element offsets into values
    values: np.ndarray  # target dtype [content bucket + PALLAS_BLOCK_SIZE]


def bucket_size(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= ``n`` and >= ``minimum``."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _resolve_overlap(rows, starts, lengths, values):
    """Rewrite overlapping writes as disjoint runs; for each element the last write wins."""
    total = values.shape[0]
    write_of_element = np.repeat(np.arange(rows.shape[0]), lengths)
    flat_rows = rows[write_of_element]
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    flat_cols = starts[write_of_element] + np.arange(total) - offsets[write_of_element]
    key = flat_rows * (int(flat_cols.max()) + 1) + flat_cols
    # np.unique returns the first occurrence; on the reversed keys that is the last write.
    _, first_in_reversed = np.unique(key[::-1], return_index=True)
    keep = np.sort(total - 1 - first_in_reversed)
    flat_rows, flat_cols, values = flat_rows[keep], flat_cols[keep], values[keep]
    # A new run starts wherever the row changes or the column is not the previous one plus one.
    breaks = np.ones(keep.shape[0], dtype=bool)
    breaks[1:] = (flat_rows[1:] != flat_rows[:-1]) | (flat_cols[1:] != flat_cols[:-1] + 1)
    run_starts = np.flatnonzero(breaks)
    run_lengths = np.diff(np.append(run_starts, keep.shape[0]))
    return flat_rows[run_starts], flat_cols[run_starts], run_lengths, values


def _as_indices(values: Any, name: str) -> np.ndarray:
    """``values`` as a flat int64 array; TypeError naming them unless every entry is an int
    (a float row would otherwise be truncated silently)."""
    array = np.asarray(values).reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {values!r}")
    return array.astype(np.int64)


def pack_writes(
    rows: Sequence[int],
    starts: Sequence[int],
    values_list: Sequence[Any],
    dtype: Any,
    *,
    shape: tuple[int, int] | None = None,
    min_write_bucket: int = MIN_BUCKET,
    min_content_bucket: int = MIN_BUCKET,
) -> PackedWrites:
    """Pack row writes (numpy, on the host) for :func:`apply_staged_writes`.

    ``values_list[i]`` (anything numpy converts) goes to ``array[rows[i], starts[i]:...]``.
    Values are converted to ``dtype``; a conversion that changes a value raises ValueError.
    With ``shape`` every write is bounds-checked; without it, out-of-range elements are dropped
    at apply time. Where writes overlap, the later one wins. Raising the ``min_*_bucket`` floors
    to a loop's largest step keeps every step on one compiled shape.
    """
    np_dtype = canonical_dtype(dtype).numpy
    rows, starts = _as_indices(rows, "rows"), _as_indices(starts, "starts")
    if not rows.shape[0] == starts.shape[0] == len(values_list):
        raise ValueError(
            f"got {rows.shape[0]} rows, {starts.shape[0]} starts and {len(values_list)} values"
        )
    arrays = []
    for i, value in enumerate(values_list):
        source = np.asarray(value).reshape(-1)
        converted = source.astype(np_dtype)
        # Floats may round; an integer target must hold every value exactly (no wrap-around,
        # no dropped fraction).
        if np_dtype.kind in "iub" and not np.array_equal(converted, source):
            raise ValueError(f"write {i}: values do not fit {np_dtype} exactly")
        arrays.append(converted)
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    if (rows < 0).any() or (starts < 0).any():
        raise IndexError(f"negative row or start in rows {rows} / starts {starts}")
    if shape is not None:
        bad = (rows >= shape[0]) | (starts + lengths > shape[1])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise IndexError(
                f"write {i} (row {rows[i]}, start {starts[i]}, length {lengths[i]}) "
                f"is out of bounds for shape {tuple(shape)}"
            )
    values = np.concatenate(arrays) if arrays else np.zeros(0, np_dtype)
    nonempty = lengths > 0
    rows, starts, lengths = rows[nonempty], starts[nonempty], lengths[nonempty]
    if has_overlap(np.zeros_like(rows), rows, starts, lengths):
        rows, starts, lengths, values = _resolve_overlap(rows, starts, lengths, values)
    num_writes, total = rows.shape[0], values.shape[0]
    write_bucket = bucket_size(num_writes, min_write_bucket)
    content_bucket = bucket_size(total, min_content_bucket) + PALLAS_BLOCK_SIZE
    if (
        max(
            content_bucket,
            int(starts.max(initial=0)) + int(lengths.max(initial=0)),
            int(rows.max(initial=0)),
        )
        >= _DROPPED_INDEX
    ):
        raise ValueError("writes exceed the int32 index range")

    def padded(column, fill):
        out = np.full(write_bucket, fill, dtype=np.int32)
        out[:num_writes] = column
        return out

    offsets = np.cumsum(lengths) - lengths
    padded_values = np.zeros(content_bucket, dtype=np_dtype)
    padded_values[:total] = values
    return PackedWrites(
        rows=padded(rows, 0),
        starts=padded(starts, 0),
        lengths=padded(lengths, 0),
        offsets=padded(offsets, total),
        values=padded_values,
    )


def _pallas_kernel(rows_ref, starts_ref, lengths_ref, offsets_ref, values_ref, array_ref, out_ref):
    """One program per write: copy its contents into the aliased output, a block at a time."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    del array_ref  # aliased to out_ref
    write = pl.program_id(0)
    row, start = rows_ref[write], starts_ref[write]
    length, offset = lengths_ref[write], offsets_ref[write]
    num_rows, num_cols = out_ref.shape

    def copy_block(block, carry):
        position = block * PALLAS_BLOCK_SIZE + jnp.arange(PALLAS_BLOCK_SIZE)
        # Out-of-range elements are dropped, matching the scatter path's mode="drop".
        mask = (position < length) & (start + position < num_cols) & (row < num_rows)
        block_values = plgpu.load(
            values_ref.at[pl.ds(offset + block * PALLAS_BLOCK_SIZE, PALLAS_BLOCK_SIZE)], mask=mask
        )
        plgpu.store(
            out_ref.at[row, pl.ds(start + block * PALLAS_BLOCK_SIZE, PALLAS_BLOCK_SIZE)],
            block_values,
            mask=mask,
        )
        return carry

    jax.lax.fori_loop(0, (length + PALLAS_BLOCK_SIZE - 1) // PALLAS_BLOCK_SIZE, copy_block, 0)


def _apply_pallas(array, packed: PackedWrites, interpret: bool):
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    call = pl.pallas_call(
        _pallas_kernel,
        out_shape=jax.ShapeDtypeStruct(array.shape, array.dtype),
        grid=(packed.rows.shape[0],),
        input_output_aliases={5: 0},  # the array is updated in place when donated
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(),
        name="jaxbuf_apply_staged_writes",
    )
    return call(packed.rows, packed.starts, packed.lengths, packed.offsets, packed.values, array)


def _apply_scatter(array, packed: PackedWrites):
    import jax.numpy as jnp

    element = jnp.arange(packed.values.shape[0], dtype=jnp.int32)
    # The write holding each content element: the last write whose offset is <= the element
    # (empty writes share their offset with the next one, which side="right" skips).
    write = jnp.searchsorted(packed.offsets, element, side="right") - 1
    within = element - packed.offsets[write]
    valid = within < packed.lengths[write]
    flat_rows = jnp.where(valid, packed.rows[write], _DROPPED_INDEX)
    flat_cols = jnp.where(valid, packed.starts[write] + within, _DROPPED_INDEX)
    # Kept indices are unique (pack_writes made the writes disjoint), so scatter order is moot;
    # padding elements all share one out-of-range index and are dropped.
    return array.at[flat_rows, flat_cols].set(packed.values, mode="drop")


def apply_staged_writes(
    array, packed: PackedWrites, *, method: str = "pallas", interpret: bool | None = None
):
    """Return ``array`` with ``packed``'s writes applied; jit-able, traced once per bucket.

    ``method="pallas"`` aliases ``array`` to the result (in place when the caller donates it);
    ``interpret`` defaults to True except on a GPU backend, where the Triton lowering is used.
    ``method="scatter"`` uses ``array.at[rows, cols].set(..., mode="drop")``.
    """
    import jax

    if array.ndim != 2:
        raise ValueError(f"array must be 2-D, got shape {tuple(array.shape)}")
    if packed.values.dtype != array.dtype:
        raise TypeError(f"packed values are {packed.values.dtype}, array is {array.dtype}")
    if method == "scatter":
        return _apply_scatter(array, packed)
    if method != "pallas":
        raise ValueError(f"method must be 'pallas' or 'scatter', got {method!r}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _apply_pallas(array, packed, interpret)
