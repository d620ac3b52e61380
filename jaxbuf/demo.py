"""The worked example of notebook 4 as a function: a toy decode loop over a paged KV cache.

:func:`run_decode_demo` runs it and returns one record per step; ``python -m jaxbuf demo``
shows it with a progress bar and a summary table. The pieces:

* the **KV cache** is one :class:`~jaxbuf.ExtensibleTensor` with two segments (K and V) that
  reserves every page up front and commits one page (one granule) when a sequence crosses a
  block boundary; its base pointer never moves;
* the **block table** (``num_seqs x max_blocks``, int32) is a
  :class:`~jaxbuf.staged.StagedWriteTensor`: new pages are staged on the host and applied with
  one launch per step (none when nothing changed);
* the per-step **metadata** (lengths, new-token slots) comes from a
  :class:`~jaxbuf.UvaBufferPool` that the jitted JAX step reads in place;
* **torch** writes the new K/V rows in place, and checks every step by gathering the cache
  through the block table and recomputing JAX's attention.

Needs torch and JAX. On the CPU the block table is applied with ``backend="numpy"`` (Triton
would run under its interpreter); on CUDA with the Triton kernel.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

__all__ = ["BLOCK", "MAX_BLOCKS", "NUM_SEQS", "PREFILL_LENGTHS", "run_decode_demo"]

NUM_SEQS, MAX_BLOCKS, BLOCK = 4, 4, 16
PREFILL_LENGTHS = (13, 5, 30, 40)
#: Largest |difference| between torch's and JAX's attention that the check accepts.
TOLERANCE = 1e-4


def run_decode_demo(
    device: Any, steps: int = 20, progress: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Prefill four sequences, then decode ``steps`` tokens each; one record per step.

    Each record holds ``step``, ``committed_bytes`` (the cache's committed length, K + V),
    ``physical_bytes`` (physical memory it holds), ``step_s`` (seconds: page allocation,
    block-table launch, K/V write, JAX attention), ``grew`` (whether the cache grew this step),
    ``new_pages``, ``lengths``, ``max_diff`` (torch vs JAX, worst over K, V and the attention
    output) and ``check_ok``. ``progress``, if given, is called with each record as it is made.
    Everything allocated is freed before returning.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jaxbuf.devices import as_device
    from jaxbuf.extensible import ExtensibleTensor, granule_size
    from jaxbuf.staged import StagedWriteTensor
    from jaxbuf.uva import UvaBufferPool

    device = as_device(device)
    max_steps = MAX_BLOCKS * BLOCK - max(PREFILL_LENGTHS)
    if not 0 < steps <= max_steps:
        raise ValueError(f"steps must be in 1..{max_steps}, got {steps}")
    torch_device = torch.device("cuda", device.index) if device.is_cuda else torch.device("cpu")
    jax_device = jax.devices("gpu")[device.index] if device.is_cuda else jax.devices("cpu")[0]

    page_bytes = granule_size(device)  # one page commits one granule per segment
    dim = page_bytes // (BLOCK * 4)  # float32 elements per token vector
    max_pages = NUM_SEQS * MAX_BLOCKS
    max_tokens = MAX_BLOCKS * BLOCK

    def sync() -> None:
        if device.is_cuda:  # torch and JAX use different streams
            torch.cuda.synchronize(torch_device)

    with jax.default_device(jax_device):
        freqs = jnp.linspace(0.01, 1.0, dim, dtype=jnp.float32)
        freqs_torch = torch.from_dlpack(freqs).to(torch_device)

        @jax.jit
        def make_kv(seqs, positions):
            angle = (positions[:, None] + 1).astype(jnp.float32) * freqs + seqs[:, None]
            return jnp.sin(angle), jnp.cos(angle)

        @jax.jit
        def attend(k_cache, v_cache, block_table, meta):
            lengths = meta[:, 0]
            t = jnp.arange(max_tokens)
            rows = block_table[:, t // BLOCK] * BLOCK + t % BLOCK  # [seqs, tokens]
            valid = t[None, :] < lengths[:, None]
            rows = jnp.where(valid, rows, 0)  # unused entries read row 0, then are masked
            q = jnp.cos(lengths[:, None].astype(jnp.float32) * freqs)
            scores = jnp.einsum("std,sd->st", k_cache[rows], q) / jnp.sqrt(dim)
            weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
            return jnp.einsum("st,std->sd", weights, v_cache[rows])

        cache = ExtensibleTensor(
            2 * max_pages * page_bytes,
            device=device,
            segment_capacities=[max_pages * page_bytes] * 2,
        )
        block_table = meta_pool = None
        records: list[dict[str, Any]] = []
        try:
            block_table = StagedWriteTensor(
                (NUM_SEQS, MAX_BLOCKS),
                "int32",
                device=device,
                backend="triton" if device.is_cuda else "numpy",
            )
            bt_jax = block_table.to_jax()  # aliases the table: reads the latest entries
            bt_torch = block_table.to_torch()
            meta_pool = UvaBufferPool((NUM_SEQS, 2), "int32", device=device, framework="jax")
            pages_of: list[list[int]] = [[] for _ in range(NUM_SEQS)]
            num_pages = 0

            def allocate_page(seq: int) -> None:
                nonlocal num_pages
                block_table.stage_write(seq, len(pages_of[seq]), [num_pages])
                cache.resize_segments_([(num_pages + 1) * page_bytes] * 2)
                pages_of[seq].append(num_pages)
                num_pages += 1

            def slot_of(seq: int, pos: int) -> int:
                return pages_of[seq][pos // BLOCK] * BLOCK + pos % BLOCK

            def cache_views():
                rows = num_pages * BLOCK
                k, v = (cache.segment_view(i) for i in (0, 1))
                return (
                    (
                        k.to_torch(dtype=torch.float32, shape=(rows, dim)),
                        v.to_torch(dtype=torch.float32, shape=(rows, dim)),
                    ),
                    (
                        k.to_jax(dtype=jnp.float32, shape=(rows, dim)),
                        v.to_jax(dtype=jnp.float32, shape=(rows, dim)),
                    ),
                )

            def write_kv(k_torch, v_torch, seqs, positions, slots) -> None:
                k_new, v_new = make_kv(
                    jnp.asarray(seqs, jnp.int32), jnp.asarray(positions, jnp.int32)
                )
                k_new.block_until_ready()
                index = torch.as_tensor(np.asarray(slots, np.int64), device=torch_device)
                k_torch.index_copy_(0, index, torch.from_dlpack(k_new))
                v_torch.index_copy_(0, index, torch.from_dlpack(v_new))

            def torch_check(k_torch, v_torch, bt_torch, lengths, jax_out) -> float:
                """Worst |diff|: K/V rows gathered through the block table against the toy
                model, and torch's attention against JAX's."""
                t = torch.arange(max_tokens, device=torch_device)
                jax_out = torch.from_dlpack(jax_out)
                worst = 0.0
                for s in range(NUM_SEQS):
                    n = int(lengths[s])
                    rows = bt_torch[s, t[:n] // BLOCK].long() * BLOCK + t[:n] % BLOCK
                    k_rows, v_rows = k_torch[rows], v_torch[rows]
                    angle = (t[:n, None] + 1).float() * freqs_torch + s
                    q = torch.cos(float(n) * freqs_torch)
                    out = torch.softmax(k_rows @ q / dim**0.5, dim=0) @ v_rows
                    worst = max(
                        worst,
                        float((k_rows - torch.sin(angle)).abs().max()),
                        float((v_rows - torch.cos(angle)).abs().max()),
                        float((out - jax_out[s]).abs().max()),
                    )
                return worst

            # Prefill: pages for every sequence, one block-table launch, the K/V rows.
            lengths = np.array(PREFILL_LENGTHS, dtype=np.int64)
            for s, n in enumerate(lengths):
                for _ in range(-(-int(n) // BLOCK)):
                    allocate_page(s)
            block_table.apply_write()
            (k_torch, v_torch), (k_jax, v_jax) = cache_views()
            seqs = np.repeat(np.arange(NUM_SEQS), lengths)
            positions = np.concatenate([np.arange(n) for n in lengths])
            write_kv(
                k_torch, v_torch, seqs, positions, [slot_of(s, p) for s, p in zip(seqs, positions)]
            )
            sync()

            for step in range(steps):
                start = time.perf_counter()
                new_pages = 0
                for s in range(NUM_SEQS):
                    if lengths[s] % BLOCK == 0:  # the new token starts a block
                        allocate_page(s)
                        new_pages += 1
                slots = [slot_of(s, int(lengths[s])) for s in range(NUM_SEQS)]
                positions = lengths.copy()
                lengths += 1
                meta = meta_pool.copy_to_uva(np.stack([lengths, slots], axis=1).astype(np.int32))
                block_table.apply_write()  # nothing staged: nothing launched
                if new_pages:  # the committed length changed: new views of it
                    (k_torch, v_torch), (k_jax, v_jax) = cache_views()
                write_kv(k_torch, v_torch, np.arange(NUM_SEQS), positions, slots)
                sync()
                out = attend(k_jax, v_jax, bt_jax, meta).block_until_ready()
                step_s = time.perf_counter() - start
                max_diff = torch_check(k_torch, v_torch, bt_torch, lengths, out)
                record = {
                    "step": step,
                    "committed_bytes": cache.num_bytes,
                    "physical_bytes": cache.physical_bytes,
                    "step_s": step_s,
                    "grew": new_pages > 0,
                    "new_pages": new_pages,
                    "lengths": lengths.tolist(),
                    "max_diff": max_diff,
                    "check_ok": max_diff < TOLERANCE,
                }
                records.append(record)
                del out, meta
                if progress is not None:
                    progress(record)
            del k_torch, v_torch, k_jax, v_jax, bt_jax, bt_torch
        finally:
            if meta_pool is not None:
                meta_pool.close()
            if block_table is not None:
                block_table.free()
            cache.free()
    return records
