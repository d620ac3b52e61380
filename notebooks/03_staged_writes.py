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
# # Staged writes: many small row writes, one kernel launch
#
# Serving loops update small tables every step: a block table gains a page, a slot mapping
# gets a few entries, a per-sequence scale changes. Issuing one copy per change costs one
# launch (or one host-to-device copy) each. A `StagedWriteTensor` records
# `target[row, start:start + n] = values` **on the host** (`stage_write`, a few hundred
# nanoseconds), and `apply_write()` applies everything staged so far with **one** Triton
# launch that reads the write table and the values in place from pinned (UVA) memory.
# A `FusedStagedWriter` does the same for several tables at once, of different dtypes.
#
# For JAX code there is the same path inside `jax.jit`: `jaxbuf.jax_ops.StagedWrites` stages
# on the same C stager, and `apply_staged_writes` applies the writes in the jitted step (an
# XLA scatter by default, on every platform), with the array donated so it is updated in
# place.
#
# The tables here come from `jaxbuf.torch`, the face for torch code: vLLM's names, with
# `table.gpu` a `torch.Tensor` over the target, as in vLLM (the neutral `jaxbuf.staged`
# classes give a `BufferView` there instead). `to_jax()` hands JAX the same memory.
#
# On the CPU the Triton kernel runs under Triton's interpreter (slow; write counts here are
# kept small), on CUDA it is compiled.

# %%
import os

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jaxbuf

device = jaxbuf.default_device()
if device.platform == "cpu":
    # No GPU: run Triton kernels under its interpreter. Must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxbuf.jax_ops import StagedWrites, apply_staged_writes
from jaxbuf.torch import FusedStagedWriter, StagedWriteTensor


def sync():
    """Finish the applies (on torch's stream) before JAX reads the targets."""
    if device.is_cuda:
        torch.cuda.synchronize()


print("device:", device, "| Triton interpreter:", os.environ.get("TRITON_INTERPRET") == "1")

# %% [markdown]
# ## Staging
#
# A `(num_rows, row_len)` target starts zeroed. `stage_write(row, start, values)` accepts
# lists, numpy arrays, torch tensors and JAX arrays; `stage_write_elem(row, value)` sets
# `target[row, 0]`. Nothing touches the target until the apply.

# %%
table = StagedWriteTensor((4, 8), "int32", device=device)
table.stage_write(0, 0, [1, 2, 3])
table.stage_write(1, 4, np.array([7, 8, 9, 10], dtype=np.int32))
table.stage_write(2, 2, torch.tensor([5, 6], dtype=torch.int32))
table.stage_write_elem(3, 42)
print(table)
print(
    "staged:",
    table.num_staged_writes,
    "| target still zero:",
    int(table.gpu.abs().sum()) == 0,
)

# %% [markdown]
# ### Rejected writes stage nothing
#
# Every write is bounds-checked and its values converted to the target's dtype when it is
# *staged*, so a bad write fails at the line that made it, not later inside a kernel. A
# rejected write raises (`IndexError`, `ValueError`, `TypeError`) and leaves the staged
# writes as they were.

# %%
bad_writes = [
    (4, 0, [1]),  # row out of range
    (0, 6, [1, 2, 3]),  # runs past the end of the row
    (0, 0, [2**40]),  # does not fit in int32
    (0, 0, [1.5]),  # would be truncated
    (0, 0, ["a"]),  # not a number
]
for row, start, values in bad_writes:
    try:
        table.stage_write(row, start, values)
    except (IndexError, ValueError, TypeError) as error:
        print(f"{type(error).__name__}: {error}")
print("still staged:", table.num_staged_writes)

# %% [markdown]
# ## One launch
#
# `apply_write()` applies the four staged writes with one launch of the Triton kernel and
# clears them. The result is visible to torch and to JAX through DLPack, with no copy:
# `gpu` (a torch tensor) and `to_jax()` alias the target. On CUDA a consumer that passes its stream
# (torch does) is ordered after the launch; before JAX reads, this notebook calls `sync()`
# (`torch.cuda.synchronize()` on a GPU, nothing on the CPU).

