"""The flagship decode loop of ``jax.paged_decode`` and ``notebooks/06_paged_decode``
(:mod:`jaxbuf.bench._paged_model`): the torch prefill is the model the JAX step runs, the
host bookkeeping hands every token its own slot, and the agreement check catches a cache or
a step that differs. The suite's rows are checked from the quick bench run of
``tests/test_bench_jax.py``."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import JAX_REASON, TORCH_REASON

from jaxbuf.bench import _paged_model as model
from jaxbuf.devices import as_device

needs_both = pytest.mark.skipif(
    JAX_REASON is not None or TORCH_REASON is not None,
    reason=JAX_REASON or TORCH_REASON or "",
)
CPU = as_device("cpu")


def test_requests_give_every_token_its_own_slot():
    """Over a whole run (arrivals, argmax tokens, blocks handed out as positions cross block
    boundaries), each request's tokens sit in blocks of its own, never in the scratch block,
    and ``blocks_used`` covers every id in the table."""
    config = model.PagedConfig()
    steps = 24
    requests = model.Requests(config)
    owner: dict[tuple[int, int], int] = {}  # (block, offset) -> row
    rng = np.random.default_rng(0)
    for n in range(steps):
        for arrival in model.arrivals(config, steps):
            if arrival.step == n:
                blocks, offsets = requests.admit(arrival)
                assert len(blocks) == len(arrival.prompt) - 1
                for slot in zip(blocks.tolist(), offsets.tolist()):
                    assert owner.setdefault(slot, arrival.row) == arrival.row
        for row in range(config.rows):
            p = int(requests.position[row])
            block = int(requests.block_table[row, p // config.block_tokens])
            if requests.active[row]:
                assert block != 0
                slot = (block, p % config.block_tokens)
                assert owner.setdefault(slot, row) == row, (n, row, slot)
            else:  # a placeholder: block 0, its own offset
                assert (block, p) == (0, row)
        assert requests.block_table.max() < requests.blocks_used
        requests.advance(rng.standard_normal((config.rows, config.vocab)))
    assert requests.active.all()
    with pytest.raises(ValueError, match="row 0 already holds a request"):
        requests.admit(model.Arrival(0, 0, (1, 2)))


@needs_both
def test_the_torch_prefill_is_the_model_the_jax_step_runs():
    """The prefill's K/V of a prompt equal, to float32 rounding, what the JAX step writes
    when it decodes the same prompt one token at a time (a different summation order:
    torch's causal matmuls against XLA's gathers)."""
    import jax

    config = model.PagedConfig(rows=1)
    weights = model.init_weights(config)
    jax_w, torch_w = model.jax_weights(weights, CPU), model.torch_weights(weights, CPU)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, config.vocab, 37)]
    expected = model.prefill_kv(config, torch_w, prompt).numpy()  # [L, 2, 36, H, D]
    blocks = 1 + -(-len(prompt) // config.block_tokens)
    table = np.zeros((1, config.max_blocks), np.int32)
    table[0, : blocks - 1] = np.arange(1, blocks)
    step = jax.jit(model.decode_step(config))
    cache = jax.numpy.zeros(config.cache_shape(blocks), jax.numpy.float32)
    for position, token in enumerate(prompt[:-1]):
        meta = {
            "position": np.array([position], np.int32),
            "token": np.array([token], np.int32),
            "block_table": table,
        }
        cache, _ = step(cache, meta, jax_w)
    positions = np.arange(len(prompt) - 1)
    got = np.asarray(cache)[
        :, :, table[0, positions // config.block_tokens], positions % config.block_tokens
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@needs_both
def test_agreement_is_exact_and_catches_a_difference():
    """jaxbuf's cache and the preallocated one give the same logits at every step and hold
    the same committed blocks, bit for bit; one changed value in the cache, or in one step's
    logits, fails the check."""
    config = model.PagedConfig()
    weights = model.init_weights(config)
    both = (model.jax_weights(weights, CPU), model.torch_weights(weights, CPU))
    caches = {
        "jaxbuf": model.JaxbufCache(config, 64, CPU),
        "preallocated": model.PreallocatedCache(config, 64, CPU),
    }
    try:
        traces = model.run(caches, config, 8, both)
        model.check_agreement(caches, traces, "preallocated")
        jaxbuf = traces["jaxbuf"]
        assert jaxbuf.blocks == traces["preallocated"].blocks and jaxbuf.blocks[-1] > 1
        assert jaxbuf.bytes_held[-1] == caches["jaxbuf"].kv.physical_bytes
        assert set(traces["preallocated"].bytes_held) == {64 * config.block_bytes}
        # Every row decoded real tokens: the logits change from step to step.
        assert not np.array_equal(jaxbuf.logits[0], jaxbuf.logits[-1])
        jaxbuf.logits[3] = jaxbuf.logits[3].copy()
        jaxbuf.logits[3][1, 7] += 1e-6
        with pytest.raises(AssertionError, match="jaxbuf: step 3's logits differ"):
            model.check_agreement(caches, traces, "preallocated")
        jaxbuf.logits[3][1, 7] -= 1e-6
        model.check_agreement(caches, traces, "preallocated")
        caches["jaxbuf"].torch_cache[1, 0, jaxbuf.blocks[-1] - 1, 0, 0, 0] += 1.0
        with pytest.raises(AssertionError, match="jaxbuf: the committed cache differs"):
            model.check_agreement(caches, traces, "preallocated")
    finally:
        for cache in caches.values():
            cache.close()
