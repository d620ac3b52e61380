"""Packing staged writes into the JAX wing's layout (:class:`~jaxbuf.jax_ops.PackedWrites`).

Packing is two steps, so that a packer owning its memory (a :class:`~jaxbuf.jax_ops.PackRing`)
can find room in between: :func:`plan_pack` resolves the staged writes (later wins, from the C
stager's row index, or :func:`jaxbuf.kernels.resolve_later_wins` without the extension) and
sizes the pack as a :class:`PackPlan`; :func:`write_pack` writes it into a host buffer of that
size. ``StagedWrites.plan_pack`` / ``StagedWrites.pack_into`` are the same two steps on one
object: the contract between a StagedWrites and whatever packs it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..kernels.reference import resolve_later_wins
from ._host import StagingState
from ._jax_packed import (
    DROPPED_INDEX,
    PALLAS_BLOCK_SIZE,
    PackedWrites,
    bucket_size,
    expand_elements,
    packed_words,
    register_pytree,
    uniform_layout,
    value_words,
)

__all__ = ["PackPlan", "Packer", "plan_pack", "write_pack"]


class Packer:
    """What ``StagedWrites.pack(ring=...)`` and ``pack_writes(..., ring=...)`` pack into: a
    packer that owns its memory (:class:`~jaxbuf.jax_ops.PackRing`, the one implementation).
    Declared here, below both, so that the staging side names the type it accepts without
    importing the ring."""

    __slots__ = ()

    def pack(self, staged: Any, *, clear: bool = True, expand: bool | None = None) -> PackedWrites:
        """``staged``'s writes packed into this packer's memory; a failure leaves them staged."""
        raise NotImplementedError

    def scratch_writes(self, arguments: tuple) -> Any:
        """A StagedWrites made with ``arguments`` (``new_staged_writes``'s), kept from call to
        call, that ``pack_writes`` stages a batch into; empty between calls."""
        raise NotImplementedError


class PackPlan(NamedTuple):
    """A pack sized by :func:`plan_pack`: ``num_writes`` resolved writes of ``total`` visible
    elements of ``dtype``, padded to ``write_bucket`` writes and ``content_bucket`` values;
    ``table`` is the resolved write table without the C extension (None with it)."""

    num_writes: int
    total: int
    write_bucket: int
    content_bucket: int
    dtype: np.dtype
    table: Any = None

    def words(self, expand: bool) -> int:
        """The int32 length of the buffer :func:`write_pack` fills."""
        return packed_words(self.write_bucket, self.content_bucket, self.dtype, expand)


def plan_pack(
    staging: StagingState, dtype: np.dtype, min_write_bucket: int, min_content_bucket: int
) -> PackPlan:
    """Resolve ``staging``'s writes (later wins) and size their pack; changes nothing staged.
    ValueError when the visible elements exceed the int32 index range."""
    stager = staging.stager
    table = None
    if stager is not None:
        num_writes, total = stager.resolve()
    else:
        table = _resolved_table(staging)
        num_writes, total = table.shape[0], int(table[:, 4].sum())
    write_bucket = bucket_size(num_writes, min_write_bucket)
    content_bucket = bucket_size(total, min_content_bucket) + PALLAS_BLOCK_SIZE
    if content_bucket >= DROPPED_INDEX:
        raise ValueError(f"{total} staged elements exceed the int32 index range")
    return PackPlan(num_writes, total, write_bucket, content_bucket, dtype, table)


def write_pack(
    staging: StagingState,
    plan: PackPlan,
    buffer: np.ndarray,
    expand: bool,
    shape: tuple[int, int] | None = None,
) -> PackedWrites:
    """Write the pack ``plan`` sized into ``buffer`` (host int32, ``plan.words(expand)``
    long, any contents: every word is written) and return a PackedWrites over it, for arrays
    of ``shape`` or larger (None: any). Nothing staged is cleared here."""
    register_pytree()
    write_bucket, num_values, dtype = plan.write_bucket, plan.content_bucket, plan.dtype
    columns = buffer[: 4 * write_bucket].reshape(4, write_bucket)
    value_bytes = buffer[4 * write_bucket : 4 * write_bucket + value_words(num_values, dtype)]
    value_bytes = value_bytes.view(np.uint8)
    if staging.stager is not None:
        staging.stager.write_columns(*columns, value_bytes)
    else:
        values = value_bytes[: num_values * dtype.itemsize].view(dtype)
        _write_columns_numpy(staging, plan.table, *columns, values)
    # The buffer is uninitialised: pad explicitly (see PackedWrites' invariants).
    num_writes, total = plan.num_writes, plan.total
    columns[:3, num_writes:] = 0
    columns[3, num_writes:] = total
    value_bytes[total * dtype.itemsize :] = 0
    if expand:
        packed = PackedWrites.from_buffer(
            buffer, write_bucket, num_values, dtype, True, False, shape
        )
        expand_elements(packed)
        return packed
    uniform = uniform_layout(columns[2], columns[3])
    return PackedWrites.from_buffer(buffer, write_bucket, num_values, dtype, False, uniform, shape)


def _resolved_table(staging: StagingState) -> np.ndarray:
    """Without the C extension: the staged writes as a write table (content offsets in
    elements), resolved by :func:`~jaxbuf.kernels.resolve_later_wins`."""
    table = np.frombuffer(staging.records, np.int64).reshape(-1, 5).copy()
    table[:, 3] = np.cumsum(table[:, 4]) - table[:, 4]
    return resolve_later_wins(table)


def _write_columns_numpy(staging, table, rows, starts, lengths, offsets, values) -> None:
    """``Stager.write_columns`` without the extension: visible values back to back."""
    n = table.shape[0]
    staged = np.frombuffer(staging.contents, values.dtype).copy()
    rows[:n], starts[:n], lengths[:n] = table[:, 1], table[:, 2], table[:, 4]
    packed_offsets = np.cumsum(table[:, 4]) - table[:, 4]
    offsets[:n] = packed_offsets
    total = int(table[:, 4].sum())
    source = np.repeat(table[:, 3] - packed_offsets, table[:, 4]) + np.arange(total)
    values[:total] = staged[source]
