"""The ``transfer.kv_cache`` benchmark of :mod:`jaxbuf.transfer`, on the machinery of
:mod:`jaxbuf.bench.transfer` (its two processes, prefill and decode, and its rows against a
baseline): a cache shaped like a model's on both sides (32 layers, one tensor per layer with K
and V segments, blocks of 16 tokens x 8 KV heads x 128 dims in bf16 = 32 KiB per segment; 8
layers and 32 blocks with ``--quick``), and one ``write`` of a 2,048-token request's 128
scattered blocks (256 MiB) from the prefill process into the decode process, by the same-host
transport (``KVCacheEndpoint(name, cache, transport="local")``), NIXL over the same jaxbuf
memory (``KVCacheEndpoint(agent, cache, transport="nixl")``) and NIXL over plain per-layer
buffers with one descriptor per block and layer (prepared lists: what a connector without a
cross-layer layout posts), against the floor: one device copy of the same bytes on CUDA, and on
the CPU the same scattered blocks gathered in one process by the copy the CPU driver moves
blocks with (``copy_batch``); on the CPU also against one contiguous memcpy of the same bytes,
the physical floor (glibc copies many MiB with non-temporal stores; ``copy_batch`` streams a
batch that large too). Also the host time of the post alone, the time of the first ``connect``,
and each process's threads and open descriptors (``/proc/self/task``, ``/proc/self/fd``) with
the same-host endpoint alone, before NIXL is loaded. NIXL's rows keep their place, with the
reason, where NIXL does not import. Targets: the same-host transport at >= 0.8x the floor's
bandwidth (CUDA and CPU, both floors on the CPU); on the CPU at most 4 threads per process,
whatever the layer count (judged at 32 layers); on CUDA the post within 50 µs and >= 1.5x the
bandwidth of NIXL over plain per-layer buffers.

Every row says which transport moved the bytes, as :mod:`jaxbuf.bench.transfer`'s do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jaxbuf.bench import Row, Sizes, format_bytes, ratio_spread, suite
from jaxbuf.bench.transfer import _LOCAL, _NIXL_JAXBUF, _against, _floor_row, _Run

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
    from jaxbuf.bench._kv_cache_peer import KVCacheProcesses

    run = _Run(device, KVCacheProcesses)
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
        _floor_row(name, floor_s, transports["floor"], moved, params),
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
