"""The README's examples run as written (they use CUDA, so they run on the GPU machine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index):
    result = subprocess.run([sys.executable, "-c", EXAMPLES[index]], capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
