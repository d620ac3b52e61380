"""``KVCacheStep`` against a numpy model of the cache: random commits across bucket boundaries,
releases and recommits, writes from outside the step and random writes inside it, in both
layouts (an array per segment, one per tensor with ``segment_shape``); what ``fn`` sees (a
bucket of blocks on the CPU, never the capacity); the compile count; debug mode; jit options;
``segment_shape`` checks; the framework faces' caches."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxbuf import ExtensibleKVCacheBuffers, ExtensibleKVCacheBuilder, ExtensibleTensor

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jaxbuf.kv import KVCacheStep  # noqa: E402


@pytest.fixture(autouse=True)
def _no_debug_from_the_environment(monkeypatch):
    """These tests say when they want debug mode: a JAXBUF_DEBUG set for the run would
    change the blocks and executables they count."""
    monkeypatch.delenv("JAXBUF_DEBUG", raising=False)


CAPACITY = 16  # blocks: buckets 1, 2, 4, 8, 16
LAYERS, TOKENS, HEADS, DIM = 2, 2, 2, 4  # segment_shape (LAYERS, 2); a block (TOKENS, HEADS, DIM)
SEGMENTS = LAYERS * 2
BLOCK = (TOKENS, HEADS, DIM)
BLOCK_BYTES = math.prod(BLOCK) * 4  # float32, one segment
TENSORS = 2
WRITES, READS = 2, 4  # per segment and step (writes distinct: at most a block's tokens)


def _cache(device="cpu", builder_type=ExtensibleKVCacheBuilder):
    """Two tensors of SEGMENTS back-to-back planes each, one block committed."""
    builder = builder_type(CAPACITY, device)
    for _ in range(TENSORS):
        builder.reserve(CAPACITY * BLOCK_BYTES * SEGMENTS, SEGMENTS)
    return builder.finish()


def _skip_without_jax_gpu(device):
    if device == "cuda" and jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (default backend {jax.default_backend()})")


def _per_segment_fn(caches, blocks, tokens, values, read_blocks, read_tokens):
    """Writes ``values`` at (block, token) of every segment array, then reads READS tokens."""
    out, updated = [], []
    for i, cache in enumerate(caches):
        t, s = divmod(i, SEGMENTS)
        cache = cache.at[blocks[t, s], tokens[t, s]].set(values[t, s])
        updated.append(cache)
        out.append(cache[read_blocks[t, s], read_tokens[t, s]])
    return updated, jnp.stack(out).reshape(TENSORS, SEGMENTS, *out[0].shape)


def _nd_fn(caches, blocks, tokens, values, read_blocks, read_tokens):
    """The same through one (LAYERS, 2, blocks, ...) array per tensor, indexed the engine's
    way: ``cache[layer, k_or_v, block, token]``."""
    layer = (jnp.arange(SEGMENTS) // 2)[:, None]
    k_or_v = (jnp.arange(SEGMENTS) % 2)[:, None]
    out, updated = [], []
    for t, cache in enumerate(caches):
        assert cache.shape[:2] == (LAYERS, 2) and cache.shape[3:] == BLOCK
        cache = cache.at[layer, k_or_v, blocks[t], tokens[t]].set(values[t])
        updated.append(cache)
        out.append(cache[layer, k_or_v, read_blocks[t], read_tokens[t]])
    return updated, jnp.stack(out)


LAYOUTS = {"per_segment": (_per_segment_fn, {}), "nd": (_nd_fn, {"segment_shape": (LAYERS, 2)})}


def _held(kv):
    """The committed blocks, read through fresh JAX imports (host or device memory):
    [tensor][segment] -> (committed, *BLOCK)."""
    return np.stack(
        [
            np.stack([np.array(v.to_jax()) for v in kv.committed_views(t, "float32", BLOCK)])
            for t in range(TENSORS)
        ]
    )


def _write_block(view, block, value):
    """Write ``value`` into ``block`` of ``view`` from outside the step, as torch or a
    transfer would: a driver copy from host memory, finished before the next step."""
    value = np.ascontiguousarray(value, np.float32)
    driver, index = view.owner.driver, view.device.index
    driver.copy(view.ptr + int(block) * BLOCK_BYTES, value.ctypes.data, BLOCK_BYTES, index)
    driver.synchronize(index)


def _random_slots(rng, committed, count, distinct=True):
    """``count`` (block, token) slots below ``committed`` blocks, per segment."""
    picks = np.stack(
        [
            rng.choice(committed * TOKENS, size=count, replace=not distinct)
            for _ in range(TENSORS * SEGMENTS)
        ]
    ).reshape(TENSORS, SEGMENTS, count)
    return (picks // TOKENS).astype(np.int32), (picks % TOKENS).astype(np.int32)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(3))
def test_steps_match_a_numpy_model_across_commits_releases_and_outside_writes(device, layout, seed):
    _skip_without_jax_gpu(device)
    fn, options = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    kv = _cache(device)
    step = KVCacheStep(kv, fn, "float32", BLOCK, **options)
    model = np.zeros((TENSORS, SEGMENTS, CAPACITY, *BLOCK), np.float32)
    buckets = set()
    try:
        for _ in range(40):
            committed = kv.num_blocks_committed
            action = rng.choice(["step", "step", "step", "grow", "release", "outside"])
            if action == "grow" and committed < CAPACITY:
                n = int(rng.integers(committed + 1, CAPACITY + 1))
                if rng.random() < 0.5:
                    kv.commit(n)
                else:
                    kv.ensure_blocks(n + 3)  # capped at the capacity
                committed = kv.num_blocks_committed
                model[:, :, committed:] = 0  # new blocks are zeroed; past them nothing held
            elif action == "release":
                kv.release_physical()
                assert kv.num_blocks_committed == 0
                kv.recommit()
                model[:] = 0  # recommitted zeroed
            elif action == "outside":  # the import reads the memory: a host write shows
                t, s = rng.integers(TENSORS), rng.integers(SEGMENTS)
                block = rng.integers(committed)
                value = rng.standard_normal(BLOCK).astype(np.float32)
                _write_block(kv.committed_views(int(t), "float32", BLOCK)[s], block, value)
                model[t, s, block] = value
            elif committed:
                blocks, tokens = _random_slots(rng, committed, WRITES)
                values = rng.standard_normal((TENSORS, SEGMENTS, WRITES, HEADS, DIM))
                values = values.astype(np.float32)
                read_blocks, read_tokens = _random_slots(rng, committed, READS, distinct=False)
                out = step(blocks, tokens, values, read_blocks, read_tokens)
                buckets.add(step.blocks)
                for t in range(TENSORS):
                    for s in range(SEGMENTS):
                        model[t, s, blocks[t, s], tokens[t, s]] = values[t, s]
                expected = model[
                    np.arange(TENSORS)[:, None, None],
                    np.arange(SEGMENTS)[None, :, None],
                    read_blocks,
                    read_tokens,
                ]
                np.testing.assert_array_equal(np.asarray(out), expected)
            np.testing.assert_array_equal(_held(kv), model[:, :, : kv.num_blocks_committed])
        assert len(buckets) >= 2 or step.in_place  # the walk crossed a bucket boundary
        compiled = step.compiled()
        assert compiled is None or compiled <= len(buckets)
        assert compiled is None or compiled <= math.ceil(math.log2(CAPACITY)) + 1
    finally:
        step.close()
        kv.free()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fn_sees_a_bucket_of_the_committed_blocks_not_the_capacity(layout):
    """On the CPU the step's cost follows the committed blocks: ``fn`` gets arrays of the
    smallest power of two at or above them (it used to get the whole capacity, which XLA
    copied every step)."""
    seen = []

    def fn(caches):
        seen.append([c.shape for c in caches])
        return caches, 0

    kv = _cache()
    step = KVCacheStep(kv, fn, "float32", BLOCK, **LAYOUTS[layout][1])
    try:
        assert step.in_place is False
        expected = {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 16: 16}
        for committed, blocks in expected.items():
            kv.commit(committed)
            assert step.blocks == blocks
            step()
            axis = 0 if layout == "per_segment" else 2
            assert {shape[axis] for shape in seen[-1]} == {blocks}
        kv.release_physical()
        assert step.blocks == 1  # nothing committed: one block, not an empty axis
        assert len(seen) == step.compiled() == 5  # traced once per bucket: 1, 2, 4, 8, 16
    finally:
        step.close()
        kv.free()


def test_the_engine_layout_is_one_array_per_tensor_over_its_planes():
    """``segment_shape=(L, 2)``: ``cache[l, kv, block]`` is segment ``2 * l + kv``'s block."""
    kv = _cache()
    kv.commit(3)
    held = np.arange(SEGMENTS * 3 * math.prod(BLOCK), dtype=np.float32)
    held = held.reshape(SEGMENTS, 3, *BLOCK)
    for s, view in enumerate(kv.committed_views(1, "float32", BLOCK)):
        np.from_dlpack(view)[:] = held[s]
    step = KVCacheStep(
        kv, lambda caches: (caches, caches[1][1, 0, 2]), "float32", BLOCK, segment_shape=(2, 2)
    )
    try:
        assert [c.shape for c in step.caches] == [(LAYERS, 2, CAPACITY, *BLOCK)] * TENSORS
        np.testing.assert_array_equal(np.asarray(step()), held[2, 2])  # layer 1, K: segment 2
    finally:
        step.close()
        kv.free()


