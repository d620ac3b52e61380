"""The transfer benchmark suites (``jaxbuf.bench.transfer``, ``jaxbuf.bench.transfer_kv_cache``),
run quickly on the CPU: the two processes are started and always ended, every row is
well-formed against a baseline measured in the same run, says which transport moved the bytes,
and the floor is there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxbuf.bench import Row, load_suites
from jaxbuf.devices import Device

transfer = pytest.importorskip("jaxbuf.transfer")
try:
    transfer.load_nixl()
except transfer.NixlUnavailable as error:  # pragma: no cover - the CI image installs it
    pytest.skip(f"NIXL is not installed: {error}", allow_module_level=True)

from jaxbuf.bench._transfer_peer import TwoProcesses  # noqa: E402
from jaxbuf.bench._ucx_log import ucx_protocols  # noqa: E402

_SUBJECTS = {
    "floor",
    "same-host transport",
    "NIXL over jaxbuf memory",
    "NIXL over plain memory (prepared lists)",
}


def _peer_processes() -> list[int]:
    """Processes of ``jaxbuf.bench._transfer_peer`` (or of ``_kv_cache_peer``, its cache
    sides) started by this one, still alive."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        peer = b"_transfer_peer" in command or b"_kv_cache_peer" in command
        if parent == os.getpid() and peer:
            found.append(int(entry.name))
    return found


def _run(name: str) -> tuple[list[str], list]:
    sizes: list[str] = []
    rows = list(load_suites()[name].run(Device("cpu"), quick=True, sizes=sizes.append))
    assert _peer_processes() == [], "the suite left its processes running"
    return sizes, rows


@pytest.fixture(scope="module")
def bandwidth_rows():
    return _run("transfer.bandwidth")


def test_bandwidth_rows_are_well_formed(bandwidth_rows):
    sizes, rows = bandwidth_rows
    assert len(sizes) == 1 and "two processes" in sizes[0]
    # 3 sizes x (WRITE, READ) x (floor, same-host twice, NIXL over jaxbuf, NIXL over plain)
    assert len(rows) == 3 * 2 * 5
    cases = {(row.params["operation"], row.params["blocks"]) for row in rows}
    assert {operation for operation, _ in cases} == {"WRITE", "READ"}
    assert sorted({blocks for _, blocks in cases}) == [1, 64, 256]
    for row in rows:
        params = row.params
        assert params["subject"] in _SUBJECTS, row
        assert params["processes"] == 2 and params["prefill_device"] == "cpu", row
        assert params["bytes"] == params["blocks"] * params["block_bytes"], row
        if row.median_s is None:  # only a same-host transport that is not there
            assert params["subject"] == "same-host transport", row
            assert "same-host" in row.notes, row
            continue
        assert row.median_s > 0 and params["gbps"] > 0, row
        # Every row names the transport that moved the bytes.
        assert params["transport"], row
        if params["subject"].startswith("NIXL"):
            assert params["transport"].startswith("NIXL, UCX"), row
        if params["subject"] != "floor":
            assert row.baseline_median_s > 0 and params["baseline_gbps"] > 0, row
            assert row.ratio == pytest.approx(row.median_s / row.baseline_median_s)
            assert params["bandwidth_vs_baseline"] == pytest.approx(1 / row.ratio)
        assert row.at_quick_sizes and row.judged is None, row


def test_bandwidth_has_a_floor_per_case_and_rows_against_it(bandwidth_rows):
    _, rows = bandwidth_rows
    cases = {(row.params["operation"], row.params["blocks"]) for row in rows}
    for operation, blocks in cases:
        case = [
            row
            for row in rows
            if (row.params["operation"], row.params["blocks"]) == (operation, blocks)
        ]
        floors = [row for row in case if row.params["subject"] == "floor"]
        assert len(floors) == 1, case
        floor = floors[0]
        assert floor.baseline_name == "" and floor.median_s > 0
        assert floor.params["gbps"] > 0 and "np.copyto" in floor.params["transport"]
        against_floor = [row for row in case if row.baseline_name.startswith("floor:")]
        assert len(against_floor) == 3
        assert all(row.baseline_median_s == floor.median_s for row in against_floor)
        against_plain = [row for row in case if "NIXL over plain" in row.baseline_name]
        assert [row.params["subject"] for row in against_plain] == ["same-host transport"]
        assert against_plain[0].target.startswith("<= 1x")


