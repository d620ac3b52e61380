"""The UVA benchmark suites (``jaxbuf.bench.uva``), run quickly on the CPU: rows well-formed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TORCH_REASON

from jaxbuf.bench import Row, load_suites
from jaxbuf.devices import as_device

needs_torch = pytest.mark.skipif(TORCH_REASON is not None, reason=TORCH_REASON or "")


def run_suite(name: str) -> list[Row]:
    suites = load_suites()
    assert name in suites, sorted(suites)
    return list(suites[name].run(as_device("cpu"), True))


def check_row(row: Row) -> None:
    assert isinstance(row, Row)
    assert isinstance(row.name, str) and row.name
    assert row.median_s is not None and math.isfinite(row.median_s) and row.median_s > 0
    assert row.baseline_name, row
    assert row.baseline_median_s is not None and row.baseline_median_s > 0, row
    assert row.ratio == pytest.approx(row.median_s / row.baseline_median_s)  # jaxbuf ÷ baseline
    assert row.met in (None, True, False)
    if row.target:
        assert isinstance(row.met, bool), row
    row.to_json()  # plain values only


def test_suites_are_registered():
    suites = load_suites()
    assert {"uva.copy_to_uva", "uva.read"} <= suites.keys()
    assert suites["uva.copy_to_uva"].description
    assert suites["uva.read"].description


@needs_torch
def test_copy_to_uva_rows_on_cpu():
    rows = run_suite("uva.copy_to_uva")
    host_rows = [row for row in rows if not row.baseline_name]
    rows = [row for row in rows if row.baseline_name]
    for row in rows:
        check_row(row)
    # The 4 KiB host-time bound is a row of its own, apart from the ratio to the seed-style
    # pool: each row judges the one thing it measures, with its spread.
    assert [row.name for row in host_rows] == [
        f"copy_to_uva 4 KiB (jaxbuf, framework={framework!r})" for framework in ("torch", "view")
    ]
    for row in host_rows:
        assert row.target == "<= 2 µs" and row.limit == 2e-6
        low, high = row.spread
        assert 0 < low <= row.median_s <= high
    expected_baselines = {
        "seed-style pool (pinned torch, sliced view)",
        "np.copyto (preallocated)",
        "torch.from_numpy(x).clone()",
    }
    for size in ("4 KiB", "256 KiB"):
        for framework in ("torch", "view"):
            name = f"copy_to_uva {size} (jaxbuf, framework={framework!r})"
            mine = [row for row in rows if row.name == name]
            assert {row.baseline_name for row in mine} == expected_baselines, name
            # One measurement per configuration: every row of it shows the same median.
            assert len({row.median_s for row in mine}) == 1
            seed = next(r for r in mine if r.params["baseline_kind"] == "seed")
            assert seed.target == "<= 1x" and isinstance(seed.met, bool)
            assert seed.spread is not None and seed.limit == 1.0
            assert all("CPU" in row.notes for row in mine)  # the substitution is stated
            assert seed.params["size_bytes"] == (4096 if size == "4 KiB" else 262144)
    assert len(rows) == 2 * 2 * 3


@needs_torch
def test_read_rows_on_cpu():
    rows = run_suite("uva.read")
    assert rows
    for row in rows:
        check_row(row)
        assert row.target is None and row.met is None
        assert row.name.startswith("read ") and row.name.endswith(" from UVA")
        assert row.notes
    kinds = {(row.params["size_bytes"], row.params["baseline_kind"]) for row in rows}
    sizes = sorted({size for size, _ in kinds})
    assert sizes[0] == 4096
    assert kinds == {(size, kind) for size in sizes for kind in ("device", "copy")}


@needs_torch
def test_seed_style_pool_round_robin_and_growth():
    import torch

    from jaxbuf.bench.uva import _SeedStyleUvaPool

    pool = _SeedStyleUvaPool(4, torch.int32, as_device("cpu"))
    try:
        first = pool.copy_to_uva(np.array([1, 2, 3], np.int32))
        second = pool.copy_to_uva([4, 5])
        assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]
        grown = pool.copy_to_uva(torch.arange(5, dtype=torch.int32))  # slot 1 grows to 8
        assert grown.tolist() == [0, 1, 2, 3, 4]
        assert pool._uva_bufs[1].cpu.shape[0] == 8
        assert second.tolist() == [4, 5]  # the other slot is left intact
    finally:
        pool.close()
