"""Benchmarks of :mod:`jaxbuf.transfer` (NIXL), each against plain NIXL in the same run.

Two agents in one process talk over NIXL's UCX backend (loopback between agents: the same
transport code as two processes on one host, without a second process's noise).

* ``transfer.bandwidth``: WRITE of 1, 64 and 1024 blocks from a jaxbuf buffer (grown chunk
  by chunk) into another, against the same blocks between two plain allocations (numpy on
  the CPU, ``torch.empty`` on CUDA) registered whole with the same agents, through prepared
  descriptor lists built by hand. Target: at least 0.95x the plain bandwidth.
* ``transfer.grow``: a +2 MiB grow with the registration following it, against the same
  grow plus NIXL registering the new chunk by hand (target at most 1.2x), and against the
  same grow plus re-registering everything committed (the cost that grows with the buffer).
* ``transfer.host``: the host cost of one block-list WRITE (post and wait) of small blocks,
  against plain NIXL with hand-built descriptors (``initialize_xfer``). Target at most 1.1x.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, SuiteSkipped, format_bytes, suite
from jaxbuf.bench._timing import measure, round_by_round
from jaxbuf.extensible import ExtensibleTensor, granule_size

_MiB = 1 << 20


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


def _plain(device: Any, nbytes: int) -> tuple[Any, int]:
    """A plain allocation of ``nbytes`` (numpy / torch.empty) and its address."""
    if device.is_cuda:
        import torch

        array = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device.index}")
        return array, array.data_ptr()
    array = np.empty(nbytes, dtype=np.uint8)
    array[:] = 1  # touched, as the jaxbuf side is after its grow
    return array, array.ctypes.data


def _plain_small_pages(nbytes: int) -> tuple[Any, int]:
    """Anonymous host memory on 4 KiB pages (``MADV_NOHUGEPAGE``), as the CPU driver's memfd
    chunks are where the kernel gives shared memory no transparent huge pages; numpy's
    arrays of this size get them (numpy asks for them). Whether huge pages are what separates
    the two is what the row over this memory shows."""
    import mmap

    memory = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    array = np.frombuffer(memory, dtype=np.uint8)
    array[:] = 1
    return (memory, array), array.ctypes.data


def _grown(device: Any, nbytes: int) -> ExtensibleTensor:
    """A buffer of ``nbytes`` committed one granule per grow (one chunk each)."""
    chunk = granule_size(device)
    tensor = ExtensibleTensor(nbytes, device=device)
    for size in range(chunk, nbytes + 1, chunk):
        tensor.resize_per_segment_(size)
    if not device.is_cuda:
        tensor.segment_view(0).to_numpy()[:] = 1
    return tensor


def _wait(agent: Any, handle: Any) -> None:
    state = agent.post(handle, b"")
    while state == "PROC":
        state = agent.state(handle)
    if state != "DONE":
        raise RuntimeError(f"a plain NIXL transfer reported {state}")


def _prep_plain(agent: Any, peer: str, address: int, block: int, count: int, mem: str, dev: int):
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = address + np.arange(count, dtype=np.uint64) * block
    rows[:, 1], rows[:, 2] = block, dev
    return agent.prep_dlist(peer, rows, mem)


@suite("transfer.bandwidth")
def bandwidth(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Block WRITE bandwidth from a grown jaxbuf buffer against two plain allocations
    registered whole with the same agents, and against jaxbuf's own memory registered whole
    by hand (what the registration and block lists cost, on the same memory)."""
    transfer = _nixl()
    block = 4096 if quick else 64 << 10
    counts = (1, 64, 1024)
    nbytes = max(counts) * block
    repeat = 3 if quick else 15
    yield Sizes(f"blocks of {format_bytes(block)}, {format_bytes(nbytes)} per side")
    agent_a, agent_b = _agents(transfer, "bw")
    layout = transfer.KVLayout(block)
    a, b = _grown(device, nbytes), _grown(device, nbytes)
    ea, eb = transfer.KVEndpoint(agent_a, a, layout), transfer.KVEndpoint(agent_b, b, layout)
    (plain_a, address_a), (plain_b, address_b) = _plain(device, nbytes), _plain(device, nbytes)
    # On the CPU, plain memory on small pages too: the page size, not jaxbuf, may set the pace.
    small = None if device.is_cuda else (_plain_small_pages(nbytes), _plain_small_pages(nbytes))
    mem = ea.registration.mem_type
    dev = ea.registration.device_id
    registrations = [
        (agent_a, agent_a.register([(address_a, nbytes)], mem, dev)),
        (agent_b, agent_b.register([(address_b, nbytes)], mem, dev)),
    ]
    plain_lists: list[Any] = []
    try:
        peer = ea.connect(eb.metadata())
        # jaxbuf's memory again, through a second pair of agents, registered whole.
        whole_a, whole_b = _agents(transfer, "bw-whole")
        registrations += [
            (whole_a, whole_a.register([(a.base_ptr, nbytes)], mem, dev)),
            (whole_b, whole_b.register([(b.base_ptr, nbytes)], mem, dev)),
        ]
        whole_a.add_remote(whole_b.metadata())
        sides = [
            (agent_a, agent_b, address_a, address_b),
            (whole_a, whole_b, a.base_ptr, b.base_ptr),
        ]
        small_a = None
        if small is not None:
            small_a, small_b = _agents(transfer, "bw-small-pages")
            (_, small_address_a), (_, small_address_b) = small
            registrations += [
                (small_a, small_a.register([(small_address_a, nbytes)], mem, dev)),
                (small_b, small_b.register([(small_address_b, nbytes)], mem, dev)),
            ]
            small_a.add_remote(small_b.metadata())
            sides.append((small_a, small_b, small_address_a, small_address_b))
        pairs = {}
        for agent, peer_agent, src, dst in sides:
            local = _prep_plain(agent, "NIXL_INIT_AGENT", src, block, max(counts), mem, dev)
            remote = _prep_plain(agent, peer_agent.name, dst, block, max(counts), mem, dev)
            plain_lists += [(agent, local), (agent, remote)]
            pairs[agent.name] = (agent, local, remote)
        for count in counts:
            yield from _bandwidth_rows(
                ea, peer, pairs, agent_a, whole_a, small_a, count, block, repeat
            )
    finally:
        for agent, handle in plain_lists:
            agent.release_dlist(handle)
        for agent, handle in registrations:
            agent.deregister(handle)
        ea.close()
        eb.close()
        a.free()
        b.free()
        agent_a.close()
        del plain_a, plain_b, small


