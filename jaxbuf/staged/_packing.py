"""Packing an apply into a staging slot: the C packer, and the same layout in numpy.

A :class:`~jaxbuf.FusedStagedWriter` chooses one packer when it is made
(:func:`new_packer`): :class:`CPacker` (``jaxbuf._staging.pack``, one C call) when the
extension is built, else :class:`NumpyPacker`. Both lay an apply out the same way in the slot's
pinned memory, which the kernel then reads in place:

1. the group table: ``(out_ptr, row_stride, elem_size)`` per tensor, from the writer's layout;
2. the write table: every tensor's staged writes in turn, *resolved* (no two overlap: where
   writes overlap, later ones hide earlier ones, which are dropped or split into their visible
   pieces), with the group id and the byte offset of the values filled in;
3. every tensor's values as staged (hidden parts included), each tensor's at an offset aligned
   to its element size.

Because no two entries overlap, the kernel applies them in any order, one program per entry,
and the result is the in-order result. The C packer finds overlaps through the row index the
C stager keeps as writes are staged (no sort); the numpy packer with
:func:`jaxbuf.kernels.resolve_later_wins` (a sort, then Python over repeated rows: a fallback).
A packer allocates nothing: when the slot is too small ``pack`` writes nothing and reports the
size, and the writer grows the slot and packs again. Once the launch is enqueued the writer
calls ``clear``, which drops the staged writes that the last ``pack`` laid out.

A packer gets the tensors of an apply and sees each only through ``tensor.staging`` (its
:class:`~jaxbuf.staged._host.StagingState`), a slot only through ``host`` (its host address),
``capacity`` (bytes) and ``i64`` (an int64 numpy view of it), and the layout through its group
table and item sizes (``jaxbuf.staged._fused._Layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..kernels.reference import resolve_later_wins
from ._host import GROUP_FIELDS, RECORD_BYTES, WRITE_FIELDS, StagingState, c_clear, c_pack

__all__ = ["CPacker", "NumpyPacker", "new_packer"]


class CPacker:
    """Packs with ``jaxbuf._staging.pack`` and clears with ``jaxbuf._staging.clear``."""

    __slots__ = ("_stagers",)

    def __init__(self) -> None:
        self._stagers: list | None = None

    def pack(
        self, tensors: Sequence[Any], staged_bytes: Sequence[int], layout: Any, slot: Any
    ) -> tuple[int, int, int]:
        """Fill ``slot``; ``(num_writes, contents_start, total_bytes)``, ``num_writes`` the
        resolved entries. Nothing is written when ``total_bytes > slot.capacity``: grow the
        slot and pack again."""
        stagers = self._stagers = [t.staging.stager for t in tensors]
        return c_pack(stagers, layout.group_bytes, slot.host, slot.capacity)

    def clear(self) -> None:
        """Drop the staged writes the last :meth:`pack` laid out (its launch is enqueued)."""
        stagers, self._stagers = self._stagers, None
        c_clear(stagers)


class NumpyPacker:
    """The same layout as :class:`CPacker`, in numpy (builds without the C extension)."""

    __slots__ = ("_states",)

    def __init__(self) -> None:
        self._states: Sequence[StagingState] = ()

    def pack(
        self, tensors: Sequence[Any], staged_bytes: Sequence[int], layout: Any, slot: Any
    ) -> tuple[int, int, int]:
        states = [t.staging for t in tensors]
        num_groups = len(states)
        bases, contents_bytes = _content_bases(states, layout)
        staged = _staged_table(states, staged_bytes, layout, bases)
        table = resolve_later_wins(staged, layout.itemsizes)
        num_writes = table.shape[0]
        contents_start = (num_groups * GROUP_FIELDS + num_writes * WRITE_FIELDS) * 8
        total = contents_start + contents_bytes
        if total > slot.capacity:
            return num_writes, contents_start, total
        self._states = states
        i64 = slot.i64
        table_start = num_groups * GROUP_FIELDS
        i64[:table_start] = layout.group_table
        i64[table_start : table_start + num_writes * WRITE_FIELDS] = table.reshape(-1)
        u8 = i64.view(np.uint8)
        for state, base in zip(states, bases):
            # A view of a staging buffer lives only inside this statement: a buffer with a
            # live export cannot grow, and the next stage_write must.
            at = contents_start + base
            u8[at : at + len(state.contents)] = np.frombuffer(state.contents, np.uint8)
        return num_writes, contents_start, total

    def clear(self) -> None:
        states, self._states = self._states, ()
        for state in states:
            state.clear()


def new_packer() -> CPacker | NumpyPacker:
    """The C packer when ``jaxbuf._staging`` is built, else the numpy one."""
    return CPacker() if c_pack is not None else NumpyPacker()


def _content_bases(states: Sequence[StagingState], layout: Any) -> tuple[list[int], int]:
    """Each tensor's values' offset in the contents region (aligned to its element size), and
    the region's size: what ``_staging.pack`` computes in C."""
    bases, offset = [], 0
    for state, itemsize in zip(states, layout.itemsize_list):
        aligned = -(-offset // itemsize) * itemsize
        bases.append(aligned)
        offset = aligned + len(state.contents)
    return bases, offset


def _staged_table(
    states: Sequence[StagingState], staged_bytes: Sequence[int], layout: Any, bases: list[int]
) -> np.ndarray:
    """The staged writes as one write table, in order, before resolution: group ids and byte
    offsets into the contents region filled in."""
    counts = [n // RECORD_BYTES for n in staged_bytes]
    # np.concatenate copies: the views of the staging buffers die with this statement.
    table = np.concatenate([np.frombuffer(state.records, np.int64) for state in states]).reshape(
        -1, WRITE_FIELDS
    )
    table[:, 0] = np.repeat(layout.group_ids, counts)
    byte_lengths = table[:, 4] * np.repeat(layout.itemsizes, counts)
    ends = np.cumsum(byte_lengths) + np.repeat(
        np.array(bases, np.int64) - np.array(_unpadded_starts(states), np.int64), counts
    )
    table[:, 3] = ends - byte_lengths
    return table


def _unpadded_starts(states: Sequence[StagingState]) -> list[int]:
    """Where each tensor's values would start were the contents packed without padding."""
    starts, offset = [], 0
    for state in states:
        starts.append(offset)
        offset += len(state.contents)
    return starts
