"""The two processes of the transfer benchmarks (:mod:`jaxbuf.bench.transfer`): prefill and
decode, one process each, as an inference deployment runs them.

Each side runs :func:`serve` in a fresh interpreter of its own (``python -m
jaxbuf.bench._transfer_peer``: nothing is forked, which CUDA and UCX would not survive, and
nothing of the caller's ``__main__`` runs again) and answers commands from the bench process
over a socket pair. The bench process only relays: it hands each side the other's metadata,
then asks the prefill side to time its transfers; the decode side holds its memory and its
endpoints and stays passive (WRITE and READ are one-sided). All figures are timed in one
process, the prefill one, the subjects interleaved round by round in the same pair of processes.

A side holds, for one block size at a time (:meth:`_Side.setup`):

* a jaxbuf buffer grown one granule per grow, with a NIXL :class:`~jaxbuf.transfer.KVEndpoint`
  (``transport="nixl"``) and a same-host endpoint (``transport="local"``, a plain name for an
  agent) over it; the latter is absent, with the reason, where this jaxbuf has no same-host
  transport;
* a plain allocation (``torch.empty`` on CUDA, numpy on the CPU) registered whole with the same
  NIXL agent, and prepared descriptor lists of its blocks on both sides;
* on the prefill side, a second plain allocation: the destination of the floor, the device's
  own copy of the same bytes in one process.

For the ``transfer.kv_cache`` suite a side holds instead a KV cache shaped like a model's
(:meth:`_Side.cache_setup`): one tensor per layer with K and V segments, built by
:class:`~jaxbuf.ExtensibleKVCacheBuilder`, a same-host :class:`~jaxbuf.transfer.KVCacheEndpoint`
over it, then (:meth:`_Side.cache_nixl_setup`, after the threads and descriptors of the
same-host transport alone are counted) a NIXL ``KVCacheEndpoint`` over the same cache and plain
per-layer buffers with one descriptor per block and layer.

Which transport moved the bytes: the same-host endpoint's peer says it (``peer.transport``);
for NIXL, UCX says it when asked (``UCX_PROTO_INFO=y``, written to ``UCX_LOG_FILE``): the
prefill process reads the protocols UCX selected for remote writes and reads from its log.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from jaxbuf._errors import Cleanup
from jaxbuf.bench._ucx_log import UcxLog, describe_nixl

__all__ = ["TwoProcesses", "serve"]

#: Seconds the bench process waits for a side's answer to a command, by command (default
#: :data:`_DEFAULT_TIMEOUT`): a NIXL agent and a grown buffer take seconds on a slow host.
_TIMEOUTS = {
    "setup": 300.0,
    "bandwidth": 600.0,
    "host_cost": 300.0,
    "cache_setup": 300.0,
    "cache_nixl_setup": 300.0,
    "kv_cache": 600.0,
}
_DEFAULT_TIMEOUT = 120.0
#: Seconds a transfer may take before the bench calls it stuck.
_TRANSFER_TIMEOUT = 60.0
#: A KV-cache tensor's segments: K and V.
_SEGMENTS = 2


class _Side:
    """One process's buffers, endpoints and descriptor lists for one block size."""

    def __init__(self, role: str, device: str, ucx_log: str | None) -> None:
        import numpy as np

        from jaxbuf.devices import as_device

        self.np = np
        self.role = role
        self.device = as_device(device)
        self.log = UcxLog(ucx_log)
        self.torch: Any = None
        if self.device.is_cuda:
            import torch

            self.torch = torch
            torch.cuda.set_device(self.device.index)
        self._cleanup: list[Callable[[], None]] = []
        self.group = 0

    # -- memory -----------------------------------------------------------------------
    def _plain(self, nbytes: int) -> tuple[Any, int]:
        """A plain allocation of ``nbytes``, touched, and its address."""
        if self.device.is_cuda:
            array = self.torch.full((nbytes,), 1, dtype=self.torch.uint8, device=str(self.device))
            return array, array.data_ptr()
        array = self.np.empty(nbytes, dtype=self.np.uint8)
        array[:] = 1
        return array, array.ctypes.data

    def _grown(self, nbytes: int) -> Any:
        """A jaxbuf buffer of ``nbytes`` committed one granule per grow, touched."""
        from jaxbuf.extensible import ExtensibleTensor, granule_size

        chunk = granule_size(self.device)
        tensor = ExtensibleTensor(nbytes, device=self.device)
        self._cleanup.append(tensor.free)
        for size in range(chunk, nbytes + 1, chunk):
            tensor.resize_per_segment_(size)
        if self.device.is_cuda:
            tensor.segment_view(0).to_torch().fill_(1)
        else:
            tensor.segment_view(0).to_numpy()[:] = 1
        return tensor

    def _rows(self, address: int, count: int, device_id: int) -> Any:
        np = self.np
        rows = np.empty((count, 3), dtype=np.uint64)
        rows[:, 0] = address + np.arange(count, dtype=np.uint64) * self.block_bytes
        rows[:, 1], rows[:, 2] = self.block_bytes, device_id
        return rows

    # -- commands ---------------------------------------------------------------------
    def setup(self, block_bytes: int, capacity: int) -> dict[str, Any]:
        """Build this side for blocks of ``block_bytes`` in ``capacity`` bytes; what the
        other side needs to connect (plain values and bytes)."""
        from jaxbuf.extensible import granule_size
        from jaxbuf.transfer import Agent, KVEndpoint, KVLayout

        self.teardown()
        self.group += 1
        chunk = granule_size(self.device)
        capacity = -(-capacity // chunk) * chunk
        self.block_bytes, self.capacity = block_bytes, capacity
        layout = KVLayout(block_bytes)
        name = f"bench-{self.role}-{os.getpid()}-{self.group}"
        self.agent = Agent(name)
        self._cleanup.append(self.agent.close)
        self.tensor = self._grown(capacity)
        self.nixl_endpoint = _nixl_endpoint(KVEndpoint, self.agent, self.tensor, layout)
        self._cleanup.append(self.nixl_endpoint.close)
        self.local_endpoint: Any = None
        self.local_error: str | None = None
        try:
            self.local_endpoint = KVEndpoint(
                f"{name}-local", self.tensor, layout, transport="local"
            )
        except Exception as error:  # noqa: BLE001 - the reason goes into the skipped rows
            self.local_error = (
                "the same-host transport is not available: KVEndpoint(name, tensor, layout, "
                f"transport='local') raised {type(error).__name__}: {error}"
            )
        else:
            self._cleanup.append(self.local_endpoint.close)
        registration = self.nixl_endpoint.registration
        self.mem_type, self.device_id = registration.mem_type, registration.device_id
        self.plain, self.plain_address = self._plain(capacity)
        handle = self.agent.register(
            [(self.plain_address, capacity)], self.mem_type, self.device_id
        )
        self._cleanup.append(lambda: self.agent.deregister(handle))
        if self.role == "prefill":
            self.floor_target, _ = self._plain(capacity)
        return {
            "nixl": self.nixl_endpoint.metadata(),  # after every registration: it lists them
            "local": None if self.local_endpoint is None else self.local_endpoint.metadata(),
            "local_error": self.local_error,
            "plain_address": self.plain_address,
            "agent": self.agent.name,
            "capacity": capacity,
        }

    def connect(self, other: dict[str, Any]) -> dict[str, Any]:
        """Connect both endpoints to the other side's and prepare the plain memory's lists."""
        from jaxbuf.transfer._nixl import LOCAL_AGENT

        self.nixl_peer = self.nixl_endpoint.connect(other["nixl"])
        self.local_peer: Any = None
        if self.local_endpoint is not None and other["local"] is None:
            self.local_error = f"the other side has no same-host endpoint: {other['local_error']}"
        elif self.local_endpoint is not None:
            try:
                self.local_peer = self.local_endpoint.connect(other["local"])
            except Exception as error:  # noqa: BLE001 - the reason goes into the skipped rows
                self.local_error = (
                    f"the same-host endpoint failed to connect: {type(error).__name__}: {error}"
                )
        count = self.capacity // self.block_bytes
        agent = self.agent
        local = agent.prep_dlist(
            LOCAL_AGENT, self._rows(self.plain_address, count, self.device_id), self.mem_type
        )
        self._cleanup.append(lambda: agent.release_dlist(local))
        remote = agent.prep_dlist(
            other["agent"], self._rows(other["plain_address"], count, self.device_id), self.mem_type
        )
        self._cleanup.append(lambda: agent.release_dlist(remote))
        self.plain_lists = (local, remote)
        return {
            "nixl_transport": getattr(self.nixl_peer, "transport", "nixl"),
            "local_transport": None if self.local_peer is None else self.local_peer.transport,
            "local_error": self.local_error,
        }

    def _calls(self, operation: str, count: int) -> dict[str, Callable[[], None]]:
        """The subjects of one bandwidth row set: the floor, the same-host endpoint (where
        it works), NIXL over jaxbuf memory, NIXL over plain memory."""
        np = self.np
        # Scattered block ids on both sides, as a KV cache's are: no two blocks adjacent on
        # both sides, so no transport (nor the floor) can merge them into one copy.
        rng = np.random.default_rng(count)
        slots = self.capacity // self.block_bytes
        local = rng.permutation(slots)[:count].astype(np.int64)
        remote = rng.permutation(slots)[:count].astype(np.int64)
        calls = {"floor": self._floor(count * self.block_bytes)}
        method = operation.lower()
        if self.local_peer is not None:
            local_post = getattr(self.local_endpoint, method)
            local_peer = self.local_peer
            calls["local"] = lambda: local_post(local_peer, local, remote).wait(_TRANSFER_TIMEOUT)
        nixl_post, nixl_peer = getattr(self.nixl_endpoint, method), self.nixl_peer
        calls["nixl jaxbuf"] = lambda: nixl_post(nixl_peer, local, remote).wait(_TRANSFER_TIMEOUT)
        post, finish = self._plain_nixl(operation, local, remote)
        calls["nixl plain"] = lambda: finish(post())
        return calls

    def _plain_nixl(
        self, operation: str, blocks: Any, remote_blocks: Any = None, lists: Any = None
    ) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """Post / finish a transfer of ``blocks`` (indices into the prepared lists, the
        plain allocations' by default) through NIXL's own calls, as a NIXL user writes it."""
        nixl = self.agent.nixl
        local, remote = self.plain_lists if lists is None else lists
        theirs = blocks if remote_blocks is None else remote_blocks

        def post() -> Any:
            handle = nixl.make_prepped_xfer(operation, local, blocks, remote, theirs, b"")
            return handle, nixl.transfer(handle, b"")

        def finish(posted: Any) -> None:
            handle, state = posted
            deadline = time.monotonic() + _TRANSFER_TIMEOUT
            try:
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"a plain NIXL {operation} did not finish")
                    state = nixl.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"a plain NIXL {operation} reported {state}")
            finally:
                nixl.release_xfer_handle(handle)

        return post, finish

    def _floor(self, nbytes: int) -> Callable[[], None]:
        """The physical floor: the device's own copy of ``nbytes`` between two plain buffers
        of this process, in one copy (``np.copyto`` on the CPU, torch's ``copy_`` plus a
        synchronize on CUDA)."""
        target, source = self.floor_target[:nbytes], self.plain[:nbytes]
        if self.device.is_cuda:
            synchronize, index = self.torch.cuda.synchronize, self.device.index

            def device_copy() -> None:
                target.copy_(source, non_blocking=True)
                synchronize(index)

            return device_copy
        copyto = self.np.copyto
        return lambda: copyto(target, source)

    def floor_description(self) -> str:
        if self.device.is_cuda:
            return f"one torch copy_ of the same bytes on {self.device} + synchronize"
        return "one np.copyto (memcpy) of the same bytes"

    def _nixl_description(self, label: str, operation: str) -> str:
        memory = "plain memory" if label == "nixl plain" else "jaxbuf memory"
        ucx_memory = "cuda" if self.mem_type == "VRAM" else "host"
        return describe_nixl(self.log.transports(operation, ucx_memory), memory)

    def _local_description(self, peer: Any = None) -> str:
        peer = self.local_peer if peer is None else peer
        return f"same-host transport (peer.transport={peer.transport!r})"

    def bandwidth(self, operation: str, count: int, quick: bool) -> dict[str, Any]:
        """Median seconds of each subject moving ``count`` blocks, round by round, and the
        transport each took."""
        from jaxbuf.bench._timing import round_by_round

        calls = self._calls(operation, count)
        transports = {"floor": self.floor_description()}
        warm, single = 0.0, {}
        for label, call in calls.items():
            self.log.mark()
            call()
            start = time.perf_counter()
            call()
            single[label] = time.perf_counter() - start
            warm += 0.0 if single[label] > 0.02 else single[label]
            if label.startswith("nixl"):
                transports[label] = self._nixl_description(label, operation)
            elif label == "local":
                transports[label] = self._local_description()
        # About two seconds of rounds at full sizes (more rounds where a round is short,
        # where host jitter moves a median most), a smoke run's worth with quick.
        rounds = 5 if quick else max(15, min(301, int(2.0 / max(warm, 1e-6))))
        # A subject a thousand times slower than the floor (NIXL through TCP) is sampled on
        # its own: interleaved, it leaves the device idle for long stretches, and the fast
        # subjects would be timed on a cold device.
        slow = {label for label, seconds in single.items() if seconds > 0.02}
        fast_calls = {label: call for label, call in calls.items() if label not in slow}
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            medians = round_by_round(fast_calls, rounds)
            if slow:
                slow_rounds = 3 if quick else 7
                medians.update(
                    round_by_round({k: calls[k] for k in calls if k in slow}, slow_rounds)
                )
        finally:
            if gc_was_enabled:
                gc.enable()
        return {"medians": medians, "transports": transports, "rounds": rounds}

    def host_cost(self, rounds: int) -> dict[str, Any]:
        """Median host seconds of posting a one-block WRITE (``post``) and of posting and
        waiting for it (``total``), per subject, round by round."""
        np = self.np
        blocks = np.zeros(1, dtype=np.int64)
        posts: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        if self.local_peer is not None:
            write, peer = self.local_endpoint.write, self.local_peer
            posts["local"] = (
                lambda: write(peer, blocks, blocks),
                lambda t: t.wait(_TRANSFER_TIMEOUT),
            )
        nixl_write, nixl_peer = self.nixl_endpoint.write, self.nixl_peer
        posts["nixl jaxbuf"] = (
            lambda: nixl_write(nixl_peer, blocks, blocks),
            lambda t: t.wait(_TRANSFER_TIMEOUT),
        )
        posts["nixl plain"] = self._plain_nixl("WRITE", blocks)
        transports = {}
        for label, (post, finish) in posts.items():
            self.log.mark()
            for _ in range(5):
                finish(post())
            if label.startswith("nixl"):
                transports[label] = self._nixl_description(label, "WRITE")
            else:
                transports[label] = self._local_description()
        post_samples: dict[str, list[float]] = {label: [] for label in posts}
        total_samples: dict[str, list[float]] = {label: [] for label in posts}
        labels = list(posts)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for i in range(rounds):
                for label in labels if i % 2 == 0 else reversed(labels):
                    post, finish = posts[label]
                    start = time.perf_counter_ns()
                    posted = post()
                    posted_at = time.perf_counter_ns()
                    finish(posted)
                    stop = time.perf_counter_ns()
                    post_samples[label].append((posted_at - start) * 1e-9)
                    total_samples[label].append((stop - start) * 1e-9)
        finally:
            if gc_was_enabled:
                gc.enable()
        return {
            "post": {label: statistics.median(s) for label, s in post_samples.items()},
            "total": {label: statistics.median(s) for label, s in total_samples.items()},
            "transports": transports,
            "rounds": rounds,
        }

    # -- a KV cache shaped like a model (transfer.kv_cache) ---------------------------
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
        """Release what :meth:`setup` and :meth:`connect` (or the ``cache_*`` commands) made,
        newest first; raise the first failure after trying every step."""
        cleanup = Cleanup("the transfer bench's teardown")
        while self._cleanup:
            cleanup.run(self._cleanup.pop())
        self.plain = self.floor_target = None
        self.layer_plain = self.floor_layers = None  # plain arrays, freed once unreferenced
        cleanup.raise_first()


