"""The ``python -m jaxbuf`` command (also installed as ``jaxbuf``).

Subcommands:

* ``info``: platform, which drivers work here (and why not), library versions, granule sizes;
* ``bench``: the benchmark suites of :mod:`jaxbuf.bench`, a table per suite, a JSON result
  file and, with ``--plot``, a PNG of growth cost against committed size;
* ``demo``: a terminal walkthrough: grow a buffer four times, seeing the same bytes from torch
  and JAX; then the worked example of notebook 4 (:mod:`jaxbuf.demo`), a toy decode loop over a
  growing paged KV cache, with a progress bar and a summary table.

``--device`` defaults to CUDA when it works here, else the CPU. A bad device or a missing
framework prints one line, ``jaxbuf: error: ...``, on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2

_VERSIONED_PACKAGES = ("jaxbuf", "numpy", "torch", "jax", "jaxlib", "triton", "cuda-bindings",
                       "ml_dtypes", "rich", "matplotlib")  # fmt: skip
_FRAMEWORK_EXTRAS = {"torch": "torch", "jax": "jax", "matplotlib": "notebooks"}


class CliError(Exception):
    """An error the user can fix (bad device, missing framework): one line, exit 2."""


# -- output -------------------------------------------------------------------------------
class _Printer:
    """Tables and lines through rich when it is installed, plain text otherwise."""

    def __init__(self) -> None:
        try:
            import rich.console
        except ImportError:
            self.console = None
        else:
            # Not a terminal (a pipe, a log): wide enough that tables are not wrapped.
            width = None if sys.stdout.isatty() else 160
            self.console = rich.console.Console(width=width, highlight=False)

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False)
        else:
            print(text)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
              right: Sequence[int] = ()) -> None:  # fmt: skip
        """Print a table; ``right`` lists the indices of right-aligned (numeric) columns."""
        show_header = any(columns)
        if self.console is not None:
            import rich.table

            table = rich.table.Table(title=title, title_justify="left", show_header=show_header)
            for i, column in enumerate(columns):
                table.add_column(column, justify="right" if i in right else "left",
                                 overflow="fold")  # fmt: skip
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return
        widths = [max(len(str(c)) for c in column) for column in zip(columns, *rows)]
        print(title)
        header = [columns, ["-" * w for w in widths]] if show_header else []
        for cells in (*header, *rows):
            print("  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                            for i, (c, w) in enumerate(zip(cells, widths))).rstrip())  # fmt: skip
        print()


class _Progress:
    """A progress bar (rich, else tqdm, else one line per step) over ``total`` steps."""

    def __init__(self, total: int, description: str) -> None:
        self._bar: Any = None
        self._tqdm: Any = None
        try:
            import rich.progress

            self._bar = rich.progress.Progress(
                rich.progress.SpinnerColumn(),
                rich.progress.TextColumn("{task.description}"),
                rich.progress.BarColumn(),
                rich.progress.MofNCompleteColumn(),
                rich.progress.TimeElapsedColumn(),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=total)
        except ImportError:
            try:
                import tqdm

                self._tqdm = tqdm.tqdm(total=total, desc=description, leave=False)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        elif self._tqdm is not None:
            self._tqdm.set_description_str(text)
        else:
            print(f"  {text}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)
        elif self._tqdm is not None:
            self._tqdm.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._tqdm is not None:
            self._tqdm.close()


# -- shared helpers -----------------------------------------------------------------------
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> dict[str, str]:
    return {package: _version(package) for package in _VERSIONED_PACKAGES}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_names() -> list[str]:
    """Names of the CUDA devices, through torch when it has CUDA (else none)."""
    from jaxbuf.drivers import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None or importlib.util.find_spec("torch") is None:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _machine() -> dict[str, Any]:
    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": _gpu_names(),
    }


def _one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split())


def _resolve_device(spec: str | None) -> Any:
    """The :class:`~jaxbuf.devices.Device` named by ``spec`` (None: the default), whose
    driver works here; :class:`CliError` otherwise."""
    from jaxbuf.devices import as_device, default_device
    from jaxbuf.drivers import get_vmm_driver

    try:
        device = default_device() if spec is None else as_device(spec)
        get_vmm_driver(device)
    except (ValueError, TypeError, RuntimeError) as error:
        raise CliError(_one_line(error)) from None
    return device


def _require(module: str) -> None:
    """Import ``module`` or raise :class:`CliError` naming the extra that installs it."""
    extra = _FRAMEWORK_EXTRAS.get(module, module)
    if importlib.util.find_spec(module) is None:
        raise CliError(f"{module} is not installed (pip install 'jaxbuf[{extra}]')")
    try:
        __import__(module)
    except Exception as error:  # noqa: BLE001 - a broken install is reported, in one line
        raise CliError(f"{module} is installed but failed to import: {_one_line(error)}") from None


# -- info ---------------------------------------------------------------------------------
def _cmd_info(args: argparse.Namespace) -> int:
    from jaxbuf.drivers import HostVmmDriver, cuda_unavailable_reason, get_vmm_driver
    from jaxbuf.extensible import granule_size

    out = _Printer()
    machine = _machine()
    out.table("jaxbuf info", ["", ""], [
        ["platform", machine["platform"]],
        ["python", f"{machine['python']} ({sys.executable})"],
        ["machine", f"{machine['node']}: {machine['cpu']}, {machine['cpu_count']} CPUs"],
        ["GPUs", ", ".join(machine["gpus"]) or "none"],
    ])  # fmt: skip

    driver_rows = []
    granule_rows = []
    for name, reason in (("cpu", HostVmmDriver().unavailable_reason()),
                         ("cuda", cuda_unavailable_reason())):  # fmt: skip
        if reason is not None:
            driver_rows.append([name, "unavailable", _one_line(reason)])
            continue
        driver = get_vmm_driver(name)
        count = driver.device_count()
        driver_rows.append([name, "works", f"{count} device(s)"])
        for index in range(count):
            device = name if name == "cpu" else f"cuda:{index}"
            granule_rows.append([device, f"{granule_size(device) // 1024:,} KiB",
                                 f"{driver.granularity(index) // 1024:,} KiB"])  # fmt: skip
    out.table("drivers", ["driver", "status", "details"], driver_rows)
    out.table("granules", ["device", "commit granule", "driver granularity"], granule_rows)
    out.table("versions", ["package", "version"], [[k, v] for k, v in _versions().items()])
    try:
        default = _resolve_device(None)
    except CliError as error:
        default = f"none ({error})"
    out.line(f"default device: {default}")
    return 0


# -- bench --------------------------------------------------------------------------------
def _default_json_path(device: Any) -> Path:
    name = device.platform if device.index == 0 else f"{device.platform}{device.index}"
    return Path("results") / f"bench-{name}.json"


def _row_cells(row: Any) -> list[str]:
    from jaxbuf.bench import format_seconds

    ratio = row.ratio
    target = ""
    if row.target:
        target = f"{row.target} {'ok' if row.met else 'MISSED'}"
    notes = [row.notes] if row.notes else []
    if row.device_median_s is not None:
        notes.append(f"device {format_seconds(row.device_median_s)}")
    if row.baseline_device_median_s is not None:
        notes.append(f"baseline device {format_seconds(row.baseline_device_median_s)}")
    return [row.name, format_seconds(row.median_s), row.baseline_name or "—",
            format_seconds(row.baseline_median_s),
            "—" if ratio is None else f"{ratio:,.3g}x", target, "; ".join(notes)]  # fmt: skip


def _plot_growth(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of growth cost against committed size, beside realloc+copy. False: no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxbuf.bench import format_bytes

    # series[step][label] = {committed_bytes: seconds}
    series: dict[int, dict[str, dict[int, float]]] = {}
    labels = {"seed": "seed-style (granule set)", "torch": "torch realloc+copy",
              "jax": "JAX realloc+copy"}  # fmt: skip
    for result in results:
        for row in result["rows"]:
            params = row["params"]
            if "committed_bytes" not in params or "step_bytes" not in params:
                continue
            by_label = series.setdefault(params["step_bytes"], {})
            committed = params["committed_bytes"]
            by_label.setdefault("jaxbuf ExtensibleTensor", {})[committed] = row["median_s"]
            if row["baseline_median_s"] is not None:
                label = labels.get(params.get("baseline_kind"), row["baseline_name"])
                by_label.setdefault(label, {})[committed] = row["baseline_median_s"]
    if not series:
        return False
    figure, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.5), squeeze=False)
    for axis, (step, by_label) in zip(axes[0], sorted(series.items())):
        for label, points in by_label.items():
            xs = sorted(points)
            axis.plot([x / 2**30 for x in xs], [points[x] for x in xs], marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("already committed (GiB)")
        axis.set_ylabel("time per grow (s)")
        axis.set_title(f"grow by {format_bytes(step)} on {device}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _cmd_bench(args: argparse.Namespace) -> int:
    # Baselines reallocate to sizes never allocated before: JAX must not serve them from
    # its pool (nor keep tens of GiB pooled for the suites after them), as torch's cache
    # is emptied between samples. Set before JAX starts; a user's setting wins.
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    device = _resolve_device(args.device)
    if args.plot is not None:
        _require("matplotlib")
    from jaxbuf import bench

    try:
        suites = bench.select_suites(args.only)
    except ValueError as error:
        raise CliError(_one_line(error)) from None
    out = _Printer()
    for module, message in bench.load_errors.items():
        print(f"jaxbuf: warning: benchmark module {module} failed to import: "
              f"{_one_line(message)}", file=sys.stderr)  # fmt: skip
    out.line(f"jaxbuf bench on {device}{' (quick)' if args.quick else ''}: "
             f"{len(suites)} suite(s)")  # fmt: skip

    started = datetime.datetime.now(datetime.timezone.utc)
    results: list[dict[str, Any]] = []
    failed = False
    progress = _Progress(len(suites), "benchmarks")
    try:
        for suite in suites:
            progress.describe(suite.name)
            rows, error = [], None
            begin = time.perf_counter()
            try:
                for row in suite.run(device, args.quick):
                    rows.append(row)
                    progress.describe(f"{suite.name}: {row.name}")
            except Exception as exc:  # noqa: BLE001 - reported below, other suites still run
                failed = True
                error = f"{type(exc).__name__}: {_one_line(exc)}"
                traceback.print_exc(file=sys.stderr)
            results.append({"suite": suite, "rows": rows, "error": error,
                            "seconds": time.perf_counter() - begin})  # fmt: skip
            progress.advance()
    finally:
        progress.close()

    columns = ["name", "median", "baseline", "baseline median", "speedup", "target", "notes"]
    for result in results:
        suite = result["suite"]
        title = f"{suite.name}: {suite.description} ({result['seconds']:.1f} s)"
        out.table(title, columns, [_row_cells(row) for row in result["rows"]],
                  right=(1, 3, 4))
        if result["error"]:
            out.line(f"  {suite.name} FAILED: {result['error']}")

    serial = [{"name": r["suite"].name, "description": r["suite"].description,
               "seconds": r["seconds"], "error": r["error"],
               "rows": [row.to_json() for row in r["rows"]]} for r in results]  # fmt: skip
    document = {
        "date": started.isoformat(timespec="seconds"),
        "command": ["jaxbuf", *sys.argv[1:]] if args.argv is None else ["jaxbuf", *args.argv],
        "device": str(device),
        "quick": args.quick,
        "machine": _machine(),
        "versions": _versions(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_")},
        "speedup": "baseline_median_s / median_s",
        "suites": serial,
        "load_errors": dict(bench.load_errors),
    }
    json_path = Path(args.json) if args.json else _default_json_path(device)
    import json

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    out.line(f"results: {json_path}")
    if args.plot is not None:
        plot_path = Path(args.plot)
        if _plot_growth(serial, plot_path, device):
            out.line(f"plot: {plot_path}")
        else:
            print("jaxbuf: warning: no growth rows to plot (run the extensible.growth suite)",
                  file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


# -- demo ---------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    device = _resolve_device(args.device)
    frameworks = args.framework or ["torch", "jax"]
    for framework in frameworks:
        _require(framework)
    from jaxbuf.bench import format_bytes
    from jaxbuf.extensible import ExtensibleTensor

    out = _Printer()
    capacity = 64 << 20
    buf = ExtensibleTensor(capacity, device=device)
    base_ptr = buf.base_ptr
    out.line(f"Part 1: reserved {format_bytes(buf.capacity_bytes)} of address space on {device} at "
             f"{base_ptr:#x}; nothing is committed yet ({buf.physical_bytes} bytes).")  # fmt: skip
    if len(frameworks) == 2:
        out.line("Growing four times; each step writes its number into the new bytes through "
                 "torch and sums the whole buffer through both torch and JAX.")
    else:
        out.line(f"Growing four times (zeroing the new bytes); {frameworks[0]} reads the "
                 "buffer after each grow.")
    # Small enough that every float32 partial sum is an exact integer (< 2**24).
    sizes = [2 << 20, 4 << 20, 6 << 20, 8 << 20]
    rows, all_ok = [], True
    progress = _Progress(len(sizes), "growing")
    try:
        for step, size in enumerate(sizes, start=1):
            old = buf.num_bytes
            # torch overwrites every new byte; without it, zero them on the device.
            buf.resize_per_segment_(size, zero_new="torch" not in frameworks)
            view = buf.segment_view(0).view("float32")
            same_base = buf.base_ptr == base_ptr
            row = [str(step), format_bytes(size), format_bytes(buf.physical_bytes),
                   str(buf.num_physical_chunks), "yes" if same_base else "NO"]  # fmt: skip
            # Step i fills its new bytes with the float i.
            expected = sum(i * (new - prev) // 4 for i, (prev, new)
                           in enumerate(zip([0, *sizes], sizes[:step]), start=1))  # fmt: skip
            sums = []
            if "torch" in frameworks:
                import torch

                tensor = view.to_torch()
                tensor[old // 4:] = float(step)  # write the new bytes through torch
                if device.is_cuda:
                    torch.cuda.synchronize(device.index)
                sums.append(int(tensor.double().sum().item()))
                row += [f"{tensor.data_ptr():#x}", f"{sums[-1]:,}"]
                del tensor
            else:
                expected = 0  # zero_new zeroed the new bytes; nothing writes them
            if "jax" in frameworks:
                array = view.to_jax()  # reads what torch wrote: the same bytes
                sums.append(int(array.sum()))
                row += [f"{array.unsafe_buffer_pointer():#x}", f"{sums[-1]:,}"]
                del array
            ok = same_base and all(total == expected for total in sums)
            all_ok = all_ok and ok
            rows.append([*row, "ok" if ok else f"MISMATCH (expected {expected:,})"])
            progress.advance()
    finally:
        progress.close()
    columns = ["step", "committed", "physical", "chunks", "same base_ptr"]
    if "torch" in frameworks:
        columns += ["torch data_ptr", "torch sum"]
    if "jax" in frameworks:
        columns += ["JAX buffer ptr", "JAX sum"]
    columns.append("check")
    out.table(f"ExtensibleTensor on {device}: grown 4 times, one base pointer", columns, rows,
              right=(1, 2, 3, 6, 8))
    out.line("Every framework array points at the same address: the buffer grew in place, "
             "so views (and CUDA graphs) taken before a grow stay valid after it.")
    buf.free()
    if len(frameworks) == 2:
        all_ok = _decode_demo(out, device, args.steps) and all_ok
    else:
        out.line("(The decode-loop part needs both torch and JAX; run without --framework.)")
    return 0 if all_ok else 1


def _decode_demo(out: _Printer, device: Any, steps: int) -> bool:
    """Part 2: the decode loop of notebook 4, with a progress bar and a summary table."""
    import statistics

    from jaxbuf.bench import format_bytes, format_seconds
    from jaxbuf.demo import run_decode_demo

    out.line()
    out.line(f"Part 2: the decode loop of notebooks/04_decode_loop.py on {device}: a paged KV "
             "cache (ExtensibleTensor) that commits a page as a sequence crosses a block, a "
             "block table updated by staged writes, per-step metadata from a UVA pool, and "
             "torch checking JAX's attention on the same memory every step.")  # fmt: skip
    progress = _Progress(steps, "decoding")

    def on_step(record: dict[str, Any]) -> None:
        progress.describe(f"step {record['step']}: "
                          f"{format_bytes(record['committed_bytes'])} committed")  # fmt: skip
        progress.advance()

    try:
        records = run_decode_demo(device, steps, progress=on_step)
    finally:
        progress.close()
    grew = [r["step"] for r in records if r["grew"]]
    failed = [r["step"] for r in records if not r["check_ok"]]
    worst = max(r["max_diff"] for r in records)
    first, last = records[0], records[-1]
    step_s = [r["step_s"] for r in records]
    steady = [r["step_s"] for r in records[1:] if not r["grew"]]
    check = (f"ok: {len(records)}/{len(records)} steps, max |diff| {worst:.1e}" if not failed
             else f"MISMATCH at steps {failed} (max |diff| {worst:.1e})")  # fmt: skip
    growth = (f"{sum(r['new_pages'] for r in records)} page(s) at steps "
              f"{', '.join(map(str, grew)) or 'none'}")  # fmt: skip
    committed = (f"{format_bytes(first['committed_bytes'])} -> "
                 f"{format_bytes(last['committed_bytes'])} "
                 f"(physical {format_bytes(last['physical_bytes'])})")  # fmt: skip
    median = (f"{format_seconds(statistics.median(step_s))} (steps without growth "
              f"{format_seconds(statistics.median(steady) if steady else None)}; "
              "growth steps re-trace the JAX step for the new cache shape)")  # fmt: skip
    lengths = f"{first['lengths']} -> {last['lengths']}"
    out.table(f"decode loop on {device}: summary", ["", ""], [
        ["steps", f"{len(records)} (4 sequences, lengths {lengths})"],
        ["growth events", growth],
        ["committed (K + V)", committed],
        ["median step", median],
        ["torch check", check],
    ])  # fmt: skip
    return not failed


def _decode_steps(text: str) -> int:
    """``--steps``: the decode loop's cache holds 20 more tokens after its prefill."""
    if not text.isdigit() or not 1 <= int(text) <= 20:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 20, got {text!r}")
    return int(text)


