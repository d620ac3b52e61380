"""Benchmarks of peer access: a GPU reading a buffer that lives on
another GPU, against the owner reading it locally, in the same run.

Suite ``peer.read``: an :class:`~jaxbuf.ExtensibleTensor` of 256 MiB (32 MiB with
``--quick``; the title states the size run) on the bench device, granted to the next GPU
(``peer_devices``). Two kernels read it: torch's ``sum`` and a copy into a tensor local to
the reader, each on the peer (over NVLink or PCIe) and on the owner (from its own memory,
the baseline). Device time from CUDA events on the reader's stream; both GPUs' L2 caches are
flushed before each sample. The ratio is peer time / local time (above 1: the peer read is
slower); ``params`` carries the bandwidths in GB/s.

With fewer than two CUDA devices (or two that cannot reach each other) there is no peer to
measure: the suite yields one row timing the local read alone, with a note. On the CPU it is
skipped, saying why (no peer devices: a host sum would measure numpy, not peer access).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from jaxbuf.bench import Row, Sizes, format_bytes, require, suite
from jaxbuf.bench._timing import (
    DeviceEventTimer,
    device_synchronizer,
    measure,
    release_torch_memory,
)
from jaxbuf.devices import Device
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.extensible import ExtensibleTensor
from jaxbuf.views import BufferView

MiB = 1 << 20


def _peer_index(device: Device) -> tuple[int | None, str]:
    """The GPU that reads the bench device's memory, or None and why not."""
    if not device.is_cuda:
        return None, "the CPU has no peer devices"
    driver = get_vmm_driver(device)
    count = driver.device_count()
    if count < 2:
        return None, f"only {count} CUDA device is visible"
    peer = (device.index + 1) % count
    if not driver.can_access_peer(peer, device.index):
        return None, f"cuda:{peer} cannot access cuda:{device.index} (no peer-to-peer)"
    return peer, ""


def _local_only(device: Device, quick: bool, reason: str) -> Iterator[Row | Sizes]:
    """One row: the owner's own read of the buffer, no peer to compare with."""
    nbytes = (32 if quick else 256) * MiB if device.is_cuda else (4 if quick else 64) * MiB
    repeat = 5 if quick else 20
    yield Sizes(f"{format_bytes(nbytes)}, local read only")
    if device.is_cuda:
        require("torch")  # the sum kernel on the GPU; numpy sums on the CPU
    buffer = ExtensibleTensor(nbytes, device=device)
    tensor = None
    try:
        buffer.resize_per_segment_(nbytes, zero_new=True)
        view = buffer.segment_view(0).view("float32")
        # torch on a GPU; numpy on the CPU (no framework needed there).
        tensor = view.to_torch() if device.is_cuda else view.to_numpy()
        timing = measure(
            tensor.sum, repeat=repeat, warmup=1, synchronize=device_synchronizer(device)
        )
    finally:
        tensor = None
        buffer.free()
    yield Row(
        f"local read {format_bytes(nbytes)} (sum, no peer)",
        timing.median_s,
        notes=f"peer read not measured: {reason}; needs two CUDA devices with peer access",
        params={
            "size_bytes": nbytes,
            "kernel": "sum",
            "peer": None,
            "samples": repeat,
            "local_GBps": nbytes / timing.median_s / 1e9,
        },
    )


def _median_device_time(
    fn: Any, *, repeat: int, setup: Any, synchronize: Any, timer: DeviceEventTimer
) -> tuple[float, float]:
    """(device median, host median) of ``fn``, L2 flushed (``setup``) before each sample."""
    timing = measure(
        lambda _state: fn(),
        repeat=repeat,
        warmup=0,
        setup=setup,
        synchronize=synchronize,
        device_timer=timer,
    )
    device_s = timing.device_median_s
    return (device_s if device_s is not None else timing.median_s), timing.median_s


