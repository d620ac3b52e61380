"""The PNGs of ``jaxbuf bench --plot``: growth cost against committed size
(``extensible.growth``), the decode loop's memory and step time (``jax.decode``) and the staged
apply's time against writes per pattern (``staged.patterns``), drawn from the rows of a run's
JSON result (what the suites emit, on any device).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: ``--plot`` given without a path: write ``results/growth-<device>.png``,
#: ``results/decode-<device>.png`` and ``results/staged-<device>.png`` (those with rows).
PLOT_DEFAULT = object()


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


def write_plots(
    results: list[dict[str, Any]], plot: Any, device: Any, device_name: str
) -> list[Path]:
    """Draw every plot that ``results`` (the JSON result's suites) hold rows for, at the
    paths ``plot`` (``--plot``'s value) names; the paths written. None to draw: a warning."""
    present = {
        "growth": _has_growth_rows(results),
        "decode": bool(_decode_series(results)),
        "staged": bool(_staged_series(results)),
    }
    kinds = [kind for kind, has_rows in present.items() if has_rows]
    if not kinds:
        print(
            "jaxbuf: warning: no rows to plot (run the extensible.growth, jax.decode or "
            "staged.patterns suite)",
            file=sys.stderr,
        )
    return [
        path
        for kind, path in _plot_paths(plot, device_name, kinds).items()
        if _PLOTTERS[kind](results, path, device)
    ]