def _bandwidth_rows(
    endpoint: Any,
    peer: Any,
    pairs: dict[str, tuple[Any, Any, Any]],
    plain_agent: Any,
    whole_agent: Any,
    small_pages_agent: Any | None,
    count: int,
    block: int,
    repeat: int,
) -> list[Row]:
    """The two rows of :func:`bandwidth` for ``count`` blocks, sampled round by round."""
    blocks = np.arange(count, dtype=np.int64)

    def jaxbuf_write() -> None:
        endpoint.write(peer, blocks, blocks).wait()

    def by_hand(name: str):
        agent, local, remote = pairs[name]

        def write() -> None:
            handle = agent.make_prepped("WRITE", local, blocks, remote, blocks, b"")
            try:
                _wait(agent, handle)
            finally:
                agent.release_transfer(handle)

        return write

    calls = {
        "jaxbuf": jaxbuf_write,
        "plain": by_hand(plain_agent.name),
        "whole": by_hand(whole_agent.name),
    }
    if small_pages_agent is not None:
        calls["small pages"] = by_hand(small_pages_agent.name)
    for call in calls.values():  # warm-up
        call()
        call()
    # A single block takes a few hundred microseconds, so host jitter moves its median by
    # several percent over 15 rounds: it gets ten times as many (a fraction of a second).
    medians = round_by_round(calls, repeat * 10 if count == 1 else repeat)
    moved = count * block
    name = f"WRITE {count} block{'s' if count > 1 else ''} ({format_bytes(moved)})"
    params = {"blocks": count, "block_bytes": block}
    row = Row(
        name,
        medians["jaxbuf"],
        "plain allocations, hand-prepared NIXL lists",
        medians["plain"],
        notes=f"{moved / medians['jaxbuf'] / 1e9:.2f} GB/s, plain "
        f"{moved / medians['plain'] / 1e9:.2f} GB/s",
        # Time, jaxbuf ÷ plain, as every ratio: at least 0.95x the plain bandwidth.
        target="<= 1.05x (0.95x the bandwidth or better)",
        params=params,
    )
    row.met = row.ratio is not None and row.ratio <= 1 / 0.95
    rows = [
        row,
        Row(
            name,
            medians["jaxbuf"],
            "jaxbuf's memory registered whole, hand-prepared lists",
            medians["whole"],
            notes="the same memory: what the registrations and block lists cost",
            params=params,
        ),
    ]
    if "small pages" in medians:
        rows.append(
            Row(
                name,
                medians["jaxbuf"],
                "plain allocations on 4 KiB pages, hand-prepared lists",
                medians["small pages"],
                notes="plain memory without transparent huge pages, as memfd memory has "
                "where the kernel gives shared memory none (shmem_enabled)",
                params=params,
            )
        )
    return rows


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
        medians = round_by_round({"followed": grow_followed, "by hand": grow_by_hand}, repeat)
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


