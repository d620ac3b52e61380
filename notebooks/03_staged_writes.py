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
# For JAX code there is a second path: `jaxbuf.jax_ops.pack_writes` + `apply_staged_writes`
# inside `jax.jit`, with the array donated so it is updated in place.
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

from jaxbuf.jax_ops import apply_staged_writes, pack_writes
from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor


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
    int(table.to_torch().abs().sum()) == 0,
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
# `to_torch()` / `to_jax()` alias the target. On CUDA a consumer that passes its stream
# (torch does) is ordered after the launch; before JAX reads, this notebook calls `sync()`
# (`torch.cuda.synchronize()` on a GPU, nothing on the CPU).

# %%
table.apply_write()
sync()
print("staged after apply:", table.num_staged_writes)
print(table.to_torch().cpu())
as_jax = table.to_jax()
print("JAX aliases the target:", as_jax.unsafe_buffer_pointer() == table.gpu.ptr)
print("JAX row sums:", as_jax.sum(axis=1))

# %% [markdown]
# ## Later wins where writes overlap
#
# Writes staged before one apply take effect in staging order. The writer detects overlap
# on the host (a repeated row is the cheap first test) and only then runs the writes in
# order, still in one launch.

# %%
table.stage_write(0, 0, [100, 100, 100, 100])
table.stage_write(0, 2, [200, 200])  # overlaps the previous write: this one wins
table.stage_write(0, 3, [300])  # and this one wins over both
table.apply_write()
print("row 0:", table.to_torch()[0].cpu().tolist())

# %% [markdown]
# ## The fused writer: tables of different dtypes, one launch
#
# A decode step typically touches several tables: an `int32` block table, `float32`
# per-sequence scales, `bfloat16` per-sequence biases. A `FusedStagedWriter` applies the
# writes staged on all of them with a single launch: the kernel's group table holds each
# target's pointer, row stride and element size.
#
# To show that it is one launch, the cell counts calls of the writer's launcher (a private
# attribute, peeked at here for the demonstration only).

# %%
num_seqs, max_blocks = 4, 6
block_table = StagedWriteTensor((num_seqs, max_blocks), "int32", device=device)
scales = StagedWriteTensor((num_seqs, 2), "float32", device=device)
biases = StagedWriteTensor((num_seqs, 2), "bfloat16", device=device)
writer = FusedStagedWriter(device, max_writes=64)

launches = []
launch = writer._launch
writer._launch = lambda *args, **kwargs: (
    launches.append(args[3]),
    launch(*args, **kwargs),
)  # args[3]: write count

for seq in range(num_seqs):
    block_table.stage_write(seq, 0, list(range(seq * 10, seq * 10 + seq + 1)))
    scales.stage_write(seq, 0, [0.5 * seq, 1.0])
    biases.stage_write(seq, 0, np.array([seq / 3, -1.0], dtype=np.float32))  # rounded to bf16
writer.apply([block_table, scales, biases])
sync()

print("launches:", len(launches), "| writes in that launch:", launches[0])
print("block table (torch):\n", block_table.to_torch().cpu())
print("scales (JAX):\n", scales.to_jax())
print("biases (torch, bfloat16):\n", biases.to_torch().cpu())

# %% [markdown]
# Tensors with nothing staged cost nothing, and an apply with nothing staged launches
# nothing:

# %%
block_table.stage_write(2, 3, [99])
writer.apply([block_table, scales, biases])
writer.apply([block_table, scales, biases])  # nothing staged: no launch
print("launches so far:", len(launches), "| row 2:", block_table.to_torch()[2].cpu().tolist())

# %% [markdown]
# `clear_staged_writes()` drops writes that should not happen after all:

# %%
scales.stage_write(0, 0, [123.0, 456.0])
scales.clear_staged_writes()
writer.apply([block_table, scales, biases])
print("scales row 0 unchanged:", scales.to_torch()[0].cpu().tolist())

# %% [markdown]
# ## Inside `jax.jit`: `pack_writes` + `apply_staged_writes`, donated
#
# When the table is a JAX array updated by jitted code, the writes go *into* the
# computation instead: `pack_writes` packs them on the host into a `PackedWrites` pytree
# (rows, starts, lengths, offsets, values), and `apply_staged_writes` applies them inside
# `jit`, with a Pallas kernel that aliases the array to its output. With the array
# **donated**, XLA reuses its buffer: the update happens in place and the pointer does not
# change.
#
# `pack_writes` rounds the write count and the content length up to powers of two (at
# least 16), so steps with different numbers of writes share one compiled program.

# %%
traces = []


def update(array, packed):
    traces.append(packed.rows.shape[0])  # runs only while tracing
    return apply_staged_writes(array, packed, method="pallas")


update = jax.jit(update, donate_argnums=0)

array = jnp.zeros((num_seqs, max_blocks), jnp.int32)
expected = np.zeros((num_seqs, max_blocks), np.int32)
pointer = array.unsafe_buffer_pointer()
rng = np.random.default_rng(0)
for step in range(6):
    n = int(rng.integers(1, 9))  # 1..8 writes: all in the 16-write bucket
    rows = rng.integers(0, num_seqs, n)
    starts = rng.integers(0, max_blocks - 2, n)
    values = [rng.integers(0, 1000, 2) for _ in range(n)]
    for r, s, v in zip(rows, starts, values):
        expected[r, s : s + 2] = v  # the host model, later wins
    packed = pack_writes(rows, starts, values, "int32", shape=(num_seqs, max_blocks))
    array = update(array, packed)
    print(
        f"step {step}: {n} writes -> bucket {packed.rows.shape[0]} | "
        f"same pointer: {array.unsafe_buffer_pointer() == pointer}"
    )
print(
    "traced",
    len(traces),
    "time(s) | matches the host model:",
    bool((np.asarray(array) == expected).all()),
)

# %% [markdown]
# `pack_writes` checks bounds against `shape` (when given) and values against the dtype,
# on the host, before anything reaches the device:

# %%
for args in (([4], [0], [[1]]), ([0], [5], [[1, 2]]), ([0], [0], [[2**40]])):
    try:
        pack_writes(*args, "int32", shape=(num_seqs, max_blocks))
    except (IndexError, ValueError) as error:
        print(f"{type(error).__name__}: {error}")

# %% [markdown]
# `method="scatter"` does the same with an XLA scatter (`array.at[...].set`); both give the
# same result:

# %%
packed = pack_writes([0, 1], [0, 3], [[1, 2], [3, 4, 5]], "int32")
zeros = jnp.zeros((num_seqs, max_blocks), jnp.int32)
via_pallas = jax.jit(lambda a, p: apply_staged_writes(a, p, method="pallas"))(zeros, packed)
via_scatter = jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))(zeros, packed)
print("pallas == scatter:", bool((via_pallas == via_scatter).all()))
print(via_scatter)

# %% [markdown]
# ## Clean up
#
# `free()` / `close()` mean "I am done": the memory goes with the last array over it, so
# dropping the framework arrays first releases it at once. Both are idempotent; a `with`
# block works too.

# %%
del as_jax
writer.close()
for t in (table, block_table, scales, biases):
    t.free()
print(table)
