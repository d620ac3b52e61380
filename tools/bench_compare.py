"""Print a before/after table of two ``python -m jaxbuf bench --json`` files.

    python3 tools/bench_compare.py before.json after.json

Rows are matched by suite and row name (the first row of each name: its median is the jaxbuf
figure; baselines differ per row but the jaxbuf median is the same). The ratio is after/before.
"""

from __future__ import annotations

import json
import sys


def _medians(path: str) -> dict[tuple[str, str], float]:
    with open(path) as file:
        report = json.load(file)
    medians: dict[tuple[str, str], float] = {}
    for suite in report["suites"]:
        for row in suite.get("rows", []):
            key = (suite["name"], row["name"])
            if row.get("median_s") is not None and key not in medians:
                medians[key] = row["median_s"]
    return medians


def _format(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def main(argv: list[str]) -> int:
    before, after = _medians(argv[0]), _medians(argv[1])
    print("| suite | row | before | after | after / before |")
    print("| --- | --- | ---: | ---: | ---: |")
    for key, value in after.items():
        if key in before:
            ratio = value / before[key]
            print(
                f"| {key[0]} | {key[1]} | {_format(before[key])} | {_format(value)} | {ratio:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
