"""What ``jaxbuf bench`` prints and decides, read by a person: verdicts that a rerun does not
flip (a stated tolerance around each bound), pinned intra-op threads on the CPU, lines that
fit 120 columns when piped, short row names with their details in footnotes, a ratio column
that holds only jaxbuf ÷ baseline; and the smaller faces of the command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CUDA_REASON

from jaxbuf.__main__ import main
from jaxbuf.bench import SUITES, TOLERANCE, Row, Sizes, load_suites, suite

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def temporary_suites():
    """Suites registered by a test, removed afterwards (the package's own loaded first, so
    that they are not taken for the test's)."""
    load_suites()
    before = set(SUITES)
    yield
    for name in set(SUITES) - before:
        del SUITES[name]


@pytest.fixture
def thread_variables(monkeypatch):
    """The command sets the thread variables of its process: give them back afterwards."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    if torch is not None:
        torch.set_num_threads(before)


def _model_verdict(low: float, high: float, limit: float) -> bool | None:
    """The rule, written out: judged only when the spread widened by TOLERANCE on each side
    lies wholly on one side of the bound."""
    if high * (1 + TOLERANCE) <= limit:
        return True
    if low * (1 - TOLERANCE) > limit:
        return False
    return None


@pytest.mark.parametrize("limit", [0.5, 1.0, 1.2])
@pytest.mark.parametrize("median", [0.3, 0.85, 0.95, 1.0, 1.05, 1.1, 1.15, 1.3, 2.0])
def test_a_ratio_target_is_judged_only_clear_of_its_bound_by_the_tolerance(median, limit):
    # Without a spread the median alone is the run's figure; the bound comes from the target.
    row = Row("r", median * 1e-6, "b", 1e-6, target=f"<= {limit:g}x", met=median <= limit)
    assert row.judged == _model_verdict(median, median, limit)
    # With a spread, its ends count.
    spread = (median * 0.97, median * 1.03)
    row = Row("r", median * 1e-6, "b", 1e-6, target=f"<= {limit:g}x", met=median <= limit)
    row.limit, row.spread = limit, spread
    assert row.judged == _model_verdict(*spread, limit)
    if row.judged is None:
        assert "too close to call" in row.verdict


def test_a_time_target_is_judged_the_same_way():
    near = Row("t", 1.9e-6, target="<= 2 µs", met=True)
    assert near.too_close and near.judged is None
    clear = Row("t", 1.5e-6, target="<= 2 µs", met=True)
    assert not clear.too_close and clear.judged is True
    over = Row("t", 3e-6, target="<= 2 µs", met=False)
    assert over.judged is False


def test_a_suite_that_judged_another_quantity_keeps_its_verdict():
    # The host ratio says missed; the suite judged its device time and says met: the bound
    # read from the target does not describe that verdict, so it is left as the suite gave it.
    row = Row("r", 2e-6, "b", 1e-6, target="<= 1x", met=True)
    assert row.judged is True
    # A target of another form (a memory bound) is the suite's alone too.
    held = Row("held", None, value="4 MiB", target="held <= tokens", met=True)
    assert held.judged is True


def test_rerunning_a_suite_prints_the_same_verdicts(capsys, temporary_suites, tmp_path):
    """Two runs whose figures move by up to 8% (less than the tolerance) around targets
    near and far from them judge alike: the close ones are not judged in either."""
    shifts = iter([0.96, 1.04])

    @suite("test_bench_output.rerun")
    def rerun(device, quick):
        shift = next(shifts)
        yield Sizes("moving figures")
        for name, ratio in [("far under", 0.5), ("near", 0.98), ("far over", 2.0)]:
            value = ratio * shift
            yield Row(name, value * 1e-3, "b", 1e-3, target="<= 1x", met=value <= 1.0)

    verdicts = []
    for _ in range(2):
        argv = ["bench", "--device", "cpu", "--only", "test_bench_output.rerun"]
        assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0
        out = capsys.readouterr().out
        verdicts.append(
            re.findall(r"^(far under|near|far over) .*?(ok|MISSED|not judged)", out, re.M)
        )
    assert verdicts[0] == verdicts[1]
    assert dict(verdicts[0]) == {"far under": "ok", "near": "not judged", "far over": "MISSED"}


def test_the_cpu_run_pins_torch_and_openmp_threads(
    capsys, temporary_suites, tmp_path, thread_variables
):
    seen = {}

    @suite("test_bench_output.threads")
    def threads(device, quick):
        seen["omp"] = os.environ.get("OMP_NUM_THREADS")
        yield Row("r", 1e-3)

    argv = ["bench", "--device", "cpu", "--only", "test_bench_output.threads"]
    assert main([*argv, "--json", str(tmp_path / "t.json")]) == 0
    assert seen["omp"] == "1"
    assert "threads: 1 (torch, OpenMP; --threads N changes it)" in capsys.readouterr().out
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None

    @suite("test_bench_output.torch_threads")
    def torch_threads(device, quick):
        seen["torch"] = torch.get_num_threads() if torch is not None else None
        yield Row("r", 1e-3)

    argv[-1] = "test_bench_output"
    assert main([*argv, "--threads", "2", "--json", str(tmp_path / "t.json")]) == 0
    assert seen["omp"] == "2"
    if torch is not None:  # an already imported torch is set at once
        assert seen["torch"] == 2
    # The process gets its own settings back: main() may run inside a longer-lived one.
    assert "OMP_NUM_THREADS" not in os.environ
    if torch is not None:
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_must_be_a_positive_integer(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--device", "cpu", "--threads", value])
    assert exit_.value.code == 2
    assert "--threads takes a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["info", "demo"])
def test_info_and_demo_help_describe_the_command(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n", 2)[1]
    assert not description.startswith("options:") and len(description.split()) > 10, out


@pytest.mark.skipif(CUDA_REASON is None, reason="a CUDA GPU works here")
def test_an_unavailable_cuda_device_points_at_the_cpu_option():
    result = subprocess.run(
        [sys.executable, "-m", "jaxbuf", "bench", "--device", "cuda", "--only", "uva"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Use --device cpu" in result.stderr and 'device="cpu"' not in result.stderr


def test_a_local_virtual_environment_is_ignored():
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()


LONG_NAME = (
    "jitted apply 256 writes, device time per apply (method='scatter' on an unexpanded "
    "pack (indices computed on the device))"
)


def _register_wordy_suite() -> None:
    @suite("test_bench_output.wordy")
    def wordy(device, quick):
        yield Sizes("a " + "very " * 30 + "long title")
        yield Row(
            LONG_NAME,
            2e-6,
            "plain JAX: a.at[r, c].set(v), device time per apply",
            1e-6,
            target="<= 1x plain JAX",
            met=False,
            notes="a note " + "that goes on " * 20,
        )
        yield Row(
            "seed-style: grow at 10,000 granules", 5e-4, "seed-style: grow at 100 granules", 5e-6
        )
        yield Row(
            "jaxbuf: grow at 10,000 granules", 2e-6, "seed-style: grow at 10,000 granules", 5e-4
        )
        yield Row("held at most (jaxbuf)", None, value="4 MiB", target="held <= tokens",
                  met=True, notes="jaxbuf held at most 4 MiB, within its bound")  # fmt: skip


def test_piped_output_fits_120_columns_with_short_names(capsys, temporary_suites, tmp_path):
    _register_wordy_suite()
    argv = ["bench", "--device", "cpu", "--only", "test_bench_output.wordy"]
    assert main([*argv, "--json", str(tmp_path / "w.json")]) == 0  # capsys: not a terminal
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    # The long name is cut before its parenthesis; the rest is a footnote it points at.
    row = next(line for line in lines if line.startswith("jitted apply 256 writes"))
    assert "(method=" not in row and re.search(r"per apply \[\d", row)
    words = " ".join(out.split())
    assert "jitted apply 256 writes, device time per apply: method='scatter' on an" in words
    # The ratio column holds jaxbuf ÷ baseline only: a seed ÷ seed scaling is a footnote.
    seed = next(line for line in lines if line.startswith("seed-style: grow at 10,000"))
    assert not re.search(r"\d+x", seed), seed
    assert "seed-style: grow at 100 granules: 100x (not jaxbuf)" in words
    jaxbuf = next(line for line in lines if line.startswith("jaxbuf: grow at 10,000"))
    assert "0.004x" in jaxbuf
    # The JSON keeps every figure, the scaling ratio included.
    import json

    rows = json.loads((tmp_path / "w.json").read_text())["suites"][0]["rows"]
    assert rows[0]["name"] == LONG_NAME and rows[1]["ratio"] == pytest.approx(100)


def test_a_short_name_never_cuts_inside_brackets():
    from jaxbuf.cli._report import short_name

    name = "plain JAX: numpy indices + jitted a.at[r, c].set(v), end to end, and more words"
    short, detail = short_name(name)
    assert short == "plain JAX: numpy indices + jitted a.at[r, c].set(v)"
    assert detail == f"{short}: end to end, and more words"
    assert short_name("short") == ("short", "")
    unbroken = "x" * 80
    short, detail = short_name(unbroken)
    assert len(short) <= 60 and short.endswith("…") and unbroken in detail


def test_a_footnote_keeps_its_parentheses_balanced():
    """A name cut before a parenthesis that the rest of the name outlasts keeps the whole
    parenthesis in its footnote (it read "copy_batch: memmove loop in C), the CPU ...")."""
    from jaxbuf.cli._report import _depth, short_name

    name = (
        "floor: 8,192 scattered blocks gathered by one copy_batch (memmove loop in C), the "
        "CPU driver's copy, in one process"
    )
    short, detail = short_name(name)
    assert short == "floor: 8,192 scattered blocks gathered by one copy_batch"
    assert detail == f"{short}: (memmove loop in C), the CPU driver's copy, in one process"
    assert _depth(detail) == 0 and detail.count("(") == detail.count(")")
    whole = "a name long enough to be cut at its parenthesis here (and all the rest inside)"
    assert short_name(whole)[1].endswith(": and all the rest inside")


def _decode_profiles() -> list[dict]:
    """jax.decode and torch.decode rows of three profiles each, shaped as the suites write
    them: six panels a row before the grid."""
    rows = []
    for framework in ("jax", "torch"):
        for profile, steps in (("short", 40), ("long", 160), ("mixed", 160)):
            needed = [(1 + i // 16) << 18 for i in range(steps)]
            step_s = [1e-3 * (1 + (i % 17 == 0)) for i in range(steps)]
            series = {
                variant: {"step_s": step_s, "held_bytes": needed}
                for variant in ("jaxbuf", "preallocated", "realloc")
            }
            params = {
                "kind": "decode-step",
                "profile": profile,
                "framework": framework,
                "granule_bytes": 2 << 20,
                "needed_bytes": needed,
                "series": series,
            }
            rows.append(Row(f"{framework} decode {profile}", 1e-3, params=params).to_json())
    return [{"name": "jax.decode", "rows": rows[:3]}, {"name": "torch.decode", "rows": rows[3:]}]


def test_the_decode_plot_is_a_grid_under_2000_px_one_colour_per_series(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from jaxbuf.cli import _plots

    path = tmp_path / "decode.png"
    captured = {}
    save = _plots._save

    def keep(plt, figure, where, note=""):
        captured["labels"] = {
            line.get_label(): line.get_color()
            for axis in figure.axes
            for line in axis.lines
            if not line.get_label().startswith("_")
        }
        save(plt, figure, where, note)

    _plots._save, saved = keep, _plots._save
    try:
        assert _plots._plot_decode(_decode_profiles(), path, "cpu")
    finally:
        _plots._save = saved
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width <= 2000 and height <= 2400, (width, height)
    colours = captured["labels"]
    series = [label for label in colours if not label.startswith("granule")]
    assert len({colours[label] for label in series}) == len(series), colours


def test_plot_with_nothing_to_draw_names_what_it_can_draw_here(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from jaxbuf.cli import _plots
    from jaxbuf.devices import Device

    results = [{"name": "staged.patterns", "rows": [], "skipped": "interpreter"}]
    assert _plots.write_plots(results, str(tmp_path / "p.png"), Device("cpu"), "cpu") == []
    err = " ".join(capsys.readouterr().err.split())
    assert "staged.patterns was skipped (off a GPU its rows time Triton's interpreter" in err
    assert "On cpu, --plot draws extensible.growth" in err
    assert "run the extensible.growth, jax.decode or staged.patterns suite" not in err
