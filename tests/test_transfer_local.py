"""The same-host transport: two real processes move KV blocks through imported chunks and
driver copies, while either side grows (inside a chunk and across chunks), releases,
recommits and defragments; a numpy model of both buffers is checked after every step. An
impostor or a hostile peer gets an error and changes nothing; nothing leaks (descriptors,
mappings, threads). The same runs on one H200 with two processes (``-m gpu``)."""

from __future__ import annotations

import gc
import os
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest
from transfer_peer import PeerProcess, write_bytes  # noqa: E402

import jaxbuf
from jaxbuf.transfer import KVEndpoint, KVLayout, _wire
from jaxbuf.transfer._local import host_identity

MiB = 1 << 20
BLOCK = 64 * 1024
CAPACITY = 16 * MiB
SEGMENTS = 2

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda:0", id="cuda", marks=pytest.mark.gpu),
]


def _to_host(view, device: str) -> np.ndarray:
    if device == "cpu":
        return view.to_numpy()
    return view.to_torch().cpu().numpy()


def _fill(tensor, device: str, segment: int, start: int, data: np.ndarray) -> None:
    write_bytes(tensor, device, segment, start, data.tobytes())


class Side:
    """One buffer and the model of its bytes (per segment, its committed prefix)."""

    def __init__(self, committed: int) -> None:
        self.model = [np.zeros(committed, np.uint8) for _ in range(SEGMENTS)]

    def grow(self, size: int) -> None:
        self.model = [
            np.concatenate([m[:size], np.zeros(max(size - len(m), 0), np.uint8)])
            for m in self.model
        ]

    @property
    def blocks(self) -> int:
        return len(self.model[0]) // BLOCK


@pytest.fixture
def pair(request):
    device = getattr(request, "param", "cpu")
    peer = PeerProcess("peer", CAPACITY, SEGMENTS, BLOCK, device, transport="local")
    tensor = jaxbuf.ExtensibleTensor(CAPACITY, device, num_segments=SEGMENTS)
    tensor.resize_per_segment_(MiB, zero_new=True)
    endpoint = KVEndpoint("here", tensor, KVLayout(BLOCK), transport="local")
    try:
        yield device, peer, tensor, endpoint
    finally:
        endpoint.close()
        tensor.free()
        peer.stop()


def _sync_both(peer, endpoint) -> None:
    endpoint.connect(peer("metadata"))
    peer("connect", endpoint.metadata())


