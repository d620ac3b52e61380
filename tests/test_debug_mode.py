"""Debug mode on the CPU driver (``JAXBUF_DEBUG=1``, or ``HostVmmDriver(debug=True)``).

Without it a read of uncommitted or released memory returns zeros on the CPU (the reservation
is readable), where CUDA faults. With it such a read faults as on CUDA: ``SIGSEGV``, after the
hint's line naming jaxbuf, debug mode and the cause. Committed memory behaves identically in
both modes. Every case that can fault runs in a child process and checks both modes: zeros
and a normal exit without debug, the fault with it."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import platform
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxbuf._debug import DEBUG_ENV, debug_enabled
from jaxbuf.drivers import HostVmmDriver

HAS_HINT = importlib.util.find_spec("jaxbuf.drivers._host_calls") is not None
# The hint tells a read from a write where the signal context says (x86-64 Linux).
A_READ_OF = "a read of " if platform.machine() == "x86_64" else "a read or write of "
PAGE = mmap.PAGESIZE
MiB = 1 << 20


# -- the switch ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "on"),
    [
        (None, False),
        ("", False),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
        (" 0 ", False),
        ("1", True),
        ("true", True),
        ("yes", True),
        ("on", True),
        ("2", True),
    ],
)
def test_the_environment_switches_it(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(DEBUG_ENV, value)
    assert debug_enabled() is on
    driver = HostVmmDriver()
    assert driver.debug is on
    assert repr(driver) == ("HostVmmDriver(debug=True)" if on else "HostVmmDriver()")


@pytest.mark.parametrize("environment", ["0", "1"])
@pytest.mark.parametrize("override", [False, True])
def test_an_argument_overrides_the_environment(monkeypatch, environment, override):
    monkeypatch.setenv(DEBUG_ENV, environment)
    assert debug_enabled(override) is override
    assert HostVmmDriver(debug=override).debug is override


@pytest.mark.parametrize("bad", [1, 0, "1", "true", 1.0, np.bool_(True), [True]])
def test_a_bad_override_raises_type_error_naming_it(bad):
    with pytest.raises(TypeError, match="debug must be True, False or None") as info:
        debug_enabled(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match="debug must be"):
        HostVmmDriver(debug=bad)


def _protections(ptr: int, size: int) -> set[str]:
    """The permission strings of /proc/self/maps over [ptr, ptr + size)."""
    found, covered = set(), 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, mode = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            overlap = min(high, ptr + size) - max(low, ptr)
            if overlap > 0:
                found.add(mode)
                covered += overlap
    assert covered == size
    return found


@pytest.mark.parametrize("built_with", ["0", "1"])
def test_a_driver_decides_once_when_built(monkeypatch, built_with):
    """Changing the environment later changes nothing: every range a driver reserves, unmaps
    or moves a mapping away from gets the protection it was built with."""
    monkeypatch.setenv(DEBUG_ENV, built_with)
    driver = HostVmmDriver()
    monkeypatch.setenv(DEBUG_ENV, "0" if built_with == "1" else "1")
    uncommitted = {"---p"} if built_with == "1" else {"r--p"}
    base = driver.reserve(4 * PAGE)
    try:
        assert _protections(base, 4 * PAGE) == uncommitted
        chunk = driver.create(PAGE, 0)
        driver.map(base, PAGE, chunk)
        assert _protections(base, PAGE) == {"rw-s"}
        ctypes.memset(base, 7, PAGE)
        driver.move_mapping(chunk, base, base + 2 * PAGE, PAGE)
        assert _protections(base, PAGE) == uncommitted  # the source, re-reserved
        assert ctypes.string_at(base + 2 * PAGE, 4) == b"\x07" * 4
        driver.unmap(base + 2 * PAGE, PAGE)
        driver.release(chunk)
        assert _protections(base, 4 * PAGE) == uncommitted
    finally:
        driver.free_reserved(base, 4 * PAGE)


# -- reads that fault in debug mode --------------------------------------------------------
SETUP = """
import ctypes, sys
import numpy as np
import jaxbuf
from jaxbuf import ExtensibleTensor, ExtensibleKVCacheBuilder
from jaxbuf.drivers import get_vmm_driver
MiB = 1 << 20
print("debug", get_vmm_driver("cpu").debug, flush=True)
"""

# Each case reads memory that is not committed; it prints "read <value>" when the read returns.
UNCOMMITTED, RELEASED = "uncommitted memory", "uncommitted or released memory"
CASES = {
    "full_view to_numpy past the committed granule": (
        """
        buf = ExtensibleTensor(8 * MiB, device="cpu", num_segments=2)
        buf.resize_per_segment_(4096, zero_new=True)
        full = buf.full_view().to_numpy()
        full[:4096] = 1  # committed: fine in both modes
        print("read", int(full[3 * MiB]), flush=True)  # segment 0, an uncommitted granule
        """,
        UNCOMMITTED,
    ),
    "np.from_dlpack of a never-grown full_view": (
        """
        buf = ExtensibleTensor(4 * MiB, device="cpu")
        print("read", int(np.from_dlpack(buf.full_view()).sum()), flush=True)
        """,
        UNCOMMITTED,
    ),
    "printing a full_view": (
        """
        buf = ExtensibleTensor(4 * MiB, device="cpu")
        buf.resize_per_segment_(MiB)
        text = repr(buf.full_view().to_numpy())  # numpy prints the last elements too
        assert text == repr(np.zeros(4 * MiB, np.uint8)), text
        print("read 0", flush=True)
        """,
        UNCOMMITTED,
    ),
    "a view kept over release_physical": (
        """
        buf = ExtensibleTensor(4 * MiB, device="cpu")
        buf.resize_per_segment_(MiB, zero_new=True)
        array = buf.segment_view(0).to_numpy()
        array[:] = 9
        buf.release_physical()
        print("read", int(array.max()), flush=True)  # zeros, never the stale 9
        """,
        RELEASED,
    ),
    "a KV layer view over the capacity, uncommitted blocks": (
        """
        builder = ExtensibleKVCacheBuilder(4, "cpu")
        builder.reserve(4 * 2 * MiB * 2, 2)  # 4 blocks of 2 MiB per layer, 2 layers
        kv = builder.finish()
        kv.commit(1)
        layer = kv.layer_views("float32")[1].to_numpy()
        layer[0] = 1.0  # block 0 is committed
        print("read", int(layer[3].sum()), flush=True)
        """,
        UNCOMMITTED,
    ),
    "a KV view kept over release_physical": (
        """
        builder = ExtensibleKVCacheBuilder(4, "cpu")
        builder.reserve(4 * 2 * MiB * 2, 2)
        kv = builder.finish()
        kv.commit(2)
        layer = kv.layer_views("float32")[0].to_numpy()
        layer[:2] = 5.0
        kv.release_physical()
        print("read", int(layer[0].sum()), flush=True)
        """,
        RELEASED,
    ),
    "a KV shrink: released, then fewer blocks committed": (
        """
        builder = ExtensibleKVCacheBuilder(4, "cpu")
        builder.reserve(4 * 2 * MiB * 2, 2)
        kv = builder.finish()
        kv.commit(4)
        layer = kv.layer_views("float32")[0].to_numpy()
        layer[:] = 5.0
        kv.release_physical()
        kv.commit(1)
        assert layer[0].sum() == 0  # recommitted, zeroed: fine in both modes
        print("read", int(layer[3].sum()), flush=True)  # released and not recommitted
        """,
        RELEASED,
    ),
}


def run_case(code: str, debug: str | None) -> subprocess.CompletedProcess:
    """``SETUP`` + ``code`` in a fresh interpreter, ``JAXBUF_DEBUG`` set to ``debug`` (None:
    unset) and faulthandler off, so that the hint's line is the only report."""
    environment = {
        k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "PYTHONFAULTHANDLER")
    }
    if debug is not None:
        environment[DEBUG_ENV] = debug
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )


def hint_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxbuf: segmentation")]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("debug", [None, "0", "false"], ids=["unset", "0", "false"])
def test_without_debug_the_read_returns_zeros(case, debug):
    result = run_case(CASES[case][0], debug)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "debug False" in result.stdout
    assert "read 0" in result.stdout, result.stdout
    assert hint_lines(result.stderr) == []


@pytest.mark.parametrize("case", CASES)
def test_in_debug_mode_the_read_faults_with_the_hint(case):
    code, cause = CASES[case]
    result = run_case(code, "1")
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-3000:])
    assert "debug True" in result.stdout
    assert "read" not in result.stdout.replace("debug", ""), result.stdout
    if not HAS_HINT:
        return
    (line,) = hint_lines(result.stderr)
    assert "(CPU driver, debug mode): " + A_READ_OF + cause in line, line
    address = int(line.split(" at ", 1)[1].split(",", 1)[0], 16)
    start, end = (int(x, 16) for x in line.split("reservation ", 1)[1].split(" ", 1)[0].split("-"))
    assert start <= address < end


# -- what jaxbuf reads itself: committed bytes only ----------------------------------------
COPIES = """
from jaxbuf.sharing import ImportedBuffer, export_layout
buf = ExtensibleTensor(8 * MiB, device="cpu", num_segments=2)
never_grown = np.from_dlpack(buf.full_view(), copy=True)
assert never_grown.shape == (8 * MiB,) and not never_grown.any()
buf.resize_segments_([4096, MiB], zero_new=True)
buf.resize_segments_([4096, 3 * MiB])  # segment 1 is two chunks now
buf.segment_view(0).to_numpy()[:] = 3
buf.segment_view(1).to_numpy()[:] = 7
copied = np.from_dlpack(buf.full_view(), copy=True)
assert copied.sum() == 3 * 4096 + 7 * 3 * MiB, copied.sum()
layout, fds = export_layout(buf)
imported = ImportedBuffer(layout, list(fds))
assert (np.from_dlpack(imported.full_view(), copy=True) == copied).all()
imported.close()
assert buf.defragment() == [1]
assert (np.from_dlpack(buf.full_view(), copy=True) == copied).all()
buf.release_physical()
assert not np.from_dlpack(buf.full_view(), copy=True).any()
buf.free()
print("read 0", flush=True)
"""


