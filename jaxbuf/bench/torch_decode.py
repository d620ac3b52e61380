"""Benchmark of a torch decode loop over a paged KV cache, baselines in-run.

Suite ``torch.decode``: the decode loop of ``jax.decode`` (the same sizes, length profiles,
pages and attention) in eager torch. Three ways to hold the cache, in one run:

* **jaxbuf**: an :class:`~jaxbuf.ExtensibleKVCacheBuilder` reserves one KV-cache tensor for
  every page (blocks outermost) and the :class:`~jaxbuf.ExtensibleKVCacheBuffers` it finishes
  commit a growth step of whole blocks when the next step needs more pages, while the device
  works on the current step. The step reads and writes the cache through its torch view
  (:meth:`~jaxbuf.ExtensibleKVCacheBuffers.layer_views`, ``to_torch``), made once over the
  full capacity: no view is rebuilt as the cache grows. The lengths and slots come from a
  :class:`~jaxbuf.DeviceParamTable` imported once and synced per step.
* **preallocated**: a torch tensor holding every page of the maximum length, from the start.
* **realloc+copy**: a torch tensor grown on jaxbuf's schedule into a new tensor (``copy_`` of
  the old, which is dropped after).

The baselines put the metadata on the device with ``torch.as_tensor`` every step, as a plain
torch user writes; the block-table entries go on the device the same way in every variant.
Timing and memory are as in ``jax.decode`` (host time of each step, waiting for the device;
the bytes the cache holds). On the CPU torch runs each step on the calling thread, so a
commit's page mapping and zeroing add to that step instead of overlapping the device's work:
the time targets are set for the GPU.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, format_bytes, require, suite
from jaxbuf.bench._decode_plan import (
    VARIANTS,
    Run,
    _Plan,
    _plan,
    _Schedule,
    _schedule,
    build_cache,
    check_agreement,
    decode_rows,
    param_table,
    set_meta,
)

__all__ = ["decode_suite"]

_LABELS = {
    "jaxbuf": "jaxbuf ExtensibleKVCacheBuffers",
    "preallocated": "preallocated torch cache",
    "realloc": "torch realloc+copy cache",
}


class _Model:
    """The step every variant runs, on ``flat`` ([tokens, 2, heads, head_dim]) in place."""

    def __init__(self, plan: _Plan, device: Any) -> None:
        import torch

        self.torch, self.plan, self.device = torch, plan, device
        self.target = torch.device(device.torch())
        width = plan.heads * plan.head_dim
        rng = np.random.default_rng(0)
        weights = rng.standard_normal((width, 3 * width)).astype(np.float32) / math.sqrt(width)
        self.weights = torch.from_numpy(weights).to(self.target)
        self.freqs = torch.linspace(0.01, 1.0, width, device=self.target)
        self.offsets = torch.arange(plan.num_seqs, device=self.target, dtype=torch.float32)
        t = torch.arange(plan.max_len, device=self.target)
        self.tokens, self.page_of, self.in_page = t, t // plan.block, t % plan.block

    def step(self, flat: Any, block_table: Any, lengths: Any, slots: Any) -> Any:
        torch, plan = self.torch, self.plan
        b, h, d = plan.num_seqs, plan.heads, plan.head_dim
        x = torch.sin(lengths.float()[:, None] * self.freqs[None, :] + self.offsets[:, None])
        q, k, v = torch.split(x @ self.weights, h * d, dim=1)
        flat.index_copy_(0, slots.long(), torch.stack([k.reshape(b, h, d), v.reshape(b, h, d)], 1))
        rows = block_table[:, self.page_of] * plan.block + self.in_page  # [seqs, tokens]
        kv = flat[rows]  # [seqs, tokens, 2, heads, head_dim]
        scores = torch.einsum("bhd,bthd->bht", q.reshape(b, h, d), kv[:, :, 0]) / math.sqrt(d)
        valid = (self.tokens[None, :] < lengths[:, None])[:, None, :]
        attention = torch.softmax(scores.masked_fill(~valid, -math.inf), dim=-1)
        return torch.einsum("bht,bthd->bhd", attention, kv[:, :, 1])

    def write_block_table(self, block_table: Any, writes: tuple) -> None:
        rows, columns, pages = writes
        if rows:
            torch = self.torch
            index = torch.as_tensor(np.array([rows, columns]), device=self.target)
            block_table[index[0], index[1]] = torch.as_tensor(pages, device=self.target)

    def empty_block_table(self) -> Any:
        plan = self.plan
        return self.torch.zeros(
            (plan.num_seqs, plan.blocks_per_seq), dtype=self.torch.int64, device=self.target
        )

    def empty_cache(self, pages: int) -> Any:
        p = self.plan
        return self.torch.zeros(
            (pages * p.block, 2, p.heads, p.head_dim), dtype=self.torch.float32, device=self.target
        )

    def synchronize(self) -> None:
        if self.target.type == "cuda":
            self.torch.cuda.synchronize(self.target)


def _run_plain(model: _Model, schedule: _Schedule, growing: bool) -> Run:
    """The preallocated cache (``growing=False``) or realloc+copy on jaxbuf's schedule."""
    torch, plan = model.torch, model.plan
    capacity = plan.capacity(int(schedule.pages[0])) if growing else plan.total_blocks
    cache, block_table = model.empty_cache(capacity), model.empty_block_table()
    step_s, held = [], []
    gc.disable()
    try:
        for n in range(schedule.steps):
            start = time.perf_counter_ns()
            model.write_block_table(block_table, schedule.writes[n])
            meta = torch.as_tensor(schedule.meta[n], device=model.target)
            out = model.step(cache, block_table, meta[:, 0], meta[:, 1])
            held_now = capacity * plan.block_bytes
            if growing and n + 1 < schedule.steps:
                wanted = plan.capacity(int(schedule.pages[n + 1]))
                if wanted != capacity:  # the copy runs after the step, on the device
                    grown = model.empty_cache(wanted)
                    grown[: cache.shape[0]].copy_(cache)
                    cache = grown
                    held_now += wanted * plan.block_bytes  # old and new, during the copy
                    capacity = wanted
            model.synchronize()
            step_s.append((time.perf_counter_ns() - start) * 1e-9)
            held.append(held_now)
    finally:
        gc.enable()
    return Run(step_s, held, out.cpu().numpy(), block_table.cpu().numpy())


