"""A regular (non-editable) install carries everything: the kernels subpackage (installed from
the top-level ``kernels/`` folder), the benchmarks and the compiled extensions."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_kernels_bench_and_extensions(tmp_path):
    pytest.importorskip("setuptools")
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(wheel_dir)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if build.returncode:
        pytest.skip(f"cannot build a wheel here: {build.stderr[-500:]}")
    (wheel,) = wheel_dir.glob("jaxbuf-*.whl")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    check = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import jaxbuf, jaxbuf.kernels, jaxbuf.bench, jaxbuf._capsule
        assert jaxbuf.__file__.startswith({str(target)!r}), jaxbuf.__file__
        assert jaxbuf.kernels.__file__.startswith({str(target)!r}), jaxbuf.kernels.__file__
        from jaxbuf.kernels import has_overlap, row_segments
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
