"""The PNGs of ``jaxbuf bench --plot``: growth cost against committed size
(``extensible.growth``), the decode loops' memory and step time (``jax.decode``,
``torch.decode``) and the staged apply's time against writes per pattern
(``staged.patterns``), drawn from the rows of a run's JSON result (what the suites emit, on
any device).

Every plot keeps the look of :mod:`jaxbuf.cli._plot_style` (jaxbuf drawn the same way above
every other artist, legends outside the data, sizes in binary units) and leaves out rows timed
under Triton's interpreter: they time the interpreter, not jaxbuf (the table and the JSON keep
them).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ._plot_style import (
    BASELINE_LW,
    JAXBUF_COLOUR,
    JAXBUF_STYLE,
    JAXBUF_ZORDER,
    _bars,
    _byte_ticks,
    _legend_outside,
    _linear_byte_ticks,
    _measured_rows,
    _one_size,
    _plain_log_ticks,
    _pyplot,
    _row_handles,
    _save,
    _time_ticks,
)
from ._shared import warn

#: ``--plot`` given without a path: write ``results/growth-<device>.png``,
#: ``results/decode-<device>.png`` and ``results/staged-<device>.png`` (those with rows).
PLOT_DEFAULT = object()

#: The decode plot marks this many of each variant's slowest steps.
SLOWEST_MARKED = 5


def _plot_paths(plot: Any, device_name: str, kinds: list[str]) -> dict[str, Path]:
    """Where each plot of ``kinds`` (those with rows to draw, growth first) goes: the default
    paths (``results/<kind>-<device_name>.png``), or the ``--plot`` path for the first and
    ``<stem>-<kind><suffix>`` beside it for the others."""
    if plot is PLOT_DEFAULT:
        return {kind: Path("results") / f"{kind}-{device_name}.png" for kind in kinds}
    path = Path(plot)
    return {
        kind: path if i == 0 else path.with_name(f"{path.stem}-{kind}{path.suffix or '.png'}")
        for i, kind in enumerate(kinds)
    }


# -- growth -----------------------------------------------------------------------------------
#: ``baseline_kind`` -> (label, colour, line style); jaxbuf's own series use JAXBUF_STYLE.
_GROWTH_BASELINES = {
    "floor": ("raw driver calls (floor)", "black", "--"),
    "seed": ("seed-style (granule set)", "#2ca02c", "-"),
    "torch": ("torch realloc+copy", "#ff7f0e", "-"),
    "jax": ("JAX realloc+copy", "#9467bd", "-"),
}
_JAXBUF_GROWTH = "jaxbuf ExtensibleTensor"


def _growth_series(
    results: list[dict[str, Any]],
) -> dict[int, dict[tuple[str, str], dict[int, float]]]:
    """The ``extensible.growth`` rows as ``{step_bytes: {(who, variant): {committed: s}}}``:
    ``who`` is ``"jaxbuf"`` or a ``baseline_kind``, ``variant`` ``""`` or what sets the row
    apart (``", 1 peer"``, ``", 1 TiB reserved"``)."""
    from jaxbuf.bench import format_bytes

    series: dict[int, dict[tuple[str, str], dict[int, float]]] = {}
    for row in _measured_rows(results):
        params = row["params"]
        if "committed_bytes" not in params or "step_bytes" not in params:
            continue
        by_who = series.setdefault(params["step_bytes"], {})
        committed = params["committed_bytes"]
        variant = ", 1 peer" if params.get("peers") else ""
        if params.get("reserved_bytes"):
            variant += f", {format_bytes(params['reserved_bytes'])} reserved"
        by_who.setdefault(("jaxbuf", variant), {})[committed] = row["median_s"]
        if row["baseline_median_s"] is not None:
            who = params.get("baseline_kind") or row["baseline_name"]
            by_who.setdefault((who, variant), {})[committed] = row["baseline_median_s"]
    return series


def _growth_look(who: str, variant: str) -> tuple[str, dict[str, Any]]:
    """The label and line options of one growth series: variants (a reservation, a peer)
    share their series' colour with hollow markers and a dotted line."""
    if who == "jaxbuf":
        label, style = _JAXBUF_GROWTH, dict(JAXBUF_STYLE)
    else:
        label, colour, dashes = _GROWTH_BASELINES.get(who, (who, "#7f7f7f", "-."))
        style = {"color": colour, "ls": dashes, "lw": BASELINE_LW}
    style["marker"] = "o"
    if variant:
        style.update(ls=":", marker="D", markerfacecolor="none", markersize=7)
    return label + variant, style