@suite("transfer.host")
def host_cost(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Host cost of one block-list WRITE (post and wait) against plain NIXL with hand-built
    descriptors."""
    transfer = _nixl()
    block = 4096
    nbytes = granule_size(device)
    counts = (1, 64)
    repeat = 50 if quick else 400
    yield Sizes(f"blocks of {format_bytes(block)}, {repeat} transfers each")
    agent_a, agent_b = _agents(transfer, "host")
    layout = transfer.KVLayout(block)
    a, b = _grown(device, nbytes), _grown(device, nbytes)
    ea, eb = transfer.KVEndpoint(agent_a, a, layout), transfer.KVEndpoint(agent_b, b, layout)
    mem, dev = ea.registration.mem_type, ea.registration.device_id
    try:
        peer = ea.connect(eb.metadata())
        for count in counts:
            blocks = np.arange(count, dtype=np.int64) * 3  # scattered blocks

            def jaxbuf_write(blocks: np.ndarray = blocks) -> None:
                ea.write(peer, blocks, blocks).wait()

            def plain_write(blocks: np.ndarray = blocks) -> None:
                local = np.empty((len(blocks), 3), dtype=np.uint64)
                remote = np.empty((len(blocks), 3), dtype=np.uint64)
                local[:, 0] = a.base_ptr + blocks.astype(np.uint64) * block
                remote[:, 0] = b.base_ptr + blocks.astype(np.uint64) * block
                local[:, 1] = remote[:, 1] = block
                local[:, 2] = remote[:, 2] = dev
                handle = agent_a.make_transfer("WRITE", local, remote, agent_b.name, (mem, mem))
                try:
                    _wait(agent_a, handle)
                finally:
                    agent_a.release_transfer(handle)

            mine = measure(jaxbuf_write, repeat=repeat, warmup=5)
            plain = measure(plain_write, repeat=repeat, warmup=5)
            row = Row(
                f"WRITE {count} block{'s' if count > 1 else ''} of {format_bytes(block)}",
                mine.median_s,
                "plain NIXL, hand-built descriptors",
                plain.median_s,
                target="<= 1.1x",
                params={"blocks": count, "block_bytes": block},
            )
            row.met = row.ratio is not None and row.ratio <= 1.1
            yield row
    finally:
        ea.close()
        eb.close()
        a.free()
        b.free()
        agent_a.close()
