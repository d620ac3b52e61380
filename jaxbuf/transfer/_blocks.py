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

__all__ = [
    "MAX_PREPARED_ROWS",
    "BlockTable",
    "KVLayout",
    "block_ids",
    "bounds",
    "check_block_range",
    "describe",
    "split_pairs",
]

MAX_PREPARED_ROWS = 1 << 20
"""Blocks (of all segments) up to which a side's table prepares a descriptor list: bounds
what a peer's claims cost (24 bytes of descriptor and 8 of index a block)."""


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
            if isinstance(self.segments, (str, bytes)) or not isinstance(self.segments, Sequence):
                raise TypeError(
                    f"segments must be a sequence of segment indices, got {self.segments!r}"
                )
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

    Registered pieces are kept as runs: the blocks of a segment that lie inside one piece
    form one run, so building a table costs O(pieces + segments + prepared rows), never
    O(committed blocks): committed blocks outside every piece (a peer may claim terabytes)
    cost nothing. When the runs hold at most ``max_rows`` blocks in all (counted up to the
    last registered block of each segment), :attr:`rows` lists them (the descriptors to
    prepare: address, nbytes, device id) and ``whole[s][b]`` is block ``b`` of layout
    segment ``s``'s row, or -1 (the block crosses a boundary, or is not registered:
    :meth:`cuts` tells which); a block at or past ``len(whole[s])`` is not registered.
    Beyond ``max_rows`` nothing is prepared (:attr:`prepared` is False) and every transfer
    is built by hand, at a cost proportional to the blocks it moves.
    """

    def __init__(
        self,
        base: int,
        offsets: Sequence[int],
        committed: Sequence[int],
        block_bytes: int,
        ranges: Any,
        device_id: int,
        max_rows: int = MAX_PREPARED_ROWS,
    ) -> None:
        self.base, self.block_bytes, self.device_id = base, block_bytes, device_id
        self.offsets = list(offsets)
        self.num_blocks = [size // block_bytes for size in committed]
        pieces = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        self.starts = pieces[:, 0]
        self.ends = pieces[:, 0] + pieces[:, 1]
        runs = [self._runs(offset, blocks) for offset, blocks in zip(self.offsets, self.num_blocks)]
        spans = [int(ends[-1]) if len(ends) else 0 for _, ends in runs]
        self.prepared = sum(spans) <= max_rows
        self.min_span = min(spans, default=0)  # blocks below it are listed in every segment
        self.whole: list[np.ndarray] = []
        self.whole_lists: list[Any] = []
        self.rows = np.empty((0, 3), dtype=np.uint64)
        if not self.prepared:
            return
        rows, count = [], 0
        for offset, (firsts, ends), span in zip(self.offsets, runs, spans):
            lengths = ends - firsts
            total = int(lengths.sum())
            # The block ids of every run, one after another, without a Python loop.
            chosen = np.arange(total, dtype=np.int64) + np.repeat(
                firsts - (np.cumsum(lengths) - lengths), lengths
            )
            index = np.full(span, -1, dtype=np.int64)
            index[chosen] = np.arange(count, count + total)
            count += total
            self.whole.append(index)
            segment_rows = np.empty((total, 3), dtype=np.uint64)
            segment_rows[:, 0] = base + offset + chosen * block_bytes
            segment_rows[:, 1] = block_bytes
            segment_rows[:, 2] = device_id
            rows.append(segment_rows)
        if rows:
            self.rows = np.concatenate(rows)
        # The same indices for a transfer of a few blocks, looked up without numpy's per-call
        # overhead (microseconds, on a path whose NIXL calls take ~10 us): Python lists while
        # small, else memoryviews of the arrays (no copy, a little slower to index).
        small = sum(spans) <= _LISTED_BLOCKS
        self.whole_lists = [index.tolist() if small else memoryview(index) for index in self.whole]

    def _runs(self, offset: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """``(firsts, ends)``: the runs of blocks of a segment at ``offset`` with ``blocks``
        committed blocks that lie inside one registered piece each, ``[first, end)``."""
        block_bytes = self.block_bytes
        low = int(np.searchsorted(self.ends, offset, side="right"))
        high = int(np.searchsorted(self.starts, offset + blocks * block_bytes, side="left"))
        starts, ends = self.starts[low:high] - offset, self.ends[low:high] - offset
        firsts = np.maximum(-(-starts // block_bytes), 0)  # the first block starting inside
        lasts = np.minimum(ends // block_bytes, blocks)  # past the last block ending inside
        keep = lasts > firsts
        return firsts[keep], lasts[keep]

    def check_blocks(self, blocks: np.ndarray, side: str, segments: list[int]) -> int:
        """IndexError naming the first block id outside what each of ``segments`` (layout
        positions) committed (:func:`check_block_range`); else the highest block id."""
        limit = min(self.num_blocks[s] for s in segments)
        return check_block_range(blocks, limit, side, self.block_bytes)

    def prepared_indices(
        self, blocks: np.ndarray, side: str, segments: list[int]
    ) -> list[int] | np.ndarray | None:
        """The rows of ``blocks`` in :attr:`rows`, segment after segment (what
        ``make_prepped_xfer`` selects), or None when a block is not in one registered piece
        or nothing is prepared (the caller cuts the descriptors instead); IndexError naming
        the first block out of range, as :meth:`check_blocks`."""
        if len(segments) == 1 and len(blocks) <= _SHORT_LIST and self.prepared:
            segment = segments[0]
            listed = blocks.tolist()
            high = max(listed)
            if min(listed) < 0 or high >= self.num_blocks[segment]:
                self.check_blocks(blocks, side, segments)  # raises, naming the block
            whole = self.whole_lists[segment]
            if high >= len(whole):
                return None
            indices = [whole[b] for b in listed]
            return None if min(indices) < 0 else indices
        high = self.check_blocks(blocks, side, segments)
        if not self.prepared:
            return None
        if high >= self.min_span and any(high >= len(self.whole[s]) for s in segments):
            return None
        rows = [self.whole[s][blocks] for s in segments]
        index = np.concatenate(rows) if len(rows) > 1 else rows[0]
        return index if bounds(index)[0] >= 0 else None

    def cuts(self, segment: int, block: int, side: str) -> list[int]:
        """Offsets inside block ``block`` of layout segment ``segment`` where a registered
        piece ends, plus 0 and ``block_bytes``; ValueError naming the block and the side when
        part of it is not registered."""
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
_LISTED_BLOCKS = 1 << 18  # blocks up to which a table also keeps its indices as Python lists


def bounds(values: np.ndarray) -> tuple[int, int]:
    """``(min, max)`` of a non-empty 1-D array: in Python for the short lists a transfer
    usually has (two numpy reductions cost more than the list), in numpy beyond."""
    if len(values) <= 64:
        listed = values.tolist()
        return min(listed), max(listed)
    return int(values.min()), int(values.max())


def block_ids(blocks: Any, name: str) -> np.ndarray:
    """``blocks`` as a 1-D int64 array; TypeError for what is not a sequence of integer ids,
    IndexError naming an id beyond int64 as given (never wrapped around)."""
    if isinstance(blocks, np.ndarray) and blocks.dtype == np.int64 and blocks.ndim == 1:
        return blocks
    try:
        array = np.asarray(blocks)
    except (TypeError, ValueError, OverflowError) as error:
        raise TypeError(f"{name} must be a sequence of block ids, got {blocks!r:.200}") from error
    if array.ndim == 0:
        array = array.reshape(1)
    if array.dtype == object and array.ndim == 1:  # Python ints beyond int64 land here
        for value in array.tolist():
            if type(value) is int or isinstance(value, np.integer):
                if not _INT64_MIN <= int(value) <= _INT64_MAX:
                    raise IndexError(f"{name}: block {value} is out of range (beyond int64)")
            else:
                break
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a 1-D sequence of integer block ids, got {blocks!r:.200}")
    if array.dtype == np.uint64 and array.size and int(array.max()) > _INT64_MAX:
        raise IndexError(f"{name}: block {int(array.max())} is out of range (beyond int64)")
    return array.astype(np.int64, copy=False)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_block_range(blocks: np.ndarray, limit: int, side: str, block_bytes: int) -> int:
    """The one range check of block ids: IndexError naming the first of ``blocks`` outside
    ``[0, limit)`` (``side``: "local" or the peer's name), else the highest id."""
    low, high = bounds(blocks)
    if low < 0 or high >= limit:
        bad = int(blocks[(blocks < 0) | (blocks >= limit)][0])
        whose = side if side == "local" else f"{side}'s"
        raise IndexError(
            f"{whose} block {bad} is out of range: {limit} block(s) of {block_bytes} bytes are "
            "committed (and mapped) in every segment transferred there"
        )
    return high


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
