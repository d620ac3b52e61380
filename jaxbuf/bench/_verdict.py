"""When a benchmark row's target may be judged: the targets' grammar (``"<= 1.2x the floor"``,
``"<= 2 µs"``), the spreads a run gives its figures, and the :data:`TOLERANCE` a margin must
clear. :class:`jaxbuf.bench.Row` judges itself with these; :mod:`jaxbuf.bench` re-exports
the public names."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

__all__ = [
    "NOT_JUDGED",
    "TOLERANCE",
    "is_time_target",
    "parse_target",
    "ratio_spread",
    "time_spread",
]

#: What each :attr:`~jaxbuf.bench.Row.not_judged_reason` key means, for the closing tally's
#: reader. A reason that is not a key is a :attr:`~jaxbuf.bench.Row.not_judged_here`, which
#: says it in full.
NOT_JUDGED = {
    "quick sizes": "targets are set for full sizes (--quick measures small ones)",
    "interpreter": "Triton's interpreter times the interpreter, not jaxbuf",
    "baseline not measured": "its baseline could not run here, so there is nothing to compare",
    "not measured": "the row's own measurement could not run here",
    "too close to call": "the bound lies inside the run's interquartile spread widened by "
    "±10% (how far a rerun moves on a shared machine): a rerun could land on either side",
}

#: How far a rerun may move a figure, relative: a target is judged only when the judged
#: quantity's interquartile spread in this run, widened by this much on each side, lies on
#: one side of its bound. Baseline and jaxbuf are sampled round by round where a suite can
#: (:func:`jaxbuf.bench._timing.round_by_round`), so drift of the machine falls on both; the
#: tolerance covers what one run's spread cannot show (the next run's load, memory layout).
#: On a shared 2-core machine reruns of the CPU suites moved most ratios by under 10%.
TOLERANCE = 0.10

_TIME_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_TARGET = re.compile(r"<=\s*([0-9.]+)\s*(x|ns|µs|us|ms|s)(?:\s|$)")


def is_time_target(target: str) -> bool:
    """Whether ``target`` bounds a time (``"<= 2 µs"``), not a ratio or a memory bound."""
    parsed = parse_target(target)
    return parsed is not None and parsed[1]


def parse_target(target: str) -> tuple[float, bool] | None:
    """``"<= 1.2x the floor" -> (1.2, False)``, ``"<= 2 µs" -> (2e-06, True)``: the bound
    and whether it is a time; None for a target of another form (a memory bound)."""
    match = _TARGET.match(target.strip())
    if match is None:
        return None
    number, unit = float(match.group(1)), match.group(2)
    return (number, False) if unit == "x" else (number * _TIME_UNITS[unit], True)


def _quartiles(samples: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``samples`` (both the sample for one sample)."""
    if not samples:
        raise ValueError("no samples")
    if len(samples) == 1:
        return samples[0], samples[0]
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q3


def time_spread(samples: Sequence[float]) -> tuple[float, float]:
    """The interquartile range of a time's samples: where a repeat's median may fall."""
    return _quartiles(samples)


def ratio_spread(
    samples: Sequence[float], baseline_samples: Sequence[float], *, paired: bool = False
) -> tuple[float, float]:
    """The range of jaxbuf ÷ baseline a repeat may give. ``paired``: the samples were taken
    round by round (:func:`jaxbuf.bench._timing.round_by_round`), so the i-th of each shares
    the machine's state: the quartiles of the per-round ratios. Otherwise the ratio of the
    quartiles, crossed (jaxbuf's low over the baseline's high, and the reverse)."""
    if paired:
        if len(samples) != len(baseline_samples):
            raise ValueError("paired samples must be as many on both sides")
        return _quartiles([a / b for a, b in zip(samples, baseline_samples)])
    low, high = _quartiles(samples)
    baseline_low, baseline_high = _quartiles(baseline_samples)
    return low / baseline_high, high / baseline_low