def test_bandwidth_targets(bandwidth_rows):
    _, rows = bandwidth_rows
    targeted = [row for row in rows if row.target]
    # >= NIXL over plain memory at every size; >= 0.8x the floor for the one big block (the
    # CPU has no 0.5x target at 1,024 blocks: that one is for CUDA).
    assert len(targeted) == 6 + 2
    for row in targeted:
        assert row.params["subject"] == "same-host transport"
        if row.median_s is not None:
            assert row.met in (True, False)


def test_host_rows_are_well_formed():
    sizes, rows = _run("transfer.host")
    assert len(sizes) == 1 and "two processes" in sizes[0]
    assert [row.params["phase"] for row in rows] == ["post", "post", "post + wait", "post + wait"]
    for row in rows:
        assert row.baseline_median_s > 0 and "NIXL over plain" in row.baseline_name
        assert row.params["baseline_transport"].startswith("NIXL, UCX")
        if row.median_s is None:
            assert row.params["subject"] == "same-host transport" and "same-host" in row.notes
            continue
        assert row.median_s > 0 and row.params["transport"], row
    assert not any(row.target for row in rows)  # the 20 µs post is a GPU target


def test_grow_rows_are_well_formed():
    sizes, rows = _run("transfer.grow")
    assert len(sizes) == 1 and sizes[0]
    assert len(rows) == 4
    for row in rows:
        assert row.median_s > 0 and row.baseline_median_s > 0, row
    judged = [row for row in rows if row.target]
    assert len(judged) == 2
    assert all(row.met in (True, False) for row in judged)


def test_a_side_that_fails_to_start_ends_both_processes():
    with pytest.raises(RuntimeError, match="prefill process"):
        TwoProcesses("cuda:7", "cpu", None)  # no CUDA here: the prefill side cannot start
    assert _peer_processes() == []


_PROTO_INFO = """\
[1.5] [vm:9:0]   +--------+-------------+-----------------------------------+
[1.5] [vm:9:0]   | pre self cfg#0                                           |
[1.5] [vm:9:0]   | remote memory write by ucp_put* from host memory to host |
[1.5] [vm:9:0]   +--------+-------------+-----------------------------------+
[1.5] [vm:9:0]   | Range  | Description |              Config               |
[1.5] [vm:9:0]   | 0..inf | zero-copy   | self/memory                       |
[1.6] [vm:9:0]   | pre intra-node cfg#1                                     |
[1.6] [vm:9:0]   | active message by ucp_am_send* from host memory          |
[1.6] [vm:9:0]   | Range  | Description |              Config               |
[1.6] [vm:9:0]   | 0..inf | zero-copy   | tcp/lo                            |
[1.7] [vm:9:0]   | pre intra-node cfg#1                                     |
[1.7] [vm:9:0]   | remote memory write by ucp_put*(multi) from host memory to host |
[1.7] [vm:9:0]   | Range  | Description |              Config               |
[1.7] [vm:9:0]   | 0..inf | zero-copy   | cma/memory                        |
[1.8] [vm:9:0]   | pre intra-node cfg#1                                     |
[1.8] [vm:9:0]   | remote memory read by ucp_get* into cuda memory from cuda |
[1.8] [vm:9:0]   | Range  | Description |              Config               |
[1.8] [vm:9:0]   |  0..8k | copy-in     | tcp/lo                            |
[1.8] [vm:9:0]   | 8k..inf | zero-copy  | cuda_ipc/cuda                     |
"""