@pytest.mark.parametrize("pair", DEVICES, indirect=True)
@pytest.mark.parametrize("seed", [0, 1])
def test_model_of_both_buffers_through_grows_releases_and_defragments(pair, seed):
    """Random steps against a numpy model; every byte of both sides checked after each."""
    device, peer, tensor, endpoint = pair
    rng = random.Random(seed)
    here, there = Side(MiB), Side(0)
    peer("recommit", MiB)
    there.grow(MiB)
    _sync_both(peer, endpoint)
    assert endpoint.peers["peer"].transport == "local"
    assert peer("transport", "here") == "local"
    for step in range(40):
        action = rng.choice(
            ["write", "read", "peer_write", "grow_here", "grow_there", "release_there",
             "defragment_here", "defragment_there", "release_here"]
        )  # fmt: skip
        if action in ("write", "read", "peer_write"):
            count = rng.randint(1, min(here.blocks, there.blocks, 24))
            mine = rng.sample(range(here.blocks), count)
            theirs = rng.sample(range(there.blocks), count)
            segment = rng.randrange(SEGMENTS)
            segments = [segment] if rng.random() < 0.5 else None
            chosen = [segment] if segments else list(range(SEGMENTS))
            if action == "write":
                for s in chosen:
                    for b in mine:
                        data = np.random.default_rng(step * 100 + b).integers(
                            0, 256, BLOCK, dtype=np.uint8
                        )
                        _fill(tensor, device, s, b * BLOCK, data)
                        here.model[s][b * BLOCK : (b + 1) * BLOCK] = data
                endpoint.write("peer", mine, theirs, segments=segments).wait(30)
                for s in chosen:
                    for a, b in zip(mine, theirs):
                        there.model[s][b * BLOCK : (b + 1) * BLOCK] = here.model[s][
                            a * BLOCK : (a + 1) * BLOCK
                        ]
            elif action == "read":
                endpoint.read("peer", mine, theirs, segments=segments).wait(30)
                for s in chosen:
                    for a, b in zip(mine, theirs):
                        here.model[s][a * BLOCK : (a + 1) * BLOCK] = there.model[s][
                            b * BLOCK : (b + 1) * BLOCK
                        ]
            else:  # the peer writes into this side through its own link
                for s in range(SEGMENTS):
                    data = np.random.default_rng(step).integers(0, 256, BLOCK, dtype=np.uint8)
                    peer("write_bytes", s, theirs[0] * BLOCK, data.tobytes())
                    there.model[s][theirs[0] * BLOCK : (theirs[0] + 1) * BLOCK] = data
                peer("write", "here", theirs[:1], mine[:1])
                for s in range(SEGMENTS):
                    a, b = mine[0], theirs[0]
                    here.model[s][a * BLOCK : (a + 1) * BLOCK] = there.model[s][
                        b * BLOCK : (b + 1) * BLOCK
                    ]
        elif action == "grow_here":
            # Small grows as a KV cache makes them: most stay inside the mapped chunk.
            size = min(len(here.model[0]) + BLOCK * rng.choice([1, 2, 8, 40]), CAPACITY // 2)
            tensor.resize_per_segment_(size, zero_new=True)
            here.grow(size)
            peer("connect", endpoint.metadata())
        elif action == "grow_there":
            size = min(len(there.model[0]) + BLOCK * rng.choice([1, 2, 8, 40]), CAPACITY // 2)
            peer("recommit", size)
            there.grow(size)
            endpoint.connect(peer("metadata"))
        elif action == "release_here":
            size = len(here.model[0])
            tensor.release_physical()
            tensor.resize_per_segment_(size, zero_new=True)
            here.model = [np.zeros(size, np.uint8) for _ in range(SEGMENTS)]
            peer("connect", endpoint.metadata())
        elif action == "release_there":
            size = len(there.model[0])
            peer("release")
            peer("recommit", size)
            there.model = [np.zeros(size, np.uint8) for _ in range(SEGMENTS)]
            endpoint.connect(peer("metadata"))
        elif action == "defragment_here":
            tensor.defragment()
            peer("connect", endpoint.metadata())
        else:
            peer("defragment")
            endpoint.connect(peer("metadata"))
        for s in range(SEGMENTS):
            got = _to_host(tensor.segment_view(s), device)
            np.testing.assert_array_equal(got, here.model[s], err_msg=f"here, {action} {step}")
            theirs_now = np.frombuffer(peer("read", s, 0, len(there.model[s])), np.uint8)
            np.testing.assert_array_equal(theirs_now, there.model[s], err_msg=f"there, {action}")
    if device != "cpu":  # lists of more than a few blocks went through the copy kernel
        assert endpoint.copier.kernel_unavailable is None


def test_growth_inside_a_mapped_chunk_is_learned(pair):
    """1 MiB -> 1.5 MiB inside one 2 MiB chunk: the new blocks are reachable at once."""
    device, peer, tensor, endpoint = pair
    peer("recommit", MiB)
    endpoint.connect(peer("metadata"))
    with pytest.raises(IndexError, match="peer's block 20 is out of range"):
        endpoint.write("peer", [0], [20])
    peer("recommit", 3 * MiB // 2)
    endpoint.connect(peer("metadata"))
    data = np.full(BLOCK, 9, np.uint8)
    _fill(tensor, device, 0, 0, data)
    endpoint.write("peer", [0], [20], segments=[0]).wait(30)
    assert peer("read", 0, 20 * BLOCK, 4) == b"\x09" * 4


def test_notifications_follow_the_bytes(pair):
    device, peer, tensor, endpoint = pair
    peer("recommit", MiB)
    _sync_both(peer, endpoint)
    _fill(tensor, device, 1, 3 * BLOCK, np.full(BLOCK, 5, np.uint8))
    endpoint.write("peer", [3], [4], segments=[1], notification=b"done").wait(30)
    peer("wait_notification", "here", b"done")
    assert peer("read", 1, 4 * BLOCK, 2) == b"\x05\x05"
    peer("write", "here", [4], [6], b"back")
    endpoint.wait_notification("peer", b"back", 30)
    assert _to_host(tensor.segment_view(1), device)[6 * BLOCK] == 5
    endpoint.notify("peer", b"alone")
    peer("wait_notification", "here", b"alone")


def _encode_with(layout: _wire.RemoteLayout, **changes) -> bytes:
    import dataclasses

    return _wire.encode(dataclasses.replace(layout, **changes))


def test_an_impostor_message_is_refused_and_changes_nothing(pair):
    """A message naming 'evil' but pointing at the peer's socket: refused (the socket serves
    'peer'), and the live link to the peer still moves bytes."""
    device, peer, tensor, endpoint = pair
    peer("recommit", MiB)
    endpoint.connect(peer("metadata"))
    genuine = _wire.decode(peer("metadata"))
    with pytest.raises(ValueError, match="serves endpoint 'peer'"):
        endpoint.connect(_encode_with(genuine, agent="evil"))
    assert sorted(endpoint.peers) == ["peer"]
    # The same name with another address: a known peer's address never changes.
    moved = _encode_with(
        genuine,
        epoch=genuine.epoch + 10,
        local=_wire.LocalAddress(genuine.local.boot_id, genuine.local.uid, "jaxbuf-nowhere"),
    )
    with pytest.raises(ValueError, match="address changed"):
        endpoint.connect(moved)
    endpoint.write("peer", [1], [2]).wait(30)  # the link is intact


@pytest.mark.parametrize(
    "change, message",
    [
        ({"boot_id": "0" * 36}, "another host"),
        ({"uid": os.geteuid() + 1}, "runs as uid"),
        ({"address": "jaxbuf-no-such-socket"}, "unreachable"),
    ],
)
def test_a_peer_off_this_host_or_user_is_refused_with_transport_local(pair, change, message):
    device, peer, tensor, endpoint = pair
    genuine = _wire.decode(peer("metadata"))
    import dataclasses

    local = dataclasses.replace(genuine.local, **change)
    with pytest.raises(ValueError, match=message):
        endpoint.connect(_encode_with(genuine, local=local))
    assert endpoint.peers == {}


def _threads_fds_maps() -> tuple[int, int, int]:
    """Threads, open descriptors, and mappings of chunk memfds or of a reservation's size
    (glibc keeps stacks and arenas of joined threads mapped: those are not counted), once
    garbage in reference cycles is collected."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        mappings = 0
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            mappings += "memfd:" in line or end - start == CAPACITY
    return threading.active_count(), len(os.listdir("/proc/self/fd")), mappings


def test_nothing_leaks_across_connect_transfer_and_close():
    peer = PeerProcess("leak-peer", CAPACITY, SEGMENTS, BLOCK, "cpu", transport="local")
    try:
        peer("recommit", MiB)
        before = None
        for round_ in range(4):
            name = f"leak-here-{round_}"  # a peer never takes back a name it has seen
            tensor = jaxbuf.ExtensibleTensor(CAPACITY, "cpu", num_segments=SEGMENTS)
            tensor.resize_per_segment_(MiB)
            endpoint = KVEndpoint(name, tensor, KVLayout(BLOCK), transport="local")
            endpoint.connect(peer("metadata"))
            peer("connect", endpoint.metadata())
            endpoint.write("leak-peer", list(range(8)), list(range(8))).wait(30)
            peer("write", name, [1], [2])
            tensor.resize_per_segment_(3 * MiB)
            peer("connect", endpoint.metadata())
            endpoint.close()
            tensor.free()
            if before is None:  # after one round: modules and caches loaded on first use
                before = _threads_fds_maps()
        time.sleep(0.1)
        threads, fds, mappings = _threads_fds_maps()
        assert (threads, fds) == before[:2]
        # The CPU driver may hold an unmapped range in quarantine for a while: the count may
        # fall below the first round's, never climb above it (three rounds would leak three).
        assert mappings <= before[2]
    finally:
        peer.stop()


def test_hostile_frames_close_that_connection_only(pair):
    """Garbage, an oversized frame and a frame before hello each cost the sender its
    connection; the server goes on serving the genuine peer."""
    device, peer, tensor, endpoint = pair
    address = _wire.decode(endpoint.metadata()).local.address
    payloads = [
        b"\x00" * 64,
        struct.pack("!cQI", b"H", 0, 5) + b"hello" + struct.pack("!cQI", b"N", 0, 1 << 30),
        struct.pack("!cQI", b"L", 1, 0),
        struct.pack("!cQI", b"H", 0, 1) + b"x" + struct.pack("!cQI", b"Z", 0, 0),
    ]
    for payload in payloads:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hostile:
            hostile.settimeout(10)
            hostile.connect("\0" + address)
            hostile.sendall(payload)
            assert hostile.recv(16) == b""  # closed by the server
    peer("recommit", MiB)
    peer("connect", endpoint.metadata())
    peer("write", "here", [0], [1])


def test_transport_choice_is_validated_and_explicit():
    tensor = jaxbuf.ExtensibleTensor(4 * MiB, "cpu")
    try:
        with pytest.raises(ValueError, match="transport must be one of"):
            KVEndpoint("x", tensor, KVLayout(BLOCK), transport="tcp")
        with pytest.raises(ValueError, match="needs a jaxbuf.transfer.Agent"):
            KVEndpoint("x", tensor, KVLayout(BLOCK), transport="nixl")
        with pytest.raises(TypeError, match="agent must be"):
            KVEndpoint(object(), tensor, KVLayout(BLOCK))
        assert host_identity()[1] == os.geteuid()
    finally:
        tensor.free()


def test_copy_kernel_against_numpy():
    """The block-copy kernel under Triton's interpreter, over a column table of copies longer
    and shorter than a piece (cut on the device), lands where a numpy model says."""
    pytest.importorskip("triton")
    from jaxbuf.kernels.block_copy import PIECE_BYTES, copy_interpreted

    rng = np.random.default_rng(7)
    slot = 3 * PIECE_BYTES
    source = rng.integers(0, 256, 16 * slot, dtype=np.uint8)
    target = np.zeros(16 * slot, np.uint8)
    model = target.copy()
    starts = rng.permutation(16)[:6] * slot  # disjoint slots, each room for 3 pieces
    reads = rng.permutation(16)[:6] * slot
    sizes = rng.integers(1, slot // 8 + 1, len(starts)) * 8
    sizes[0] = slot  # exactly three pieces
    for to, at, size in zip(starts, reads, sizes):
        model[to : to + size] = source[at : at + size]
    table = np.concatenate([target.ctypes.data + starts, source.ctypes.data + reads, sizes]).astype(
        np.uint64
    )
    copy_interpreted(table.ctypes.data, len(sizes), int(sizes.max()))
    np.testing.assert_array_equal(target, model)


def _two_gpu_reason() -> str | None:
    from jaxbuf.drivers import cuda_unavailable_reason, get_vmm_driver

    if cuda_unavailable_reason() is not None:
        return f"needs 2 CUDA devices: {cuda_unavailable_reason()}"
    count = get_vmm_driver("cuda").device_count()
    return None if count >= 2 else f"needs 2 CUDA devices, found {count}"


@pytest.mark.multigpu
def test_two_gpus_of_one_host_map_each_other_with_peer_access():
    """Prefill on cuda:1 in another process, decode on cuda:0 here: the import is mapped with
    access for cuda:0 (peer access), and blocks move both ways through it."""
    reason = _two_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    peer = PeerProcess("gpu1", CAPACITY, SEGMENTS, BLOCK, "cuda:1", transport="local")
    tensor = jaxbuf.ExtensibleTensor(CAPACITY, "cuda:0", num_segments=SEGMENTS)
    endpoint = KVEndpoint("gpu0", tensor, KVLayout(BLOCK), transport="local")
    try:
        tensor.resize_per_segment_(MiB, zero_new=True)
        peer("recommit", MiB)
        _sync_both(peer, endpoint)
        data = np.arange(BLOCK, dtype=np.uint8)
        _fill(tensor, "cuda:0", 0, 2 * BLOCK, data)
        blocks = list(range(12))  # more than a few: the copy kernel on cuda:0
        endpoint.write("gpu1", blocks, blocks[::-1], segments=[0]).wait(30)
        assert peer("read", 0, 9 * BLOCK, BLOCK) == data.tobytes()
        peer("write", "gpu0", [9], [5])
        got = _to_host(tensor.segment_view(0), "cuda:0")[5 * BLOCK : 6 * BLOCK]
        np.testing.assert_array_equal(got, data)
    finally:
        endpoint.close()
        tensor.free()
        peer.stop()


def test_a_buffer_that_cannot_be_served_falls_back_or_says_why():
    """A driver that cannot export a chunk (on the CPU without CAP_SYS_ADMIN): "local"
    raises naming the reason, "auto" offers a message without a same-host address."""
    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.testing import FaultInjectingDriver

    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    tensor = jaxbuf.ExtensibleTensor(CAPACITY, "cpu", driver=driver)
    tensor.resize_per_segment_(MiB)
    local = KVEndpoint("refused", tensor, KVLayout(BLOCK), transport="local")
    auto = KVEndpoint("fallback", tensor, KVLayout(BLOCK), transport="auto")
    try:
        driver.fail_on("export_handle", 1, PermissionError("EPERM: no CAP_SYS_ADMIN"))
        with pytest.raises(RuntimeError, match="cannot be served.*CAP_SYS_ADMIN"):
            local.metadata()
        driver.fail_on("export_handle", 1, PermissionError("EPERM: no CAP_SYS_ADMIN"))
        assert _wire.decode(auto.metadata()).local is None
        assert _wire.decode(auto.metadata()).local is not None  # the driver works again
    finally:
        local.close()
        auto.close()
        tensor.free()
