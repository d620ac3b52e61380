"""The README's test command (``-n auto --dist loadgroup``) runs each ONE_WORKER module of
conftest.py on one worker, with the pytest and pytest-xdist installed here: a pytest run on
two workers over a stand-in module, with this directory's conftest.py, must not split it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ONE_WORKER

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

pytest.importorskip("xdist", reason="pytest-xdist is not installed (the `test` extra has it)")

# Each test appends the xdist worker that ran it to a file named after the module.
_RECORDING_MODULE = """
import os
from pathlib import Path

import pytest


@pytest.mark.parametrize("i", range(8))
def test_records_its_worker(i):
    with open(Path(__file__).with_suffix(".workers"), "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def _run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess:
    # An empty pytest.ini makes `directory` the rootdir: the project's pyproject.toml (its
    # addopts, testpaths) stays out of the run.
    (directory / "pytest.ini").write_text("[pytest]\n")
    shutil.copy(TESTS / "conftest.py", directory / "conftest.py")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    path = [str(ROOT), str(directory), *filter(None, [os.environ.get("PYTHONPATH")])]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    environment.pop("PYTEST_XDIST_WORKER", None)
    environment.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        command, cwd=directory, env=environment, capture_output=True, text=True, timeout=300
    )


def test_a_one_worker_module_runs_on_one_worker_of_two(tmp_path):
    grouped = next(iter(ONE_WORKER))
    (tmp_path / grouped).write_text(_RECORDING_MODULE)
    # Ungrouped tests beside it, sorted before it, so both workers have work from the start.
    (tmp_path / "test_aaa_ungrouped.py").write_text(_RECORDING_MODULE)
    result = _run_pytest(tmp_path, "-n", "2", "--dist", "loadgroup")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = (tmp_path / grouped).with_suffix(".workers").read_text().split()
    assert len(workers) == 8
    assert len(set(workers)) == 1, f"{grouped} ran on several workers: {workers}"
    ungrouped = (tmp_path / "test_aaa_ungrouped.workers").read_text().split()
    assert len(ungrouped) == 8  # ran too: the group took one worker, not the run


def test_an_xdist_group_mark_is_refused_not_silently_ignored(tmp_path):
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.xdist_group('g')\n\n\ndef test_x():\n    pass\n"
    )
    result = _run_pytest(tmp_path)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "ONE_WORKER" in result.stderr


def test_every_one_worker_module_exists():
    missing = [name for name in ONE_WORKER if not (TESTS / name).is_file()]
    assert not missing, f"ONE_WORKER names modules that are not in tests/: {missing}"


@pytest.mark.parametrize("document", ["README.md", ".ci/run"])
def test_the_test_commands_distribute_with_loadgroup(document):
    """Every `pytest ... -n` command of the README and CI groups (``--dist loadgroup``):
    under xdist's default ``--dist load`` the ONE_WORKER modules would spread."""
    lines = (ROOT / document).read_text().splitlines()
    commands = [line for line in lines if "-m pytest" in line and " -n " in line]
    assert commands, f"{document} has no `python3 -m pytest -n ...` command"
    for line in commands:
        assert "--dist loadgroup" in line, line