def test_ucx_protocols_reads_the_remote_operations_to_another_process():
    assert ucx_protocols(_PROTO_INFO, "WRITE") == ["cma/memory"]  # not self, not messages
    assert ucx_protocols(_PROTO_INFO, "WRITE", "host") == ["cma/memory"]
    assert ucx_protocols(_PROTO_INFO, "WRITE", "cuda") == []
    assert ucx_protocols(_PROTO_INFO, "READ") == ["cuda_ipc/cuda", "tcp/lo"]
    assert ucx_protocols(_PROTO_INFO, "READ", "host") == []
    assert ucx_protocols("", "READ") == []


def test_rows_without_the_same_host_transport_keep_its_rows_with_the_reason():
    """Where the same-host transport does not work here, its rows stay, with no figure and
    the reason, never judged; the other subjects are reported as usual."""
    from jaxbuf.bench.transfer import _bandwidth_rows

    class Run:
        def params(self):
            return {"processes": 2, "prefill_device": "cpu", "decode_device": "cpu"}

    reason = "the same-host transport is not available: TypeError: transport"
    result = {
        "medians": {"floor": 1e-3, "nixl jaxbuf": 2e-3, "nixl plain": 1.5e-3},
        "transports": {
            "floor": "np.copyto (memcpy), one process",
            "nixl jaxbuf": "NIXL, UCX cma/memory",
            "nixl plain": "NIXL, UCX cma/memory",
        },
        "rounds": 5,
    }
    groups = [(64 << 20, (1,)), (64 << 10, (64, 1024))]
    rows = _bandwidth_rows(
        Device("cpu"), Run(), {"local_error": reason}, result, "WRITE", 1, 64 << 20, groups
    )
    local = [row for row in rows if row.params["subject"] == "same-host transport"]
    assert len(rows) == 5 and len(local) == 2
    for row in local:
        assert row.median_s is None and row.notes == reason and row.judged is None
        assert row.params["gbps"] is None and row.target  # the goal is still stated
    plain = next(row for row in rows if row.params["subject"].startswith("NIXL over plain"))
    assert plain.params["gbps"] == pytest.approx((64 << 20) / 1.5e-3 / 1e9)
    assert plain.ratio == pytest.approx(1.5)


# -- transfer.kv_cache: a cache shaped like a model -------------------------------------------

_KV_BLOCK = 16 * 8 * 128 * 2  # 16 tokens x 8 KV heads x 128 dims, bf16: one block, one segment


@pytest.fixture(scope="module")
def kv_cache_rows():
    return _run("transfer.kv_cache")  # quick: 8 layers, 32 blocks


def _one(rows, name_end, baseline_start=""):
    found = [
        row
        for row in rows
        if row.name.endswith(name_end) and row.baseline_name.startswith(baseline_start)
    ]
    assert len(found) == 1, (name_end, baseline_start, [row.name for row in rows])
    return found[0]


