"""Reserving a KV cache tensor by tensor, as an engine's allocator asks for them
(:class:`ExtensibleKVCacheBuilder`)."""

from __future__ import annotations

import functools
from typing import Any

from .. import interop
from .._checks import as_count
from .._errors import Cleanup
from .._resolve import resolve
from ..devices import Device, DeviceLike, as_device
from ..drivers.base import VmmDriver
from ..extensible import SEGMENT_ALIGNMENT, ExtensibleTensor
from ._buffers import ExtensibleKVCacheBuffers

__all__ = ["ExtensibleKVCacheBuilder"]

#: ``shareable`` values beyond the bools: where the CUDA driver's handle-type chain starts
#: (see :class:`jaxbuf.drivers.cuda.CudaVmmDriver`).
_HANDLE_TYPES = ("fabric", "posix", "none")


@functools.cache
def _shareable_cuda_driver(handle_type: str) -> VmmDriver:
    """One CUDA driver per handle type asked for, creating RDMA-capable chunks where the
    device supports them (drivers hold no state of their own beyond caches)."""
    from ..drivers.cuda import CudaVmmDriver

    return CudaVmmDriver(shareable=handle_type, rdma="auto")


def _driver_for(device: Device, shareable: bool | str, driver: VmmDriver | None) -> Any:
    """The driver the tensors are created with: ``driver`` when given, else the device's
    default one, or on CUDA with ``shareable`` one creating exportable, RDMA-capable chunks
    (the CPU driver's chunks are always shareable memfds)."""
    if driver is not None or not shareable or not device.is_cuda:
        return driver
    return _shareable_cuda_driver("fabric" if shareable is True else shareable)


class ExtensibleKVCacheBuilder:
    """Collects one :class:`~jaxbuf.ExtensibleTensor` per KV-cache tensor as the engine's
    allocator reserves them; :meth:`finish` hands them over as
    :class:`ExtensibleKVCacheBuffers` with one block committed.

    :meth:`reserve` stands in for the engine's allocation of a tensor of ``size`` bytes: it
    reserves address space for all ``num_blocks_capacity`` blocks and returns a flat uint8
    view over it (a :class:`~jaxbuf.BufferView`, or an array of ``framework``), on which the
    engine builds its layer views. Nothing is committed before :meth:`finish`.

    Parameters
    ----------
    num_blocks_capacity : int
        Blocks every tensor holds at most (positive).
    device : device spec, optional
    shareable : bool or {"fabric", "posix", "none"}
        On CUDA, chunks other processes and NICs can use: True starts the driver's
        handle-type chain at fabric handles and asks for GPUDirect RDMA where the device
        offers it (each stepped down where refused: see ``CudaVmmDriver.allocation_options``);
        a string starts the chain there. False: the default driver's chunks (POSIX
        descriptors, no RDMA flag). The CPU driver's chunks are always shareable.
    framework : str, optional
        ``"torch"``, ``"jax"`` or a registered adapter's name: :meth:`reserve` returns that
        framework's array (as an engine's allocator returns one); None: a BufferView.
    driver : VmmDriver, optional
        The driver to create the tensors with (not with ``shareable``).
    """

    #: The class :meth:`finish` hands the tensors over as: the framework faces
    #: (:mod:`jaxbuf.torch`, :mod:`jaxbuf.jax`) put theirs here, whose views are their arrays.
    buffers_type: type[ExtensibleKVCacheBuffers] = ExtensibleKVCacheBuffers

    def __init__(
        self,
        num_blocks_capacity: int,
        device: DeviceLike | None = None,
        shareable: bool | str = False,
        *,
        framework: str | None = None,
        driver: VmmDriver | None = None,
    ) -> None:
        self.num_blocks_capacity = as_count(num_blocks_capacity, "num_blocks_capacity")
        if not isinstance(shareable, bool) and shareable not in _HANDLE_TYPES:
            raise ValueError(
                f"shareable must be a bool or one of {_HANDLE_TYPES}, got {shareable!r}"
            )
        if shareable and driver is not None:
            raise ValueError("pass shareable or a driver, not both: shareable picks the driver")
        self._adapter = None if framework is None else interop.get(framework)
        device = as_device(device) if device is not None else None
        self.device, self.driver = resolve(device, driver)
        if (chosen := _driver_for(self.device, shareable, driver)) is not None:
            self.device, self.driver = resolve(self.device, chosen)
        self.shareable = shareable
        self.buffers: list[tuple[ExtensibleTensor, int]] = []
        self._finished: ExtensibleKVCacheBuffers | None = None

    def reserve(self, size: int, num_segments: int) -> Any:
        """Reserve ``size`` bytes for one KV-cache tensor of ``num_blocks_capacity`` blocks,
        each split into ``num_segments`` equal parts (segment ``s`` holds part ``s`` of every
        block, as a prefix of blocks), and return a flat uint8 view over all of it.

        ValueError naming the bad value when ``size`` does not divide into the blocks, a
        block into the segments, or (with several segments) a segment is not a multiple of
        256 bytes (segments start at such multiples, so the view would have gaps); nothing
        is reserved then. RuntimeError after :meth:`finish`.
        """
        if self._finished is not None:
            raise RuntimeError("ExtensibleKVCacheBuilder.reserve after finish()")
        size = as_count(size, "size")
        num_segments = as_count(num_segments, "num_segments")
        block_bytes, remainder = divmod(size, self.num_blocks_capacity)
        if remainder:
            raise ValueError(
                f"size ({size} bytes) does not divide into num_blocks_capacity "
                f"({self.num_blocks_capacity}) blocks"
            )
        if block_bytes % num_segments:
            raise ValueError(
                f"num_segments ({num_segments}) does not divide a block of {block_bytes} bytes"
            )
        if num_segments > 1 and (size // num_segments) % SEGMENT_ALIGNMENT:
            raise ValueError(
                f"a segment of {size // num_segments} bytes (size {size} / num_segments "
                f"{num_segments}) is not a multiple of {SEGMENT_ALIGNMENT} bytes, where "
                "segments start: the flat view would not be contiguous"
            )
        tensor = ExtensibleTensor(size, self.device, num_segments=num_segments, driver=self.driver)
        self.buffers.append((tensor, block_bytes // num_segments))
        view = tensor.full_view()
        return view if self._adapter is None else self._adapter.from_view(view)

    def finish(self) -> ExtensibleKVCacheBuffers:
        """The reserved tensors as :class:`ExtensibleKVCacheBuffers`, one block committed:
        what warmup and graph capture need. A failed commit leaves the builder unfinished
        (call again, or :meth:`free`)."""
        if self._finished is not None:
            return self._finished
        buffers = self.buffers_type(self.buffers, self.num_blocks_capacity)
        buffers.commit(1)
        self._finished = buffers
        return buffers

    def free(self) -> None:
        """Free the tensors reserved so far (an engine that gives up before :meth:`finish`);
        after it, free the finished buffers instead."""
        if self._finished is not None:
            raise RuntimeError("the builder is finished: free its ExtensibleKVCacheBuffers")
        cleanup = Cleanup("ExtensibleKVCacheBuilder.free")
        for tensor, _ in self.buffers:
            cleanup.run(tensor.free)
        cleanup.raise_first()
        self.buffers = []

    def __repr__(self) -> str:
        state = "finished" if self._finished is not None else "open"
        return (
            f"ExtensibleKVCacheBuilder(num_blocks_capacity={self.num_blocks_capacity}, "
            f"device={self.device}, {len(self.buffers)} tensor(s), {state})"
        )
