"""``jaxbuf bench``: run the suites of :mod:`jaxbuf.bench`, print a table per suite (its
title states the sizes run), write the JSON result and, with ``--plot``, the plots: growth
cost (``extensible.growth``), the decode loop's memory and step time (``jax.decode``) and the
staged apply's time against writes per pattern (``staged.patterns``).

What runs is what means something on the device: a suite whose optional dependency is
missing, whose figures need a GPU (``gpu_only``), or whose kernels would run under Triton's
interpreter (``interpreted``, unless ``--interpreter``) is skipped with its reason, listed
at the end (never a traceback or ``FAILED``). Every ratio is jaxbuf ÷ baseline, lower is
better; a row is judged against its target only at full sizes, outside the interpreter, with
its baseline measured (:attr:`jaxbuf.bench.Row.verdict`). When stdout is not a terminal (a
log, a pipe) each suite prints one line as it ends: its name, elapsed time and verdicts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import _plots
from ._shared import (
    CliError,
    Printer,
    Progress,
    machine,
    one_line,
    require,
    resolve_device,
    versions,
)

#: The ratio column's header: one direction for every suite.
RATIO_COLUMN = "jaxbuf ÷ baseline (lower is better)"
INTERPRETER_LABEL = "Triton interpreter figures: they time the interpreter, not jaxbuf"


def _device_file_name(device: Any) -> str:
    """``cpu``, ``cuda``, ``cuda1``: the device part of the default result file names."""
    return device.platform if device.index == 0 else f"{device.platform}{device.index}"


def _default_json_path(device: Any) -> Path:
    return Path("results") / f"bench-{_device_file_name(device)}.json"


def _row_cells(row: Any) -> list[str]:
    from jaxbuf.bench import format_seconds

    ratio = row.ratio
    notes = ["Triton interpreter"] if row.interpreter else []
    notes += [row.notes] if row.notes else []
    if row.device_median_s is not None:
        notes.append(f"device {format_seconds(row.device_median_s)}")
    if row.baseline_device_median_s is not None:
        notes.append(f"baseline device {format_seconds(row.baseline_device_median_s)}")
    return [
        row.name,
        format_seconds(row.median_s),
        row.baseline_name or "—",
        format_seconds(row.baseline_median_s),
        "—" if ratio is None else f"{ratio:,.3g}x",
        row.verdict,
        "; ".join(notes),
    ]


def _run_suite(
    suite: Any, device: Any, args: argparse.Namespace, progress: Progress
) -> dict[str, Any]:
    """Run one suite: its rows, the sizes it states, and why it was skipped or failed."""
    from jaxbuf.bench import SuiteSkipped

    result: dict[str, Any] = {"suite": suite, "rows": [], "sizes": None, "error": None}
    result["interpreter"] = suite.uses_interpreter(device)
    begin = time.perf_counter()

    def stated(sizes: str) -> None:
        result["sizes"] = sizes

    # What cannot run or means nothing here is a skip with its reason, never a traceback:
    # checked before the suite starts (a missing framework, a GPU-only figure, interpreter
    # figures not asked for) or raised by it (``require``, SuiteSkipped).
    result["skipped"] = suite.skip_reason(device, interpreter=args.interpreter)
    if result["skipped"] is None:
        try:
            for row in suite.run(device, args.quick, sizes=stated):
                result["rows"].append(row)
                progress.describe(f"{suite.name}: {row.name}")
        except SuiteSkipped as skip:
            result["skipped"] = one_line(skip)
        except Exception as exc:  # noqa: BLE001 - reported below, other suites still run
            result["error"] = f"{type(exc).__name__}: {one_line(exc)}"
            traceback.print_exc(file=sys.stderr)
    result["seconds"] = time.perf_counter() - begin
    return result


def _suite_title(result: dict[str, Any]) -> str:
    suite = result["suite"]
    title = f"{suite.name}: {suite.description}"
    if result["sizes"]:
        title += f" Sizes: {result['sizes']}."
    if result["interpreter"]:
        title += f" [{INTERPRETER_LABEL}]"
    return f"{title} ({result['seconds']:.1f} s)"


def verdict_counts(rows: list[Any]) -> str:
    """``"12 rows: 3 ok, 1 MISSED, 2 not judged"``: the verdicts of one suite's rows."""
    counts = {"ok": 0, "MISSED": 0, "not judged": 0}
    for row in rows:
        if not row.target:
            continue
        judged = row.judged
        counts["not judged" if judged is None else "ok" if judged else "MISSED"] += 1
    words = [f"{n} {label}" for label, n in counts.items() if n]
    text = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
    return f"{text}: {', '.join(words)}" if words else f"{text}, no target"


