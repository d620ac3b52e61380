"""Benchmark of a JAX decode loop over a paged KV cache, baselines in-run.

Suite ``jax.decode``: the user's use case. ``num_seqs`` sequences decode one token per step;
each step (one jitted function) appends every sequence's new K/V at its slot, gathers each
sequence's cache through its block table and runs a small attention (projection matmul,
softmax). Pages of ``block`` tokens are handed out in order as sequences cross block
boundaries; page 0 is a scratch page that padding entries of the block table point at and
finished sequences write to. Three ways to hold the cache, in one run:

* **jaxbuf**: the cache is what an engine builds with the public API: an
  :class:`~jaxbuf.ExtensibleKVCacheBuilder` reserves one KV-cache tensor for every page
  (blocks outermost), and the :class:`~jaxbuf.ExtensibleKVCacheBuffers` it finishes commit a
  growth step of whole blocks when the next step needs more pages, while the device works on
  the current step. The step is a :class:`~jaxbuf.KVCacheStep`: the cache imported into JAX
  once, over the full capacity. Where JAX updates donated imports in place (its GPU client)
  the step writes the cache in place and one compiled step serves every grow; where it does
  not (its CPU client: ``params["write_path"]``) the step runs over a power-of-two bucket of
  the committed blocks (one compiled step per bucket) and copies the committed blocks back.
  The lengths and slots come from a :class:`~jaxbuf.DeviceParamTable`, synced per step and
  passed to it as its live JAX mapping; new block-table entries are packed by
  :func:`jaxbuf.jax_ops.pack_writes` and applied inside the step
  (:func:`jaxbuf.jax_ops.apply_staged_writes`).
* **preallocated**: a JAX array holding every page of the maximum length, from the start.
* **realloc+copy**: a JAX array grown on the same schedule as jaxbuf's by ``jnp.pad`` into a
  new array (the old one is dropped after the copy).

The baselines are what a plain JAX user writes: block-table indices built in numpy, put on the
device with ``jax.device_put`` and set with ``.at[rows, cols].set(..., mode="drop")``; the
metadata put on the device the same way. Every variant runs the longest profile once untimed
first (every shape compiled), then each length profile timed step by step (host time of the
whole step, waiting for the device). Memory is the bytes the cache holds at each step:
jaxbuf's ``physical_bytes`` (as the driver committed them), the preallocated array, and
realloc's current array plus, on a growing step, the new one beside it (the transient
peak). The per-step series go into the first row of each profile (``params["series"]``) for
``jaxbuf bench --plot``. The CPU numbers are not the claim: the time targets are set for the
GPU, where the step writes the cache in place.

The sizes and length profiles' schedules, shared with ``torch.decode``, are in
:mod:`jaxbuf.bench._decode_plan`.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, format_bytes, suite
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
    "preallocated": "preallocated JAX cache",
    "realloc": "realloc+copy JAX cache",
}


class _Model:
    """The jitted pieces, shared by every variant and profile (compiled once per shape)."""

    def __init__(self, plan: _Plan, device: Any) -> None:
        import jax
        import jax.numpy as jnp

        from jaxbuf.jax_ops import apply_staged_writes

        self.jax, self.jnp = jax, jnp
        self.plan, self.device = plan, device
        self.jax_device = device.jax()
        b, h, d, block, t_max = (plan.num_seqs, plan.heads, plan.head_dim, plan.block, plan.max_len)
        width = h * d
        rng = np.random.default_rng(0)
        self.weights = self.put(
            rng.standard_normal((width, 3 * width)).astype(np.float32) / math.sqrt(width)
        )
        # The XLA scatter where no GPU kernel applies; the library's default on a GPU.
        apply_kwargs: dict[str, Any] = {} if device.is_cuda else {"method": "scatter"}
        self.apply_method = apply_kwargs.get("method", "default")

        def append_and_attend(flat, block_table, lengths, slots, weights):
            """Write each sequence's new K/V at its slot of ``flat`` ([tokens, 2, heads,
            head_dim]) and attend over its pages."""
            freqs = jnp.linspace(0.01, 1.0, width, dtype=jnp.float32)
            x = jnp.sin(
                lengths.astype(jnp.float32)[:, None] * freqs[None, :] + jnp.arange(b)[:, None]
            )
            q, k, v = jnp.split(x @ weights, 3, axis=1)
            q = q.reshape(b, h, d)
            flat = flat.at[slots].set(jnp.stack([k.reshape(b, h, d), v.reshape(b, h, d)], 1))
            t = jnp.arange(t_max)
            rows = block_table[:, t // block] * block + t % block  # [seqs, tokens]
            kv = flat[rows]  # [seqs, tokens, 2, heads, head_dim]
            scores = jnp.einsum("bhd,bthd->bht", q, kv[:, :, 0]) / math.sqrt(d)
            valid = (t[None, :] < lengths[:, None])[:, None, :]
            attention = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
            return flat, jnp.einsum("bht,bthd->bhd", attention, kv[:, :, 1])

        def plain_step(cache, block_table, rows, columns, pages, meta, weights):
            block_table = block_table.at[rows, columns].set(pages, mode="drop")
            cache, out = append_and_attend(cache, block_table, meta[:, 0], meta[:, 1], weights)
            return cache, block_table, out

        def kv_step(caches, block_table, packed, length, slot, weights):
            """A :class:`~jaxbuf.KVCacheStep` function: one layer view, blocks of
            ``(block, 2, heads, head_dim)``; the block table comes back beside the output."""
            (cache,) = caches
            block_table = apply_staged_writes(block_table, packed, **apply_kwargs)
            flat, out = append_and_attend(
                cache.reshape(-1, 2, h, d), block_table, length, slot, weights
            )
            return [flat.reshape(cache.shape)], (block_table, out)

        self.kv_step = kv_step
        self.block_shape = (block, 2, h, d)
        self.plain_step = jax.jit(plain_step, donate_argnums=(0, 1))
        self.grow = jax.jit(
            lambda cache, rows: jnp.pad(
                cache, ((0, rows - cache.shape[0]), (0, 0), (0, 0), (0, 0))
            ),
            static_argnums=1,
        )
        self.no_rows = self.put(
            (np.full(b, b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32))
        )  # row index b is out of range: the scatter drops every entry
        # Unexpanded on a GPU, as the PackRing's packs there: one compiled step for both.
        self.expand = not device.is_cuda
        self.no_writes = self.put(self.pack([], [], []))

    def put(self, value: Any) -> Any:
        return self.jax.device_put(value, self.jax_device)

    def pack(self, rows: list[int], columns: list[int], pages: list[int], ring: Any = None) -> Any:
        """The block-table writes packed, into ``ring`` (a :class:`~jaxbuf.jax_ops.PackRing`,
        read by the step in place) when given."""
        from jaxbuf.jax_ops import pack_writes

        b = self.plan.num_seqs
        # A floor of one write per sequence keeps every step on one compiled shape.
        return pack_writes(
            rows,
            columns,
            [[p] for p in pages],
            "int32",
            shape=(b, self.plan.blocks_per_seq),
            min_write_bucket=b,
            min_content_bucket=b,
            ring=ring,
            expand=self.expand,
        )

    def empty_cache(self, pages: int) -> Any:
        p = self.plan
        return self.put(np.zeros((pages * p.block, 2, p.heads, p.head_dim), np.float32))

    def empty_block_table(self) -> Any:
        return self.put(np.zeros((self.plan.num_seqs, self.plan.blocks_per_seq), np.int32))

    def compiled(self) -> int | None:
        """Executables of the plain steps compiled so far (None where JAX does not say)."""
        sizes = [getattr(f, "_cache_size", None) for f in (self.plain_step, self.grow)]
        return sum(s() for s in sizes) if all(callable(s) for s in sizes) else None


def _run_plain(model: _Model, schedule: _Schedule, growing: bool) -> Run:
    """The preallocated cache (``growing=False``) or realloc+copy on jaxbuf's schedule."""
    plan = model.plan
    capacity = plan.capacity(int(schedule.pages[0])) if growing else plan.total_blocks
    cache, block_table = model.empty_cache(capacity), model.empty_block_table()
    step_s, held = [], []
    before = model.compiled()
    gc.disable()
    try:
        for n in range(schedule.steps):
            start = time.perf_counter_ns()
            rows, columns, pages = schedule.writes[n]
            if rows:
                k = len(rows)
                index_rows = np.full(plan.num_seqs, plan.num_seqs, np.int32)
                index_columns = np.zeros(plan.num_seqs, np.int32)
                values = np.zeros(plan.num_seqs, np.int32)
                index_rows[:k], index_columns[:k], values[:k] = rows, columns, pages
                indices = model.put((index_rows, index_columns, values))
            else:
                indices = model.no_rows
            meta = model.put(schedule.meta[n])
            cache, block_table, out = model.plain_step(
                cache, block_table, *indices, meta, model.weights
            )
            held_now = capacity * plan.block_bytes
            if growing and n + 1 < schedule.steps:
                wanted = plan.capacity(int(schedule.pages[n + 1]))
                if wanted != capacity:  # the copy runs after the step, on the device
                    cache = model.grow(cache, wanted * plan.block)
                    held_now += wanted * plan.block_bytes  # old and new, during the copy
                    capacity = wanted
            out.block_until_ready()
            cache.block_until_ready()
            step_s.append((time.perf_counter_ns() - start) * 1e-9)
            held.append(held_now)
    finally:
        gc.enable()
    after = model.compiled()
    result = Run(
        step_s,
        held,
        np.asarray(out),
        np.asarray(block_table),
        None if before is None or after is None else after - before,
    )
    del cache, block_table, out
    return result