def _plot_growth(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of growth cost against committed size, beside the raw driver calls (the floor),
    the seed-style buffer and realloc+copy. False: no data."""
    series = _growth_series(results)
    if not series:
        return False
    plt = _pyplot()

    from jaxbuf.bench import format_bytes

    figure, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4.5), squeeze=False)
    for axis, (step, by_who) in zip(axes[0], sorted(series.items())):
        looks = {key: _growth_look(*key) for key in by_who}
        if _one_size(by_who):  # one committed size: bars, not a column of dots
            (committed,) = {x for points in by_who.values() for x in points}
            title = f"grow by {format_bytes(step)} onto {format_bytes(committed)} on {device}"
            by_label = {looks[key][0]: points for key, points in by_who.items()}
            colours = [looks[key][1]["color"] for key in by_who]
            _bars(axis, by_label, "time per grow", title, colours)
            continue
        for key, points in by_who.items():
            label, style = looks[key]
            xs = sorted(points)
            axis.plot(xs, [points[x] for x in xs], label=label, **style)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        _byte_ticks(axis, [x for points in by_who.values() for x in points])
        _time_ticks(axis)
        axis.set_xlabel("already committed")
        axis.set_ylabel("time per grow")
        axis.set_title(f"grow by {format_bytes(step)} on {device}")
        axis.grid(True, which="both", alpha=0.3)
    handles = _row_handles(axes[0])
    if handles:  # none where every panel is bars, named on their own axis
        _legend_outside(axes[0][-1], handles)
    _save(plt, figure, path)
    return True


def _has_growth_rows(results: list[dict[str, Any]]) -> bool:
    """Whether ``results`` hold a measured ``extensible.growth`` row (what _plot_growth draws)."""
    return bool(_growth_series(results))


# -- decode -----------------------------------------------------------------------------------
#: variant -> (label, colour, line width, z-order): jaxbuf above the baselines. A label's
#: ``{framework}`` is the row's (``params["framework"]``: the suite's, jax.decode or
#: torch.decode). Each framework's baselines have colours of their own
#: (:data:`_DECODE_COLOURS`): one legend names the series of every panel, so a colour
#: stands for one series.
_DECODE_VARIANTS = {
    "jaxbuf": ("jaxbuf KV cache", JAXBUF_COLOUR, JAXBUF_STYLE["lw"], JAXBUF_ZORDER),
    "preallocated": ("{framework}, preallocated", "#1f77b4", BASELINE_LW, 4),
    "realloc": ("{framework}, realloc+copy", "#9467bd", 1.0, 5),
}
_DECODE_COLOURS = {
    ("JAX", "preallocated"): "#1f77b4",  # blue
    ("JAX", "realloc"): "#9467bd",  # purple
    ("torch", "preallocated"): "#17becf",  # cyan
    ("torch", "realloc"): "#ff7f0e",  # orange
}
_FRAMEWORK_NAMES = {"jax": "JAX", "torch": "torch"}
#: The decode figure's panel size in inches (at 120 dpi: 600 x 336 px): two panels a row
#: (memory, step time), one row per framework and length profile, so the figure stays
#: under 2,000 px wide whatever ran.
_DECODE_PANEL = (5.0, 2.8)


def _decode_series(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The params of the decode rows (``jax.decode``, ``torch.decode``) that carry per-step
    series, one per profile and framework."""
    return [
        row["params"]
        for row in _measured_rows(results)
        if row["params"].get("kind") == "decode-step" and row["params"].get("series")
    ]


def _framework(params: dict[str, Any]) -> str:
    """The framework a decode profile ran in, as a title says it (JAX where unsaid: the
    rows of runs before torch.decode existed)."""
    name = params.get("framework", "jax")
    return _FRAMEWORK_NAMES.get(name, name)


def _rolling_median(values: list[float], window: int) -> list[float]:
    """The median of each value's centred ``window`` (odd; shorter at the ends)."""
    half = window // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def _median_window(steps: int) -> int:
    """An odd window of about 1/16 of the run and at least 5 steps: wide enough to smooth a
    loaded host's noise, narrow beside the run."""
    return max(5, steps // 16) | 1


def _decode_look(variant: str, params: dict[str, Any]) -> tuple[str, str, float, int]:
    label, colour, width, zorder = _DECODE_VARIANTS.get(
        variant, (variant, "#7f7f7f", BASELINE_LW, 3)
    )
    framework = _framework(params)
    colour = _DECODE_COLOURS.get((framework, variant), colour)
    return label.format(framework=framework), colour, width, zorder


def _granule_floor(params: dict[str, Any]) -> int | None:
    """The granule where jaxbuf's cache sits on it (holds one granule, its least, at some
    step), else None: there the granule, not the tokens, sets what jaxbuf holds."""
    granule = params.get("granule_bytes")
    held = params["series"].get("jaxbuf", {}).get("held_bytes")
    return granule if granule and held and min(held) <= granule else None


def _draw_decode_memory(axis: Any, params: dict[str, Any]) -> None:
    """Bytes held per step: the tokens' pages shaded, every variant, and the granule where
    jaxbuf sits on it."""
    from jaxbuf.bench import format_bytes

    for variant, series in params["series"].items():
        label, colour, width, zorder = _decode_look(variant, params)
        held = series["held_bytes"]
        axis.step(
            range(len(held)),
            held,
            where="post",
            color=colour,
            lw=width,
            zorder=zorder,
            label=label,
        )
    if params.get("needed_bytes"):
        needed = params["needed_bytes"]
        axis.fill_between(
            range(len(needed)),
            needed,
            step="post",
            color="#bbbbbb",
            alpha=0.6,
            lw=0,
            zorder=1,
            label="pages the tokens use",
        )
    granule = _granule_floor(params)
    if granule:
        axis.axhline(
            granule,
            color="#555555",
            ls="--",
            lw=0.8,
            zorder=2,
            label=f"granule ({format_bytes(granule)}): jaxbuf's least",
        )
    axis.set_ylim(bottom=0)
    _linear_byte_ticks(axis)
    axis.set_ylabel("bytes held")


def _draw_decode_time(axis: Any, params: dict[str, Any]) -> int:
    """Step time per variant as a rolling median, its slowest steps marked; the window."""
    window = 1
    for variant, series in params["series"].items():
        label, colour, width, zorder = _decode_look(variant, params)
        times = [s * 1e3 for s in series["step_s"]]
        if not times:
            continue
        window = _median_window(len(times))
        axis.plot(
            _rolling_median(times, window), color=colour, lw=width, zorder=zorder, label=label
        )
        slowest = sorted(range(len(times)), key=times.__getitem__)[-SLOWEST_MARKED:]
        axis.scatter(
            slowest,
            [times[i] for i in slowest],
            color=colour,
            edgecolors="white",
            linewidths=0.5,
            s=28,
            zorder=zorder + 0.5,
        )
    axis.set_yscale("log")
    _plain_log_ticks(axis)
    axis.set_ylabel("step (ms)")
    return window


def _plot_decode(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of the decode loops (``jax.decode``, ``torch.decode``): for each length profile
    and framework, the bytes the KV cache holds at every step and the step time (a rolling
    median, the slowest steps marked), jaxbuf beside the preallocated cache and
    realloc+copy. False: no data."""
    profiles = _decode_series(results)
    if not profiles:
        return False
    plt = _pyplot()
    from matplotlib.lines import Line2D

    from jaxbuf.bench import format_bytes

    # One row per profile, each framework's beside the other's: memory left, time right.
    profiles.sort(key=lambda p: (p["profile"], _framework(p)))
    width, height = _DECODE_PANEL
    figure, axes = plt.subplots(
        len(profiles), 2, figsize=(2 * width, height * len(profiles)), squeeze=False
    )
    for row, params in enumerate(profiles):
        memory, time_axis = axes[row]
        _draw_decode_memory(memory, params)
        window = _draw_decode_time(time_axis, params)
        what = f"{_framework(params)}, {params['profile']} lengths"
        memory.set_title(f"{what}: KV cache memory", fontsize=10)
        time_axis.set_title(f"{what}: step time (median of {window} steps)", fontsize=10)
        for axis in (memory, time_axis):
            axis.grid(True, which="both", alpha=0.3)
            if row == len(profiles) - 1:
                axis.set_xlabel("decode step")
    figure.suptitle(f"Decode loops over a growing KV cache on {device}", fontsize=11)
    slowest = Line2D(
        [],
        [],
        ls="",
        marker="o",
        color="#7f7f7f",
        label=f"each one's {SLOWEST_MARKED} slowest steps",
    )
    # One legend for every panel (a colour is one series everywhere), beside the top row.
    handles = _row_handles([axis for pair in axes for axis in pair])
    _legend_outside(axes[0][-1], [*handles, slowest])
    granules = sorted({g for g in map(_granule_floor, profiles) if g})
    note = (
        "realloc+copy grows at jaxbuf's steps (where it holds what jaxbuf holds, its line "
        "lies under jaxbuf's); its spikes are the old and new arrays side by side during a copy."
    )
    if granules:
        note += (
            f" The driver commits whole granules ({', '.join(map(format_bytes, granules))} "
            "here): jaxbuf's cache holds at least one granule, and grows a granule at a time "
            "where a growth step is smaller, so at small sizes it can hold more than a "
            "preallocated cache; the row's memory target allows one growth step above the "
            "tokens' pages."
        )
    _save(plt, figure, path, note)
    return True


# -- staged -----------------------------------------------------------------------------------
#: Who applies: label and colour; one marker per write pattern.
_STAGED_WHO = {
    "jaxbuf": ("jaxbuf FusedStagedWriter", JAXBUF_COLOUR),
    "seed": ("seed-style apply", "#2ca02c"),
    "index_put": ("torch index_put_", "#ff7f0e"),
}
_PATTERN_MARKERS = ("o", "s", "^", "D", "v", "P")


def _staged_series(
    results: list[dict[str, Any]],
) -> dict[str, dict[tuple[str, str], dict[int, float]]]:
    """The measured ``staged.patterns`` apply rows as
    ``{timing: {(pattern, who): {num_writes: seconds}}}``, ``who`` ``"jaxbuf"`` or the
    ``baseline_kind``; rows timed under Triton's interpreter left out."""
    series: dict[str, dict[tuple[str, str], dict[int, float]]] = {}
    for row in _measured_rows(results):
        params = row["params"]
        if params.get("kind") != "pattern-apply":
            continue
        by_key = series.setdefault(params["timing"], {})
        pattern, writes = params["pattern"], params["num_writes"]
        by_key.setdefault((pattern, "jaxbuf"), {})[writes] = row["median_s"]
        if row["baseline_median_s"] is not None:
            who = params.get("baseline_kind") or row["baseline_name"]
            by_key.setdefault((pattern, who), {})[writes] = row["baseline_median_s"]
    return series


def _interpreted_staged_rows(results: list[dict[str, Any]]) -> bool:
    """Whether ``results`` hold ``staged.patterns`` rows timed under Triton's interpreter."""
    return any(
        row.get("interpreter") and row["params"].get("kind") == "pattern-apply"
        for result in results
        for row in result["rows"]
    )


def _plot_staged(results: list[dict[str, Any]], path: Path, device: Any) -> bool:
    """PNG of one staged apply's time against the number of writes (``staged.patterns``):
    one colour per apply (jaxbuf, the seed-style apply, torch ``index_put_``), one marker
    per write pattern; host time and end to end side by side. False: no data."""
    series = _staged_series(results)
    if not series:
        return False
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    timings = [t for t in ("host", "end to end") if t in series]
    figure, axes = plt.subplots(1, len(timings), figsize=(5.5 * len(timings), 4.8), squeeze=False)
    patterns = list(dict.fromkeys(p for by_key in series.values() for p, _ in by_key))
    markers = {p: _PATTERN_MARKERS[i % len(_PATTERN_MARKERS)] for i, p in enumerate(patterns)}
    whos = list(dict.fromkeys(w for by_key in series.values() for _, w in by_key))
    looks = {w: _STAGED_WHO.get(w, (w, f"C{7 + i % 3}")) for i, w in enumerate(whos)}
    for axis, timing in zip(axes[0], timings):
        by_key = series[timing]
        for (pattern, who), points in by_key.items():
            colour = looks[who][1]
            mine = who == "jaxbuf"
            xs = sorted(points)
            axis.plot(
                xs,
                [points[x] for x in xs],
                label=f"{looks[who][0]}, {pattern}",
                marker=markers[pattern],
                color=colour,
                lw=JAXBUF_STYLE["lw"] if mine else BASELINE_LW,
                markersize=7 if mine else 5,
                zorder=JAXBUF_ZORDER if mine else 3,
            )
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        _time_ticks(axis)
        writes = sorted({x for points in by_key.values() for x in points})
        axis.set_xticks(writes, [f"{n:,}" for n in writes])
        axis.xaxis.set_minor_locator(NullLocator())
        if len(writes) == 1:  # one size: room either side of its column of points
            axis.set_xlim(writes[0] / 2, writes[0] * 2)
        axis.set_xlabel("writes per apply")
        axis.set_ylabel("time per apply")
        axis.set_title(f"staged apply, {timing}, on {device}")
        axis.grid(True, which="both", alpha=0.3)
    last = axes[0][-1]
    applies = [
        Line2D(
            [],
            [],
            color=colour,
            lw=JAXBUF_STYLE["lw"] if who == "jaxbuf" else BASELINE_LW,
            label=label,
        )
        for who, (label, colour) in looks.items()
    ]
    # One legend of both keys (a second legend beside the axes would be clipped to them).
    header = Line2D([], [], ls="", label="write pattern (marker):")
    shapes = [Line2D([], [], ls="", marker=markers[p], color="#555555", label=p) for p in patterns]
    _legend_outside(last, [*applies, header, *shapes], title="apply (colour):")
    _save(plt, figure, path)
    return True


_PLOTTERS = {"growth": _plot_growth, "decode": _plot_decode, "staged": _plot_staged}
#: The suites whose rows each plot draws.
PLOTTED_SUITES = ("extensible.growth", "jax.decode", "torch.decode", "staged.patterns")


def drawable_here(device: Any) -> tuple[list[str], dict[str, str]]:
    """``(suites, why_not)``: the :data:`PLOTTED_SUITES` whose rows ``--plot`` can draw on
    ``device`` here, and why each other one cannot (interpreter rows are never drawn)."""
    from jaxbuf.bench import load_suites

    suites = load_suites()
    can, why_not = [], {}
    for name in PLOTTED_SUITES:
        suite = suites.get(name)
        if suite is None:
            why_not[name] = "not registered"
        elif suite.uses_interpreter(device):
            why_not[name] = "off a GPU its rows time Triton's interpreter, never drawn"
        elif suite.skip_reason(device) is not None:
            why_not[name] = suite.skip_reason(device)
        else:
            can.append(name)
    return can, why_not


def _nothing_to_plot(results: list[dict[str, Any]], device: Any) -> str:
    """Why no plot was written, and which suites ``--plot`` can draw on ``device``."""
    ran = {r["name"]: r for r in results}
    can, why_not = drawable_here(device)
    said = [
        f"{name} was skipped ({why_not.get(name) or ran[name]['skipped']})"
        for name in PLOTTED_SUITES
        if name in ran and ran[name].get("skipped")
    ]
    text = "no rows to plot" + (f": {'; '.join(said)}" if said else "")
    text += f". On {device}, --plot draws " + (", ".join(can) if can else "no suite")
    cannot = [f"{name}: {why}" for name, why in why_not.items() if not any(name in s for s in said)]
    if cannot:
        text += f" (not {'; '.join(cannot)})"
    return text


def write_plots(
    results: list[dict[str, Any]], plot: Any, device: Any, device_name: str
) -> list[Path]:
    """Draw every plot that ``results`` (the JSON result's suites) hold rows for, at the
    paths ``plot`` (``--plot``'s value) names; the paths written. Rows timed under Triton's
    interpreter are not drawn (a warning says so); nothing to draw: a warning."""
    present = {
        "growth": _has_growth_rows(results),
        "decode": bool(_decode_series(results)),
        "staged": bool(_staged_series(results)),
    }
    interpreted = not present["staged"] and _interpreted_staged_rows(results)
    if interpreted:
        warn(
            "staged.patterns not plotted: its rows time Triton's interpreter, not jaxbuf "
            "(the table and the JSON keep them)"
        )
    kinds = [kind for kind, has_rows in present.items() if has_rows]
    if not kinds and not interpreted:
        warn(_nothing_to_plot(results, device))
    return [
        path
        for kind, path in _plot_paths(plot, device_name, kinds).items()
        if _PLOTTERS[kind](results, path, device)
    ]
