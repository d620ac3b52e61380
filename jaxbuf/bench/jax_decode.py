"""Benchmark of a JAX decode loop over a paged KV cache (issue 13, item 3), baselines in-run.

Suite ``jax.decode``: the user's use case. ``num_seqs`` sequences decode one token per step;
each step (one jitted function, cache and block table donated) appends every sequence's new
K/V at its slot, gathers each sequence's cache through its block table and runs a small
attention (projection matmul, softmax). Pages of ``block`` tokens are handed out in order as
sequences cross block boundaries; page 0 is a scratch page that padding entries of the block
table point at and finished sequences write to. Three ways to hold the cache, in one run:

* **jaxbuf**: the cache lives in an :class:`~jaxbuf.ExtensibleTensor` that grows by a growth
  step (whole blocks, and whole granules where a growth step spans one) when the next step
  needs more pages than it holds; the grow runs while the device works on the current step,
  and the view is imported again (``to_jax``) only then, when its shape changes. New
  block-table entries are packed by :func:`jaxbuf.jax_ops.pack_writes` and applied inside the
  step (:func:`jaxbuf.jax_ops.apply_staged_writes`); the per-step metadata (lengths, slots)
  comes from a :class:`~jaxbuf.UvaBufferPool` with ``framework="jax"``.
* **preallocated**: a JAX array holding every page of the maximum length, from the start.
* **realloc+copy**: a JAX array grown on the same schedule as jaxbuf's by ``jnp.pad`` into a
  new array (the old one is dropped after the copy).

The baselines are what a plain JAX user writes: block-table indices built in numpy, put on the
device with ``jax.device_put`` and set with ``.at[rows, cols].set(..., mode="drop")``; the
metadata put on the device the same way (jaxbuf puts its packed writes there too). Every
variant runs the longest profile once untimed first (every shape compiled), then each length
profile timed step by step (host time of the whole step, waiting for the device). Memory is
the bytes the cache holds at each step: jaxbuf's ``physical_bytes`` (as the driver committed
them), the preallocated array, and realloc's current array plus, on a growing step, the new
one beside it (the transient peak). The per-step series go into the first row of each profile
(``params["series"]``) for ``jaxbuf bench --plot``.

How jaxbuf's cache is written is probed once: where a jitted step that donates an imported
array updates that memory in place, the step above is used as is (``write_path="donate"``).
Where JAX returns a copy instead (its CPU client does), the new K/V rows are computed by a
jitted projection and written outside JAX, then a second jitted call attends: through numpy
into the host memory of the cache on the CPU (``"numpy"``), with torch's ``index_copy_`` on a
torch view of it on a GPU (``"torch"``, synchronised before JAX reads). The row notes and
``params["write_path"]`` say which ran. The CPU numbers are not the claim: the targets are set
for the GPU.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, SuiteSkipped, format_bytes, missing_dependency, suite

_STEP_TARGET = 1.1  # jaxbuf's median step <= 1.1x the preallocated cache's
_SPIKE_TARGET = 2.0  # jaxbuf's slowest step <= 2x the preallocated cache's slowest step
# The variants' attention outputs agree to this: the same float32 math, maybe compiled into
# different kernels (TF32 matmuls on a GPU); a wrong page or a stale cache is off by far more.
_TOLERANCE = 2e-2
VARIANTS = ("jaxbuf", "preallocated", "realloc")
_LABELS = {
    "jaxbuf": "jaxbuf ExtensibleTensor",
    "preallocated": "preallocated JAX cache",
    "realloc": "realloc+copy JAX cache",
}


@dataclass(frozen=True)
class _Plan:
    """Sizes of one run. Every token stores K and V: ``2 * heads * head_dim`` float32."""

    num_seqs: int
    heads: int
    head_dim: int
    block: int  # tokens per page
    max_len: int  # tokens per sequence at most
    growth_steps: int  # the growing caches reach the maximum in about this many grows
    granule: int

    @property
    def token_bytes(self) -> int:
        return 2 * self.heads * self.head_dim * 4

    @property
    def block_bytes(self) -> int:
        return self.block * self.token_bytes

    @property
    def blocks_per_seq(self) -> int:
        return self.max_len // self.block

    @property
    def total_blocks(self) -> int:
        """Pages of the maximum: every sequence at ``max_len``, plus the scratch page."""
        return 1 + self.num_seqs * self.blocks_per_seq

    @property
    def growth_blocks(self) -> int:
        """Pages per grow: whole blocks, rounded up to whole granules where a growth step
        spans at least one (so jaxbuf commits exactly what the array shows)."""
        blocks = -(-self.total_blocks // self.growth_steps)
        if blocks * self.block_bytes >= self.granule and self.granule % self.block_bytes == 0:
            per_granule = self.granule // self.block_bytes
            blocks = -(-blocks // per_granule) * per_granule
        return blocks

    @property
    def growth_step_bytes(self) -> int:
        """Bytes a growing cache may hold beyond the pages in use: the growth step, plus the
        granule the driver rounds a commit up to where the step is not whole granules."""
        step = self.growth_blocks * self.block_bytes
        return step if step % self.granule == 0 else step + self.granule

    def capacity(self, pages: int) -> int:
        """Pages a growing cache holds when ``pages`` are in use: whole growth steps, never
        more than the maximum."""
        return min(-(-pages // self.growth_blocks) * self.growth_blocks, self.total_blocks)


def _plan(device: Any, quick: bool) -> _Plan:
    from jaxbuf import granule_size

    granule = granule_size(device)
    if device.is_cuda:
        if quick:
            return _Plan(16, 8, 128, 16, 512, 3, granule)
        return _Plan(32, 8, 128, 16, 2048, 8, granule)
    # The CPU runs the attention on a couple of cores: small heads, short sequences. Every
    # growth step is a shape compiled (twice: jaxbuf and realloc+copy), so few of them.
    if quick:
        return _Plan(4, 2, 64, 16, 128, 3, granule)
    return _Plan(8, 4, 64, 16, 512, 4, granule)


@dataclass
class _Schedule:
    """One length profile's host-side bookkeeping, computed once and fed to every variant.

    ``meta[n]`` is step ``n``'s ``[num_seqs, 2]`` int32 (length after the step's token, slot of
    that token); ``writes[n]`` the block-table entries the step adds, as ``(rows, columns,
    pages)``; ``pages[n]`` the pages in use during step ``n`` (the scratch page included).
    """

    name: str
    final_lengths: list[int]
    meta: np.ndarray
    writes: list[tuple[list[int], list[int], list[int]]]
    pages: np.ndarray

    @property
    def steps(self) -> int:
        return self.meta.shape[0]


def _final_lengths(plan: _Plan, profile: str) -> list[int]:
    b, top = plan.num_seqs, plan.max_len
    if profile == "short":
        return [top // 4] * b
    if profile == "long":
        return [top] * b
    if profile == "mixed":  # from an eighth of the maximum up to all of it
        return [max(1, round(top * (1 + 7 * s / max(1, b - 1)) / 8)) for s in range(b)]
    raise ValueError(f"unknown length profile {profile!r}")


def _schedule(plan: _Plan, profile: str) -> _Schedule:
    finals = _final_lengths(plan, profile)
    steps = max(finals)
    meta = np.zeros((steps, plan.num_seqs, 2), np.int32)
    lengths = [0] * plan.num_seqs
    pages_of: list[list[int]] = [[] for _ in range(plan.num_seqs)]
    next_page = 1  # page 0 is the scratch page
    writes, pages = [], np.zeros(steps, np.int64)
    for n in range(steps):
        rows, columns, new_pages = [], [], []
        for s in range(plan.num_seqs):
            position = lengths[s]
            if position < finals[s]:
                if position % plan.block == 0:  # the token starts a block: a new page
                    rows.append(s)
                    columns.append(position // plan.block)
                    new_pages.append(next_page)
                    pages_of[s].append(next_page)
                    next_page += 1
                slot = pages_of[s][position // plan.block] * plan.block + position % plan.block
                lengths[s] += 1
            else:  # finished: its token goes to the scratch page, its length stays
                slot = s % plan.block
            meta[n, s] = (lengths[s], slot)
        writes.append((rows, columns, new_pages))
        pages[n] = next_page
    return _Schedule(profile, finals, meta, writes, pages)


class _Model:
    """The jitted pieces, shared by every variant and profile (compiled once per shape)."""

    def __init__(self, plan: _Plan, device: Any, write_path: str) -> None:
        import jax
        import jax.numpy as jnp

        from jaxbuf.jax_ops import apply_staged_writes

        self.jax, self.jnp = jax, jnp
        self.plan = plan
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
        self.write_path = write_path  # how jaxbuf's cache gets the new K/V: see the docstring

        def project(meta, weights):
            lengths = meta[:, 0].astype(jnp.float32)
            freqs = jnp.linspace(0.01, 1.0, width, dtype=jnp.float32)
            x = jnp.sin(lengths[:, None] * freqs[None, :] + jnp.arange(b)[:, None])
            q, k, v = jnp.split(x @ weights, 3, axis=1)
            return q.reshape(b, h, d), jnp.stack([k.reshape(b, h, d), v.reshape(b, h, d)], 1)

        def attend(cache, block_table, meta, q):
            t = jnp.arange(t_max)
            rows = block_table[:, t // block] * block + t % block  # [seqs, tokens]
            kv = cache[rows]  # [seqs, tokens, 2, heads, head_dim]
            scores = jnp.einsum("bhd,bthd->bht", q, kv[:, :, 0]) / math.sqrt(d)
            valid = (t[None, :] < meta[:, 0:1])[:, None, :]
            weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
            return jnp.einsum("bht,bthd->bhd", weights, kv[:, :, 1])

        def append_and_attend(cache, block_table, meta, weights):
            q, kv = project(meta, weights)
            cache = cache.at[meta[:, 1]].set(kv)
            return cache, block_table, attend(cache, block_table, meta, q)

        def plain_step(cache, block_table, rows, columns, pages, meta, weights):
            block_table = block_table.at[rows, columns].set(pages, mode="drop")
            return append_and_attend(cache, block_table, meta, weights)

        def jaxbuf_step(cache, block_table, packed, meta, weights):
            block_table = apply_staged_writes(block_table, packed, **apply_kwargs)
            return append_and_attend(cache, block_table, meta, weights)

        def jaxbuf_attend(cache, block_table, packed, meta, q):
            block_table = apply_staged_writes(block_table, packed, **apply_kwargs)
            return block_table, attend(cache, block_table, meta, q)

        self.plain_step = jax.jit(plain_step, donate_argnums=(0, 1))
        self.jaxbuf_step = jax.jit(jaxbuf_step, donate_argnums=(0, 1))
        self.project = jax.jit(project)
        self.jaxbuf_attend = jax.jit(jaxbuf_attend, donate_argnums=(1,))
        self.grow = jax.jit(
            lambda cache, rows: jnp.pad(
                cache, ((0, rows - cache.shape[0]), (0, 0), (0, 0), (0, 0))
            ),
            static_argnums=1,
        )
        self.no_rows = self.put(
            (np.full(b, b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32))
        )  # row index b is out of range: the scatter drops every entry
        self.no_writes = self.put(self.pack([], [], []))

    def put(self, value: Any) -> Any:
        return self.jax.device_put(value, self.jax_device)

    def pack(self, rows: list[int], columns: list[int], pages: list[int]) -> Any:
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
        )

    def empty_cache(self, pages: int) -> Any:
        p = self.plan
        return self.put(np.zeros((pages * p.block, 2, p.heads, p.head_dim), np.float32))

    def empty_block_table(self) -> Any:
        return self.put(np.zeros((self.plan.num_seqs, self.plan.blocks_per_seq), np.int32))

    def compiled(self) -> int | None:
        """Executables compiled so far (None where JAX does not say): a growth in a timed
        pass means a compile inside it."""
        jitted = (self.plain_step, self.jaxbuf_step, self.project, self.jaxbuf_attend, self.grow)
        sizes = [getattr(f, "_cache_size", None) for f in jitted]
        return sum(s() for s in sizes) if all(callable(s) for s in sizes) else None


def _donation_in_place(device: Any) -> bool:
    """Whether a jitted step that donates an array imported from jaxbuf memory writes that
    memory, measured here (JAX's CPU client returns a copy)."""
    import jax

    from jaxbuf import ExtensibleTensor, granule_size

    probe = ExtensibleTensor(granule_size(device), device=device)
    try:
        probe.resize_per_segment_(4096, zero_new=True)
        array = probe.segment_view(0).to_jax(dtype="float32", shape=(1024,))
        step = jax.jit(lambda x: x.at[0].set(1.0), donate_argnums=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable"
            result = step(array)
        result.block_until_ready()
        in_place = result.unsafe_buffer_pointer() == probe.base_ptr
        del array, result
    finally:
        probe.free()
    return in_place


def _write_path(device: Any) -> str:
    """How the jaxbuf variant writes its cache here (see the module docstring)."""
    if _donation_in_place(device):
        return "donate"
    if not device.is_cuda:
        return "numpy"
    reason = missing_dependency("torch")
    if reason is not None:
        raise SuiteSkipped(
            f"JAX copies a donated import on {device}, so the cache is written by torch, "
            f"which this run lacks: {reason}"
        )
    return "torch"


def _torch_write(target: Any, slots: np.ndarray, kv: Any) -> None:
    """``target[slots] = kv`` by torch on its stream, finished before JAX reads the cache."""
    import torch

    kv.block_until_ready()
    index = torch.as_tensor(slots.astype(np.int64), device=target.device)
    target.index_copy_(0, index, torch.from_dlpack(kv))
    if target.is_cuda:  # JAX's stream cannot wait for torch's: the host waits
        torch.cuda.synchronize(target.device)


@dataclass
class _Run:
    """One variant over one profile: per-step host time, bytes held, last outputs."""

    step_s: list[float]
    held_bytes: list[int]
    out: np.ndarray
    block_table: np.ndarray
    compiles: int | None


def _run_plain(model: _Model, schedule: _Schedule, growing: bool) -> _Run:
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
    result = _Run(
        step_s,
        held,
        np.asarray(out),
        np.asarray(block_table),
        None if before is None or after is None else after - before,
    )
    del cache, block_table, out
    return result


def _run_jaxbuf(model: _Model, schedule: _Schedule, device: Any) -> _Run:
    """The cache in an ExtensibleTensor, block-table writes through jax_ops, metadata from a
    UVA pool; see the module docstring."""
    from jaxbuf import ExtensibleTensor, UvaBufferPool

    plan = model.plan
    cache = ExtensibleTensor(plan.total_blocks * plan.block_bytes, device=device)
    pool = None
    array = target = out = block_table = None
    try:
        pool = UvaBufferPool((plan.num_seqs, 2), "int32", device=device, framework="jax")

        def imported(pages: int) -> tuple[Any, Any]:
            """The committed pages as a JAX array, and as the array the K/V rows are written
            through where JAX does not write them (numpy, torch)."""
            view = cache.segment_view(0)
            shape = (pages * plan.block, 2, plan.heads, plan.head_dim)
            writable = None
            if model.write_path == "numpy":
                writable = view.to_numpy().view(np.float32).reshape(shape)
            elif model.write_path == "torch":
                writable = view.to_torch(dtype="float32", shape=shape)
            return view.to_jax(dtype="float32", shape=shape), writable

        capacity = plan.capacity(int(schedule.pages[0]))
        cache.resize_per_segment_(capacity * plan.block_bytes, zero_new=True)
        array, target = imported(capacity)
        block_table = model.empty_block_table()
        step_s, held = [], []
        before = model.compiled()
        gc.disable()
        try:
            for n in range(schedule.steps):
                start = time.perf_counter_ns()
                rows, columns, pages = schedule.writes[n]
                packed = model.put(model.pack(rows, columns, pages)) if rows else model.no_writes
                meta = pool.copy_to_uva(schedule.meta[n])
                if model.write_path == "donate":
                    array, block_table, out = model.jaxbuf_step(
                        array, block_table, packed, meta, model.weights
                    )
                else:
                    q, kv = model.project(meta, model.weights)
                    slots = schedule.meta[n][:, 1]
                    if model.write_path == "numpy":
                        target[slots] = np.asarray(kv)
                    else:
                        _torch_write(target, slots, kv)
                    block_table, out = model.jaxbuf_attend(array, block_table, packed, meta, q)
                wanted = capacity
                if n + 1 < schedule.steps:
                    wanted = plan.capacity(int(schedule.pages[n + 1]))
                if wanted != capacity:  # committed while the device runs this step
                    cache.resize_per_segment_(wanted * plan.block_bytes, zero_new=True)
                out.block_until_ready()
                if wanted != capacity:  # a new shape: import the grown view
                    array = target = None
                    array, target = imported(wanted)
                    capacity = wanted
                step_s.append((time.perf_counter_ns() - start) * 1e-9)
                held.append(cache.physical_bytes)
                if n == 0 and model.write_path == "donate":
                    _check_in_place(array, cache)
        finally:
            gc.enable()
        after = model.compiled()
        return _Run(
            step_s,
            held,
            np.asarray(out),
            np.asarray(block_table),
            None if before is None or after is None else after - before,
        )
    finally:
        if out is not None:
            out.block_until_ready()
        array = target = out = block_table = None
        if pool is not None:
            pool.close()
        cache.free()


def _check_in_place(array: Any, cache: Any) -> None:
    array.block_until_ready()
    if array.unsafe_buffer_pointer() != cache.base_ptr:
        raise RuntimeError(
            "jax.decode: the donated step returned a copy of the imported cache instead of "
            "updating jaxbuf memory in place; the jaxbuf variant would not measure jaxbuf"
        )


def _run(model: _Model, variant: str, schedule: _Schedule, device: Any) -> _Run:
    if variant == "jaxbuf":
        return _run_jaxbuf(model, schedule, device)
    return _run_plain(model, schedule, growing=variant == "realloc")


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 9) for v in values]


