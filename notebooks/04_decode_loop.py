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
# # A decode loop: a growing KV cache, a staged block table, per-request parameters
#
# This notebook ties the pieces together in a toy decode loop written in JAX, with the
# objects an inference engine imports:
#
# * the **KV cache** is built as an engine builds it: an `ExtensibleKVCacheBuilder` reserves
#   one KV-cache tensor (K and V planes, one segment each) for every page up front, and the
#   `ExtensibleKVCacheBuffers` it finishes commit physical memory in whole blocks (pages)
#   when a sequence crosses a block boundary. No address ever moves;
# * the **decode step** is a `KVCacheStep`: one jitted function over the cache's layers,
#   imported into JAX once over the full capacity. It writes the cache in place where JAX
#   updates donated imports in place (a GPU: one trace for every grow); on the CPU it runs
#   over a power-of-two bucket of the committed blocks (one trace per bucket);
# * the **block table** (`num_seqs x max_blocks`, int32) is a JAX array that the step carries:
#   a new page is staged on the host in a `jaxbuf.jax_ops.StagedWrites` (bounds-checked, the
#   C stager), packed once per step, and applied inside the jitted step by
#   `apply_staged_writes` (an XLA scatter): JAX all the way, no torch, no Triton;
# * the per-step **metadata** (each sequence's length, the slot of its new token) lives in a
#   `DeviceParamTable`: host values written freely, uploaded with one copy per step (none
#   when nothing changed), handed to the step as JAX values of the last upload;
# * **torch** writes the prefill into the same cache and checks JAX's results from it.
#
# The "model" is a toy: each step makes one new K/V vector per sequence (a fixed function of
# sequence and position, so the cache's contents can be checked), writes it into the cache,
# and computes an attention-like reduction over each sequence's cached tokens.

# %%
import os

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import torch

import jaxbuf
from jaxbuf.jax_ops import StagedWrites, apply_staged_writes
from jaxbuf.kv import KVCacheStep

device = jaxbuf.default_device()
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
# A page (a block of the cache) holds `BLOCK` tokens of one sequence. Its K plane is one
# commit granule (2 MiB), its V plane another, so each new page commits new physical memory
# and the plot below shows the cache growing. The per-token vector size `DIM` follows.

# %%
num_seqs, max_blocks, BLOCK = 4, 4, 16
granule = jaxbuf.granule_size(device)
page_bytes = granule  # per plane: K, and again V
DIM = page_bytes // (BLOCK * 4)  # float32 elements per token vector
max_pages = num_seqs * max_blocks
max_tokens = max_blocks * BLOCK
print(
    f"{BLOCK} tokens x {DIM} float32 per page and plane = {page_bytes // MiB} MiB; "
    f"up to {max_pages} pages"
)

# %% [markdown]
# ## The cache, the block table, the metadata table
#
# `reserve` stands in for the engine's allocation of one KV-cache tensor: it reserves
# address space for all `max_pages` blocks, split into two segments (K and V), and returns a
# flat uint8 view of all of it. `finish` commits one block, as warmup needs. Page *p* holds
# rows `p * BLOCK ... p * BLOCK + BLOCK - 1` of each plane; token *t* of sequence *s* lives in
# row `block_table[s, t // BLOCK] * BLOCK + t % BLOCK`.

