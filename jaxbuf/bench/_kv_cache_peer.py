"""The two processes of ``transfer.kv_cache`` (:mod:`jaxbuf.bench.transfer_kv_cache`): the
sides of :mod:`jaxbuf.bench._transfer_peer`, each holding a KV cache shaped like a model's.

A side (:class:`_CacheSide`, run as ``python -m jaxbuf.bench._kv_cache_peer``) holds, once
built (:meth:`_CacheSide.cache_setup`), one tensor per layer with K and V segments, built by
:class:`~jaxbuf.ExtensibleKVCacheBuilder`, and a same-host
:class:`~jaxbuf.transfer.KVCacheEndpoint` over it; then (:meth:`_CacheSide.cache_nixl_setup`,
after the threads and descriptors of the same-host transport alone are counted) a NIXL
``KVCacheEndpoint`` over the same cache and plain per-layer buffers with one descriptor per
block and layer. :class:`KVCacheProcesses` starts and drives the two.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxbuf.bench._transfer_peer import _TRANSFER_TIMEOUT, TwoProcesses, _main, _Side

__all__ = ["KVCacheProcesses", "process_counts"]

#: A KV-cache tensor's segments: K and V.
_SEGMENTS = 2


class _CacheSide(_Side):
    """One process's KV cache, its endpoints, plain per-layer buffers and their lists."""

    #: The base commands' and the cache's: a cache of many layers takes seconds to build.
    timeouts = {
        **_Side.timeouts,
        "cache_setup": 300.0,
        "cache_nixl_setup": 300.0,
        "kv_cache": 600.0,
    }

    def commands(self) -> dict[str, Callable[..., Any]]:
        return {
            **super().commands(),
            "cache_setup": self.cache_setup,
            "cache_connect_local": self.cache_connect_local,
            "cache_counts": self.cache_counts,
            "cache_nixl_setup": self.cache_nixl_setup,
            "cache_connect_nixl": self.cache_connect_nixl,
            "kv_cache": self.kv_cache,
            "counts": self.counts,
        }

    def cache_setup(self, layers: int, capacity: int, block_bytes: int) -> dict[str, Any]:
        """Build a KV cache of ``layers`` tensors (K and V segments of ``capacity`` blocks of
        ``block_bytes`` each, all committed and touched) and a same-host
        :class:`~jaxbuf.transfer.KVCacheEndpoint` over it (absent, with the reason, where it
        cannot be made); what the other side needs to connect. This process's threads and
        descriptors are counted first, before anything of the cache exists."""
        from jaxbuf import ExtensibleKVCacheBuilder
        from jaxbuf.transfer import KVCacheEndpoint

        self.teardown()
        self.group += 1
        self.counts_before = process_counts()
        self.layers, self.capacity, self.block_bytes = layers, capacity, block_bytes
        self.name = f"bench-cache-{self.role}-{os.getpid()}-{self.group}"
        builder = ExtensibleKVCacheBuilder(capacity, self.device)
        try:
            for _ in range(layers):
                builder.reserve(capacity * _SEGMENTS * block_bytes, _SEGMENTS)
            self.cache = builder.finish()
        except BaseException:
            builder.free()
            raise
        self._cleanup.append(self.cache.free)
        self.cache.commit(capacity)
        for tensor, _ in self.cache.buffers:
            for segment in range(_SEGMENTS):
                view = tensor.segment_view(segment)
                if self.device.is_cuda:
                    view.to_torch().fill_(1)
                else:
                    view.to_numpy()[:] = 1
        self.cache_local: Any = None
        self.cache_local_peer: Any = None
        self.cache_nixl: Any = None
        self.cache_nixl_peer: Any = None
        self.local_error = self.nixl_error = None
        try:
            self.cache_local = KVCacheEndpoint(f"{self.name}-local", self.cache, transport="local")
        except Exception as error:  # noqa: BLE001 - the reason goes into the skipped rows
            self.local_error = (
                "the same-host transport is not available: KVCacheEndpoint(name, cache, "
                f"transport='local') raised {type(error).__name__}: {error}"
            )
        else:
            self._cleanup.append(self.cache_local.close)
        return {
            "local": None if self.cache_local is None else self.cache_local.metadata(),
            "local_error": self.local_error,
        }

    def cache_connect_local(self, other: dict[str, Any]) -> dict[str, Any]:
        """Connect the same-host cache endpoint to the other side's; the seconds it took."""
        connect_s = None
        if self.cache_local is not None and other["local"] is None:
            self.local_error = f"the other side has no same-host endpoint: {other['local_error']}"
        elif self.cache_local is not None:
            try:
                start = time.perf_counter()
                self.cache_local_peer = self.cache_local.connect(other["local"])
                connect_s = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 - the reason goes into the skipped rows
                self.local_error = (
                    f"the same-host endpoint failed to connect: {type(error).__name__}: {error}"
                )
        return {
            "transport": None
            if self.cache_local_peer is None
            else self._local_description(self.cache_local_peer),
            "error": self.local_error,
            "connect_s": connect_s,
        }

    def cache_counts(self, count: int) -> dict[str, Any]:
        """This process's threads and descriptors with the same-host cache endpoint alone,
        connected and (on the prefill side, first) after one WRITE of a request of ``count``
        blocks; and the counts before the cache existed."""
        if self.role == "prefill" and self.cache_local_peer is not None:
            local, remote = _request_blocks(self.np, count, self.capacity)
            self.cache_local.write(self.cache_local_peer, local, remote).wait(_TRANSFER_TIMEOUT)
        return {"before": self.counts_before, "with the same-host endpoint": process_counts()}

    def cache_nixl_setup(self) -> dict[str, Any]:
        """Plain per-layer buffers (``torch.empty`` on CUDA, numpy on the CPU), as an engine
        without jaxbuf allocates a layer's K and V, and on the prefill side the floor's
        destinations; where NIXL imports, an agent registering each plain buffer and a NIXL
        :class:`~jaxbuf.transfer.KVCacheEndpoint` over the cache. What the other side needs
        to connect, or why NIXL is not measured."""
        from jaxbuf.transfer import Agent, KVCacheEndpoint, NixlUnavailable, load_nixl

        layer_bytes = self.capacity * _SEGMENTS * self.block_bytes
        self.layer_plain = [self._plain(layer_bytes) for _ in range(self.layers)]
        if self.role == "prefill" and not self.device.is_cuda:
            self.floor_layers = [self._plain(layer_bytes) for _ in range(self.layers)]
        try:
            load_nixl()
        except NixlUnavailable as error:
            self.nixl_error = f"not measured: {error}"
            return {"nixl": None, "error": self.nixl_error}
        self.agent = Agent(self.name)
        self._cleanup.append(self.agent.close)
        self.cache_nixl = KVCacheEndpoint(self.agent, self.cache, transport="nixl")
        self._cleanup.append(self.cache_nixl.close)
        self.mem_type = "VRAM" if self.device.is_cuda else "DRAM"
        self.device_id = self.device.index if self.device.is_cuda else 0
        agent = self.agent
        for _, address in self.layer_plain:  # one registration per layer, as a connector's
            handle = agent.register([(address, layer_bytes)], self.mem_type, self.device_id)
            self._cleanup.append(lambda handle=handle: agent.deregister(handle))
        return {
            "nixl": self.cache_nixl.metadata(),
            "error": None,
            "agent": agent.name,
            "plain_addresses": [address for _, address in self.layer_plain],
        }

    def cache_connect_nixl(self, other: dict[str, Any]) -> dict[str, Any]:
        """Connect the NIXL cache endpoint to the other side's (timed), and prepare lists of
        both sides' plain buffers with one descriptor per block and layer."""
        from jaxbuf.transfer._nixl import LOCAL_AGENT

        if self.cache_nixl is None or other["nixl"] is None:
            self.nixl_error = self.nixl_error or f"the other side has no NIXL: {other['error']}"
            return {"transport": None, "error": self.nixl_error, "connect_s": None}
        start = time.perf_counter()
        self.cache_nixl_peer = self.cache_nixl.connect(other["nixl"])
        connect_s = time.perf_counter() - start
        agent, mem_type = self.agent, self.mem_type
        local = agent.prep_dlist(
            LOCAL_AGENT, self._layer_rows([a for _, a in self.layer_plain]), mem_type
        )
        self._cleanup.append(lambda: agent.release_dlist(local))
        remote = agent.prep_dlist(
            other["agent"], self._layer_rows(other["plain_addresses"]), mem_type
        )
        self._cleanup.append(lambda: agent.release_dlist(remote))
        self.cache_plain_lists = (local, remote)
        return {"transport": "nixl", "error": None, "connect_s": connect_s}

    def _layer_rows(self, addresses: list[int]) -> Any:
        """NIXL descriptor rows of plain per-layer buffers at ``addresses``: one per block
        and layer (a block's K and V adjacent, as one descriptor), layer-major, so that row
        ``layer * capacity + block`` is block ``block`` of layer ``layer``."""
        np = self.np
        span = _SEGMENTS * self.block_bytes
        offsets = np.arange(self.capacity, dtype=np.uint64) * np.uint64(span)
        rows = np.empty((len(addresses) * self.capacity, 3), dtype=np.uint64)
        rows[:, 0] = (np.array(addresses, dtype=np.uint64)[:, None] + offsets[None, :]).ravel()
        rows[:, 1], rows[:, 2] = span, self.device_id
        return rows

    def _cache_floor(self, local: Any, remote: Any, nbytes: int) -> tuple[Callable[[], None], str]:
        """The floor of one request and what it is. On CUDA one device copy of the same
        ``nbytes`` (torch's ``copy_`` plus a synchronize); on the CPU the same scattered
        blocks of every layer and segment gathered between plain buffers of this process by
        one call of the copy the CPU driver moves blocks with (``copy_batch``, a ``memmove``
        loop in C)."""
        if self.device.is_cuda:
            self.plain, _ = self._plain(nbytes)
            self.floor_target, _ = self._plain(nbytes)
            return self._floor(nbytes), self.floor_description()
        from jaxbuf.drivers import get_vmm_driver

        np = self.np
        block, segment = self.block_bytes, self.capacity * self.block_bytes
        starts = np.arange(_SEGMENTS, dtype=np.uint64) * np.uint64(segment)

        def addresses(buffers: list[tuple[Any, int]], blocks: Any) -> Any:
            bases = np.array([address for _, address in buffers], dtype=np.uint64)
            within = blocks.astype(np.uint64) * np.uint64(block)
            return (bases[:, None, None] + starts[None, :, None] + within[None, None, :]).ravel()

        dsts = addresses(self.floor_layers, remote)
        srcs = addresses(self.layer_plain, local)
        sizes = np.full(len(dsts), block, dtype=np.uint64)
        copy_batch, index = get_vmm_driver(self.device).copy_batch, self.device.index
        description = (
            f"{len(sizes):,} scattered blocks gathered by one copy_batch (memmove loop in C), "
            "the CPU driver's copy, in one process"
        )
        return lambda: copy_batch(dsts, srcs, sizes, index), description

    def kv_cache(self, count: int, quick: bool) -> dict[str, Any]:
        """Median seconds of each subject writing a request of ``count`` scattered blocks of
        every layer, round by round (the samples too, for the ratios' spread; ``"slow"``
        names the subjects sampled in rounds of their own), the median host time of the post
        alone (same-host transport, NIXL over plain buffers), the transport each took, and
        this process's threads and descriptors at the end."""
        from jaxbuf.bench._timing import round_by_round_samples

        np = self.np
        local, remote = _request_blocks(np, count, self.capacity)
        moved = self.layers * _SEGMENTS * count * self.block_bytes
        floor, floor_description = self._cache_floor(local, remote, moved)
        calls: dict[str, Callable[[], None]] = {"floor": floor}
        transports = {"floor": floor_description}
        if not self.device.is_cuda:
            # A reference, not the floor: one contiguous memcpy of the bytes, which glibc
            # makes with non-temporal stores; copies of 32 KiB (even of 8 MiB) do not get
            # them and run at about half its speed, contiguous or not.
            self.plain, _ = self._plain(moved)
            self.floor_target, _ = self._plain(moved)
            calls["contiguous"] = self._floor(moved)
            transports["contiguous"] = self.floor_description()
        posts: dict[str, list[float]] = {}
        if self.cache_local_peer is not None:
            write, peer = self.cache_local.write, self.cache_local_peer
            calls["local"] = _timed_post(
                posts.setdefault("local", []),
                lambda: write(peer, local, remote),
                lambda posted: posted.wait(_TRANSFER_TIMEOUT),
            )
        if self.cache_nixl_peer is not None:
            nixl_write, nixl_peer = self.cache_nixl.write, self.cache_nixl_peer
            calls["nixl jaxbuf"] = lambda: nixl_write(nixl_peer, local, remote).wait(
                _TRANSFER_TIMEOUT
            )
            layer_starts = np.arange(self.layers, dtype=np.int64)[:, None] * self.capacity
            ours = (layer_starts + local[None, :]).ravel()
            theirs = (layer_starts + remote[None, :]).ravel()
            post, finish = self._plain_nixl("WRITE", ours, theirs, self.cache_plain_lists)
            calls["nixl plain"] = _timed_post(posts.setdefault("nixl plain", []), post, finish)
        single: dict[str, float] = {}
        for label, call in calls.items():
            self.log.mark()
            call()
            # The least of two: one call preempted by another process on a busy host would
            # call a subject slow.
            for _ in range(2):
                start = time.perf_counter()
                call()
                seconds = time.perf_counter() - start
                single[label] = min(single.get(label, seconds), seconds)
            if label.startswith("nixl"):
                transports[label] = self._nixl_description(label, "WRITE")
            elif label == "local":
                transports[label] = self._local_description(self.cache_local_peer)
        for posted in posts.values():
            posted.clear()  # the warm-up's posts are not the rounds'
        # A subject ten times slower than the floor (NIXL through TCP) is sampled on its own:
        # interleaved, it would leave the device idle and the others timed on a cold one.
        slow = [label for label, seconds in single.items() if seconds > 10 * single["floor"]]
        fast = {label: call for label, call in calls.items() if label not in slow}
        # About six seconds of rounds at full sizes, a smoke run's worth with quick.
        fast_round = sum(single[label] for label in fast)
        rounds = 5 if quick else max(11, min(101, int(6.0 / max(fast_round, 1e-6))))
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            samples = round_by_round_samples(fast, rounds)
            if slow:
                samples.update(
                    round_by_round_samples({k: calls[k] for k in slow}, 3 if quick else 7)
                )
        finally:
            if gc_was_enabled:
                gc.enable()
        return {
            "medians": {label: statistics.median(s) for label, s in samples.items()},
            "samples": samples,
            "slow": slow,
            "posts": {label: statistics.median(s) for label, s in posts.items()},
            "transports": transports,
            "rounds": rounds,
            "bytes": moved,
            "counts": process_counts(),
        }

    def counts(self) -> dict[str, int]:
        """This process's threads and descriptors now."""
        return process_counts()

    def teardown(self) -> None:
        """The base's teardown, then the plain per-layer arrays dropped (freed once
        unreferenced)."""
        try:
            super().teardown()
        finally:
            self.layer_plain = self.floor_layers = None


