"""What the subcommands share: one-line errors, tables and progress bars (rich when it is
installed, plain text otherwise), the device to run on, versions and the machine's
description."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
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


class Printer:
    """Tables and lines through rich when it is installed, plain text otherwise (or when
    ``plain``: a log reads better without box drawing)."""

    def __init__(self, *, plain: bool = False) -> None:
        try:
            if plain:
                raise ImportError("plain text asked for")
            import rich.console
        except ImportError:
            self.console = None
        else:
            # Not a terminal (a pipe, a log): wide enough that tables are not wrapped.
            width = None if sys.stdout.isatty() else 160
            self.console = rich.console.Console(width=width, highlight=False)

    def line(self, text: str = "", *, flush: bool = False) -> None:
        """Print ``text``; ``flush``: at once, even into a pipe or a log."""
        if self.console is not None:
            # A line is never wrapped: a log keeps one suite per line.
            self.console.print(text, markup=False, soft_wrap=True)
            if flush:
                self.console.file.flush()
        else:
            print(text, flush=flush)

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
        print(title)
        header = [columns, ["-" * w for w in widths]] if show_header else []
        for cells in (*header, *rows):
            padded = (
                str(c).rjust(w) if i in right else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            )
            print("  ".join(padded).rstrip())
        for text in under:
            print(text)
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
