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
# # UVA pools: pinned host memory the device reads in place
#
# A `UvaBuffer` is page-locked host memory mapped into the device's address space
# (`cuMemHostAlloc` + `cuMemHostGetDevicePointer` on CUDA). The host writes it through numpy;
# kernels of torch, JAX or Triton read the same bytes through a device pointer, with no copy.
# A `UvaBufferPool` hands out one of `max_concurrency` such buffers per step, so the host can
# fill step *t + 1* while the device still reads step *t*: the way to feed small per-step
# metadata (positions, block tables, sequence lengths) to the device.
#
# On the CPU driver "device" memory is host memory, so the device view *is* the host memory;
# the API is the same, which is what this notebook shows when no GPU is present.

# %%
import os

# JAX would otherwise take most of the GPU at its first use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxbuf
import jaxbuf.jax
from jaxbuf.uva import UvaBuffer, UvaBufferPool, uva_unavailable_reason

device = jaxbuf.default_device()
print("device:", device)
print("UVA available:", uva_unavailable_reason(device) or "yes")

# %% [markdown]
# ## One pinned buffer, four ways to see it
#
# * `buf.np`: numpy over the host memory (the host writes here);
# * `buf.cpu`: a torch CPU tensor over the same host memory;
# * `buf.torch_device_tensor`: a torch tensor on the device, over the device pointer;
# * `buf.jax_device_array`: a JAX array on the device, over the device pointer. Pass this one
#   into `jit`: compiled kernels read the pinned bytes in place.

# %%
buf = UvaBuffer((4, 3), "float32", device=device)
buf.np[:] = np.arange(12, dtype=np.float32).reshape(4, 3)

print("host ptr", hex(buf.host_ptr), "| device ptr", hex(buf.device_ptr))
print("torch CPU:   ", buf.cpu.device, buf.cpu.data_ptr() == buf.host_ptr)
print(
    "torch device:",
    buf.torch_device_tensor.device,
    buf.torch_device_tensor.data_ptr() == buf.device_ptr,
)
print(
    "JAX device:  ",
    buf.jax_device_array.devices(),
    buf.jax_device_array.unsafe_buffer_pointer() == buf.device_ptr,
)

# %% [markdown]
# A host write is seen by device kernels launched afterwards, with no copy and no sync. The
# same JAX array, imported once, reads the new values at every call.

# %%
column_sums = jax.jit(lambda x: x.sum(axis=0))
print("before:", column_sums(buf.jax_device_array))
buf.np[0] = 100.0  # a plain numpy write on the host
print("after: ", column_sums(buf.jax_device_array))
print("torch: ", buf.torch_device_tensor.sum(dim=0).cpu())

# %% [markdown]
# ## The `pinned_host` memory kind in JAX
#
# `buf.jax_pinned_host_array` imports the *host* pointer through DLPack `kDLCUDAHost`, which
# JAX turns into an array whose memory kind is `pinned_host` (torch rejects `kDLCUDAHost`).
# Memory kinds are part of a `jit` signature: JAX's host-offloading recipes move such an array
# into `device` memory with an explicit `jax.device_put`, i.e. a host-to-device copy. Use it
# for offloading (`device_put`, `out_shardings` with a memory kind), and use
# `jax_device_array` as the zero-copy input of a computation.
#
# Memory kinds exist on GPU backends only: on the CPU the "pinned" array is a plain CPU array,
# so the cell below only runs its demonstration where CUDA is present.

# %%
if device.is_cuda:
    host_array = buf.jax_pinned_host_array
    print("memory kind:", host_array.sharding.memory_kind)
    on_device = jax.device_put(host_array, host_array.sharding.with_memory_kind("device"))
    print("copied to:  ", on_device.sharding.memory_kind, "| sum =", float(on_device.sum()))
else:
    print(
        "CPU: no memory kinds; jax_pinned_host_array is a plain CPU array:",
        buf.jax_pinned_host_array.devices(),
    )

# %%
buf.free()
buf.free()  # safe to call twice
print(buf)

# %% [markdown]
# ## A pool: round-robin slots that grow
#
# Each `copy_to_uva(x)` takes the next slot, writes `x` into its host memory and returns the
# device-visible first `len(x)` rows, as a `BufferView` (`jaxbuf.UvaBufferPool`), a torch
# tensor (`jaxbuf.torch.UvaBufferPool`, vLLM's pool) or a JAX array
# (`jaxbuf.jax.UvaBufferPool`, used here; `framework=` picks the same on the neutral pool).
# Views and torch tensors are made once per slot and length, so a steady-state step pays no
# DLPack import; JAX arrays are imported afresh on every call (see `jaxbuf.jax`). An input
# longer than its slot replaces the slot with one whose row count is the next power of two.
#
# `x` may be a list, a numpy array, a CPU torch tensor or a JAX array.

