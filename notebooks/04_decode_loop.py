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
# # A decode loop: paged KV cache, staged block table, UVA metadata
#
# This notebook ties the pieces together in a toy decode loop written in JAX:
#
# * the **KV cache** lives in one `ExtensibleTensor` with two segments (K and V). It reserves
#   room for every page up front and commits physical memory a page at a time, when a
#   sequence crosses a block boundary. Its base pointer never moves;
# * the **block table** (`num_seqs x max_blocks`, int32) is a `StagedWriteTensor`: a new page
#   is staged on the host and applied with one launch per step (none when nothing changed);
# * the per-step **metadata** (sequence lengths, the slot of each new token) comes from a
#   `UvaBufferPool`: pinned host memory that the jitted step reads in place;
# * a **torch** function reads the same cache and block table to check JAX's results.
#
# The "model" is a toy: each step makes one new K/V vector per sequence (a fixed function of
# sequence and position, so the cache's contents can be checked), writes it into the cache,
# and computes an attention-like reduction over each sequence's cached tokens in JAX.

# %%
import os

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jaxbuf

device = jaxbuf.default_device()
if device.platform == "cpu":
    # No GPU: run Triton kernels under its interpreter. Must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import torch

from jaxbuf.staged import StagedWriteTensor

torch_device = torch.device("cuda", device.index) if device.is_cuda else torch.device("cpu")
MiB = 1 << 20


def sync():
    """Order torch's work before JAX's reads (on a GPU they use different streams)."""
    if device.is_cuda:
        torch.cuda.synchronize(torch_device)


print("device:", device, "| torch device:", torch_device)

# %% [markdown]
# ## Sizes
#
# A page holds `BLOCK` tokens of one sequence. Its size is one commit granule (2 MiB), so
# each new page commits new physical memory and the plot below shows the cache growing. The
# per-token vector size `DIM` follows from that.

# %%
num_seqs, max_blocks, BLOCK = 4, 4, 16
granule = jaxbuf.granule_size(device)
page_bytes = granule
DIM = page_bytes // (BLOCK * 4)  # float32 elements per token vector
max_pages = num_seqs * max_blocks
max_tokens = max_blocks * BLOCK
print(
    f"{BLOCK} tokens x {DIM} float32 per page = {page_bytes // MiB} MiB; "
    f"up to {max_pages} pages per segment"
)

# %% [markdown]
# ## The cache, the block table, the metadata pool
#
# The cache reserves `max_pages` pages per segment (address space only) and commits nothing
# yet. Page *p* holds cache rows `p * BLOCK ... p * BLOCK + BLOCK - 1`; token *t* of sequence
# *s* lives in row `block_table[s, t // BLOCK] * BLOCK + t % BLOCK`.

# %%
cache = jaxbuf.ExtensibleTensor(
    2 * max_pages * page_bytes, device=device, segment_capacities=[max_pages * page_bytes] * 2
)
block_table = StagedWriteTensor((num_seqs, max_blocks), "int32", device=device)
bt_jax = block_table.to_jax()  # aliases the table: every step reads the latest entries
bt_torch = block_table.to_torch()
meta_pool = jaxbuf.UvaBufferPool((num_seqs, 2), "int32", device=device, framework="jax")
print(cache)
print(block_table)

# %% [markdown]
# The page allocator: hand out the next page, stage its block-table entry, and grow both
# segments by whole pages. Growing never moves the base pointer, so block-table entries
# (page numbers) and views taken earlier stay valid; only the committed *length* changes, so
# the framework views of the committed rows are re-made after a grow.

# %%
num_pages = 0


def allocate_page(seq, block):
    global num_pages
    page = num_pages
    block_table.stage_write(seq, block, [page])  # bounds-checked first: raises if full
    cache.resize_segments_([(page + 1) * page_bytes] * 2)
    num_pages += 1
    return page


def cache_views():
    """(K, V) as torch and JAX arrays over the committed rows, zero-copy."""
    rows = num_pages * BLOCK
    k, v = (cache.segment_view(i) for i in (0, 1))
    return (
        (
            k.to_torch(dtype=torch.float32, shape=(rows, DIM)),
            v.to_torch(dtype=torch.float32, shape=(rows, DIM)),
        ),
        (
            k.to_jax(dtype=jnp.float32, shape=(rows, DIM)),
            v.to_jax(dtype=jnp.float32, shape=(rows, DIM)),
        ),
    )


