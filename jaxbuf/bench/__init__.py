"""Benchmark suites run by ``python -m jaxbuf bench``, and the registry that finds them.

Registry
--------
A *suite* is a function ``(device, quick) -> Iterable[Row]``: ``device`` is a
:class:`jaxbuf.devices.Device` whose driver works, ``quick`` asks for small sizes and few
repetitions (the test suite runs every suite with ``quick=True`` in seconds). Each
:class:`Row` compares one measurement with a baseline **measured in the same run**. A suite
may return a list or be a generator: a generator lets the progress bar advance per row.

Adding a suite is one line, the decorator, in any public module of this package (modules
whose name starts with ``_`` are helpers and are not scanned)::

    # jaxbuf/bench/uva.py
    from jaxbuf.bench import Row, suite

    @suite("uva.copy_to_gpu")
    def copy_to_gpu(device, quick):
        ...
        yield Row("copy_to_gpu 1 MiB", median_s, "torch .to(device)", baseline_s)

:func:`load_suites` imports every module of the package once; a module that fails to import
is reported (``load_errors``) instead of stopping the others. Suite names are dotted,
``<module>.<what>``, so ``--only uva`` selects every suite of ``uva.py``.

Rules for suites: free every buffer before returning (or before the next row, for big ones);
time with :mod:`jaxbuf.bench._timing`; put what the plot or a reader needs into
``Row.params`` (plain JSON values). Suites run in one process, in registration order (the
modules in alphabetical order). The command runs JAX with
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (unless set): every JAX allocation is a fresh
device allocation, returned on release, as realloc baselines need; time JAX work that
allocates with that in mind.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SUITES", "Row", "Suite", "format_bytes", "format_seconds", "load_errors", "load_suites",
    "select_suites", "suite",
]


@dataclass
class Row:
    """One line of a benchmark table.

    ``ratio`` is ``baseline_median_s / median_s``: above 1, the measured thing is faster than
    its baseline. A baseline that could not run (framework missing, out of memory) has
    ``baseline_median_s=None`` and says why in ``notes``. ``target`` states the goal in
    words (``">= 1000x"``), ``met`` whether this run reached it (None: no goal).
    ``device_median_s`` is the device-side time where host and device time differ
    (CUDA events around asynchronous work).
    """

    name: str
    median_s: float | None
    baseline_name: str = ""
    baseline_median_s: float | None = None
    notes: str = ""
    target: str = ""
    met: bool | None = None
    device_median_s: float | None = None
    baseline_device_median_s: float | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if not self.median_s or self.baseline_median_s is None:
            return None
        return self.baseline_median_s / self.median_s

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratio"] = self.ratio
        return data


SuiteFunction = Callable[[Any, bool], Iterable[Row]]


@dataclass(frozen=True)
class Suite:
    name: str
    function: SuiteFunction
    description: str

    def run(self, device: Any, quick: bool) -> Iterable[Row]:
        return self.function(device, quick)


#: Registered suites by name, in registration order.
SUITES: dict[str, Suite] = {}
#: ``module name -> error message`` for suite modules that failed to import.
load_errors: dict[str, str] = {}
_loaded = False


def suite(name: str) -> Callable[[SuiteFunction], SuiteFunction]:
    """Register the decorated function as the benchmark suite ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"suite name must be a non-empty string, got {name!r}")

    def register(function: SuiteFunction) -> SuiteFunction:
        if name in SUITES and SUITES[name].function is not function:
            raise ValueError(f"benchmark suite {name!r} is registered twice")
        doc = (function.__doc__ or "").strip().splitlines()
        SUITES[name] = Suite(name, function, doc[0] if doc else "")
        return function

    return register


def load_suites() -> dict[str, Suite]:
    """Import every public module of this package (once) and return :data:`SUITES`."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in pkgutil.iter_modules(__path__):
            if module.name.startswith("_"):
                continue
            qualified = f"{__name__}.{module.name}"
            try:
                importlib.import_module(qualified)
            except Exception as error:  # noqa: BLE001 - reported by the command
                load_errors[qualified] = f"{type(error).__name__}: {error}"
    return SUITES


def select_suites(only: Iterable[str] | None = None) -> list[Suite]:
    """The suites named by ``only`` (exact names or dotted prefixes); all when empty.

    Raises ``ValueError`` naming a pattern that matches no suite.
    """
    suites = load_suites()
    patterns = list(only or [])
    if not patterns:
        return list(suites.values())
    chosen: list[Suite] = []
    for pattern in patterns:
        matches = [s for name, s in suites.items()
                   if name == pattern or name.startswith(pattern + ".")]  # fmt: skip
        if not matches:
            known = ", ".join(suites) or "none"
            raise ValueError(f"no benchmark suite matches {pattern!r}; known suites: {known}")
        chosen.extend(s for s in matches if s not in chosen)
    return chosen


def format_bytes(size: int) -> str:
    """``2097152 -> '2 MiB'``; exact binary units where they divide, else one decimal."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if size % scale == 0 else f"{value:.1f} {unit}"
    return f"{size} B"


def format_seconds(seconds: float | None) -> str:
    """``1.5e-06 -> '1.50 µs'``; ``None -> '—'``."""
    if seconds is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"
