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
its baseline measured, on a device the target is set for, and with its bound clear of the
run's spread widened by ±10% (:attr:`jaxbuf.bench.Row.judged`). When stdout is not a
terminal (a log, a pipe) each suite prints one line as it ends, and the tables are plain text
within 120 columns, two lines a row. On the CPU torch and OpenMP time with one intra-op
thread (``--threads``). JAX hot-path suites selected with a suite that puts JAX on its
platform allocator run in a child process, on JAX's pool.

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

from . import _plots
from ._report import (
    RATIO_LINE,
    legend,
    stacked_table,
    suite_table,
    tally,
    tally_lines,
    verdict_counts,
)
from ._shared import (
    CliError,
    Printer,
    Progress,
    machine,
    one_line,
    require,
    resolve_device,
    versions,
    warn,
)

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


#: The variables that set the intra-op threads of torch (read when it is imported), OpenMP
#: and the BLAS libraries loaded after the command starts.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def thread_count(text: str) -> int:
    """``--threads N``: a positive integer."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"--threads takes a positive integer, got {text!r}")
    return count


def _pin_threads(device: Any, asked: int | None) -> str:
    """Set the intra-op threads the timed loops run with, before any suite imports torch;
    return the header's phrase for it.

    On the CPU torch's intra-op threads (one per core by default) compete with the timed
    work and each other for the cores: ``torch.decode``'s medians moved between 1 ms and
    60 ms from run to run on a shared 2-core machine, and held at about 1.7 ms with one
    thread. So the CPU default is one thread, or ``OMP_NUM_THREADS`` where the user set it;
    ``--threads`` overrides both. On CUDA the default is left alone (torch's host threads
    hardly touch the device figures). numpy's own loops are single-threaded; its BLAS was
    loaded before the command started and keeps its setting (no timed loop multiplies
    matrices in numpy)."""
    if asked is None:
        if getattr(device, "is_cuda", False):
            return "threads: torch's default (--threads N pins them)"
        user = os.environ.get("OMP_NUM_THREADS", "")
        asked = int(user) if user.isdigit() and int(user) > 0 else 1
    for name in THREAD_VARIABLES:
        os.environ[name] = str(asked)
    torch = sys.modules.get("torch")  # read at import: only an already imported torch is set
    if torch is not None:
        torch.set_num_threads(asked)
    return f"threads: {asked} (torch, OpenMP; --threads N changes it)"


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
    """The command: pins the timing threads for the run and gives the process its own
    settings back afterwards (``main`` may be called in a process that goes on)."""
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    try:
        return _run(args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)


def _run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    threads = _pin_threads(device, getattr(args, "threads", None))
    if args.plot is not None:
        require("matplotlib", "--plot")
    from jaxbuf import bench

    try:
        suites = bench.select_suites(args.only)
    except ValueError as error:
        raise CliError(one_line(error)) from None
    runnable = [s for s in suites if s.skip_reason(device, interpreter=args.interpreter) is None]
    apart: list[str] = []
    fresh = any(s.fresh_jax_allocations for s in runnable)
    if fresh and "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ:
        # Realloc baselines reallocate to sizes never allocated before: JAX must not serve
        # them from its pool (nor keep tens of GiB pooled for the suites after them), as
        # torch's cache is emptied between samples. Set before JAX starts (no suite has run
        # yet). The JSON records it under "environment".
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
        # The allocator is the process's: JAX hot paths timed under it would pay for a
        # fresh device allocation per jitted call, which a JAX user never runs. They run in
        # a child process of their own, under JAX's pool.
        apart = _hot_jax_suites(runnable)
    elif fresh:
        _warn_of_shared_allocator(runnable)  # the user's own setting: said, not overridden
    # On a terminal the progress bar shows what runs and rich draws the tables; in a log or
    # a pipe, one line per suite as it ends, and plain-text tables.
    lines_per_suite = not sys.stdout.isatty()
    out = Printer(plain=lines_per_suite)
    for module, message in bench.load_errors.items():
        warn(f"benchmark module {module} failed to import: {one_line(message)}")
    children: dict[str, dict[str, Any]] = {}
    quick = " (quick: small sizes, targets not judged at quick sizes)" if args.quick else ""
    start_load = _one_minute_load()
    load = "" if start_load is None else f"; load {start_load:.1f} on {os.cpu_count()} cores"
    out.line(f"jaxbuf bench on {device}{quick}: {len(suites)} suite(s){load}; {threads}")
    interpreted = [s.name for s in runnable if s.uses_interpreter(device)]
    if interpreted:
        out.line(
            f"--interpreter: {', '.join(interpreted)} run under Triton's interpreter here, "
            f"{INTERPRETER_COST}; their figures time the interpreter and are never judged"
        )
    if apart:
        out.line(
            f"{', '.join(apart)} run in a process of their own, on JAX's own memory pool (the "
            "other suites run JAX on its platform allocator: XLA_PYTHON_CLIENT_ALLOCATOR)"
        )
    out.line(RATIO_LINE)

    started = datetime.datetime.now(datetime.timezone.utc)
    results: list[dict[str, Any]] = []
    progress = Progress(len(suites), "benchmarks")
    try:
        for index, suite in enumerate(suites, 1):
            progress.describe(suite.name)
            if suite.name in apart:
                if not children:
                    children.update(_run_apart(apart, device, args))
                results.append({**children[suite.name], "suite": suite})
            else:
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
        if lines_per_suite:  # a pipe or a log: two lines a row, within 120 columns
            columns, cells, right = stacked_table(columns, cells)
            out.table(_suite_title(result), columns, cells, right=right, under=under)
        else:
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
            "own_process": r["suite"].name in apart,
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
        "environment": {
            k: v
            for k, v in os.environ.items()
            if k.startswith("XLA_PYTHON_") or k in THREAD_VARIABLES
        },
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
        for path in _plots.write_plots(serial, args.plot, device, _device_file_name(device)):
            out.line(f"plot: {path}")
    failed = any(r["error"] for r in results)
    return 1 if failed or (args.strict and counts["missed"]) else 0


def _one_minute_load() -> float | None:
    """The machine's 1-minute load average (None where the platform has none): a shared
    machine's figures move with it, so the header and the JSON state it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _hot_jax_suites(suites: list) -> list[str]:
    """The JAX hot-path suites among ``suites``: they need JAX and not fresh allocations."""
    return [
        s.name
        for s in suites
        if "jax" in s.requires and not s.fresh_jax_allocations and s.missing_requirement() is None
    ]


