"""PackRing: packed writes in pinned slots that the jitted apply reads in place.

On the CPU: random batches through the ring against a numpy model (slot reuse, growth,
overlapping writes later-wins, several dtypes), the slot bytes against a fresh pack's, the
guard (a recorded consumer is waited for, an unrecorded or donated one costs a device-wide
wait, seen through a counting driver), driver faults leaving the staged writes staged, close
semantics and bad input. On a GPU (``gpu`` marker): the Triton method through the ring.
"""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
from conftest import row_writes_model

jax = pytest.importorskip("jax", reason="jax is not installed")
import jax.numpy as jnp  # noqa: E402

from jaxbuf import interop  # noqa: E402
from jaxbuf.drivers import DriverError, get_vmm_driver  # noqa: E402
from jaxbuf.jax_ops import (  # noqa: E402
    PackedWrites,
    PackRing,
    StagedWrites,
    apply_staged_writes,
    pack_writes,
)
from jaxbuf.testing import FaultInjectingDriver  # noqa: E402

SHAPE = (10, 64)
DTYPES = ["int32", "float32", "bfloat16", "float16", "int8"]


def _random_writes(rng, num_writes, dtype, shape=SHAPE, max_len=40):
    """In-bounds writes of random lengths, overlapping often (few rows)."""
    np_dtype = jnp.dtype(dtype)
    rows, starts, values_list = [], [], []
    for _ in range(num_writes):
        length = int(rng.integers(0, max_len + 1))
        rows.append(int(rng.integers(shape[0])))
        starts.append(int(rng.integers(0, shape[1] - length + 1)))
        if np_dtype.kind in "iu":
            values_list.append(rng.integers(-100, 100, length).astype(np_dtype))
        else:
            values_list.append((rng.standard_normal(length) * 100).astype(np_dtype))
    return rows, starts, values_list


