"""The ``jaxbuf`` command line (``python -m jaxbuf``, also installed as ``jaxbuf``).

Subcommands:

* ``info``: platform, which drivers work here (and why not), library versions, granule sizes;
* ``bench``: the benchmark suites of :mod:`jaxbuf.bench` that mean something on the device,
  a table per suite whose title states the sizes run (every ratio jaxbuf ÷ baseline, lower
  is better), a JSON result file and, with ``--plot``, PNGs of growth cost against committed
  size, of the decode loop's memory and step time, and of the staged apply per pattern. A
  suite whose optional dependency (torch, JAX, Triton) is missing, whose figures need a GPU,
  or whose kernels would run under Triton's interpreter (unless ``--interpreter``) is skipped
  with its reason; a row is judged against its target only at full sizes, outside the
  interpreter, with its baseline measured;
* ``demo``: a terminal walkthrough: grow a buffer four times, seeing the same bytes from torch
  and JAX; then the worked example of notebook 4 (:mod:`jaxbuf.demo`), a toy decode loop over a
  growing paged KV cache, with a progress bar and a summary table.

``--version`` prints the version. ``--device`` defaults to CUDA when it works here, else the
CPU. A bad device or a missing
framework prints one line, ``jaxbuf: error: ...``, on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import _bench, _demo, _info, _plots
from ._demo import decode_steps
from ._shared import CliError

__all__ = ["EXIT_USAGE", "CliError", "main"]

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    from jaxbuf import __version__

    parser = argparse.ArgumentParser(
        prog="jaxbuf", description="Device memory shared zero-copy by JAX and torch."
    )
    parser.add_argument("--version", action="version", version=f"jaxbuf {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{info,bench,demo}")
    device_help = "cpu, cuda or cuda:N (default: CUDA when it works here, else the CPU)"

    info = commands.add_parser(
        "info",
        help="platform, drivers, versions, granule sizes",
        description="Print the platform, which drivers work here (and, for those that do not, "
        "why), the versions of jaxbuf and the frameworks it can share memory with, and each "
        "working device's allocation granule.",
    )
    info.set_defaults(handler=_info.run)

    bench = commands.add_parser(
        "bench",
        help="run the benchmark suites",
        description="Run the benchmark suites that mean something on the device: a table per "
        "suite (notes as footnotes), the legend of baseline kinds, a closing tally of the "
        "targets met, missed and not judged here (and why).",
        epilog=_bench.EXIT_STATUS,
    )
    bench.add_argument("--device", help=device_help)
    bench.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, few repetitions (targets are not judged at quick sizes)",
    )
    bench.add_argument(
        "--interpreter",
        action="store_true",
        help="off a GPU, also run the suites whose Triton kernels run under Triton's "
        "interpreter (their rows are labelled interpreter figures and never judged); "
        f"slow: {_bench.INTERPRETER_COST}",
    )
    bench.add_argument(
        "--json",
        metavar="PATH",
        help="result file (default: results/bench-<device>.json; with --only, "
        "results/bench-<device>-<names>.json, the names joined by +)",
    )
    bench.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a target is missed (by default a run that measured exits 0)",
    )
    bench.add_argument(
        "--plot",
        metavar="PATH",
        nargs="?",
        const=_plots.PLOT_DEFAULT,
        help="also write up to three PNGs, one for each of these suites that ran: growth cost "
        "against committed size (extensible.growth), the decode loop's memory and step time "
        "(jax.decode), the staged apply per write pattern (staged.patterns; rows timed under "
        "Triton's interpreter are not drawn). Default paths: results/growth-<device>.png, "
        "results/decode-<device>.png, results/staged-<device>.png; with PATH, the first "
        "goes there and each other beside it as <stem>-<kind>.png",
    )
    bench.add_argument(
        "--threads",
        type=_bench.thread_count,
        metavar="N",
        help="intra-op threads of torch and OpenMP while timing (default on the CPU: "
        "OMP_NUM_THREADS when set, else 1, so that torch's threads do not fight the timed "
        "work for the cores; on CUDA: torch's own default)",
    )
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="suite names or dotted prefixes (e.g. extensible.views, uva)",
    )
    bench.set_defaults(handler=_bench.run)

    demo = commands.add_parser(
        "demo",
        help="grow a buffer, then run a toy decode loop",
        description="A terminal walkthrough: grow one buffer four times while torch and JAX "
        "read the same bytes through zero-copy views, then run a toy decode loop over a "
        "growing paged KV cache (notebook 04's worked example) with a summary table.",
    )
    demo.add_argument("--device", help=device_help)
    demo.add_argument(
        "--steps",
        type=decode_steps,
        default=20,
        metavar="N",
        help="decode steps (1-20, default 20)",
    )
    demo.add_argument(
        "--framework",
        action="append",
        choices=["torch", "jax"],
        help="framework(s) to show (repeatable; default: torch and jax)",
    )
    demo.set_defaults(handler=_demo.run)
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
