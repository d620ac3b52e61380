"""``jaxbuf bench``: run the suites of :mod:`jaxbuf.bench`, print a table per suite (its
title states the sizes run, its notes are footnotes), the legend of the baseline kinds and a
closing tally of the verdicts, write the JSON result and, with ``--plot``, the plots: growth
cost (``extensible.growth``), the decode loop's memory and step time (``jax.decode``) and the
staged apply's time against writes per pattern (``staged.patterns``).

What runs is what means something on the device: a suite whose optional dependency is
missing, whose figures need a GPU (``gpu_only``), or whose kernels would run under Triton's
interpreter (``interpreted``, unless ``--interpreter``) is skipped with its reason, listed
at the end (never a traceback or ``FAILED``). Every ratio is jaxbuf ÷ baseline, lower is
better; a row is judged against its target only at full sizes, outside the interpreter, with
its baseline measured, on a device the target is set for, and with its bound outside the
run's spread (:attr:`jaxbuf.bench.Row.judged`). When stdout is not a terminal (a log, a
pipe) each suite prints one line as it ends, and the tables are plain text.

Exit status (:data:`EXIT_STATUS`): 0 when every selected suite ran or was skipped with its
reason, missed targets included; 1 when a suite failed, or with ``--strict`` when a target
was missed; 2 for a usage error (bad device, unknown suite, ``--plot`` without matplotlib).
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

from ._report import RATIO_LINE, legend, suite_table, tally, tally_lines, verdict_counts
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
#: ``results/decode-<device>.png`` and ``results/staged-<device>.png`` (those with rows).
PLOT_DEFAULT = object()

INTERPRETER_LABEL = "Triton interpreter figures: they time the interpreter, not jaxbuf"
#: What --interpreter costs off a GPU: staged.patterns and staged.overlap under Triton's
#: interpreter took about 10 minutes on a 2-core CPU (the rest of the CPU run under 2).
INTERPRETER_COST = "about 10 minutes on a 2-core CPU"

#: The command's exit statuses, for ``--help`` and the module docstring.
EXIT_STATUS = (
    "exit status: 0 when every selected suite ran or was skipped with its reason, missed "
    "targets included; 1 when a suite failed, or with --strict when a target was missed; "
    "2 for a usage error (bad device, unknown suite, --plot without matplotlib)"
)


def _device_file_name(device: Any) -> str:
    """``cpu``, ``cuda``, ``cuda1``: the device part of the default result file names."""
    return device.platform if device.index == 0 else f"{device.platform}{device.index}"


def _default_json_path(device: Any, only: list[str] | None = None) -> Path:
    """``results/bench-<device>.json`` for the full run; a run of ``--only`` suites writes
    its own file, ``results/bench-<device>-<names>.json`` (names joined by ``+``), so it
    never overwrites the full run's."""
    stem = f"bench-{_device_file_name(device)}"
    if only:
        names = "+".join(dict.fromkeys(only))
        stem += "-" + "".join(c if c.isalnum() or c in "._+-" else "_" for c in names)
    return Path("results") / f"{stem}.json"


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


def _save(plt: Any, figure: Any, path: Path, note: str = "") -> None:
    """Write ``figure`` to ``path`` as PNG (making its folder), then close it; ``note`` is
    printed under the axes (what a reader needs to read them right)."""
    if note:
        figure.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=8, wrap=True)
        figure.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _one_size(by_label: dict[str, dict[Any, float]]) -> bool:
    """Whether every series of ``by_label`` is measured at the same single x: a line plot
    of one x is a column of dots, so such data is drawn as bars (:func:`_bars`)."""
    return len({x for points in by_label.values() for x in points}) == 1