class _Jaxbuf:
    """The jaxbuf variant's state, made once per run of the suite as an engine makes it: the
    cache (reserved for the maximum), its :class:`~jaxbuf.KVCacheStep` (compiled once on a
    GPU, once per bucket of committed blocks on the CPU), the metadata table and the
    block-table pack ring. Each profile starts from :meth:`reset`: the cache released and
    ``capacity`` blocks committed again, zeroed, as an engine's sleep and wake."""

    def __init__(self, model: _Model) -> None:
        from jaxbuf.jax_ops import PackRing
        from jaxbuf.kv import KVCacheStep

        plan, device = model.plan, model.device
        self.kv = build_cache(plan, device, 1)
        self.table = self.ring = self.step = None
        try:
            self.table = param_table(plan, device)
            self.fields = self.table.arrays("jax")
            self.ring = PackRing(device=device)  # the step reads its block-table writes in place
            self.step = KVCacheStep(self.kv, model.kv_step, "float32", model.block_shape)
        except BaseException:
            self.close()
            raise

    def reset(self, capacity: int) -> None:
        self.kv.release_physical()
        self.kv.commit(capacity)

    def close(self) -> None:
        self.fields = None
        if self.step is not None:
            self.step.close()
        if self.table is not None:
            self.table.close()
        if self.ring is not None:
            self.ring.close()
        self.kv.free()


