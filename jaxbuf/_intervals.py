"""Sorted, merged half-open integer intervals: the committed-memory bookkeeping.

A reservation may hold a terabyte of 2 MiB granules, so committed state is kept as runs,
never as a per-granule set. Every query is a binary search plus work proportional to the
runs it touches: finding the gaps of a range costs O(log n + gaps), and recording a run
costs O(log n + runs merged) comparisons (plus one list splice, a memmove of pointers).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator


class IntervalSet:
    """A set of integers stored as sorted, disjoint, non-touching ``[start, end)`` runs.

    Invariants: ``_starts`` and ``_ends`` have equal length, and for every ``i``,
    ``_starts[i] < _ends[i] < _starts[i + 1]`` (runs that touch are merged into one);
    ``total`` is the summed length of all runs, maintained on every change.
    """

    __slots__ = ("_starts", "_ends", "_total")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._total: int = 0

    def __len__(self) -> int:
        """Number of runs."""
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(zip(self._starts, self._ends)))

    def __repr__(self) -> str:
        return f"IntervalSet({list(zip(self._starts, self._ends))})"

    @property
    def total(self) -> int:
        """Summed length of all runs."""
        return self._total

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self._total = 0

    def covers(self, start: int, end: int) -> bool:
        """Whether every integer of ``[start, end)`` is in the set (True when empty)."""
        if start >= end:
            return True
        i = bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The maximal sub-ranges of ``[start, end)`` not in the set, in order."""
        result: list[tuple[int, int]] = []
        if start >= end:
            return result
        starts, ends = self._starts, self._ends
        # First run that ends after `start`; runs before it cannot overlap the range.
        i = bisect_right(ends, start)
        cursor = start
        n = len(starts)
        while i < n and starts[i] < end:
            if starts[i] > cursor:
                result.append((cursor, starts[i]))
            cursor = max(cursor, ends[i])
            i += 1
        if cursor < end:
            result.append((cursor, end))
        return result

    def intersection(self, start: int, end: int) -> list[tuple[int, int]]:
        """The maximal sub-ranges of ``[start, end)`` in the set, in order."""
        result: list[tuple[int, int]] = []
        starts, ends = self._starts, self._ends
        i = bisect_right(ends, start)  # the first run that ends after `start`
        while i < len(starts) and starts[i] < end:
            result.append((max(starts[i], start), min(ends[i], end)))
            i += 1
        return result

    def _merge_span(self, start: int, end: int) -> tuple[int, int, int, int]:
        """Indices ``[lo, hi)`` of the runs that overlap or touch ``[start, end)`` and
        the bounds of their union with it."""
        lo = bisect_left(self._ends, start)  # first run with end >= start
        hi = bisect_right(self._starts, end)  # runs with start <= end
        if lo < hi:
            return lo, hi, min(start, self._starts[lo]), max(end, self._ends[hi - 1])
        return lo, hi, start, end

    def run_bounds(self, start: int, end: int) -> tuple[int, int]:
        """Bounds of the maximal run that would contain ``[start, end)`` once added."""
        _, _, run_start, run_end = self._merge_span(start, end)
        return run_start, run_end

    def add(self, start: int, end: int) -> tuple[int, int]:
        """Add ``[start, end)``; return the bounds of the merged run now containing it."""
        if start >= end:
            raise ValueError(f"empty or inverted interval [{start}, {end})")
        starts, ends = self._starts, self._ends
        if starts and start >= starts[-1]:
            # At or past the last run's start (a grow appends there): no search, no splice.
            last_end = ends[-1]
            if start > last_end:
                starts.append(start)
                ends.append(end)
                self._total += end - start
                return start, end
            if end > last_end:
                ends[-1] = end
                self._total += end - last_end
            return starts[-1], ends[-1]
        lo, hi, run_start, run_end = self._merge_span(start, end)
        absorbed = sum(e - s for s, e in zip(self._starts[lo:hi], self._ends[lo:hi]))
        self._starts[lo:hi] = [run_start]
        self._ends[lo:hi] = [run_end]
        self._total += (run_end - run_start) - absorbed
        return run_start, run_end

    def discard(self, start: int, end: int) -> None:
        """Remove ``[start, end)`` (any part not in the set is ignored)."""
        if start >= end:
            return
        lo = bisect_right(self._ends, start)  # first run ending after start
        hi = bisect_left(self._starts, end)  # runs starting before end
        if lo >= hi:
            return
        new_starts: list[int] = []
        new_ends: list[int] = []
        removed = 0
        for s, e in zip(self._starts[lo:hi], self._ends[lo:hi]):
            removed += min(e, end) - max(s, start)
        if self._starts[lo] < start:
            new_starts.append(self._starts[lo])
            new_ends.append(start)
        if self._ends[hi - 1] > end:
            new_starts.append(end)
            new_ends.append(self._ends[hi - 1])
        self._starts[lo:hi] = new_starts
        self._ends[lo:hi] = new_ends
        self._total -= removed