# %%
table.apply_write()
sync()
print("staged after apply:", table.num_staged_writes)
print(table.gpu.cpu())
as_jax = table.to_jax()
print("JAX aliases the target:", as_jax.unsafe_buffer_pointer() == table.gpu.data_ptr())
print("JAX row sums:", as_jax.sum(axis=1))

# %% [markdown]
# ## Later wins where writes overlap
#
# Writes staged before one apply take effect in staging order. The C stager indexes the
# writes by row as they are staged; where two overlap, packing keeps only what the later
# writes leave visible (the earlier write dropped or split into pieces). The packed writes
# are disjoint, so the one launch runs them all in parallel, whatever the pattern.

# %%
table.stage_write(0, 0, [100, 100, 100, 100])
table.stage_write(0, 2, [200, 200])  # overlaps the previous write: this one wins
table.stage_write(0, 3, [300])  # and this one wins over both
table.apply_write()
print("row 0:", table.gpu[0].cpu().tolist())

# %% [markdown]
# ## The fused writer: tables of different dtypes, one launch
#
# A decode step typically touches several tables: an `int32` block table, `float32`
# per-sequence scales, `bfloat16` per-sequence biases. A `FusedStagedWriter` applies the
# writes staged on all of them with a single launch: the kernel's group table holds each
# target's pointer, row stride and element size.
#
# To show that it is one launch, the cell counts the calls of the kernel's launcher with
# Python's profiler: `jaxbuf.kernels.staged_write.CompiledLauncher` on a GPU, and on the CPU
# `jaxbuf.kernels.apply_staged_writes`, which runs the kernel under Triton's interpreter.

# %%
num_seqs, max_blocks = 4, 6
block_table = StagedWriteTensor((num_seqs, max_blocks), "int32", device=device)
scales = StagedWriteTensor((num_seqs, 2), "float32", device=device)
biases = StagedWriteTensor((num_seqs, 2), "bfloat16", device=device)
writer = FusedStagedWriter(device=device, max_writes=64)

import cProfile
import pstats

from jaxbuf.kernels import apply_staged_writes as interpreted_launch
from jaxbuf.kernels.staged_write import CompiledLauncher

launcher = (CompiledLauncher.__call__ if device.is_cuda else interpreted_launch).__code__


def launches(run) -> int:
    """How many kernel launches ``run()`` makes: calls of the launcher, profiled."""
    profile = cProfile.Profile()
    profile.runcall(run)
    key = (launcher.co_filename, launcher.co_firstlineno, launcher.co_name)
    return pstats.Stats(profile).stats.get(key, (0, 0))[1]


for seq in range(num_seqs):
    block_table.stage_write(seq, 0, list(range(seq * 10, seq * 10 + seq + 1)))
    scales.stage_write(seq, 0, [0.5 * seq, 1.0])
    biases.stage_write(seq, 0, np.array([seq / 3, -1.0], dtype=np.float32))  # rounded to bf16
staged_now = sum(t.num_staged_writes for t in (block_table, scales, biases))
count = launches(lambda: writer.apply([block_table, scales, biases]))
sync()

print("writes staged:", staged_now, "| launches to apply them:", count)
print("block table (torch):\n", block_table.gpu.cpu())
print("scales (JAX):\n", scales.to_jax())
print("biases (torch, bfloat16):\n", biases.gpu.cpu())

# %% [markdown]
# Tensors with nothing staged cost nothing, and an apply with nothing staged launches
# nothing:

# %%
block_table.stage_write(2, 3, [99])
count = launches(lambda: writer.apply([block_table, scales, biases]))
count_empty = launches(lambda: writer.apply([block_table, scales, biases]))  # nothing staged
sync()
print("launches:", count, "then", count_empty, "| row 2:", block_table.gpu[2].cpu().tolist())

# %% [markdown]
# `clear_staged_writes()` drops writes that should not happen after all:

# %%
scales.stage_write(0, 0, [123.0, 456.0])
scales.clear_staged_writes()
writer.apply([block_table, scales, biases])
print("scales row 0 unchanged:", scales.gpu[0].cpu().tolist())