@suite(
    "peer.read",
    gpu_only="the CPU has no peer devices (the peer read needs two CUDA GPUs with peer access)",
)
def read(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """A GPU reading memory that lives on another GPU, against the owner's local read."""
    peer, reason = _peer_index(device)
    if peer is None:
        yield from _local_only(device, quick, reason)
        return
    require("torch")
    import torch

    owner = device.index
    owner_dev, peer_dev = Device("cuda", owner), Device("cuda", peer)
    nbytes = (32 if quick else 256) * MiB
    yield Sizes(f"{format_bytes(nbytes)} on cuda:{owner}, read from cuda:{peer}")
    elements = nbytes // 4
    repeat = 5 if quick else 20
    driver = get_vmm_driver(device)
    sync = {owner: device_synchronizer(owner_dev), peer: device_synchronizer(peer_dev)}
    timers = {owner: DeviceEventTimer(owner), peer: DeviceEventTimer(peer)}
    # Writing 128 MiB on each GPU before a sample evicts the buffer from both L2 caches.
    scratch = [torch.empty(128 * MiB, dtype=torch.uint8, device=f"cuda:{i}") for i in (owner, peer)]

    def flush_l2() -> None:
        for tensor in scratch:
            tensor.zero_()
        sync[owner]()
        sync[peer]()

    buffer = ExtensibleTensor(nbytes, device=owner_dev, peer_devices=[peer_dev])
    local = remote = local_dst = remote_dst = functions = None
    try:
        buffer.resize_per_segment_(nbytes)
        local = buffer.segment_view(0).to_torch(dtype=torch.float32)
        remote = BufferView(
            buffer.base_ptr,
            nbytes,
            "float32",
            (elements,),
            peer_dev,
            buffer,
            driver.dlpack_device_type,
        ).to_torch()
        local.copy_(torch.arange(elements, device=local.device, dtype=torch.float32) % 8)
        sync[owner]()
        expected = float(local.sum(dtype=torch.float64))
        if float(remote.sum(dtype=torch.float64)) != expected:
            raise RuntimeError("the peer read returned a wrong sum")
        local_dst = torch.empty_like(local)
        remote_dst = torch.empty_like(remote)  # on the peer: a local destination there

        functions = {
            "sum": (remote.sum, local.sum),
            "copy": (lambda: remote_dst.copy_(remote), lambda: local_dst.copy_(local)),
        }
        for on_peer, on_owner in functions.values():  # warm-up: kernels loaded
            measure(on_peer, repeat=2, warmup=0, synchronize=sync[peer])
            measure(on_owner, repeat=2, warmup=0, synchronize=sync[owner])
        results = {}
        for kind, (on_peer, on_owner) in functions.items():
            samples: dict[str, list[tuple[float, float]]] = {"peer": [], "owner": []}
            # Alternate peer and owner samples, so drift affects both alike.
            for _ in range(repeat):
                for who, fn, index in (("peer", on_peer, peer), ("owner", on_owner, owner)):
                    samples[who].append(
                        _median_device_time(
                            fn,
                            repeat=1,
                            setup=flush_l2,
                            synchronize=sync[index],
                            timer=timers[index],
                        )
                    )
            results[kind] = tuple(
                statistics.median(sample[column] for sample in samples[who])
                for column, who in ((0, "peer"), (0, "owner"), (1, "peer"), (1, "owner"))
            )
    finally:
        functions = local = remote = local_dst = remote_dst = None
        on_peer = on_owner = fn = None  # drop every tensor over the buffer before freeing it
        for index in (owner, peer):
            sync[index]()
        buffer.free()
        scratch = None  # drop the L2-flushing tensors before returning torch's cache
        release_torch_memory(owner_dev)
        release_torch_memory(peer_dev)

    size = format_bytes(nbytes)
    labels = {"sum": "sum", "copy": "copy into a local tensor"}
    for kind, (peer_s, owner_s, peer_host, owner_host) in results.items():
        yield Row(
            f"cuda:{peer} reads {size} on cuda:{owner} ({labels[kind]})",
            peer_s,
            f"cuda:{owner} reads its own {size} ({labels[kind]})",
            owner_s,
            notes="device time (CUDA events), L2 flushed; ratio > 1 expected: peer reads "
            "cross NVLink/PCIe, local reads HBM; no target",
            device_median_s=peer_s,
            baseline_device_median_s=owner_s,
            params={
                "size_bytes": nbytes,
                "kernel": kind,
                "owner": owner,
                "peer": peer,
                "peer_GBps": nbytes / peer_s / 1e9,
                "local_GBps": nbytes / owner_s / 1e9,
                "host_median_s": peer_host,
                "baseline_host_median_s": owner_host,
                "samples": repeat,
            },
        )
