# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A transformer decoding over a growing paged KV cache
#
# The loop an inference engine runs, written in JAX over jaxbuf, and checked against the
# same model over a preallocated JAX cache:
#
# * a small **decoder-only transformer** with random weights (2 layers, 4 heads of 32,
#   float32, a fixed seed) decodes with **paged attention**: per layer, the new token's K/V
#   goes to its slot (the block its request's block table names, at `position % 16`), each
#   request's blocks are gathered through its block table, attention is a masked softmax over
#   its length, then an MLP, and the logits give the next token (greedy);
# * the **KV cache** is one tensor in the engine's layout, `(layers, 2, blocks, 16, heads,
#   head_dim)`: an `ExtensibleKVCacheBuilder` reserves it for the whole capacity, and the
#   cache commits memory in whole blocks (`ensure_blocks`) as requests need them;
# * **requests arrive** over the run; a **torch prefill** (the same weights) computes each
#   prompt's K/V and writes them into the cache through its torch view: no copy, no JAX;
# * the **step** is a `KVCacheStep` over the cache in that layout, and the per-request
#   metadata (position, token, and the block table as a 2-D field) lives in a
#   `DeviceParamTable`, synced once per step.
#
# The model and the host's bookkeeping (which row a request takes, which block a token
# goes to) are shared with the `jax.paged_decode` benchmark, in `jaxbuf.bench._paged_model`.
# The jaxbuf parts are written out below.

# %%
import os

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import statistics

import numpy as np
import torch

import jaxbuf
from jaxbuf.bench import _paged_model as model
from jaxbuf.kv import KVCacheStep

device = jaxbuf.default_device()
config = model.PagedConfig()  # 2 layers, 4 heads of 32, blocks of 16 tokens, 4 requests
weights = model.init_weights(config)  # numpy, fixed seed
jax_weights = model.jax_weights(weights, device)
torch_weights = model.torch_weights(weights, device)  # the same values (zero-copy on the CPU)
print(device, "|", config)
print(f"one block: {config.block_bytes // 1024} KiB over {config.layers * 2} segments (K, V)")

# %% [markdown]
# ## The model
#
# `model.decode_step(config)` is a plain JAX function `step(cache, meta, weights) -> (cache,
# logits)` over a cache of shape `(layers, 2, blocks, 16, heads, head_dim)`. It indexes
# blocks only through the block table, so it runs over any number of blocks that covers the
# ids in use. `model.prefill_kv` is the same model in torch over a whole prompt (causal
# attention), returning its K/V.

# %%
step_fn = model.decode_step(config)
schedule = model.arrivals(config, steps=24)
for arrival in schedule:
    print(f"step {arrival.step:2d}: request in row {arrival.row}, {len(arrival.prompt)} tokens")

# %% [markdown]
# ## The jaxbuf cache, its step and its table
#
# One KV-cache tensor of `layers * 2` segments (segment `2 * l + c` holds plane `c`, K or V,
# of layer `l`), reserved for `capacity` blocks. `finish()` commits one block: block 0, the
# scratch block that rows without a request decode into. The torch view over the whole
# reservation is made once; committing never moves an address, so it stays valid as the
# cache grows (touch only committed blocks).
#
# `KVCacheStep(..., segment_shape=(layers, 2))` hands the step function the tensor as one
# array in the engine's layout, `(layers, 2, blocks, 16, heads, head_dim)`: the model runs
# unchanged. `blocks` is the capacity where JAX writes the cache in place (a GPU); on the CPU
# it is a power of two at or above the committed blocks, so a step costs what the cache
# holds, not what it could hold (the model indexes blocks only through the block table).
#
# The table's `block_table` field is 2-D: `rows x max_blocks`. `table.arrays("jax")` is a
# live mapping (a pytree): passed to each step, it gives the values of the last `sync()`.

# %%
capacity = 1024
builder = jaxbuf.ExtensibleKVCacheBuilder(capacity, device)
builder.reserve(capacity * config.block_bytes, num_segments=config.layers * 2)
kv = builder.finish()
torch_cache = kv.full_view(0).to_torch(torch.float32, config.cache_shape(capacity))
fields = {"position": "int32", "token": "int32", "block_table": ("int32", config.max_blocks)}
table = jaxbuf.DeviceParamTable(config.rows, fields, device)
meta = table.arrays("jax")  # the same mapping every call: each step gets the last sync()


def jaxbuf_step(caches, meta, weights):
    """The KVCacheStep function: one array per KV tensor (here one), the model."""
    cache, logits = step_fn(caches[0], meta, weights)
    return [cache], logits


