"""The second process of the transfer tests: an endpoint over its own growing buffer, driven
by commands over a multiprocessing pipe (``serve``), so two real processes move bytes over
UCX. Imported by tests/test_transfer*.py and by the bench; not a test module itself."""

from __future__ import annotations

import multiprocessing
from typing import Any

MiB = 1 << 20


def serve(
    connection: Any,
    name: str,
    capacity: int,
    num_segments: int,
    block_bytes: int,
    device: str = "cpu",
    transport: str = "nixl",
) -> None:
    """Answer ``(command, *args)`` tuples with ``("ok", result)`` or ``("error", repr)``.
    With ``transport="local"`` the endpoint has no NIXL agent (a name only)."""
    import numpy as np

    import jaxbuf
    from jaxbuf.transfer import Agent, KVEndpoint, KVLayout

    tensor = jaxbuf.ExtensibleTensor(capacity, device, num_segments=num_segments)
    agent = None if transport == "local" else Agent(name)
    endpoint = KVEndpoint(agent or name, tensor, KVLayout(block_bytes), transport=transport)

    def fill(segment: int, seed: int) -> None:
        view = tensor.segment_view(segment)
        values = ((np.arange(view.nbytes, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)
        if device == "cpu":
            view.to_numpy()[:] = values
        else:  # VRAM: through torch (the GPU tests have it)
            import torch

            view.to_torch().copy_(torch.from_numpy(values))

    def read(segment: int, start: int, nbytes: int) -> bytes:
        view = tensor.segment_view(segment)
        if device == "cpu":
            return view.to_numpy()[start : start + nbytes].tobytes()
        return view.to_torch()[start : start + nbytes].cpu().numpy().tobytes()

    commands = {
        "grow": lambda size: tensor.resize_per_segment_(size),
        "metadata": endpoint.metadata,
        "connect": lambda message: endpoint.connect(message).name,
        "fill": fill,
        "read": read,
        "release": tensor.release_physical,
        "recommit": lambda size: tensor.resize_per_segment_(size, zero_new=True),
        "write_bytes": lambda segment, start, data: write_bytes(
            tensor, device, segment, start, data
        ),
        "transport": lambda peer: endpoint.peers[peer].transport,
        "defragment": tensor.defragment,
        "write": lambda peer, local, remote, note=b"": endpoint.write(
            peer, local, remote, notification=note
        ).wait(30),
        "pull": lambda peer, local, remote: endpoint.read(peer, local, remote).wait(30),
        "wait_notification": lambda peer, message: endpoint.wait_notification(peer, message, 30),
        "notify": lambda peer, message: endpoint.notify(peer, message),
        "notifications": lambda: endpoint.notifications(),
        "limit_fds": limit_fds,
        "counts": lambda: (
            agent.live_registrations if agent else 0,
            agent.live_dlists if agent else 0,
            agent.live_transfers if agent else 0,
            tensor.num_physical_chunks,
        ),
    }
    while True:
        command, *args = connection.recv()
        if command == "stop":
            endpoint.close()
            tensor.free()
            connection.send(
                ("ok", (agent.live_registrations, agent.live_dlists) if agent else (0, 0))
            )
            return
        try:
            connection.send(("ok", commands[command](*args)))
        except Exception as error:  # noqa: BLE001 - sent back to the test, which raises it
            connection.send(("error", f"{type(error).__name__}: {error}"))


def limit_fds(headroom: int) -> int:
    """Lower this process's soft descriptor limit to what is open now plus ``headroom``
    (what a process near its limit looks like); the new limit."""
    import os
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + headroom
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    return limit


def write_bytes(tensor: Any, device: str, segment: int, start: int, data: bytes) -> None:
    """Write ``data`` at byte ``start`` of ``tensor``'s segment, through numpy on the CPU and
    torch on CUDA (synchronized): what a cache's owner does before a transfer."""
    import numpy as np

    values = np.frombuffer(data, dtype=np.uint8)
    view = tensor.segment_view(segment)
    if device == "cpu":
        view.to_numpy()[start : start + len(values)] = values
    else:
        import torch

        view.to_torch()[start : start + len(values)].copy_(torch.from_numpy(values.copy()))
        torch.cuda.synchronize()


class PeerProcess:
    """A :func:`serve` process and a call interface: ``peer("grow", 4 << 20)``."""

    def __init__(
        self,
        name: str,
        capacity: int,
        num_segments: int,
        block_bytes: int,
        device: str = "cpu",
        transport: str = "nixl",
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=serve,
            args=(child, name, capacity, num_segments, block_bytes, device, transport),
            daemon=True,
        )
        self.process.start()
        child.close()
        self.name = name

    def __call__(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        self.connection.send((command, *args))
        if not self.connection.poll(timeout):
            raise TimeoutError(f"the peer process did not answer {command!r} in {timeout} s")
        status, result = self.connection.recv()
        if status != "ok":
            raise RuntimeError(f"peer {command!r} failed: {result}")
        return result

    def stop(self) -> Any:
        result = self("stop")
        self.process.join(30)
        return result


def serve_cache(
    connection: Any,
    name: str,
    capacity_blocks: int,
    tensors: list[tuple[int, int]],
    transport: str = "local",
) -> None:
    """:func:`serve` for a whole KV cache: a :class:`~jaxbuf.ExtensibleKVCacheBuffers` of
    ``tensors`` (``(num_segments, bytes_per_block_per_segment)`` each) on the CPU under a
    :class:`~jaxbuf.transfer.KVCacheEndpoint`; blocks are read and written by
    ``(tensor, segment, block)``."""
    import numpy as np

    import jaxbuf
    from jaxbuf.transfer import Agent, KVCacheEndpoint

    builder = jaxbuf.ExtensibleKVCacheBuilder(capacity_blocks, "cpu")
    for num_segments, block_bytes in tensors:
        builder.reserve(capacity_blocks * num_segments * block_bytes, num_segments)
    cache = builder.finish()
    agent = None if transport == "local" else Agent(name)
    endpoint = KVCacheEndpoint(agent or name, cache, transport=transport)

    def block(tensor: int, segment: int, first: int) -> np.ndarray:
        return cache.segment_views(tensor)[segment].to_numpy()[first]  # a (block_bytes,) row

    def put(tensor: int, segment: int, first: int, data: bytes) -> None:
        block(tensor, segment, first)[:] = np.frombuffer(data, np.uint8)

    commands = {
        "commit": lambda n, defragment=False: cache.commit(n, defragment=defragment),
        "release": cache.release_physical,
        "recommit": cache.recommit,
        "committed": lambda: cache.num_blocks_committed,
        "metadata": endpoint.metadata,
        "connect": lambda message: endpoint.connect(message).transport,
        "get": lambda tensor, segment, first: block(tensor, segment, first).tobytes(),
        "dump": lambda: [  # every committed block, (segments, blocks, bytes) per tensor
            np.stack(
                [view.to_numpy()[: cache.num_blocks_committed] for view in cache.segment_views(t)]
            ).tobytes()
            for t in range(len(cache))
        ],
        "put": put,
        "grow_tensor": lambda tensor, n: cache.tensors[tensor].resize_per_segment_(
            n * cache.bytes_per_block_per_segment[tensor], zero_new=True
        ),
        "write": lambda peer, local, remote, note=b"": endpoint.write(
            peer, local, remote, notification=note
        ).wait(30),
        "pull": lambda peer, local, remote: endpoint.read(peer, local, remote).wait(30),
        "wait_notification": lambda peer, message: endpoint.wait_notification(peer, message, 30),
    }
    while True:
        command, *args = connection.recv()
        if command == "stop":
            endpoint.close()
            cache.free()
            connection.send(("ok", None))
            return
        try:
            connection.send(("ok", commands[command](*args)))
        except Exception as error:  # noqa: BLE001 - sent back to the test, which raises it
            connection.send(("error", f"{type(error).__name__}: {error}"))


class CachePeerProcess(PeerProcess):
    """A :func:`serve_cache` process: ``peer("commit", 8)``."""

    def __init__(
        self, name: str, capacity_blocks: int, tensors: list, transport: str = "local"
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=serve_cache,
            args=(child, name, capacity_blocks, tensors, transport),
            daemon=True,
        )
        self.process.start()
        child.close()
        self.name = name