# -- entry point --------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxbuf", description="Device memory shared zero-copy by JAX and torch."
    )
    commands = parser.add_subparsers(dest="command", metavar="{info,bench,demo}")
    device_help = "cpu, cuda or cuda:N (default: CUDA when it works here, else the CPU)"

    info = commands.add_parser("info", help="platform, drivers, versions, granule sizes")
    info.set_defaults(handler=_cmd_info)

    bench = commands.add_parser("bench", help="run the benchmark suites")
    bench.add_argument("--device", help=device_help)
    bench.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    bench.add_argument("--json", metavar="PATH",
                       help="result file (default: results/bench-<device>.json)")
    bench.add_argument("--plot", metavar="PATH",
                       help="also write a PNG of growth cost against committed size")
    bench.add_argument("--only", nargs="+", metavar="NAME",
                       help="suite names or dotted prefixes (e.g. extensible.views, uva)")
    bench.set_defaults(handler=_cmd_bench)

    demo = commands.add_parser("demo", help="grow a buffer, then run a toy decode loop")
    demo.add_argument("--device", help=device_help)
    demo.add_argument("--steps", type=_decode_steps, default=20, metavar="N",
                      help="decode steps (1-20, default 20)")
    demo.add_argument("--framework", action="append", choices=["torch", "jax"],
                      help="framework(s) to show (repeatable; default: torch and jax)")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    # JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = None if argv is None else list(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except CliError as error:
        print(f"jaxbuf: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("jaxbuf: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
