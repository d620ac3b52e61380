"""A KV cache's layout over a buffer, and one side's block addresses among its registrations.

:class:`KVLayout` is the public value (block size, segments); :class:`BlockTable` is what an
endpoint computes from it at one epoch of a side: which blocks lie inside one registered piece
(the prepared-list fast path) and where the others must be cut (:func:`split_pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxbuf._checks import as_int

__all__ = ["BlockTable", "KVLayout", "block_ids", "bounds", "describe", "split_pairs"]


@dataclass(frozen=True)
class KVLayout:
    """Blocks of ``block_bytes`` bytes from the start of each of ``segments`` (segment
    indices of the buffer; default all of them, in order)."""

    block_bytes: int
    segments: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        block_bytes = as_int(self.block_bytes, "block_bytes")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        object.__setattr__(self, "block_bytes", block_bytes)
        if self.segments is not None:
            segments = tuple(as_int(s, "segment") for s in self.segments)
            if not segments or len(set(segments)) != len(segments):
                raise ValueError(f"segments must be distinct and non-empty, got {segments}")
            object.__setattr__(self, "segments", segments)

    def segments_of(self, tensor: Any) -> tuple[int, ...]:
        count = tensor.num_segments
        segments = tuple(range(count)) if self.segments is None else self.segments
        for segment in segments:
            if not 0 <= segment < count:
                raise IndexError(f"segment {segment} out of range for {count} segment(s)")
        return segments


class BlockTable:
    """One side's block addresses at one epoch: per layout segment, the committed blocks and
    where each lies among the registered pieces.

    ``whole[s][b]`` is block ``b`` of layout segment ``s``'s row in :attr:`rows` (the
    descriptors to prepare: address, nbytes, device id) when the block lies inside one
    piece, else -1 (it crosses a boundary, or is not registered: :meth:`cut` tells which).
    """

    def __init__(
        self,
        base: int,
        offsets: Sequence[int],
        committed: Sequence[int],
        block_bytes: int,
        ranges: Sequence[tuple[int, int]],
        device_id: int,
    ) -> None:
        self.base, self.block_bytes, self.device_id = base, block_bytes, device_id
        self.offsets = list(offsets)
        self.num_blocks = [size // block_bytes for size in committed]
        starts = np.array([start for start, _ in ranges], dtype=np.int64)
        ends = np.array([start + nbytes for start, nbytes in ranges], dtype=np.int64)
        self.starts, self.ends = starts, ends
        self.whole: list[np.ndarray] = []
        rows, count = [], 0
        for offset, blocks in zip(self.offsets, self.num_blocks):
            block_starts = offset + np.arange(blocks, dtype=np.int64) * block_bytes
            piece = np.searchsorted(starts, block_starts, side="right") - 1
            inside = (piece >= 0) & (block_starts + block_bytes <= ends[np.maximum(piece, 0)])
            index = np.full(blocks, -1, dtype=np.int64)
            index[inside] = np.arange(count, count + int(inside.sum()))
            count += int(inside.sum())
            self.whole.append(index)
            chosen = block_starts[inside]
            segment_rows = np.empty((len(chosen), 3), dtype=np.uint64)
            segment_rows[:, 0] = base + chosen
            segment_rows[:, 1] = block_bytes
            segment_rows[:, 2] = device_id
            rows.append(segment_rows)
        self.rows = np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.uint64)
        # The same indices as Python lists: a transfer of a few blocks looks them up without
        # numpy's per-call overhead (microseconds, on a path whose NIXL calls take ~10 us).
        self.whole_lists = [index.tolist() for index in self.whole]

    def check_blocks(self, blocks: np.ndarray, side: str, segments: list[int]) -> None:
        """IndexError naming the first block id outside what each of ``segments`` (layout
        positions) committed."""
        limit = min(self.num_blocks[s] for s in segments)
        low, high = bounds(blocks)
        if low < 0 or high >= limit:
            bad = int(blocks[(blocks < 0) | (blocks >= limit)][0])
            raise IndexError(
                f"{side} block {bad} is out of range: {limit} block(s) of {self.block_bytes} "
                f"bytes are committed in each segment transferred there (committed blocks per "
                f"segment: {self.num_blocks})"
            )

    def prepared_indices(
        self, blocks: np.ndarray, side: str, segments: list[int]
    ) -> list[int] | np.ndarray | None:
        """The rows of ``blocks`` in :attr:`rows`, segment after segment (what
        ``make_prepped_xfer`` selects), or None when a block crosses a registration boundary
        (the caller cuts the descriptors instead); IndexError naming the first block out of
        range, as :meth:`check_blocks`."""
        if len(segments) == 1 and len(blocks) <= _SHORT_LIST:
            whole = self.whole_lists[segments[0]]
            listed = blocks.tolist()
            if min(listed) < 0 or max(listed) >= len(whole):
                self.check_blocks(blocks, side, segments)  # raises, naming the block
            indices = [whole[b] for b in listed]
            return None if min(indices) < 0 else indices
        self.check_blocks(blocks, side, segments)
        rows = [self.whole[s][blocks] for s in segments]
        index = np.concatenate(rows) if len(rows) > 1 else rows[0]
        return index if bounds(index)[0] >= 0 else None

    def cuts(self, segment: int, block: int, side: str) -> list[int]:
        """Offsets inside block ``block`` of layout segment ``segment`` where a registered
        piece ends, plus 0 and ``block_bytes``; ValueError naming the block when part of it
        is not registered."""
        start = self.offsets[segment] + block * self.block_bytes
        end = start + self.block_bytes
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        cuts, cursor = [0], start
        while cursor < end:
            if i < 0 or i >= len(self.starts) or not self.starts[i] <= cursor < self.ends[i]:
                raise ValueError(
                    f"{side} block {block} of segment {segment} (bytes [{start}, {end})) is not "
                    f"all registered: byte {cursor} lies in no registration"
                )
            cursor = min(int(self.ends[i]), end)
            cuts.append(cursor - start)
            i += 1
        return cuts


_SHORT_LIST = 16  # blocks up to which Python lists beat numpy indexing


def bounds(values: np.ndarray) -> tuple[int, int]:
    """``(min, max)`` of a non-empty 1-D array: in Python for the short lists a transfer
    usually has (two numpy reductions cost more than the list), in numpy beyond."""
    if len(values) <= 64:
        listed = values.tolist()
        return min(listed), max(listed)
    return int(values.min()), int(values.max())


def block_ids(blocks: Any, name: str) -> np.ndarray:
    if isinstance(blocks, np.ndarray) and blocks.dtype == np.int64 and blocks.ndim == 1:
        return blocks
    try:
        array = np.asarray(blocks)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a sequence of block ids, got {blocks!r}") from error
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a 1-D sequence of integer block ids, got {blocks!r}")
    return array.astype(np.int64, copy=False)


def describe(blocks: np.ndarray) -> str:
    shown = ", ".join(str(int(b)) for b in blocks[:8])
    more = f", ... ({len(blocks)} blocks)" if len(blocks) > 8 else ""
    return f"blocks [{shown}{more}]"


def split_pairs(
    local: BlockTable,
    remote: BlockTable,
    segments: list[int],
    local_blocks: np.ndarray,
    remote_blocks: np.ndarray,
    peer_name: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors of both sides for every (segment, block pair), each pair cut where a
    registration ends on either side; ValueError naming a block not all registered."""
    block_bytes = local.block_bytes
    local_rows: list[tuple[int, int, int]] = []
    remote_rows: list[tuple[int, int, int]] = []
    local_device, remote_device = local.device_id, remote.device_id
    for s in segments:
        for lb, rb in zip(local_blocks.tolist(), remote_blocks.tolist()):
            cuts = sorted(
                set(local.cuts(s, lb, "local")) | set(remote.cuts(s, rb, f"{peer_name}'s"))
            )
            local_start = local.base + local.offsets[s] + lb * block_bytes
            remote_start = remote.base + remote.offsets[s] + rb * block_bytes
            for low, high in zip(cuts, cuts[1:]):
                local_rows.append((local_start + low, high - low, local_device))
                remote_rows.append((remote_start + low, high - low, remote_device))
    return (
        np.array(local_rows, dtype=np.uint64),
        np.array(remote_rows, dtype=np.uint64),
    )
