"""What ``jaxbuf bench`` prints after the suites ran: a table per suite whose notes are
footnotes (each printed once, rows pointing at it), the legend of the baseline kinds the run
compared with, and the closing tally of the device's verdicts.

A row's ``notes`` are split at ``"; "`` into parts; each distinct part of a suite is one
footnote, numbered in order of first use; a part every row of the suite carries is printed
once under the table, unnumbered. The verdict column says ``ok``, ``MISSED`` or ``not
judged`` with the reason (:attr:`jaxbuf.bench.Row.not_judged_reason`); a reason of this
device's (:attr:`~jaxbuf.bench.Row.not_judged_here`) is a footnote too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

#: The ratio column's header: one direction for every suite.
RATIO_COLUMN = "jaxbuf ÷ baseline"
#: Said once above the tables, and in the ratio column's header.
RATIO_LINE = "Every ratio is jaxbuf ÷ baseline: below 1, jaxbuf is faster (lower is better)."
INTERPRETER_NOTE = "Triton interpreter figures: they time the interpreter, not jaxbuf"


def _note_parts(row: Any) -> list[str]:
    """The row's notes as footnote texts: the interpreter label, then its ``notes`` split
    at ``"; "``."""
    parts = [INTERPRETER_NOTE] if row.interpreter else []
    return parts + [part.strip() for part in row.notes.split("; ") if part.strip()]


#: The longest row or baseline name in a table; the rest of a longer one is a footnote.
NAME_WIDTH = 60
#: Kinds of baseline whose names say unambiguously that a row measures a baseline itself
#: (``"seed-style: grow at 10,000 granules"``), not jaxbuf.
_BASELINE_ONLY_KINDS = ("seed-style", "realloc+copy", "preallocated", "floor")


def short_name(name: str, width: int = NAME_WIDTH) -> tuple[str, str]:
    """``(name for the table, details for a footnote)``: a name of at most ``width``
    characters is whole; a longer one is cut before its first parenthesis or comma that
    leaves a name of its own, and the footnote says the rest (or, with nowhere to cut,
    the whole name)."""
    if len(name) <= width:
        return name, ""
    for separator in (" (", " [", ", ", ": "):
        cut = name.find(separator, 12)
        while 0 < cut <= width and _depth(name[:cut]):  # never inside brackets: a.at[r, c]
            cut = name.find(separator, cut + 1)
        if 0 < cut <= width:
            head = name[:cut]
            if separator == " (":  # the parenthesis stays whole in the footnote
                rest = name[cut:].strip()
                if rest.endswith(")") and not _depth(rest[1:-1]):
                    rest = rest[1:-1]  # one parenthesis around all the rest: drop it
            else:
                rest = name[cut + len(separator) :].strip()
            return head, f"{head}: {rest}"
    cut = name.rfind(" ", 12, width - 1)
    head = name[: cut if cut > 0 else width - 1] + "…"
    return head, f"{head} is {name}"


def _depth(text: str) -> int:
    """How many brackets (round or square) are open at the end of ``text``."""
    return sum(text.count(o) - text.count(c) for o, c in ("()", "[]"))


def measures_jaxbuf(row: Any) -> bool:
    """Whether the row's ratio is jaxbuf ÷ baseline: not when the row measures a baseline
    against itself at another size (a seed-style scaling, say)."""
    from jaxbuf.bench import baseline_kind

    kind = baseline_kind(row.name)
    return not (kind in _BASELINE_ONLY_KINDS and kind == baseline_kind(row.baseline_name))


def format_spread(row: Any) -> str:
    """``"0.91-1.3x"`` or ``"1.8-2.4 µs"``: the row's spread in its target's unit."""
    from jaxbuf.bench import format_seconds, is_time_target

    low, high = row.spread
    if is_time_target(row.target):
        return f"{format_seconds(low)}-{format_seconds(high)}"
    return f"{low:.3g}-{high:.3g}x"


class Footnotes:
    """Numbered footnotes of one table: :meth:`mark` returns the marker for some texts."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def number(self, text: str) -> int:
        if text not in self.texts:
            self.texts.append(text)
        return self.texts.index(text) + 1

    def mark(self, texts: list[str]) -> str:
        numbers = sorted({self.number(text) for text in texts})
        return f" [{','.join(map(str, numbers))}]" if numbers else ""

    def lines(self) -> list[str]:
        return [f"  [{i}] {text}" for i, text in enumerate(self.texts, 1)]