# -- debug mode ----------------------------------------------------------------------------


def _writes_and_reads(caches, write_block, read_block):
    """Reads a block of the cache as the step found it, writes a token of another."""
    read = caches[0][0, 0, read_block].sum()
    return [caches[0].at[0, 0, write_block, 0].set(7.0), *caches[1:]], read


@pytest.mark.parametrize(
    "write_block, read_block",
    [(1, 5), (5, 1), (6, 6)],
    ids=["uncommitted-read", "uncommitted-write", "both"],
)
def test_debug_mode_raises_on_an_uncommitted_block_and_keeps_the_cache(
    device, write_block, read_block
):
    """Debug mode: a read or write of an uncommitted block raises ``IndexError`` naming the
    step and the committed count, and the step's writes to committed blocks are not copied
    back (without it, on the CPU, the read returns zeros and the write is dropped). On a GPU
    debug mode copies back too, over exactly the committed blocks."""
    _skip_without_jax_gpu(device)
    kv = _cache(device)
    kv.commit(5)  # bucket 8 on the CPU: blocks 5..7 are in the arrays without debug mode
    strict = KVCacheStep(kv, _writes_and_reads, "float32", BLOCK, segment_shape=(2, 2), debug=True)
    quiet = None
    try:
        for block in range(5):
            _write_block(kv.committed_views(0, "float32", BLOCK)[0], block, np.full(BLOCK, 3.0))
        before = _held(kv)
        assert strict.debug and strict.blocks == 5 and strict.in_place is False
        with pytest.raises(IndexError, match=r"KVCacheStep\(_writes_and_reads\).* 5 blocks"):
            strict(write_block, read_block)
        np.testing.assert_array_equal(_held(kv), before)  # nothing copied back
        strict(2, 3)  # a step within the committed blocks runs and copies back
        expected = before.copy()
        expected[0, 0, 2, 0] = 7.0
        np.testing.assert_array_equal(_held(kv), expected)
        if device != "cpu":
            return  # without debug mode a GPU faults on such a read
        # Without debug mode the CPU reads zeros there and drops the write.
        quiet = KVCacheStep(kv, _writes_and_reads, "float32", BLOCK, segment_shape=(2, 2))
        assert quiet.blocks == 8
        before = expected.copy()
        out = quiet(write_block, read_block)
        if write_block < 5:
            expected[0, 0, write_block, 0] = 7.0
        np.testing.assert_array_equal(_held(kv), expected)
        assert float(out) == (0.0 if read_block >= 5 else float(before[0, 0, read_block].sum()))
    finally:
        if quiet is not None:
            quiet.close()
        strict.close()
        kv.free()


