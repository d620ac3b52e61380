"""Benchmarks of :mod:`jaxbuf.transfer`: KV-block transfers between two processes, as an
inference deployment runs them (a prefill process and a decode process, one GPU each where
there are two), and the registrations that follow a grow. ``transfer.kv_cache``, a cache
shaped like a model's, is in :mod:`jaxbuf.bench.transfer_kv_cache`, on the same machinery.

* ``transfer.bandwidth``: WRITE and READ of 1 block of 64 MiB, 64 and 1,024 blocks of 64 KiB
  (4 MiB, 16 KiB blocks with ``--quick``) from the prefill process into the decode process,
  by four subjects timed round by round in the same pair of processes: (a) the same-host
  transport over jaxbuf memory (``KVEndpoint(..., transport="local")``), (b) NIXL over jaxbuf
  memory (a buffer grown one granule per grow, one registration per chunk), (c) NIXL over
  plain allocations (``torch.empty`` on CUDA, numpy on the CPU) registered whole, through
  prepared descriptor lists, and (d) the floor: the device's own copy of the same blocks
  between two plain buffers of one process (torch's ``copy_`` on CUDA, ``np.copyto`` on the
  CPU), one copy per contiguous run of the block list. Each subject's row is against the
  floor; the same-host transport's also against NIXL over plain memory. ``params`` carries
  the GB/s of both sides. Targets: the same-host transport at >= 0.8x the floor's bandwidth
  for one 64 MiB block (CUDA and CPU), >= 0.5x for 1,024 blocks of 64 KiB (CUDA), and at
  least NIXL over plain memory's bandwidth at every size.
* ``transfer.host``: the host cost of posting a one-block WRITE (the post alone, and post
  plus wait), the same-host transport and NIXL over jaxbuf memory against NIXL over plain
  memory with prepared lists, in the same two processes. Target: the same-host post within
  20 µs on a GPU.
* ``transfer.grow``: a +2 MiB grow with the registration following it, against the same
  grow plus NIXL registering the new chunk by hand (target at most 1.2x), and against the
  same grow plus re-registering everything committed (the cost that grows with the buffer).
  One process: it times registration, not bandwidth.

Every row says which transport moved the bytes: the same-host endpoint's peer names its
transport; for NIXL, the prefill process runs UCX with ``UCX_PROTO_INFO=y`` and reads the
protocols UCX chose for remote writes and reads (``cma/memory`` between two processes on the
CPU; ``tcp/lo`` where UCX fell back to TCP loopback, which is then what the row measures).
Where this jaxbuf has no same-host transport, its rows are kept with no figure and the reason.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from typing import Any

from jaxbuf.bench import Row, Sizes, SuiteSkipped, format_bytes, ratio_spread, suite
from jaxbuf.bench._timing import measure, round_by_round_samples
from jaxbuf.extensible import ExtensibleTensor, granule_size

_KiB, _MiB = 1 << 10, 1 << 20
_OPERATIONS = ("WRITE", "READ")
_LOCAL = "same-host transport"
_NIXL_JAXBUF = "NIXL over jaxbuf memory"
_NIXL_PLAIN = "NIXL over plain memory"


def _nixl() -> Any:
    from jaxbuf import transfer

    try:
        transfer.load_nixl()
    except transfer.NixlUnavailable as error:
        raise SuiteSkipped(str(error)) from None
    return transfer


def _agents(transfer: Any, what: str) -> tuple[Any, Any]:
    tag = f"{what}-{os.getpid()}"
    return transfer.Agent(f"bench-{tag}-a"), transfer.Agent(f"bench-{tag}-b")


def _decode_device(device: Any) -> Any:
    """Where the decode process's memory lives: the next GPU where there are two (one GPU
    per process, as deployments run), else the bench device too."""
    if not device.is_cuda:
        return device
    from jaxbuf.devices import Device
    from jaxbuf.drivers import get_vmm_driver

    count = get_vmm_driver(device).device_count()
    return Device("cuda", (device.index + 1) % count) if count > 1 else device


class _Run:
    """The two processes of a suite, and the UCX log of the prefill one; closing ends both
    processes and removes the log."""

    def __init__(self, device: Any, processes_type: type[Any] | None = None) -> None:
        """``processes_type``: ``TwoProcesses`` (the default) or a subclass of it, whose
        sides serve more commands."""
        from jaxbuf.bench._transfer_peer import TwoProcesses

        processes_type = processes_type or TwoProcesses
        self.prefill_device, self.decode_device = device, _decode_device(device)
        self.log_dir = tempfile.mkdtemp(prefix="jaxbuf-bench-ucx-")
        try:
            log = os.path.join(self.log_dir, "prefill.log")
            self.processes = processes_type(str(device), str(self.decode_device), log)
        except BaseException:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            raise

    @property
    def topology(self) -> str:
        return f"two processes, prefill on {self.prefill_device}, decode on {self.decode_device}"

    def params(self) -> dict[str, Any]:
        return {
            "processes": 2,
            "prefill_device": str(self.prefill_device),
            "decode_device": str(self.decode_device),
        }

    def close(self) -> None:
        try:
            self.processes.close()
        finally:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e9


def _bandwidth_groups(quick: bool) -> list[tuple[int, tuple[int, ...]]]:
    """``(block bytes, block counts)``: one block of 64 MiB; 64 and 1,024 blocks of 64 KiB."""
    if quick:
        return [(4 * _MiB, (1,)), (16 * _KiB, (64, 256))]
    return [(64 * _MiB, (1,)), (64 * _KiB, (64, 1024))]


def _blocks_name(count: int, block: int) -> str:
    return f"{count:,} x {format_bytes(block)}"


@suite("transfer.bandwidth")
def bandwidth(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """KV-block WRITE and READ bandwidth between a prefill and a decode process: the
    same-host transport, NIXL over jaxbuf memory and NIXL over plain memory, against the
    device's own copy of the same bytes in one process (the floor)."""
    _nixl()
    groups = _bandwidth_groups(quick)
    run = _Run(device)
    try:
        sizes = "; ".join(
            ", ".join(_blocks_name(count, block) for count in counts) for block, counts in groups
        )
        yield Sizes(f"{sizes}; WRITE and READ; {run.topology}")
        for block, counts in groups:
            connected = run.processes.setup(block, max(counts) * block)
            for count in counts:
                for operation in _OPERATIONS:
                    result = run.processes.prefill("bandwidth", operation, count, quick)
                    yield from _bandwidth_rows(
                        device, run, connected, result, operation, count, block, groups
                    )
            run.processes.teardown()
    finally:
        run.close()


