"""A grow maps and grants only the chunks it adds.

``cuMemSetAccess`` over a long committed run is slow (0.7 ms at 48 GiB on an H200) when part
of it is newly mapped, so a grow must grant each new chunk alone (a whole chunk, as CUDA
requires), the owner and its peers in one ``set_access_many``, and never touch the chunks
already mapped (CUDA graphs captured over them stay valid). Wider grants happen only where
they are needed: ``grant_access`` to a new peer grants every committed run to that peer.

The driver is a :class:`jaxbuf.testing.FaultInjectingDriver` with ``record_calls=True``. On
the CPU a peer is faked (:class:`TwoDeviceHostDriver`: memory on device 0, device 1 accepted
by ``set_access``); on CUDA the peer tests need two GPUs with peer access.

A hypothesis state machine then runs random grows (faults armed on ``set_access``, ``create``
or ``map``), ``grant_access`` and ``defragment`` against a model of the chunks: each
successful call grants exactly the model's new chunks, each failed grow leaves chunks, sizes,
bytes and the driver's live state as they were.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from jaxbuf.drivers import DriverError, HostVmmDriver, get_vmm_driver
from jaxbuf.extensible import ExtensibleTensor, granule_size
from jaxbuf.testing import FaultInjectingDriver

MiB = 1 << 20


class TwoDeviceHostDriver(HostVmmDriver):
    """The CPU driver with a fake peer: memory lives on device 0; device 1 may access it
    (``set_access`` for it checks the arguments as for device 0, then does nothing)."""

    def device_count(self) -> int:
        return 2

    def can_access_peer(self, device_index: int, peer_index: int) -> bool:
        return True

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        super().set_access(ptr, size, 0)

    def synchronize(self, device_index: int) -> None:
        super().synchronize(0)


def recording_driver(platform: str, peers: bool) -> FaultInjectingDriver:
    if platform == "cpu" and peers:
        return FaultInjectingDriver(TwoDeviceHostDriver(), record_calls=True)
    inner = get_vmm_driver(platform)
    if peers and (inner.device_count() < 2 or not inner.can_access_peer(1, 0)):
        pytest.skip(f"needs 2 {platform} devices with peer access")
    return FaultInjectingDriver(inner, record_calls=True)


@pytest.fixture(params=[False, True], ids=["owner", "peer"])
def peers(request) -> bool:
    return request.param


def make(platform: str, driver, capacity: int, peers: bool = False, **kwargs) -> ExtensibleTensor:
    peer_devices = [f"{platform}:1"] if peers else []
    return ExtensibleTensor(
        capacity, device=platform, driver=driver, peer_devices=peer_devices, **kwargs
    )


def grants(driver: FaultInjectingDriver, buf: ExtensibleTensor) -> list[tuple]:
    """``(offset, size, devices)`` of every logged ``set_access_many`` in ``buf``'s
    reservation (not in defragment's temporary ones), offsets relative to its base."""
    found = []
    for call in driver.log:
        if call.kind != "set_access_many":
            continue
        offset = int(call.args["ptr"], 16) - buf.base_ptr
        if 0 <= offset < buf.capacity_bytes:
            found.append((offset, call.args["size"], call.args["devices"]))
    return found


def vmm_calls(driver: FaultInjectingDriver, base: int) -> list[tuple]:
    """create / map / set_access_many / set_access of the log, offsets relative to ``base``."""
    calls = []
    for call in driver.log:
        args = call.args
        if call.kind == "create":
            calls.append(("create", args["size"]))
        elif call.kind in ("map", "set_access", "set_access_many"):
            entry = (call.kind, int(args["ptr"], 16) - base, args["size"])
            calls.append(entry + ((args["devices"],) if "devices" in args else ()))
    return calls


def test_the_call_log_is_off_by_default_and_records_failed_calls():
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    with make("cpu", driver, 8 * MiB) as buf:
        buf.resize_per_segment_(1)
        assert driver.log == []
        driver.record_calls = True
        driver.fail_on("set_access")
        with pytest.raises(DriverError, match="INJECTED_FAULT"):
            buf.resize_per_segment_(buf.granularity + 1)
        kinds = [call.kind for call in driver.log]
        assert kinds[-4:] == ["set_access_many", "set_access", "unmap", "release"], kinds
        failed = driver.log[-3]
        assert failed.call_index == driver.injected[0].call_index
        assert driver.log[-4].call_index is None  # set_access_many is logged, not counted


# -- one grow onto chunks already committed ---------------------------------------------------
# (chunks before the grow, each this many granules): one small, one large, many.
LAYOUTS = {"one chunk": [1], "one large chunk": [6], "many chunks": [1] * 7}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_grow_creates_maps_and_grants_only_the_new_chunk(device, peers, layout):
    driver = recording_driver(device, peers)
    granule = granule_size(device)
    existing = LAYOUTS[layout]
    with make(device, driver, (sum(existing) + 2) * granule, peers) as buf:
        committed = 0
        for granules in existing:
            committed += granules * granule
            buf.resize_per_segment_(committed)
        assert buf.num_physical_chunks == len(existing)
        driver.log.clear()
        buf.resize_per_segment_(committed + granule // 2)
        devices = (0, 1) if peers else (0,)
        access = [("set_access", committed, granule)] * len(devices)
        assert vmm_calls(driver, buf.base_ptr) == [
            ("create", granule),
            ("map", committed, granule),
            ("set_access_many", committed, granule, devices),  # one call, owner and peer
            *access,
        ]
        # Nothing already mapped was touched: no unmap, no remap, no other grant.
        assert not {call.kind for call in driver.log} & {"unmap", "move_mapping", "release"}
        driver.check_invariants()
        assert buf.num_physical_chunks == len(existing) + 1


def test_each_gap_of_one_grow_is_its_own_chunk_and_grant(device, peers):
    """Three segments of 4 granules at [G, 0, G], grown to [3G, 2G, 3G]: three gaps, one
    chunk and one grant each; the two gaps that touch are not merged into one chunk."""
    driver = recording_driver(device, peers)
    G = granule_size(device)
    with make(device, driver, 12 * G, peers, num_segments=3) as buf:
        buf.resize_segments_([G, 0, G])
        driver.log.clear()
        buf.resize_segments_([3 * G, 2 * G, 3 * G])
        devices = (0, 1) if peers else (0,)
        new = [(G, 2 * G), (4 * G, 2 * G), (9 * G, 2 * G)]
        assert grants(driver, buf) == [(o, n, devices) for o, n in new]
        assert [c for c in vmm_calls(driver, buf.base_ptr) if c[0] == "create"] == [
            ("create", 2 * G)
        ] * 3
        # Two segments grown from empty at once: adjacent gaps, still one chunk each.
        buf.release_physical()
        driver.log.clear()
        buf.resize_segments_([4 * G, 4 * G, 0])
        assert grants(driver, buf) == [(0, 4 * G, devices), (4 * G, 4 * G, devices)]
        assert buf.num_physical_chunks == 2
        driver.check_invariants()


def test_grant_access_to_a_new_peer_is_where_committed_runs_are_granted():
    driver = recording_driver("cpu", peers=True)
    G = granule_size("cpu")
    with make("cpu", driver, 16 * G, num_segments=2) as buf:
        for size in (G, 2 * G, 3 * G):
            buf.resize_per_segment_(size)  # 3 chunks per segment, one run each
        driver.log.clear()
        buf.grant_access("cpu:1")
        # The wider grant: each committed run, to the new peer only.
        assert grants(driver, buf) == [(0, 3 * G, (1,)), (8 * G, 3 * G, (1,))]
        driver.log.clear()
        buf.resize_per_segment_(4 * G)
        assert grants(driver, buf) == [(3 * G, G, (0, 1)), (11 * G, G, (0, 1))]
        driver.check_invariants()


def test_defragment_grants_the_new_chunk_alone(device):
    driver = recording_driver(device, peers=False)
    G = granule_size(device)
    with make(device, driver, 16 * G, num_segments=2) as buf:
        for size in (G, 2 * G, 3 * G):
            buf.resize_per_segment_(size)
        buf.resize_segments_([3 * G, 4 * G])  # segment 1 has 4 chunks
        driver.log.clear()
        assert buf.defragment() == [0, 1]
        # The neighbours of each span keep their access: only the moved chunk is granted.
        assert grants(driver, buf) == [(0, 3 * G, (0,)), (8 * G, 4 * G, (0,))]
        driver.check_invariants()
        assert buf.segments_backed_by_one_chunk([3 * G, 4 * G]) == [True, True]


def test_a_failed_defragment_grants_the_restored_chunks_alone(device):
    driver = recording_driver(device, peers=False)
    G = granule_size(device)
    with make(device, driver, 16 * G, num_segments=2) as buf:
        for size in (G, 2 * G, 3 * G):
            buf.resize_per_segment_(size)
        driver.log.clear()
        # set_access 1: the new chunk at its temporary address; 2: at its final address.
        driver.fail_on("set_access", 2)
        with pytest.raises(DriverError, match="INJECTED_FAULT"):
            buf.defragment()
        assert grants(driver, buf) == [(0, 3 * G, (0,)), (0, 3 * G, (0,))]
        driver.check_invariants()
        assert buf.num_physical_chunks == 6
        assert buf.defragment() == [0, 1]


# -- failures of the grant roll back as before --------------------------------------------------
def test_a_failed_grant_rolls_back_only_the_new_chunks(device, peers):
    driver = recording_driver(device, peers)
    G = granule_size(device)
    with make(device, driver, 12 * G, peers, num_segments=3) as buf:
        buf.resize_segments_([G, 0, G])
        mapped = dict(driver.mapped)
        devices = 2 if peers else 1
        for nth in range(1, 3 * devices + 1):  # every grant of the three new chunks
            driver.fail_on("set_access", nth)
            with pytest.raises(DriverError, match="INJECTED_FAULT"):
                buf.resize_segments_([3 * G, 2 * G, 3 * G])
            assert buf.committed_sizes == [G, 0, G]
            assert driver.mapped == mapped and buf.num_physical_chunks == 2
            assert driver.created - driver.released == 2
            driver.check_invariants()
        buf.resize_segments_([3 * G, 2 * G, 3 * G])
        driver.check_invariants()


def test_a_grant_and_its_unmap_failing_strands_only_the_new_chunk(device, peers):
    driver = recording_driver(device, peers)
    G = granule_size(device)
    with make(device, driver, 8 * G, peers) as buf:
        buf.resize_per_segment_(2 * G)
        driver.fail_on("set_access", 2 if peers else 1)  # the peer's grant, else the owner's
        driver.fail_on("unmap")
        with pytest.raises(DriverError, match="INJECTED_FAULT") as info:
            buf.resize_per_segment_(3 * G)
        assert any("unmap" in note for note in info.value.__notes__)
        assert buf.committed_sizes == [2 * G] and buf.num_physical_chunks == 2
        with pytest.raises(RuntimeError, match="release_physical"):
            buf.resize_per_segment_(3 * G)
        buf.release_physical()
        buf.resize_per_segment_(3 * G)
        driver.check_invariants()
    driver.assert_clean()


# -- random operations against a model ----------------------------------------------------------
def _state_machine(peers: bool):
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    granule = granule_size("cpu")
    # Granule-aligned and unaligned segment boundaries: neighbours may share a granule.
    capacities = [3 * granule, granule + granule // 2, 2 * granule + granule // 2]

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # With ``peers`` the driver has a second device, granted by the grant_peer rule.
            self.driver = recording_driver("cpu", peers)
            self.buf = make("cpu", self.driver, sum(capacities), segment_capacities=capacities)
            self.devices: tuple[int, ...] = (0,)
            self.chunks: dict[int, int] = {}  # model: offset -> size
            self.sizes = [0] * len(capacities)
            self.offsets = [sum(capacities[:i]) for i in range(len(capacities))]
            self.data = [np.zeros(0, np.uint8) for _ in capacities]

        def _granted_now(self) -> list:
            return grants(self.driver, self.buf)

        def _expected_new_chunks(self, sizes: list[int]) -> list[tuple[int, int]]:
            """What ensure_committed_ranges adds: one chunk per gap, range by range."""
            covered = {
                o // granule + k for o, n in self.chunks.items() for k in range(n // granule)
            }
            new = []
            for offset, old, size in zip(self.offsets, self.sizes, sizes):
                if size <= old:
                    continue
                first = (offset + old) // granule
                last = -(-(offset + size) // granule)
                run = None
                for g in range(first, last + 1):
                    if g < last and g not in covered:
                        run = g if run is None else run
                        covered.add(g)
                    elif run is not None:
                        new.append((run * granule, (g - run) * granule))
                        run = None
            return new

        @rule(
            fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
            fault=st.sampled_from([None, None, "set_access", "set_access", "create", "map"]),
            nth=st.integers(1, 6),
        )
        def grow(self, fractions, fault, nth) -> None:
            sizes = [
                old + int((cap - old) * f) for old, cap, f in zip(self.sizes, capacities, fractions)
            ]
            expected = self._expected_new_chunks(sizes)
            mapped_before = dict(self.driver.mapped)
            self.driver.log.clear()
            if fault is not None:
                self.driver.fail_on(fault, nth)
            try:
                self.buf.resize_segments_(sizes)
            except DriverError:
                assert self.driver.armed == 0
                # Rolled back: the chunks, sizes and mappings are those of before.
                assert self.buf.committed_sizes == self.sizes
                assert self.driver.mapped == mapped_before
                assert self.buf.num_physical_chunks == len(self.chunks)
                # What was granted before the failure was new chunks only, each whole.
                granted = self._granted_now()
                assert granted == [(o, n, self.devices) for o, n in expected[: len(granted)]]
                return
            finally:
                self.driver.disarm()
            assert self._granted_now() == [(o, n, self.devices) for o, n in expected]
            for offset, size in expected:
                self.chunks[offset] = size
            for i, (old, new) in enumerate(zip(self.sizes, sizes)):
                if new > old:
                    fresh = np.random.default_rng(new).integers(1, 255, new - old, np.uint8)
                    self.buf.segment_view(i).to_numpy()[old:new] = fresh
                    self.data[i] = np.concatenate([self.data[i], fresh])
            self.sizes = sizes

        @precondition(lambda self: self.devices == (0,))
        @rule()
        def grant_peer(self) -> None:
            if not peers:  # the real CPU driver has no second device
                with pytest.raises(ValueError, match="out of range"):
                    self.buf.grant_access("cpu:1")
                return
            self.driver.log.clear()
            self.buf.grant_access("cpu:1")
            runs = []
            for offset in sorted(self.chunks):
                if runs and runs[-1][0] + runs[-1][1] == offset:
                    runs[-1][1] += self.chunks[offset]
                else:
                    runs.append([offset, self.chunks[offset]])
            assert self._granted_now() == [(o, n, (1,)) for o, n in runs]
            self.devices = (0, 1)

        @rule()
        def defragment(self) -> None:
            spans = []
            for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
                if size:
                    first = offset // granule * granule
                    spans.append((i, first, -(-(offset + size) // granule) * granule))
            shared = any(a[2] > b[1] for a, b in zip(spans, spans[1:]))
            crossing = any(
                o < first < o + n or o < last < o + n
                for _, first, last in spans
                for o, n in self.chunks.items()
            )
            self.driver.log.clear()
            if shared or crossing:
                with pytest.raises(ValueError, match="cannot defragment"):
                    self.buf.defragment()
                assert self.driver.log == []
                return
            remapped = [
                (i, first, last)
                for i, first, last in spans
                if sum(first <= o < last for o in self.chunks) > 1
            ]
            assert self.buf.defragment() == [i for i, _, _ in remapped]
            assert self._granted_now() == [
                (first, last - first, self.devices) for _, first, last in remapped
            ]
            for _, first, last in remapped:
                for offset in [o for o in self.chunks if first <= o < last]:
                    del self.chunks[offset]
                self.chunks[first] = last - first

        @invariant()
        def consistent(self) -> None:
            self.driver.check_invariants()
            base = self.buf.base_ptr
            assert {p - base: s for p, (s, _, _) in self.driver.mapped.items()} == self.chunks
            assert self.driver.created - self.driver.released == len(self.chunks)
            for i, expected in enumerate(self.data):
                got = self.buf.segment_view(i).to_numpy()
                # array_equal first: assert_array_equal costs 5 ms per MiB, even when equal.
                if not np.array_equal(got, expected):
                    np.testing.assert_array_equal(got, expected)

        def teardown(self) -> None:
            self.buf.free()
            self.driver.assert_clean()

    return Machine


def test_random_grows_grant_only_new_chunks_and_roll_back(peers):
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    gc.collect()
    run_state_machine_as_test(
        _state_machine(peers),
        settings=settings(
            max_examples=60,
            stateful_step_count=10,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


# -- the benchmark's floor ----------------------------------------------------------------------
def test_the_bench_floor_maps_the_chunk_the_grow_maps_next():
    """``extensible.growth`` times jaxbuf's grow against the raw driver calls for the same
    chunk; both sample lists are full and the row is judged against the 1.2x target."""
    from jaxbuf.bench.extensible import _FLOOR_TARGET, _floor_row, _paired_growth
    from jaxbuf.devices import as_device

    G = granule_size("cpu")
    jaxbuf, floor = _paired_growth(as_device("cpu"), 2 * G, G, repeat=3, reserved=64 * G)
    assert len(jaxbuf.samples_s) == len(floor.samples_s) == 3
    assert jaxbuf.median_s > 0 and floor.median_s > 0
    row = _floor_row("+G onto 2G", jaxbuf, floor, {"committed_bytes": 2 * G, "step_bytes": G})
    assert row.params["baseline_kind"] == "floor"
    assert row.met == (jaxbuf.median_s / floor.median_s <= _FLOOR_TARGET)  # jaxbuf ÷ floor
    skipped = _floor_row("+G onto 2G", None, None, {}, notes="skipped: out of memory")
    assert skipped.median_s is None and skipped.met is False and skipped.judged is None