def verdict_cell(row: Any, device: str, footnotes: Footnotes) -> str:
    """``ok``, ``MISSED``, ``not judged: <reason>`` (a device's reason as a footnote), or
    ``""`` without a target."""
    if not row.target:
        return ""
    judged = row.judged
    if judged is not None:
        return "ok" if judged else "MISSED"
    reason = row.not_judged_reason
    if reason == row.not_judged_here:
        return "not judged here" + footnotes.mark([f"not judged on {device}: {reason}"])
    if reason == "too close to call" and row.spread is not None:
        return f"not judged: spread {format_spread(row)}"
    return f"not judged: {reason}"


def suite_table(rows: list[Any], device: str) -> tuple[list[str], list[list[str]], list[str]]:
    """``(columns, cells, lines under the table)`` for one suite's rows; device times (CUDA
    events) get two columns of their own where any row has one."""
    from jaxbuf.bench import format_seconds

    parts = [_note_parts(row) for row in rows]
    shared = [p for p in parts[0] if all(p in others for others in parts[1:])] if rows else []
    footnotes = Footnotes()
    with_device = any(
        row.device_median_s is not None or row.baseline_device_median_s is not None for row in rows
    )
    columns = ["name", "median", "baseline", "baseline median", RATIO_COLUMN, "target", "verdict"]
    cells = []
    for row, notes in zip(rows, parts):
        name, name_detail = short_name(row.name)
        baseline, baseline_detail = short_name(row.baseline_name)
        ratio = row.ratio
        extra = [text for text in (name_detail, baseline_detail) if text]
        if ratio is not None and not measures_jaxbuf(row):
            # The ratio column holds jaxbuf ÷ baseline only; a baseline's own scaling is told.
            extra.append(f"{row.name} ÷ {row.baseline_name}: {ratio:,.3g}x (not jaxbuf)")
            ratio = None
        name += footnotes.mark(extra + [n for n in notes if n not in shared])
        measured = format_seconds(row.median_s) if row.median_s is not None else row.value
        line = [
            name,
            measured or "—",
            baseline or "—",
            format_seconds(row.baseline_median_s) if row.baseline_name else "",
            "" if ratio is None else f"{ratio:,.3g}x",
            row.target,
            verdict_cell(row, device, footnotes),
        ]
        if with_device:
            line[4:4] = [
                format_seconds(row.device_median_s) if row.device_median_s is not None else "",
                format_seconds(row.baseline_device_median_s)
                if row.baseline_device_median_s is not None
                else "",
            ]
        cells.append(line)
    if with_device:
        columns[4:4] = ["device time", "baseline device time"]
    under = footnotes.lines()
    if shared:
        under += [f"  every row: {'; '.join(shared)}"]
    return columns, cells, under