def slot_of(seq, pos):
    """Cache row of token ``pos`` of ``seq`` (host side, from the allocator's records)."""
    return pages_of[seq][pos // BLOCK] * BLOCK + pos % BLOCK


pages_of = [[] for _ in range(num_seqs)]

# %% [markdown]
# ## The model, in JAX
#
# `make_kv` is the toy projection: the K/V vectors of tokens at given positions.
# `attend` gathers each sequence's cached K/V rows through the block table (an int32 JAX
# array aliasing the `StagedWriteTensor`), masks positions past the sequence length (from
# the UVA metadata), and reduces: softmax(K q) V. A query is a function of the length.

# %%
freqs = jnp.linspace(0.01, 1.0, DIM, dtype=jnp.float32)


@jax.jit
def make_kv(seqs, positions):
    angle = (positions[:, None] + 1).astype(jnp.float32) * freqs + seqs[:, None]
    return jnp.sin(angle), jnp.cos(angle)


def query(lengths):
    return jnp.cos(lengths[:, None].astype(jnp.float32) * freqs)


@jax.jit
def attend(k_cache, v_cache, block_table, meta):
    lengths = meta[:, 0]
    t = jnp.arange(max_tokens)
    rows = block_table[:, t // BLOCK] * BLOCK + t % BLOCK  # [seqs, tokens]
    valid = t[None, :] < lengths[:, None]
    rows = jnp.where(valid, rows, 0)  # unused entries point at row 0: read, then masked
    q = query(lengths)
    scores = jnp.einsum("std,sd->st", k_cache[rows], q) / jnp.sqrt(DIM)
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    return jnp.einsum("st,std->sd", weights, v_cache[rows])


# %% [markdown]
# The K/V writes go through torch: `index_copy_` on torch views of the two segments, in
# place, on every platform. (Writing them from JAX needs a jitted step that donates the
# imported cache array: on a GPU that step writes jaxbuf memory in place, but its result is
# no longer tracked by jaxbuf (see the README's "Limits"); JAX's CPU client copies a donated
# import instead, so the cache would not change. Small tables updated inside `jit` use
# `jaxbuf.jax_ops`, see notebook 3.)


# %%
def write_kv(k_torch, v_torch, seqs, positions, slots):
    k_new, v_new = make_kv(jnp.asarray(seqs, jnp.int32), jnp.asarray(positions, jnp.int32))
    k_new.block_until_ready()
    index = torch.as_tensor(np.asarray(slots, np.int64), device=torch_device)
    k_torch.index_copy_(0, index, torch.from_dlpack(k_new))
    v_torch.index_copy_(0, index, torch.from_dlpack(v_new))


# %% [markdown]
# ## The torch check
#
# A torch function that reads the same memory: it gathers each sequence's K rows through the
# block table (a torch tensor over the `StagedWriteTensor`) and compares them with what
# `make_kv` says they must be, then recomputes the attention and compares with JAX's output.


# %%
def torch_check(k_torch, v_torch, lengths, jax_out):
    t = torch.arange(max_tokens, device=torch_device)
    worst_row, worst_out = 0.0, 0.0
    for s in range(num_seqs):
        n = int(lengths[s])
        # ruff sees the last cell's `del bt_torch`, not the order in which cells run.
        rows = bt_torch[s, t[:n] // BLOCK].long() * BLOCK + t[:n] % BLOCK  # noqa: F821
        k_rows, v_rows = k_torch[rows], v_torch[rows]
        k_want, _ = make_kv(jnp.full((n,), s, jnp.int32), jnp.arange(n, dtype=jnp.int32))
        worst_row = max(
            worst_row, float((k_rows.cpu() - torch.from_dlpack(k_want).cpu()).abs().max())
        )
        q = torch.cos(
            torch.tensor(float(n), device=torch_device) * torch.from_dlpack(freqs).to(torch_device)
        )
        out = torch.softmax(k_rows @ q / DIM**0.5, dim=0) @ v_rows
        jax_row = torch.from_dlpack(np.asarray(jax_out[s]))
        worst_out = max(worst_out, float((out.cpu() - jax_row).abs().max()))
    return worst_row, worst_out


# %% [markdown]
# ## Prefill
#
# Four sequences of different lengths: allocate their pages, apply the block table (one
# launch for all of them), write their K/V.

# %%
lengths = np.array([13, 5, 30, 40], dtype=np.int64)
for s, n in enumerate(lengths):
    for block in range(-(-int(n) // BLOCK)):
        pages_of[s].append(allocate_page(s, block))
print("staged block-table writes:", block_table.num_staged_writes)
block_table.apply_write()
(k_torch, v_torch), (k_jax, v_jax) = cache_views()
seqs = np.repeat(np.arange(num_seqs), lengths)
positions = np.concatenate([np.arange(n) for n in lengths])
write_kv(k_torch, v_torch, seqs, positions, [slot_of(s, p) for s, p in zip(seqs, positions)])
sync()
print("pages:", num_pages, "| committed:", cache.physical_bytes // MiB, "MiB")
print("block table:\n", bt_torch.cpu())

# %% [markdown]
# ## The loop
#
# Each step appends one token to every sequence:
#
# 1. on the host: a sequence whose new token starts a block gets a page (the cache grows, the
#    block-table entry is staged); the lengths and new-token slots go into the next UVA slot;
# 2. `apply_write()`: the staged block-table entries, one launch (nothing staged: nothing
#    launched);
# 3. torch writes the new K/V rows in place;
# 4. JAX attends over the cache, reading block table and metadata in place.
#
# `attend` is traced again only when the committed cache grows (its input shape changes);
# a real server would reserve and view the cache at bucketed sizes.

# %%
steps = 20
committed_mib, step_ms, grew = [], [], []
for step in range(steps):
    start = time.perf_counter()
    new_pages = 0
    for s in range(num_seqs):
        if lengths[s] % BLOCK == 0:  # the new token starts a block
            pages_of[s].append(allocate_page(s, int(lengths[s]) // BLOCK))
            new_pages += 1
    slots = [slot_of(s, int(lengths[s])) for s in range(num_seqs)]
    positions = lengths.copy()
    lengths += 1
    meta = meta_pool.copy_to_uva(np.stack([lengths, slots], axis=1).astype(np.int32))
    block_table.apply_write()
    if new_pages:
        (k_torch, v_torch), (k_jax, v_jax) = cache_views()
    write_kv(k_torch, v_torch, np.arange(num_seqs), positions, slots)
    sync()
    out = attend(k_jax, v_jax, bt_jax, meta).block_until_ready()
    step_ms.append(1e3 * (time.perf_counter() - start))
    committed_mib.append(cache.physical_bytes / MiB)
    grew.append(new_pages)
    if new_pages or step in (0, steps - 1):
        print(
            f"step {step:2d}: lengths {lengths.tolist()} | +{new_pages} page(s) -> "
            f"{num_pages} pages, {committed_mib[-1]:.0f} MiB | {step_ms[-1]:.1f} ms"
        )

# %% [markdown]
# ## Check from torch
#
# The torch side reads the cache and the block table that JAX read, with no copy.

# %%
worst_row, worst_out = torch_check(k_torch, v_torch, lengths, out)
print(f"K rows gathered by torch vs make_kv: max |diff| = {worst_row:.2e}")
print(f"torch attention vs JAX attention:    max |diff| = {worst_out:.2e}")
assert worst_row == 0.0 and worst_out < 1e-4
print("cache base_ptr == the torch K view's pointer:", k_torch.data_ptr() == cache.base_ptr)

# %% [markdown]
# ## Memory and time per step
#
# Committed memory rises in whole pages (here one granule each, in K and in V) when a
# sequence crosses a block boundary. Steps that grow the cache also re-trace `attend` for the
# new cache shape, which shows up as the taller bars (step 0 holds the first trace). On the
# CPU the block-table launch runs under Triton's interpreter, which adds to those steps too.

# %%
fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(9, 3))
ax_mem.step(range(steps), committed_mib, where="post")
ax_mem.set(xlabel="step", ylabel="committed, K + V (MiB)", title="KV cache memory")
colors = ["tab:orange" if g else "tab:blue" for g in grew]
ax_time.bar(range(steps), step_ms, color=colors)
ax_time.set(xlabel="step", ylabel="ms", title="step time (orange: cache grew)")
fig.tight_layout()
figure_path = Path(tempfile.mkdtemp()) / "decode_loop.png"
fig.savefig(figure_path, dpi=72)
print("figure saved to", figure_path)
print(
    f"median step {np.median(step_ms):.1f} ms | committed {committed_mib[0]:.0f} -> "
    f"{committed_mib[-1]:.0f} MiB of {cache.capacity_bytes // MiB} MiB reserved"
)
plt.show()

# %% [markdown]
# ## Clean up
#
# `free()` / `close()` mean "I am done": the memory goes with the last array over it, so
# dropping the framework arrays first releases it at once.

# %%
del k_torch, v_torch, k_jax, v_jax, bt_jax, bt_torch, meta, out
meta_pool.close()
block_table.free()
cache.free()
print(cache)
