"""The transfer benchmark suites (``jaxbuf.bench.transfer``), run quickly on the CPU: the two
processes are started and always ended, every row is well-formed against a baseline measured
in the same run, says which transport moved the bytes, and the floor is there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxbuf.bench import load_suites
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
    """Processes of ``jaxbuf.bench._transfer_peer`` started by this one, still alive."""
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
        if parent == os.getpid() and b"_transfer_peer" in command:
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