def _bandwidth_target(
    device: Any, count: int, block: int, groups: list[tuple[int, tuple[int, ...]]]
) -> float | None:
    """The same-host transport's fraction of the floor's bandwidth to reach, or None."""
    if count == 1 and block == groups[0][0]:  # one big block
        return 0.8
    if device.is_cuda and block == groups[1][0] and count == max(groups[1][1]):
        return 0.5
    return None


def _against(
    name: str,
    subject: str,
    seconds: float | None,
    transport: str | None,
    baseline: str,
    baseline_s: float | None,
    moved: int,
    unmeasured: str,
    params: dict[str, Any],
    fraction: float | None = None,
    spread: tuple[float, float] | None = None,
) -> Row:
    """The row of ``subject`` moving ``moved`` bytes against ``baseline`` doing the same:
    both sides' GB/s in ``notes`` and ``params``, the transport that moved the bytes, or
    ``unmeasured`` (why there is no figure). With ``fraction``, the target of reaching that
    fraction of the baseline's bandwidth (a bound on the time ratio, ``spread`` its range)."""
    notes = transport or unmeasured
    gbps, baseline_gbps = _gbps(moved, seconds), _gbps(moved, baseline_s)
    if gbps is not None:
        against = "no baseline" if baseline_gbps is None else f"{baseline_gbps:.2f} GB/s baseline"
        notes = f"{gbps:.2f} GB/s ({against}); {notes}"
    made = Row(
        f"{name}: {subject}",
        seconds,
        baseline,
        baseline_s,
        notes=notes,
        spread=spread,
        params={
            **params,
            "subject": subject,
            "transport": transport,
            "gbps": gbps,
            "baseline_gbps": baseline_gbps,
            # baseline time ÷ this time: the fraction of the baseline's bandwidth reached.
            "bandwidth_vs_baseline": None
            if not seconds or not baseline_s
            else baseline_s / seconds,
        },
    )
    if fraction is not None:
        # Every ratio is time ÷ baseline time: 0.8x the bandwidth is 1.25x the time.
        made.target = f"<= {1 / fraction:.3g}x ({fraction:.2g}x the bandwidth or better)"
        made.limit = 1 / fraction
        made.met = made.ratio is not None and made.ratio <= 1 / fraction * (1 + 1e-9)
    return made