def _profile_rows(
    plan: _Plan, schedule: _Schedule, runs: dict[str, _Run], model: _Model
) -> Iterator[Row]:
    name = schedule.name
    median = {v: statistics.median(r.step_s) for v, r in runs.items()}
    slowest = {v: max(r.step_s) for v, r in runs.items()}
    spikes = ", ".join(f"{v} {slowest[v] / median[v]:.2g}" for v in VARIANTS)
    # What the tokens need: the pages in use during the step and the next one (a page is
    # committed before the step that first writes it).
    needed = [int(p) * plan.block_bytes for p in schedule.pages]
    needed_next = needed[1:] + needed[-1:]
    bound = [n + plan.growth_step_bytes for n in needed_next]
    held = runs["jaxbuf"].held_bytes
    memory_ok = all(h <= b for h, b in zip(held, bound))
    peaks = {v: max(r.held_bytes) for v, r in runs.items()}
    memory_note = (
        f"bytes held at most: jaxbuf {format_bytes(peaks['jaxbuf'])}, preallocated "
        f"{format_bytes(peaks['preallocated'])}, realloc+copy {format_bytes(peaks['realloc'])} "
        f"(old + new during a copy); the tokens need {format_bytes(max(needed))}"
    )
    path = ""
    if model.write_path != "donate":
        path = (
            "; this device's JAX copies a donated import, so jaxbuf writes new K/V through "
            f"{model.write_path} and attends in a second jitted call"
        )
    compiles = {v: r.compiles for v, r in runs.items() if r.compiles}
    compile_note = f"; compiled inside the timed run: {compiles}" if compiles else ""
    common = {
        "profile": name,
        "steps": schedule.steps,
        "write_path": model.write_path,
        "block_table_apply": model.apply_method,
    }
    step_row = Row(
        f"decode {name}: median step (jaxbuf)",
        median["jaxbuf"],
        f"{_LABELS['preallocated']}, median step",
        median["preallocated"],
        notes=f"max/median: {spikes}{path}{compile_note}",
        target=f"<= {_STEP_TARGET:g}x preallocated",
        met=median["jaxbuf"] <= _STEP_TARGET * median["preallocated"],
        params={
            **common,
            "kind": "decode-step",
            "median_s": median,
            "max_s": slowest,
            "needed_bytes": needed,
            "growth_step_bytes": plan.growth_step_bytes,
            "series": {
                v: {"step_s": _rounded(r.step_s), "held_bytes": r.held_bytes}
                for v, r in runs.items()
            },
        },
    )
    yield step_row
    yield Row(
        f"decode {name}: median step, memory (jaxbuf)",
        median["jaxbuf"],
        f"{_LABELS['realloc']}, median step",
        median["realloc"],
        notes=memory_note,
        target="held <= tokens + 1 growth step",
        met=memory_ok,
        params={**common, "kind": "decode-memory", "peak_bytes": peaks},
    )
    yield Row(
        f"decode {name}: slowest step (jaxbuf)",
        slowest["jaxbuf"],
        f"{_LABELS['preallocated']}, slowest step",
        slowest["preallocated"],
        notes=f"max/median: {spikes}",
        target=f"<= {_SPIKE_TARGET:g}x preallocated",
        met=slowest["jaxbuf"] <= _SPIKE_TARGET * slowest["preallocated"],
        params={**common, "kind": "decode-spike"},
    )
    yield Row(
        f"decode {name}: slowest step (jaxbuf)",
        slowest["jaxbuf"],
        f"{_LABELS['realloc']}, slowest step",
        slowest["realloc"],
        notes="realloc+copy's slowest steps are its copies",
        params={**common, "kind": "decode-spike-realloc"},
    )


def _check_agreement(schedule: _Schedule, runs: dict[str, _Run]) -> None:
    """The variants computed the same thing (a guard for the numbers, not a test)."""
    reference = runs["preallocated"]
    for variant, run in runs.items():
        if not np.array_equal(run.block_table, reference.block_table) or not np.allclose(
            run.out, reference.out, rtol=_TOLERANCE, atol=_TOLERANCE
        ):
            raise AssertionError(
                f"jax.decode {schedule.name}: {variant} disagrees with the preallocated cache"
            )


@suite("jax.decode", requires=("jax",))
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
    model = _Model(plan, device, _write_path(device))
    schedules = {p: _schedule(plan, p) for p in profiles}
    longest = max(schedules.values(), key=lambda s: s.steps)
    for variant in VARIANTS:  # every shape compiled before anything is timed
        _run(model, variant, longest, device)
    for profile in profiles:
        schedule = schedules[profile]
        runs = {v: _run(model, v, schedule, device) for v in VARIANTS}
        _check_agreement(schedule, runs)
        yield from _profile_rows(plan, schedule, runs, model)
