"""A whole KV cache as one side of block transfers (:class:`jaxbuf.transfer.KVCacheEndpoint`):
two real processes move blocks of a multi-tensor cache (blocks outermost, K/V planes and
layer-compact tensors, each with its own block size) by block id, on the same-host
transport, while either cache commits, releases, recommits and defragments; a numpy model of
every block of both caches is checked after every step. NIXL takes the same steps where it is
installed."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from transfer_peer import CachePeerProcess  # noqa: E402

import jaxbuf
from jaxbuf.transfer import KVCacheEndpoint, KVEndpoint, KVLayout

KiB, MiB = 1 << 10, 1 << 20
CAPACITY = 64  # blocks
# (num_segments, bytes_per_block_per_segment): K and V planes of 4 MiB each; one tensor
# whose blocks are outermost; a layer-compact tensor of four layers. Every segment is a
# whole number of 2 MiB granules, so the cache can be defragmented.
TENSORS = [(2, 64 * KiB), (1, 32 * KiB), (4, 32 * KiB)]


class Model:
    """Every block of every segment of every tensor of one cache, and its committed count."""

    def __init__(self) -> None:
        self.blocks = [np.zeros((s, CAPACITY, b), np.uint8) for s, b in TENSORS]
        self.committed = 1

    def commit(self, n: int) -> None:
        if n > self.committed:
            for planes in self.blocks:
                planes[:, self.committed : n] = 0
            self.committed = n

    def wipe(self) -> None:
        for planes in self.blocks:
            planes[:] = 0


def _cache():
    builder = jaxbuf.ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    for num_segments, block_bytes in TENSORS:
        builder.reserve(CAPACITY * num_segments * block_bytes, num_segments)
    return builder.finish()


def _block(cache, tensor: int, segment: int, block: int) -> np.ndarray:
    return cache.segment_views(tensor)[segment].to_numpy()[block]


def _check(cache, peer, here: Model, there: Model, what: str) -> None:
    assert cache.num_blocks_committed == here.committed, what
    assert peer("committed") == there.committed, what
    for t, (num_segments, _) in enumerate(TENSORS):
        for s in range(num_segments):
            for b in range(here.committed):
                np.testing.assert_array_equal(
                    _block(cache, t, s, b), here.blocks[t][s, b], err_msg=f"here {t}/{s}/{b} {what}"
                )
    for t, ((num_segments, size), data) in enumerate(zip(TENSORS, peer("dump"))):
        got = np.frombuffer(data, np.uint8).reshape(num_segments, there.committed, size)
        np.testing.assert_array_equal(
            got, there.blocks[t][:, : there.committed], err_msg=f"there {t} {what}"
        )


def _fill(cache, model: Model, blocks, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t, (num_segments, size) in enumerate(TENSORS):
        for s in range(num_segments):
            for b in blocks:
                data = rng.integers(0, 256, size, dtype=np.uint8)
                _block(cache, t, s, b)[:] = data
                model.blocks[t][s, b] = data


def _copy(src: Model, dst: Model, src_blocks, dst_blocks) -> None:
    for t in range(len(TENSORS)):
        dst.blocks[t][:, list(dst_blocks)] = src.blocks[t][:, list(src_blocks)]


@pytest.fixture
def caches():
    peer = CachePeerProcess("peer", CAPACITY, TENSORS, transport="local")
    cache = _cache()
    endpoint = KVCacheEndpoint("here", cache, transport="local")
    try:
        yield peer, cache, endpoint
    finally:
        endpoint.close()
        cache.free()
        peer.stop()


def _exchange(peer, endpoint) -> None:
    endpoint.connect(peer("metadata"))
    peer("connect", endpoint.metadata())


def _run_model(peer, cache, endpoint, seed: int, transport: str) -> None:
    rng = random.Random(seed)
    here, there = Model(), Model()
    # After warmup: the peer defragments as it grows (RDMA registration), this side not.
    peer("commit", 4, True)
    there.commit(4)
    cache.commit(8)
    here.commit(8)
    _exchange(peer, endpoint)
    assert endpoint.peers["peer"].transport == transport
    assert peer("connect", endpoint.metadata()) == transport
    _check(cache, peer, here, there, "start")
    for step in range(30):
        action = rng.choice(
            ["write", "write", "read", "peer_write", "grow_here", "grow_there",
             "release_there", "release_here"]
        )  # fmt: skip
        if action in ("write", "read", "peer_write"):
            count = rng.randint(1, min(here.committed, there.committed, 6))
            mine = rng.sample(range(here.committed), count)
            theirs = rng.sample(range(there.committed), count)
            if action == "write":
                _fill(cache, here, mine, step)
                endpoint.write("peer", mine, theirs).wait(30)
                _copy(here, there, mine, theirs)
            elif action == "read":
                endpoint.read("peer", mine, theirs).wait(30)
                _copy(there, here, theirs, mine)
            else:  # the peer writes its blocks into this cache and says so
                peer("write", "here", theirs, mine, b"step%d" % step)
                endpoint.wait_notification("peer", b"step%d" % step, 30)
                _copy(there, here, theirs, mine)
        elif action == "grow_here":  # a commit across chunks of the larger tensors
            n = min(here.committed + rng.choice([1, 8, 24]), CAPACITY)
            cache.commit(n)
            here.commit(n)
            peer("connect", endpoint.metadata())
        elif action == "grow_there":
            n = min(there.committed + rng.choice([1, 8, 24]), CAPACITY)
            peer("commit", n)
            there.commit(n)
            endpoint.connect(peer("metadata"))
        elif action == "release_there":
            peer("release")
            endpoint.connect(peer("metadata"))
            with pytest.raises(RuntimeError, match="IndexError"):
                peer("write", "here", [0], [0])  # nothing of the peer is mapped
            with pytest.raises(IndexError, match="peer's block 0 is out of range"):
                endpoint.write("peer", [0], [0])
            peer("recommit")
            there.wipe()
            endpoint.connect(peer("metadata"))
        else:
            cache.release_physical()
            assert cache.physical_bytes == 0
            peer("connect", endpoint.metadata())
            cache.recommit()
            here.wipe()
            peer("connect", endpoint.metadata())
        _check(cache, peer, here, there, f"{action} at step {step}")


@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_move_in_every_tensor_through_commits_releases_and_recommits(caches, seed):
    peer, cache, endpoint = caches
    _run_model(peer, cache, endpoint, seed, "local")


def test_one_request_moves_the_blocks_of_every_layer(caches):
    """One write of block ids lands in every segment of every tensor; blocks past what the
    peer committed are refused naming them, and nothing moves."""
    peer, cache, endpoint = caches
    cache.commit(10)
    peer("commit", 20)
    _exchange(peer, endpoint)
    here, there = Model(), Model()
    here.commit(10)
    there.commit(20)
    _fill(cache, here, [2, 7], seed=3)
    transfer = endpoint.write("peer", [2, 7], [19, 0], notification=b"kv")
    assert transfer.done and f"in {len(TENSORS)} tensors" in transfer.what  # one transfer
    peer("wait_notification", "here", b"kv")
    _copy(here, there, [2, 7], [19, 0])
    with pytest.raises(IndexError, match="peer's block 20 is out of range"):
        endpoint.write("peer", [1], [20])
    with pytest.raises(IndexError, match="local block 10 is out of range"):
        endpoint.read("peer", [10], [1])
    _check(cache, peer, here, there, "one request")
    # The peer grows inside and across chunks: learned from its metadata.
    peer("commit", CAPACITY)
    endpoint.connect(peer("metadata"))
    endpoint.write("peer", [7], [CAPACITY - 1]).wait(30)
    there.commit(CAPACITY)
    _copy(here, there, [7], [CAPACITY - 1])
    _check(cache, peer, here, there, "after the peer grew")
    assert bytes(endpoint.block_view(2, 3, 7).to_numpy()[:4]) == bytes(here.blocks[2][3, 7, :4])


def test_a_message_of_another_cache_is_refused_and_changes_nothing(caches):
    peer, cache, endpoint = caches
    _exchange(peer, endpoint)
    before = {name: (p.layouts, p.link) for name, p in endpoint.peers.items()}
    other = jaxbuf.ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    other.reserve(CAPACITY * 2 * 64 * KiB, 2)
    other_cache = other.finish()
    try:
        with (
            KVCacheEndpoint("other", other_cache) as lonely,
            pytest.raises(ValueError, match="has 1 tensor"),
        ):
            endpoint.connect(lonely.metadata())
        single = jaxbuf.ExtensibleTensor(4 * MiB, "cpu")
        with (
            KVEndpoint("single", single, KVLayout(64 * KiB)) as plain,
            pytest.raises(ValueError, match="not a KV cache metadata message"),
        ):
            endpoint.connect(plain.metadata())
        single.free()
    finally:
        other_cache.free()
    message = peer("metadata")
    with pytest.raises(ValueError, match="trailing"):
        endpoint.connect(message + b"\0")
    with pytest.raises(ValueError, match="ends inside tensor"):
        endpoint.connect(message[:-1])
    assert {name: (p.layouts, p.link) for name, p in endpoint.peers.items()} == before
    endpoint.connect(message)
    before = {name: (p.layouts, p.link) for name, p in endpoint.peers.items()}
    with pytest.raises(ValueError, match="tensor 0's metadata"):
        endpoint.connect(message)  # stale: the same epoch again
    assert {name: (p.layouts, p.link) for name, p in endpoint.peers.items()} == before
    with pytest.raises(TypeError, match="ExtensibleKVCacheBuffers"):
        KVCacheEndpoint("bad", [cache.tensors[0]])
    with pytest.raises(ValueError, match="not a connected peer"):
        endpoint.write("nobody", [0], [0])


def test_a_cache_with_a_different_block_size_is_refused():
    builder = jaxbuf.ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    for num_segments, block_bytes in TENSORS:
        builder.reserve(CAPACITY * num_segments * block_bytes * 2, num_segments)
    a, b = builder.finish(), _cache()
    try:
        with KVCacheEndpoint("a", a) as ea, KVCacheEndpoint("b", b) as eb:
            with pytest.raises(ValueError, match="tensor 0 has blocks of 131072 bytes"):
                eb.connect(ea.metadata())
            assert eb.peers == {}
    finally:
        a.free()
        b.free()


def test_nixl_moves_the_same_blocks():
    """The model run over NIXL between two processes, where NIXL's UCX works on the CPU."""
    from jaxbuf.transfer import NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as error:
        pytest.skip(f"NIXL is not installed: {error}")
    from jaxbuf.transfer import Agent

    peer = CachePeerProcess("peer", CAPACITY, TENSORS, transport="nixl")
    cache = _cache()
    endpoint = KVCacheEndpoint(Agent("here"), cache, transport="nixl")
    try:
        _run_model(peer, cache, endpoint, 0, "nixl")
    finally:
        endpoint.close()
        cache.free()
        peer.stop()


