"""The JAX side of the KV cache: a jitted decode step over ``ExtensibleKVCacheBuffers`` that
writes the cache's memory (in place where JAX writes donated imports in place), reads
``DeviceParamTable`` fields imported once, and stays one compiled step while the cache
grows; checked against a numpy model of the cache."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbuf import DeviceParamTable, ExtensibleKVCacheBuilder

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jaxbuf.kv import KVCacheStep, donation_in_place  # noqa: E402


@pytest.fixture(autouse=True)
def _no_debug_from_the_environment(monkeypatch):
    """These tests say when they want debug mode: a JAXBUF_DEBUG set for the run would
    change the blocks and executables they count."""
    monkeypatch.delenv("JAXBUF_DEBUG", raising=False)


SEQS, BLOCK, HEAD, CAPACITY = 2, 4, 16, 8  # tokens per block, head size, blocks
MAX_TOKENS = 12  # per sequence: three blocks each, plus block 0 as scratch = 7 blocks


def _decode(caches, params, block_table, new_kv):
    """Append each sequence's K/V at its slot, then attend over its tokens."""
    cache = caches[0].at[params["page"], params["offset"]].set(new_kv)  # [blocks, B, 2, H]
    t = jnp.arange(MAX_TOKENS)
    kv = cache[block_table[:, t // BLOCK], t % BLOCK]  # [seqs, tokens, 2, head]
    q = new_kv[:, 0] * params["scale"][:, None]
    scores = jnp.einsum("sh,sth->st", q, kv[:, :, 0])
    valid = t[None, :] < params["length"][:, None]
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    return [cache], jnp.einsum("st,sth->sh", weights, kv[:, :, 1])


def _reference(model, block_table, lengths, new_kv, scale):
    out = np.zeros((SEQS, HEAD), np.float32)
    for s in range(SEQS):
        t = np.arange(lengths[s])
        kv = model[block_table[s, t // BLOCK], t % BLOCK]
        scores = kv[:, 0] @ (new_kv[s, 0] * scale[s])
        w = np.exp(scores - scores.max())
        out[s] = (w / w.sum()) @ kv[:, 1]
    return out


def _run_decode(device):
    builder = ExtensibleKVCacheBuilder(CAPACITY, device)
    builder.reserve(CAPACITY * BLOCK * 2 * HEAD * 4, 1)
    kv = builder.finish()  # block 0: the scratch block the table's padding points at
    table = DeviceParamTable(
        SEQS,
        {"page": "int32", "offset": "int32", "length": "int32", "scale": "float32"},
        device,
    )
    step = KVCacheStep(kv, _decode, "float32", (BLOCK, 2, HEAD))
    try:
        params = table.arrays("jax")  # imported once
        table["scale"].np[:] = [0.5, 0.25]
        model = np.zeros((CAPACITY, BLOCK, 2, HEAD), np.float32)
        block_table = np.zeros((SEQS, MAX_TOKENS // BLOCK), np.int32)
        rng = np.random.default_rng(0)
        next_page, grows = 1, 0
        for position in range(MAX_TOKENS):
            if position % BLOCK == 0:  # every sequence starts a block: new pages
                for s in range(SEQS):
                    block_table[s, position // BLOCK] = next_page
                    next_page += 1
                before = kv.num_blocks_committed
                kv.ensure_blocks(next_page)
                grows += kv.num_blocks_committed > before
            pages = block_table[:, position // BLOCK]
            table["page"].np[:] = pages
            table["offset"].np[:] = position % BLOCK
            table["length"].np[:] = position + 1
            assert table.sync()
            new_kv = rng.standard_normal((SEQS, 2, HEAD)).astype(np.float32)
            out = step(params, jnp.asarray(block_table), jnp.asarray(new_kv))
            model[pages, position % BLOCK] = new_kv
            expected = _reference(model, block_table, table["length"].np, new_kv, [0.5, 0.25])
            np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)
        assert grows == 3 and kv.num_blocks_committed == next_page == 7
        # One compiled step per bucket the grows crossed (3 -> 4 blocks, 5 and 7 -> 8), one in
        # place over the capacity.
        assert step.compiled() in (None, 1 if step.in_place else 2)
        assert table.arrays("jax") is params
        # The cache's memory holds every K/V written, block by block.
        (view,) = kv.committed_views(0, "float32", (BLOCK, 2, HEAD))
        held = np.from_dlpack(view, device="cpu", copy=True)
        np.testing.assert_array_equal(held, model[: kv.num_blocks_committed])
        return step.in_place
    finally:
        step.close()
        table.close()
        kv.free()


def test_decode_steps_write_the_cache_and_stay_compiled_once():
    assert _run_decode("cpu") is False  # JAX's CPU client copies donated imports


@pytest.mark.gpu
def test_decode_steps_run_in_place_on_a_gpu(cuda_device):
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (default backend {jax.default_backend()})")
    assert donation_in_place(cuda_device)
    assert _run_decode(cuda_device) is True


def test_the_step_checks_what_fn_returns_and_refuses_once_closed():
    builder = ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    builder.reserve(CAPACITY * 1024, 2)
    kv = builder.finish()
    try:
        step = KVCacheStep(kv, lambda caches: (caches[:1], 0), "float32")
        with pytest.raises(ValueError, match="returned 1 caches, expected 2"):
            step()
        assert [c.shape for c in step.caches] == [(CAPACITY, 128)] * 2
        step.close()
        with pytest.raises(RuntimeError, match="closed"):
            step()
        with pytest.raises(TypeError, match="ExtensibleKVCacheBuffers"):
            KVCacheStep(object(), _decode, "float32")
        with pytest.raises(TypeError, match="callable"):
            KVCacheStep(kv, None, "float32")
        with pytest.raises(ValueError, match="block_shape"):
            KVCacheStep(kv, _decode, "float32", (3,))
    finally:
        kv.free()


@pytest.mark.parametrize(
    "wrong, error, message",
    [
        (lambda c: c[:1], ValueError, r"caches\[1\] of shape \(1, 128\); it was passed \(8, 128\)"),
        (lambda c: c.astype(jnp.float16), TypeError, r"caches\[1\] of dtype float16"),
        (lambda c: c.T, ValueError, r"caches\[1\] of shape \(128, 8\)"),
        (lambda c: c.reshape(-1), ValueError, r"caches\[1\] of shape \(1024,\)"),
    ],
    ids=["prefix", "dtype", "transpose", "flat"],
)
def test_an_output_the_cache_cannot_take_is_refused_before_any_byte_is_copied(
    wrong, error, message
):
    """``fn`` returning a cache of another shape, dtype or layout: an error naming it, and
    the cache keeps its values (a numpy model), where the unchecked copy read past the
    output (a prefix, a narrower dtype) or copied it scrambled (a transpose)."""
    builder = ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    builder.reserve(CAPACITY * 1024, 2)
    kv = builder.finish()
    kv.commit(CAPACITY)
    try:
        good = KVCacheStep(kv, lambda caches, value: ([c + value for c in caches], 0), "float32")
        good(jnp.float32(1.5))
        model = [np.full((CAPACITY, 128), 1.5, np.float32)] * 2
        bad = KVCacheStep(kv, lambda caches: ([caches[0] + 1, wrong(caches[1] + 1)], 0), "float32")
        with pytest.raises(error, match=message):
            bad()
        held = [np.from_dlpack(v, device="cpu", copy=True) for v in kv.layer_views("float32")]
        for got, expected in zip(held, model):
            np.testing.assert_array_equal(got, expected)
        good(jnp.float32(1.0))  # the cache and the good step still work
        held = np.from_dlpack(kv.layer_views("float32")[1], device="cpu", copy=True)
        np.testing.assert_array_equal(held, model[1] + 1.0)
        good.close()
        bad.close()
    finally:
        kv.free()


def test_a_step_over_a_freed_cache_raises_closed_error():
    """Freeing the cache under a step: the next call raises ``ClosedError`` and runs nothing
    (it used to run and drop every write)."""
    from jaxbuf import ClosedError

    builder = ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    builder.reserve(CAPACITY * 1024, 1)
    kv = builder.finish()
    calls = []

    def fn(caches):
        calls.append(1)
        return [c + 1 for c in caches], 0

    step = KVCacheStep(kv, fn, "float32")
    kv.free()
    with pytest.raises(ClosedError, match="ExtensibleKVCacheBuffers has been freed"):
        step()
    assert calls == []  # not even traced
    step.close()
    with pytest.raises(ClosedError, match="KVCacheStep has been closed"):
        step()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_in_flight_reads_the_old_values(device):
    """A step still running when the host changes a value and syncs computes with the value
    it was dispatched with, and the next step sees the new one: on the CPU the upload waits
    for the steps JAX dispatched; on CUDA the copy is ordered on the legacy default stream,
    after the work on JAX's stream and before what JAX enqueues later."""
    if device == "cuda" and jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (default backend {jax.default_backend()})")
    size, rounds = (384, 30) if device == "cpu" else (4096, 200)
    table = DeviceParamTable(4, {"scale": "float32"}, device)
    try:
        table["scale"].np[:] = 1.0
        table.sync()
        params = table.arrays("jax")

        @jax.jit
        def slow(p, x):
            x = jax.lax.fori_loop(0, rounds, lambda _, y: jnp.tanh(y @ y), x)
            return x.sum() * 0 + p["scale"]

        x = jax.device_put(jnp.full((size, size), 1e-3, jnp.float32), params["scale"].device)
        slow(params, x).block_until_ready()  # compiled
        out = slow(params, x)  # dispatched, still running
        table["scale"].np[:] = 2.0
        table.sync()
        np.testing.assert_array_equal(np.asarray(out), 1.0)
        np.testing.assert_array_equal(np.asarray(slow(params, x)), 2.0)
    finally:
        table.close()
