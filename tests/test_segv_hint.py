"""A process that dies touching a CPU-driver reservation where nothing is committed, or after
its ``free()``, first prints one line naming jaxbuf, the reservation and the likely cause,
then dies of ``SIGSEGV`` as before: the signal is handed on (to faulthandler where it is
enabled, else to the default), never swallowed. Each case runs in a child process, with debug
mode off and on (``JAXBUF_DEBUG``: the line then says so; reads that fault only in debug mode
are in ``tests/test_debug_mode.py``)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import textwrap

import pytest

_host_calls = pytest.importorskip(
    "jaxbuf.drivers._host_calls", reason="the optional CPU-driver extension is not built"
)

SETUP = """
import ctypes, faulthandler, sys
import numpy as np
from jaxbuf import ExtensibleTensor
buf = ExtensibleTensor(4 << 20, device="cpu")
buf.resize_per_segment_(1 << 20)
"""

# The hint tells a write from a read in debug mode where the signal context says (x86-64).
A_WRITE_TO = "a write to " if platform.machine() == "x86_64" else "a read or write of "
# case: (code, the cause the line names without debug mode, with it)
CASES = {
    "release_physical": (
        "view = np.from_dlpack(buf.segment_view(0))\nbuf.release_physical()\nview[:] = 1",
        "(CPU driver), not committed there: likely a write through a view after release_physical()",
        f"(CPU driver, debug mode): {A_WRITE_TO}uncommitted or released memory (likely "
        "through a view after release_physical()",
    ),
    "past the committed bytes": (
        "full = np.from_dlpack(buf.full_view())\nfull[-1] = 1",
        "(CPU driver), not committed there: likely a write past the committed bytes",
        f"(CPU driver, debug mode): {A_WRITE_TO}uncommitted memory (likely past the "
        "committed bytes)",
    ),
    "free": (
        "ptr = buf.segment_view(0).ptr\nbuf.free()\nctypes.memset(ptr, 1, 16)",
        "(CPU driver), freed: likely a view or raw pointer used after free()",
        "(CPU driver), freed: likely a view or raw pointer used after free()",
    ),
}


def _run(code: str, *options: str, debug: bool = False) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "JAXBUF_DEBUG")
    }
    environment["JAXBUF_DEBUG"] = "1" if debug else "0"
    return subprocess.run(
        [sys.executable, *options, "-c", textwrap.dedent(SETUP) + code],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )


def _jaxbuf_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxbuf: segmentation")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("faulthandler", ["off", "on at start", "on after the buffer"])
@pytest.mark.parametrize("debug", [False, True], ids=["normal", "debug"])
def test_a_fault_in_a_reservation_names_jaxbuf_and_is_handed_on(case, faulthandler, debug):
    code, normal_cause, debug_cause = CASES[case]
    cause = debug_cause if debug else normal_cause
    options = ("-X", "faulthandler") if faulthandler == "on at start" else ()
    if faulthandler == "on after the buffer":
        code = "faulthandler.enable()\n" + code
    result = _run(code, *options, debug=debug)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)
    if faulthandler == "on after the buffer" and case == "past the committed bytes":
        # No change to the reservation since faulthandler took the signal: its handler runs
        # alone (the documented gap), and the process still dies of SIGSEGV with its report.
        assert _jaxbuf_lines(result.stderr) == []
        assert "Fatal Python error: Segmentation fault" in result.stderr
        return
    (line,) = _jaxbuf_lines(result.stderr)
    address = int(line.split(" at ", 1)[1].split(",", 1)[0], 16)
    start, end = (int(x, 16) for x in line.split("reservation ", 1)[1].split(" ", 1)[0].split("-"))
    assert start <= address < end
    assert cause in line, line
    if faulthandler != "off":  # handed on: faulthandler's traceback follows, or precedes
        assert "Fatal Python error: Segmentation fault" in result.stderr


def test_a_fault_elsewhere_passes_without_a_word():
    result = _run("ctypes.string_at(1)")
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)
    assert _jaxbuf_lines(result.stderr) == [] and "jaxbuf" not in result.stderr


def test_the_reservation_is_forgotten_once_its_addresses_are_reserved_again():
    # A new reservation over a freed one's addresses replaces its entry: a write past the new
    # one's committed bytes names the new reservation, not the freed one.
    code = (
        "base = buf.full_view().ptr\nbuf.free()\n"
        "from jaxbuf.drivers import get_vmm_driver\n"
        "driver = get_vmm_driver('cpu'); driver.flush_quarantine()\n"
        "again = ExtensibleTensor(4 << 20, device='cpu')\n"
        "ctypes.memset(again.full_view().ptr, 1, 16)"
    )
    result = _run(code)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr)
    (line,) = _jaxbuf_lines(result.stderr)
    assert "freed" not in line and "past the committed bytes" in line


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((1 << 20,), TypeError),
        ((1 << 20, 0), ValueError),
        ((1 << 20, -1), OverflowError),
        ((2**64 - 4096, 8192), ValueError),
        (("0", 4096), TypeError),
    ],
)
def test_the_table_refuses_a_bad_range(args, error):
    with pytest.raises(error):
        _host_calls.watch_reservation(*args)
    with pytest.raises((error, TypeError)):
        _host_calls.mark_reservation(*args, 2)