def _run_jaxbuf(model: _Model, state: _Jaxbuf, schedule: _Schedule) -> Run:
    """The cache in ExtensibleKVCacheBuffers under a KVCacheStep, block-table writes through
    jax_ops, metadata from a DeviceParamTable; see the module docstring."""
    plan, kv, step, table, fields = model.plan, state.kv, state.step, state.table, state.fields
    state.reset(plan.capacity(int(schedule.pages[0])))
    block_table = model.empty_block_table()
    step_s, held = [], []
    out = None
    before = step.compiled()
    gc.disable()
    try:
        for n in range(schedule.steps):
            start = time.perf_counter_ns()
            rows, columns, pages = schedule.writes[n]
            packed = model.pack(rows, columns, pages, state.ring) if rows else model.no_writes
            set_meta(table, schedule.meta[n])
            block_table, out = step(
                block_table, packed, fields["length"], fields["slot"], model.weights
            )
            if rows:
                state.ring.consumed_by(out)  # the slot is rewritten once this step is done
            if n + 1 < schedule.steps:  # committed while the device runs this step
                kv.commit(plan.capacity(int(schedule.pages[n + 1])))
            out.block_until_ready()
            step_s.append((time.perf_counter_ns() - start) * 1e-9)
            held.append(kv.physical_bytes)
    finally:
        gc.enable()
        if out is not None:
            out.block_until_ready()
    after = step.compiled()
    return Run(
        step_s,
        held,
        np.asarray(out),
        np.asarray(block_table),
        None if before is None or after is None else after - before,
    )


def _run(model: _Model, state: _Jaxbuf, variant: str, schedule: _Schedule) -> Run:
    if variant == "jaxbuf":
        return _run_jaxbuf(model, state, schedule)
    return _run_plain(model, schedule, growing=variant == "realloc")


def _profile_rows(
    plan: _Plan, schedule: _Schedule, runs: dict[str, Run], model: _Model, in_place: bool
) -> Iterator[Row]:
    write_path = "donate" if in_place else "write-back"
    notes = not_here = ""
    if not in_place:  # where JAX copies a donated import (its CPU client)
        notes = (
            "; this device's JAX copies a donated import, so KVCacheStep copies the "
            "committed blocks back after each step"
        )
        not_here = (
            "a GPU target: here JAX copies a donated import, so each step copies a bucket of "
            "the committed blocks and KVCacheStep copies them back, a path the GPU does not take"
        )
    yield from decode_rows(
        plan,
        schedule,
        runs,
        labels=_LABELS,
        prefix="decode",
        notes=notes,
        not_judged_here=not_here,
        params={
            "framework": "jax",
            "write_path": write_path,
            "block_table_apply": model.apply_method,
        },
    )


@suite("jax.decode", requires=("jax",), fresh_jax_allocations=True)
def decode_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A JAX decode loop over a paged KV cache growing in jaxbuf memory, against a preallocated
    JAX cache and realloc+copy: per-step time and memory."""
    plan = _plan(device, quick)
    profiles = ("short", "long", "mixed")
    yield Sizes(
        f"{plan.num_seqs} sequences of up to {plan.max_len:,} tokens "
        f"({format_bytes(plan.token_bytes)} of K/V per token, pages of {plan.block}), "
        f"{format_bytes(plan.total_blocks * plan.block_bytes)} at most, growth step "
        f"{format_bytes(plan.growth_blocks * plan.block_bytes)}; profiles " + ", ".join(profiles)
    )
    model = _Model(plan, device)
    state = _Jaxbuf(model)
    try:
        schedules = {p: _schedule(plan, p) for p in profiles}
        longest = max(schedules.values(), key=lambda s: s.steps)
        for variant in VARIANTS:  # every shape compiled before anything is timed
            _run(model, state, variant, longest)
        for profile in profiles:
            schedule = schedules[profile]
            runs = {v: _run(model, state, v, schedule) for v in VARIANTS}
            check_agreement("jax.decode", schedule, runs)
            yield from _profile_rows(plan, schedule, runs, model, state.step.in_place)
    finally:
        state.close()