@pytest.fixture(autouse=True)
def _cpu_arrays_unless_gpu(request):
    """The CPU rings' tests make their arrays on JAX's CPU device, also on a machine whose
    default JAX device is a GPU (the arrays must live where the ring's memory does)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def counting():
    """A CPU driver that counts calls (synchronize among them)."""
    return FaultInjectingDriver(get_vmm_driver("cpu"))


@pytest.fixture
def quiesces(monkeypatch):
    """Calls of interop.quiesce (the device-wide wait's first half), counted."""
    calls = []
    real = interop.quiesce

    def spy(device):
        calls.append(device)
        real(device)

    monkeypatch.setattr(interop, "quiesce", spy)
    return calls


# -- correctness against the model ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("expand", [None, False])  # None: the CPU's default, expanded
def test_random_batches_through_the_ring_match_therow_writes_model(dtype, slots, expand):
    rng = np.random.default_rng(slots)
    np_dtype = jnp.dtype(dtype)
    expected = np.zeros(SHAPE, np_dtype)
    array = jnp.asarray(expected)
    staged = StagedWrites(*SHAPE, dtype)
    # A small first capacity, and batches growing, so slots are reused and grown.
    with PackRing(slots, device="cpu", min_words=64, expand=expand) as ring:
        assert ring.pack(StagedWrites(*SHAPE, dtype)).expanded is (expand is None)
        for step in range(12):
            writes = _random_writes(rng, int(rng.integers(0, 8 + 12 * step)), dtype)
            staged.stage_writes(*writes)
            array = ring.apply(array, staged)
            expected = row_writes_model(expected, *writes)
            assert staged.num_staged_writes == 0
        np.testing.assert_array_equal(np.asarray(array), expected)
        assert all(c & (c - 1) == 0 and c >= 64 for c in ring.capacities), ring.capacities
        assert max(ring.capacities) > 64  # grown


@pytest.mark.parametrize("dtype", ["int32", "bfloat16"])
def test_own_jitted_step_with_pack_writes_and_consumed_by(dtype):
    rng = np.random.default_rng(1)
    np_dtype = jnp.dtype(dtype)
    expected = np.zeros(SHAPE, np_dtype)
    array = jnp.asarray(expected)

    @jax.jit
    def step(a, packed):
        out = apply_staged_writes(a, packed, method="scatter")  # CPU arrays, on any machine
        return out, out.sum()

    with PackRing(device="cpu") as ring:
        for _ in range(7):
            writes = _random_writes(rng, 9, dtype)
            packed = pack_writes(*writes, dtype, shape=SHAPE, ring=ring)
            assert isinstance(packed, PackedWrites) and isinstance(packed.buffer, jax.Array)
            array, total = step(array, packed)
            assert ring.consumed_by(total) is total
            expected = row_writes_model(expected, *writes)
        np.testing.assert_array_equal(np.asarray(array), expected)


def test_pack_writes_through_a_ring_reuses_its_staging_and_fails_clean(counting):
    """pack_writes(..., ring=) stages into one StagedWrites the ring keeps (its buffers stay
    allocated): batches of changing shapes and dtypes match the model, a call that fails (bad
    input, a driver fault) leaves nothing staged for the next, and a closed ring refuses."""
    rng = np.random.default_rng(5)
    arrays = {"int32": jnp.zeros(SHAPE, jnp.int32), "float16": jnp.zeros(SHAPE, jnp.float16)}
    models = {dtype: np.zeros(SHAPE, jnp.dtype(dtype)) for dtype in arrays}

    @jax.jit
    def step(a, packed):
        return apply_staged_writes(a, packed, method="scatter")

    with PackRing(1, device="cpu", driver=counting, min_words=64) as ring:
        scratches = []
        for i in range(10):
            dtype = "int32" if i % 3 else "float16"
            writes = _random_writes(rng, int(rng.integers(1, 20)), dtype)
            if i == 4:  # out of bounds: IndexError after the valid writes were looked at
                with pytest.raises(IndexError):
                    pack_writes(
                        *[w + [SHAPE[0]] for w in writes[:2]],
                        [*writes[2], [1]],
                        dtype,
                        shape=SHAPE,
                        ring=ring,
                    )
            if i == 6:  # the wait for the slot fails: nothing packed, nothing left staged
                arrays[dtype] = step(
                    arrays[dtype], pack_writes(*writes, dtype, shape=SHAPE, ring=ring)
                )
                models[dtype] = row_writes_model(models[dtype], *writes)
                counting.fail_on("synchronize")
                junk = _random_writes(rng, 5, dtype)  # never applied: must not stay staged
                with pytest.raises(DriverError):
                    pack_writes(*junk, dtype, shape=SHAPE, ring=ring)
            packed = pack_writes(*writes, dtype, shape=SHAPE, ring=ring)
            scratches.append(ring._scratch_staged)
            assert ring._scratch_staged.num_staged_writes == 0
            arrays[dtype] = ring.consumed_by(step(arrays[dtype], packed))
            models[dtype] = row_writes_model(models[dtype], *writes)
        for dtype in arrays:
            np.testing.assert_array_equal(np.asarray(arrays[dtype]), models[dtype])
        assert scratches[1] is scratches[2]  # the same arguments: the same StagedWrites
        assert scratches[2] is not scratches[3]  # another dtype: another one
    with pytest.raises(RuntimeError, match="closed"):
        pack_writes([0], [0], [[1]], "int32", shape=SHAPE, ring=ring)
    with pytest.raises(TypeError, match="PackRing"):
        pack_writes([0], [0], [[1]], "int32", shape=SHAPE, ring=object())


def test_the_slot_holds_what_a_fresh_pack_holds():
    rng = np.random.default_rng(2)
    staged = StagedWrites(*SHAPE, "float16")
    with PackRing(device="cpu", min_words=16) as ring:
        for _ in range(5):
            staged.stage_writes(*_random_writes(rng, 20, "float16"))
            fresh = staged.pack(clear=False)
            slot = ring._slots[ring._next]
            packed = staged.pack(ring=ring)
            words = fresh.buffer.shape[0]
            assert (packed.num_writes, packed.num_values, packed.dtype) == (
                fresh.num_writes,
                fresh.num_values,
                fresh.dtype,
            )
            assert packed.buffer.shape == (words,) and packed.buffer.dtype == jnp.int32
            # Same layout and padding, byte for byte (padding included: no stale bytes).
            np.testing.assert_array_equal(slot.buffer.np[:words], fresh.buffer)
            assert staged.num_staged_writes == 0
            ring.consumed_by(jnp.zeros(1))  # nothing reads it: a ready guard


def test_the_jax_import_is_made_once_per_slot_and_length(counting):
    staged = StagedWrites(*SHAPE, "int32")
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(device="cpu", driver=counting) as ring:
        leaves = []
        for _ in range(6):
            staged.stage_write(0, 0, np.arange(4, dtype=np.int32))
            packed = ring.pack(staged)
            leaves.append(packed.buffer)
            array = ring.apply(array, packed)
        assert leaves[0] is leaves[2] is leaves[4] and leaves[1] is leaves[3] is leaves[5]
        assert leaves[0] is not leaves[1]
        assert counting.calls["host_alloc"] == 2  # one pinned block per slot, never regrown
    np.testing.assert_array_equal(np.asarray(array)[0, :4], np.arange(4))


# -- the guard -----------------------------------------------------------------------------------
def test_apply_records_its_guard_so_no_device_wide_wait(counting, quiesces, monkeypatch):
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
    staged = StagedWrites(*SHAPE, "int32")
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(device="cpu", driver=counting) as ring:
        for i in range(8):
            staged.stage_write(i % SHAPE[0], 0, np.full(5, i, np.int32))
            array = ring.apply(array, staged)  # the result is donated by the next apply
        assert counting.calls["synchronize"] == 0 and not quiesces
        assert len(waited) == 6  # every reuse of a slot waited for its recorded token
    assert np.asarray(array)[7, :5].tolist() == [7] * 5


def test_an_unrecorded_consumer_costs_a_device_wide_wait(counting, quiesces):
    step = jax.jit(apply_staged_writes, donate_argnums=0)
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(device="cpu", driver=counting) as ring:
        for i in range(5):
            array = step(array, pack_writes([i], [0], [[i + 1]], "int32", ring=ring))
        # Packs 3, 4 and 5 reused slots whose readers nobody recorded.
        assert counting.calls["synchronize"] == 3 and len(quiesces) == 3
    assert np.asarray(array)[:5, 0].tolist() == [1, 2, 3, 4, 5]


def test_a_donated_guard_falls_back_to_the_device_wide_wait(counting, quiesces):
    step = jax.jit(apply_staged_writes, donate_argnums=0)
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(device="cpu", driver=counting) as ring:
        for i in range(4):
            array = ring.consumed_by(step(array, pack_writes([i], [0], [[9]], "int32", ring=ring)))
        # Each guard was donated by the next step: packs 3 and 4 could not wait on theirs.
        assert counting.calls["synchronize"] == 2 and len(quiesces) == 2
        # A guard that is not donated is waited for instead.
        total = jax.jit(jnp.sum)
        for i in range(4):
            array = step(array, pack_writes([i], [1], [[8]], "int32", ring=ring))
            ring.consumed_by(total(array))
        # The first two of these reused slots whose guards (packs 3 and 4) were donated.
        assert counting.calls["synchronize"] == 4 and len(quiesces) == 4
    assert np.asarray(array)[:4, :2].tolist() == [[9, 8]] * 4


def test_a_failed_wait_leaves_the_writes_staged_and_the_ring_usable(counting):
    staged = StagedWrites(*SHAPE, "int32")
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(1, device="cpu", driver=counting) as ring:
        staged.stage_write(0, 0, [1, 2])
        packed = ring.pack(staged)  # not recorded: the next pack waits device-wide
        array = jax.jit(apply_staged_writes)(array, packed)
        staged.stage_write(1, 0, [3, 4])
        counting.fail_on("synchronize")
        with pytest.raises(DriverError):
            ring.pack(staged)
        assert staged.num_staged_writes == 1
        array = ring.apply(array, staged)  # retried: the wait succeeds now
    assert np.asarray(array)[:2, :2].tolist() == [[1, 2], [3, 4]]


def test_a_failed_growth_leaves_the_slot_and_the_writes(counting):
    staged = StagedWrites(*SHAPE, "int32")
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(1, device="cpu", driver=counting, min_words=16) as ring:
        array = ring.apply(array, pack_writes([0], [0], [[5]], "int32", ring=ring))
        capacity = ring.capacities
        staged.stage_writes(list(range(SHAPE[0])), [0] * SHAPE[0], [np.ones(64, np.int32)] * 10)
        counting.fail_on("host_alloc")
        with pytest.raises(DriverError):
            ring.apply(array, staged)
        assert ring.capacities == capacity and staged.num_staged_writes == SHAPE[0]
        array = ring.apply(array, staged)
        assert ring.capacities[0] > capacity[0]
    np.testing.assert_array_equal(np.asarray(array), np.ones(SHAPE, np.int32))
    counting.assert_clean()


# -- closing -------------------------------------------------------------------------------------
def test_close_refuses_later_use_and_releases_the_slots(counting):
    ring = PackRing(device="cpu", driver=counting)
    staged = StagedWrites(*SHAPE, "int32")
    array = jnp.zeros(SHAPE, jnp.int32)
    staged.stage_write(0, 0, [1])
    array = ring.apply(array, staged)
    staged.stage_write(0, 1, [2])
    held = ring.pack(staged)  # a live array over slot 1
    assert len(counting.pinned) == 2
    ring.close()
    assert ring.closed and "closed" in repr(ring)
    assert len(counting.pinned) == 1  # slot 0 released; slot 1 lives with ``held``
    array = jax.jit(apply_staged_writes)(array, held)  # still valid memory
    assert np.asarray(array)[0, :2].tolist() == [1, 2]
    del held
    gc.collect()
    assert not counting.pinned
    staged.stage_write(0, 0, [3])
    for call in (
        lambda: ring.pack(staged),
        lambda: ring.apply(array, staged),
        lambda: ring.consumed_by(array),
        lambda: pack_writes([0], [0], [[1]], "int32", ring=ring),
    ):
        with pytest.raises(RuntimeError, match=r"PackRing\(.*closed"):
            call()
    assert staged.num_staged_writes == 1
    ring.close()  # idempotent
    counting.assert_clean()


def test_the_ring_is_not_copyable():
    with PackRing(device="cpu") as ring:
        for refuse in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="PackRing"):
                refuse(ring)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_concurrency": 0}, ValueError, "max_concurrency"),
        ({"max_concurrency": 5000}, ValueError, "max_concurrency"),
        ({"max_concurrency": True}, TypeError, "max_concurrency"),
        ({"max_concurrency": 2.0}, TypeError, "max_concurrency"),
        ({"min_words": 0}, ValueError, "min_words"),
        ({"min_words": "8"}, TypeError, "min_words"),
        ({"device": "cpu", "driver": "nope"}, TypeError, "driver"),
        ({"device": "tpu"}, ValueError, "tpu"),
        ({"expand": 1}, TypeError, "expand"),
        ({"expand": "no"}, TypeError, "expand"),
    ],
)
def test_bad_constructor_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        PackRing(**kwargs)