# %%
builder = jaxbuf.ExtensibleKVCacheBuilder(max_pages, device)
flat = builder.reserve(max_pages * 2 * page_bytes, num_segments=2)
kv = builder.finish()
print(kv, "| flat view:", flat.nbytes // MiB, "MiB")

# Buckets of every page at once: each pack (prefill's, or a step's) has one shape, one trace.
block_table = StagedWrites(
    num_seqs, max_blocks, "int32", min_write_bucket=max_pages, min_content_bucket=max_pages
)
bt_jax = jax.device_put(jnp.zeros((num_seqs, max_blocks), jnp.int32), device.jax())
meta = jaxbuf.DeviceParamTable(num_seqs, {"length": "int32", "slot": "int32"}, device)
fields = meta.arrays("jax")  # a live mapping: read per step, the last sync's values
# torch views of K and V over the full capacity: made once, valid as the cache grows.
k_torch, v_torch = (
    view.to_torch().view(-1, DIM) for view in kv.layer_views("float32", (BLOCK, DIM))
)
print(block_table)
print(meta)

# %% [markdown]
# The page allocator: hand out the next page, stage its block-table entry, and commit the
# cache up to that page (`ensure_blocks`: whole blocks, every segment, new ones zeroed).
# Committing never moves an address, so block-table entries (page numbers), the torch views
# and the step's JAX arrays all stay valid.

# %%
num_pages = 0
pages_of = [[] for _ in range(num_seqs)]


def allocate_page(seq, block):
    global num_pages
    page = num_pages
    block_table.stage_write(seq, block, np.array([page], np.int32))  # raises if out of bounds
    kv.ensure_blocks(page + 1)
    num_pages += 1
    return page


def slot_of(seq, pos):
    """Cache row of token ``pos`` of ``seq`` (host side, from the allocator's records)."""
    return pages_of[seq][pos // BLOCK] * BLOCK + pos % BLOCK


# %% [markdown]
# ## The model, in JAX
#
# `make_kv` is the toy projection: the K/V vectors of tokens at given positions. `attend`
# gathers each sequence's cached K/V rows through the block table, masks positions past the
# sequence length and reduces: softmax(K q) V. A query is a function of the length.
#
# `decode_step` is the `KVCacheStep` function: it gets the cache's layer arrays (K and V,
# each `blocks x BLOCK x DIM`, where `blocks` is the capacity on a GPU and a bucket of the
# committed pages on the CPU), applies the step's block-table writes, writes each
# sequence's new token at its slot and attends. It returns the updated arrays with its output
# (the block table and the attention); the step makes the cache's memory hold them.

# %%
freqs = jnp.linspace(0.01, 1.0, DIM, dtype=jnp.float32)


@jax.jit
def make_kv(seqs, positions):
    angle = (positions[:, None] + 1).astype(jnp.float32) * freqs + seqs[:, None]
    return jnp.sin(angle), jnp.cos(angle)


def attend(k_rows, v_rows, block_table, lengths):
    t = jnp.arange(max_tokens)
    rows = block_table[:, t // BLOCK] * BLOCK + t % BLOCK  # [seqs, tokens]
    valid = t[None, :] < lengths[:, None]
    rows = jnp.where(valid, rows, 0)  # unused entries point at row 0: read, then masked
    q = jnp.cos(lengths[:, None].astype(jnp.float32) * freqs)
    scores = jnp.einsum("std,sd->st", k_rows[rows], q) / jnp.sqrt(DIM)
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    return jnp.einsum("st,std->sd", weights, v_rows[rows])


def decode_step(caches, block_table, packed, length, slot):
    k_cache, v_cache = caches
    block_table = apply_staged_writes(block_table, packed)  # the pages handed out this step
    k_new, v_new = make_kv(jnp.arange(num_seqs), length - 1)  # the token just appended
    k_rows = k_cache.reshape(-1, DIM).at[slot].set(k_new)
    v_rows = v_cache.reshape(-1, DIM).at[slot].set(v_new)
    out = attend(k_rows, v_rows, block_table, length)
    return [k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape)], (block_table, out)


step = KVCacheStep(kv, decode_step, "float32", block_shape=(BLOCK, DIM))
print("writes the cache in place:", step.in_place, "(else: committed blocks copied back)")

# %% [markdown]
# ## The torch check
#
# A torch function that reads the same memory: it gathers each sequence's K rows through the
# block table (JAX's array, seen by torch through DLPack, zero-copy) and compares them with
# what `make_kv` says they must be, then recomputes the attention and compares with JAX's
# output.


# %%
def torch_check(lengths, jax_out):
    # ruff sees the last cell's `del`, not the order in which cells run.
    bt_torch = torch.from_dlpack(bt_jax)  # noqa: F821
    t = torch.arange(max_tokens, device=torch_device)
    worst_row, worst_out = 0.0, 0.0
    for s in range(num_seqs):
        n = int(lengths[s])
        rows = bt_torch[s, t[:n] // BLOCK].long() * BLOCK + t[:n] % BLOCK
        k_rows, v_rows = k_torch[rows], v_torch[rows]  # noqa: F821
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
# ## Prefill, from torch
#
# Four sequences of different lengths: allocate their pages, apply the block table (one
# jitted scatter for all of them, the table donated), and write their K/V with torch's
# `index_copy_` on the cache's torch views: the same memory the JAX step reads.

# %%
lengths = np.array([13, 5, 30, 40], dtype=np.int64)
for s, n in enumerate(lengths):
    for block in range(-(-int(n) // BLOCK)):
        pages_of[s].append(allocate_page(s, block))
print("staged block-table writes:", block_table.num_staged_writes)
apply_table = jax.jit(apply_staged_writes, donate_argnums=0)
bt_jax = apply_table(bt_jax, block_table.pack())
seqs = np.repeat(np.arange(num_seqs), lengths)
positions = np.concatenate([np.arange(n) for n in lengths])
k_new, v_new = make_kv(jnp.asarray(seqs, jnp.int32), jnp.asarray(positions, jnp.int32))
index = torch.as_tensor([slot_of(s, p) for s, p in zip(seqs, positions)], device=torch_device)
k_torch.index_copy_(0, index, torch.from_dlpack(k_new))
v_torch.index_copy_(0, index, torch.from_dlpack(v_new))
sync()
print("pages:", kv.num_blocks_committed, "| committed:", kv.physical_bytes // MiB, "MiB")
print("block table:\n", np.asarray(bt_jax))

# %% [markdown]
# ## The loop
#
# Each step appends one token to every sequence:
#
# 1. on the host: a sequence whose new token starts a block gets a page (the cache commits
#    it, the block-table entry is staged); the lengths and new-token slots are written into
#    the metadata table's host values;
# 2. `block_table.pack()`: the staged entries resolved and packed (an empty pack when
#    nothing is staged); `meta.sync()`: the metadata, one copy;
# 3. the JAX step applies the block-table writes, writes the new K/V into the cache and
#    attends, reading the metadata in place; the updated block table comes back with its
#    output, for the next step.
#
# On a GPU the step's shapes never change (its arrays span the full capacity, every pack
# fills the same buckets), so it is compiled once however often the cache grows; on the CPU
# it compiles once per power-of-two bucket of committed pages.

# %%
steps = 20
committed_mib, step_ms, grew = [], [], []
for i in range(steps):
    start = time.perf_counter()
    new_pages = 0
    for s in range(num_seqs):
        if lengths[s] % BLOCK == 0:  # the new token starts a block
            pages_of[s].append(allocate_page(s, int(lengths[s]) // BLOCK))
            new_pages += 1
    meta["slot"].np[:] = [slot_of(s, int(lengths[s])) for s in range(num_seqs)]
    lengths += 1
    meta["length"].np[:] = lengths
    packed = block_table.pack()
    meta.sync()
    bt_jax, out = step(bt_jax, packed, fields["length"], fields["slot"])
    out.block_until_ready()
    step_ms.append(1e3 * (time.perf_counter() - start))
    committed_mib.append(kv.physical_bytes / MiB)
    grew.append(new_pages)
    if new_pages or i in (0, steps - 1):
        print(
            f"step {i:2d}: lengths {lengths.tolist()} | +{new_pages} page(s) -> "
            f"{kv.num_blocks_committed} pages, {committed_mib[-1]:.0f} MiB | {step_ms[-1]:.1f} ms"
        )
print("compiled steps:", step.compiled())

# %% [markdown]
# ## Check from torch
#
# The torch side reads the cache and the block table that JAX wrote and read, with no copy.

# %%
worst_row, worst_out = torch_check(lengths, out)
print(f"K rows gathered by torch vs make_kv: max |diff| = {worst_row:.2e}")
print(f"torch attention vs JAX attention:    max |diff| = {worst_out:.2e}")
assert worst_row == 0.0 and worst_out < 1e-4
print("the flat view, the torch K view and the step's K array share one address:")
print(flat.ptr == k_torch.data_ptr() == step.caches[0].unsafe_buffer_pointer())

# %% [markdown]
# ## Memory and time per step
#
# Committed memory rises in whole pages (one granule in K and one in V each) when a sequence
# crosses a block boundary, and nothing is re-traced: step 0 holds the one compile. On the
# CPU JAX copies a donated import, so each step also copies the cache's committed blocks
# back; on a GPU the step writes the cache in place.

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
    f"{committed_mib[-1]:.0f} MiB of {flat.nbytes // MiB} MiB reserved"
)
plt.show()

# %% [markdown]
# ## What a connector registers, and sleep
#
# `committed_views` trims each plane to the committed blocks: every byte mapped, what a
# transfer connector registers (`jaxbuf.transfer.KVCacheEndpoint` does it for the whole
# cache). `release_physical` discards the physical memory while every address stays valid
# (an engine's sleep); `recommit` maps the same number of blocks again, zeroed.

# %%
k_view, v_view = kv.committed_views(0, "float32", (BLOCK, DIM))
print("committed K:", k_view.shape, "| V:", v_view.shape)
kv.release_physical()
print("asleep:", kv.physical_bytes, "bytes,", kv.num_blocks_committed, "blocks")
kv.recommit()
print("awake: ", kv.physical_bytes // MiB, "MiB,", kv.num_blocks_committed, "blocks (zeroed)")

# %% [markdown]
# ## Clean up
#
# `free()` / `close()` mean "I am done": the memory goes with the last array over it, so
# dropping the framework arrays first releases it at once.

# %%
del k_torch, v_torch, bt_jax, fields, out, flat, k_view, v_view
step.close()
meta.close()
kv.free()
print(kv)