def test_close_closes_every_tensor_through_an_interrupt_and_finishes_next_time():
    """An interrupt from one tensor's registration close: the others still close, the
    interrupt reaches the caller, and the endpoint stays open until a second close() has
    closed them all."""
    cache = _cache()
    endpoint = KVCacheEndpoint("here", cache, transport="local")
    try:
        endpoint.metadata()  # the control server runs
        first = endpoint.sides[0].registration
        close, interrupts = first.close, [KeyboardInterrupt()]

        def interrupted_close():
            if interrupts:
                raise interrupts.pop()
            close()

        first.close = interrupted_close
        with pytest.raises(KeyboardInterrupt):
            endpoint.close()
        assert not endpoint.closed
        assert all(side.registration.closed for side in endpoint.sides[1:])
        assert not any(t.name.startswith("jaxbuf-control") for t in threading.enumerate())
        endpoint.close()
        assert endpoint.closed and first.closed
        with pytest.raises(RuntimeError, match="KVCacheEndpoint has been closed"):
            endpoint.read("peer", [0], [0])
    finally:
        endpoint.close()
        cache.free()


@pytest.mark.parametrize("blocks", [1, 2, 3, 40])
def test_the_copy_list_of_a_request_matches_a_model(blocks):
    """The same-host link's list of copies for a request, built in Python for a few pairs
    and by numpy beyond: every chosen segment of every tensor, segment after segment, block
    pair after block pair, each at its tensor's block size."""
    from jaxbuf.transfer._transport import Operation, Request

    caches = [_cache(), _cache()]
    try:
        with KVCacheEndpoint("a", caches[0]) as a, KVCacheEndpoint("b", caches[1]) as b:
            for cache in caches:
                cache.commit(CAPACITY)
            link = a.connect(b.metadata()).link
            rng = np.random.default_rng(blocks)
            local = rng.integers(0, CAPACITY, blocks).astype(np.int64)
            remote = rng.integers(0, CAPACITY, blocks).astype(np.int64)
            positions = tuple(tuple(range(len(side.segments))) for side in a.sides)
            request = Request(Operation.WRITE, "b", local, remote, positions, b"")
            here, there, sizes = link._triples(request)
            expected = []
            for t, side in enumerate(a.sides):
                imported = link.imports[t]
                for p in positions[t]:
                    there_start = imported.base_ptr + imported.segment_offsets[link.segments[t][p]]
                    for mine, theirs in zip(local.tolist(), remote.tolist()):
                        expected.append(
                            (
                                side.starts[p] + mine * side.block_bytes,
                                there_start + theirs * side.block_bytes,
                                side.block_bytes,
                            )
                        )
            got = list(zip(here.tolist(), there.tolist(), sizes.tolist()))
            assert got == expected
            assert here.dtype == there.dtype == sizes.dtype == np.uint64
    finally:
        for cache in caches:
            cache.free()