# %% [markdown]
# ## Inside `jax.jit`: `StagedWrites` + `apply_staged_writes`, donated
#
# When the table is a JAX array updated by jitted code, the writes go *into* the
# computation. `StagedWrites(num_rows, row_len, dtype)` stages them on the host through the
# C stager `StagedWriteTensor` uses: `stage_write` for one write, `stage_writes` for a batch
# (no Python loop per write). `pack()` resolves overlaps, pads the writes into a
# `PackedWrites` pytree (rows, starts, lengths, offsets, values) and clears the stager for
# the next step. `apply_staged_writes` applies them inside `jit`; its default method is an XLA
# scatter on every platform (on an H200 no slower than plain JAX's scatter, while the Triton
# staged-write kernel through `jax_triton`, `method="triton"`, pays a host launch per call).
# With the array **donated**, XLA reuses its buffer: the update happens in place and the
# pointer does not change.
#
# `pack()` rounds the write count and the content length up to powers of two (at least 16),
# so steps with different numbers of writes share one compiled program.

# %%
traces = []


def update(array, packed):
    traces.append(packed.rows.shape[0])  # runs only while tracing
    return apply_staged_writes(array, packed)  # default: an XLA scatter, on every platform


update = jax.jit(update, donate_argnums=0)

staged = StagedWrites(num_seqs, max_blocks, "int32")
array = jnp.zeros((num_seqs, max_blocks), jnp.int32)
expected = np.zeros((num_seqs, max_blocks), np.int32)
pointer = array.unsafe_buffer_pointer()
rng = np.random.default_rng(0)
print("JAX backend:", jax.default_backend())
for step in range(6):
    n = int(rng.integers(1, 9))  # 1..8 writes: all in the 16-write bucket
    rows = rng.integers(0, num_seqs, n)
    starts = rng.integers(0, max_blocks - 2, n)
    values = rng.integers(0, 1000, (n, 2), dtype=np.int32)  # one 2-element write per row
    staged.stage_writes(rows, starts, values)  # one call for the batch; overlaps allowed
    for r, s, v in zip(rows, starts, values):
        expected[r, s : s + 2] = v  # numpy, in order: later wins
    packed = staged.pack()
    array = update(array, packed)
    print(
        f"step {step}: {n} writes -> bucket {packed.rows.shape[0]} | "
        f"same pointer: {array.unsafe_buffer_pointer() == pointer}"
    )
print(
    "traced",
    len(traces),
    "time(s) | matches numpy:",
    bool((np.asarray(array) == expected).all()),
)

# %% [markdown]
# ### Later wins, resolved on the host
#
# Overlapping writes resolve as on the torch side. Below, row 0 gets a 6-element write, then
# two shorter ones over its middle; in one batch, row 1 gets a 6-element write and then one
# element over it. `pack()` hands the kernel only the visible pieces, pairwise disjoint, so every
# method gives the in-order result whatever order the writes run in.

# %%
staged.stage_write(0, 0, np.full(6, 100, np.int32))
staged.stage_write(0, 2, np.array([200, 200], np.int32))  # hides the middle of the first
staged.stage_write(0, 3, np.array([300], np.int32))  # and this one wins over both
staged.stage_writes([1, 1], [0, 1], [np.arange(1, 7, dtype=np.int32), np.array([40], np.int32)])
expected[0, 0:6] = 100
expected[0, 2:4] = 200
expected[0, 3] = 300
expected[1, 0:6] = np.arange(1, 7)
expected[1, 1] = 40

packed = staged.pack()
visible = packed.lengths > 0
print("staged 5 writes; packed (row, start, length):")
print(list(zip(*(a[visible].tolist() for a in (packed.rows, packed.starts, packed.lengths)))))
array = update(array, packed)
print("row 0:", np.asarray(array[0]).tolist(), "| row 1:", np.asarray(array[1]).tolist())
print("matches numpy:", bool((np.asarray(array) == expected).all()))

# %% [markdown]
# `StagedWrites` checks every write when it is staged, as `StagedWriteTensor` does (bounds,
# and values against the dtype), before anything reaches the device; a rejected batch stages
# none of its writes. (`pack_writes(rows, starts, values_list, dtype, shape=...)` stages and
# packs one batch in one call.)