def test_kv_cache_transfer_rows_are_well_formed(kv_cache_rows):
    sizes, rows = kv_cache_rows
    assert len(sizes) == 1 and "two processes" in sizes[0] and "8 layers" in sizes[0]
    assert len(rows) == 10  # with the CPU's reference: one contiguous memcpy
    moved = 8 * 2 * 32 * _KV_BLOCK
    floor = _one(rows, ": floor")
    assert floor.median_s > 0 and floor.baseline_name == ""
    assert "copy_batch" in floor.params["transport"]  # the CPU driver's copy, scattered blocks
    assert floor.params["gbps"] == pytest.approx(moved / floor.median_s / 1e9)
    transfers = [row for row in rows if row.params.get("phase") is None and row is not floor]
    transfers = [row for row in transfers if "process" not in row.params]
    assert [row.params["subject"] for row in transfers] == [
        "same-host transport",
        "same-host transport",
        "same-host transport",
        "NIXL over jaxbuf memory",
        "NIXL over plain per-layer buffers",
    ]
    for row in transfers:
        params = row.params
        assert params["layers"] == 8 and params["blocks"] == 32 and params["bytes"] == moved
        assert params["processes"] == 2 and params["prefill_device"] == "cpu", row
        assert row.median_s > 0 and row.baseline_median_s > 0, row
        assert row.ratio == pytest.approx(row.median_s / row.baseline_median_s)
        assert params["gbps"] == pytest.approx(moved / row.median_s / 1e9)
        if row.baseline_name.startswith("floor, contiguous:"):
            # The CPU's physical floor, one contiguous memcpy: 0.8x its bandwidth is a target.
            assert "np.copyto" in row.baseline_name
            assert row.target.startswith("<= 1.25x") and row.limit == pytest.approx(1.25)
        if row.baseline_name.startswith("floor:"):
            assert row.baseline_median_s == floor.median_s
            # Bytes between two processes do not move many times faster than one process's
            # own copy of them (a faster row moved less than it says); the bound is loose,
            # as a busy 2-core host preempts a quick run's copies for whole time slices.
            assert row.ratio > 0.02, row
        expected = "same-host transport (peer" if "same-host" in row.name else "NIXL, UCX"
        assert params["transport"].startswith(expected), row
        low, high = row.spread  # the paired rounds' ratios
        assert 0 < low <= high, row


def test_kv_cache_post_connect_and_targets_are_stated(kv_cache_rows):
    _, rows = kv_cache_rows
    local = _one(rows, "x 8 layers: same-host transport", "floor:")
    plain = _one(rows, "x 8 layers: NIXL over plain per-layer buffers", "floor:")
    post = _one(rows, "post: same-host transport")
    # Each round's post is part of that round's transfer, so its median is at most the whole.
    assert 0 < post.median_s <= local.median_s
    assert 0 < post.baseline_median_s <= plain.median_s
    connect = _one(rows, "connect 8 layers: same-host transport")
    assert 0 < connect.median_s < 60 and 0 < connect.baseline_median_s < 60
    assert local.target.startswith("<= 1.25x") and local.limit == pytest.approx(1.25)
    against_plain = _one(rows, "layers: same-host transport", "NIXL over plain per-layer")
    assert not against_plain.target and not post.target  # GPU targets, not stated on the CPU


def test_kv_cache_counts_threads_and_descriptors_of_each_process(kv_cache_rows):
    _, rows = kv_cache_rows
    counted = [row for row in rows if "process" in row.params]
    assert [row.params["process"] for row in counted] == ["prefill", "decode"]
    for row in counted:
        params = row.params
        assert row.median_s is None and row.value.startswith(f"{params['threads']} thread")
        assert 1 <= params["threads_before"] <= params["threads"]
        assert params["threads_with_nixl"] >= 1
        assert 3 <= params["descriptors_before"] <= params["descriptors"]
        assert row.target == "<= 4 threads" and row.met in (True, False)
        assert row.not_judged_reason == "quick sizes"  # judged at 32 layers, not 8


_COUNTS_CHILD = """
import os, threading, time
from jaxbuf.bench._kv_cache_peer import process_counts
before = process_counts()
started, stop = threading.Event(), threading.Event()
thread = threading.Thread(target=lambda: (started.set(), stop.wait()))
thread.start()
started.wait()
read, write = os.pipe()
during = process_counts()
stop.set()
thread.join()
os.close(read)
os.close(write)
# join() returns before the kernel has reaped the thread: give it a moment to leave the list.
deadline, after = time.monotonic() + 10, process_counts()
while after != before and time.monotonic() < deadline:
    time.sleep(0.01)
    after = process_counts()
print(before, during, after)
"""


def test_process_counts_follows_the_process():
    """One more thread and two more descriptors are counted as such, and gone once closed
    (in a fresh interpreter, where no other test's threads come and go)."""
    import ast
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _COUNTS_CHILD], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, during, after = ast.literal_eval(out.stdout.strip().replace("} {", "}, {"))
    assert before["threads"] >= 1 and before["descriptors"] >= 3
    assert during == {"threads": before["threads"] + 1, "descriptors": before["descriptors"] + 2}
    assert after == before