def _nixl_endpoint(endpoint_type: Any, agent: Any, tensor: Any, layout: Any) -> Any:
    """A NIXL endpoint: ``transport="nixl"`` where the endpoint takes a transport, the only
    kind of endpoint there is where it does not."""
    try:
        return endpoint_type(agent, tensor, layout, transport="nixl")
    except TypeError as error:
        if "transport" not in str(error):
            raise
        return endpoint_type(agent, tensor, layout)


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


def serve(connection: Any, role: str, device: str, ucx_log: str | None) -> None:
    """A side's command loop: answer ``(command, *args)`` with ``("ok", result)`` or
    ``("error", traceback)`` until ``("stop",)`` (or until the bench process is gone)."""
    side = None
    try:
        side = _Side(role, device, ucx_log)
        commands = {
            "setup": side.setup,
            "connect": side.connect,
            "bandwidth": side.bandwidth,
            "host_cost": side.host_cost,
            "teardown": side.teardown,
            "cache_setup": side.cache_setup,
            "cache_connect_local": side.cache_connect_local,
            "cache_counts": side.cache_counts,
            "cache_nixl_setup": side.cache_nixl_setup,
            "cache_connect_nixl": side.cache_connect_nixl,
            "kv_cache": side.kv_cache,
            "counts": side.counts,
        }
        connection.send(("ok", os.getpid()))
    except Exception:  # noqa: BLE001 - sent to the bench process, which raises it
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            command, *args = connection.recv()
        except EOFError:  # the bench process is gone: release everything and end
            command, args = "stop", []
        if command == "stop":
            try:
                side.teardown()
                reply: tuple[str, Any] = ("ok", None)
            except Exception:  # noqa: BLE001 - sent to the bench process, which reports it
                reply = ("error", traceback.format_exc())
            with contextlib.suppress(OSError):  # the bench process may be gone
                connection.send(reply)
            return
        try:
            connection.send(("ok", commands[command](*args)))
        except Exception:  # noqa: BLE001 - sent to the bench process, which raises it
            connection.send(("error", traceback.format_exc()))