def _floor_row(
    name: str, seconds: float, transport: str, moved: int, params: dict[str, Any]
) -> Row:
    """The floor's own row, with no baseline: its time and GB/s moving ``moved`` bytes."""
    gbps = _gbps(moved, seconds)
    return Row(
        f"{name}: floor",
        seconds,
        notes=f"{gbps:.2f} GB/s; {transport}",
        params={**params, "subject": "floor", "transport": transport, "gbps": gbps},
    )


def _bandwidth_rows(
    device: Any,
    run: _Run,
    connected: dict[str, Any],
    result: dict[str, Any],
    operation: str,
    count: int,
    block: int,
    groups: list[tuple[int, tuple[int, ...]]],
) -> list[Row]:
    """The rows of one operation on ``count`` blocks: the floor alone, then each transport
    against the floor, and the same-host transport against NIXL over plain memory."""
    medians, transports = result["medians"], result["transports"]
    moved = count * block
    name = f"{operation} {_blocks_name(count, block)}"
    base = {
        "operation": operation,
        "blocks": count,
        "block_bytes": block,
        "bytes": moved,
        "rounds": result["rounds"],
        **run.params(),
    }
    floor_s = medians["floor"]
    floor_name = f"floor: {transports['floor']}"

    def row(
        subject: str, label: str, baseline: str, baseline_label: str, fraction: float | None
    ) -> Row:
        return _against(
            name,
            subject,
            medians.get(label),
            transports.get(label),
            baseline,
            medians[baseline_label],
            moved,
            connected.get("local_error") or "not measured",
            base,
            fraction,
        )

    rows = [
        _floor_row(name, floor_s, transports["floor"], moved, base),
        row(_LOCAL, "local", floor_name, "floor", _bandwidth_target(device, count, block, groups)),
        row(_LOCAL, "local", f"{_NIXL_PLAIN} (prepared lists)", "nixl plain", 1.0),
        row(_NIXL_JAXBUF, "nixl jaxbuf", floor_name, "floor", None),
        row(f"{_NIXL_PLAIN} (prepared lists)", "nixl plain", floor_name, "floor", None),
    ]
    return rows