def _run_jaxbuf(model: _Model, schedule: _Schedule) -> Run:
    """The cache in ExtensibleKVCacheBuffers through its torch view, metadata from a
    DeviceParamTable; see the module docstring."""
    plan = model.plan
    kv = build_cache(plan, model.device, plan.capacity(int(schedule.pages[0])))
    table = None
    try:
        table = param_table(plan, model.device)
        fields = table.arrays("torch")
        (view,) = kv.layer_views("float32", (plan.block, 2, plan.heads, plan.head_dim))
        flat = view.to_torch().view(-1, 2, plan.heads, plan.head_dim)  # over the capacity
        block_table = model.empty_block_table()
        step_s, held = [], []
        gc.disable()
        try:
            for n in range(schedule.steps):
                start = time.perf_counter_ns()
                model.write_block_table(block_table, schedule.writes[n])
                set_meta(table, schedule.meta[n])
                out = model.step(flat, block_table, fields["length"], fields["slot"])
                if n + 1 < schedule.steps:  # committed while the device runs this step
                    kv.commit(plan.capacity(int(schedule.pages[n + 1])))
                model.synchronize()
                step_s.append((time.perf_counter_ns() - start) * 1e-9)
                held.append(kv.physical_bytes)
        finally:
            gc.enable()
        return Run(step_s, held, out.cpu().numpy(), block_table.cpu().numpy())
    finally:
        model.synchronize()
        flat = fields = view = None
        if table is not None:
            table.close()
        kv.free()


def _run(model: _Model, variant: str, schedule: _Schedule) -> Run:
    if variant == "jaxbuf":
        return _run_jaxbuf(model, schedule)
    return _run_plain(model, schedule, growing=variant == "realloc")


@suite("torch.decode", requires=("torch",))
def decode_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A torch decode loop over a paged KV cache growing in jaxbuf memory, against a
    preallocated torch cache and realloc+copy: per-step time and memory."""
    require("torch")
    plan = _plan(device, quick)
    profiles = ("short", "long", "mixed")
    yield Sizes(
        f"{plan.num_seqs} sequences of up to {plan.max_len:,} tokens "
        f"({format_bytes(plan.token_bytes)} of K/V per token, pages of {plan.block}), "
        f"{format_bytes(plan.total_blocks * plan.block_bytes)} at most, growth step "
        f"{format_bytes(plan.growth_blocks * plan.block_bytes)}; profiles " + ", ".join(profiles)
    )
    model = _Model(plan, device)
    schedules = {p: _schedule(plan, p) for p in profiles}
    longest = max(schedules.values(), key=lambda s: s.steps)
    for variant in VARIANTS:  # warm: torch's kernels and allocator, jaxbuf's first commits
        _run(model, variant, longest)
    not_here = ""
    if not device.is_cuda:
        not_here = (
            "a GPU target: on the CPU torch runs the step on the calling thread, so a "
            "commit's mapping and zeroing add to the step instead of overlapping it"
        )
    for profile in profiles:
        schedule = schedules[profile]
        runs = {v: _run(model, v, schedule) for v in VARIANTS}
        check_agreement("torch.decode", schedule, runs)
        yield from decode_rows(
            plan,
            schedule,
            runs,
            labels=_LABELS,
            prefix="torch decode",
            not_judged_here=not_here,
            params={"framework": "torch"},
        )