@pytest.mark.parametrize("debug", ["0", "1"], ids=["normal", "debug"])
def test_copies_exports_and_defragment_read_committed_bytes_only(debug):
    """A copy of a full view (also of an import of it), ``defragment`` and a release touch
    only committed bytes: the same result in debug mode, where anything else would fault."""
    result = run_case(COPIES, debug)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "read 0" in result.stdout


# -- committed memory: the same in both modes ----------------------------------------------
MODEL = """
import hashlib
seed, steps = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(seed)
capacities = [4 * MiB, 6 * MiB, 2 * MiB]  # granule-aligned segments: defragment can succeed
buf = ExtensibleTensor(sum(capacities), device="cpu", segment_capacities=capacities)
model = [np.zeros(0, np.uint8) for _ in capacities]
digest = hashlib.sha256()

def check():
    for s, expected in enumerate(model):
        got = buf.segment_view(s).to_numpy()[: expected.size]
        assert got.size == expected.size and (got == expected).all(), s
        digest.update(got.tobytes())
    image = np.from_dlpack(buf.full_view(), copy=True)
    for s, expected in enumerate(model):
        start = buf.segment_offsets[s]
        part = image[start : start + capacities[s]]
        assert (part[: expected.size] == expected).all() and not part[expected.size :].any(), s

for step in range(steps):
    op = rng.choice(["grow", "write", "release", "shrink", "defragment"], p=[.35, .4, .08, .1, .07])
    if op == "grow":
        sizes = [min(c, m.size + int(rng.integers(c // 3))) for m, c in zip(model, capacities)]
        buf.resize_segments_(sizes, zero_new=bool(rng.integers(2)))
        model = [np.concatenate([m, np.zeros(n - m.size, np.uint8)]) for m, n in zip(model, sizes)]
    elif op == "write":
        s = int(rng.integers(len(model)))
        if model[s].size:
            a = int(rng.integers(model[s].size))
            b = int(rng.integers(a, model[s].size + 1))
            data = rng.integers(0, 256, b - a, dtype=np.uint8)
            buf.segment_view(s).to_numpy()[a:b] = data
            model[s][a:b] = data
    elif op in ("release", "shrink"):
        kept = [m[: int(rng.integers(m.size + 1))].copy() for m in model]
        buf.release_physical()
        model = [np.zeros(0, np.uint8) for _ in capacities]
        if op == "shrink":  # fewer bytes committed again, the kept prefix written back
            buf.resize_segments_([k.size for k in kept], zero_new=bool(rng.integers(2)))
            for s, k in enumerate(kept):
                if k.size:
                    buf.segment_view(s).to_numpy()[:] = k
            model = kept
    else:
        try:
            buf.defragment()
        except ValueError:  # two committed segments share a granule: refused, unchanged
            pass
    check()
buf.free()
print("read 0", digest.hexdigest(), flush=True)
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_committed_reads_and_writes_are_the_same_in_both_modes(seed):
    """Random grows, writes, releases, shrinks (release, then a smaller commit) and
    defragments against a numpy model: every committed byte and every copy of the full view
    as the model says, in both modes, with the same digest of everything read."""
    digests = {}
    for debug in ("0", "1"):
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SETUP) + MODEL, str(seed), "60"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, DEBUG_ENV: debug},
        )
        assert result.returncode == 0, (debug, result.returncode, result.stderr[-3000:])
        assert f"debug {debug == '1'}" in result.stdout
        digests[debug] = result.stdout.split("read 0 ", 1)[1].strip()
    assert digests["0"] == digests["1"]
