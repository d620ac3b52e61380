"""The ``python -m jaxbuf`` command: info, bench, demo, and its errors (run as subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxbuf.__main__ import main
from jaxbuf.bench import (
    SUITES,
    Row,
    Sizes,
    SuiteSkipped,
    format_bytes,
    format_seconds,
    missing_dependency,
    require,
    select_suites,
    suite,
)
from jaxbuf.drivers import cuda_unavailable_reason

REPO = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
needs_frameworks = pytest.mark.skipif(
    not (HAS_TORCH and HAS_JAX), reason="the demo and the baselines need torch and JAX"
)


# Runs ``python -m jaxbuf`` as if the modules named in argv[1] (comma-separated) were not
# installed: a wrapper around the path finder finds nothing for them, so ``import torch``
# raises ModuleNotFoundError, ``importlib.util.find_spec("torch")`` is None and
# importlib.metadata lists no torch distribution, as on a core-only install.
HIDING_LAUNCHER = textwrap.dedent(
    """
    import importlib.machinery, runpy, sys

    hidden = set(sys.argv.pop(1).split(","))
    path_finder = importlib.machinery.PathFinder

    class HidingFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in hidden:
                return None
            return path_finder.find_spec(name, path, target)

        @staticmethod
        def invalidate_caches():
            path_finder.invalidate_caches()

        @staticmethod
        def find_distributions(*args, **kwargs):  # importlib.metadata asks here
            for dist in path_finder.find_distributions(*args, **kwargs):
                if dist.metadata["Name"].lower().replace("-", "_") not in hidden:
                    yield dist

    sys.meta_path[:] = [HidingFinder if f is path_finder else f for f in sys.meta_path]
    sys.argv[0] = "jaxbuf"
    runpy.run_module("jaxbuf", run_name="__main__", alter_sys=True)
    """
)
CORE_ONLY = ("torch", "triton", "jax", "jaxlib")


def run_cli(
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    hide: tuple[str, ...] = (),
    cwd: Path = REPO,
):
    """``python -m jaxbuf ARGS`` in a subprocess; ``hide`` names modules to treat as absent."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if hide:
        command = [sys.executable, "-c", HIDING_LAUNCHER, ",".join(hide), *args]
    else:
        command = [sys.executable, "-m", "jaxbuf", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environment
    )


def assert_one_line_error(result) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jaxbuf: error: "), result.stderr
    assert "Traceback" not in result.stderr


def test_info_exits_zero():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    for word in ("drivers", "cpu", "versions", "numpy", "default device"):
        assert word in result.stdout
    if cuda_unavailable_reason() is not None:
        assert "unavailable" in result.stdout


