"""NIXL transfers of growing buffers, on the CPU over UCX: two real processes move KV blocks
while either side grows, releases, recommits and defragments; registrations follow the
memory (nothing registered over unmapped memory, only new chunks registered on a grow); a
hostile or stale peer's metadata is refused; driver faults and NIXL errors at each step
leave everything consistent; nothing leaks (registrations, descriptor lists, handles)."""

from __future__ import annotations

import numpy as np
import pytest

import jaxbuf
from jaxbuf.testing import FaultInjectingDriver

nixl = pytest.importorskip("jaxbuf.transfer")
try:
    nixl.load_nixl()
except nixl.NixlUnavailable as error:  # pragma: no cover - the CI image installs it
    pytest.skip(f"NIXL is not installed: {error}", allow_module_level=True)

from transfer_peer import PeerProcess  # noqa: E402

from jaxbuf.drivers import get_vmm_driver  # noqa: E402
from jaxbuf.transfer import (  # noqa: E402
    Agent,
    KVEndpoint,
    KVLayout,
    Registration,
    TransferError,
    TransferInFlight,
    _wire,  # noqa: E402
)

MiB = 1 << 20
BLOCK = 768 * 1024  # does not divide the 2 MiB chunk: some blocks span two registrations


def pattern(size: int, seed: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def registered_inside_mapped(registration: Registration, tensor) -> bool:
    """Every registered byte lies in a mapped chunk (nothing over unmapped memory)."""
    chunks = tensor.mapped_chunks() if not tensor.released and tensor.base_ptr else []
    for start, nbytes in registration.registered_ranges():
        if not any(o <= start and start + nbytes <= o + n for o, n in chunks):
            return False
    return True


class CountingAgent(Agent):
    """A real agent that can fail chosen calls (``fail[name] = n``: the n-th next call of
    ``name`` raises) and logs registrations."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.fail: dict[str, int] = {}
        self.registered: list[list[tuple[int, int]]] = []
        self.stuck = False

    def _maybe_fail(self, call: str) -> None:
        if call in self.fail:
            self.fail[call] -= 1
            if self.fail[call] <= 0:
                del self.fail[call]
                raise RuntimeError(f"injected NIXL failure in {call}")

    def register(self, regions, mem_type, device_id):
        self._maybe_fail("register")
        self.registered.append(list(regions))
        return super().register(regions, mem_type, device_id)

    def deregister(self, handle):
        self._maybe_fail("deregister")
        return super().deregister(handle)

    def prep_dlist(self, agent_name, descs, mem_type):
        self._maybe_fail("prep_dlist")
        return super().prep_dlist(agent_name, descs, mem_type)

    def make_prepped(self, *args):
        self._maybe_fail("make_prepped")
        return super().make_prepped(*args)

    def post(self, handle, notification):
        self._maybe_fail("post")
        return super().post(handle, notification)

    def state(self, handle):
        if self.stuck:
            return "PROC"
        if self.fail.get("state_err"):
            del self.fail["state_err"]
            return "ERR"
        return super().state(handle)


@pytest.fixture(scope="module")
def peer():
    process = PeerProcess("peer", 64 * MiB, 2, BLOCK)
    yield process
    registrations, dlists = process.stop()
    assert (registrations, dlists) == (0, 0)


@pytest.fixture
def local():
    """A local endpoint over a fresh buffer (agent names unique per test)."""
    made = []

    def make(capacity=64 * MiB, driver=None, agent=None, **kwargs):
        tensor = jaxbuf.ExtensibleTensor(capacity, "cpu", num_segments=2, driver=driver)
        agent = agent or CountingAgent(f"local{len(made)}-{id(made)}")
        kwargs.setdefault("transport", "nixl")  # these tests are of the NIXL path
        endpoint = KVEndpoint(agent, tensor, KVLayout(BLOCK), **kwargs)
        made.append((endpoint, tensor, agent))
        return endpoint, tensor, agent

    yield make
    for endpoint, tensor, agent in made:
        agent.fail.clear()
        agent.stuck = False
        endpoint.close()
        tensor.free()
        assert (agent.live_registrations, agent.live_dlists, agent.live_transfers) == (0, 0, 0)


def connect(endpoint, peer):
    remote = endpoint.connect(peer("metadata"))
    peer("connect", endpoint.metadata())
    return remote


# -- two processes --------------------------------------------------------------------------
def test_blocks_move_both_ways_while_both_sides_grow(peer, local):
    endpoint, tensor, agent = local()
    tensor.resize_per_segment_(3 * MiB)
    peer("grow", 3 * MiB)
    remote = connect(endpoint, peer)
    segment0 = tensor.segment_view(0).to_numpy()
    segment0[:] = pattern(segment0.size, 1)
    endpoint.write(remote, [0, 1, 2], [3, 0, 1]).wait(30)
    assert peer("read", 0, 3 * BLOCK, BLOCK) == segment0[:BLOCK].tobytes()
    assert peer("read", 0, 0, 2 * BLOCK) == segment0[BLOCK : 3 * BLOCK].tobytes()

    # Both grow; blocks 2 and 5 span a chunk boundary (growth) on each side.
    peer("grow", 9 * MiB)
    tensor.resize_per_segment_(9 * MiB)
    remote = endpoint.connect(peer("metadata"))
    peer("connect", endpoint.metadata())
    segment1 = tensor.segment_view(1).to_numpy()
    segment1[:] = pattern(segment1.size, 2)
    blocks = [2, 5, 10, 11]
    endpoint.write(remote, blocks, [11, 10, 5, 2], notification=b"grown").wait(30)
    peer("wait_notification", endpoint.agent.name, b"grown")
    for lb, rb in zip(blocks, [11, 10, 5, 2]):
        expected = segment1[lb * BLOCK : (lb + 1) * BLOCK].tobytes()
        assert peer("read", 1, rb * BLOCK, BLOCK) == expected, (lb, rb)

    # The peer writes back into this side (its blocks pattern), and we READ from it too.
    peer("fill", 0, 5)
    endpoint.read(remote, [7, 8], [0, 11], segments=[0]).wait(30)
    mine = tensor.segment_view(0).to_numpy()
    assert mine[7 * BLOCK : 8 * BLOCK].tobytes() == peer("read", 0, 0, BLOCK)
    assert mine[8 * BLOCK : 9 * BLOCK].tobytes() == peer("read", 0, 11 * BLOCK, BLOCK)
    peer("write", endpoint.agent.name, [1], [4])
    assert mine[4 * BLOCK : 5 * BLOCK].tobytes() == peer("read", 0, BLOCK, BLOCK)


def test_release_recommit_and_defragment_keep_transfers_correct(peer, local):
    endpoint, tensor, agent = local()
    for size in (2 * MiB, 4 * MiB, 6 * MiB):  # three chunks per segment
        tensor.resize_per_segment_(size)
    peer("grow", 9 * MiB)
    remote = connect(endpoint, peer)
    assert endpoint.registration.num_registrations == 6
    assert tensor.defragment() == [0, 1]
    assert endpoint.registration.num_registrations == 2
    assert registered_inside_mapped(endpoint.registration, tensor)
    data = tensor.segment_view(0).to_numpy()
    data[:] = pattern(data.size, 3)
    # After defragment every block of a segment is in one registration: the prepared path.
    endpoint.write(remote, list(range(7)), list(range(7)), segments=[0]).wait(30)
    assert peer("read", 0, 0, 7 * BLOCK) == data[: 7 * BLOCK].tobytes()

    tensor.release_physical()
    assert endpoint.registration.registered_ranges() == []
    with pytest.raises(IndexError, match="local block 0 is out of range"):
        endpoint.write(remote, [0], [0])
    tensor.resize_per_segment_(4 * MiB)  # recommit registers again
    assert endpoint.registration.num_registrations == 2
    assert registered_inside_mapped(endpoint.registration, tensor)
    peer("connect", endpoint.metadata())
    peer("fill", 1, 9)
    peer("write", agent.name, [0, 3], [4, 1])
    mine = tensor.segment_view(1).to_numpy()
    assert mine[4 * BLOCK : 5 * BLOCK].tobytes() == peer("read", 1, 0, BLOCK)
    assert mine[BLOCK : 2 * BLOCK].tobytes() == peer("read", 1, 3 * BLOCK, BLOCK)


def test_peer_release_needs_new_metadata_and_old_registrations_are_forgotten(local):
    peer = PeerProcess("releasing-peer", 32 * MiB, 2, BLOCK)
    try:
        endpoint, tensor, agent = local()
        tensor.resize_per_segment_(4 * MiB)
        peer("grow", 4 * MiB)
        remote = connect(endpoint, peer)
        old = remote.layout
        peer("release")
        peer("grow", 2 * MiB)
        remote = endpoint.connect(peer("metadata"))
        assert remote.layout.epoch > old.epoch
        with pytest.raises(IndexError, match="block 3 is out of range"):
            endpoint.write(remote, [0], [3])
        endpoint.write(remote, [0, 1], [0, 1]).wait(30)
        assert peer("read", 0, 0, BLOCK) == tensor.segment_view(0).to_numpy()[:BLOCK].tobytes()
        with pytest.raises(ValueError, match="stale metadata"):
            endpoint.connect(_wire.encode(old))
    finally:
        assert peer.stop() == (0, 0)


# -- registrations follow the memory (one process is enough: the agent sees them all) ---------
def test_a_grow_registers_only_the_new_chunks(local):
    endpoint, tensor, agent = local()
    tensor.resize_per_segment_(2 * MiB)
    before = len(agent.registered)
    tensor.resize_per_segment_(4 * MiB)
    assert [len(r) for r in agent.registered[before:]] == [1, 1]
    assert all(size == 2 * MiB for r in agent.registered[before:] for _, size in r)
    tensor.resize_per_segment_(4 * MiB + 1)  # within... no: the next granule is new
    assert len(agent.registered) == before + 4
    assert registered_inside_mapped(endpoint.registration, tensor)


def test_chosen_segments_register_only_their_memory():
    tensor = jaxbuf.ExtensibleTensor(16 * MiB, "cpu", num_segments=2)
    agent = CountingAgent("segments-only")
    try:
        tensor.resize_per_segment_(2 * MiB)
        registration = Registration(agent, tensor, [1])
        assert registration.registered_ranges() == [(8 * MiB, 2 * MiB)]
        tensor.resize_per_segment_(4 * MiB)
        assert registration.registered_ranges() == [(8 * MiB, 2 * MiB), (10 * MiB, 2 * MiB)]
        tensor.free()  # free deregisters, although no export holds the memory now
        assert agent.live_registrations == 0
        registration.close()
    finally:
        tensor.free()


def test_free_with_live_exports_deregisters_at_once(local):
    endpoint, tensor, agent = local()
    tensor.resize_per_segment_(2 * MiB)
    array = tensor.segment_view(0).to_numpy()
    tensor.free()
    assert agent.live_registrations == 0 and endpoint.registration.registered_ranges() == []
    del array


def test_release_waits_for_a_transfer_in_flight_then_refuses(local):
    endpoint, tensor, agent = local(release_timeout=0.05)
    other, other_tensor, _ = local()
    for t in (tensor, other_tensor):
        t.resize_per_segment_(2 * MiB)
    remote = endpoint.connect(other.metadata())
    transfer = endpoint.write(remote, [0], [1])
    agent.stuck = True
    physical = tensor.physical_bytes
    with pytest.raises(TransferInFlight, match="still in flight"):
        tensor.release_physical()
    with pytest.raises(TransferInFlight):
        tensor.defragment() if tensor.num_physical_chunks > 2 else tensor.free()
    assert tensor.physical_bytes == physical and not tensor.released
    assert registered_inside_mapped(endpoint.registration, tensor)
    with pytest.raises(TimeoutError, match="WRITE of blocks \\[0\\]"):
        transfer.wait(0.01)
    agent.stuck = False
    transfer.wait(5)
    tensor.release_physical()  # nothing in flight now
    assert endpoint.registration.registered_ranges() == []


# -- faults: driver and NIXL ----------------------------------------------------------------
def test_driver_faults_leave_registrations_matching_the_memory(local):
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    endpoint, tensor, agent = local(driver=driver)
    tensor.resize_per_segment_(2 * MiB)
    before = endpoint.registration.registered_ranges()
    for kind in ("create", "map", "set_access"):
        driver.fail_on(kind)
        with pytest.raises(Exception, match="INJECTED"):
            tensor.resize_per_segment_(6 * MiB)
        assert endpoint.registration.registered_ranges() == before, kind
    tensor.resize_per_segment_(6 * MiB)
    for kind in ("copy", "move_mapping", "set_access"):
        driver.fail_on(kind)
        with pytest.raises(Exception, match="INJECTED"):
            tensor.defragment()
        # Rolled back: the old chunks are back and registered again.
        assert registered_inside_mapped(endpoint.registration, tensor), kind
        assert endpoint.registration.num_registrations == tensor.num_physical_chunks, kind
    assert tensor.defragment() == [0, 1]
    assert endpoint.registration.num_registrations == 2
    driver.check_invariants()
    # The leak check: after close and free nothing is left, in the driver or in NIXL.
    endpoint.close()
    tensor.free()
    driver.assert_clean()
    assert (agent.live_registrations, agent.live_dlists, agent.live_transfers) == (0, 0, 0)


@pytest.mark.parametrize("call", ["register", "deregister"])
def test_nixl_registration_errors_refuse_the_buffer_operation(local, call):
    endpoint, tensor, agent = local()
    tensor.resize_per_segment_(2 * MiB)
    state = (tensor.committed_sizes, tensor.physical_bytes, endpoint.registration.epoch)
    agent.fail[call] = 1
    with pytest.raises(RuntimeError, match=f"injected NIXL failure in {call}"):
        if call == "register":
            tensor.resize_per_segment_(8 * MiB)  # a grow that cannot register is undone
        else:
            tensor.release_physical()  # a release that cannot deregister is refused
    assert (tensor.committed_sizes, tensor.physical_bytes) == state[:2]
    assert registered_inside_mapped(endpoint.registration, tensor)
    assert agent.live_registrations == tensor.num_physical_chunks
    tensor.resize_per_segment_(8 * MiB)
    tensor.release_physical()
    assert agent.live_registrations == 0


@pytest.mark.parametrize("call", ["prep_dlist", "make_prepped", "post", "state_err"])
def test_nixl_transfer_errors_name_the_blocks_and_leak_nothing(local, call):
    endpoint, tensor, agent = local()
    other, other_tensor, _ = local()
    for t in (tensor, other_tensor):
        t.resize_per_segment_(MiB + 512 * 1024)
    remote = endpoint.connect(other.metadata())
    agent.fail[call] = 1
    error = TransferError if call == "state_err" else RuntimeError
    with pytest.raises(error) as caught:
        endpoint.write(remote, [1], [0]).wait(5)
    if call == "state_err":
        assert "WRITE of blocks [1]" in str(caught.value)
    assert agent.live_transfers == 0
    endpoint.write(remote, [1], [0]).wait(5)  # the next transfer works
    assert other_tensor.segment_view(0).to_numpy()[:BLOCK].tobytes() == (
        tensor.segment_view(0).to_numpy()[BLOCK : 2 * BLOCK].tobytes()
    )


# -- hostile metadata -----------------------------------------------------------------------
def _mutations(layout):
    cap = layout.capacity
    yield "epoch", dict(epoch=-1)
    yield "base", dict(base=0)
    yield "aligned", dict(base=layout.base + 8)
    yield "segment", dict(segment_offsets=(0, cap))
    yield "overlaps", dict(segment_offsets=(0, 256), segment_capacities=(cap // 2, cap // 2))
    yield "capacity", dict(committed=(layout.segment_capacities[0] + 1, 0))
    yield "outside", dict(registrations=((cap - 4096, 8192),))
    yield "overlaps", dict(registrations=((0, 8192), (4096, 8192)))
    yield "mem_type", dict(mem_type="FILE")
    yield "block_bytes", dict(block_bytes=0)


def test_hostile_metadata_is_refused_before_nixl_sees_it(local):
    import dataclasses

    endpoint, tensor, agent = local()
    other, other_tensor, _ = local()
    other_tensor.resize_per_segment_(2 * MiB)
    tensor.resize_per_segment_(2 * MiB)
    good = other.remote_layout()
    for match, change in _mutations(good):
        message = _wire.encode(dataclasses.replace(good, **change))
        with pytest.raises(ValueError, match=match):
            endpoint.connect(message)
    assert agent.remote_agents == set()
    for junk in (b"", b"JXKV" + b"\0" * 12, b"XXXX" + bytes(20), _wire.encode(good)[:40]):
        with pytest.raises(ValueError):
            endpoint.connect(junk)
    with pytest.raises(ValueError, match="has blocks of"):
        endpoint.connect(_wire.encode(dataclasses.replace(good, block_bytes=4096)))

    # A peer claiming more committed memory than it registered: the uncovered blocks are
    # refused by name, before any descriptor reaches NIXL.
    lying = dataclasses.replace(good, committed=(4 * MiB, 4 * MiB))
    remote = endpoint.connect(_wire.encode(lying))
    with pytest.raises(ValueError, match="block 3 of segment 0 .* is not all registered"):
        endpoint.write(remote, [0], [3])
    # An update that moves the buffer, or an old epoch, is refused.
    with pytest.raises(ValueError, match="changes base"):
        endpoint.connect(_wire.encode(dataclasses.replace(lying, epoch=99, base=good.base + MiB)))
    with pytest.raises(ValueError, match="stale"):
        endpoint.connect(_wire.encode(lying))


def test_bad_block_lists_are_refused_by_name(local):
    endpoint, tensor, agent = local()
    other, other_tensor, _ = local()
    for t in (tensor, other_tensor):
        t.resize_per_segment_(2 * MiB)
    remote = endpoint.connect(other.metadata())
    with pytest.raises(IndexError, match="local block 2 is out of range"):
        endpoint.write(remote, [2], [0])
    with pytest.raises(IndexError, match="block -1 is out of range"):
        endpoint.write(remote, [0], [-1])
    with pytest.raises(ValueError, match="pair up"):
        endpoint.write(remote, [0, 1], [0])
    with pytest.raises(TypeError, match="integer block ids"):
        endpoint.write(remote, [0.5], [0])
    with pytest.raises(ValueError, match="not a connected peer"):
        endpoint.write("nobody", [0], [0])
    with pytest.raises(IndexError, match="not in the layout"):
        endpoint.write(remote, [0], [0], segments=[5])
    assert agent.live_transfers == 0


# -- received blocks are arrays --------------------------------------------------------------
def test_received_blocks_are_zero_copy_arrays(local):
    endpoint, tensor, agent = local()
    other, other_tensor, _ = local()
    for t in (tensor, other_tensor):
        t.resize_per_segment_(3 * MiB)
    remote = endpoint.connect(other.metadata())
    source = tensor.segment_view(1).to_numpy()
    source[:] = pattern(source.size, 4)
    endpoint.write(remote, [1, 2], [0, 1], segments=[1]).wait(5)
    view = other.block_view(1, 0, 2)
    assert view.ptr == other_tensor.segment_view(1).ptr
    as_numpy = view.to_numpy()
    np.testing.assert_array_equal(as_numpy, source[BLOCK : 3 * BLOCK])
    jnp = pytest.importorskip("jax.numpy")
    as_jax = view.view("float32", (2, BLOCK // 4)).to_jax()
    assert as_jax.unsafe_buffer_pointer() == view.ptr
    np.testing.assert_array_equal(
        np.asarray(as_jax).view(np.uint8).ravel(), source[BLOCK : 3 * BLOCK]
    )
    assert jnp.sum(as_jax).dtype == jnp.float32
    with pytest.raises(IndexError, match="outside the 4 committed"):
        other.block_view(1, 3, 2)