def test_bad_calls_are_named_and_change_nothing():
    staged = StagedWrites(*SHAPE, "int32")
    staged.stage_write(0, 0, [1])
    array = jnp.zeros(SHAPE, jnp.int32)
    with PackRing(device="cpu") as ring:
        with pytest.raises(RuntimeError, match="no pack in flight"):
            ring.consumed_by(array)
        with pytest.raises(TypeError, match="StagedWrites"):
            ring.pack([(0, 0, [1])])
        with pytest.raises(TypeError, match="writes must be"):
            ring.apply(array, np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="'fast'"):
            ring.apply(array, staged, method="fast")
        with pytest.raises(ValueError, match="triton.*GPU"):
            ring.apply(array, staged, method="triton")
        with pytest.raises(TypeError, match="ring must be a PackRing"):
            staged.pack(ring=object())
        assert staged.num_staged_writes == 1 and ring.capacities == [0, 0]
        with pytest.raises(TypeError, match="bfloat16"):  # dtype mismatch, before packing
            ring.apply(jnp.zeros(SHAPE, jnp.bfloat16), staged)
        assert staged.num_staged_writes == 1 and ring.capacities == [0, 0]
        staged.clear()
        # A PackedWrites not from the ring (numpy leaf) is applied without a guard.
        array = ring.apply(array, pack_writes([1], [1], [[4]], "int32"))
    assert np.asarray(array)[1, 1] == 4


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (jnp.zeros(SHAPE, jnp.float32), TypeError, "float32"),
        (jnp.zeros((2, *SHAPE), jnp.int32), ValueError, "2-D"),
        (np.zeros(SHAPE, np.int32), TypeError, "jax.Array"),
        (jnp.zeros((SHAPE[0] - 1, SHAPE[1]), jnp.int32), ValueError, "smaller than the shape"),
        (jnp.zeros((SHAPE[0], SHAPE[1] - 1), jnp.int32), ValueError, "smaller than the shape"),
    ],
)
def test_a_refused_table_keeps_the_writes_for_the_retry(bad, error, match):
    # The table is checked before packing: nothing is cleared or packed when it is refused,
    # and the retry on a good table applies every write (none lost, none cut off).
    staged = StagedWrites(*SHAPE, "int32")
    staged.stage_write(SHAPE[0] - 1, SHAPE[1] - 2, [5, 6])
    staged.stage_write(0, 0, [1])
    with PackRing(device="cpu") as ring:
        with pytest.raises(error, match=match):
            ring.apply(bad, staged)
        assert staged.num_staged_writes == 2 and ring.capacities == [0, 0]
        out = np.asarray(ring.apply(jnp.zeros(SHAPE, jnp.int32), staged))
    assert out[0, 0] == 1 and out[-1, -2:].tolist() == [5, 6]
    assert staged.num_staged_writes == 0