class _Process:
    """The bench process's handle on one side: ``python -m jaxbuf.bench._transfer_peer``
    (a fresh interpreter, which imports nothing of the caller's ``__main__``), a
    :class:`multiprocessing.connection.Connection` over a socket pair, a timeout on every
    answer, and :meth:`close`, which always ends the process."""

    def __init__(self, role: str, device: str, ucx_log: str | None) -> None:
        import jaxbuf

        self.role = role
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The interpreter finds this jaxbuf, whatever the working directory.
        root = os.path.dirname(os.path.dirname(os.path.abspath(jaxbuf.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        if ucx_log is not None:  # read by UCX when it loads, at the first NIXL agent
            env["UCX_PROTO_INFO"] = "y"
            env["UCX_LOG_FILE"] = ucx_log
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxbuf.bench._transfer_peer",
                    str(theirs.fileno()),
                    role,
                    device,
                ],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stderr stays: a crash's traceback is seen
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.connection = Connection(ours.detach())

    def send(self, command: str, *args: Any) -> None:
        self.connection.send((command, *args))

    def receive(self, command: str) -> Any:
        timeout = _TIMEOUTS.get(command, _DEFAULT_TIMEOUT)
        if not self.connection.poll(timeout):
            raise TimeoutError(f"the {self.role} process did not answer {command!r} in {timeout} s")
        try:
            status, result = self.connection.recv()
        except EOFError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            raise RuntimeError(
                f"the {self.role} process died during {command!r} "
                f"(exit code {self.process.returncode})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"the {self.role} process failed {command!r}:\n{result}")
        return result

    def __call__(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive(command)

    def close(self) -> None:
        """Ask the process to stop (it releases its memory and agents), then make sure it
        has ended: terminated, then killed, if it does not in time."""
        try:
            if self.process.poll() is None:
                self.send("stop")
                if self.connection.poll(30):
                    self.connection.recv()
        except (OSError, EOFError):
            pass  # the process is gone already; it is waited for below
        finally:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                try:
                    self.process.wait(5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.connection.close()


class TwoProcesses:
    """A prefill and a decode process, each serving one side (:func:`serve`); a context
    manager that ends both, whatever happens.

    ``prefill_device`` / ``decode_device``: the device each side's memory lives on (one GPU
    each where there are two). ``ucx_log``: where the prefill process has UCX write its
    protocol tables (None: not asked for).
    """

    def __init__(self, prefill_device: str, decode_device: str, ucx_log: str | None) -> None:
        self.sides: list[_Process] = []
        try:
            self.prefill = _Process("prefill", prefill_device, ucx_log)
            self.sides.append(self.prefill)
            self.decode = _Process("decode", decode_device, None)
            self.sides.append(self.decode)
            for side in self.sides:
                side.receive("start")
        except BaseException:
            self.close()
            raise

    def _build_and_connect(self, build: str, connect: str, *args: Any) -> dict[str, Any]:
        """Both sides run ``build(*args)`` at once, then ``connect`` with the other side's
        answer; the prefill side's answer to ``connect``."""
        for side in self.sides:
            side.send(build, *args)
        prefill_info, decode_info = (side.receive(build) for side in self.sides)
        for side, other in ((self.prefill, decode_info), (self.decode, prefill_info)):
            side.send(connect, other)
        connected, _ = (side.receive(connect) for side in self.sides)
        return connected

    def setup(self, block_bytes: int, capacity: int) -> dict[str, Any]:
        """Both sides built for blocks of ``block_bytes``, connected both ways; what the
        prefill side's connection reports (transports, the same-host transport's absence)."""
        return self._build_and_connect("setup", "connect", block_bytes, capacity)

    def setup_cache(
        self, layers: int, capacity: int, block_bytes: int, count: int
    ) -> dict[str, Any]:
        """Both sides hold a KV cache of ``layers`` tensors (:meth:`_Side.cache_setup`),
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

    def teardown(self) -> None:
        for side in self.sides:
            side.send("teardown")
        for side in self.sides:
            side.receive("teardown")

    def close(self) -> None:
        """End both processes (each is ended even when ending the other fails)."""
        sides, self.sides = self.sides, []
        try:
            if sides:
                sides[0].close()
        finally:
            for side in sides[1:]:
                side.close()

    def __enter__(self) -> TwoProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _main(argv: list[str]) -> None:
    """``python -m jaxbuf.bench._transfer_peer FD ROLE DEVICE``: serve one side over the
    socket ``FD`` (UCX's log, where asked for, is in the environment: ``UCX_LOG_FILE``)."""
    fd, role, device = argv
    serve(Connection(int(fd)), role, device, os.environ.get("UCX_LOG_FILE"))


if __name__ == "__main__":
    _main(sys.argv[1:])