def test_debug_mode_follows_the_environment_unless_told(monkeypatch):
    kv = _cache()
    kv.commit(3)
    options = {"segment_shape": (2, 2)}
    try:
        monkeypatch.setenv("JAXBUF_DEBUG", "1")
        step = KVCacheStep(kv, _writes_and_reads, "float32", BLOCK, **options)
        assert step.debug and step.blocks == 3
        with pytest.raises(IndexError, match="with 3 blocks committed"):
            step(0, 3)
        assert not KVCacheStep(kv, _nd_fn, "float32", BLOCK, debug=False, **options).debug
        monkeypatch.setenv("JAXBUF_DEBUG", "0")
        assert not KVCacheStep(kv, _nd_fn, "float32", BLOCK, **options).debug
        with pytest.raises(TypeError, match="debug must be True, False or None"):
            KVCacheStep(kv, _nd_fn, "float32", BLOCK, debug=1, **options)
    finally:
        kv.free()


def test_debug_mode_compiles_once_per_committed_count():
    kv = _cache()
    step = KVCacheStep(kv, _writes_and_reads, "float32", BLOCK, segment_shape=(2, 2), debug=True)
    try:
        for committed in (3, 4, 5, 5):
            kv.commit(committed)
            step(0, 1)
            assert step.blocks == committed
        assert step.compiled() in (None, 3)
    finally:
        step.close()
        kv.free()


