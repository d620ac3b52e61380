"""The flagship decode loop, shared by the ``jax.paged_decode`` suite and
``notebooks/06_paged_decode``: a small random-weight decoder-only transformer decoding with
paged attention, over jaxbuf's growable KV cache and over a preallocated JAX cache.

The model (:class:`PagedConfig`, :func:`init_weights`, :func:`decode_step`): per layer, the new
token's K/V is written at its slot (block ``block_table[row, position // block_tokens]``,
offset ``position % block_tokens``), each request's blocks are gathered through its block
table, attention is a masked softmax over its length, then an MLP; logits at the end. The
cache is one array in the engine's layout, ``(layers, 2, blocks, block_tokens, heads,
head_dim)`` (K and V of each layer as segments of one tensor); the step indexes blocks only
through block ids, so it runs over any number of blocks that covers the ids in use.

The loop (:class:`Requests`, :func:`run`): requests arrive over the run (:func:`arrivals`);
a torch prefill (:func:`prefill_kv`, the same weights) computes each arriving prompt's K/V,
written into the cache through the cache's torch view; the cache grows by whole blocks
between steps; each step feeds every request its last token and takes the argmax of its
logits as the next. Row ``r`` with no request decodes a placeholder in block 0 (a scratch
block no request owns) at offset ``r``, so every row's output is defined.

The caches (:class:`JaxbufCache`, :class:`PreallocatedCache`) behind one interface: what
differs is how the cache is held, grown, written by torch and stepped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Arrival",
    "JaxbufCache",
    "PagedConfig",
    "PreallocatedCache",
    "Requests",
    "Trace",
    "arrivals",
    "decode_step",
    "init_weights",
    "prefill_kv",
    "run",
]


@dataclass(frozen=True)
class PagedConfig:
    """The model's sizes and the request slots decoded per step (float32 throughout)."""

    layers: int = 2
    heads: int = 4
    head_dim: int = 32
    block_tokens: int = 16
    vocab: int = 256
    mlp: int = 256
    rows: int = 4  # requests decoded per step
    max_blocks: int = 8  # blocks per request at most
    seed: int = 0

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def max_tokens(self) -> int:
        return self.max_blocks * self.block_tokens

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one segment (a layer's K or V): ``(block_tokens, heads, head_dim)``."""
        return (self.block_tokens, self.heads, self.head_dim)

    @property
    def segment_shape(self) -> tuple[int, int]:
        """The segments of a block: ``(layers, 2)``, K and V of each layer."""
        return (self.layers, 2)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every segment."""
        return self.layers * 2 * math.prod(self.block_shape) * 4

    def cache_shape(self, blocks: int) -> tuple[int, ...]:
        return (*self.segment_shape, blocks, *self.block_shape)


@dataclass(frozen=True)
class Arrival:
    """A request arriving before step ``step`` into row ``row`` with ``prompt`` (token ids)."""

    step: int
    row: int
    prompt: tuple[int, ...]


def arrivals(config: PagedConfig, steps: int) -> list[Arrival]:
    """A fixed schedule over ``steps`` steps: two requests at step 0, the others an eighth and
    a quarter of the way in (rows past four arrive with the last), prompts of one and a half
    to two and a half blocks: at 24 steps the requests end up in 15 blocks."""
    rng = np.random.default_rng(config.seed + 1)
    schedule = []
    for row in range(config.rows):
        step = (0, 0, steps // 8, steps // 4)[min(row, 3)]
        length = int(config.block_tokens * (2.5, 1.6, 1.9, 1.6)[row % 4])
        length = max(1, min(length, config.max_tokens - (steps - step)))
        prompt = tuple(int(t) for t in rng.integers(0, config.vocab, length))
        schedule.append(Arrival(step, row, prompt))
    return schedule


def init_weights(config: PagedConfig) -> dict[str, np.ndarray]:
    """Random weights (fixed seed), scaled by fan-in so the activations stay near unit size."""
    rng = np.random.default_rng(config.seed)
    L, E, M = config.layers, config.width, config.mlp

    def normal(*shape: int, fan_in: int = 1) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    return {
        "embed": normal(config.vocab, E),
        "position": normal(config.max_tokens, E),
        "qkv": normal(L, E, 3 * E, fan_in=E),
        "out": normal(L, E, E, fan_in=E),
        "up": normal(L, E, M, fan_in=E),
        "down": normal(L, M, E, fan_in=M),
        "logits": normal(E, config.vocab, fan_in=E),
    }


def decode_step(config: PagedConfig) -> Callable[..., Any]:
    """``step(cache, meta, weights) -> (cache, logits)`` in JAX, to jit.

    ``cache``: ``config.cache_shape(blocks)`` for any ``blocks`` above the block ids in use;
    ``meta``: ``position`` and ``token`` (``[rows]`` int32), ``block_table`` (``[rows,
    max_blocks]`` int32); ``logits``: ``[rows, vocab]`` float32."""
    import jax
    import jax.numpy as jnp

    R, H, D, BT = config.rows, config.heads, config.head_dim, config.block_tokens
    T = config.max_tokens

    def rms(x: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def step(cache: Any, meta: Any, weights: Any) -> tuple[Any, Any]:
        position, table = meta["position"], meta["block_table"]
        x = weights["embed"][meta["token"]] + weights["position"][position]
        block = table[jnp.arange(R), position // BT]  # where the new token's K/V goes
        offset = position % BT
        t = jnp.arange(T)
        blocks, offsets = table[:, t // BT], t % BT  # [rows, tokens]: every request's slots
        valid = (t[None, :] <= position[:, None])[:, None, :]  # [rows, 1, tokens]
        for layer in range(config.layers):
            q, k, v = jnp.split(rms(x) @ weights["qkv"][layer], 3, axis=-1)
            cache = cache.at[layer, 0, block, offset].set(k.reshape(R, H, D))
            cache = cache.at[layer, 1, block, offset].set(v.reshape(R, H, D))
            keys = cache[layer, 0][blocks, offsets]  # [rows, tokens, heads, head_dim]
            values = cache[layer, 1][blocks, offsets]
            scores = jnp.einsum("rhd,rthd->rht", q.reshape(R, H, D), keys) / math.sqrt(D)
            attention = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
            mixed = jnp.einsum("rht,rthd->rhd", attention, values).reshape(R, H * D)
            x = x + mixed @ weights["out"][layer]
            hidden = jax.nn.gelu(rms(x) @ weights["up"][layer], approximate=True)
            x = x + hidden @ weights["down"][layer]
        return cache, rms(x) @ weights["logits"]

    return step


def prefill_kv(config: PagedConfig, weights: dict[str, Any], prompt: Sequence[int]) -> Any:
    """The K/V of ``prompt``'s tokens but its last (which the first decode step feeds), from
    the same model in torch (``weights``: torch tensors): ``[layers, 2, len - 1, heads,
    head_dim]``, causal attention within the prompt."""
    import torch

    n = len(prompt) - 1
    device = weights["embed"].device
    tokens = torch.as_tensor(prompt[:n], dtype=torch.long, device=device)
    x = weights["embed"][tokens] + weights["position"][:n]
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    H, D = config.heads, config.head_dim

    def rms(y: Any) -> Any:
        return y * torch.rsqrt(torch.mean(y * y, dim=-1, keepdim=True) + 1e-6)

    planes = []
    for layer in range(config.layers):
        q, k, v = (p.reshape(n, H, D) for p in (rms(x) @ weights["qkv"][layer]).chunk(3, -1))
        planes.append(torch.stack([k, v]))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        attention = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", attention, v).reshape(n, H * D) @ weights["out"][layer]
        hidden = torch.nn.functional.gelu(rms(x) @ weights["up"][layer], approximate="tanh")
        x = x + hidden @ weights["down"][layer]
    return torch.stack(planes)


class Requests:
    """The host's bookkeeping: each row's position, next token and block table, and the
    block allocator (block 0 is the scratch block; blocks are handed out in order, so
    ``blocks_used`` blocks cover every id in use)."""

    def __init__(self, config: PagedConfig) -> None:
        self.config = config
        self.position = np.arange(config.rows, dtype=np.int32)  # placeholders in block 0
        self.token = np.zeros(config.rows, np.int32)
        self.block_table = np.zeros((config.rows, config.max_blocks), np.int32)
        self.active = np.zeros(config.rows, bool)
        self.blocks_used = 1

    def _allocate(self, row: int, index: int) -> None:
        self.block_table[row, index] = self.blocks_used
        self.blocks_used += 1

    def admit(self, arrival: Arrival) -> tuple[np.ndarray, np.ndarray]:
        """Give the request its row and the blocks of its prompt; return the (block, offset)
        slots of the prompt's tokens but its last, where its prefill K/V goes."""
        config, n = self.config, len(arrival.prompt)
        if self.active[arrival.row]:
            raise ValueError(f"row {arrival.row} already holds a request")
        if not 0 < n <= config.max_tokens:
            raise ValueError(f"a prompt of {n} tokens does not fit {config.max_tokens}")
        for index in range(-(-n // config.block_tokens)):
            self._allocate(arrival.row, index)
        self.active[arrival.row] = True
        self.position[arrival.row] = n - 1
        self.token[arrival.row] = arrival.prompt[-1]
        positions = np.arange(n - 1)
        blocks = self.block_table[arrival.row, positions // config.block_tokens]
        return blocks, positions % config.block_tokens

    def advance(self, logits: np.ndarray) -> None:
        """Each request takes its argmax as its next token, one position on (a new block
        when it starts one)."""
        config = self.config
        for row in np.flatnonzero(self.active):
            position = int(self.position[row]) + 1
            if position >= config.max_tokens:
                raise ValueError(f"row {row} reached {config.max_tokens} tokens")
            if position % config.block_tokens == 0:
                self._allocate(row, position // config.block_tokens)
            self.position[row] = position
            self.token[row] = int(np.argmax(logits[row]))

    def meta(self) -> dict[str, np.ndarray]:
        return {"position": self.position, "token": self.token, "block_table": self.block_table}


class PreallocatedCache:
    """The baseline: a JAX array of the full capacity, zeros, allocated up front; each step
    jitted with the cache donated (written in place), its metadata put on the device."""

    label = "preallocated JAX cache, donated"

    def __init__(self, config: PagedConfig, capacity: int, device: Any) -> None:
        import jax
        import jax.numpy as jnp

        self.config, self.capacity, self._jax = config, capacity, jax
        self._device = device.jax()
        self.cache = jax.device_put(jnp.zeros(config.cache_shape(capacity), jnp.float32))
        self._step = jax.jit(decode_step(config), donate_argnums=0)
        self._write = jax.jit(
            lambda cache, blocks, offsets, kv: cache.at[:, :, blocks, offsets].set(kv),
            donate_argnums=0,
        )

    @property
    def bytes_held(self) -> int:
        return self.cache.nbytes

    def ensure_blocks(self, blocks: int) -> None:
        if blocks > self.capacity:
            raise ValueError(f"{blocks} blocks exceed the capacity of {self.capacity}")

    def write_prefill(self, kv: Any, blocks: np.ndarray, offsets: np.ndarray) -> None:
        values = self._jax.device_put(kv.cpu().numpy(), self._device)
        self.cache = self._write(self.cache, blocks, offsets, values)

    def step(self, requests: Requests, weights: Any) -> Any:
        meta = self._jax.device_put(requests.meta(), self._device)
        self.cache, logits = self._step(self.cache, meta, weights)
        return logits.block_until_ready()

    def committed(self, blocks: int) -> np.ndarray:
        return np.asarray(self.cache[:, :, :blocks])

    def reset(self) -> None:
        """Zeros again, as at the start."""
        import jax.numpy as jnp

        self.cache = None  # dropped before its successor is made: one capacity at a time
        zeros = jnp.zeros(self.config.cache_shape(self.capacity), jnp.float32)
        self.cache = self._jax.device_put(zeros, self._device)

    def close(self) -> None:
        self.cache = None


class JaxbufCache:
    """The cache an engine builds on jaxbuf: one KV-cache tensor of ``layers * 2`` segments
    reserved for ``capacity`` blocks, committed as the requests need blocks; a torch view over
    the whole reservation for the prefill; the step a :class:`~jaxbuf.KVCacheStep` that hands
    the model the tensor in the engine's layout (``segment_shape=(layers, 2)``); the
    per-request metadata, block table included (a 2-D field), in a
    :class:`~jaxbuf.DeviceParamTable` whose live JAX mapping each step is passed."""

    label = "jaxbuf"

    def __init__(self, config: PagedConfig, capacity: int, device: Any) -> None:
        import torch

        from jaxbuf import DeviceParamTable, ExtensibleKVCacheBuilder
        from jaxbuf.kv import KVCacheStep

        self.config, self.capacity = config, capacity
        builder = ExtensibleKVCacheBuilder(capacity, device)
        self.kv = self.table = self.kv_step = None
        try:
            builder.reserve(capacity * config.block_bytes, num_segments=config.layers * 2)
            self.kv = builder.finish()
            self.torch_cache = self.kv.full_view(0).to_torch(
                torch.float32, config.cache_shape(capacity)
            )
            self.table = DeviceParamTable(
                config.rows,
                {
                    "position": "int32",
                    "token": "int32",
                    "block_table": ("int32", config.max_blocks),
                },
                device,
            )
            self.meta = self.table.arrays("jax")  # a live mapping: each step's current values
            model = decode_step(config)

            def step(caches: list[Any], meta: Any, weights: Any) -> Any:
                cache, logits = model(caches[0], meta, weights)
                return [cache], logits

            self.kv_step = KVCacheStep(
                self.kv,
                step,
                "float32",
                config.block_shape,
                segment_shape=config.segment_shape,
            )
        except BaseException:
            if self.kv is None:  # not finished: the builder still owns the tensor
                builder.free()
            self.close()
            raise

    @property
    def bytes_held(self) -> int:
        return self.kv.physical_bytes

    @property
    def in_place(self) -> bool:
        """Whether the step writes the cache's memory in place (else it copies it back)."""
        return self.kv_step.in_place

    @property
    def step_blocks(self) -> int:
        """The blocks the step's arrays span: the capacity in place, else a bucket of the
        committed blocks."""
        return self.kv_step.blocks

    def ensure_blocks(self, blocks: int) -> None:
        self.kv.ensure_blocks(blocks)

    def write_prefill(self, kv: Any, blocks: np.ndarray, offsets: np.ndarray) -> None:
        import torch

        index = [torch.as_tensor(i, device=self.torch_cache.device) for i in (blocks, offsets)]
        self.torch_cache[:, :, index[0], index[1]] = kv.to(self.torch_cache.device)
        if self.torch_cache.is_cuda:  # the next JAX step reads it on a stream of its own
            torch.cuda.synchronize(self.torch_cache.device)

    def step(self, requests: Requests, weights: Any) -> Any:
        for name, values in requests.meta().items():
            self.table[name].np[:] = values
        self.table.sync()
        return self.kv_step(self.meta, weights).block_until_ready()

    def committed(self, blocks: int) -> np.ndarray:
        return self.torch_cache[:, :, :blocks].cpu().numpy().copy()

    def reset(self) -> None:
        """One block committed again, zeroed, as after :meth:`ExtensibleKVCacheBuilder.finish`
        (an engine's sleep and wake)."""
        self.kv.release_physical()
        self.kv.commit(1)

    def close(self) -> None:
        self.meta = self.torch_cache = None
        if self.kv_step is not None:
            self.kv_step.close()
        if self.table is not None:
            self.table.close()
        if self.kv is not None:
            self.kv.free()


@dataclass
class Trace:
    """One cache's run: logits of every step (numpy), step seconds, blocks committed and
    bytes held at each step."""

    logits: list[np.ndarray] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    bytes_held: list[int] = field(default_factory=list)

    def extend(self, other: Trace) -> None:
        """Append ``other``'s steps (another run of the same schedule)."""
        for name in ("logits", "step_s", "blocks", "bytes_held"):
            getattr(self, name).extend(getattr(other, name))


def run(
    caches: dict[str, Any],
    config: PagedConfig,
    steps: int,
    weights: tuple[dict[str, Any], dict[str, Any]],
) -> dict[str, Trace]:
    """Decode ``steps`` steps over each of ``caches`` in lockstep (the order alternating each
    step, so the machine's drift falls on all alike): before each step, the requests arriving
    are admitted and prefilled, and the cache grows to the blocks in use. ``weights``: the
    JAX weights and the torch ones. A step's time is its metadata upload, the step and the
    wait for its logits."""
    import time

    jax_weights, torch_weights = weights
    schedule = arrivals(config, steps)
    requests = {name: Requests(config) for name in caches}
    traces = {name: Trace() for name in caches}
    names = list(caches)
    for n in range(steps):
        for name in names if n % 2 == 0 else reversed(names):
            cache, mine, trace = caches[name], requests[name], traces[name]
            for arrival in (a for a in schedule if a.step == n):
                slots = mine.admit(arrival)
                cache.ensure_blocks(mine.blocks_used)
                if len(arrival.prompt) > 1:
                    cache.write_prefill(prefill_kv(config, torch_weights, arrival.prompt), *slots)
            cache.ensure_blocks(mine.blocks_used)
            start = time.perf_counter()
            logits = cache.step(mine, jax_weights)
            trace.step_s.append(time.perf_counter() - start)
            trace.logits.append(np.asarray(logits))
            trace.blocks.append(mine.blocks_used)
            trace.bytes_held.append(cache.bytes_held)
            mine.advance(trace.logits[-1])
    return traces


def check_agreement(caches: dict[str, Any], traces: dict[str, Trace], reference: str) -> None:
    """Every cache gave the reference's logits at every step and holds its committed blocks,
    bit for bit (the same XLA computation over the same values; block ids index the same
    blocks whatever the cache's block count): the same dtype, shape and bytes, so ``-0.0``
    differs from ``0.0`` and a NaN equals only the same NaN. AssertionError naming the first
    difference, and when there is nothing to compare (no step, no other cache)."""
    expected = traces[reference]
    if not expected.logits or len(expected.blocks) != len(expected.logits):
        raise AssertionError(
            f"{reference}: {len(expected.logits)} steps of logits and {len(expected.blocks)} "
            "of blocks: nothing to compare"
        )
    if len(traces) < 2:
        raise AssertionError(f"only {reference} ran: nothing to compare it with")
    blocks = expected.blocks[-1]
    want = caches[reference].committed(blocks)
    for name, trace in traces.items():
        if len(trace.logits) != len(expected.logits):
            raise AssertionError(
                f"{name}: {len(trace.logits)} steps of logits, {reference} {len(expected.logits)}"
            )
        for n, (got, ref) in enumerate(zip(trace.logits, expected.logits)):
            if not _identical(got, ref):
                raise AssertionError(f"{name}: step {n}'s logits differ: {_difference(got, ref)}")
        if trace.blocks != expected.blocks:
            raise AssertionError(f"{name}: blocks {trace.blocks} != {expected.blocks}")
        got = caches[name].committed(blocks)
        if not _identical(got, want):
            raise AssertionError(f"{name}: the committed cache differs: {_difference(got, want)}")


def _identical(a: Any, b: Any) -> bool:
    """The same dtype, shape and bytes."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _difference(got: Any, want: Any) -> str:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} against {want.dtype}{list(want.shape)}"
    differing = np.frombuffer(got.tobytes(), np.uint8) != np.frombuffer(want.tobytes(), np.uint8)
    worst = np.nanmax(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0)
    return f"{np.count_nonzero(differing)} bytes, values by up to {worst:g}"


def torch_weights(weights: dict[str, np.ndarray], device: Any) -> dict[str, Any]:
    """``weights`` as torch tensors on ``device`` (zero-copy on the CPU)."""
    import torch

    return {k: torch.from_numpy(v).to(device.torch()) for k, v in weights.items()}


def jax_weights(weights: dict[str, np.ndarray], device: Any) -> dict[str, Any]:
    import jax

    return jax.device_put(weights, device.jax())