def _suite_line(index: int, total: int, result: dict[str, Any]) -> str:
    """The line a suite prints as it ends when stdout is not a terminal."""
    head = f"[{index}/{total}] {result['suite'].name} ({result['seconds']:.1f} s)"
    if result["error"]:
        return f"{head}: FAILED: {result['error']}"
    if result["skipped"] is not None and not result["rows"]:
        return f"{head}: skipped: {result['skipped']}"
    text = f"{head}: {verdict_counts(result['rows'])}"
    if result["interpreter"]:
        text += " (Triton interpreter figures)"
    if result["skipped"] is not None:
        text += f"; stopped early: {result['skipped']}"
    return text


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.plot is not None:
        require("matplotlib", "--plot")
    from jaxbuf import bench

    try:
        suites = bench.select_suites(args.only)
    except ValueError as error:
        raise CliError(one_line(error)) from None
    runnable = [s for s in suites if s.skip_reason(device, interpreter=args.interpreter) is None]
    if any(s.fresh_jax_allocations for s in runnable):
        # Realloc baselines reallocate to sizes never allocated before: JAX must not serve
        # them from its pool (nor keep tens of GiB pooled for the suites after them), as
        # torch's cache is emptied between samples. Set before JAX starts (no suite has run
        # yet); a user's setting wins. The JSON records it under "environment".
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
        _warn_of_shared_allocator(runnable)
    out = Printer()
    for module, message in bench.load_errors.items():
        print(
            f"jaxbuf: warning: benchmark module {module} failed to import: {one_line(message)}",
            file=sys.stderr,
        )
    quick = " (quick: small sizes, targets not judged at quick sizes)" if args.quick else ""
    out.line(f"jaxbuf bench on {device}{quick}: {len(suites)} suite(s)")
    out.line(f"Every ratio is {bench.RATIO}: below 1, jaxbuf is faster (lower is better).")

    started = datetime.datetime.now(datetime.timezone.utc)
    results: list[dict[str, Any]] = []
    # On a terminal the progress bar shows what runs; in a log or a pipe, one line per suite.
    lines_per_suite = not sys.stdout.isatty()
    progress = Progress(len(suites), "benchmarks")
    try:
        for index, suite in enumerate(suites, 1):
            progress.describe(suite.name)
            results.append(_run_suite(suite, device, args, progress))
            progress.advance()
            if lines_per_suite:
                out.line(_suite_line(index, len(suites), results[-1]), flush=True)
    finally:
        progress.close()
    if lines_per_suite:
        out.line()

    columns = ["name", "median", "baseline", "baseline median", RATIO_COLUMN, "target", "notes"]
    for result in results:
        name = result["suite"].name
        if result["skipped"] is not None and not result["rows"]:
            out.line(f"{name}: skipped: {result['skipped']}")
            out.line()
            continue
        rows = [_row_cells(row) for row in result["rows"]]
        out.table(_suite_title(result), columns, rows, right=(1, 3, 4))
        if result["skipped"] is not None:
            out.line(f"  {name} stopped early, skipped: {result['skipped']}")
        if result["error"]:
            out.line(f"  {name} FAILED: {result['error']}")

    serial = [
        {
            "name": r["suite"].name,
            "description": r["suite"].description,
            "sizes": r["sizes"],
            "seconds": r["seconds"],
            "skipped": r["skipped"],
            "error": r["error"],
            "interpreter": r["interpreter"] and r["skipped"] is None,
            "rows": [row.to_json() for row in r["rows"]],
        }
        for r in results
    ]
    document = {
        "date": started.isoformat(timespec="seconds"),
        "command": ["jaxbuf", *sys.argv[1:]] if args.argv is None else ["jaxbuf", *args.argv],
        "device": str(device),
        "quick": args.quick,
        "interpreter": args.interpreter,
        "machine": machine(),
        "versions": versions(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_")},
        "ratio": f"median_s / baseline_median_s ({bench.RATIO}, lower is better)",
        "suites": serial,
        "load_errors": dict(bench.load_errors),
    }
    json_path = Path(args.json) if args.json else _default_json_path(device)
    import json

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    skipped = [r for r in results if r["skipped"] is not None and not r["rows"]]
    if skipped:
        out.line(f"skipped here ({len(skipped)} of {len(results)} suites):")
        for r in skipped:
            out.line(f"  {r['suite'].name}: {r['skipped']}")
    out.line(f"results: {json_path}")
    if args.plot is not None:
        for path in _plots.write_plots(serial, args.plot, device, _device_file_name(device)):
            out.line(f"plot: {path}")
    return 1 if any(r["error"] for r in results) else 0


def _warn_of_shared_allocator(suites: list) -> None:
    """The allocator is the process's: JAX hot-path suites selected with a suite that needs
    fresh allocations are timed under the platform allocator too (hundreds of µs a jitted
    call on an H200), which a JAX user never runs. Say so, and how to time them apart."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "platform":
        return
    fresh = [s.name for s in suites if s.fresh_jax_allocations]
    hot = [
        s.name
        for s in suites
        if "jax" in s.requires and not s.fresh_jax_allocations and s.missing_requirement() is None
    ]
    if hot:
        print(
            f"jaxbuf: warning: {', '.join(fresh)} run JAX on its platform allocator "
            f"(XLA_PYTHON_CLIENT_ALLOCATOR=platform), and so do {', '.join(hot)} in this run, "
            "slower than under JAX's own pool; for their figures run them apart: "
            f"--only {' '.join(hot)}",
            file=sys.stderr,
        )