def test_request_blocks_are_scattered_on_both_sides():
    import numpy as np

    from jaxbuf.bench._kv_cache_peer import _request_blocks

    for count, capacity in ((1, 2), (8, 16), (128, 256), (30, 101)):
        for blocks in _request_blocks(np, count, capacity):
            assert len(blocks) == count == len(set(blocks.tolist()))
            assert blocks.min() >= 0 and blocks.max() < capacity
            ordered = np.sort(blocks)
            assert (np.diff(ordered) >= 2).all()  # no two adjacent: no run to merge
    with pytest.raises(ValueError, match="capacity of 16, got 15"):
        _request_blocks(np, 8, 15)


def test_kv_cache_rows_without_nixl_keep_its_rows_with_the_reason():
    """Where NIXL does not import, its rows stay, with no figure and the reason, and the
    same-host transport is still measured against the floor and judged."""
    from jaxbuf.bench.transfer_kv_cache import _kv_cache_rows

    reason = "not measured: NIXL is not importable (nixl: No module named 'nixl')"
    params = {"layers": 2, "blocks": 4, "bytes": 2 * 2 * 4 * _KV_BLOCK, "processes": 2}
    counts = {"threads": 2, "descriptors": 9}
    setup = {
        "local": {"error": None, "connect_s": 1e-3, "transport": "local"},
        "nixl": {"error": reason, "connect_s": None, "transport": None},
        "counts": {
            role: {
                "before": {"threads": 1, "descriptors": 4},
                "with the same-host endpoint": counts,
            }
            for role in ("prefill", "decode")
        },
    }
    result = {
        "medians": {"floor": 1e-3, "local": 1.1e-3},
        "samples": {"floor": [1e-3] * 3, "local": [1.1e-3] * 3},
        "slow": [],
        "posts": {"local": 1e-3},
        "transports": {"floor": "copy_batch", "local": "same-host transport"},
        "rounds": 3,
    }
    finals = {"prefill": counts, "decode": counts}
    rows = _kv_cache_rows(Device("cpu"), params, setup, result, finals)
    assert len(rows) == 9
    local = _one(rows, ": same-host transport", "floor:")
    assert local.ratio == pytest.approx(1.1) and local.judged is True
    for row in rows:
        if row.params["subject"].startswith("NIXL") or row.baseline_name.startswith("NIXL"):
            assert reason in row.notes, row
        if row.params["subject"].startswith("NIXL"):
            assert row.median_s is None and row.judged is None, row
    assert _one(rows, "post: same-host transport").baseline_median_s is None
    assert _one(rows, "connect 2 layers: same-host transport").baseline_median_s is None


def test_kv_cache_without_nixl_in_the_processes_measures_the_rest(tmp_path, monkeypatch):
    """Two real processes where NIXL does not import: the NIXL rows say why, the same-host
    transport and the floor are measured, and both processes end."""
    from jaxbuf.bench.transfer_kv_cache import kv_cache_rows

    for module in ("nixl", "nixl_cu12", "nixl_cu13"):
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text("raise ImportError('blocked here')\n")
    paths = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    rows = [
        item
        for item in kv_cache_rows(Device("cpu"), layers=2, blocks=4, quick=True)
        if isinstance(item, Row)
    ]
    assert _peer_processes() == []
    assert len(rows) == 10
    for row in rows:
        nixl_subject = row.params["subject"].startswith("NIXL")
        if nixl_subject or row.baseline_name.startswith("NIXL"):
            assert "NIXL is not importable" in row.notes and "blocked here" in row.notes, row
        if nixl_subject:
            assert row.median_s is None, row
        elif row.params.get("process") is None:
            assert row.median_s > 0, row