def stacked_table(
    columns: list[str], cells: list[list[str]]
) -> tuple[list[str], list[list[str]], tuple[int, ...]]:
    """:func:`suite_table`'s table in two lines a row, for a pipe or a log (120 columns):
    the row's name, median, ratio and verdict, then ``vs <baseline>``, its median and the
    target under them. ``(columns, cells, right-aligned column indices)``."""
    at = {name: i for i, name in enumerate(columns)}
    device = "device time" in at
    head = ["name, vs baseline", "median", RATIO_COLUMN, "verdict, target"]
    if device:
        head[2:2] = ["device time"]
    stacked = []
    for row in cells:
        first = [row[at["name"]], row[at["median"]], row[at[RATIO_COLUMN]], row[at["verdict"]]]
        baseline, target = row[at["baseline"]], row[at["target"]]
        second = [
            "  vs " + baseline if baseline != "—" else "",
            row[at["baseline median"]],
            "",
            target,
        ]
        if device:
            first[2:2] = [row[at["device time"]]]
            second[2:2] = [row[at["baseline device time"]]]
        stacked.append(first)
        if any(second):
            stacked.append(second)
    right = (1, 2, 3) if device else (1, 2)
    return head, stacked, right


def verdict_counts(rows: list[Any]) -> str:
    """``"12 rows: 3 ok, 1 MISSED, 2 not judged"``: the verdicts of one suite's rows."""
    counts = {"ok": 0, "MISSED": 0, "not judged": 0}
    for row in rows:
        if not row.target:
            continue
        judged = row.judged
        counts["not judged" if judged is None else "ok" if judged else "MISSED"] += 1
    words = [f"{n} {label}" for label, n in counts.items() if n]
    text = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
    return f"{text}: {', '.join(words)}" if words else f"{text}, no target"


def legend(rows: list[Any]) -> list[str]:
    """Lines defining each kind of baseline ``rows`` compare with, in the order of
    :data:`jaxbuf.bench.BASELINE_KINDS`; none without a baseline."""
    from jaxbuf.bench import BASELINE_KINDS, baseline_kind

    used = {baseline_kind(row.baseline_name) for row in rows if row.baseline_name}
    kinds = [kind for kind in BASELINE_KINDS if kind in used]
    if not kinds:
        return []
    width = max(map(len, kinds))
    lines = ["Baselines, by the words their names start with:"]
    lines += [f"  {kind.ljust(width)}  {BASELINE_KINDS[kind]}" for kind in kinds]
    return lines


def tally(results: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """The device's verdicts over every row with a target: ``met``, ``missed`` (the rows,
    as ``(suite, row)``) and ``not_judged`` (reason -> count)."""
    met, missed = 0, []
    not_judged: Counter[str] = Counter()
    for result in results:
        for row in result["rows"]:
            if not row.target:
                continue
            judged = row.judged
            if judged is None:
                not_judged[row.not_judged_reason] += 1
            elif judged:
                met += 1
            else:
                missed.append((result["suite"].name, row))
    return {"device": device, "met": met, "missed": missed, "not_judged": not_judged}


def tally_lines(counts: dict[str, Any], *, strict: bool) -> list[str]:
    """The closing tally: ``"cpu: N targets met, M missed, K not judged here"``, each
    reason for not judging with its count, each missed row, and what the exit status
    makes of a miss."""
    from jaxbuf.bench import NOT_JUDGED, format_seconds, is_time_target

    device, missed, reasons = counts["device"], counts["missed"], counts["not_judged"]
    total = sum(reasons.values())
    head = f"{device}: {counts['met']} targets met, {len(missed)} missed, {total} not judged here"
    lines = [head + (":" if total else ".")]
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        meaning = NOT_JUDGED.get(reason)
        text = f"{reason}: {meaning}" if meaning else f"not judged on {device}: {reason}"
        lines.append(f"  {count} {text}")
    for suite_name, row in missed:
        ratio = row.ratio
        measured = f"{ratio:.3g}x" if ratio is not None and not is_time_target(row.target) else ""
        if not measured:
            measured = format_seconds(row.median_s) if row.median_s is not None else row.value
        lines.append(f"  missed: {suite_name}: {row.name}: {measured}, target {row.target}")
    if missed:
        lines.append(
            "  a missed target fails the command with --strict (exit 1)"
            if strict
            else "  missed targets do not fail the command (exit 0); --strict makes them"
        )
    return lines
