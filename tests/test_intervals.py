"""IntervalSet: sorted, merged runs; checked against a set-of-integers model."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbuf._intervals import IntervalSet


def runs(intervals: IntervalSet) -> list[tuple[int, int]]:
    return list(intervals)


def check_invariants(intervals: IntervalSet) -> None:
    pairs = runs(intervals)
    for start, end in pairs:
        assert start < end
    for (_, end), (start, _) in zip(pairs, pairs[1:]):
        assert end < start, f"runs touch or overlap: {pairs}"
    assert intervals.total == sum(end - start for start, end in pairs)


def test_add_merges_touching_and_overlapping_runs():
    intervals = IntervalSet()
    assert intervals.add(10, 20) == (10, 20)
    assert intervals.add(30, 40) == (30, 40)
    assert intervals.add(20, 30) == (10, 40)  # touches both neighbours: one run
    assert runs(intervals) == [(10, 40)]
    assert intervals.add(5, 12) == (5, 40)
    assert intervals.add(50, 60) == (50, 60)
    assert len(intervals) == 2 and intervals.total == 45
    check_invariants(intervals)


def test_gaps_and_covers():
    intervals = IntervalSet()
    intervals.add(10, 20)
    intervals.add(30, 40)
    assert intervals.gaps(0, 50) == [(0, 10), (20, 30), (40, 50)]
    assert intervals.gaps(10, 40) == [(20, 30)]
    assert intervals.gaps(12, 18) == []
    assert intervals.gaps(20, 30) == [(20, 30)]
    assert intervals.gaps(5, 5) == []
    assert intervals.covers(10, 20) and intervals.covers(12, 13) and intervals.covers(3, 3)
    assert not intervals.covers(10, 21) and not intervals.covers(9, 11)


def test_run_bounds_does_not_change_the_set():
    intervals = IntervalSet()
    intervals.add(0, 10)
    intervals.add(20, 30)
    assert intervals.run_bounds(10, 20) == (0, 30)
    assert intervals.run_bounds(40, 50) == (40, 50)
    assert runs(intervals) == [(0, 10), (20, 30)]


def test_discard_splits_runs():
    intervals = IntervalSet()
    intervals.add(0, 100)
    intervals.discard(40, 60)
    assert runs(intervals) == [(0, 40), (60, 100)]
    intervals.discard(30, 70)
    assert runs(intervals) == [(0, 30), (70, 100)]
    intervals.discard(200, 300)  # nothing there
    intervals.discard(0, 30)
    assert runs(intervals) == [(70, 100)] and intervals.total == 30
    check_invariants(intervals)


def test_add_rejects_empty_interval():
    with pytest.raises(ValueError, match=r"\[5, 5\)"):
        IntervalSet().add(5, 5)


operation = st.tuples(
    st.sampled_from(["add", "discard", "gaps", "intersection"]),
    st.integers(0, 60),
    st.integers(1, 20),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=40))
def test_matches_a_set_model(operations):
    intervals, model = IntervalSet(), set()
    for name, start, length in operations:
        end = start + length
        if name == "add":
            run_start, run_end = intervals.add(start, end)
            model |= set(range(start, end))
            assert set(range(run_start, run_end)) <= model
            assert run_start - 1 not in model and run_end not in model
        elif name == "discard":
            intervals.discard(start, end)
            model -= set(range(start, end))
        elif name == "gaps":
            missing = [x for x in range(start, end) if x not in model]
            assert [x for s, e in intervals.gaps(start, end) for x in range(s, e)] == missing
        else:
            pieces = intervals.intersection(start, end)
            present = [x for x in range(start, end) if x in model]
            assert [x for s, e in pieces for x in range(s, e)] == present
            assert all(s < e for s, e in pieces)  # maximal, non-empty pieces
            assert all(e < s for (_, e), (s, _) in zip(pieces, pieces[1:]))
        check_invariants(intervals)
        assert {x for s, e in intervals for x in range(s, e)} == model


def _seconds_per_query(num_runs: int, repeats: int = 2000) -> float:
    """Median-ish cost of one gaps + add + discard cycle in a set of ``num_runs`` runs."""
    intervals = IntervalSet()
    for i in range(num_runs):
        intervals.add(4 * i, 4 * i + 2)
    middle = 4 * (num_runs // 2)
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(repeats):
            gaps = intervals.gaps(middle, middle + 4)  # one gap: [middle + 2, middle + 4)
            intervals.add(*gaps[0])
            intervals.discard(*gaps[0])
        best = min(best, time.perf_counter() - begin)
    return best / repeats


def test_cost_does_not_scale_with_the_number_of_runs():
    # A per-granule walk would be ~100x slower at 10,000 runs than at 100; binary search
    # is a few comparisons more. The bound is loose so a noisy CI machine passes.
    small, large = _seconds_per_query(100), _seconds_per_query(10_000)
    assert large < 5 * small, f"100 runs: {small * 1e6:.2f} us, 10,000 runs: {large * 1e6:.2f} us"