# -- jit options ---------------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_jit_options_reach_jax_jit_and_keywords_reach_fn(debug):
    kv = _cache()
    kv.commit(4)
    calls = []

    def fn(caches, width, extra, scale=1.0):
        calls.append(width)
        ones = jnp.ones((width,), jnp.float32)  # width must be static: it is a shape
        cache = caches[0].at[0, 0, 1, 0, 0, :].set(ones[:DIM] * scale)
        return [cache, *caches[1:]], (extra * 2, ones.sum())

    common = {"segment_shape": (2, 2), "debug": debug}
    try:
        step = KVCacheStep(
            kv,
            fn,
            "float32",
            BLOCK,
            static_argnums=1,
            donate_argnums=2,
            compiler_options={},
            **common,
        )
        # On the cache's device: a GPU array beside a CPU cache would not be donated.
        with jax.default_device(jax.devices("cpu")[0]):
            extra = jnp.arange(4.0)
        (doubled, total) = step(5, extra, scale=3.0)
        assert extra.is_deleted()  # the extra argument was donated, on the CPU too
        np.testing.assert_array_equal(np.asarray(doubled), [0, 2, 4, 6])
        assert float(total) == 5
        assert (_held(kv)[0, 0, 1, 0, 0] == 3.0).all()
        step(5, jnp.arange(4.0), scale=1.0)
        step(6, jnp.arange(4.0))
        assert calls == [5, 6] and step.compiled() == 2  # one trace per static value
        by_name = KVCacheStep(kv, fn, "float32", BLOCK, static_argnames="width", **common)
        by_name(width=4, extra=jnp.zeros(2))
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        sharded = KVCacheStep(
            kv, fn, "float32", BLOCK, static_argnums=1, out_shardings=cpu, **common
        )
        assert sharded(4, jnp.zeros(2))[0].sharding == cpu
    finally:
        kv.free()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"donate_argnums": 0}, "donate_argnums / donate_argnames name the caches"),
        ({"donate_argnums": (2, 0)}, "cannot be donated by the caller"),
        ({"donate_argnames": "caches"}, r"argument 0, 'caches'"),
        ({"static_argnums": [0]}, "cannot be static"),
        ({"static_argnames": ("caches",)}, "cannot be static"),
        ({"static_argnums": -1}, "count fn's parameters from 0"),
    ],
)
def test_the_caller_cannot_make_the_caches_static_or_donate_them(options, message):
    kv = _cache()
    try:
        with pytest.raises(ValueError, match=message):
            KVCacheStep(kv, lambda caches, x=0: (caches, x), "float32", BLOCK, **options)
        with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
            KVCacheStep(kv, lambda caches: (caches, 0), "float32", no_such_option=1)
    finally:
        kv.free()


# -- segment_shape -------------------------------------------------------------------------


def test_a_block_shape_over_all_segments_points_at_segment_shape():
    """The engine's block, ``(L, 2, tokens, heads, dim)``, passed as ``block_shape``: the
    error says which ``segment_shape`` and ``block_shape`` to pass instead."""
    kv = _cache()
    try:
        with pytest.raises(
            ValueError,
            match=r"is 256 bytes, not the block's 64.*"
            r"pass segment_shape=\(2, 2\), block_shape=\(2, 2, 4\)",
        ):
            KVCacheStep(kv, _nd_fn, "float32", (LAYERS, 2, *BLOCK))
        with pytest.raises(ValueError, match=r"block_shape \(3,\)") as caught:
            KVCacheStep(kv, _nd_fn, "float32", (3,))
        assert "segment_shape" not in str(caught.value)
    finally:
        kv.free()


@pytest.mark.parametrize(
    "segment_shape, error, message",
    [
        ((3,), ValueError, r"segment_shape \(3,\) holds 3 segments; buffers\[0\] has 4"),
        ((2, 2, 2), ValueError, "holds 8 segments"),
        ((), ValueError, "at least one dimension"),
        ("LK", TypeError, "segment_shape must be an int or a sequence of ints"),
        ((2, -2), ValueError, "segment_shape"),
    ],
)
def test_a_segment_shape_that_does_not_fit_is_refused(segment_shape, error, message):
    kv = _cache()
    try:
        with pytest.raises(error, match=message):
            KVCacheStep(kv, _nd_fn, "float32", BLOCK, segment_shape=segment_shape)
    finally:
        kv.free()