def test_a_pack_refuses_a_smaller_table_naming_both_shapes():
    staged = StagedWrites(*SHAPE, "int32")
    staged.stage_write(SHAPE[0] - 1, 0, [7])
    packed = staged.pack()
    assert packed.shape == SHAPE
    small = (SHAPE[0] - 1, SHAPE[1])
    apply = jax.jit(apply_staged_writes)
    with pytest.raises(
        ValueError, match=rf"shape \({small[0]}, {small[1]}\).*\({SHAPE[0]}, {SHAPE[1]}\)"
    ):
        apply(jnp.zeros(small, jnp.int32), packed)
    with PackRing(device="cpu") as ring, pytest.raises(ValueError, match="smaller"):
        ring.apply(jnp.zeros(small, jnp.int32), packed)
    # A larger table takes every write; an unchecked pack (no shape) any table.
    assert np.asarray(apply(jnp.zeros((SHAPE[0] + 1, SHAPE[1]), jnp.int32), packed))[-2, 0] == 7
    unchecked = pack_writes([0], [0], [[3]], "int32")
    assert unchecked.shape is None
    assert np.asarray(apply(jnp.zeros((1, 1), jnp.int32), unchecked))[0, 0] == 3


def test_apply_names_the_jax_array_it_expects():
    packed = pack_writes([0], [0], [[3]], "int32", shape=SHAPE)
    with pytest.raises(TypeError, match=r"jax\.Array.*numpy\.ndarray"):
        apply_staged_writes(np.zeros(SHAPE, np.int32), packed)