def _row_from_json(data: dict[str, Any]) -> Any:
    """The :class:`~jaxbuf.bench.Row` that :meth:`~jaxbuf.bench.Row.to_json` wrote."""
    import dataclasses

    from jaxbuf.bench import Row

    fields = {f.name for f in dataclasses.fields(Row)}
    values = {k: v for k, v in data.items() if k in fields}
    values["met"] = data.get("target_reached")
    if values.get("spread") is not None:
        values["spread"] = tuple(values["spread"])
    return Row(**values)


def _run_apart(names: list[str], device: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run the suites ``names`` in a child ``jaxbuf bench`` under JAX's default allocator;
    their results by name, as :func:`_run_suite` gives them (``"suite"`` left out). A child
    that writes no result fails each of them with its last words."""
    import json
    import subprocess
    import tempfile

    environment = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_ALLOCATOR"}
    with tempfile.TemporaryDirectory(prefix="jaxbuf-bench-") as directory:
        path = Path(directory) / "apart.json"
        command = [sys.executable, "-m", "jaxbuf", "bench", "--device", str(device)]
        command += ["--json", str(path), "--only", *names]
        command += ["--quick"] * args.quick + ["--interpreter"] * args.interpreter
        if getattr(args, "threads", None) is not None:
            command += ["--threads", str(args.threads)]
        begin = time.perf_counter()
        child = subprocess.run(command, env=environment, capture_output=True, text=True)
        if not path.is_file():
            words = one_line(child.stderr.strip().splitlines()[-1] if child.stderr else "")
            error = f"its own process exited {child.returncode} without a result: {words}"
            seconds = (time.perf_counter() - begin) / len(names)
            return {
                name: {"rows": [], "sizes": None, "error": error, "skipped": None,
                       "seconds": seconds, "interpreter": False}
                for name in names
            }  # fmt: skip
        document = json.loads(path.read_text(encoding="utf-8"))
    return {
        entry["name"]: {
            "rows": [_row_from_json(row) for row in entry["rows"]],
            "sizes": entry["sizes"],
            "error": entry["error"],
            "skipped": entry["skipped"],
            "seconds": entry["seconds"],
            "interpreter": entry["interpreter"],
        }
        for entry in document["suites"]
    }


def _warn_of_shared_allocator(suites: list) -> None:
    """Where the user set ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` themselves, JAX hot-path
    suites run in the one process under it (hundreds of µs a jitted call on an H200), which
    a JAX user never runs: say so, and how to time them apart. (Left to the command, they
    run in a process of their own.)"""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "platform":
        return
    fresh = [s.name for s in suites if s.fresh_jax_allocations]
    hot = _hot_jax_suites(suites)
    if hot:
        warn(
            f"{', '.join(fresh)} run JAX on its platform allocator "
            f"(XLA_PYTHON_CLIENT_ALLOCATOR=platform), and so do {', '.join(hot)} in this run, "
            "slower than under JAX's own pool; for their figures run them apart: "
            f"--only {' '.join(hot)}"
        )
