"""Benchmarks of :mod:`jaxbuf.transfer`: KV-block transfers between two processes, as an
inference deployment runs them (a prefill process and a decode process, one GPU each where
there are two), and the registrations that follow a grow.

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
* ``transfer.kv_cache``: a cache shaped like a model's on both sides (32 layers, one tensor
  per layer with K and V segments, blocks of 16 tokens x 8 KV heads x 128 dims in bf16 =
  32 KiB per segment; 8 layers and 32 blocks with ``--quick``), and one ``write`` of a
  2,048-token request's 128 scattered blocks (256 MiB) from the prefill process into the
  decode process, by the same-host transport (``KVCacheEndpoint(name, cache,
  transport="local")``), NIXL over the same jaxbuf memory (``KVCacheEndpoint(agent, cache,
  transport="nixl")``) and NIXL over plain per-layer buffers with one descriptor per block
  and layer (prepared lists: what a connector without a cross-layer layout posts), against
  the floor: one device copy of the same bytes on CUDA, and on the CPU the same scattered
  blocks gathered in one process by the copy the CPU driver moves blocks with
  (``copy_batch``); on the CPU also against one contiguous memcpy of the same bytes, the
  physical floor (glibc copies many MiB with non-temporal stores; ``copy_batch`` streams a
  batch that large too). Also the host time of the post alone, the
  time of the first ``connect``, and each process's threads and open descriptors
  (``/proc/self/task``, ``/proc/self/fd``) with the same-host endpoint alone, before NIXL is
  loaded. NIXL's rows keep their place, with the reason, where NIXL does not import.
  Targets: the same-host transport at >= 0.8x the floor's bandwidth (CUDA and CPU, both
  floors on the CPU); on the
  CPU at most 4 threads per process, whatever the layer count (judged at 32 layers); on CUDA
  the post within 50 µs and >= 1.5x the bandwidth of NIXL over plain per-layer buffers.
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

    def __init__(self, device: Any) -> None:
        from jaxbuf.bench._transfer_peer import TwoProcesses

        self.prefill_device, self.decode_device = device, _decode_device(device)
        self.log_dir = tempfile.mkdtemp(prefix="jaxbuf-bench-ucx-")
        try:
            log = os.path.join(self.log_dir, "prefill.log")
            self.processes = TwoProcesses(str(device), str(self.decode_device), log)
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

    floor_gbps = _gbps(moved, floor_s)
    rows = [
        Row(
            f"{name}: floor",
            floor_s,
            notes=f"{floor_gbps:.2f} GB/s; {transports['floor']}",
            params={
                **base,
                "subject": "floor",
                "transport": transports["floor"],
                "gbps": floor_gbps,
            },
        ),
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


#: The shape of ``transfer.kv_cache``: a model's layers, a 2,048-token request's blocks, and
#: a block of 16 tokens x 8 KV heads x 128 dims in bf16 per segment (K, V).
_KV_LAYERS, _KV_BLOCKS = 32, 128
_KV_BLOCK_BYTES = 16 * 8 * 128 * 2
_KV_TOKENS_PER_BLOCK = 16
_NIXL_PER_LAYER = "NIXL over plain per-layer buffers"
_NIXL_PER_LAYER_NOTE = "one descriptor per block and layer (K and V adjacent), prepared lists"


@suite("transfer.kv_cache")
def kv_cache(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A request's scattered KV blocks written across every layer of a cache shaped like a
    model's, from a prefill to a decode process in one ``write``: the same-host transport,
    NIXL over jaxbuf memory and NIXL over plain per-layer buffers, against one copy of the
    same bytes in one process (the floor); each process's threads and descriptors, and the
    time to connect."""
    layers, blocks = (8, 32) if quick else (_KV_LAYERS, _KV_BLOCKS)
    yield from kv_cache_rows(device, layers=layers, blocks=blocks, quick=quick)


def kv_cache_rows(
    device: Any, *, layers: int, blocks: int, quick: bool, capacity: int | None = None
) -> Iterator[Row | Sizes]:
    """The rows of :func:`kv_cache` for a cache of ``layers`` tensors of ``capacity`` blocks
    (twice the request's by default) and a request of ``blocks`` scattered blocks."""
    capacity = 2 * blocks if capacity is None else capacity
    moved = layers * 2 * blocks * _KV_BLOCK_BYTES
    run = _Run(device)
    try:
        yield Sizes(
            f"WRITE of {blocks:,} scattered blocks (a {blocks * _KV_TOKENS_PER_BLOCK:,}-token "
            f"request) x {layers} layers x K and V, {format_bytes(_KV_BLOCK_BYTES)} per block "
            f"and segment = {format_bytes(moved)} in one write, {capacity:,} blocks per "
            f"layer; {run.topology}"
        )
        setup = run.processes.setup_cache(layers, capacity, _KV_BLOCK_BYTES, blocks)
        result = run.processes.prefill("kv_cache", blocks, quick)
        finals = {"prefill": result["counts"], "decode": run.processes.decode("counts")}
        run.processes.teardown()
    finally:
        run.close()
    params = {
        "operation": "WRITE",
        "layers": layers,
        "segments": 2,
        "blocks": blocks,
        "block_bytes": _KV_BLOCK_BYTES,
        "capacity_blocks": capacity,
        "bytes": moved,
        "rounds": result["rounds"],
        **run.params(),
    }
    yield from _kv_cache_rows(device, params, setup, result, finals)


