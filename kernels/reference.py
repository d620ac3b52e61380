"""Numpy side of the staged-write kernels: table builders, overlap check, reference apply.

The table format is the one :mod:`jaxbuf.kernels.staged_write` documents: an int64 write table
``[W, 5]`` (``group, row, start, content_offset, length``; ``content_offset`` in bytes, the rest
in elements) and an int64 group table ``[G, 3]`` (``out_ptr, row_stride, elem_size``).
:func:`apply_staged_writes_numpy` applies them one write after another through raw addresses, so
later writes always win; it is the test oracle and the explicit fallback when Triton is missing.
:func:`resolve_later_wins` rewrites a table so that no two writes overlap (later wins): the
Python form of what the C stager (``jaxbuf/_staging.c``) does as writes are staged, used where
that extension is missing.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "WRITE_FIELDS",
    "GROUP_FIELDS",
    "CONTENT_ALIGNMENT",
    "make_write_table",
    "make_group_table",
    "pack_contents",
    "has_overlap",
    "resolve_later_wins",
    "address_of",
    "apply_staged_writes_numpy",
    "row_segments",
    "IntsAt",
    "StagedLaunch",
]


class StagedLaunch(NamedTuple):
    """One launch of the staged-write kernel over disjoint writes (one program per write, in
    any order): what every launcher of an apply takes. Addresses are device-visible (device
    memory or UVA-mapped pinned memory; host memory under the interpreter and the numpy
    reference)."""

    write_table: int  # address of the int64 [num_writes, 5] write table
    group_table: int  # address of the int64 [G, 3] group table
    contents: int  # address of the values' bytes (CONTENT_ALIGNMENT-aligned)
    num_writes: int  # rows of the write table to apply


WRITE_FIELDS = ("group", "row", "start", "content_offset", "length")
GROUP_FIELDS = ("out_ptr", "row_stride", "elem_size")
# Contents buffers must start on this boundary so an 8-byte element at an aligned offset is
# itself aligned (misaligned 8-byte loads fault on the GPU).
CONTENT_ALIGNMENT = 8
_ELEM_SIZES = (1, 2, 4, 8)


def make_write_table(groups, rows, starts, content_offsets, lengths) -> np.ndarray:
    """Stack the per-write fields into a C-contiguous int64 ``[W, 5]`` table."""
    columns = [
        np.asarray(c, dtype=np.int64).reshape(-1)
        for c in (groups, rows, starts, content_offsets, lengths)
    ]
    num_writes = columns[0].shape[0]
    for name, column in zip(WRITE_FIELDS, columns):
        if column.shape[0] != num_writes:
            raise ValueError(
                f"write field {name!r} has {column.shape[0]} entries, expected {num_writes}"
            )
    return (
        np.ascontiguousarray(np.stack(columns, axis=1))
        if num_writes
        else np.zeros((0, 5), np.int64)
    )


def make_group_table(out_ptrs, row_strides, elem_sizes) -> np.ndarray:
    """Stack the per-group fields into a C-contiguous int64 ``[G, 3]`` table."""
    columns = [
        np.asarray(c, dtype=np.int64).reshape(-1) for c in (out_ptrs, row_strides, elem_sizes)
    ]
    for name, column in zip(GROUP_FIELDS, columns):
        if column.shape[0] != columns[0].shape[0]:
            raise ValueError(
                f"group field {name!r} has {column.shape[0]} entries, "
                f"expected {columns[0].shape[0]}"
            )
    bad = ~np.isin(columns[2], _ELEM_SIZES)
    if bad.any():
        raise ValueError(f"elem_size must be one of {_ELEM_SIZES}, got {columns[2][bad][0]}")
    return np.ascontiguousarray(np.stack(columns, axis=1))


def pack_contents(values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the raw bytes of ``values`` into one uint8 buffer.

    Returns ``(contents, content_offsets)``: each array starts at a byte offset that is a
    multiple of its itemsize, and ``contents`` itself is 8-byte aligned.
    """
    for value in values:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"values must be numpy arrays, got {value!r}")
    offsets = np.zeros(len(values), dtype=np.int64)
    total = 0
    for i, value in enumerate(values):
        itemsize = value.dtype.itemsize
        total = -(-total // itemsize) * itemsize
        offsets[i] = total
        total += value.nbytes
    # Over-allocate by the alignment and slice so the start is aligned whatever numpy gave us.
    raw = np.zeros(total + CONTENT_ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % CONTENT_ALIGNMENT
    contents = raw[shift : shift + total]
    for offset, value in zip(offsets, values):
        contents[offset : offset + value.nbytes] = (
            np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        )
    return contents, offsets


def has_overlap(groups, rows, starts, lengths) -> bool:
    """Whether two non-empty writes touch the same element of the same group's row.

    O(W log W): sort by (group, row, start); with sorted starts, a write overlaps some later
    write exactly when it overlaps the next one in its row, so comparing neighbours suffices.
    """
    groups, rows, starts, lengths = (
        np.asarray(a, dtype=np.int64).reshape(-1) for a in (groups, rows, starts, lengths)
    )
    if not groups.shape == rows.shape == starts.shape == lengths.shape:
        raise ValueError(
            f"groups, rows, starts and lengths differ in length: {groups.shape[0]}, "
            f"{rows.shape[0]}, {starts.shape[0]}, {lengths.shape[0]}"
        )
    keep = lengths > 0  # an empty write touches nothing
    groups, rows, starts, lengths = groups[keep], rows[keep], starts[keep], lengths[keep]
    if groups.shape[0] < 2:
        return False
    order = np.lexsort((starts, rows, groups))
    groups, rows, starts, ends = (
        groups[order],
        rows[order],
        starts[order],
        starts[order] + lengths[order],
    )
    same_row = (groups[1:] == groups[:-1]) & (rows[1:] == rows[:-1])
    return bool(np.any(same_row & (ends[:-1] > starts[1:])))


def resolve_later_wins(write_table: np.ndarray, elem_sizes: Any = None) -> np.ndarray:
    """An equivalent write table in which no two writes overlap: where writes overlap, the
    later one (in table order) wins.

    A write that later writes hide entirely is dropped; one they hide in part is replaced by
    its visible pieces, in place and in start order, each an ordinary entry (same group and
    row, its own start and length, ``content_offset`` moved by ``(piece start - start) *
    elem_size``). Other writes are kept as they are, in order. ``elem_sizes[group]`` is the
    element size in bytes of each group (default 1: offsets counted in elements). Applying the
    result in any order equals applying ``write_table`` in order. Returns ``write_table``
    itself when no row is written twice.

    The Python form of the C stager's resolution (``jaxbuf/_staging.c``): rows written once
    cost a sort, each repeated row's writes a walk from the newest, keeping the covered
    intervals. A fallback; the hot paths run the C one.
    """
    table = np.asarray(write_table)
    if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != 5:
        raise ValueError(f"write_table must be int64 [W, 5], got {table.dtype} {list(table.shape)}")
    if table.shape[0] < 2:
        return table
    order = np.lexsort((table[:, 1], table[:, 0]))  # stable: each row's writes stay in order
    keys = table[order, :2]
    same_as_next = np.all(keys[1:] == keys[:-1], axis=1)
    if not same_as_next.any():
        return table
    run_bounds = np.flatnonzero(np.diff(np.concatenate(([False], same_as_next, [False]))))
    replacements: dict[int, list[tuple[int, int]]] = {}
    for first, last in zip(run_bounds[0::2].tolist(), run_bounds[1::2].tolist()):
        covered_starts: list[int] = []  # sorted, disjoint intervals [start, end)
        covered_ends: list[int] = []
        for write in reversed(order[first : last + 1].tolist()):  # newest first
            _, _, start, _, length = table[write].tolist()
            end = start + length
            if length <= 0:
                replacements[write] = []
                continue
            lo = bisect.bisect_left(covered_ends, start)  # first interval that may touch it
            pieces, position, j = [], start, lo
            while j < len(covered_starts) and covered_starts[j] <= end:
                if covered_starts[j] > position:
                    pieces.append((position, covered_starts[j] - position))
                position = max(position, covered_ends[j])
                j += 1
            if position < end:
                pieces.append((position, end - position))
            if pieces != [(start, length)]:
                replacements[write] = pieces
            merged_start = min(start, covered_starts[lo]) if lo < j else start
            merged_end = max(end, covered_ends[j - 1]) if lo < j else end
            covered_starts[lo:j] = [merged_start]
            covered_ends[lo:j] = [merged_end]
    if not replacements:
        return table
    counts = np.ones(table.shape[0], np.int64)
    for write, pieces in replacements.items():
        counts[write] = len(pieces)
    resolved = np.repeat(table, counts, axis=0)
    firsts = np.cumsum(counts) - counts
    sizes = None if elem_sizes is None else np.asarray(elem_sizes, np.int64).reshape(-1)
    for write, pieces in replacements.items():
        group, _, start, offset, _ = table[write].tolist()
        elem_size = 1 if sizes is None else int(sizes[group])
        for k, (piece_start, piece_length) in enumerate(pieces):
            entry = resolved[firsts[write] + k]
            entry[2] = piece_start
            entry[3] = offset + (piece_start - start) * elem_size
            entry[4] = piece_length
    return resolved


def address_of(obj: Any) -> int:
    """The address behind ``obj``: an int, a C-contiguous numpy array, or anything with
    ``data_ptr()`` (torch tensors, jaxbuf views)."""
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("numpy arrays passed by address must be C-contiguous")
        return int(obj.ctypes.data)
    if hasattr(obj, "data_ptr"):
        return int(obj.data_ptr())
    raise TypeError(
        f"cannot take the address of {type(obj).__name__}; pass an int address, "
        "a numpy array or an object with data_ptr()"
    )


def _check_tables(write_table: np.ndarray, group_table: np.ndarray) -> None:
    for name, table, width in (("write_table", write_table, 5), ("group_table", group_table, 3)):
        if not isinstance(table, np.ndarray):
            raise TypeError(f"{name} must be a numpy array, got {type(table).__name__}")
        if table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != width:
            raise ValueError(
                f"{name} must be int64 [N, {width}], got {table.dtype} {list(table.shape)}"
            )
        if not table.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")


def apply_staged_writes_numpy(
    write_table: np.ndarray, group_table: np.ndarray, contents: Any, num_writes: int | None = None
) -> None:
    """Apply the first ``num_writes`` rows of ``write_table`` in order; later writes win.

    Tables are host numpy arrays; ``contents`` is a numpy array or an int address; targets are
    written through the raw ``out_ptr`` addresses, so they must be host-addressable memory.
    """
    _check_tables(write_table, group_table)
    if num_writes is None:
        num_writes = write_table.shape[0]
    if not 0 <= num_writes <= write_table.shape[0]:
        raise ValueError(f"num_writes {num_writes} outside [0, {write_table.shape[0]}]")
    contents_addr = address_of(contents)
    for group, row, start, content_offset, length in write_table[:num_writes].tolist():
        if length <= 0:
            continue
        out_ptr, row_stride, elem_size = group_table[group].tolist()
        ctypes.memmove(
            out_ptr + (row * row_stride + start) * elem_size,
            contents_addr + content_offset,
            length * elem_size,
        )


def row_segments(write_table: np.ndarray) -> np.ndarray:
    """Reorder ``write_table`` in place so writes to one target row are adjacent, keeping their
    order (a stable sort on ``(group, row)``), and return the int64 ``[S + 1]`` bounds of the
    runs of equal ``(group, row)``: the ``segments`` of a serial launch, in which writes that
    may overlap run in order and different rows still run in parallel."""
    order = np.lexsort((write_table[:, 1], write_table[:, 0]))  # lexsort is stable
    write_table[:] = write_table[order]
    keys = write_table[:, :2]
    starts = np.flatnonzero(np.any(keys[1:] != keys[:-1], axis=1)) + 1
    return np.concatenate(([0], starts, [write_table.shape[0]])).astype(np.int64)


class IntsAt:
    """``length`` int64 values at ``address`` (host or device): what the launchers need of an
    array (``shape``, ``data_ptr()``) when only its address is known."""

    def __init__(self, address: int, length: int) -> None:
        self.shape = (length,)
        self._address = address

    def data_ptr(self) -> int:
        return self._address