# %%
for row, start, values in bad_writes:  # the rejected writes of the first section
    try:
        staged.stage_write(row, start, values)
    except (IndexError, ValueError, TypeError) as error:
        print(f"{type(error).__name__}: {error}")
try:
    staged.stage_writes([0, 4], [0, 0], [[1], [2]])  # the second write's row is out of range
except IndexError as error:
    print(f"IndexError: {error}")
print("still staged:", staged.num_staged_writes)

# %% [markdown]
# One stager, one result: the same overlapping writes staged for torch (a
# `StagedWriteTensor`, applied by the Triton kernel) and for JAX (applied by the default
# method, and by `method="scatter"`, the XLA path every platform has) give the same table.

# %%
writes = [(2, 0, [1, 2, 3, 4, 5]), (2, 1, [6, 7]), (3, 4, [8, 9]), (2, 2, [10])]
torch_side = StagedWriteTensor((num_seqs, max_blocks), "int32", device=device)
for row, start, values in writes:
    torch_side.stage_write(row, start, values)
    staged.stage_write(row, start, values)
torch_side.apply_write()
sync()
packed = staged.pack()
zeros = jnp.zeros((num_seqs, max_blocks), jnp.int32)
via_default = jax.jit(apply_staged_writes)(zeros, packed)
via_scatter = jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))(zeros, packed)
from_torch = torch_side.gpu.cpu().numpy()
print("torch == JAX default:", bool((np.asarray(via_default) == from_torch).all()))
print("JAX default == scatter:", bool((via_default == via_scatter).all()))
print(from_torch)

# %% [markdown]
# ## The fast path: `PackRing`, packed writes read in place
#
# `pack()` returns a numpy buffer, so every jitted call copies it to the device first (on an
# H200 that copy alone costs 110-180 µs a call, whatever its size). A `PackRing` packs into
# one of `max_concurrency` pinned slots (default 2) that were imported into JAX once; the
# apply reads the writes where the host put them. `ring.apply(array, staged)` packs into the
# next slot, runs a cached jitted apply on the donated array and records when that slot's
# reader is done: before rewriting a slot, the ring waits for it (usually already done). With
# a jitted step of your own, `staged.pack(ring=ring)` packs, and `ring.consumed_by(output)`
# records an output of the step that you will not donate; without it the ring waits for the
# whole device when the slot comes round. Don't read a ring pack on the host: JAX caches an
# array's host value, and the next pack overwrites the slot.

# %%
from jaxbuf.jax_ops import PackRing

ring = PackRing(device=device)  # 2 pinned slots, grown (powers of two) when a pack needs it
array = jnp.zeros((num_seqs, max_blocks), jnp.int32)
expected = np.zeros((num_seqs, max_blocks), np.int32)
rng = np.random.default_rng(1)
for _ in range(6):
    n = int(rng.integers(1, 9))
    rows, starts = rng.integers(0, num_seqs, n), rng.integers(0, max_blocks - 2, n)
    values = rng.integers(0, 1000, (n, 2), dtype=np.int32)
    staged.stage_writes(rows, starts, values)
    for r, s, v in zip(rows, starts, values):
        expected[r, s : s + 2] = v
    array = ring.apply(array, staged)  # pack into a slot + jitted apply, donated
print(ring)
print("matches numpy:", bool((np.asarray(array) == expected).all()))

# Your own jitted step: pack into the ring, then record an output the next step won't donate.
step_fn = jax.jit(lambda a, p: (apply_staged_writes(a, p), a.sum()), donate_argnums=0)
staged.stage_write(0, 0, np.array([7, 7], np.int32))
array, total = step_fn(array, staged.pack(ring=ring))
ring.consumed_by(total)
print("row 0 starts with:", np.asarray(array[0, :2]).tolist())
ring.close()  # the slots' memory goes once nothing reads it; later packs raise

# %% [markdown]
# ## Clean up
#
# `free()` / `close()` mean "I am done": the memory goes with the last array over it, so
# dropping the framework arrays first releases it at once. Both are idempotent; a `with`
# block works too.

# %%
del as_jax
writer.close()
for t in (table, block_table, scales, biases, torch_side):
    t.free()
print(table)
