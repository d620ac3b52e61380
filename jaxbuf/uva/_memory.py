"""What a UVA buffer owns, and what its views ask of it.

* :class:`_PinnedHostMemory` (a :class:`~jaxbuf.uva.UvaBuffer`'s pinned block) and
  :class:`_DeviceMemory` (a :class:`~jaxbuf.uva.NonUvaBuffer`'s device memory) are the
  allocations (:class:`jaxbuf._owner.OwnedAllocation`): a buffer's
  :class:`~jaxbuf._owner.Lifetime` anchor holds one, and every export holds the anchor.
* :class:`_ViewOwner` is the owner of a buffer's views (:class:`jaxbuf._owner.MemoryOwner`).
* The bounds checked before allocating, and the refusal to pickle or copy an owner.

Reference graph, kept acyclic on purpose: buffer -> cached arrays -> capsule -> anchor ->
allocation, and buffer -> views -> view owner -> lifetime. Nothing below a buffer points back
at it (or at a pool): a capsule's reference is invisible to the cycle collector, so a cycle
through one would never be collected, and without cycles a dropped buffer (or pool) goes by
reference counting, at once, its memory with its last array.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, NoReturn

from .. import interop
from .._errors import ClosedError
from .._interrupts import deferred_interrupts
from .._lifetime import release_when_collected, retry_deferred
from .._owner import Lifetime
from ..devices import Device
from ..drivers.base import VmmDriver


@functools.cache
def _physical_memory_bytes() -> int:
    """This host's physical memory (2**63 - 1 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not Linux/macOS
        return (1 << 63) - 1


def _check_host_bytes(nbytes: int, what: str) -> None:
    """ValueError before allocating when ``nbytes`` of host memory could never be had.

    Pinned (page-locked) memory must stay resident in RAM, so no driver can pin more than
    the host's physical memory; asking would only fail after a long attempt (or, on the CPU
    driver's overcommitted mmap, later, when the pages are touched).
    """
    limit = _physical_memory_bytes()
    if nbytes > limit:
        raise ValueError(
            f"{what} needs {nbytes} bytes of host memory, more than this host's {limit} bytes "
            "of physical memory: pinned memory stays resident in RAM, so no driver could "
            "allocate it"
        )


def _refuse_copy(self: Any, *args: Any) -> NoReturn:
    """``__reduce_ex__`` of the owners: pickling, ``copy.copy`` and ``deepcopy`` all end here."""
    raise TypeError(
        f"a {type(self).__name__} cannot be pickled or copied: it owns memory of this process "
        "(pinned host or device memory, freed exactly once), which a copy could neither share "
        "nor free; make a new one instead"
    )


# -- the allocations (jaxbuf._owner.OwnedAllocation) --------------------------------------
class _PinnedHostMemory:
    """One ``host_alloc`` block: the allocation of a :class:`UvaBuffer`, zeroed.

    Zeroed as the seed's ``torch.zeros(..., pin_memory=True)`` is, unless the driver's
    ``host_alloc_zeroed`` says it already is: a pinned allocator may hand back a block freed
    earlier with its bytes (on CUDA a fresh pool slot read the UVA probe's pattern).

    Held by the buffer's lifetime anchor, so by every export of the buffer; it references
    nothing of the buffer or of a pool (see the module docstring). Released once, by
    :meth:`release` (retryable: the pointer is dropped only after ``host_free`` succeeded)
    or, when the last reference goes unreleased, by ``__del__``. On CUDA the device is
    synchronized first: the last export's deleter may run while kernels reading the memory
    are still queued (torch drops an imported tensor's memory when the Python object dies,
    not when its stream is done with it).
    """

    __slots__ = ("host_ptr", "device_ptr", "nbytes", "_driver", "_sync_index", "__weakref__")

    def __init__(self, driver: VmmDriver, nbytes: int, device: Device) -> None:
        self.host_ptr = 0
        self._driver = driver
        self._sync_index = device.index if device.is_cuda else None
        retry_deferred(driver)  # releases that failed in a finalizer: retried at next use
        # host_alloc refuses 0 bytes; an empty buffer still gets a valid pointer. Allocated
        # and recorded as one step: an interrupt as the call returns would leak the block.
        with deferred_interrupts():
            self.host_ptr, self.device_ptr = driver.host_alloc(max(nbytes, 1), device.index)
        self.nbytes = nbytes
        if not driver.host_alloc_zeroed:
            # Through the host pointer: no device work is pending on a block just allocated.
            ctypes.memset(self.host_ptr, 0, nbytes)

    @property
    def released(self) -> bool:
        return not self.host_ptr

    def release(self) -> None:
        ptr = self.host_ptr
        if ptr:
            if self._sync_index is not None:
                self._driver.synchronize(self._sync_index)
            with deferred_interrupts():  # freed and recorded as one step
                self._driver.host_free(ptr)
                self.host_ptr = 0

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "host_ptr", 0):
            _release(self.release, "pinned host memory", driver=self._driver)


class _DeviceMemory:
    """The allocation of a :class:`NonUvaBuffer`: a one-segment ExtensibleTensor that only
    the buffer's views export (through this object's anchor).

    :meth:`release` is the tensor's ``free()``, which waits for the frameworks, synchronizes
    the device and unmaps (a failed release is retried by the next call). No ``__del__``
    here: collected unreleased, this object drops the tensor, whose memory then frees itself
    (its own allocation's finalizer, which calls no framework).
    """

    __slots__ = ("tensor", "released", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.tensor.free()  # idempotent; after a driver failure a retry frees the rest
            self.released = True


def _release_now(allocation: Any, device: Device, quiesce: bool) -> None:
    """Release an allocation that no export holds.

    ``quiesce``: first :func:`jaxbuf.interop.quiesce` (a donated JAX step, say, may still run
    on the memory); False on behalf of the garbage collector (which must not call into a
    framework) and where the caller has just done it.
    """
    if allocation.released:
        return
    if quiesce:
        interop.quiesce(device)
    allocation.release()


def _nothing(allocation: Any) -> None:
    """``Lifetime.close``'s release step when the owner releases by itself afterwards."""


class _ViewOwner:
    """The owner of a buffer's views (:class:`jaxbuf._owner.MemoryOwner`).

    Holds what a view asks of its owner (device, driver, the ready event of the last copy,
    the buffer's lifetime) and not the buffer, so that buffer -> views -> owner closes no
    cycle. Views taken before ``free()`` raise at export once the lifetime is closed.
    """

    __slots__ = ("device", "driver", "ready_event", "_lifetime", "_what")

    def __init__(self, device: Device, driver: VmmDriver, lifetime: Lifetime, what: str):
        self.device = device
        self.driver = driver
        self.ready_event: Any = None  # a NonUvaBuffer's last copy; its buffer destroys it
        self._lifetime = lifetime
        self._what = what

    def check_exportable(self) -> None:
        if self._lifetime.anchor is None:
            raise ClosedError(self._what, "freed", "its views cannot be exported")

    @property
    def export_anchor(self) -> object:
        return self._lifetime.anchor

    def __del__(self, _release: Any = release_when_collected) -> None:
        event = getattr(self, "ready_event", None)
        if event is not None:  # the buffer was dropped unfreed: the last views are going
            driver = self.driver
            _release(
                lambda: driver.destroy_event(event), "a NonUvaBuffer's ready event", driver=driver
            )