@suite("transfer.host")
def host_cost(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Host cost of posting a one-block WRITE from a prefill to a decode process (the post
    alone, and post plus wait): the same-host transport and NIXL over jaxbuf memory, against
    NIXL over plain memory with prepared lists."""
    _nixl()
    block = 4 * _KiB
    rounds = 50 if quick else 2000
    run = _Run(device)
    try:
        yield Sizes(f"1 block of {format_bytes(block)}, {rounds} rounds; {run.topology}")
        connected = run.processes.setup(block, granule_size(device))
        result = run.processes.prefill("host_cost", rounds)
        run.processes.teardown()
    finally:
        run.close()
    transports = result["transports"]
    baseline = f"{_NIXL_PLAIN}, prepared lists"
    for phase, key in (("post", "post"), ("post + wait", "total")):
        medians = result[key]
        for subject, label in ((_LOCAL, "local"), (_NIXL_JAXBUF, "nixl jaxbuf")):
            seconds = medians.get(label)
            notes = transports.get(label) or connected.get("local_error") or "not measured"
            made = Row(
                f"WRITE 1 x {format_bytes(block)}, {phase}: {subject}",
                seconds,
                baseline,
                medians["nixl plain"],
                notes=f"{notes}; baseline: {transports['nixl plain']}",
                params={
                    "operation": "WRITE",
                    "blocks": 1,
                    "block_bytes": block,
                    "phase": phase,
                    "subject": subject,
                    "transport": transports.get(label),
                    "baseline_transport": transports["nixl plain"],
                    "rounds": rounds,
                    **run.params(),
                },
            )
            if label == "local" and key == "post" and device.is_cuda:
                made.target = "<= 20 µs"
                made.met = seconds is not None and seconds <= 20e-6
            yield made


@suite("transfer.grow")
def grow_registration(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A one-chunk grow whose registration follows it, against the grow plus NIXL registering
    the new chunk by hand, and against the grow plus re-registering everything."""
    transfer = _nixl()
    chunk = granule_size(device)
    committed_sizes = (16 * _MiB, 64 * _MiB) if quick else (16 * _MiB, 256 * _MiB, 1024 * _MiB)
    if device.is_cuda and not quick:  # flat up to what a KV cache on one GPU commits
        committed_sizes += (8192 * _MiB, 49152 * _MiB)
    repeat = 3 if quick else 31
    yield Sizes(
        f"+{format_bytes(chunk)} at {', '.join(map(format_bytes, committed_sizes))} committed"
    )
    agent, _ = _agents(transfer, "grow")
    for committed in committed_sizes:
        yield from _grow_rows(transfer, agent, device, committed, chunk, repeat)


def _grow_rows(
    transfer: Any, agent: Any, device: Any, committed: int, chunk: int, repeat: int
) -> list[Row]:
    """The two rows of :func:`grow_registration` at ``committed`` bytes. The re-registering
    baseline runs after the other two are freed, so at most two buffers of ``committed``
    bytes are alive at once (two of 48 GiB fit an H200, three do not)."""
    capacity = committed + (repeat + 3) * chunk
    params = {"committed_bytes": committed, "grow_bytes": chunk}
    name = f"+{format_bytes(chunk)} grow at {format_bytes(committed)}"
    followed = ExtensibleTensor(capacity, device=device)
    by_hand = ExtensibleTensor(capacity, device=device)
    registration = transfer.Registration(agent, followed)
    handles: list[Any] = []
    mem, dev = registration.mem_type, registration.device_id
    try:
        for tensor in (followed, by_hand):
            tensor.resize_per_segment_(committed)

        def grow_followed() -> None:
            followed.resize_per_segment_(followed.num_bytes + chunk)

        def grow_by_hand() -> None:
            start = by_hand.num_bytes
            by_hand.resize_per_segment_(start + chunk)
            handles.append(agent.register([(by_hand.base_ptr + start, chunk)], mem, dev))

        grow_followed(), grow_by_hand()  # warm-up: first-call costs on neither side
        # Round by round, so that drift of the host's speed falls on both sides of the target.
        samples = round_by_round_samples(
            {"followed": grow_followed, "by hand": grow_by_hand}, repeat
        )
        medians = {key: statistics.median(values) for key, values in samples.items()}
    finally:
        for handle in handles:
            agent.deregister(handle)
        registration.close()
        followed.free()
        by_hand.free()
    everything = _reregistering_grow(agent, device, committed, chunk, capacity, repeat, mem, dev)
    row = Row(
        name,
        medians["followed"],
        "grow + NIXL registering the new chunk",
        medians["by hand"],
        target="<= 1.2x",
        limit=1.2,
        spread=ratio_spread(samples["followed"], samples["by hand"], paired=True),
        params=params,
    )
    row.met = row.ratio is not None and row.ratio <= 1.2
    return [
        row,
        Row(
            name,
            medians["followed"],
            "grow + re-registering everything",
            everything,
            params=params,
        ),
    ]


def _reregistering_grow(
    agent: Any,
    device: Any,
    committed: int,
    chunk: int,
    capacity: int,
    repeat: int,
    mem: str,
    dev: int,
) -> float:
    """Median seconds of a one-chunk grow followed by re-registering everything committed
    (the baseline whose cost grows with the buffer)."""
    whole = ExtensibleTensor(capacity, device=device)
    handle: list[Any] = []
    try:
        whole.resize_per_segment_(committed)
        handle.append(agent.register([(whole.base_ptr, committed)], mem, dev))

        def grow_reregister_all() -> None:
            whole.resize_per_segment_(whole.num_bytes + chunk)
            agent.deregister(handle.pop())
            handle.append(agent.register([(whole.base_ptr, whole.num_bytes)], mem, dev))

        return measure(grow_reregister_all, repeat=repeat).median_s
    finally:
        for registered in handle:
            agent.deregister(registered)
        whole.free()
