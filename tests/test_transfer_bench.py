"""The transfer benchmark suites (``jaxbuf.bench.transfer``), run quickly on the CPU: every
row is well-formed, against a baseline measured in the same run, judged where it has a
target."""

from __future__ import annotations

import pytest

from jaxbuf.bench import load_suites
from jaxbuf.devices import Device

transfer = pytest.importorskip("jaxbuf.transfer")
try:
    transfer.load_nixl()
except transfer.NixlUnavailable as error:  # pragma: no cover - the CI image installs it
    pytest.skip(f"NIXL is not installed: {error}", allow_module_level=True)


@pytest.mark.parametrize(
    ("name", "rows", "targets"),
    # On the CPU the bandwidth suite adds a third baseline per size: plain memory on 4 KiB pages.
    [("transfer.bandwidth", 9, 3), ("transfer.grow", 4, 2), ("transfer.host", 2, 2)],
)
def test_suite_rows_are_well_formed(name, rows, targets):
    suite = load_suites()[name]
    sizes: list[str] = []
    produced = list(suite.run(Device("cpu"), quick=True, sizes=sizes.append))
    assert len(sizes) == 1 and sizes[0]
    assert len(produced) == rows
    for row in produced:
        assert row.median_s > 0 and row.baseline_median_s > 0, row
        assert row.ratio is not None
    judged = [row for row in produced if row.target]
    assert len(judged) == targets
    assert all(row.met in (True, False) for row in judged)
    if name == "transfer.bandwidth":
        small = [row for row in produced if "4 KiB pages" in row.baseline_name]
        assert [row.params["blocks"] for row in small] == [1, 64, 1024]