@needs_frameworks
def test_demo_on_cpu_exits_zero():
    result = run_cli("demo", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MISMATCH" not in result.stdout
    assert len(re.findall(r"\bok\b", result.stdout)) >= 4, result.stdout  # one per grow


@needs_frameworks
def test_bench_quick_writes_json_and_plot(tmp_path):
    # Every suite but the JAX ones, which tests/test_bench_jax.py runs the same way (--quick,
    # --plot) and checks with the same rules.
    json_path = tmp_path / "out" / "bench.json"
    plot_path = tmp_path / "growth.png"
    names = [s.name for s in select_suites() if not s.name.startswith("test_cli")]
    areas = sorted({name.split(".")[0] for name in names})
    assert "jax" in areas and "extensible" in areas
    result = run_cli(
        "bench",
        "--device",
        "cpu",
        "--quick",
        "--only",
        *(area for area in areas if area != "jax"),
        "--json",
        str(json_path),
        "--plot",
        str(plot_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(json_path.read_text())
    assert document["device"] == "cpu" and document["quick"] is True
    assert {"date", "machine", "versions", "suites"} <= document.keys()
    assert document["machine"]["node"]
    assert document["versions"]["numpy"] != "not installed"
    names = {s["name"] for s in document["suites"]}
    assert {
        "extensible.growth",
        "extensible.bookkeeping",
        "extensible.views",
        "extensible.release",
    } <= names
    for suite_result in document["suites"]:
        assert suite_result["error"] is None, suite_result
        assert bool(suite_result["rows"]) != bool(suite_result["skipped"]), suite_result
        assert suite_result["interpreter"] is False  # not asked for: no interpreter figures
        for row in suite_result["rows"]:
            # A time, or a value of another kind (a decode loop's bytes held).
            assert row["median_s"] > 0 if row["median_s"] is not None else row["value"], row
            if row["baseline_median_s"] is not None:
                # One direction everywhere: jaxbuf ÷ baseline, lower is better.
                assert row["ratio"] == pytest.approx(row["median_s"] / row["baseline_median_s"])
            if row["target"]:
                assert ">=" not in row["target"], row  # targets point the ratio's way
                # --quick judges no full-size target, only bounds that hold at any size.
                assert row["met"] is None or row["size_independent"], row
    assert "MISSED" not in result.stdout
    assert "not judged: quick sizes" in result.stdout
    # The direction, above the tables (each table's ratio column says it too, wrapped).
    assert "Every ratio is jaxbuf ÷ baseline: below 1, jaxbuf is faster" in result.stdout
    # Every suite that ran prints a table with its name; the others are listed with a reason.
    for name in names:
        assert name in result.stdout
    skipped = {s["name"]: s["skipped"] for s in document["suites"] if s["skipped"]}
    assert {"staged.patterns", "staged.overlap", "uva.read", "peer.read"} <= skipped.keys()
    words = " ".join(result.stdout.split())  # piped: long lines wrap at 120 columns
    for name, reason in skipped.items():
        assert f"{name}: {reason}" in words
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_only_selects_by_prefix(tmp_path):
    json_path = tmp_path / "views.json"
    result = run_cli(
        "bench",
        "--device",
        "cpu",
        "--quick",
        "--only",
        "extensible.views",
        "--json",
        str(json_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(json_path.read_text())
    assert [s["name"] for s in document["suites"]] == ["extensible.views"]


@pytest.mark.parametrize(
    "only, platform_allocator",
    [("extensible.views", False), ("extensible.release", True)],
)
def test_bench_pins_jax_to_fresh_allocations_only_for_suites_that_need_it(
    tmp_path, only, platform_allocator
):
    """Suites registered with fresh_jax_allocations (realloc baselines) run JAX on its
    platform allocator; a run of others keeps JAX's pool, as a JAX user runs."""
    json_path = tmp_path / "run.json"
    environment = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_ALLOCATOR"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxbuf",
            "bench",
            "--device",
            "cpu",
            "--quick",
            "--only",
            only,
            "--json",
            str(json_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=environment,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    recorded = json.loads(json_path.read_text())["environment"]
    expected = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"} if platform_allocator else {}
    assert {k: v for k, v in recorded.items() if k == "XLA_PYTHON_CLIENT_ALLOCATOR"} == expected
    assert "platform allocator" not in result.stderr  # no JAX hot-path suite was selected


def test_bench_warns_when_jax_hot_paths_share_the_platform_allocator(monkeypatch, capsys):
    """A run that selects a fresh-allocation suite with a JAX hot-path suite times the latter
    under the platform allocator too: the command says so and names the separate run."""
    from jaxbuf import bench
    from jaxbuf.cli import _bench

    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    suites = bench.select_suites(["jax.decode", "jax.staged", "extensible.views"])
    _bench._warn_of_shared_allocator(suites)
    warning = capsys.readouterr().err
    assert "jax.decode run JAX on its platform allocator" in warning
    assert "--only jax.staged" in warning and "extensible.views" not in warning
    # A user's own allocator setting is theirs: nothing to warn about.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
    _bench._warn_of_shared_allocator(suites)
    assert capsys.readouterr().err == ""


BAD_DEVICES = ["tpu", "cuda:99", "cuda:x", "-1"]
if cuda_unavailable_reason() is not None:
    BAD_DEVICES.append("cuda")


@pytest.mark.parametrize("command", ["bench", "demo"])
@pytest.mark.parametrize("device", BAD_DEVICES)
def test_bad_device_is_one_line_and_nonzero(command, device):
    assert_one_line_error(run_cli(command, f"--device={device}", timeout=60))


def test_unknown_suite_is_one_line_and_nonzero():
    result = run_cli("bench", "--device", "cpu", "--only", "no-such-suite", timeout=60)
    assert_one_line_error(result)
    assert "no-such-suite" in result.stderr


def test_unavailable_framework_is_one_line_and_nonzero(tmp_path):
    # A `jax` that fails to import stands in for a broken or missing JAX.
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise ImportError('jax blocked by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = run_cli("demo", "--device", "cpu", "--framework", "jax", env=env, timeout=60)
    assert_one_line_error(result)
    assert "jax" in result.stderr


def test_main_in_process_returns_two_for_a_bad_device(capsys):
    assert main(["bench", "--device", "tpu"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        "jaxbuf: error: unknown device 'tpu'; expected 'cpu', 'cuda' or 'cuda:N'"
    )


def test_version_prints_the_package_version():
    import jaxbuf

    result = run_cli("--version", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"jaxbuf {jaxbuf.__version__}"


def test_no_subcommand_prints_usage(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


# -- the registry ---------------------------------------------------------------------------
def test_registry_selects_by_prefix_and_rejects_unknown():
    everything = select_suites()
    assert {"extensible.growth", "extensible.views"} <= {s.name for s in everything}
    assert {s.name for s in select_suites(["extensible"])} >= {"extensible.growth"}
    assert [s.name for s in select_suites(["extensible.views"])] == ["extensible.views"]
    with pytest.raises(ValueError, match="'nope'"):
        select_suites(["nope"])
    with pytest.raises(ValueError, match="non-empty"):
        suite("")


def test_registering_a_name_twice_is_an_error():
    def first(device, quick):
        return []

    def second(device, quick):
        return []

    suite("test_cli.duplicate")(first)
    suite("test_cli.duplicate")(first)  # the same function again is harmless
    with pytest.raises(ValueError, match="registered twice"):
        suite("test_cli.duplicate")(second)
    from jaxbuf.bench import SUITES

    del SUITES["test_cli.duplicate"]


def test_row_ratio_and_formatting():
    assert Row("a", 2e-3, "b", 4e-3).ratio == pytest.approx(0.5)  # jaxbuf ÷ baseline
    assert Row("a", 2e-3, "b", None).ratio is None
    assert Row("a", 2e-3).to_json()["ratio"] is None
    assert format_bytes(2 << 20) == "2 MiB" and format_bytes(48 << 30) == "48 GiB"
    assert format_bytes(3 << 19) == "1.5 MiB"
    assert format_seconds(1.5e-6) == "1.5 µs" and format_seconds(None) == "—"


# -- a core-only install, skips, targets, titles, the plot's default path ---------------------
SIZE_WORDS = re.compile(r"\d[\d,.]*\s*(?:B|KiB|MiB|GiB|TiB)\b")


def test_bench_on_a_core_only_install_skips_what_needs_a_framework(tmp_path):
    json_path = tmp_path / "core.json"
    result = run_cli(
        "bench",
        "--device",
        "cpu",
        "--quick",
        "--json",
        str(json_path),
        hide=CORE_ONLY,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # (A row may still miss a target against a baseline that ran: MISSED is judged per row.)
    assert "Traceback" not in output and "FAILED" not in output
    assert "warning" not in result.stderr, result.stderr  # every bench module imports
    document = json.loads(json_path.read_text())
    versions = document["versions"]
    assert versions["torch"] == versions["jax"] == "not installed" != versions["numpy"]
    by_name = {s["name"]: s for s in document["suites"]}
    for name in ("staged.apply", "jax.decode", "jax.staged"):
        reason = by_name[name]["skipped"]
        assert reason and "not installed" in reason and "pip install 'jaxbuf[" in reason, name
        assert f"{name}: skipped: {reason}" in result.stdout
    # What would not mean anything on the CPU says so first, installed or not.
    assert by_name["uva.read"]["skipped"].startswith("needs a CUDA GPU: ")
    assert "Triton's interpreter" in by_name["staged.overlap"]["skipped"]
    ran = [s for s in document["suites"] if s["skipped"] is None]
    assert {"extensible.growth", "extensible.views", "uva.copy_to_uva"} <= {s["name"] for s in ran}
    for suite_result in document["suites"]:
        assert suite_result["error"] is None, suite_result
    skipped_baselines = 0
    for suite_result in ran:
        assert suite_result["rows"], suite_result["name"]
        for row in suite_result["rows"]:
            if row["baseline_name"] and row["baseline_median_s"] is None:
                skipped_baselines += 1
                assert row["met"] is None, row  # not judged, in the JSON too
    assert skipped_baselines  # the growth suite's torch and JAX baselines


def test_a_row_whose_baseline_was_skipped_is_never_missed():
    row = Row("grow", 1e-3, "torch realloc+copy", None, notes="skipped: torch is not installed")
    row.target, row.met = "<= 0.001x", False  # what a suite computes from a missing ratio
    assert row.baseline_skipped and row.judged is None
    assert row.verdict == "<= 0.001x not judged (baseline not measured)"
    assert row.to_json()["met"] is None
    measured = Row("grow", 1e-3, "torch realloc+copy", 0.5, target="<= 0.001x", met=False)
    assert measured.verdict == "<= 0.001x MISSED" and measured.to_json()["met"] is False
    assert Row("grow", 1e-3, "b", 2.0, target="<= 0.001x", met=True).verdict == "<= 0.001x ok"
    absolute = Row("capsule", 1e-7, target="<= 2 µs", met=True)  # no baseline at all
    assert absolute.verdict == "<= 2 µs ok"
    assert Row("view", None, notes="skipped").verdict == ""


@pytest.fixture
def temporary_suites():
    """Suites registered by a test, removed afterwards."""
    before = set(SUITES)
    yield
    for name in set(SUITES) - before:
        del SUITES[name]


def test_requires_and_require_skip_a_suite_with_its_reason(tmp_path, capsys, temporary_suites):
    @suite("test_cli.needs_module", requires=("jaxbuf_no_such_module",))
    def needs_module(device, quick):
        raise AssertionError("a suite whose requirement is missing must not run")

    @suite("test_cli.needs_inside")
    def needs_inside(device, quick):
        yield Sizes("1 row")
        yield Row("before the skip", 1e-6)
        require("jaxbuf_no_such_module")

    @suite("test_cli.runs")
    def runs(device, quick):
        yield Sizes("3 KiB")
        yield Row("measured", 2e-6, "baseline", 4e-6)

    json_path = tmp_path / "skips.json"
    status = main(["bench", "--device", "cpu", "--only", "test_cli", "--json", str(json_path)])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert "Traceback" not in captured.err and "FAILED" not in captured.out
    reason = "needs jaxbuf_no_such_module, which is not installed"
    assert f"test_cli.needs_module: skipped: {reason}" in captured.out
    assert "test_cli.needs_inside stopped early, skipped: " + reason in captured.out
    assert "test_cli.runs: " in captured.out and "Sizes: 3 KiB." in captured.out
    document = json.loads(json_path.read_text())
    by_name = {s["name"]: s for s in document["suites"]}
    assert by_name["test_cli.needs_module"]["skipped"].startswith(reason)
    assert by_name["test_cli.needs_module"]["rows"] == []
    assert [r["name"] for r in by_name["test_cli.needs_inside"]["rows"]] == ["before the skip"]
    assert by_name["test_cli.runs"]["skipped"] is None
    assert by_name["test_cli.runs"]["sizes"] == "3 KiB"


def test_missing_dependency_and_require():
    assert missing_dependency("numpy") is None
    reason = missing_dependency("jaxbuf_no_such_module")
    assert reason == (
        "needs jaxbuf_no_such_module, which is not installed "
        "(pip install 'jaxbuf[jaxbuf_no_such_module]')"
    )
    require("numpy")
    with pytest.raises(SuiteSkipped, match="jaxbuf_no_such_module"):
        require("numpy", "jaxbuf_no_such_module")
    with pytest.raises(TypeError, match="requires"):
        suite("test_cli.bad_requires", requires="torch")


def test_suite_titles_state_only_the_sizes_run():
    # The description (the docstring's title) names no sizes: they depend on the device and
    # --quick, and come from the run (Sizes), so a title cannot claim sizes that did not run.
    for registered in select_suites():
        assert not SIZE_WORDS.search(registered.description), registered
        assert "\n" not in registered.description


def test_bench_titles_show_the_sizes_of_this_run(tmp_path):
    from jaxbuf.bench.extensible import _growth_plan
    from jaxbuf.devices import Device

    json_path = tmp_path / "sizes.json"
    result = run_cli(
        "bench",
        "--device",
        "cpu",
        "--quick",
        "--only",
        "extensible",
        "--json",
        str(json_path),
        hide=CORE_ONLY,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(json_path.read_text())
    words = " ".join(result.stdout.split())  # a long title wraps in the table
    for suite_result in document["suites"]:
        assert suite_result["sizes"], suite_result["name"]  # every suite states its sizes
        title = f"{suite_result['name']}: {suite_result['description']} "
        title += f"Sizes: {suite_result['sizes']}."
        assert " ".join(title.split()) in words, (title, result.stdout)
    committed, steps, _, _ = _growth_plan(Device("cpu"), True)
    growth = next(s for s in document["suites"] if s["name"] == "extensible.growth")
    for size in (*committed, *steps):
        assert format_bytes(size) in growth["sizes"]
    assert "48 GiB" not in result.stdout  # the full run's size, not run with --quick


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="--plot needs matplotlib"
)
def test_plot_without_a_path_writes_results_growth_device_png(tmp_path):
    result = run_cli(
        "bench",
        "--device",
        "cpu",
        "--quick",
        "--only",
        "extensible.growth",
        "--plot",
        cwd=tmp_path,
        hide=CORE_ONLY,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    plot = tmp_path / "results" / "growth-cpu.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --only writes its own result, never the full run's bench-cpu.json.
    assert (tmp_path / "results" / "bench-cpu-extensible.growth.json").is_file()
    assert not (tmp_path / "results" / "bench-cpu.json").exists()
    assert f"plot: {Path('results') / 'growth-cpu.png'}" in result.stdout


def test_plot_without_matplotlib_is_one_line_and_nonzero(tmp_path):
    result = run_cli(
        "bench", "--device", "cpu", "--plot", cwd=tmp_path, hide=("matplotlib",), timeout=60
    )
    assert_one_line_error(result)
    assert "--plot needs matplotlib" in result.stderr and "jaxbuf[plot]" in result.stderr
    assert not (tmp_path / "results").exists()


# -- what runs off a GPU, interpreter figures, one line per suite, one ratio direction -------
def test_off_a_gpu_gpu_only_and_interpreter_suites_are_skipped_with_their_reason():
    from jaxbuf.devices import Device

    cpu = Device("cpu")
    suites = {s.name: s for s in select_suites()}
    for name in ("staged.patterns", "staged.overlap"):
        assert suites[name].uses_interpreter(cpu)
        assert "Triton's interpreter" in suites[name].skip_reason(cpu)
        assert "--interpreter" in suites[name].skip_reason(cpu)
        assert suites[name].skip_reason(cpu, interpreter=True) == suites[name].missing_requirement()
    for name in ("uva.read", "peer.read"):
        assert suites[name].skip_reason(cpu, interpreter=True).startswith("needs a CUDA GPU: ")
    # What means something on the CPU runs by default: growth, views, UVA copies, staging on
    # the host, the JAX suites.
    for name in ("extensible.growth", "extensible.views", "uva.copy_to_uva", "staged.stage"):
        assert suites[name].skip_reason(cpu) is None, name
    assert not suites["extensible.growth"].uses_interpreter(Device("cuda", 0))


def _register_cpu_suites(gpu_ran: list[str]) -> None:
    """Four suites: plain, GPU-only, interpreted (each with a target) and a failing-target one."""

    @suite("test_cli.plain")
    def plain(device, quick):
        yield Sizes("1 row")
        yield Row("fast", 1e-6, "slow", 4e-6, target="<= 0.5x", met=True)
        yield Row("slow", 4e-6, "fast", 1e-6, target="<= 0.5x", met=False)

    @suite("test_cli.gpu_only", gpu_only="a GPU measurement")
    def gpu_only(device, quick):
        gpu_ran.append("gpu_only")
        yield Row("never", 1e-6)

    @suite("test_cli.interpreted", interpreted=True)
    def interpreted(device, quick):
        yield Sizes("1 row")
        yield Row("kernel", 1.0, "torch", 1e-3, target="<= 1x", met=False)


def test_cpu_run_skips_lists_and_labels(tmp_path, capsys, temporary_suites):
    ran: list[str] = []
    _register_cpu_suites(ran)
    json_path = tmp_path / "run.json"
    argv = ["bench", "--device", "cpu", "--only", "test_cli", "--json", str(json_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ran == []  # a GPU-only suite never runs on the CPU
    assert "skipped here (2 of 3 suites):" in out
    assert "  test_cli.gpu_only: needs a CUDA GPU: a GPU measurement" in out
    assert "  test_cli.interpreted: off a GPU its kernels run under Triton's interpreter" in out
    # Piped, a row is two lines: name, median, ratio, verdict; then its baseline and target.
    assert re.search(r"^fast .* ok\n  vs slow .* <= 0\.5x$", out, re.M)
    assert re.search(r"^slow .* MISSED\n  vs fast .* <= 0\.5x$", out, re.M)
    document = json.loads(json_path.read_text())
    assert document["interpreter"] is False
    assert document["ratio"].startswith("median_s / baseline_median_s (jaxbuf ÷ baseline")
    plain_rows = document["suites"][0]["rows"]
    assert [r["ratio"] for r in plain_rows] == [pytest.approx(0.25), pytest.approx(4.0)]
    assert [r["met"] for r in plain_rows] == [True, False]

    # Asked for, the interpreter suite runs, labelled, and is never judged.
    assert main([*argv, "--interpreter"]) == 0
    out = capsys.readouterr().out
    assert "Triton interpreter figures: they time the interpreter, not jaxbuf" in out
    assert re.search(r" not judged: interpreter\n  vs torch .* <= 1x$", out, re.M)
    assert "missed: test_cli.interpreted" not in out
    interpreted = json.loads(json_path.read_text())["suites"][2]
    assert interpreted["interpreter"] is True
    (row,) = interpreted["rows"]
    assert row["interpreter"] is True and row["met"] is None and row["target_reached"] is False


def test_quick_runs_report_targets_without_judging_them(tmp_path, capsys, temporary_suites):
    _register_cpu_suites([])
    argv = ["bench", "--device", "cpu", "--quick", "--only", "test_cli.plain"]
    assert main([*argv, "--json", str(tmp_path / "quick.json")]) == 0
    out = capsys.readouterr().out
    assert "(quick: small sizes, targets not judged at quick sizes)" in out
    assert len(re.findall(r" not judged: quick sizes\n  vs .* <= 0\.5x$", out, re.M)) == 2
    assert "MISSED" not in out and "missed:" not in out
    rows = json.loads((tmp_path / "quick.json").read_text())["suites"][0]["rows"]
    assert [(r["met"], r["target_reached"], r["at_quick_sizes"]) for r in rows] == [
        (None, True, True),
        (None, False, True),
    ]
    bound = Row("held", 1.0, "b", 1.0, target="held <= tokens", met=False, size_independent=True)
    bound.at_quick_sizes = True
    assert bound.verdict == "held <= tokens MISSED"  # a bound at any size is judged anyway


def test_one_line_per_suite_when_stdout_is_not_a_terminal(tmp_path, capsys, temporary_suites):
    _register_cpu_suites([])
    argv = ["bench", "--device", "cpu", "--only", "test_cli", "--json", str(tmp_path / "x.json")]
    assert main(argv) == 0  # capsys: stdout is not a terminal
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 3
    assert re.fullmatch(
        r"\[1/3\] test_cli\.plain \(\d+\.\d s\): 2 rows: 1 ok, 1 MISSED", progress[0]
    )
    assert re.fullmatch(
        r"\[2/3\] test_cli\.gpu_only \(\d+\.\d s\): skipped: needs a CUDA GPU: a GPU measurement",
        progress[1],
    )
    assert progress[2].startswith("[3/3] test_cli.interpreted (")
    # The lines come before the tables, as each suite ends.
    title = next(i for i, line in enumerate(lines) if line.startswith("test_cli.plain: "))
    assert lines.index(progress[-1]) < title


def test_the_ratio_column_says_its_direction():
    from jaxbuf.bench import RATIO
    from jaxbuf.cli._report import RATIO_COLUMN, RATIO_LINE, suite_table

    assert RATIO == RATIO_COLUMN == "jaxbuf ÷ baseline"
    assert "lower is better" in RATIO_LINE
    columns, cells, under = suite_table(
        [Row("x", 3e-6, "base", 1e-6, interpreter=True, notes="n")], "cpu"
    )
    assert columns[4] == RATIO_COLUMN and cells[0][4] == "3x"
    # One row: every note is shared, printed once under the table.
    assert under == [
        "  every row: Triton interpreter figures: they time the interpreter, not jaxbuf; n"
    ]


# -- footnotes, the legend, the tally, stable verdicts, --only's file, the exit status ------
def test_each_note_is_one_footnote_that_rows_point_at():
    from jaxbuf.cli._report import suite_table

    rows = [
        Row("a", 1e-6, "seed-style x", 2e-6, notes="shared; first"),
        Row("b", 1e-6, "seed-style x", 2e-6, notes="shared; second; first"),
        Row("c", 1e-6, "torch y", 2e-6, notes="shared"),
        Row("d", 1e-6, "torch y", 2e-6, target="<= 1x", met=True, not_judged_here="GPU only"),
    ]
    rows[2].notes, rows[3].notes = "shared", "shared"
    _, cells, under = suite_table(rows, "cpu")
    assert [c[0] for c in cells] == ["a [1]", "b [1,2]", "c", "d"]
    assert cells[3][6] == "not judged here [3]"
    assert under == [
        "  [1] first",
        "  [2] second",
        "  [3] not judged on cpu: GPU only",
        "  every row: shared",
    ]


def test_the_legend_defines_each_baseline_kind_the_run_used():
    from jaxbuf.bench import BASELINE_KINDS, baseline_kind
    from jaxbuf.cli._report import legend

    assert baseline_kind("seed-style (granule set)") == "seed-style"
    assert baseline_kind("raw create+map+set_access (floor)") == "floor"
    assert baseline_kind("torch realloc+copy") == "realloc+copy"
    assert baseline_kind("plain JAX: numpy index build (host)") == "plain JAX"
    assert baseline_kind("something new") == "other" and baseline_kind("") == ""
    lines = legend([Row("a", 1.0, "seed-style x", 1.0), Row("b", 1.0, "torch y", 1.0)])
    assert lines[1:] == [
        f"  seed-style  {BASELINE_KINDS['seed-style']}",
        f"  torch       {BASELINE_KINDS['torch']}",
    ]
    assert legend([Row("a", 1.0)]) == []


def test_every_baseline_of_the_registered_suites_names_a_known_kind():
    from jaxbuf.bench import baseline_kind

    # The baseline names as the suites spell them (a literal after the row's median).
    sources = (REPO / "jaxbuf" / "bench").glob("*.py")
    literals = re.compile(r'Row\(\s*[^,]+,\s*[^,]+,\s*f?"([^"]+)"')
    names = {m for path in sources for m in literals.findall(path.read_text())}
    assert len(names) > 20
    # A name built from a variable ("{_LABELS[...]}, median step") is checked by the runs.
    unknown = sorted(n for n in names if baseline_kind(n) == "other" and n[0] != "{")
    assert unknown == [], unknown


def test_a_bound_inside_the_spread_is_not_judged():
    from jaxbuf.bench import ratio_spread, time_spread

    row = Row("r", 1.1e-6, "b", 1e-6, target="<= 1.2x", met=True, limit=1.2)
    row.spread = (0.9, 1.3)  # a repeat could land on either side of 1.2
    assert row.too_close and row.judged is None
    assert row.verdict == "<= 1.2x not judged (too close to call)"
    assert row.to_json()["spread"] == [0.9, 1.3] and row.to_json()["met"] is None
    row.spread = (0.9, 1.1)  # 1.1 + 10% (TOLERANCE) reaches past 1.2: a rerun could flip it
    assert row.too_close and row.judged is None
    row.spread = (0.9, 1.05)
    assert not row.too_close and row.judged is True
    assert ratio_spread([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], paired=True) == (1.5, 2.5)
    low, high = ratio_spread([2.0] * 4, [1.0, 1.0, 2.0, 2.0])
    assert low < 2.0 / 1.5 < high
    assert time_spread([3.0]) == (3.0, 3.0)
    with pytest.raises(ValueError, match="as many"):
        ratio_spread([1.0], [1.0, 2.0], paired=True)


def test_the_tally_counts_met_missed_and_not_judged_with_the_reasons():
    from jaxbuf.cli._report import tally, tally_lines

    class Named:
        name = "s"

    rows = [
        Row("met", 1.0, "b", 2.0, target="<= 1x", met=True),
        Row("missed", 2.0, "b", 1.0, target="<= 1x", met=False),
        Row("gpu", 2.0, "b", 1.0, target="<= 1x", met=False, not_judged_here="a GPU target"),
        Row("quick", 2.0, "b", 1.0, target="<= 1x", met=False, at_quick_sizes=True),
        Row("quick2", 2.0, "b", 1.0, target="<= 1x", met=True, at_quick_sizes=True),
        Row("no target", 2.0, "b", 1.0),
    ]
    counts = tally([{"suite": Named(), "rows": rows}], "cpu")
    assert counts["met"] == 1 and [r.name for _, r in counts["missed"]] == ["missed"]
    lines = tally_lines(counts, strict=False)
    assert lines[0] == "cpu: 1 targets met, 1 missed, 3 not judged here:"
    assert lines[1].startswith("  2 quick sizes: targets are set for full sizes")
    assert lines[2] == "  1 not judged on cpu: a GPU target"
    assert lines[3] == "  missed: s: missed: 2x, target <= 1x"
    assert "exit 0" in lines[4] and "--strict" in lines[4]
    assert "exit 1" in tally_lines(counts, strict=True)[-1]


def test_only_writes_its_own_result_file():
    from jaxbuf.cli._bench import _default_json_path
    from jaxbuf.devices import Device

    cpu = Device("cpu")
    assert _default_json_path(cpu) == Path("results/bench-cpu.json")
    assert _default_json_path(cpu, ["uva"]) == Path("results/bench-cpu-uva.json")
    assert _default_json_path(cpu, ["jax.staged", "uva", "uva"]) == Path(
        "results/bench-cpu-jax.staged+uva.json"
    )
    assert _default_json_path(cpu, ["a/b"]) == Path("results/bench-cpu-a_b.json")


def test_exit_status_missed_targets_fail_only_with_strict(tmp_path, capsys, temporary_suites):
    _register_cpu_suites([])  # test_cli.plain misses one of its two targets

    @suite("test_cli.broken")
    def broken(device, quick):
        yield Sizes("1 row")
        raise RuntimeError("a bug in the suite")

    argv = ["bench", "--device", "cpu", "--json", str(tmp_path / "r.json"), "--only"]
    assert main([*argv, "test_cli.plain"]) == 0
    out = capsys.readouterr().out
    assert "cpu: 1 targets met, 1 missed, 0 not judged here." in out
    assert "missed: test_cli.plain: slow: 4x, target <= 0.5x" in out
    tallied = json.loads((tmp_path / "r.json").read_text())["tally"]
    assert tallied == {"met": 1, "missed": ["test_cli.plain: slow"], "not_judged": {}}
    assert main([*argv, "test_cli.plain", "--strict"]) == 1
    assert main([*argv, "test_cli.plain", "--quick", "--strict"]) == 0  # nothing judged
    capsys.readouterr()
    assert main([*argv, "test_cli.broken"]) == 1  # a failed suite fails the run
    assert "test_cli.broken FAILED: RuntimeError: a bug in the suite" in capsys.readouterr().out


def test_help_documents_the_exit_status_and_the_interpreters_cost(capsys):
    from jaxbuf.cli._bench import INTERPRETER_COST

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    words = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 when every selected suite ran" in words
    assert "--strict when a target was missed" in words
    assert f"slow: {INTERPRETER_COST}" in words
    assert "results/bench-<device>-<names>.json" in words


def test_interpreter_runs_state_their_cost_up_front(tmp_path, capsys, temporary_suites):
    from jaxbuf.cli._bench import INTERPRETER_COST

    _register_cpu_suites([])
    argv = ["bench", "--device", "cpu", "--only", "test_cli.interpreted"]
    assert main([*argv, "--json", str(tmp_path / "r.json"), "--interpreter"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("--interpreter: test_cli.interpreted run under Triton's")
    assert " ".join(" ".join(lines[1:3]).split()) == (
        f"--interpreter: test_cli.interpreted run under Triton's interpreter here, "
        f"{INTERPRETER_COST}; their figures time the interpreter and are never judged"
    )


# -- plots: jaxbuf on top, legends outside, sizes in binary units, no interpreter figures ----
@pytest.fixture
def captured_figures(monkeypatch):
    """The figures the plotters save, kept open for the test to inspect."""
    pytest.importorskip("matplotlib")
    from jaxbuf.cli import _plots

    figures: list = []

    def keep(plt, figure, path, note=""):
        figures.append((figure, note))

    monkeypatch.setattr(_plots, "_save", keep)
    yield figures
    import matplotlib.pyplot as plt

    for figure, _ in figures:
        plt.close(figure)


def _growth_rows(committed_sizes, step=2 << 20):
    rows = []
    for committed in committed_sizes:
        for kind, baseline_s in (("floor", 9e-6), ("torch", 1e-3)):
            params = {"committed_bytes": committed, "step_bytes": step, "baseline_kind": kind}
            rows.append(Row("grow", 1e-5, kind, baseline_s, params=params).to_json())
    return [{"name": "extensible.growth", "rows": rows}]


def _decode_rows(steps=64, held=None, granule=2 << 20):
    """One jax.decode profile shaped as the suite writes it: jaxbuf's cache holding what the
    tokens need (the line the plot must not hide), step times with a few slow steps."""
    needed = [(1 + i // 16) << 20 for i in range(steps)]
    held = held or [n + (1 << 20) for n in needed]
    step_s = [1e-3 * (3 if i % 20 == 7 else 1) for i in range(steps)]
    series = {
        "jaxbuf": {"step_s": step_s, "held_bytes": held},
        "preallocated": {"step_s": step_s[::-1], "held_bytes": [8 << 20] * steps},
        "realloc": {"step_s": step_s, "held_bytes": held},
    }
    params = {
        "kind": "decode-step",
        "profile": "long",
        "granule_bytes": granule,
        "needed_bytes": needed,
        "series": series,
    }
    return [{"name": "jax.decode", "rows": [Row("d", 1e-3, params=params).to_json()]}]


def _staged_rows(sizes=(256, 4096), interpreter=False):
    rows = []
    for writes in sizes:
        for pattern in ("own row", "random"):
            for timing in ("host", "end to end"):
                for kind, baseline_s in (("seed", 5e-4), ("index_put", 2e-4)):
                    params = {
                        "kind": "pattern-apply",
                        "timing": timing,
                        "pattern": pattern,
                        "num_writes": writes,
                        "baseline_kind": kind,
                    }
                    row = Row(
                        "apply", 3e-5, kind, baseline_s, interpreter=interpreter, params=params
                    )
                    rows.append(row.to_json())
    return [{"name": "staged.patterns", "rows": rows}]


def _every_plot(captured_figures, tmp_path):
    from jaxbuf.cli._plots import _plot_decode, _plot_growth, _plot_staged

    assert _plot_growth(_growth_rows([16 << 20, 64 << 20, 1 << 30]), tmp_path / "g.png", "cpu")
    assert _plot_decode(_decode_rows(), tmp_path / "d.png", "cpu")
    assert _plot_staged(_staged_rows(), tmp_path / "s.png", "cpu")
    return [figure for figure, _ in captured_figures]


def _colour(artist):
    """The hex colour of a patch (a bar) or of a collection's first point."""
    from matplotlib.colors import to_hex

    colour = artist.get_facecolor()
    return to_hex(colour if artist in getattr(artist.axes, "patches", ()) else colour[0])


def test_jaxbuf_is_drawn_on_top_and_apart_in_every_plot(captured_figures, tmp_path):
    from jaxbuf.cli._plots import JAXBUF_COLOUR

    for figure in _every_plot(captured_figures, tmp_path):
        for axis in figure.axes:
            lines = axis.get_lines()
            mine = [line for line in lines if line.get_label().startswith("jaxbuf")]
            others = [line for line in lines if not line.get_label().startswith("jaxbuf")]
            assert mine, axis.get_title()
            theirs = others + [c for c in axis.collections if _colour(c) != JAXBUF_COLOUR]
            top = min(line.get_zorder() for line in mine)
            assert all(artist.get_zorder() < top for artist in theirs), axis.get_title()
            for line in mine:
                assert line.get_color() == JAXBUF_COLOUR
                assert line.get_linewidth() > max(o.get_linewidth() for o in others)
            assert all(o.get_color() != JAXBUF_COLOUR for o in others), axis.get_title()


def test_legends_sit_outside_the_data(captured_figures, tmp_path):
    for figure in _every_plot(captured_figures, tmp_path):
        figure.canvas.draw()
        legends = [axis.get_legend() for axis in figure.axes if axis.get_legend()]
        assert legends
        for legend in legends:
            box = legend.get_window_extent()
            for axis in figure.axes:
                assert not box.overlaps(axis.get_window_extent()), axis.get_title()


def test_sizes_are_labelled_in_binary_units(captured_figures, tmp_path):
    growth, decode, _ = _every_plot(captured_figures, tmp_path)
    for figure in (growth, decode):
        figure.canvas.draw()
    labels = [t.get_text() for t in growth.axes[0].get_xticklabels()]
    assert labels == ["16 MiB", "64 MiB", "1 GiB"]
    memory = decode.axes[0]
    labels = [t.get_text() for t in memory.get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and "4 MiB" in labels
    assert all(re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB|GiB)", label) for label in labels), labels


def test_step_time_is_a_rolling_median_with_the_slowest_steps_marked(captured_figures, tmp_path):
    from jaxbuf.cli._plots import SLOWEST_MARKED, _rolling_median

    assert _rolling_median([1, 9, 1, 1, 9, 9, 9], 3) == [5, 1, 1, 1, 9, 9, 9]
    _, decode, _ = _every_plot(captured_figures, tmp_path)
    time_axis = decode.axes[1]
    (jaxbuf,) = [line for line in time_axis.get_lines() if line.get_label().startswith("jaxbuf")]
    assert max(jaxbuf.get_ydata()) == pytest.approx(1.0)  # ms: the 3 ms steps smoothed away
    marked = [c.get_offsets() for c in time_axis.collections]
    assert len(marked) == 3 and all(len(points) == SLOWEST_MARKED for points in marked)
    slow_steps = {7, 27, 47}  # jaxbuf's 3 ms steps
    assert slow_steps <= {int(x) for x, _ in marked[0]}


def test_a_plot_of_one_size_draws_bars(captured_figures, tmp_path):
    from jaxbuf.cli._plots import JAXBUF_COLOUR, JAXBUF_ZORDER, _plot_growth, _plot_staged

    assert _plot_growth(_growth_rows([8 << 20]), tmp_path / "g.png", "cpu")
    (one,) = captured_figures[0][0].axes
    assert len(one.patches) == 3 and not one.lines  # jaxbuf, the floor and torch, as bars
    assert "onto 8 MiB" in one.get_title()
    (bar,) = [p for p in one.patches if _colour(p) == JAXBUF_COLOUR]
    assert bar.get_zorder() == JAXBUF_ZORDER
    assert _plot_staged(_staged_rows(sizes=(256,)), tmp_path / "s.png", "cuda:0")
    assert all(len(line.get_xdata()) == 1 for line in captured_figures[1][0].axes[0].lines)


def test_interpreter_figures_are_not_plotted(captured_figures, tmp_path, capsys):
    from jaxbuf.cli._plots import PLOT_DEFAULT, _plot_staged, write_plots

    interpreted = _staged_rows(sizes=(256,), interpreter=True)
    assert not _plot_staged(interpreted, tmp_path / "s.png", "cpu")
    written = write_plots(
        interpreted + _growth_rows([8 << 20, 32 << 20]), PLOT_DEFAULT, "cpu", "cpu"
    )
    assert written == [Path("results/growth-cpu.png")] and len(captured_figures) == 1
    assert "staged.patterns not plotted" in capsys.readouterr().err


def test_the_decode_plot_draws_and_explains_the_granule_floor(captured_figures, tmp_path):
    from jaxbuf.cli._plots import _plot_decode

    # jaxbuf's cache sits on the granule: the floor is drawn and the note says why.
    assert _plot_decode(_decode_rows(held=[2 << 20] * 64), tmp_path / "d.png", "cpu")
    figure, note = captured_figures[0]
    memory = figure.axes[0]
    floors = [line for line in memory.lines if line.get_label().startswith("granule")]
    assert len(floors) == 1 and floors[0].get_ydata()[0] == 2 << 20
    assert "2 MiB" in floors[0].get_label()
    assert "commits whole granules" in note and "at least one granule" in note
    # Above the granule it is no floor of jaxbuf's: neither drawn nor explained.
    assert _plot_decode(_decode_rows(granule=512 << 10), tmp_path / "d.png", "cpu")
    figure, note = captured_figures[1]
    assert not [line for line in figure.axes[0].lines if line.get_label().startswith("granule")]
    assert "granule" not in note


def test_the_decode_plot_names_each_profile_s_framework(captured_figures, tmp_path):
    """jax.decode and torch.decode rows side by side: each column's title and baselines say
    which framework ran (rows without ``framework`` are JAX's)."""
    from jaxbuf.cli._plots import _plot_decode

    torch_rows = _decode_rows()
    torch_rows[0]["rows"][0]["params"]["framework"] = "torch"
    torch_rows[0]["name"] = "torch.decode"
    assert _plot_decode(_decode_rows() + torch_rows, tmp_path / "d.png", "cpu")
    figure, _ = captured_figures[0]
    # One row per profile and framework (memory, then step time), JAX's row first.
    memory_jax, memory_torch = figure.axes[0], figure.axes[2]
    assert memory_jax.get_title().startswith("JAX, ")
    assert memory_torch.get_title().startswith("torch, ")
    labels = {line.get_label() for line in memory_torch.lines}
    assert {"jaxbuf KV cache", "torch, preallocated", "torch, realloc+copy"} <= labels
    assert "JAX, preallocated" in {line.get_label() for line in memory_jax.lines}


def test_the_readme_names_every_file_the_bench_command_writes():
    from jaxbuf.cli._plots import _PLOTTERS

    readme = " ".join((REPO / "README.md").read_text().split())
    assert "results/bench-<device>.json" in readme
    for kind in _PLOTTERS:
        assert f"results/{kind}-<device>.png" in readme, kind