def _kv_cache_rows(
    device: Any,
    params: dict[str, Any],
    setup: dict[str, Any],
    result: dict[str, Any],
    finals: dict[str, dict[str, int]],
) -> list[Row]:
    """The rows of one :func:`kv_cache_rows` run from what the processes reported: the
    floor; each transport against it; the same-host transport against NIXL over plain
    per-layer buffers; the post; connect; each process's threads and descriptors."""
    medians, samples, transports = result["medians"], result["samples"], result["transports"]
    posts = result["posts"]
    moved, layers, blocks = params["bytes"], params["layers"], params["blocks"]
    local_error = setup["local"]["error"] or "not measured"
    nixl_error = setup["nixl"]["error"] or "not measured"
    name = f"WRITE {blocks:,} blocks x {layers} layers"
    floor_s = medians["floor"]
    floor_name = f"floor: {transports['floor']}"
    floor_gbps = _gbps(moved, floor_s)

    def spread(label: str, baseline: str) -> tuple[float, float] | None:
        if label not in samples or baseline not in samples:
            return None
        paired = (label in result["slow"]) == (baseline in result["slow"])  # the same rounds
        return ratio_spread(samples[label], samples[baseline], paired=paired)

    def row(subject: str, label: str, baseline: str, baseline_label: str, **kw: Any) -> Row:
        return _against(
            name,
            subject,
            medians.get(label),
            transports.get(label),
            baseline,
            medians.get(baseline_label),
            moved,
            nixl_error if label.startswith("nixl") else local_error,
            params,
            spread=spread(label, baseline_label),
            **kw,
        )

    per_layer = f"{_NIXL_PER_LAYER} ({_NIXL_PER_LAYER_NOTE})"
    # On CUDA, 1.5x NIXL's bandwidth over plain buffers: at most 0.667x its time.
    against_plain = row(
        _LOCAL, "local", per_layer, "nixl plain", fraction=1 / 1.5 if device.is_cuda else None
    )
    if "nixl plain" not in medians:
        against_plain.notes += f"; baseline {nixl_error}"
    rows = [
        Row(
            f"{name}: floor",
            floor_s,
            notes=f"{floor_gbps:.2f} GB/s; {transports['floor']}",
            params={
                **params,
                "subject": "floor",
                "transport": transports["floor"],
                "gbps": floor_gbps,
            },
        ),
        row(_LOCAL, "local", floor_name, "floor", fraction=0.8),
        against_plain,
        *(
            [
                row(
                    _LOCAL,
                    "local",
                    f"floor, contiguous: {transports['contiguous']}",
                    "contiguous",
                    fraction=0.8,
                )
            ]
            if "contiguous" in medians
            else []
        ),
        row(_NIXL_JAXBUF, "nixl jaxbuf", floor_name, "floor"),
        row(_NIXL_PER_LAYER, "nixl plain", floor_name, "floor"),
    ]
    post = Row(
        f"{name}, post: {_LOCAL}",
        posts.get("local"),
        f"{_NIXL_PER_LAYER}, post",
        posts.get("nixl plain"),
        notes=transports.get("local") or local_error,
        params={**params, "subject": _LOCAL, "phase": "post"},
    )
    if "nixl plain" not in posts:
        post.notes += f"; baseline {nixl_error}"
    if device.is_cuda:
        post.target, post.limit = "<= 50 µs", 50e-6
        post.met = post.median_s is not None and post.median_s <= 50e-6
    rows.append(post)
    local_connect, nixl_connect = setup["local"]["connect_s"], setup["nixl"]["connect_s"]
    connect = Row(
        f"connect {layers} layers: {_LOCAL}",
        local_connect,
        f"{_NIXL_JAXBUF}, connect",
        nixl_connect,
        notes="one sample each (a peer is connected once)"
        if local_connect is not None
        else local_error,
        params={**params, "subject": _LOCAL, "phase": "connect"},
    )
    if nixl_connect is None:
        connect.notes += f"; baseline {nixl_error}"
    rows.append(connect)
    rows.extend(_kv_counts_rows(device, params, setup, finals, local_error))
    return rows


def _counted(counts: dict[str, int]) -> str:
    """``"5 threads, 32 descriptors"``."""
    threads, descriptors = counts["threads"], counts["descriptors"]
    return (
        f"{threads} thread{'s' * (threads != 1)}, "
        f"{descriptors} descriptor{'s' * (descriptors != 1)}"
    )


def _kv_counts_rows(
    device: Any,
    params: dict[str, Any],
    setup: dict[str, Any],
    finals: dict[str, dict[str, int]],
    local_error: str,
) -> list[Row]:
    """Each process's threads and open descriptors with the same-host cache endpoint alone
    (connected, one request written), against the process before the cache; target on the
    CPU: at most 4 threads, whatever the layer count (judged at full size, 32 layers, as
    every target: a quick run's few layers would pass a thread per layer)."""
    rows = []
    connected = setup["local"]["connect_s"] is not None
    for role in ("prefill", "decode"):
        counts = setup["counts"][role]
        before, alone = counts["before"], counts["with the same-host endpoint"]
        final = finals[role]
        made = Row(
            f"threads and descriptors, {role} process: {_LOCAL}",
            None,
            value=_counted(alone) if connected else "",
            notes=(
                f"before the cache: {_counted(before)}; after the run"
                f"{'' if setup['nixl']['error'] else ', with NIXL too'}: {_counted(final)}"
            )
            if connected
            else local_error,
            params={
                **params,
                "subject": _LOCAL,
                "process": role,
                "threads": alone["threads"],
                "descriptors": alone["descriptors"],
                "threads_before": before["threads"],
                "descriptors_before": before["descriptors"],
                "threads_with_nixl": final["threads"],
                "descriptors_with_nixl": final["descriptors"],
            },
        )
        if not device.is_cuda:
            made.target = "<= 4 threads"
            made.met = connected and alone["threads"] <= 4
        rows.append(made)
    return rows
