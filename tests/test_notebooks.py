"""The notebooks run top to bottom, and each ``.ipynb`` matches its jupytext ``.py`` source.

The kernel is the ``python3`` kernel of this interpreter (jupyter_client falls back to
ipykernel's native kernel when no kernelspec is installed). It inherits this process's
environment, so ``TRITON_INTERPRET=1`` (set by conftest.py without a GPU) and
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` reach it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SOURCES = sorted(NOTEBOOK_DIR.glob("*.py"))

# Per cell: the GPU demos sleep on purpose; a hung cell must not hang CI.
CELL_TIMEOUT_S = 120
# Per notebook on the CPU (they take a few seconds; a slow CI machine gets slack).
NOTEBOOK_BUDGET_S = 60


def _missing(*modules: str) -> str | None:
    absent = [name for name in modules if importlib.util.find_spec(name) is None]
    return f"{', '.join(absent)} not installed (pip install jaxbuf[notebooks])" if absent else None


EXECUTE_REASON = _missing("nbclient", "nbformat", "ipykernel", "torch", "jax")
SYNC_REASON = _missing("jupytext")


def _ids(paths: list[Path]) -> list[str]:
    return [path.stem for path in paths]


def test_notebooks_present():
    assert NOTEBOOKS, f"no notebooks under {NOTEBOOK_DIR}"
    assert _ids(NOTEBOOKS) == _ids(SOURCES), "every notebook needs a paired .py source"


@pytest.mark.skipif(SYNC_REASON is not None, reason=str(SYNC_REASON))
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_matches_source(notebook: Path):
    import jupytext

    def cells(path: Path) -> list[tuple[str, str]]:
        return [(cell.cell_type, cell.source.strip()) for cell in jupytext.read(path).cells]

    source = notebook.with_suffix(".py")
    assert cells(notebook) == cells(source), (
        f"{notebook.name} and {source.name} differ: run "
        f"`jupytext --sync {source.relative_to(NOTEBOOK_DIR.parent)}`"
    )
    for cell in jupytext.read(notebook).cells:
        if cell.cell_type == "code":
            assert not cell.outputs, f"{notebook.name}: outputs are committed stripped"


@pytest.mark.skipif(EXECUTE_REASON is not None, reason=str(EXECUTE_REASON))
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_executes(notebook: Path, tmp_path: Path):
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    # Unix sockets under this test's own directory: over TCP, kernels started at once by
    # parallel workers picked the same free port ("Address already in use": the kernel died).
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel"))
    client = NotebookClient(
        nb,
        km=kernel,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    start = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError naming the failing cell
    elapsed = time.perf_counter() - start
    outputs = [cell for cell in nb.cells if cell.cell_type == "code" and cell.outputs]
    assert outputs, f"{notebook.name} produced no output"
    from jaxbuf.drivers import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        assert elapsed < NOTEBOOK_BUDGET_S, f"{notebook.name} took {elapsed:.1f} s on the CPU"
