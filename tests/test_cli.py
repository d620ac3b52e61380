"""The ``python -m jaxbuf`` command: info, bench, demo, and its errors (run as subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxbuf.__main__ import main
from jaxbuf.bench import Row, format_bytes, format_seconds, select_suites, suite
from jaxbuf.drivers import cuda_unavailable_reason

REPO = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
needs_frameworks = pytest.mark.skipif(
    not (HAS_TORCH and HAS_JAX), reason="the demo and the baselines need torch and JAX"
)


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None):
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jaxbuf", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment,
    )  # fmt: skip


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
    json_path = tmp_path / "out" / "bench.json"
    plot_path = tmp_path / "growth.png"
    result = run_cli("bench", "--device", "cpu", "--quick", "--json", str(json_path),
                     "--plot", str(plot_path), timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(json_path.read_text())
    assert document["device"] == "cpu" and document["quick"] is True
    assert {"date", "machine", "versions", "suites"} <= document.keys()
    assert document["machine"]["node"]
    assert document["versions"]["numpy"] != "not installed"
    names = {s["name"] for s in document["suites"]}
    assert {"extensible.growth", "extensible.bookkeeping", "extensible.views",
            "extensible.release"} <= names  # fmt: skip
    for suite_result in document["suites"]:
        assert suite_result["error"] is None, suite_result
        assert suite_result["rows"], suite_result["name"]
        for row in suite_result["rows"]:
            assert row["median_s"] > 0
            if row["baseline_median_s"] is not None:
                assert row["ratio"] == pytest.approx(row["baseline_median_s"] / row["median_s"])
    # Every suite prints a table with its name.
    for name in names:
        assert name in result.stdout
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_only_selects_by_prefix(tmp_path):
    json_path = tmp_path / "views.json"
    result = run_cli("bench", "--device", "cpu", "--quick", "--only", "extensible.views",
                     "--json", str(json_path))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(json_path.read_text())
    assert [s["name"] for s in document["suites"]] == ["extensible.views"]


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
    assert Row("a", 2e-3, "b", 4e-3).ratio == pytest.approx(2.0)
    assert Row("a", 2e-3, "b", None).ratio is None
    assert Row("a", 2e-3).to_json()["ratio"] is None
    assert format_bytes(2 << 20) == "2 MiB" and format_bytes(48 << 30) == "48 GiB"
    assert format_bytes(3 << 19) == "1.5 MiB"
    assert format_seconds(1.5e-6) == "1.5 µs" and format_seconds(None) == "—"
