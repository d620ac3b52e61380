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
# # Growable buffers: `ExtensibleTensor`
#
# An `ExtensibleTensor` reserves **address space** for its maximum size once, then backs it
# with physical memory on demand (CUDA virtual memory management on a GPU, `mmap`/`memfd` on
# the CPU). Growing never moves the base pointer, so pointers, views and CUDA graphs taken
# before a grow stay valid after it. The same bytes are read and written by torch and by JAX
# through DLPack, with no copy.
#
# This notebook runs on the default device: CUDA when a GPU is present, else the CPU driver.

# %%
import os

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxbuf

device = jaxbuf.default_device()
MiB = 1 << 20
print("device:", device, "| commit granule:", jaxbuf.granule_size(device) // MiB, "MiB")

# %% [markdown]
# ## Reserve
#
# Reserving 64 MiB costs address space only: nothing is committed yet.

# %%
buf = jaxbuf.ExtensibleTensor(64 * MiB, device=device)
base = buf.base_ptr
print(buf)
print("reserved:", buf.capacity_bytes // MiB, "MiB | physical:", buf.physical_bytes, "bytes")

# %% [markdown]
# ## Grow
#
# `resize_per_segment_` grows the committed prefix. Physical memory is committed in whole
# granules, so a 1 KiB request maps one granule; a later grow inside the same granule
# maps nothing new. The base pointer does not move.

# %%
for nbytes in (1024, 4096, 3 * MiB, 5 * MiB):
    buf.resize_per_segment_(nbytes)
    print(
        f"committed {buf.num_bytes:>8} B | physical {buf.physical_bytes // MiB} MiB "
        f"in {buf.num_physical_chunks} chunk(s) | base_ptr unchanged: {buf.base_ptr == base}"
    )

# %% [markdown]
# Resizing is grow-only; asking for less raises a `ValueError` that names both sizes.

# %%
try:
    buf.resize_per_segment_(1024)
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# ## The same bytes from torch and from JAX
#
# `segment_view(i)` is a `BufferView` (uint8, 1-D) over segment *i*'s committed prefix. It
# speaks DLPack, so `torch.from_dlpack` and `jax.dlpack.from_dlpack` import it zero-copy;
# `to_torch` / `to_jax` reinterpret it with another dtype and shape on the way.

# %%
view = buf.segment_view(0)
t = view.to_torch(dtype=torch.float32, shape=(4, 8))
t.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8))
if device.is_cuda:
    torch.cuda.synchronize()  # torch's write is done before JAX (on its own streams) reads

a = view.to_jax(dtype=jnp.float32, shape=(4, 8))
print("torch ptr == base_ptr:", t.data_ptr() == buf.base_ptr)
print("JAX ptr == base_ptr:  ", a.unsafe_buffer_pointer() == buf.base_ptr)
print("JAX sees torch's writes:", bool((np.asarray(a) == t.cpu().numpy()).all()))
print("row sums (JAX):", jnp.sum(a, axis=1))

# %% [markdown]
# The plain DLPack entry points work too: the segment's committed bytes as a 1-D uint8 array.

# %%
raw_t = torch.from_dlpack(view)
raw_a = jax.dlpack.from_dlpack(view)
print(raw_t.shape, raw_t.dtype, raw_t.data_ptr() == buf.base_ptr)
print(raw_a.shape, raw_a.dtype, raw_a.unsafe_buffer_pointer() == buf.base_ptr)

# %% [markdown]
# JAX arrays are immutable to JAX, but the memory under this one is shared: after torch
# writes, the next JAX computation reads the new values. (Order the two yourself: finish
# torch's work before JAX reads, e.g. `torch.cuda.synchronize()` on a GPU.)

# %%
t[0, 0] = 100.0
if device.is_cuda:
    torch.cuda.synchronize()
print("JAX reads a[0, 0] =", float(a[0, 0]))

# %% [markdown]
# ## Segments
#
# A reservation can be split into segments, each growing its own committed prefix:
# e.g. a key and a value cache in one reservation. Segments may have different capacities.
# Neighbouring segments that share a granule map it only once.

