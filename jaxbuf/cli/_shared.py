"""What the subcommands share: one-line errors, tables and progress bars (rich when it is
installed, plain text otherwise), the device to run on, versions and the machine's
description."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

VERSIONED_PACKAGES = (
    "jaxbuf",
    "numpy",
    "torch",
    "jax",
    "jaxlib",
    "triton",
    "cuda-bindings",
    "ml_dtypes",
    "rich",
    "matplotlib",
)


class CliError(Exception):
    """An error the user can fix (bad device, missing framework): one line, exit 2."""


#: The widest line printed where stdout is not a terminal (a pipe, a log, ``| less``).
PIPE_WIDTH = 120


def wrap_line(text: str, width: int = PIPE_WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken between words; the lines
    after the first are indented 4 more than the first (a footnote's continuation)."""
    if len(text) <= width:
        return [text]
    indent = " " * (len(text) - len(text.lstrip(" ")) + 4)
    return textwrap.wrap(
        text,
        width=width,
        subsequent_indent=indent,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [text[:width]]


def warn(text: str) -> None:
    """``jaxbuf: warning: <text>`` on stderr, wrapped at :data:`PIPE_WIDTH` where stderr is
    not a terminal."""
    line = f"jaxbuf: warning: {text}"
    lines = [line] if sys.stderr.isatty() else wrap_line(line)
    print("\n".join(lines), file=sys.stderr)


def _fit_columns(
    columns: Sequence[str], rows: Sequence[Sequence[str]], limit: int, right: set[int]
) -> list[int]:
    """Column widths for a plain table of at most ``limit`` characters (two spaces between
    columns). Numeric columns (``right``) keep their figures whole and wrap their header;
    then the widest text column gives a character at a time, the first (the row name) down
    to 36, the last (a verdict) to 30, the others to 12."""
    cells = [[str(c) for c in column] for column in zip(columns, *rows)]
    widths = [max(map(len, column)) for column in cells]
    last = len(widths) - 1
    floors = []
    for i, column in enumerate(cells):
        header_word = max((len(w) for w in column[0].split()), default=0)
        if i in right:
            floors.append(max([header_word, *map(len, column[1:])]))
        elif i == last:  # a verdict stays whole; a long target under it wraps
            floors.append(min(widths[i], 30))
        else:
            floors.append(min(widths[i], max(header_word, 36 if i == 0 else 12)))
    # Numbers first: their headers wrap and nothing else moves.
    for i in right:
        if sum(widths) + 2 * last <= limit:
            break
        widths[i] = max(floors[i], widths[i] - (sum(widths) + 2 * last - limit))
    while sum(widths) + 2 * last > limit:
        shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    return widths


class Printer:
    """Tables and lines through rich when it is installed, plain text otherwise (or when
    ``plain``: a log reads better without box drawing). Where stdout is not a terminal no
    line is wider than :data:`PIPE_WIDTH`: long lines wrap between words, a wide table's
    text columns wrap inside their cells."""

    def __init__(self, *, plain: bool = False) -> None:
        self.width = None if sys.stdout.isatty() else PIPE_WIDTH
        try:
            if plain:
                raise ImportError("plain text asked for")
            import rich.console
        except ImportError:
            self.console = None
        else:
            self.console = rich.console.Console(width=self.width, highlight=False)

    def line(self, text: str = "", *, flush: bool = False) -> None:
        """Print ``text``; ``flush``: at once, even into a pipe or a log."""
        lines = [text] if self.width is None else wrap_line(text, self.width)
        if self.console is not None:
            for part in lines:
                self.console.print(part, markup=False, soft_wrap=True)
            if flush:
                self.console.file.flush()
        else:
            print("\n".join(lines), flush=flush)

    def table(
        self,
        title: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        right: Sequence[int] = (),
        under: Sequence[str] = (),
    ) -> None:
        """Print a table; ``right`` lists the indices of right-aligned (numeric) columns,
        ``under`` the lines printed under it (footnotes)."""
        show_header = any(columns)
        if self.console is not None:
            import rich.table
            import rich.text

            # Cells are plain text: a row name such as "a.at[r, c].set(v)" is not rich markup.
            table = rich.table.Table(
                title=rich.text.Text(title), title_justify="left", show_header=show_header
            )
            for i, column in enumerate(columns):
                justify = "right" if i in right else "left"
                table.add_column(column, justify=justify, overflow="fold")
            for row in rows:
                table.add_row(*(rich.text.Text(str(cell)) for cell in row))
            self.console.print(table)
            for text in under:
                self.line(text)
            self.line()
            return
        widths = [max(len(str(c)) for c in column) for column in zip(columns, *rows)]
        if self.width is not None:
            widths = _fit_columns(columns, rows, self.width, set(right))
        self.line(title)
        header = [columns, ["-" * w for w in widths]] if show_header else []
        for cells in (*header, *rows):
            wrapped = [
                textwrap.wrap(str(c), w, break_on_hyphens=False) or [""]
                if len(str(c)) > w
                else [str(c)]
                for c, w in zip(cells, widths)
            ]
            for depth in range(max(map(len, wrapped))):
                padded = (
                    (lines[depth] if depth < len(lines) else "").rjust(w)
                    if i in right
                    else (lines[depth] if depth < len(lines) else "").ljust(w)
                    for i, (lines, w) in enumerate(zip(wrapped, widths))
                )
                print("  ".join(padded).rstrip())
        for text in under:
            self.line(text)
        print()


class Progress:
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


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    return {package: version(package) for package in VERSIONED_PACKAGES}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """Names of the CUDA devices, through torch when it has CUDA (else none)."""
    from jaxbuf.drivers import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None or importlib.util.find_spec("torch") is None:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> dict[str, Any]:
    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpu_names(),
    }


def one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split())


def resolve_device(spec: str | None) -> Any:
    """The :class:`~jaxbuf.devices.Device` named by ``spec`` (None: the default), whose
    driver works here; :class:`CliError` otherwise."""
    from jaxbuf.devices import as_device, default_device
    from jaxbuf.drivers import get_vmm_driver

    try:
        device = default_device() if spec is None else as_device(spec)
        get_vmm_driver(device)
    except (ValueError, TypeError, RuntimeError) as error:
        # The driver's advice is worded for the Python API; here the same choice is the option.
        message = one_line(error).replace('Use device="cpu"', "Use --device cpu")
        raise CliError(message) from None
    return device


def require(module: str, purpose: str) -> None:
    """Import ``module`` or raise :class:`CliError` saying why not (with the extra that
    installs it)."""
    from jaxbuf.bench import missing_dependency

    reason = missing_dependency(module)
    if reason is not None:
        raise CliError(f"{purpose} {reason}")
