"""A regular (non-editable) install carries everything: every package under ``jaxbuf/``, the
kernels subpackage (installed from the top-level ``kernels/`` folder), the benchmarks and the
command line, ``py.typed`` and the compiled extensions; the version has one source. The sdist
carries the license and every file the shipped docs link to; the metadata names the license
and where the project lives."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One worker runs this module under `-n auto --dist loadgroup` (ONE_WORKER in conftest.py).

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


def _skip_unless_the_build_tools_are_here() -> None:
    """Skip, naming it, only when a tool the build needs is not installed. Anything else that
    stops a build is a packaging fault: the test building fails with the build's own error."""
    for module, why in (("setuptools", "the build backend"), ("pip", "builds the wheel")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed ({why}; the `test` extra has it)")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler!r} is not on PATH): the extensions need one")


# What a build must not read from the working tree: another build's output (a wheel built
# at the same time in the shared build/ fails with "File exists"), compiled extensions and
# caches.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".venv", ".hypothesis",
    ".pytest_cache", ".ipynb_checkpoints", "results", ".whl", ".wheels",
)  # fmt: skip


def _private_source_tree(directory: Path) -> Path:
    """A copy of the source tree in ``directory``, so that a build's ``build/`` and
    ``*.egg-info`` are its own: no other build (another worker, a developer's
    ``setup.py build_ext``) writes there at the same time."""
    source = directory / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE, symlinks=True)
    return source


def _build(command: list[str], cwd: Path, what: str) -> None:
    build = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)
    if build.returncode:
        pytest.fail(f"{what} failed (exit {build.returncode}):\n{build.stderr[-3000:]}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    _skip_unless_the_build_tools_are_here()
    work = tmp_path_factory.mktemp("wheel")
    source = _private_source_tree(work)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps"]
    command += ["--no-build-isolation", "-q", "-w", str(work)]
    _build(command, work, "building the wheel")
    (built,) = work.glob("jaxbuf-*.whl")
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


def _extra_names(extras: dict[str, list[str]], extra: str) -> set[str]:
    """The distributions ``extra`` names, with the extras it pulls through ``jaxbuf[...]``
    expanded (``plot`` inside ``notebooks``)."""
    names: set[str] = set()
    for spec in extras[extra]:
        name = re.split(r"[\[<>=~!; ]", spec, maxsplit=1)[0].strip().lower()
        if name == "jaxbuf":
            for inner in spec.split("[", 1)[1].split("]", 1)[0].split(","):
                names |= _extra_names(extras, inner.strip())
        else:
            names.add(name)
    return names


def test_extras_install_what_the_checks_and_notebooks_need():
    extras = _pyproject()["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return _extra_names(extras, extra)

    assert "ruff" in names("test")  # .ci/run runs ruff format --check and ruff check
    assert "pytest-xdist" in names("test")  # the README's test command runs `-n auto`
    # `--plot` needs matplotlib and nothing else: no framework, no Jupyter.
    assert names("plot") == {"matplotlib"}
    # `jupyter nbconvert --to notebook --execute` needs the command, nbconvert, a kernel, and
    # what the notebooks import.
    assert {"jupyter-core", "nbconvert", "nbclient", "ipykernel", "matplotlib"} <= names(
        "notebooks"
    )
    assert any(
        spec.startswith("jaxbuf[") and "torch" in spec and "jax" in spec
        for spec in extras["notebooks"]
    )
    assert {"torch", "jax", "triton", "test", "notebooks", "cli", "tvm"} <= {
        spec for spec in extras["all"][0].split("[")[1].rstrip("]").split(",")
    }


def test_ruff_is_configured():
    config = _pyproject()["tool"]["ruff"]
    assert config["line-length"] == 100 and config["target-version"] == "py310"
    assert {"E", "F", "W", "I", "UP", "B", "SIM"} <= set(config["lint"]["select"])


def test_license_is_apache_2_0_in_full():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    for words in ("Version 2.0, January 2004", "END OF TERMS AND CONDITIONS", "APPENDIX"):
        assert words in text, words


def test_license_is_an_spdx_expression_with_its_file(wheel):
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    requires = _pyproject()["build-system"]["requires"]
    assert "setuptools>=77" in requires  # the first setuptools that reads them (PEP 639)
    names = zipfile.ZipFile(wheel).namelist()
    metadata = next(n for n in names if n.endswith("/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "\nLicense-Expression: Apache-2.0\n" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_metadata_names_the_project_urls():
    urls = _pyproject()["project"]["urls"]
    assert {"Homepage", "Source", "Issues", "Changelog"} <= urls.keys()
    assert all(url.startswith("https://") for url in urls.values()), urls


def _shipped_links() -> set[str]:
    """Every repository file that the shipped documents link to (relative Markdown links),
    as paths from the root."""
    documents = [ROOT / "README.md", ROOT / "notebooks" / "README.md"]
    documents += [p for p in (ROOT / "BENCHMARKS.md", ROOT / "RELIABILITY.md") if p.is_file()]
    documents += sorted((ROOT / "docs").glob("*.md"))
    links = set()
    for document in documents:
        for target in re.findall(r"\]\(([^)#\s]+)", document.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (document.parent / target).resolve()
            if path.exists():
                links.add(path.relative_to(ROOT).as_posix())
    return links


def test_sdist_carries_the_license_docs_notebooks_and_linked_reports(tmp_path):
    _skip_unless_the_build_tools_are_here()
    source = _private_source_tree(tmp_path)
    command = [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)]
    _build(command, source, "building the sdist")
    (sdist,) = tmp_path.glob("jaxbuf-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    linked = _shipped_links()
    assert {"BENCHMARKS.md", "RELIABILITY.md", "docs/ARCHITECTURE.md"} <= linked
    missing = linked - names
    assert not missing, f"linked from the docs but not in the sdist (MANIFEST.in): {missing}"
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "jaxbuf/_capsule.c"} <= names
    # Every C source and header, the optional extensions' included (jaxbuf/drivers/_host_calls.c,
    # jaxbuf/_capsule.h, ...).
    sources = {
        path.relative_to(ROOT).as_posix()
        for pattern in ("*.c", "*.h")
        for path in (ROOT / "jaxbuf").rglob(pattern)
    }
    assert sources <= names, f"C sources not in the sdist: {sources - names}"
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert f"notebooks/{notebook.name}" in names
        assert f"notebooks/{notebook.stem}.py" in names  # its jupytext source
    assert not any(name.endswith(".so") or "__pycache__" in name for name in names)