def process_counts() -> dict[str, int]:
    """This process's threads (``/proc/self/task``) and open descriptors (``/proc/self/fd``,
    less the one that lists them)."""
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "descriptors": len(os.listdir("/proc/self/fd")) - 1,
    }


def _request_blocks(np: Any, count: int, capacity: int) -> tuple[Any, Any]:
    """A request's ``count`` block ids on both sides, scattered as a KV cache's are: even ids
    in random order, so that no two are adjacent on either side and no transport (nor the
    floor) can merge two blocks into one copy. Needs ``capacity >= 2 * count``."""
    if 2 * count > capacity:
        raise ValueError(f"{count} scattered blocks need a capacity of {2 * count}, got {capacity}")
    rng = np.random.default_rng(count)
    local = rng.permutation(capacity // 2)[:count].astype(np.int64) * 2
    remote = rng.permutation(capacity // 2)[:count].astype(np.int64) * 2
    return local, remote


def _timed_post(
    samples: list[float], post: Callable[[], Any], finish: Callable[[Any], None]
) -> Callable[[], None]:
    """A call that posts, records the host seconds of the post alone in ``samples``, then
    finishes what it posted."""

    def call() -> None:
        start = time.perf_counter()
        posted = post()
        samples.append(time.perf_counter() - start)
        finish(posted)

    return call


class KVCacheProcesses(TwoProcesses):
    """A prefill and a decode process, each serving a :class:`_CacheSide`."""

    side_type = _CacheSide

    def setup_cache(
        self, layers: int, capacity: int, block_bytes: int, count: int
    ) -> dict[str, Any]:
        """Both sides hold a KV cache of ``layers`` tensors (:meth:`_CacheSide.cache_setup`),
        connected both ways over the same-host transport, then, once each process's threads
        and descriptors are counted with that transport alone (the prefill side having
        written one request of ``count`` blocks), over NIXL too. What the prefill side's two
        connections report (``"local"``, ``"nixl"``), and the counts by role (``"counts"``)."""
        local = self._build_and_connect(
            "cache_setup", "cache_connect_local", layers, capacity, block_bytes
        )
        counts = {side.role: side("cache_counts", count) for side in self.sides}
        nixl = self._build_and_connect("cache_nixl_setup", "cache_connect_nixl")
        return {"local": local, "nixl": nixl, "counts": counts}


if __name__ == "__main__":
    _main(sys.argv[1:], _CacheSide)
