"""The JAX wing's jit-side apply: :func:`apply_staged_writes`, a pack's writes on one 2-D array.

Inside ``jit``, :func:`apply_staged_writes` applies a :class:`~jaxbuf.jax_ops.PackedWrites`
with an XLA scatter (the default on every platform, GPU included), with the Triton staged-write
kernel through ``jax_triton`` (``method="triton"``, GPU only, :mod:`jaxbuf.staged._jax_triton`),
or with the deprecated Pallas-Triton kernel (``method="pallas"``). Overlapping writes were
resolved on the host by the packer (later writes win), so every method sees disjoint writes and
its result does not depend on execution order.

JAX is imported inside the functions that trace; importing this module needs numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._jax_packed import DROPPED_INDEX, PALLAS_BLOCK_SIZE, PackedWrites

__all__ = ["METHODS", "apply_staged_writes", "check_array"]


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
        grid=(packed.num_writes,),
        input_output_aliases={5: 0},  # the array is updated in place when donated
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(),
        name="jaxbuf_apply_staged_writes",
    )
    return call(packed.rows, packed.starts, packed.lengths, packed.offsets, packed.values, array)


def _apply_scatter(array, packed: PackedWrites):
    rows, cols = _scatter_targets(packed, _platform(array))
    # unique_indices=True lets XLA store without ordering colliding updates: H200, 50 applies
    # chained, per apply at 256 / 4,096 writes, 2.80 / 3.39 µs without it, 2.64 / 3.06 µs
    # with it, plain JAX's a.at[r, c].set(v) 3.04 / 3.19 µs
    # (tools/experiments/scatter_variants.py).
    return array.at[rows, cols].set(packed.values, mode="drop", unique_indices=True)


def _scatter_targets(packed: PackedWrites, platform: str) -> tuple[Any, Any]:
    """Every value's (row, column), no two pairs equal: the packer made the writes disjoint,
    so kept values never share a target, and padding (row ``2**31 - 1``, dropped) gets its
    position as column. That makes ``unique_indices=True`` a true promise."""
    import jax.numpy as jnp

    if packed.expanded:
        # The host expanded every value's target: the scatter a JAX user writes, with
        # nothing computed on the device first.
        rows, cols = packed.element_rows, packed.element_cols
    else:
        rows, cols = _element_indices(packed, platform)
    position = jnp.arange(rows.shape[0], dtype=cols.dtype)
    return rows, jnp.where(rows == DROPPED_INDEX, position, cols)


def _element_indices(packed: PackedWrites, platform: str) -> tuple[Any, Any]:
    """Inside ``jit``: every value's target row and column, computed from the write columns
    (what the host writes into an expanded pack), ``2**31 - 1`` for padding."""
    import jax.numpy as jnp

    num_values = packed.num_values
    element = jnp.arange(num_values, dtype=jnp.int32)
    if packed.uniform:
        # Write i holds values [i * L, (i + 1) * L): a division, no search. H200, the
        # `jax.staged` bench (a GPU ring's packs of 16-value writes, 50 applies chained, device
        # time per apply, sampled round by round against plain JAX's a.at[r, c].set(v)):
        # 3.07 / 4.61 µs against 3.58 / 5.41 µs at 256 / 4,096 writes; with the search
        # below it was 1.05-1.11x plain JAX's at 4,096. Values past the last write land on
        # padding (length 0) or, clamped, past the last write's end: dropped either way.
        length = jnp.maximum(packed.lengths[0], 1)
        write = jnp.minimum(element // length, packed.num_writes - 1)
        within = element - write * length
        valid = within < packed.lengths[write]
        return (
            jnp.where(valid, packed.rows[write], DROPPED_INDEX),
            jnp.where(valid, packed.starts[write] + within, DROPPED_INDEX),
        )
    # The write holding each value: the last write whose offset is <= it, i.e. the number of
    # offsets <= it minus one (offsets are non-decreasing; empty writes share their offset
    # with the next one and are skipped). Counted the way each platform does fastest
    # (H200, 50 applies chained, per apply at 256 / 4,096 writes: an unrolled binary search
    # 2.66 / 3.06 µs, a prefix sum of marks 3.87 / 3.41 µs, plain JAX's scatter from host
    # indices 2.49 / 3.06 µs); on the CPU the search, a dozen gathers over every value, made
    # the apply 2.5x slower than the prefix sum.
    if platform == "gpu":
        write = jnp.searchsorted(packed.offsets, element, side="right", method="scan_unrolled")
        write = write.astype(jnp.int32) - 1
    else:
        marks = jnp.zeros(num_values, jnp.int32).at[packed.offsets].add(1, mode="drop")
        write = jnp.cumsum(marks) - 1
    # One gather of each value's write (row, start, offset, length) instead of four.
    table = jnp.stack([packed.rows, packed.starts, packed.offsets, packed.lengths], axis=1)
    row, start, offset, length = table[jnp.maximum(write, 0)].T
    within = element - offset
    valid = (write >= 0) & (within < length)
    return (
        jnp.where(valid, row, DROPPED_INDEX),
        jnp.where(valid, start + within, DROPPED_INDEX),
    )


#: The ``method`` values of :func:`apply_staged_writes`.
METHODS = ("triton", "scatter", "pallas")


def _platform(array) -> str:
    """``"gpu"`` (CUDA or ROCm) or JAX's platform name for where ``array`` lives; while
    tracing, the default backend's (``jit`` compiles for it unless its arguments are
    committed elsewhere)."""
    import jax

    if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer):
        platform = next(iter(array.devices())).platform
    else:
        platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _triton_unavailable_reason() -> str | None:
    """Why ``method="triton"`` cannot run in this process (None when it can)."""
    try:
        from ._jax_triton import jax_triton_unavailable_reason
    except ImportError as error:
        if not (getattr(error, "name", None) or "").startswith("triton"):
            raise
        return f"Triton is not installed ({error})"
    return jax_triton_unavailable_reason()


def apply_staged_writes(
    array, packed: PackedWrites, *, method: str | None = None, interpret: bool | None = None
):
    """Return ``array`` with ``packed``'s writes applied; jit-able, traced once per bucket.

    ``method``:

    * ``"triton"``: the Triton staged-write kernel through ``jax_triton``
      (:mod:`jaxbuf.staged._jax_triton`), GPU only. ``array`` is aliased to the
      result, so a donated array is updated in place.
    * ``"scatter"``: ``array.at[rows, cols].set(..., mode="drop")``, an XLA scatter; every
      platform (the CPU's path).
    * ``"pallas"``: the Pallas kernel on Pallas's Triton backend, which JAX 0.11 deprecates;
      kept for comparison, never chosen by default. ``interpret`` defaults to True except on
      a GPU backend.
    * ``None`` (default): ``"scatter"``, on every platform. Chosen by the numbers: on an
      H200 the scatter's device time per apply over a GPU ring's packs (3.07 / 4.61 µs at
      256 / 4,096 writes of 16 int32, in a chain of 50) is below plain JAX's
      ``a.at[r, c].set(v)`` (3.58 / 5.41 µs, same run), while the Triton kernel's is 7.3 /
      9.5 µs: XLA records its fusions into CUDA graphs but launches a ``jax_triton`` custom
      call from the host, one at a time. The scatter promises XLA unique indices (the
      packer resolved every overlap). A donated array is updated in place by either.

    Raises TypeError unless ``array`` is a 2-D ``jax.Array`` (or a tracer) of the pack's
    dtype, ValueError when it is smaller than the shape the writes were staged for
    (:attr:`PackedWrites.shape`: writes outside it would be lost), for an unknown method, and
    for ``"triton"`` off the GPU or with ``interpret``; ImportError naming what is missing
    when ``"triton"`` cannot run here.
    """
    import jax

    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    if not isinstance(packed, PackedWrites):
        raise TypeError(
            f"packed must be a PackedWrites (StagedWrites.pack, pack_writes), got {packed!r}"
        )
    check_array(array, packed.dtype, packed.shape)
    if method is None or method == "scatter":
        return _apply_scatter(array, packed)
    if method == "triton":
        if interpret:
            raise ValueError(
                "method='triton' has no interpreter; use method='scatter' (or "
                "'pallas' with interpret=True)"
            )
        platform = _platform(array)
        if platform != "gpu":
            raise ValueError(
                f"method='triton' runs on a GPU, but the array is on {platform}; "
                "use method='scatter' (the default there)"
            )
        reason = _triton_unavailable_reason()
        if reason is not None:
            raise ImportError(f"apply_staged_writes(method='triton') is unavailable: {reason}")
        from ._jax_triton import apply_packed_writes

        return apply_packed_writes(array, packed)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _apply_pallas(array, packed, interpret)


def check_array(array: Any, dtype: np.dtype, shape: tuple[int, int] | None) -> None:
    """Raise unless ``array`` can take writes of ``dtype`` staged for ``shape`` (None: any):
    a 2-D ``jax.Array`` (a tracer is one) of that dtype, at least that shape. What
    :func:`apply_staged_writes` checks, and :meth:`~jaxbuf.jax_ops.PackRing.apply` checks
    before it packs (so a refused array leaves the writes staged)."""
    import jax

    ndim = getattr(array, "ndim", None)
    if ndim is not None and ndim != 2:
        raise ValueError(f"array must be 2-D, got shape {tuple(array.shape)}")
    if not isinstance(array, jax.Array):
        raise TypeError(
            f"array must be a jax.Array (a 2-D JAX array, or a tracer inside jit), got "
            f"{type(array).__module__}.{type(array).__qualname__}"
        )
    if array.dtype != dtype:
        raise TypeError(f"packed values are {dtype}, array is {array.dtype}")
    if shape is not None and (array.shape[0] < shape[0] or array.shape[1] < shape[1]):
        raise ValueError(
            f"array of shape {tuple(array.shape)} is smaller than the shape {tuple(shape)} "
            "the writes were staged for: writes outside it would be lost"
        )
