"""The examples of the README and of docs/JAX_SEMANTICS.md run as written, each where its
first line says (the CPU ones here, the CUDA ones on the GPU machine), and the README's
commands are the ones CI runs."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import _forkserver
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = (README, ROOT / "docs" / "JAX_SEMANTICS.md")
EXAMPLES = [
    example
    for document in DOCUMENTS
    for example in re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.S)
]
GPU_LINE = "# Needs a CUDA GPU"
CPU_LINE = "# Runs on the CPU"
GPU_EXAMPLES = [e for e in EXAMPLES if e.startswith(GPU_LINE)]
CPU_EXAMPLES = [e for e in EXAMPLES if e.startswith(CPU_LINE)]
FRAMEWORKS_MISSING = [m for m in ("torch", "jax") if importlib.util.find_spec(m) is None]


def _run(example: str):
    return _forkserver.run([sys.executable, "-c", example], timeout=300, cwd=ROOT)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


def test_every_example_says_whether_it_needs_a_gpu():
    for example in EXAMPLES:
        assert example.startswith((GPU_LINE, CPU_LINE)), example.splitlines()[0]
    assert CPU_EXAMPLES, "give a CPU variant where one exists"
    for example in CPU_EXAMPLES:
        assert '"cuda' not in example, "a CPU example must not ask for CUDA"


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GPU_EXAMPLES)))
def test_readme_example_runs(index):
    result = _run(GPU_EXAMPLES[index])
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(bool(FRAMEWORKS_MISSING), reason=f"needs {FRAMEWORKS_MISSING}")
@pytest.mark.parametrize("index", range(len(CPU_EXAMPLES)))
def test_readme_cpu_example_runs(index):
    result = _run(CPU_EXAMPLES[index])
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.split()
    assert printed and all(word == "True" for word in printed), result.stdout


def test_readme_runs_what_ci_runs():
    # Every command of .ci/run (the install, ruff format --check, ruff check, pytest) appears
    # verbatim in the README's shell block, so the README's test command is CI's.
    shell = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S))
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip().startswith("python3 ")
    ]
    assert any("ruff format --check" in c for c in commands)
    assert any("ruff check" in c for c in commands)
    assert commands[-1].startswith("python3 -m pytest")
    for command in commands:
        assert command in shell, f"README does not show {command!r} (run by .ci/run)"
