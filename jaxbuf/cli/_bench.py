"""``jaxbuf bench``: run the suites of :mod:`jaxbuf.bench`, print a table per suite (its
title states the sizes run), write the JSON result and, with ``--plot``, the plots: growth
cost (``extensible.growth``), the decode loop's memory and step time (``jax.decode``) and the
staged apply's time against writes per pattern (``staged.patterns``).

A suite whose optional dependency is missing is skipped with its reason (never a traceback
or ``FAILED``); a row whose baseline was skipped is shown "not judged" instead of
``MISSED`` (:attr:`jaxbuf.bench.Row.verdict`).
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

#: ``--plot`` given without a path: write ``results/growth-<device>.png``,
#: ``results/decode-<device>.png`` and ``results/staged-<device>.png``.
PLOT_DEFAULT = object()


def _device_file_name(device: Any) -> str:
    """``cpu``, ``cuda``, ``cuda1``: the device part of the default result file names."""
    return device.platform if device.index == 0 else f"{device.platform}{device.index}"


def _default_json_path(device: Any) -> Path:
    return Path("results") / f"bench-{_device_file_name(device)}.json"


def _default_plot_path(device: Any, kind: str = "growth") -> Path:
    return Path("results") / f"{kind}-{_device_file_name(device)}.png"


def _plot_paths(plot: Any, device: Any, kinds: list[str]) -> dict[str, Path]:
    """Where each plot of ``kinds`` (those with rows to draw, growth first) goes: the default
    paths, or the ``--plot`` path for the first and ``<stem>-<kind><suffix>`` beside it for
    the others."""
    if plot is PLOT_DEFAULT:
        return {kind: _default_plot_path(device, kind) for kind in kinds}
    path = Path(plot)
    return {
        kind: path if i == 0 else path.with_name(f"{path.stem}-{kind}{path.suffix or '.png'}")
        for i, kind in enumerate(kinds)
    }


def _row_cells(row: Any) -> list[str]:
    from jaxbuf.bench import format_seconds

    ratio = row.ratio
    notes = [row.notes] if row.notes else []
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


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_log(axis: Any, xlabel: str, ylabel: str, title: str, *, legend_size: int) -> None:
    """Label ``axis`` and set it log-log (x in powers of 2), gridded, with a legend."""
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=legend_size)


def _save(plt: Any, figure: Any, path: Path) -> None:
    """Write ``figure`` to ``path`` as PNG (making its folder), then close it."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_growth(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of growth cost against committed size, beside the raw driver calls (the floor),
    the seed-style buffer and realloc+copy. False: no data."""
    plt = _pyplot()

    from jaxbuf.bench import format_bytes

    # series[step][label] = {committed_bytes: seconds}
    series: dict[int, dict[str, dict[int, float]]] = {}
    labels = {
        "floor": "raw driver calls (floor)",
        "seed": "seed-style (granule set)",
        "torch": "torch realloc+copy",
        "jax": "JAX realloc+copy",
    }
    for result in results:
        for row in result["rows"]:
            params = row["params"]
            if "committed_bytes" not in params or "step_bytes" not in params:
                continue
            if row["median_s"] is None:
                continue  # skipped (out of memory): the table says why
            by_label = series.setdefault(params["step_bytes"], {})
            committed = params["committed_bytes"]
            # Variants (with a peer device, in a large reservation) are series of their own.
            variant = ", 1 peer" if params.get("peers") else ""
            if params.get("reserved_bytes"):
                variant += f", {format_bytes(params['reserved_bytes'])} reserved"
            jaxbuf = by_label.setdefault("jaxbuf ExtensibleTensor" + variant, {})
            jaxbuf[committed] = row["median_s"]
            if row["baseline_median_s"] is not None:
                label = labels.get(params.get("baseline_kind"), row["baseline_name"])
                by_label.setdefault(label + variant, {})[committed] = row["baseline_median_s"]
    if not series:
        return False
    figure, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.5), squeeze=False)
    for axis, (step, by_label) in zip(axes[0], sorted(series.items())):
        for label, points in by_label.items():
            xs = sorted(points)
            axis.plot([x / 2**30 for x in xs], [points[x] for x in xs], marker="o", label=label)
        _log_log(
            axis,
            "already committed (GiB)",
            "time per grow (s)",
            f"grow by {format_bytes(step)} on {device}",
            legend_size=8,
        )
    _save(plt, figure, path)
    return True


def _decode_series(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The params of the ``jax.decode`` rows that carry per-step series, one per profile."""
    return [
        row["params"]
        for result in results
        for row in result["rows"]
        if row["params"].get("kind") == "decode-step" and row["params"].get("series")
    ]


