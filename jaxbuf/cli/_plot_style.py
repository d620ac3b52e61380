"""How every plot of ``jaxbuf bench --plot`` looks (:mod:`jaxbuf.cli._plots` draws them):
jaxbuf the same way everywhere (:data:`JAXBUF_STYLE`: a colour no baseline uses, a heavier
line, above every other artist), legends outside the data, sizes in binary units (``16 MiB``,
never ``2^-6 GiB``) and times in readable ones, one size drawn as bars; and the rows a plot
may draw at all (never those timed under Triton's interpreter).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: jaxbuf in every plot: drawn above everything else, in a colour no baseline uses.
JAXBUF_COLOUR = "#d62728"
JAXBUF_ZORDER = 10
JAXBUF_STYLE = {"color": JAXBUF_COLOUR, "lw": 2.6, "zorder": JAXBUF_ZORDER}
#: Baselines: thinner lines beneath jaxbuf's.
BASELINE_LW = 1.3


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _measured_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a plot may draw: measured, and not timed under Triton's interpreter."""
    return [
        row
        for result in results
        for row in result["rows"]
        if row["median_s"] is not None and not row.get("interpreter")
    ]


def _row_handles(axes: Any) -> list:
    """The labelled artists of ``axes`` (a row of panels), one per label, in drawing order:
    a legend beside the row names every series drawn in any of its panels."""
    by_label: dict[str, Any] = {}
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            by_label.setdefault(label, handle)
    return list(by_label.values())


def _legend_outside(axis: Any, handles: list, **options: Any) -> Any:
    """A legend of ``handles`` to the right of ``axis``, clear of its data."""
    return axis.legend(
        handles=handles,
        loc=options.pop("loc", "upper left"),
        bbox_to_anchor=options.pop("bbox_to_anchor", (1.02, 1.0)),
        borderaxespad=0.0,
        fontsize=8,
        title_fontsize=8,
        **options,
    )


def _byte_ticks(axis: Any, values: list[float]) -> None:
    """Tick the log-scaled x axis at the sizes ``values`` (bytes) measured, each labelled in
    binary units (``16 MiB``, ``48 GiB``)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from jaxbuf.bench import format_bytes

    axis.xaxis.set_major_locator(FixedLocator(sorted(set(values))))
    axis.xaxis.set_minor_locator(NullLocator())
    axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(int(round(v)))))


def _linear_byte_ticks(axis: Any) -> None:
    """Tick the linear y axis of bytes every power of two bytes that gives 3 to 7 ticks
    (``0 B, 256 MiB, 512 MiB, 768 MiB, 1 GiB``), labelled in binary units."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    from jaxbuf.bench import format_bytes

    low, high = axis.get_ylim()
    step = 1 << max(0, math.ceil(math.log2(max(high - low, 1) / 6)))
    axis.yaxis.set_major_locator(MultipleLocator(step))
    # The locator also places ticks just outside the view (below 0 B): those stay unnamed.
    axis.yaxis.set_major_formatter(
        FuncFormatter(lambda v, _: format_bytes(int(round(v))) if v >= 0 else "")
    )


def _plain_log_ticks(axis: Any) -> None:
    """Tick the log-scaled y axis at 1, 2 and 5 times powers of ten, as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
    axis.yaxis.set_minor_locator(NullLocator())
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _time_ticks(axis: Any) -> None:
    """Label the log-scaled y axis of seconds in readable units (``100 µs``, ``1 ms``): every
    power of ten, and 2 and 5 times it where the data spans less than two."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from jaxbuf.bench import format_seconds

    low, high = axis.get_ylim()
    subs = (1.0, 2.0, 5.0) if high < 100 * low else (1.0,)
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_seconds(v)))
    axis.yaxis.set_minor_formatter(NullFormatter())


def _save(plt: Any, figure: Any, path: Path, note: str = "") -> None:
    """Write ``figure`` to ``path`` as PNG (making its folder), then close it; ``note`` is
    printed under the axes (what a reader needs to read them right). The saved area grows
    to hold the legends beside the axes."""
    # Room for a title over every panel, and for the note (about 0.6 in, whatever the height).
    top = 1 - 0.35 / figure.get_figheight() if figure._suptitle is not None else 1
    if note:
        figure.text(0.02, 0.01, note, ha="left", va="bottom", fontsize=8, wrap=True)
        figure.tight_layout(rect=(0, min(0.06, 0.6 / figure.get_figheight()), 1, top))
    else:
        figure.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def _one_size(by_label: dict[str, dict[Any, float]]) -> bool:
    """Whether every series of ``by_label`` is measured at the same single x: a line plot
    of one x is a column of dots, so such data is drawn as bars (:func:`_bars`)."""
    return len({x for points in by_label.values() for x in points}) == 1


def _bars(
    axis: Any,
    by_label: dict[str, dict[Any, float]],
    ylabel: str,
    title: str,
    colours: list[str],
) -> None:
    """One bar per series of ``by_label`` (each a single point, in seconds), log-scaled."""
    labels = list(by_label)
    values = [next(iter(by_label[label].values())) for label in labels]
    positions = range(len(labels))
    bars = axis.bar(positions, values, color=colours)
    for bar, colour in zip(bars, colours):
        if colour == JAXBUF_COLOUR:
            bar.set_zorder(JAXBUF_ZORDER)
    axis.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=7)
    axis.set_yscale("log")
    _time_ticks(axis)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(True, axis="y", which="both", alpha=0.3)