step = KVCacheStep(
    kv, jaxbuf_step, "float32", config.block_shape, segment_shape=config.segment_shape
)
print(kv)
print("the step writes the cache in place:", step.in_place, "(else: committed blocks copied back)")

# %% [markdown]
# ## The loop, beside the preallocated cache
#
# Each step: admit the requests arriving (their rows, their prompt blocks) and write their
# prefill K/V from torch; commit the blocks in use (`ensure_blocks`: no-op when nothing is
# new); write the metadata's host values and `sync()` (one copy); run the step. The
# preallocated cache (`model.PreallocatedCache`: a `jnp.zeros` of the full capacity, the step
# jitted with the cache donated, the metadata put on the device) runs the same requests, and
# every step's logits must be equal, bit for bit.

# %%
requests = model.Requests(config)  # the jaxbuf loop's bookkeeping
baseline = model.PreallocatedCache(config, capacity, device)
baseline_requests = model.Requests(config)
steps = 24
for n in range(steps):
    for arrival in (a for a in schedule if a.step == n):
        blocks, offsets = requests.admit(arrival)
        kv.ensure_blocks(requests.blocks_used)  # before torch writes the new blocks
        prefill = model.prefill_kv(config, torch_weights, arrival.prompt)  # [L, 2, n-1, H, D]
        torch_cache[:, :, torch.as_tensor(blocks), torch.as_tensor(offsets)] = prefill
        baseline.write_prefill(prefill, *baseline_requests.admit(arrival))
    if device.is_cuda:
        torch.cuda.synchronize()  # torch's writes before the JAX step (another stream)
    kv.ensure_blocks(requests.blocks_used)
    table["position"].np[:] = requests.position
    table["token"].np[:] = requests.token
    table["block_table"].np[:] = requests.block_table
    table.sync()
    logits = np.asarray(step(meta, jax_weights))
    expected = np.asarray(baseline.step(baseline_requests, jax_weights))
    assert np.array_equal(logits, expected), f"step {n}: logits differ"
    if n % 6 == 0 or n == steps - 1:
        print(
            f"step {n:2d}: positions {requests.position.tolist()}, "
            f"{kv.num_blocks_committed} blocks committed, the step's arrays of {step.blocks}"
        )
    requests.advance(logits)
    baseline_requests.advance(expected)
print("logits equal at every step, bit for bit")

# %% [markdown]
# ## The caches agree
#
# The committed blocks hold the same values in both caches: the prefill K/V torch wrote, and
# every token's K/V the steps wrote.

# %%
committed = kv.num_blocks_committed
ours = torch_cache[:, :, :committed].cpu().numpy()
theirs = baseline.committed(committed)
assert np.array_equal(ours, theirs)
print(f"{committed} committed blocks equal; max |value| {np.abs(ours).max():.2f}")
print(
    f"held: jaxbuf {kv.physical_bytes / 2**20:.0f} MiB committed, preallocated "
    f"{baseline.bytes_held / 2**20:.0f} MiB"
)

# %% [markdown]
# ## Step time and memory at three capacities
#
# The same loop through the benchmark's classes (`model.JaxbufCache` is the code above), a
# short run at each capacity, the two caches stepped in lockstep. A step's time is its
# metadata upload, the step and the wait for its logits (the first run compiles, untimed).
# `python -m jaxbuf bench --only jax.paged_decode` runs the longer version.

# %%
step.close()
table.close()
del meta, torch_cache
kv.free()
baseline.close()

print("capacity (blocks) | step: jaxbuf | preallocated | held: jaxbuf | preallocated")
for capacity in (64, 1024, 4096):
    caches = {
        "jaxbuf": model.JaxbufCache(config, capacity, device),
        "preallocated": model.PreallocatedCache(config, capacity, device),
    }
    try:
        model.run(caches, config, 8, (jax_weights, torch_weights))  # compiles
        for cache in caches.values():
            cache.reset()
        traces = model.run(caches, config, 8, (jax_weights, torch_weights))
        model.check_agreement(caches, traces, "preallocated")
    finally:
        for cache in caches.values():
            cache.close()
    ms = {name: 1e3 * statistics.median(t.step_s) for name, t in traces.items()}
    held = {name: max(t.bytes_held) / 2**20 for name, t in traces.items()}
    print(
        f"{capacity:>17,} | {ms['jaxbuf']:9.2f} ms | {ms['preallocated']:9.2f} ms | "
        f"{held['jaxbuf']:8.0f} MiB | {held['preallocated']:8.0f} MiB"
    )
