"""The decode loop of the ``jax.decode`` suite (:mod:`jaxbuf.bench.jax_decode`): what it computes.

``_Plan`` is one run's sizes and the growth schedule of the growing caches; ``_Schedule`` one
length profile's host-side bookkeeping (per-step metadata and block-table writes), computed
once and fed to every variant; ``_Model`` the jitted pieces every variant shares (a step per
variant, the projection, attention, the realloc+copy grow). ``_write_path`` probes how the
jaxbuf variant writes its cache on this device: in place through a donated step where JAX
updates an imported array in place, else through numpy (CPU) or torch (GPU). The suite itself,
the variants' timed loops and the rows, is in :mod:`jaxbuf.bench.jax_decode`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxbuf.bench import SuiteSkipped, missing_dependency


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
    # The CPU runs the attention on a couple of cores: small heads, short sequences (the
    # default run on the CPU stays within a minute and a half). Every growth step is a shape
    # compiled (twice: jaxbuf and realloc+copy), so few of them.
    if quick:
        return _Plan(4, 2, 64, 16, 128, 3, granule)
    return _Plan(8, 4, 64, 16, 160, 4, granule)


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