# -- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int32", "float32", "bfloat16"])
def test_triton_through_the_ring_on_the_gpu(gpu_triton, dtype):
    rng = np.random.default_rng(7)
    shape = (512, 1024)
    expected = np.zeros(shape, jnp.dtype(dtype))
    state = jnp.asarray(expected)
    pointer = state.unsafe_buffer_pointer()
    staged = StagedWrites(*shape, dtype)
    with PackRing(device="cuda:0", min_words=256) as ring:
        # No wait between steps: each pack may reuse a slot whose apply is still running.
        for step in range(40):
            writes = _random_writes(rng, 8 + 4 * step, dtype, shape=shape, max_len=120)
            staged.stage_writes(*writes)
            state = ring.apply(state, staged, method="triton")
            expected = row_writes_model(expected, *writes)
        assert state.unsafe_buffer_pointer() == pointer, "the donated array was copied"
        np.testing.assert_array_equal(np.asarray(state), expected)


@pytest.mark.gpu
def test_unrecorded_consumers_on_the_gpu_stay_correct(gpu_triton):
    rng = np.random.default_rng(8)
    shape = (256, 512)
    expected = np.zeros(shape, np.int32)
    state = jnp.asarray(expected)
    step = jax.jit(lambda a, p: apply_staged_writes(a, p, method="triton"), donate_argnums=0)
    with PackRing(device="cuda:0") as ring:
        for _ in range(30):
            writes = _random_writes(rng, 64, "int32", shape=shape, max_len=100)
            state = step(state, pack_writes(*writes, "int32", shape=shape, ring=ring))
            expected = row_writes_model(expected, *writes)
        np.testing.assert_array_equal(np.asarray(state), expected)