# %%
kv = jaxbuf.ExtensibleTensor(24 * MiB, device=device, segment_capacities=[8 * MiB, 16 * MiB])
kv.resize_segments_([1 * MiB, 3 * MiB])
print("offsets:", [o // MiB for o in kv.segment_offsets], "MiB")
print("committed:", kv.committed_sizes)
print("physical:", kv.physical_bytes // MiB, "MiB in", kv.num_physical_chunks, "chunk(s)")
print("each segment within one chunk:", kv.segments_backed_by_one_chunk(kv.committed_sizes))

# %% [markdown]
# ## Zeroing new bytes
#
# With `zero_new=True` only the *newly* committed bytes are zeroed; bytes already written
# are kept. On a GPU the memset runs on the driver's stream and a DLPack consumer that
# passes its stream (`torch.from_dlpack`, `to_torch`) is ordered after it.

# %%
seg = kv.segment_view(0).to_torch()
seg.fill_(7)
kv.resize_segments_([2 * MiB, 3 * MiB], zero_new=True)
grown = kv.segment_view(0).to_torch()
print("old bytes kept:", bool((grown[: 1 * MiB] == 7).all()))
print("new bytes zeroed:", bool((grown[1 * MiB :] == 0).all()))

# %% [markdown]
# ## Release and recommit
#
# `release_physical()` returns every physical page but keeps the reservation (and so the
# base pointer). Committed sizes drop to zero; growing again commits fresh memory at the same
# addresses. Do not touch the old contents after a release: they are gone.

# %%
ptr = kv.base_ptr
kv.release_physical()
print("after release: committed", kv.committed_sizes, "| physical", kv.physical_bytes)
kv.resize_segments_([1 * MiB, 1 * MiB], zero_new=True)
print(
    "after recommit: committed", kv.committed_sizes, "| physical", kv.physical_bytes // MiB, "MiB"
)
print("same base_ptr:", kv.base_ptr == ptr)
print("fresh memory is zero:", int(kv.segment_view(0).to_torch().sum()) == 0)

# %% [markdown]
# ## What a stable `base_ptr` buys
#
# A growable buffer built on `realloc` + copy moves: every tensor over the old storage must
# be re-created, and anything that captured the pointer (a CUDA graph, an RDMA registration,
# a kernel argument table) goes stale. Here a torch view taken over the *whole reservation*
# before a grow reads and writes the newly committed bytes afterwards.

# %%
whole = buf.full_view().to_torch(dtype=torch.float32)  # taken before the grow
before = buf.num_bytes
buf.resize_per_segment_(9 * MiB, zero_new=True)
index = before // 4 + 10  # a float32 element in the newly committed region
whole[index] = 42.0
print("grew", before, "->", buf.num_bytes, "bytes; base_ptr unchanged:", buf.base_ptr == base)
print(
    "a fresh view reads the old view's write:",
    float(buf.segment_view(0).to_torch(dtype=torch.float32)[index]),
)

# %% [markdown]
# Only the committed bytes may be touched through `full_view()`: beyond them the address
# space is reserved but unmapped, and an access faults.
#
# ### On CUDA: a CUDA graph survives growth
#
# A graph captured over the buffer bakes its pointer into its kernels. Because the pointer
# never moves, the same graph keeps working after the buffer grows. This cell runs only when
# CUDA is present.

# %%
if device.is_cuda:
    n = 1024
    data = buf.full_view().to_torch(dtype=torch.float32)[:n]
    data.fill_(1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        data.mul_(2.0)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        data.mul_(2.0)
    buf.resize_per_segment_(17 * MiB)  # grow after the capture: same base pointer
    data.fill_(1.0)
    graph.replay()  # the captured kernel still writes the right memory
    torch.cuda.synchronize()
    print("after grow + replay, data[0] =", float(data[0]), "(expected 2.0)")
    del graph, data
else:
    print("no CUDA on this machine: the CUDA graph demo is skipped")

# %% [markdown]
# ## Free
#
# `free()` means "I am done": no new views or exports, and the physical memory and the
# reservation go when the last array exported from the buffer is gone (at once when there is
# none). It waits for pending JAX and CUDA work first, is safe to call twice, and a `with`
# block calls it. Arrays taken before `free()` keep reading their memory until dropped.

# %%
kv.free()
buf.free()
print("released:", buf.released, "| arrays still holding the memory:", buf.live_exports)
print("torch still reads it: t[0, :4] =", t[0, :4].tolist())
del t, a, raw_t, raw_a, seg, grown, whole
print("after the last array: released =", buf.released, "| live exports:", buf.live_exports)
buf.free()  # a second call is a no-op
print(buf)

with jaxbuf.ExtensibleTensor(4 * MiB, device=device) as scratch:
    scratch.resize_per_segment_(1024, zero_new=True)
    print("inside `with`:", scratch.num_bytes, "bytes")
print("after `with`: base_ptr =", scratch.base_ptr)
