"""A regular (non-editable) install carries everything: every package under ``jaxbuf/``, the
kernels subpackage (installed from the top-level ``kernels/`` folder), the benchmarks and the
command line, ``py.typed`` and the compiled extensions; the version has one source."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def _source_version() -> str:
    """``__version__`` as written in jaxbuf/__init__.py (the one source), without importing."""
    tree = ast.parse((ROOT / "jaxbuf" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("jaxbuf/__init__.py assigns no literal __version__")


def _packages_in_tree() -> set[str]:
    """Every package of the source tree, as installed: jaxbuf.* plus jaxbuf.kernels."""
    packages = {"jaxbuf.kernels"}
    for init in (ROOT / "jaxbuf").rglob("__init__.py"):
        if "__pycache__" not in init.parts:
            packages.add(".".join(init.parent.relative_to(ROOT).parts))
    return packages


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    wheel_dir = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps"]
    command += ["--no-build-isolation", "-q", "-w", str(wheel_dir)]
    build = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if build.returncode:
        pytest.skip(f"cannot build a wheel here: {build.stderr[-500:]}")
    (built,) = wheel_dir.glob("jaxbuf-*.whl")
    return built


def test_wheel_installs_kernels_bench_and_extensions(wheel, tmp_path):
    target = tmp_path / "site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    command += ["--target", str(target), str(wheel)]
    install = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    check = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import importlib.metadata
        import jaxbuf, jaxbuf.kernels, jaxbuf.bench, jaxbuf.cli, jaxbuf._capsule
        assert jaxbuf.__file__.startswith({str(target)!r}), jaxbuf.__file__
        assert jaxbuf.kernels.__file__.startswith({str(target)!r}), jaxbuf.kernels.__file__
        from jaxbuf.kernels import has_overlap, row_segments
        assert importlib.metadata.version("jaxbuf") == jaxbuf.__version__
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_wheel_holds_every_package_and_py_typed(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    installed = {
        name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")
    }
    missing = _packages_in_tree() - installed
    assert not missing, f"packages not in the wheel (add them to pyproject.toml): {missing}"
    assert "jaxbuf/py.typed" in names
    assert any(name.startswith("jaxbuf/_capsule") and name.endswith(".so") for name in names)


def test_the_version_has_one_source(wheel):
    # pyproject reads it from jaxbuf/__init__.py; the wheel's metadata says the same.
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    metadata = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert f"\nVersion: {_source_version()}\n" in text
    assert wheel.name.startswith(f"jaxbuf-{_source_version()}-")


def test_extras_install_what_the_checks_and_notebooks_need():
    extras = _pyproject()["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {
            spec.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower()
            for spec in extras[extra]
        }

    assert "ruff" in names("test")  # .ci/run runs ruff format --check and ruff check
    # `jupyter nbconvert --to notebook --execute` needs the command, nbconvert, a kernel, and
    # what the notebooks import.
    assert {"jupyter-core", "nbconvert", "nbclient", "ipykernel", "matplotlib"} <= names(
        "notebooks"
    )
    assert any(
        spec.startswith("jaxbuf[") and "torch" in spec and "jax" in spec
        for spec in extras["notebooks"]
    )
    assert {"torch", "jax", "triton", "test", "notebooks", "cli"} <= {
        spec for spec in extras["all"][0].split("[")[1].rstrip("]").split(",")
    }


def test_ruff_is_configured():
    config = _pyproject()["tool"]["ruff"]
    assert config["line-length"] == 100 and config["target-version"] == "py310"
    assert {"E", "F", "W", "I", "UP", "B", "SIM"} <= set(config["lint"]["select"])
