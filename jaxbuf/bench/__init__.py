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
    from jaxbuf.bench import Row, Sizes, suite

    @suite("uva.copy_to_gpu", requires=("torch",))
    def copy_to_gpu(device, quick):
        # docstring: "Host time of a copy to the device against torch's .to(device)."
        sizes = [4 << 10] if quick else [4 << 10, 1 << 20]
        yield Sizes(", ".join(map(format_bytes, sizes)))
        ...
        yield Row("copy_to_gpu 1 MiB", median_s, "torch .to(device)", baseline_s)

:func:`load_suites` imports every module of the package once; a module that fails to import
is reported (``load_errors``) instead of stopping the others. Suite names are dotted,
``<area>.<what>``, the area being the module's name or its prefix (``extensible.py`` and
``extensible_overhead.py`` both register ``extensible.*`` suites), so ``--only uva`` selects
every suite of ``uva.py``.

Rules for suites:

* The docstring's first paragraph is the suite's title; it names no sizes, because they
  depend on the device and ``--quick``. The suite yields one :class:`Sizes` (before its
  rows) saying what it actually measures; the command appends it to the title.
* A suite that needs an optional framework names it: ``requires=("torch",)`` is checked
  before the suite runs; a need that depends on the device (Triton only on CUDA) is
  :func:`require` inside the suite. Either way a missing dependency skips the suite with
  its reason (:class:`SuiteSkipped`), never a traceback. A baseline that cannot run
  (framework missing, out of memory) keeps its row, with ``baseline_median_s=None`` and
  the reason in ``notes``; such a row is never judged against its target.
