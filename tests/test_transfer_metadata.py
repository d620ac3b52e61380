"""The KV metadata message against an attacker, and the Unix socket paths peers meet at.

Protocol 2 of :mod:`jaxbuf.transfer._wire`: every bad field is a ``ValueError`` naming it;
decoding costs about the message, whatever it claims; a peer's claims cost memory only as
far as it registered (or as far as a transfer touches); a refused message changes nothing
(no peer forgotten, no descriptor list dropped, no NIXL remote added or removed); growth
inside a mapped chunk is learned. ``listen_unix`` / ``connect_unix`` take paths longer than
``sun_path``."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import stat
import struct
import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxbuf

transfer = pytest.importorskip("jaxbuf.transfer")

from jaxbuf.transfer import _wire  # noqa: E402
from jaxbuf.transfer._blocks import BlockTable  # noqa: E402
from jaxbuf.transfer._wire import LocalAddress, Ranges, RemoteLayout  # noqa: E402

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
BLOCK = 256 * 1024
BOOT_ID = "0123abcd-4567-89ef-0123-456789abcdef"


def nixl_or_skip() -> None:
    try:
        transfer.load_nixl()
    except transfer.NixlUnavailable as error:  # pragma: no cover - the CI image installs it
        pytest.skip(f"NIXL is not installed: {error}")


@pytest.fixture
def endpoints():
    """``make(name, size)``: a NIXL endpoint over a fresh 2-segment buffer with ``size``
    bytes committed per segment; everything is closed and checked for leaks after."""
    nixl_or_skip()
    from jaxbuf.transfer import Agent, KVEndpoint, KVLayout

    made = []

    def make(name: str, size: int = 2 * MiB, capacity: int = 64 * MiB):
        tensor = jaxbuf.ExtensibleTensor(capacity, "cpu", num_segments=2)
        tensor.resize_per_segment_(size)
        agent = Agent(f"{name}-{os.getpid()}-{len(made)}")
        endpoint = KVEndpoint(agent, tensor, KVLayout(BLOCK), transport="nixl")
        made.append((endpoint, tensor, agent))
        return endpoint, tensor

    yield make
    for endpoint, tensor, agent in made:
        endpoint.close()
        tensor.free()
        assert (agent.live_registrations, agent.live_dlists, agent.live_transfers) == (0, 0, 0)
    for _, _, agent in made:
        agent.close()


def fill(tensor, segment: int, seed: int) -> np.ndarray:
    data = tensor.segment_view(segment).to_numpy()
    data[:] = ((np.arange(data.size, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)
    return data


def state_of(endpoint) -> tuple:
    """What a refused message must not change."""
    return (
        {name: (peer.layouts, peer.link) for name, peer in endpoint.peers.items()},
        set(endpoint.agent.remote_agents),
        endpoint.agent.live_dlists,
    )


# -- 1. growth inside a mapped chunk ----------------------------------------------------------
def test_growth_inside_a_mapped_chunk_is_learned(endpoints):
    a, a_tensor = endpoints("grow-a", 2 * MiB)
    b, b_tensor = endpoints("grow-b", 1 * MiB)
    remote = a.connect(b.metadata())
    source = fill(a_tensor, 0, 3)
    a.write(remote, [0], [3]).wait(30)  # a prepared list of b's 4 blocks exists now
    version, epoch = remote.layout.epoch, b.registration.epoch

    b_tensor.resize_per_segment_(MiB + MiB // 2)  # inside the 2 MiB chunk already mapped
    assert b.registration.epoch == epoch  # no registration changed
    remote = a.connect(b.metadata())  # was refused as stale
    assert remote.layout.epoch > version
    assert remote.layout.committed_blocks == (6, 6)
    a.write(remote, [4, 5], [4, 5], segments=[0]).wait(30)  # was an IndexError
    got = b_tensor.segment_view(0).to_numpy()
    assert got[4 * BLOCK : 6 * BLOCK].tobytes() == source[4 * BLOCK : 6 * BLOCK].tobytes()
    # Metadata sent again with nothing changed is accepted too (a no-op defragment).
    assert b_tensor.defragment() == []
    assert a.connect(b.metadata()) is remote


# -- 2. a refused message changes nothing ------------------------------------------------------
def test_a_refused_message_changes_nothing(endpoints):
    a, a_tensor = endpoints("refuse-a")
    b, b_tensor = endpoints("refuse-b")
    c, _ = endpoints("refuse-c")
    remote = a.connect(b.metadata())
    fill(b_tensor, 0, 5)
    a.read(remote, [0], [1], segments=[0]).wait(30)  # b's prepared list exists
    good = remote.layout  # what a knows of b
    newer = dataclasses.replace(good, epoch=good.epoch + 1)
    hostile = {
        # a new agent name carrying b's NIXL metadata: used to forget b
        "evil with b's NIXL metadata": dataclasses.replace(good, agent="evil"),
        # a newer message of b carrying this endpoint's own NIXL metadata: nixlInvalidParam
        "b with a's own NIXL metadata": dataclasses.replace(
            newer, nixl_metadata=a.agent.metadata()
        ),
        "b with c's NIXL metadata": dataclasses.replace(newer, nixl_metadata=c.agent.metadata()),
        "b with junk NIXL metadata": dataclasses.replace(newer, nixl_metadata=b"junk" * 40),
        "b with a truncated name": dataclasses.replace(
            newer, nixl_metadata=good.nixl_metadata[:20]
        ),
        "b without NIXL metadata": dataclasses.replace(newer, nixl_metadata=b""),
        "b, stale": good,
    }
    matches = {
        "b without NIXL metadata": "offers no NIXL metadata",
        "b, stale": "stale",
    }
    before = state_of(a)
    for what, layout in hostile.items():
        with pytest.raises(ValueError, match=matches.get(what, "NIXL metadata")):
            a.connect(_wire.encode(layout))
        assert state_of(a) == before, what
    # b still works, and its next real message is accepted.
    a.read(remote, [1], [2], segments=[0]).wait(30)
    assert (
        a_tensor.segment_view(0).to_numpy()[BLOCK : 2 * BLOCK].tobytes()
        == b_tensor.segment_view(0).to_numpy()[2 * BLOCK : 3 * BLOCK].tobytes()
    )
    b_tensor.resize_per_segment_(4 * MiB)
    assert a.connect(b.metadata()) is remote


def test_a_failed_nixl_load_puts_the_last_metadata_back(endpoints):
    a, _ = endpoints("reload-a")
    b, b_tensor = endpoints("reload-b", 4 * MiB)
    remote = a.connect(b.metadata())
    b_tensor.release_physical()
    b_tensor.resize_per_segment_(2 * MiB)  # drops registrations: a must forget and reload
    message = b.metadata()
    load = a.agent.add_remote

    def failing(metadata):
        if metadata == _wire.decode(message).nixl_metadata:
            raise RuntimeError("injected NIXL failure in add_remote")
        return load(metadata)

    a.agent.add_remote = failing
    with pytest.raises(RuntimeError, match="injected"):
        a.connect(message)
    assert b.agent.name in a.agent.remote_agents and a.peers[b.agent.name] is remote
    del a.agent.add_remote
    assert a.connect(message) is remote
    a.write(remote, [0], [0]).wait(30)


# -- 3. claims cost nothing beyond what is registered ------------------------------------------
def rss() -> int:
    psutil = pytest.importorskip("psutil")
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("claim", ["committed", "registered"])
def test_a_terabyte_claim_costs_megabytes(endpoints, claim):
    a, a_tensor = endpoints(f"claim-a-{claim}")
    b, b_tensor = endpoints(f"claim-b-{claim}")
    good = b.remote_layout()
    # b claims a 2 TiB reservation with 1 TiB committed in each segment; the registrations
    # are the real ones, or one claimed terabyte (NIXL knows only the real ones).
    lying = dataclasses.replace(
        good,
        capacity=2 * TiB + 2 * GiB,
        segment_offsets=(0, TiB + GiB),
        segment_capacities=(TiB, TiB),
        committed=(TiB, TiB),
        registrations=good.registrations if claim == "committed" else ((0, 2 * TiB),),
    )
    message = _wire.encode(lying)
    assert len(message) < 4096
    source = fill(a_tensor, 0, 9)
    before = rss()
    remote = a.connect(message)
    a.write(remote, [0, 1], [0, 1], segments=[0]).wait(30)
    assert rss() - before < 32 * MiB
    got = b_tensor.segment_view(0).to_numpy()[: 2 * BLOCK]
    assert got.tobytes() == source[: 2 * BLOCK].tobytes()
    if claim == "committed":  # block 8 is committed as claimed, but not registered
        with pytest.raises(ValueError, match=r"block 8 of segment 0 .* is not all registered"):
            a.write(remote, [0], [8], segments=[0])
    assert rss() - before < 32 * MiB


def reference_whole(offsets, committed, block_bytes, pieces):
    """Per segment, per committed block: the piece it lies inside, or -1 (brute force)."""
    result = []
    for offset, size in zip(offsets, committed):
        row = []
        for block in range(size // block_bytes):
            start = offset + block * block_bytes
            inside = [
                i for i, (o, n) in enumerate(pieces) if o <= start and start + block_bytes <= o + n
            ]
            row.append(inside[0] if inside else -1)
        result.append(row)
    return result


@pytest.mark.parametrize("seed", range(20))
def test_block_tables_in_runs_match_a_per_block_reference(seed):
    rng = np.random.default_rng(seed)
    block_bytes = int(rng.choice([256, 768, 1024]))
    offsets = [0, 64 * 1024]
    committed = [int(rng.integers(0, 40 * 1024)) for _ in offsets]
    cuts = np.unique(rng.integers(0, 128 * 1024 // 256, size=24) * 256)
    pieces = [(int(o), int(e - o)) for o, e in zip(cuts[:-1], cuts[1:]) if rng.random() < 0.7]
    base = 1 << 40
    table = BlockTable(base, offsets, committed, block_bytes, pieces, 3)
    expected = reference_whole(offsets, committed, block_bytes, pieces)
    rows = 0
    for s, want in enumerate(expected):
        for block, piece in enumerate(want):
            got = table.whole[s][block] if block < len(table.whole[s]) else -1
            assert (got >= 0) == (piece >= 0), (s, block)
            if got >= 0:
                address = base + offsets[s] + block * block_bytes
                assert table.rows[got].tolist() == [address, block_bytes, 3]
                rows += 1
        blocks = np.arange(len(want), dtype=np.int64)
        if len(blocks):
            index = table.prepared_indices(blocks, "local", [s])
            assert (index is None) == (min(want) < 0)
    assert len(table.rows) == rows
    small = BlockTable(base, offsets, committed, block_bytes, pieces, 3, max_rows=0)
    if rows:
        assert not small.prepared and len(small.rows) == 0
        assert small.prepared_indices(np.array([0]), "local", [0]) is None


# -- 4. decoding costs about the message --------------------------------------------------------
def raw(body: dict, segments=(), registrations=(), nixl: bytes = b"", **counts) -> bytes:
    """A protocol-3 message written by hand: any JSON, any arrays, any counts."""
    text = json.dumps(body).encode()
    segments = np.asarray(segments, dtype="<u8").reshape(-1, 3)
    registrations = np.asarray(registrations, dtype="<u8").reshape(-1, 2)
    header = struct.pack(
        "!4sIIII",
        counts.get("magic", b"JXKV"),
        counts.get("protocol", 3),
        counts.get("text_bytes", len(text)),
        counts.get("num_segments", len(segments)),
        counts.get("num_registrations", len(registrations)),
    )
    return header + text + segments.tobytes() + registrations.tobytes() + nixl


GOOD_BODY = {
    "agent": "peer",
    "instance": "0123456789abcdef" * 2,
    "epoch": 1,
    "mem_type": "DRAM",
    "device_id": 0,
    "base": 1 << 30,
    "capacity": 1 << 40,
    "block_bytes": 4096,
}
GOOD_SEGMENTS = [[0, 1 << 39, 1 << 20], [1 << 39, 1 << 39, 0]]
GOOD_REGISTRATIONS = [[0, 1 << 20]]


def peak_of(function, *args) -> int:
    gc.collect()
    tracemalloc.start()
    with contextlib.suppress(ValueError):
        function(*args)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_decoding_a_maximal_message_costs_about_the_message():
    count = _wire._MAX_REGISTRATIONS
    offsets = np.arange(count, dtype=np.uint64) * 8192
    registrations = np.stack([offsets, np.full(count, 4096, dtype=np.uint64)], axis=1)
    num = _wire._MAX_SEGMENTS
    span = (1 << 40) // num
    segments = [[i * span, span, span // 2 + i * 256] for i in range(num)]
    message = raw(GOOD_BODY, segments, registrations, nixl=b"n" * MiB)
    layout = _wire.decode(message)
    assert len(layout.registrations) == count and len(layout.segment_offsets) == num
    assert layout.registrations[5] == (5 * 8192, 4096)
    del layout
    assert peak_of(_wire.decode, message) < 3 * len(message)


@pytest.mark.parametrize(
    "hostile",
    [
        "zero segments",  # 7 MiB of [0, 0, 0]: was 114 MiB of lists
        "zero registrations",
        "overlapping registrations",
    ],
)
def test_decoding_a_hostile_message_costs_about_the_message(hostile):
    if hostile == "zero segments":
        count = 7 * MiB // 24
        message = raw(GOOD_BODY, np.zeros((count, 3)), GOOD_REGISTRATIONS)
        match = "segments"
    else:
        rows = np.zeros((_wire._MAX_REGISTRATIONS, 2), dtype=np.uint64)
        if hostile == "overlapping registrations":
            rows[:, 1] = 4096
        message = raw(GOOD_BODY, GOOD_SEGMENTS, rows)
        match = "registrations"
    with pytest.raises(ValueError, match=match):
        _wire.decode(message)
    assert peak_of(_wire.decode, message) < 3 * len(message)


def test_protocol_1_is_refused_by_name():
    text = json.dumps({**GOOD_BODY, "segments": GOOD_SEGMENTS, "registrations": []}).encode()
    message = struct.pack("!4sIQ", b"JXKV", 1, len(text)) + text + b"nixl"
    with pytest.raises(ValueError, match="metadata protocol 1 is not supported .this is 3"):
        _wire.decode(message)


LOCAL = {"boot_id": BOOT_ID, "uid": 1000, "address": "jaxbuf-kv-1234"}


def bad_bodies():
    """(what the error names, body) for every scalar field."""
    for key, values in {
        "agent": ["", 7, None, ["a"], "x" * 257],
        "epoch": [-1, True, 1.0, "1", 1 << 63, None],
        "mem_type": ["FILE", "dram", 0, None, ["DRAM"]],
        "device_id": [-1, False, 1 << 17, 0.0],
        "capacity": [0, -1, True, 1 << 63, "big"],
        "base": [0, -256, True, 1 << 63, (1 << 63) - (1 << 40), 1.5],
        "block_bytes": [0, -1, True, (1 << 40) + 1],
    }.items():
        for value in values:
            yield key, {**GOOD_BODY, key: value}
    yield "base", {**GOOD_BODY, "base": (1 << 30) + 8}  # not aligned
    yield "not of protocol 3", {**GOOD_BODY, "segments": []}
    yield "local", {**GOOD_BODY, "local": "jaxbuf"}
    yield "local", {**GOOD_BODY, "local": {**LOCAL, "extra": 1}}
    yield "local", {**GOOD_BODY, "local": {"boot_id": BOOT_ID, "uid": 0}}
    for key, values in {
        "boot_id": [
            BOOT_ID.upper(),
            BOOT_ID[:-1],
            BOOT_ID + "\n",
            BOOT_ID.replace("-", "_"),
            7,
            None,
        ],
        "uid": [-1, True, (1 << 32) - 1, "0", 0.0],
        "address": ["", "a" * 101, "with\0nul", "tab\there", "caf\u00e9", 5, None],
    }.items():
        for value in values:
            yield f"local.{key}", {**GOOD_BODY, "local": {**LOCAL, key: value}}


@pytest.mark.parametrize(("field", "body"), list(bad_bodies()))
def test_every_bad_scalar_field_is_refused_by_name(field, body):
    with pytest.raises(ValueError, match=f"'?{field}"):
        _wire.decode(raw(body, GOOD_SEGMENTS, GOOD_REGISTRATIONS, nixl=b"n"))


TOP = (1 << 64) - 1


@pytest.mark.parametrize(
    ("field", "segments", "registrations"),
    [
        ("segments", [], GOOD_REGISTRATIONS),
        ("segments", [[TOP, 1 << 20, 0]], GOOD_REGISTRATIONS),
        ("segments", [[0, 1 << 63, 0]], GOOD_REGISTRATIONS),
        ("segments", [[8, 1 << 20, 0]], GOOD_REGISTRATIONS),
        ("segments", [[0, 0, 0]], GOOD_REGISTRATIONS),
        ("segments", [[1 << 40, 256, 0]], GOOD_REGISTRATIONS),
        ("segments", [[0, 1 << 20, (1 << 20) + 1]], GOOD_REGISTRATIONS),
        ("segments", [[1 << 20, 1 << 20, 0], [0, 1 << 20, 0]], GOOD_REGISTRATIONS),
        ("segments", [[0, 1 << 20, 0], [1 << 19, 1 << 20, 0]], GOOD_REGISTRATIONS),
        ("registrations", GOOD_SEGMENTS, [[0, TOP]]),
        ("registrations", GOOD_SEGMENTS, [[1 << 63, 1]]),
        ("registrations", GOOD_SEGMENTS, [[0, 0]]),
        ("registrations", GOOD_SEGMENTS, [[(1 << 40) - 4096, 8192]]),
        ("registrations", GOOD_SEGMENTS, [[4096, 4096], [0, 4096]]),
        ("registrations", GOOD_SEGMENTS, [[0, 8192], [4096, 4096]]),
    ],
)
def test_every_bad_array_entry_is_refused_by_name(field, segments, registrations):
    with pytest.raises(ValueError, match=field):
        _wire.decode(raw(GOOD_BODY, segments, registrations, nixl=b"n"))


def test_bad_framing_is_refused():
    good = raw(GOOD_BODY, GOOD_SEGMENTS, GOOD_REGISTRATIONS, nixl=b"n")
    assert _wire.decode(good).nixl_metadata == b"n"
    cases = {
        "bytes is not one": b"JXK",
        "magic": b"JXKW" + good[4:],
        "short of its header": good[:12],
        "exceeds": raw(GOOD_BODY, text_bytes=1 << 20),
        "the message has": good[:-2],  # nixl b"n" and one registration byte gone
        "'segments'": raw(GOOD_BODY, GOOD_SEGMENTS, num_segments=1 << 20),
        "'registrations'": raw(GOOD_BODY, GOOD_SEGMENTS, num_registrations=(1 << 20) + 1),
        "not JSON": raw(GOOD_BODY, GOOD_SEGMENTS)[:20] + b"\xff" * 400,
        "JSON object": raw([1, 2], GOOD_SEGMENTS),
    }
    for match, message in cases.items():
        with pytest.raises(ValueError, match=match):
            _wire.decode(message)
    deep = b"[" * 5000 + b"]" * 5000
    header = struct.pack("!4sIIII", b"JXKV", 3, len(deep), 1, 0)
    # Python 3.11's parser gives up on the nesting (not JSON); 3.12's parses it, and a list is
    # no layout: refused either way, before anything else is read.
    with pytest.raises(ValueError, match="not JSON|must be a JSON object"):
        _wire.decode(header + deep + np.array(GOOD_SEGMENTS[:1], dtype="<u8").tobytes())
    with pytest.raises(TypeError):
        _wire.decode("JXKV")


def test_the_layout_round_trips_with_its_local_address():
    layout = _wire.decode(raw(GOOD_BODY, GOOD_SEGMENTS, GOOD_REGISTRATIONS, nixl=b"md"))
    assert layout.local is None and layout.registrations == ((0, 1 << 20),)
    assert isinstance(layout.registrations, Ranges)
    with_local = dataclasses.replace(layout, local=LocalAddress(**LOCAL))
    again = _wire.decode(_wire.encode(with_local))
    assert again == with_local and again.local == LocalAddress(**LOCAL)
    assert hash(again) == hash(with_local)
    assert _wire.decode(_wire.encode(layout)) == layout
    empty = dataclasses.replace(layout, nixl_metadata=b"", registrations=())
    assert _wire.decode(_wire.encode(empty)).nixl_metadata == b""
    with pytest.raises(ValueError, match="local.address"):
        LocalAddress(BOOT_ID, 0, "x" * 101)
    assert isinstance(
        RemoteLayout(**{**vars(layout), "registrations": [(0, 4096)]}).registrations, Ranges
    )


# -- 5. addresses beyond int64 and sides with nothing registered -----------------------------------
def test_a_side_with_nothing_registered_names_the_block(endpoints):
    a, _ = endpoints("bare-a")
    b, _ = endpoints("bare-b")
    bare = dataclasses.replace(b.remote_layout(), registrations=())
    remote = a.connect(_wire.encode(bare))
    with pytest.raises(ValueError, match=r"block 2 of segment 0 .* is not all registered"):
        a.write(remote, [0], [2], segments=[0])
    with pytest.raises(ValueError, match=r"'base'"):
        a.connect(_wire.encode(dataclasses.replace(bare, agent="x", base=1 << 63)))


# -- 6. Unix socket paths longer than sun_path -----------------------------------------------------
def long_path(root, length: int, name_length: int = 6) -> str:
    """A socket path of exactly ``length`` bytes under ``root`` whose file name has
    ``name_length`` bytes (deep directories made): a short name in a deep directory is
    what a staged name beside it outgrows."""
    directory, left = str(root), length - name_length - 1
    while left - len(directory) > 0:
        part = min(100, left - len(directory) - 1)
        directory = os.path.join(directory, "d" * max(part, 1))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "s" * (length - len(directory) - 1))
    assert len(path) == length, (len(path), length)
    return path


@pytest.mark.parametrize(
    ("length", "name_length"), [(102, 6), (107, 6), (108, 6), (200, 6), (200, 150), (400, 6)]
)
def test_listen_and_connect_at_long_paths(tmp_path, length, name_length):
    from jaxbuf.sharing import connect_unix, listen_unix, recv_buffer, send_buffer

    path = long_path(tmp_path, length, name_length)
    server = listen_unix(path)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
        with pytest.raises(FileExistsError):
            listen_unix(path)
        tensor = jaxbuf.ExtensibleTensor(8 * MiB, "cpu", num_segments=2)
        tensor.resize_per_segment_(MiB)
        data = fill(tensor, 1, 4)
        sent = []

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                sent.append(send_buffer(conn, tensor, timeout=30))

        sender = threading.Thread(target=serve)
        sender.start()
        client = connect_unix(path, timeout=30)
        with recv_buffer(client, timeout=30) as imported:
            np.testing.assert_array_equal(imported.segment_view(1).to_numpy(), data)
        sender.join(30)
        assert sent
        client.close()
        tensor.free()
    finally:
        server.close()
        os.unlink(path)


def test_connect_unix_errors(tmp_path):
    from jaxbuf.sharing import connect_unix

    with pytest.raises(FileNotFoundError):
        connect_unix(long_path(tmp_path, 200), timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        connect_unix(str(tmp_path / "x"), timeout=-1)
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    with pytest.raises(ConnectionRefusedError):
        connect_unix(plain, timeout=5)


# -- 5. hand-cut descriptors: contiguous runs merged, never across a registration edge ------
@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=24),
    gaps=st.lists(st.sampled_from([0, 0, 0, 16]), min_size=24, max_size=24),
    remote_gaps=st.lists(st.sampled_from([0, 0, 0, 8]), min_size=24, max_size=24),
    edges=st.sets(st.integers(0, 2048), max_size=8),
    other_edges=st.sets(st.integers(0, 2048), max_size=8),
)
def test_merge_runs_merges_what_is_contiguous_on_both_sides_and_no_more(
    sizes, gaps, remote_gaps, edges, other_edges
):
    """Descriptor pairs as the NIXL link cuts them: merged where both sides run on without a
    gap and no registration edge lies between; every byte pair is moved as before, in order,
    and no merged descriptor spans an edge of either side."""
    from jaxbuf.transfer._nixl_link import merge_runs

    here, there, local_rows, remote_rows = 1000, 5000, [], []
    for size, gap, remote_gap in zip(sizes, gaps, remote_gaps):
        here, there = here + gap, there + remote_gap
        local_rows.append((here, size, 0))
        remote_rows.append((there, size, 1))
        here, there = here + size, there + size
    local = np.array(local_rows, dtype=np.uint64)
    remote = np.array(remote_rows, dtype=np.uint64)
    local_edges = np.array(sorted(e + 1000 for e in edges), dtype=np.int64)
    remote_edges = np.array(sorted(e + 5000 for e in other_edges), dtype=np.int64)
    merged_here, merged_there = merge_runs(local, remote, local_edges, remote_edges)

    def pairs(mine, theirs):
        return [
            (int(a) + k, int(b) + k)
            for (a, n, _), (b, _, _) in zip(mine.tolist(), theirs.tolist())
            for k in range(int(n))
        ]

    assert pairs(merged_here, merged_there) == pairs(local, remote)
    assert np.array_equal(merged_here[:, 1], merged_there[:, 1])
    assert set(merged_here[:, 2].tolist()) <= {0} and set(merged_there[:, 2].tolist()) <= {1}
    # Where a merged descriptor joins two of the originals, neither side has an edge.
    k, originals = 0, list(zip(local.tolist(), remote.tolist()))
    for row in merged_here.tolist():
        covered = 0
        while covered < row[1]:
            (at_here, size, _), (at_there, _, _) = originals[k]
            if covered:
                assert at_here not in local_edges.tolist()
                assert at_there not in remote_edges.tolist()
            covered, k = covered + size, k + 1
    # Maximal: two neighbours left apart have a gap or an edge between them.
    for i in range(len(merged_here) - 1):
        end_here = int(merged_here[i, 0] + merged_here[i, 1])
        end_there = int(merged_there[i, 0] + merged_there[i, 1])
        assert (
            end_here != int(merged_here[i + 1, 0])
            or end_there != int(merged_there[i + 1, 0])
            or end_here in local_edges.tolist()
            or end_there in remote_edges.tolist()
        )
