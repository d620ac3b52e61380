"""Render a `python -m jaxbuf bench --json` result as the Markdown tables of BENCHMARKS.md.

Usage: python tools/bench_markdown.py results/bench-cuda.json > section.md
"""

from __future__ import annotations

import json
import sys

from jaxbuf.bench import format_seconds


def _time(seconds: float | None) -> str:
    return "—" if seconds is None else format_seconds(seconds)


def render(result: dict) -> str:
    machine = result["machine"]
    versions = ", ".join(f"{name} {version}" for name, version in result["versions"].items())
    lines = [
        f"Run {result['date']} on `{result['device']}`"
        f" ({machine.get('gpu') or machine.get('cpu') or machine.get('node')}); {versions}.",
        "",
    ]
    for suite in result["suites"]:
        description = suite.get("description", "")
        if suite.get("sizes"):
            description += f" Sizes: {suite['sizes']}."
        lines += [f"### {suite['name']}", "", description, ""]
        if suite.get("skipped") and not suite["rows"]:
            lines += [f"Skipped: {suite['skipped']}", ""]
            continue
        if suite.get("error"):
            lines += [f"Failed: `{suite['error']}`", ""]
            continue
        columns = ["measurement", "median", "device", "baseline", "baseline median"]
        columns += ["jaxbuf ÷ baseline (lower is better)", "target"]
        lines += [
            "| " + " | ".join(columns) + " |",
            "| --- | ---: | ---: | --- | ---: | ---: | --- |",
        ]
        for row in suite["rows"]:
            ratio = row.get("ratio")
            if ratio and "ratio" not in result:  # written when ratios were baseline ÷ jaxbuf
                ratio = 1 / ratio
            target = row.get("target") or ""
            if target and row.get("met") is not None:
                target += " ✓" if row["met"] else " ✗"
            lines.append(
                f"| {row['name']} | {_time(row['median_s'])} | {_time(row.get('device_median_s'))}"
                f" | {row['baseline_name']} | {_time(row['baseline_median_s'])}"
                f" | {'—' if ratio is None else f'{ratio:.3g}x'} | {target} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print(render(json.load(handle)))