* Every ratio is jaxbuf ÷ baseline (:attr:`Row.ratio`, lower is better), and every target
  says where that ratio or time must stay in the same direction: ``"<= 1.2x the floor"``,
  ``"<= 0.001x"`` (a thousandth of realloc+copy's time), ``"<= 2 µs"``. Targets are set
  for full sizes on a GPU: rows of a ``quick`` run and interpreter rows are not judged.
* A suite whose figures mean nothing off a GPU (a peer read, UVA against device memory,
  both host RAM on the CPU) says why in ``gpu_only=``; one whose kernels run under Triton's
  interpreter off a GPU is ``interpreted=True``: the command skips it there unless asked
  (``--interpreter``), and labels its rows as interpreter figures.
* Free every buffer before returning (or before the next row, for big ones); time with
  :mod:`jaxbuf.bench._timing`; put what the plot or a reader needs into ``Row.params``
  (plain JSON values).

Suites run in one process, in registration order (the modules in alphabetical order). When a
selected suite is registered with ``fresh_jax_allocations=True`` (its baselines reallocate, or
it reports device memory), the command runs JAX with ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``
(unless set): every JAX allocation is then a fresh device allocation, returned on release, and
every other JAX suite in that process would pay for it too (tens to hundreds of µs a jitted
call): the command runs the JAX hot-path suites of such a run in a child process of their own,
under JAX's default pool, as a JAX user runs them.

A target is judged only when its margin is clear of the run's own spread widened by
:data:`TOLERANCE` (:attr:`Row.too_close`): a verdict that a rerun would flip is not given.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxbuf.bench._verdict import (
    NOT_JUDGED,
    TOLERANCE,
    is_time_target,
    parse_target,
    ratio_spread,
    time_spread,
)

__all__ = [
    "BASELINE_KINDS",
    "NOT_JUDGED",
    "RATIO",
    "SUITES",
    "Row",
    "Sizes",
    "Suite",
    "SuiteSkipped",
    "TOLERANCE",
    "baseline_kind",
    "format_bytes",
    "format_seconds",
    "load_errors",
    "load_suites",
    "missing_dependency",
    "ratio_spread",
    "require",
    "select_suites",
    "suite",
    "time_spread",
]

#: The extra of ``pip install 'jaxbuf[...]'`` that installs each optional module.
EXTRA_FOR_MODULE = {
    "torch": "torch",
    "jax": "jax",
    "jaxlib": "jax",
    "triton": "triton",
    "cuda.bindings": "cuda",
    "matplotlib": "plot",
    "rich": "cli",
}


#: What every ratio is, in the table header and the JSON result: lower is better.
RATIO = "jaxbuf ÷ baseline"


@dataclass
class Row:
    """One line of a benchmark table.

    ``ratio`` is ``median_s / baseline_median_s``, jaxbuf ÷ baseline: below 1, the measured
    thing is faster than its baseline (lower is better, in every suite). A baseline that
    could not run (framework missing, out of memory) has ``baseline_median_s=None`` and says
    why in ``notes``. ``target`` states the goal in the same direction (``"<= 0.001x"``: at
    most a thousandth of the baseline's time; ``"<= 2 µs"``), ``met`` whether this run
    reached it (None: no goal). ``device_median_s`` is the device-side time where host and
    device time differ (CUDA events around asynchronous work).

    Targets are set for full sizes on a GPU: a row measured at ``--quick`` sizes
    (``at_quick_sizes``) or under Triton's interpreter (``interpreter``) is reported, never
    judged, unless its target holds at any size (``size_independent``: a memory bound).
    ``not_judged_here`` says why this device cannot judge the target (a GPU target on the
    CPU, and why the CPU differs); such a row is reported, never judged.

    A row that measures something other than a time (bytes held) has ``median_s=None`` and
    says what it measured in ``value``. ``limit`` is the target's bound in the unit of the
    judged quantity (the ratio for an ``x`` target, seconds for a time) and ``spread`` that
    quantity's interquartile range in this run (:func:`ratio_spread`, :func:`time_spread`).
    A target ``"<= 1.2x ..."`` or ``"<= 2 µs"`` gives its own ``limit`` when a suite sets
    none. The row is judged only when its margin is clear (:attr:`too_close`, :data:`TOLERANCE`).
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
    at_quick_sizes: bool = False
    interpreter: bool = False
    size_independent: bool = False
    value: str = ""
    not_judged_here: str = ""
    limit: float | None = None
    spread: tuple[float, float] | None = None

    @property
    def ratio(self) -> float | None:
        """jaxbuf ÷ baseline (lower is better), or None without both medians."""
        if self.median_s is None or not self.baseline_median_s:
            return None
        return self.median_s / self.baseline_median_s

    @property
    def baseline_skipped(self) -> bool:
        """A baseline is named but was not measured (its framework missing, out of memory)."""
        return bool(self.baseline_name) and self.baseline_median_s is None

    @property
    def measured(self) -> bool:
        """Whether the row holds a measurement: a time, or a ``value`` of another kind."""
        return self.median_s is not None or bool(self.value)

    def _bound(self) -> tuple[float, tuple[float, float]] | None:
        """``(limit, (low, high))``: the target's bound and where this run puts the judged
        quantity (its spread, else its median alone); None when neither can be had. A bound
        read from the target is used only where it gives the suite's own verdict: a suite
        that judged another quantity (device time, say) keeps its verdict."""
        if self.limit is not None:
            if self.spread is not None:
                return self.limit, self.spread
            value = self.ratio if not is_time_target(self.target) else self.median_s
            return None if value is None else (self.limit, (value, value))
        parsed = parse_target(self.target)
        if parsed is None:
            return None
        limit, is_time = parsed
        value = self.median_s if is_time else self.ratio
        if value is None or (value <= limit) != bool(self.met):
            return None
        return limit, (value, value)

    @property
    def too_close(self) -> bool:
        """Whether the verdict could flip on a rerun: the judged quantity's spread in this
        run (or its median, without one), widened by :data:`TOLERANCE` on each side, reaches
        across the target's bound. One run's spread does not show how much the next run
        moves (another process's load, another memory layout), hence the tolerance."""
        bound = self._bound()
        if bound is None:
            return False
        limit, (low, high) = bound
        return low * (1 - TOLERANCE) <= limit < high * (1 + TOLERANCE)

    @property
    def not_judged_reason(self) -> str:
        """Why a row with a target is not judged (``""`` when it is, or has no target): one
        of :data:`NOT_JUDGED` (a key, a short phrase), or :attr:`not_judged_here`."""
        if not self.target:
            return ""
        if not self.measured or self.met is None:
            return "not measured"
        if self.baseline_skipped:
            return "baseline not measured"
        if self.not_judged_here:
            return self.not_judged_here
        if not self.size_independent:
            if self.interpreter:
                return "interpreter"
            if self.at_quick_sizes:
                return "quick sizes"
        if self.too_close:
            return "too close to call"
        return ""

    @property
    def judged(self) -> bool | None:
        """``met``, or None where the row cannot be judged (:attr:`not_judged_reason`): no
        target, nothing measured, a skipped baseline (no evidence that the target was
        missed), a target this device cannot judge, quick sizes or the interpreter (the
        target is set for full sizes on a GPU), a bound inside the run's spread."""
        if not self.target or self.not_judged_reason:
            return None
        return self.met

    @property
    def verdict(self) -> str:
        """The target and its verdict in words: ``"<target> ok"``, ``"<target> MISSED"``,
        ``"<target> not judged (<reason>)"`` (see :attr:`not_judged_reason`), ``""`` without
        a target."""
        if not self.target:
            return ""
        judged = self.judged
        if judged is not None:
            return f"{self.target} {'ok' if judged else 'MISSED'}"
        return f"{self.target} not judged ({self.not_judged_reason})"

    def to_json(self) -> dict[str, Any]:
        """Plain values: ``met`` is the judgement (:attr:`judged`), ``target_reached``
        whether this run's figures reach the target, judged or not."""
        data = asdict(self)
        data["ratio"] = self.ratio
        data["target_reached"] = data.pop("met")
        data["met"] = self.judged
        data["not_judged_reason"] = self.not_judged_reason or None
        if self.spread is not None:
            data["spread"] = list(self.spread)
        return data


#: The kinds of baseline, by the words a baseline's name starts with (:func:`baseline_kind`),
#: and what each one is. The command prints those a run used, as a legend.
BASELINE_KINDS = {
    "floor": "the raw driver or copy calls the operation cannot avoid: the least it can cost",
    "seed-style": "the vLLM seed's algorithm and data structures, re-implemented here and run "
    "on the same memory (the seeds need vLLM's build)",
    "torch": "what a torch user writes for the same result, in torch's own memory",
    "plain JAX": "what a JAX user writes for the same result, in JAX's own memory",
    "realloc+copy": "a buffer that grows by allocating the new size, copying, freeing the old",
    "preallocated": "a buffer allocated at its largest size up front",
    "NIXL": "NIXL used directly, on memory registered by hand",
    "copy": "moving the bytes themselves (a memcpy, a socket send) instead of sharing them",
    "jaxbuf": "jaxbuf itself at another size or state: how its cost scales",
    "own memory": "the same read by a device of its own memory: no bus crossed",
    "Triton": "Triton's own kernel launcher",
    "serial": "the same writes applied one group after another (no overlap resolution)",
    "other": "named in full in the baseline column",
}

# (prefix of a baseline name, lower case, its kind), the first match wins: ordered so that a
# longer phrase ("seed-style ...", "torch realloc+copy") is tried before a shorter one.
_KIND_PREFIXES = (
    ("seed-style", "seed-style"),
    ("raw ", "floor"),
    ("floor", "floor"),
    ("jaxbuf", "jaxbuf"),
    ("stage_write", "jaxbuf"),
    ("capsule path", "jaxbuf"),
    ("testing.nop(torch", "torch"),
    ("tvm_ffi.from_dlpack(torch", "torch"),
    ("preallocated", "preallocated"),
    ("realloc+copy", "realloc+copy"),
    ("torch realloc+copy", "realloc+copy"),
    ("jax realloc+copy", "realloc+copy"),
    ("grow + ", "NIXL"),
    ("nixl", "NIXL"),
    ("np.copyto", "copy"),
    ("re-send", "copy"),
    ("copy ", "copy"),
    ("read ", "own memory"),
    ("cuda:", "own memory"),
    ("triton", "Triton"),
    ("host overlap test", "serial"),
    ("plain jax", "plain JAX"),
    ("jax", "plain JAX"),
    ("torch", "torch"),
    ("pin_memory", "torch"),
)


def baseline_kind(baseline_name: str) -> str:
    """The :data:`BASELINE_KINDS` key of a baseline, from the words its name starts with
    (``"seed-style (granule set)" -> "seed-style"``): ``""`` without a baseline, ``"other"``
    for a name of no known kind (a new baseline names its kind first, or adds one here)."""
    if not baseline_name:
        return ""
    lowered = baseline_name.lower()
    for prefix, kind in _KIND_PREFIXES:
        if lowered.startswith(prefix):
            return kind
    return "other"


@dataclass(frozen=True)
class Sizes:
    """What a suite actually measured, in words (``"+2 MiB, +8 MiB onto 8-128 MiB"``).

    Yielded once by a suite among its rows; the command shows it in the suite's title and
    the JSON result (``"sizes"``). Sizes depend on the device and ``--quick``, so only the
    run can state them.
    """

    text: str


class SuiteSkipped(Exception):
    """Raised by a suite (usually through :func:`require`) that cannot run here; the message
    says why. The command reports it as a skip, not a failure."""


def missing_dependency(module: str) -> str | None:
    """Why the optional ``module`` cannot be used here (not installed, or failing to import,
    with the extra that installs it), or None when it imports."""
    extra = EXTRA_FOR_MODULE.get(module, module.split(".")[0])
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked in sys.modules
        found = False
    if not found:
        return f"needs {module}, which is not installed (pip install 'jaxbuf[{extra}]')"
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - a broken install is a reason, in one line
        message = " ".join(f"{type(error).__name__}: {error}".split())
        return f"needs {module}, which is installed but failed to import: {message}"
    return None


def require(*modules: str) -> None:
    """Raise :class:`SuiteSkipped` naming the first of ``modules`` that cannot be used."""
    for module in modules:
        reason = missing_dependency(module)
        if reason is not None:
            raise SuiteSkipped(reason)


SuiteFunction = Callable[[Any, bool], Iterable["Row | Sizes"]]


@dataclass(frozen=True)
class Suite:
    """A registered suite: ``function(device, quick)`` yields :class:`Row` s and one
    :class:`Sizes`; ``requires`` names the optional modules it cannot run without.

    ``gpu_only`` says why its figures mean nothing off a CUDA GPU (it is skipped there, with
    that reason); ``interpreted``: off a GPU its kernels run under Triton's interpreter, so it
    runs there only on request, its rows labelled as interpreter figures and never judged.
    """

    name: str
    function: SuiteFunction
    description: str
    requires: tuple[str, ...] = ()
    fresh_jax_allocations: bool = False
    gpu_only: str = ""
    interpreted: bool = False

    def missing_requirement(self) -> str | None:
        """Why this suite cannot run here (the first missing requirement), or None."""
        for module in self.requires:
            reason = missing_dependency(module)
            if reason is not None:
                return reason
        return None

    def uses_interpreter(self, device: Any) -> bool:
        """Whether this suite's kernels would run under Triton's interpreter on ``device``."""
        return self.interpreted and not getattr(device, "is_cuda", False)

    def skip_reason(self, device: Any, *, interpreter: bool = False) -> str | None:
        """Why this suite does not run on ``device`` (a missing requirement, a GPU-only
        measurement, interpreter figures not asked for with ``interpreter``), or None."""
        if self.gpu_only and not getattr(device, "is_cuda", False):
            return f"needs a CUDA GPU: {self.gpu_only}"
        if self.uses_interpreter(device) and not interpreter:
            return (
                "off a GPU its kernels run under Triton's interpreter, which times the "
                "interpreter, not jaxbuf (--interpreter runs it, labelled as such)"
            )
        return self.missing_requirement()

    def run(
        self,
        device: Any,
        quick: bool,
        sizes: Callable[[str], None] | None = None,
    ) -> Iterator[Row]:
        """The suite's rows, as it produces them, marked as measured at quick sizes or under
        the interpreter where they were; the :class:`Sizes` it states go to ``sizes`` (the
        command's title), and are dropped without it."""
        interpreted = self.uses_interpreter(device)
        for item in self.function(device, quick):
            if isinstance(item, Row):
                item.at_quick_sizes = item.at_quick_sizes or bool(quick)
                item.interpreter = item.interpreter or interpreted
                yield item
            elif isinstance(item, Sizes):
                if sizes is not None:
                    sizes(item.text)
            else:
                raise TypeError(f"suite {self.name} yielded {item!r}, not a Row or Sizes")


#: Registered suites by name, in registration order.
SUITES: dict[str, Suite] = {}
#: ``module name -> error message`` for suite modules that failed to import.
load_errors: dict[str, str] = {}
_loaded = False


def _first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line (a title may wrap in the source)."""
    paragraph = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def suite(
    name: str,
    *,
    requires: Sequence[str] = (),
    fresh_jax_allocations: bool = False,
    gpu_only: str = "",
    interpreted: bool = False,
) -> Callable[[SuiteFunction], SuiteFunction]:
    """Register the decorated function as the benchmark suite ``name``, which cannot run
    without the optional modules ``requires`` (import names: ``"torch"``, ``"triton"``).
    ``fresh_jax_allocations``: its numbers need JAX to allocate from the device each time
    (realloc baselines, memory readings), not from its pool (see the module docstring).
    ``gpu_only``: why its figures mean nothing off a CUDA GPU (skipped there, saying so).
    ``interpreted``: off a GPU its kernels run under Triton's interpreter (run only on
    request, labelled)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"suite name must be a non-empty string, got {name!r}")
    if isinstance(requires, str) or not all(isinstance(m, str) and m for m in requires):
        raise TypeError(f"requires must be a sequence of module names, got {requires!r}")
    if not isinstance(gpu_only, str):
        raise TypeError(f"gpu_only must be a reason (a string), got {gpu_only!r}")

    def register(function: SuiteFunction) -> SuiteFunction:
        if name in SUITES and SUITES[name].function is not function:
            raise ValueError(f"benchmark suite {name!r} is registered twice")
        description = _first_paragraph(function.__doc__)
        SUITES[name] = Suite(
            name,
            function,
            description,
            tuple(requires),
            bool(fresh_jax_allocations),
            gpu_only,
            bool(interpreted),
        )
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
        matches = [
            s for name, s in suites.items() if name == pattern or name.startswith(pattern + ".")
        ]
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
