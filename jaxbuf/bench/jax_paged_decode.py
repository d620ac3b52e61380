"""Benchmark of the flagship decode loop: a small transformer decoding with paged attention
over jaxbuf's growable KV cache, against the same model over a preallocated JAX cache.

Suite ``jax.paged_decode``. The model and the loop are in :mod:`jaxbuf.bench._paged_model`
(shared with ``notebooks/06_paged_decode``): requests arrive over the run, a torch prefill
writes each one's prompt K/V into the cache, the cache grows by whole blocks between steps,
and each step writes every request's new K/V and attends over its blocks through its block
table. Two caches, stepped in lockstep (the order alternating each step):

* **jaxbuf**: an :class:`~jaxbuf.ExtensibleKVCacheBuilder` tensor of ``layers * 2``
  segments reserved for the capacity, committed with ``ensure_blocks`` as blocks are handed
  out, stepped by a :class:`~jaxbuf.KVCacheStep` in the engine's layout
  (``segment_shape=(layers, 2)``), the per-request metadata and the block table (a 2-D
  field) in a :class:`~jaxbuf.DeviceParamTable` synced per step;
* **preallocated**: a JAX array of the full capacity, the step jitted with the cache
  donated, the metadata put on the device per step: what a JAX user writes.

Per capacity (64, 1,024 and 4,096 blocks; about 16 committed by the end of the run), the
rows give the median step (metadata upload, step, and the wait for its logits) against the
preallocated cache's, and the bytes each holds: jaxbuf's ``physical_bytes`` (whole
granules per segment) against the capacity. Both caches' logits at every step and their
committed blocks are checked equal, bit for bit, before a row is reported. The step
targets hold on the CPU and on a GPU alike; the GPU's figures need a run there.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from jaxbuf.bench import Row, Sizes, format_bytes, ratio_spread, suite

__all__ = ["paged_decode_suite"]

CAPACITIES = (64, 1024, 4096)
STEP_TARGET = 1.2  # jaxbuf's median step <= 1.2x the preallocated donated step's


def _granules(blocks: int, segment_block_bytes: int, segments: int, granule: int) -> int:
    """Bytes of ``blocks`` committed in each of ``segments``, each rounded up to granules."""
    return segments * -(-blocks * segment_block_bytes // granule) * granule


def _rows(config: Any, capacity: int, traces: dict, step_blocks: dict, granule: int) -> list[Row]:
    mine, base = traces["jaxbuf"], traces["preallocated"]
    held, capacity_bytes = max(mine.bytes_held), max(base.bytes_held)
    blocks = mine.blocks[-1]
    segments = config.layers * 2
    bound = _granules(blocks, config.block_bytes // segments, segments, granule)
    floor = blocks * config.block_bytes  # what the committed blocks need, at the least
    # Where JAX copies a donated import (its CPU client) the step runs over a bucket of the
    # committed blocks and copies them back; elsewhere it donates the full-capacity arrays.
    write_path = "donate" if step_blocks["in_place"] else "bucket, copied back"
    common = {
        "capacity_blocks": capacity,
        "blocks_committed": mine.blocks,
        "bytes_held": {"jaxbuf": mine.bytes_held, "preallocated": base.bytes_held},
        "write_path": write_path,
        "step_blocks": step_blocks["blocks"],
        "steps": len(mine.step_s),
    }
    name = f"paged decode, {capacity:,} blocks"
    median, baseline = statistics.median(mine.step_s), statistics.median(base.step_s)
    return [
        Row(
            f"{name}: median step (jaxbuf)",
            median,
            "preallocated JAX cache, donated, median step",
            baseline,
            notes=(
                f"jaxbuf holds {format_bytes(held)} ({blocks} blocks committed), the "
                f"preallocated cache {format_bytes(capacity_bytes)}; logits of every step and "
                "the committed blocks equal, bit for bit"
            ),
            target=f"<= {STEP_TARGET:g}x preallocated",
            met=median <= STEP_TARGET * baseline,
            limit=STEP_TARGET,
            spread=ratio_spread(mine.step_s, base.step_s, paired=True),
            params={**common, "kind": "paged-decode-step", "step_s": {"jaxbuf": mine.step_s}},
        ),
        Row(
            f"{name}: bytes held (jaxbuf)",
            None,
            notes=(
                f"at most the {blocks} committed blocks in whole {format_bytes(granule)} "
                f"granules per segment ({segments} segments): {format_bytes(bound)}; the "
                f"preallocated cache holds {format_bytes(capacity_bytes)}"
            ),
            value=f"{format_bytes(held)} of {format_bytes(capacity_bytes)}",
            target="committed blocks <= held <= them in whole granules",
            met=floor <= held <= bound,  # a held count of 0 would be a broken measurement
            size_independent=True,  # a bound on what is held, at any size
            params={**common, "kind": "paged-decode-memory"},
        ),
    ]


@suite("jax.paged_decode", requires=("jax", "torch"))
def paged_decode_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A small transformer decoding with paged attention over jaxbuf's growing KV cache
    (torch prefill, requests arriving), against a preallocated donated JAX cache: step time
    and bytes held per cache capacity."""
    from jaxbuf import granule_size
    from jaxbuf.bench import _paged_model as model

    config = model.PagedConfig()
    steps, repeats = (8, 1) if quick else (24, 3)
    yield Sizes(
        f"{config.layers} layers, {config.heads} heads of {config.head_dim}, blocks of "
        f"{config.block_tokens} tokens ({format_bytes(config.block_bytes)} a block), "
        f"{config.rows} requests, {steps} steps x {repeats}; capacities "
        + ", ".join(f"{c:,}" for c in CAPACITIES)
        + " blocks"
    )
    weights = model.init_weights(config)
    both = (model.jax_weights(weights, device), model.torch_weights(weights, device))
    granule = granule_size(device)
    for capacity in CAPACITIES:
        caches: dict[str, Any] = {}
        try:
            caches["jaxbuf"] = model.JaxbufCache(config, capacity, device)
            caches["preallocated"] = model.PreallocatedCache(config, capacity, device)
            # Untimed first: every shape compiled; each run checked.
            model.check_agreement(caches, model.run(caches, config, steps, both), "preallocated")
            traces: dict[str, model.Trace] = {}
            for _ in range(repeats):
                for cache in caches.values():
                    cache.reset()
                run = model.run(caches, config, steps, both)
                model.check_agreement(caches, run, "preallocated")
                for name, trace in run.items():
                    traces.setdefault(name, model.Trace()).extend(trace)
            jaxbuf = caches["jaxbuf"]
            step_blocks = {"in_place": jaxbuf.in_place, "blocks": jaxbuf.step_blocks}
        finally:
            for cache in caches.values():
                cache.close()
        yield from _rows(config, capacity, traces, step_blocks, granule)