# %%
pool = jaxbuf.jax.UvaBufferPool(4, jnp.int32, max_concurrency=2, device=device)
inputs = [
    [1, 2],
    np.arange(3, dtype=np.int32),
    torch.full((7,), 6, dtype=torch.int32),
    jnp.array([8, 9], dtype=jnp.int32),
]
for step, x in enumerate(inputs):
    rows = pool.copy_to_uva(x)
    print(
        f"step {step}: slot {pool.current_slot} -> {type(rows).__name__} {rows.tolist()} "
        f"| slot rows: {[len(slot) for slot in pool.slots]}"
    )

# %% [markdown]
# `copy_to_gpu` returns a device *copy* instead (or copies into `out`), for data that must
# outlive the slot.

# %%
copy = pool.copy_to_gpu([5, 6, 7])
print(type(copy).__name__, copy.tolist())
pool.close()

# %% [markdown]
# Bad input raises before a byte is written, naming what is wrong:

# %%
with UvaBufferPool((4, 2), "int32", device=device) as checked:
    for bad in ([1, 2, 3], np.ones((2, 2), np.float32)):
        try:
            checked.copy_to_uva(bad)
        except (ValueError, TypeError) as error:
            print(f"{type(error).__name__}: {error}")

# %% [markdown]
# ## Guarded reuse
#
# A slot is written again `max_concurrency` calls later. By default (as in vLLM) the caller
# promises that the device has finished reading a slot by then. If it has not, the host
# overwrites data a kernel is still about to read: a silent, timing-dependent bug.
#
# With `guarded="wait"` (or `True`) the pool records a device event on the consumer stream at
# each call, covering the readers of the slot handed out by the previous call, and waits for
# it before writing that slot again. `guarded="raise"` raises `RuntimeError` instead, with
# nothing written: the mode for tests, to find pools that are too small. The consumer stream
# is the `stream` argument, else torch's current stream.
#
# On the CPU there is no asynchronous device work: every reader has finished when the host
# continues, so a guarded pool never waits and never raises. The calls are the same:

# %%
guarded = UvaBufferPool(
    4, "int32", max_concurrency=2, device=device, framework="torch", guarded="raise"
)
for step in range(4):
    rows = guarded.copy_to_uva([step] * 3)
    total = rows.sum()  # the step's reader
guarded.record_readers()  # mark the last slot's readers as enqueued (the next call does it too)
print("guard mode:", guarded.guarded, "| last step's sum:", int(total))
guarded.close()

# %% [markdown]
# ### On CUDA: catching an early reuse
#
# A long kernel (`torch.cuda._sleep`) delays the reader of the first slot. The second call
# takes the other slot and records the event covering that reader; the third call wants the
# first slot back while the reader is still pending, so the `"raise"` pool refuses. After the
# device catches up the reader sees its own data intact, and the retried call succeeds.
# This cell runs only when CUDA is present.

# %%
if device.is_cuda:
    catcher = UvaBufferPool(
        4, "int32", max_concurrency=2, device=device, framework="torch", guarded="raise"
    )
    side = torch.cuda.Stream()
    first = np.array([1, 2, 3, 4], np.int32)
    with torch.cuda.stream(side):
        rows = catcher.copy_to_uva(first)
        torch.cuda._sleep(500_000_000)  # a long kernel before the read
        doubled = rows * 2  # the reader, queued behind it
        catcher.copy_to_uva([9, 9, 9, 9])  # the other slot; records the first slot's readers
        try:
            catcher.copy_to_uva([7, 7, 7, 7])  # the first slot again: too early
        except RuntimeError as error:
            print("caught:", error)
        else:
            print("not caught: the device had already finished reading")
    side.synchronize()
    print("the reader saw:", doubled.cpu().tolist(), "(its own data, doubled)")
    with torch.cuda.stream(side):
        print("retry after the device caught up:", catcher.copy_to_uva([7, 7, 7, 7]).tolist())
    side.synchronize()
    catcher.close()
else:
    print("no CUDA on this machine: the early-reuse demo is skipped")