def _bars(
    axis: Any,
    by_label: dict[str, dict[Any, float]],
    scale: float,
    ylabel: str,
    title: str,
    colours: list[str] | None = None,
) -> None:
    """One bar per series of ``by_label`` (each a single point), log-scaled values."""
    labels = list(by_label)
    values = [next(iter(by_label[label].values())) * scale for label in labels]
    positions = range(len(labels))
    axis.bar(positions, values, color=colours or [f"C{i}" for i in positions])
    axis.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=7)
    axis.set_yscale("log")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(True, axis="y", which="both", alpha=0.3)


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
        if _one_size(by_label):  # one committed size: bars, not a column of dots
            (committed,) = {x for points in by_label.values() for x in points}
            title = f"grow by {format_bytes(step)} onto {format_bytes(committed)} on {device}"
            _bars(axis, by_label, 1.0, "time per grow (s)", title)
            continue
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
    from jaxbuf.bench import format_bytes

    columns = len(profiles)
    figure, axes = plt.subplots(2, columns, figsize=(6 * columns, 8), squeeze=False)
    granules = {p["granule_bytes"] for p in profiles if p.get("granule_bytes")}
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
        if params.get("granule_bytes"):
            granule = params["granule_bytes"]
            memory.axhline(
                granule / 2**20,
                color="grey",
                ls="--",
                lw=0.8,
                label=f"granule floor ({format_bytes(granule)}): jaxbuf's least",
            )
        memory.set_title(f"{params['profile']} lengths on {device}: KV cache memory")
        memory.set_ylabel("bytes held (MiB)")
        time_axis.set_title(f"{params['profile']} lengths on {device}: step time")
        time_axis.set_ylabel("step (ms)")
        time_axis.set_ylim(bottom=0)
        for axis in (memory, time_axis):
            axis.set_xlabel("decode step")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=8)
    note = ""
    if granules:
        note = (
            f"The driver commits whole granules ({', '.join(map(format_bytes, sorted(granules)))}"
            " here): jaxbuf's cache holds at least one granule, and grows a granule at a time "
            "where a growth step is smaller, so at small sizes it can hold more than a "
            "preallocated cache; the row's memory target allows one growth step above the "
            "tokens' pages."
        )
    _save(plt, figure, path, note)
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
    interpreted = any(
        row.get("interpreter")
        for result in results
        for row in result["rows"]
        if row["params"].get("kind") == "pattern-apply"
    )
    where = f"{device}, Triton interpreter" if interpreted else str(device)
    for axis, timing in zip(axes[0], timings):
        by_label = series[timing]
        if _one_size(by_label):  # one number of writes: bars, one colour per pattern
            (writes,) = {x for points in by_label.values() for x in points}
            bar_colours = [
                colours.setdefault(label.partition(": ")[0], f"C{len(colours)}")
                for label in by_label
            ]
            title = f"staged apply of {writes:,} writes, {timing}, on {where}"
            _bars(axis, by_label, 1e6, "time per apply (µs)", title, bar_colours)
            continue
        for label, points in by_label.items():  # the suite's order: patterns first
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
            f"staged apply, {timing}, on {where}",
            legend_size=7,
        )
    note = (
        "Triton interpreter figures: they time the interpreter, not jaxbuf" if interpreted else ""
    )
    _save(plt, figure, path, note)
    return True


_PLOTTERS = {"growth": _plot_growth, "decode": _plot_decode, "staged": _plot_staged}


def _has_growth_rows(results: list[dict[str, Any]]) -> bool:
    """Whether ``results`` hold a measured ``extensible.growth`` row (what _plot_growth draws)."""
    return any(
        {"committed_bytes", "step_bytes"} <= row["params"].keys() and row["median_s"] is not None
        for result in results
        for row in result["rows"]
    )


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
    # On a terminal the progress bar shows what runs and rich draws the tables; in a log or
    # a pipe, one line per suite as it ends, and plain-text tables.
    lines_per_suite = not sys.stdout.isatty()
    out = Printer(plain=lines_per_suite)
    for module, message in bench.load_errors.items():
        print(
            f"jaxbuf: warning: benchmark module {module} failed to import: {one_line(message)}",
            file=sys.stderr,
        )
    quick = " (quick: small sizes, targets not judged at quick sizes)" if args.quick else ""
    start_load = _one_minute_load()
    load = "" if start_load is None else f"; load {start_load:.1f} on {os.cpu_count()} cores"
    out.line(f"jaxbuf bench on {device}{quick}: {len(suites)} suite(s){load}")
    interpreted = [s.name for s in runnable if s.uses_interpreter(device)]
    if interpreted:
        out.line(
            f"--interpreter: {', '.join(interpreted)} run under Triton's interpreter here, "
            f"{INTERPRETER_COST}; their figures time the interpreter and are never judged"
        )
    out.line(RATIO_LINE)

    started = datetime.datetime.now(datetime.timezone.utc)
    results: list[dict[str, Any]] = []
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

    device_name = _device_file_name(device)
    all_rows = [row for result in results for row in result["rows"]]
    for line in legend(all_rows):
        out.line(line)
    if all_rows:
        out.line()
    for result in results:
        name = result["suite"].name
        if result["skipped"] is not None and not result["rows"]:
            out.line(f"{name}: skipped: {result['skipped']}")
            out.line()
            continue
        columns, cells, under = suite_table(result["rows"], device_name)
        out.table(_suite_title(result), columns, cells, right=(1, 3, 4), under=under)
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
        # Other work on the machine moves the figures: the 1-minute load at start and end.
        "load_average": {"start": start_load, "end": _one_minute_load()},
    }
    counts = tally(results, device_name)
    document["tally"] = {
        "met": counts["met"],
        "missed": [f"{suite_name}: {row.name}" for suite_name, row in counts["missed"]],
        "not_judged": dict(counts["not_judged"]),
    }
    json_path = Path(args.json) if args.json else _default_json_path(device, args.only)
    import json

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    skipped = [r for r in results if r["skipped"] is not None and not r["rows"]]
    if skipped:
        out.line(f"skipped here ({len(skipped)} of {len(results)} suites):")
        for r in skipped:
            out.line(f"  {r['suite'].name}: {r['skipped']}")
    for line in tally_lines(counts, strict=args.strict):
        out.line(line)
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
    failed = any(r["error"] for r in results)
    return 1 if failed or (args.strict and counts["missed"]) else 0


def _one_minute_load() -> float | None:
    """The machine's 1-minute load average (None where the platform has none): a shared
    machine's figures move with it, so the header and the JSON state it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


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