def test_segments_that_are_not_back_to_back_planes_are_refused():
    """Segments with room beyond the capacity: one array over them would take that room as
    blocks, so ``segment_shape`` is refused and the per-segment layout still works."""
    tensor = ExtensibleTensor(2 * 2048, "cpu", num_segments=2)  # 2048 bytes each: 32 blocks
    kv = ExtensibleKVCacheBuffers([(tensor, BLOCK_BYTES)], CAPACITY)
    kv.commit(2)
    try:
        with pytest.raises(ValueError, match=r"not back-to-back planes of 16 blocks"):
            KVCacheStep(kv, _nd_fn, "float32", BLOCK, segment_shape=(2,))
        step = KVCacheStep(kv, lambda c: ([x + 1 for x in c], 0), "float32", BLOCK)
        step()
        assert all((np.from_dlpack(v) == 1).all() for v in kv.committed_views(0, "float32"))
        step.close()
    finally:
        kv.free()


# -- the faces' caches ---------------------------------------------------------------------


@pytest.mark.parametrize("face", ["jax", "torch"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_face_builders_cache_runs_a_step(face, layout):
    """The caches of ``jaxbuf.jax`` / ``jaxbuf.torch`` builders, whose views are arrays: the
    step takes their memory as it takes the neutral cache's."""
    module = pytest.importorskip(f"jaxbuf.{face}")
    fn, options = LAYOUTS[layout]
    kv = _cache("cpu", module.ExtensibleKVCacheBuilder)
    kv.commit(3)
    step = KVCacheStep(kv, fn, "float32", BLOCK, **options)
    try:
        blocks = np.full((TENSORS, SEGMENTS, 1), 2, np.int32)
        tokens = np.ones_like(blocks)
        values = np.full((TENSORS, SEGMENTS, 1, HEADS, DIM), 4.0, np.float32)
        out = step(blocks, tokens, values, blocks, tokens)
        np.testing.assert_array_equal(np.asarray(out), values)
        held = np.asarray(kv.committed_views(1, "float32", BLOCK)[3])  # a face's array
        assert (held[2, 1] == 4.0).all() and held.sum() == 4.0 * HEADS * DIM
    finally:
        step.close()
        kv.free()


# -- failures ------------------------------------------------------------------------------


def test_a_failed_write_back_raises_and_the_step_stays_usable():
    """The driver's batched copy failing: the step raises the driver's error, the cache
    keeps the values it held (the copy did not start), and the next step works."""
    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.drivers.base import DriverError
    from jaxbuf.testing import FaultInjectingDriver

    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    builder = ExtensibleKVCacheBuilder(CAPACITY, "cpu", driver=driver)
    for _ in range(TENSORS):
        builder.reserve(CAPACITY * BLOCK_BYTES * SEGMENTS, SEGMENTS)
    kv = builder.finish()
    kv.commit(3)
    step = KVCacheStep(
        kv, lambda caches, v: ([c + v for c in caches], 0), "float32", BLOCK, segment_shape=(2, 2)
    )
    try:
        step(1.0)
        driver.fail_on("copy_batch")
        with pytest.raises(DriverError):
            step(10.0)
        np.testing.assert_array_equal(_held(kv), np.ones((TENSORS, SEGMENTS, 3, *BLOCK)))
        step(2.0)
        np.testing.assert_array_equal(_held(kv), np.full((TENSORS, SEGMENTS, 3, *BLOCK), 3.0))
    finally:
        step.close()
        kv.free()


STRICT_DRIVER_STEP = """
import numpy as np
from jaxbuf import ExtensibleKVCacheBuilder
from jaxbuf.drivers.host import HostVmmDriver
from jaxbuf.kv import KVCacheStep

builder = ExtensibleKVCacheBuilder(64, "cpu", driver=HostVmmDriver(debug=True))
builder.reserve(64 << 20, num_segments=1)  # 1 MiB blocks: 2 MiB granules
kv = builder.finish()
kv.commit(5)  # 6 MiB mapped; a bucket of 8 blocks would reach 2 MiB of PROT_NONE


def write(caches):
    cache = caches[0].at[4, 0].set(7.0)
    return [cache], cache[4, 0]


step = KVCacheStep(kv, write, "float32")
assert step.blocks == 5, step.blocks
assert float(step()) == 7.0
assert kv.committed_views(0, "float32")[0].to_numpy()[4, 0] == 7.0
step.close()
kv.free()
print("ok")
"""


def test_a_strict_cpu_driver_gets_exactly_the_committed_blocks():
    # The driver's debug mode maps uncommitted memory with no access: a bucket's slice past
    # the committed blocks would fault there even when the step itself is not in debug mode.
    import os
    import sys

    import _forkserver

    env = {k: v for k, v in os.environ.items() if k != "JAXBUF_DEBUG"}
    result = _forkserver.run([sys.executable, "-c", STRICT_DRIVER_STEP], timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.split() == ["ok"], result.stderr[-2000:]