def _plot_decode(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of the decode loop (``jax.decode``): for each length profile, the bytes the KV
    cache holds and the time of every step, jaxbuf beside the preallocated cache and
    realloc+copy. False: no data."""
    profiles = _decode_series(results)
    if not profiles:
        return False
    plt = _pyplot()

    labels = {
        "jaxbuf": "jaxbuf ExtensibleTensor",
        "preallocated": "JAX, preallocated",
        "realloc": "JAX, realloc+copy",
    }
    columns = len(profiles)
    figure, axes = plt.subplots(2, columns, figsize=(6 * columns, 8), squeeze=False)
    for column, params in enumerate(profiles):
        memory, time_axis = axes[0][column], axes[1][column]
        for variant, series in params["series"].items():
            label = labels.get(variant, variant)
            steps = range(len(series["step_s"]))
            memory.plot(steps, [b / 2**20 for b in series["held_bytes"]], label=label)
            time_axis.plot(steps, [s * 1e3 for s in series["step_s"]], label=label, lw=0.8)
        if params.get("needed_bytes"):
            needed = [b / 2**20 for b in params["needed_bytes"]]
            memory.plot(range(len(needed)), needed, "k:", label="pages the tokens use")
        memory.set_title(f"{params['profile']} lengths on {device}: KV cache memory")
        memory.set_ylabel("bytes held (MiB)")
        time_axis.set_title(f"{params['profile']} lengths on {device}: step time")
        time_axis.set_ylabel("step (ms)")
        time_axis.set_ylim(bottom=0)
        for axis in (memory, time_axis):
            axis.set_xlabel("decode step")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=8)
    _save(plt, figure, path)
    return True


def _staged_series(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[int, float]]]:
    """The ``staged.patterns`` apply rows as ``{timing: {label: {num_writes: seconds}}}``,
    labels ``"<pattern>: jaxbuf"`` and ``"<pattern>: <baseline>"``."""
    names = {"seed": "seed-style", "index_put": "torch index_put_"}
    series: dict[str, dict[str, dict[int, float]]] = {}
    for result in results:
        for row in result["rows"]:
            params = row["params"]
            if params.get("kind") != "pattern-apply" or row["median_s"] is None:
                continue
            by_label = series.setdefault(params["timing"], {})
            pattern, writes = params["pattern"], params["num_writes"]
            by_label.setdefault(f"{pattern}: jaxbuf", {})[writes] = row["median_s"]
            if row["baseline_median_s"] is not None:
                baseline = names.get(params.get("baseline_kind"), row["baseline_name"])
                by_label.setdefault(f"{pattern}: {baseline}", {})[writes] = row["baseline_median_s"]
    return series


def _plot_staged(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of one staged apply's time against the number of writes, per write pattern
    (``staged.patterns``): jaxbuf solid, the seed-style apply dashed, torch ``index_put_``
    dotted, one colour per pattern; host time and end to end side by side. False: no data."""
    series = _staged_series(results)
    if not series:
        return False
    plt = _pyplot()

    timings = [t for t in ("host", "end to end") if t in series]
    figure, axes = plt.subplots(1, len(timings), figsize=(7 * len(timings), 5), squeeze=False)
    styles = {"jaxbuf": "-", "seed-style": "--", "torch index_put_": ":"}
    colours: dict[str, str] = {}
    for axis, timing in zip(axes[0], timings):
        for label, points in series[timing].items():  # the suite's order: patterns first
            pattern, _, who = label.partition(": ")
            colour = colours.setdefault(pattern, f"C{len(colours)}")
            xs = sorted(points)
            axis.plot(
                xs,
                [points[x] * 1e6 for x in xs],
                styles.get(who, "-."),
                marker="o",
                color=colour,
                label=label,
            )
        _log_log(
            axis,
            "writes per apply",
            "time per apply (µs)",
            f"staged apply, {timing}, on {device}",
            legend_size=7,
        )
    _save(plt, figure, path)
    return True


_PLOTTERS = {"growth": _plot_growth, "decode": _plot_decode, "staged": _plot_staged}


def _has_growth_rows(results: list[dict[str, Any]]) -> bool:
    """Whether ``results`` hold a measured ``extensible.growth`` row (what _plot_growth draws)."""
    return any(
        {"committed_bytes", "step_bytes"} <= row["params"].keys() and row["median_s"] is not None
        for result in results
        for row in result["rows"]
    )


def _run_suite(suite: Any, device: Any, quick: bool, progress: Progress) -> dict[str, Any]:
    """Run one suite: its rows, the sizes it states, and why it was skipped or failed."""
    from jaxbuf.bench import SuiteSkipped

    result: dict[str, Any] = {"suite": suite, "rows": [], "sizes": None, "error": None}
    begin = time.perf_counter()

    def stated(sizes: str) -> None:
        result["sizes"] = sizes

    # A missing optional framework is a skip with its reason, never a traceback: checked
    # before the suite starts (``requires``) or raised by it (``require``, SuiteSkipped).
    result["skipped"] = suite.missing_requirement()
    if result["skipped"] is None:
        try:
            for row in suite.run(device, quick, sizes=stated):
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
    return f"{title} ({result['seconds']:.1f} s)"


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.plot is not None:
        require("matplotlib", "--plot")
    from jaxbuf import bench

    try:
        suites = bench.select_suites(args.only)
    except ValueError as error:
        raise CliError(one_line(error)) from None
    if any(s.fresh_jax_allocations for s in suites):
        # Realloc baselines reallocate to sizes never allocated before: JAX must not serve
        # them from its pool (nor keep tens of GiB pooled for the suites after them), as
        # torch's cache is emptied between samples. Set before JAX starts (no suite has run
        # yet); a user's setting wins. The JSON records it under "environment".
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
        _warn_of_shared_allocator(suites)
    out = Printer()
    for module, message in bench.load_errors.items():
        print(
            f"jaxbuf: warning: benchmark module {module} failed to import: {one_line(message)}",
            file=sys.stderr,
        )
    quick = " (quick)" if args.quick else ""
    out.line(f"jaxbuf bench on {device}{quick}: {len(suites)} suite(s)")

    started = datetime.datetime.now(datetime.timezone.utc)
    results: list[dict[str, Any]] = []
    progress = Progress(len(suites), "benchmarks")
    try:
        for suite in suites:
            progress.describe(suite.name)
            results.append(_run_suite(suite, device, args.quick, progress))
            progress.advance()
    finally:
        progress.close()

    columns = ["name", "median", "baseline", "baseline median", "speedup", "target", "notes"]
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
            "rows": [row.to_json() for row in r["rows"]],
        }
        for r in results
    ]
    document = {
        "date": started.isoformat(timespec="seconds"),
        "command": ["jaxbuf", *sys.argv[1:]] if args.argv is None else ["jaxbuf", *args.argv],
        "device": str(device),
        "quick": args.quick,
        "machine": machine(),
        "versions": versions(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_")},
        "speedup": "baseline_median_s / median_s",
        "suites": serial,
        "load_errors": dict(bench.load_errors),
    }
    json_path = Path(args.json) if args.json else _default_json_path(device)
    import json

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    skipped = [r["suite"].name for r in results if r["skipped"] is not None]
    if skipped:
        out.line(f"skipped (a dependency is missing): {', '.join(skipped)}")
    out.line(f"results: {json_path}")
    if args.plot is not None:
        present = {
            "growth": _has_growth_rows(serial),
            "decode": bool(_decode_series(serial)),
            "staged": bool(_staged_series(serial)),
        }
        kinds = [kind for kind, has_rows in present.items() if has_rows]
        for kind, path in _plot_paths(args.plot, device, kinds).items():
            if _PLOTTERS[kind](serial, path, device):
                out.line(f"plot: {path}")
        if not kinds:
            print(
                "jaxbuf: warning: no rows to plot (run the extensible.growth, jax.decode or "
                "staged.patterns suite)",
                file=sys.stderr,
            )
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
