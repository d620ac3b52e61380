"""The driver seam: the one interface through which jaxbuf touches a platform.

Buffer logic (``extensible.py``, ``uva.py``, ``staged.py``) never calls CUDA or ``mmap``
directly; it calls a :class:`VmmDriver`. Tests wrap a driver to fail any call, and a
new platform (HIP) is one more subclass.

Drivers are the bottom layer: they know platforms by name (``"cpu"``, ``"cuda"``) and devices
by index, and import no other part of jaxbuf (no devices, views or frameworks). What a driver
needs from above arrives through hooks: :data:`out_of_memory_hooks`, which the framework
adapters (:mod:`jaxbuf.interop`) fill.

The model is CUDA's virtual memory management, which the CPU driver reproduces:

* ``reserve`` takes address space with no memory behind it;
* ``create`` makes one physical chunk (an opaque handle);
* ``map`` places a chunk at an address inside a reservation, ``unmap`` removes it;
* ``set_access`` makes mapped addresses readable and writable by a device
  (``set_access_many``: by the owner and its peers at once);
* ``release`` destroys a chunk, ``free_reserved`` returns the address space.
"""

from __future__ import annotations

import abc
import ctypes
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxbuf._errors import attempt
from jaxbuf._lifetime import release_when_collected

if TYPE_CHECKING:
    import numpy as np

# DLPack device types (dlpack.h, DLDeviceType).
K_DL_CPU = 1
K_DL_CUDA = 2
K_DL_CUDA_HOST = 3
K_DL_ROCM = 10
K_DL_ROCM_HOST = 11


class DriverError(RuntimeError):
    """A platform call failed.

    The message names the call, the driver's error name and the sizes involved, e.g.
    ``cuMemCreate(size=2097152, device=0) failed: CUDA_ERROR_OUT_OF_MEMORY``.
    """

    def __init__(self, call: str, error_name: str, **details: Any) -> None:
        args = ", ".join(f"{key}={value}" for key, value in details.items())
        super().__init__(f"{call}({args}) failed: {error_name}")
        self.call = call
        self.error_name = error_name
        self.details = details

    @property
    def out_of_memory(self) -> bool:
        return "OUT_OF_MEMORY" in self.error_name or self.error_name == "ENOMEM"


#: Called (without arguments) when a driver's allocation fails for lack of memory, to return
#: memory cached elsewhere in the process; each returns True when it released something, so
#: that a retry may succeed. :mod:`jaxbuf.interop` registers one that asks every loaded
#: framework adapter (torch: ``torch.cuda.empty_cache``). Append to add your own.
out_of_memory_hooks: list[Callable[[], bool]] = []


def release_cached_memory(error: BaseException) -> bool:
    """Run every out-of-memory hook for ``error`` (an out-of-memory :class:`DriverError`);
    True when one released something. A failing hook becomes a note on ``error``."""
    released = False
    for hook in list(out_of_memory_hooks):
        try:
            released = bool(hook()) or released
        except Exception as hook_error:  # noqa: BLE001 - reported as a note
            error.add_note(f"out-of-memory hook {hook!r} failed: {hook_error!r}")
    return released


class VmmDriver(abc.ABC):
    """One platform's virtual-memory and pinned-host primitives.

    Addresses and sizes are Python ints. Handles are opaque to callers. Every
    failure raises :class:`DriverError`; a failed call changes nothing.
    """

    #: ``"cuda"`` or ``"cpu"``: the platform of the :class:`jaxbuf.devices.Device`
    #: values this driver serves.
    platform: str
    #: DLPack ``device_type`` of memory from ``reserve``/``map``.
    dlpack_device_type: int
    #: DLPack ``device_type`` of pinned host memory as seen from the host.
    dlpack_host_device_type: int = K_DL_CPU
    #: Whether :meth:`host_alloc` always returns zeroed memory. False (the safe default):
    #: a pinned allocator may hand back a block freed earlier with its bytes (CUDA's does),
    #: so the owner zeroes it.
    host_alloc_zeroed: bool = False

    # -- probing --------------------------------------------------------------------
    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when the driver works here, else one sentence saying why not. Cached."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices this driver can address (0 when unavailable)."""

    # -- context and granularity ----------------------------------------------------
    @abc.abstractmethod
    def ensure_context(self, device_index: int) -> None:
        """Make ``device_index`` current for this thread (CUDA: its primary context)."""

    @abc.abstractmethod
    def granularity(self, device_index: int) -> int:
        """The platform's minimum allocation granularity for ``create``/``map``."""

    # -- virtual memory -------------------------------------------------------------
    @abc.abstractmethod
    def reserve(self, size: int, alignment: int = 0) -> int:
        """Reserve ``size`` bytes of address space; return its base address."""

    @abc.abstractmethod
    def free_reserved(self, ptr: int, size: int) -> None:
        """Return a reservation made by :meth:`reserve` (nothing may be mapped in it)."""

    @abc.abstractmethod
    def create(self, size: int, device_index: int) -> Any:
        """Create one physical chunk of ``size`` bytes; return its handle."""

    @abc.abstractmethod
    def release(self, handle: Any) -> None:
        """Destroy a chunk made by :meth:`create` (after it is unmapped)."""

    @abc.abstractmethod
    def map(self, ptr: int, size: int, handle: Any) -> None:
        """Map a whole chunk at ``ptr``, inside a reservation."""

    @abc.abstractmethod
    def unmap(self, ptr: int, size: int) -> None:
        """Unmap ``[ptr, ptr + size)``, leaving the addresses reserved."""

    @abc.abstractmethod
    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        """Grant ``device_index`` read/write access to whole mapped chunks."""

    def set_access_many(self, ptr: int, size: int, device_indices: Sequence[int]) -> None:
        """Grant every device of ``device_indices`` (the owner first, then its peers)
        read/write access to whole mapped chunks.

        This default makes one :meth:`set_access` call per device, so a driver (or a test's
        fault-injecting wrapper) that only implements ``set_access`` works unchanged; a
        failure may leave earlier devices granted, which the caller's rollback (``unmap``)
        undoes. The CUDA driver overrides it with one ``cuMemSetAccess`` call.
        """
        for device_index in device_indices:
            self.set_access(ptr, size, device_index)

    def can_access_peer(self, device_index: int, peer_index: int) -> bool:
        """Whether ``device_index`` can read and write memory that lives on ``peer_index``
        once granted (CUDA: ``cuDeviceCanAccessPeer(device_index, peer_index)``).

        Default: only a device itself.
        """
        return device_index == peer_index

    # -- sharing and moving chunks (optional) ----------------------------------------
    def export_handle(self, handle: Any) -> int:
        """Return a new POSIX file descriptor for chunk ``handle``, which the caller owns
        (and closes). Another process turns it back into a chunk with :meth:`import_handle`.

        The default raises ``DriverError(..., "NOT_SUPPORTED")``: a driver that can share
        chunks across processes overrides it.
        """
        raise DriverError("export_handle", "NOT_SUPPORTED", driver=type(self).__name__)

    def import_handle(self, fd: int, size: int, device_index: int) -> Any:
        """Return a chunk handle for the ``size``-byte chunk behind ``fd`` (from
        :meth:`export_handle`, possibly in another process), to be mapped with :meth:`map`
        and, once unmapped, released with :meth:`release`.

        The caller keeps ownership of ``fd`` (closes it; the handle does not need it).
        The default raises ``DriverError(..., "NOT_SUPPORTED")``.
        """
        raise DriverError("import_handle", "NOT_SUPPORTED", driver=type(self).__name__)

    def move_mapping(self, handle: Any, src_ptr: int, dst_ptr: int, size: int) -> None:
        """Move chunk ``handle``'s mapping from ``src_ptr`` to ``dst_ptr``, keeping its bytes.

        Contract: ``handle`` is mapped whole (``size`` bytes) at ``src_ptr``; ``[dst_ptr,
        dst_ptr + size)`` lies inside a reservation and nothing is mapped there. On return
        the chunk is mapped at ``dst_ptr`` and ``[src_ptr, src_ptr + size)`` is unmapped but
        still reserved. Access at ``dst_ptr`` must be granted again with :meth:`set_access`
        (CUDA grants none to a new mapping; the CPU keeps it). Raising means nothing changed.

        The default maps ``handle`` a second time at ``dst_ptr``, then unmaps ``src_ptr``,
        which is right for drivers whose chunks may be mapped at several addresses (CUDA).
        The CPU driver, whose chunks are mapped once, overrides it (``mremap``).
        """
        self.map(dst_ptr, size, handle)
        try:
            self.unmap(src_ptr, size)
        except BaseException as error:
            attempt(error, "move_mapping rollback: unmap", self.unmap, dst_ptr, size)
            raise

    # -- work on the memory ---------------------------------------------------------
    @abc.abstractmethod
    def memset(self, ptr: int, value: int, size: int, device_index: int) -> None:
        """Fill ``size`` bytes at ``ptr`` with the byte ``value`` (ordered on the
        driver's producer stream; see :meth:`record_ready_event`)."""

    @abc.abstractmethod
    def copy(self, dst: int, src: int, size: int, device_index: int) -> None:
        """Copy ``size`` bytes between any two addresses the device can reach
        (ordered on the producer stream)."""

    @abc.abstractmethod
    def synchronize(self, device_index: int) -> None:
        """Wait until all work on the device is done."""

    def memory_info(self, device_index: int) -> tuple[int, int] | None:
        """``(free_bytes, total_bytes)`` of the device's memory, or None when the platform
        has no separate device memory to report (the CPU). Used by leak checks."""
        return None

    def record_ready_event(self, device_index: int) -> Any:
        """Record an event after the producer's pending work (jaxbuf's own work runs on the
        legacy default stream, DLPack stream 1); None when the platform has no asynchronous
        work (the CPU)."""
        return self.record_event(1, device_index)

    def stream_wait_event(self, stream: int, event: Any, device_index: int) -> None:
        """Make the consumer ``stream`` wait for ``event`` (from :meth:`record_ready_event`)."""

    def destroy_event(self, event: Any) -> None:
        """Destroy an event from :meth:`record_ready_event` or :meth:`record_event`."""

    def record_event(self, stream: int, device_index: int) -> Any:
        """Record a new event on the consumer ``stream`` (a DLPack stream number: 1 the
        legacy default stream, 2 the per-thread default stream, else a stream handle), after
        the work already enqueued there. None when the platform has no asynchronous work.
        The caller owns the event and frees it with :meth:`destroy_event`."""
        return None

    def event_query(self, event: Any) -> bool:
        """True when the work before ``event`` is done (never blocks)."""
        return True

    def event_synchronize(self, event: Any) -> None:
        """Block the calling thread until the work before ``event`` is done."""

    def copy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, device_index: int
    ) -> Any:
        """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every ``i``, in one call:
        the block copies of a transfer between two mappings of this process (a local buffer
        and a peer's imported one), any two addresses the device can reach.

        ``dsts``, ``srcs``, ``sizes``: 1-D C-contiguous numpy arrays of uint64 (native byte
        order), of one length (0 is an empty batch); checked by :func:`copy_batch_arguments`
        before anything is copied (``TypeError`` / ``ValueError`` naming the argument).
        Overlapping ranges are the caller's problem: the CPU copies in order, each as
        ``memmove``; CUDA's batch runs its copies in no particular order.

        Returns what the caller waits on: None on the CPU (the copies are done when it
        returns); on CUDA an event recorded after the copies, stream-ordered on this
        driver's stream for ``device_index``, for :meth:`event_query`,
        :meth:`event_synchronize` and :meth:`destroy_event` (the caller owns it). If it
        raises, no copy of the call is still in flight (the device is synchronized when
        some may have been enqueued); the destinations' bytes are then unspecified.

        This default makes one :meth:`copy` per triple, then :meth:`record_ready_event`;
        the CPU and CUDA drivers override it with one call into C for the whole batch.
        """
        count, *addresses = copy_batch_arguments(dsts, srcs, sizes)
        for dst, src, size in batch_triples(count, *addresses):
            self.copy(dst, src, size, device_index)
        return self.record_ready_event(device_index)

    def copy_on_stream(self, dst: int, src: int, size: int, stream: Any) -> None:
        """Enqueue a copy of ``size`` bytes on ``stream`` (a raw stream handle, 0 the legacy
        default stream, as :meth:`launch_kernel` takes it), in the calling thread's current
        context: the copy a launch on that stream reads from. The default raises
        ``NotImplementedError``: a platform without streams (the CPU)."""
        raise NotImplementedError(f"{type(self).__name__} has no streams to copy on")

    # -- kernels --------------------------------------------------------------------
    def launch_kernel(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        stream: Any,
        args: int,
    ) -> None:
        """Enqueue the loaded kernel ``function`` (CUDA: a ``CUfunction`` or its address) on
        ``stream`` (a raw stream handle: 0 the legacy default stream, as the launch API
        takes it), in the calling thread's current context.

        ``grid`` / ``block`` count programs and threads per dimension, ``shared`` is the
        dynamic shared memory in bytes, ``args`` the address of an array of pointers to
        each parameter's value (``cuLaunchKernel``'s ``kernelParams``); the values are
        copied during the call, so the caller may rewrite them once it returns.

        The default raises ``NotImplementedError``: a platform without kernels (the CPU).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot launch kernels")

    def copy_and_launch(
        self,
        device_index: int,
        stream: Any,
        copy: tuple[int, int, int] | None,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        args: int,
    ) -> None:
        """A staged apply's submission: make ``device_index``'s context current, enqueue on
        the raw ``stream`` the copy ``copy`` = ``(dst, src, size)`` (None: none), then
        :meth:`launch_kernel` (nothing when ``grid`` has no program).

        If it raises, nothing was launched, and a copy already enqueued has completed (the
        device is synchronized first), so its source may be rewritten at once. This default
        makes the three calls in turn; the CUDA driver makes them in one C call.
        """
        self.ensure_context(device_index)
        if copy is not None:
            self.copy_on_stream(*copy, stream)
        if not (grid[0] and grid[1] and grid[2]):
            return
        try:
            self.launch_kernel(function, grid, block, shared, stream, args)
        except BaseException as error:
            settle_failed_launch(self, error, copy, device_index)
            raise

    # -- plain device memory --------------------------------------------------------
    def device_alloc(self, size: int, device_index: int) -> DeviceMemory:
        """``size`` bytes (at least one granule's worth is taken) of device memory, mapped and
        accessible to ``device_index`` at once: a :class:`DeviceMemory`, released by its
        ``release()`` or when it is collected. For memory that never grows (the copy a
        ``BufferView.__dlpack__(copy=True)`` makes on a device).

        All or nothing: a failure undoes what was done and raises :class:`DriverError`. This
        default is reserve, create, map and set access through this driver's own calls.
        """
        granularity = self.granularity(device_index)
        size = -(-max(size, 1) // granularity) * granularity
        self.ensure_context(device_index)
        ptr = self.reserve(size, granularity)
        try:
            handle = self.create(size, device_index)
        except BaseException as error:
            attempt(error, "device_alloc rollback: free_reserved", self.free_reserved, ptr, size)
            raise
        try:
            self.map(ptr, size, handle)
        except BaseException as error:
            attempt(error, "device_alloc rollback: release", self.release, handle)
            attempt(error, "device_alloc rollback: free_reserved", self.free_reserved, ptr, size)
            raise
        try:
            self.set_access(ptr, size, device_index)
        except BaseException as error:
            if attempt(error, "device_alloc rollback: unmap", self.unmap, ptr, size):
                attempt(error, "device_alloc rollback: release", self.release, handle)
                attempt(
                    error, "device_alloc rollback: free_reserved", self.free_reserved, ptr, size
                )
            raise
        return DeviceMemory(self, device_index, ptr, size, handle)

    # -- pinned host memory ---------------------------------------------------------
    @abc.abstractmethod
    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        """Allocate ``size`` bytes of page-locked host memory the device can read in
        place. Return ``(host_ptr, device_ptr)``; equal under unified addressing."""

    @abc.abstractmethod
    def host_free(self, host_ptr: int) -> None:
        """Free memory from :meth:`host_alloc`."""


def settle_failed_launch(
    driver: VmmDriver, error: BaseException, copy: Any, device_index: int
) -> None:
    """Keep :meth:`VmmDriver.copy_and_launch`'s contract once its launch failed with
    ``error``: a ``copy`` enqueued before it has completed (the device is synchronized), so
    its source may be rewritten. A failed synchronize is noted on ``error``."""
    if copy is not None:
        what = "waiting for the copy enqueued before the failed launch"
        attempt(error, what, driver.synchronize, device_index)


# The array-interface type string of native uint64 (a byte-swapped array is refused).
_UINT64_TYPESTR = "<u8" if sys.byteorder == "little" else ">u8"
_UINT64_SIZE = 8


def _batch_array(name: str, array: Any) -> tuple[int, int]:
    """``(length, data address)`` of one of :meth:`VmmDriver.copy_batch`'s arrays, read
    through the array interface (the drivers import no numpy), or the error naming it."""
    interface = getattr(array, "__array_interface__", None)
    if not isinstance(interface, dict) or not isinstance(interface.get("data"), tuple):
        raise TypeError(f"{name} must be a 1-D numpy array of uint64, got {type(array).__name__}")
    if interface.get("typestr") != _UINT64_TYPESTR:
        dtype = getattr(array, "dtype", interface.get("typestr"))
        raise TypeError(f"{name} must have dtype uint64 (native byte order), got {dtype}")
    shape = tuple(interface.get("shape", ()))
    if len(shape) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {shape}")
    strides = interface.get("strides")  # None: C-contiguous
    if strides is not None and shape[0] > 1 and tuple(strides) != (_UINT64_SIZE,):
        raise ValueError(f"{name} must be C-contiguous, got strides {tuple(strides)}")
    return shape[0], int(interface["data"][0])


def copy_batch_arguments(dsts: Any, srcs: Any, sizes: Any) -> tuple[int, int, int, int]:
    """``(count, dsts_address, srcs_address, sizes_address)`` of :meth:`VmmDriver.copy_batch`'s
    arrays, after checking that each is a 1-D C-contiguous uint64 array and that they have
    one length; raises ``TypeError`` / ``ValueError`` naming the bad argument otherwise.
    The addresses are valid while the caller holds the arrays."""
    count, dsts_address = _batch_array("dsts", dsts)
    srcs_count, srcs_address = _batch_array("srcs", srcs)
    sizes_count, sizes_address = _batch_array("sizes", sizes)
    if not count == srcs_count == sizes_count:
        raise ValueError(
            f"dsts, srcs and sizes must have one length, got {count}, {srcs_count} and "
            f"{sizes_count}"
        )
    return count, dsts_address, srcs_address, sizes_address


def batch_triples(
    count: int, dsts_address: int, srcs_address: int, sizes_address: int
) -> list[tuple[int, int, int]]:
    """The ``(dst, src, size)`` triples of checked batch arrays (addresses from
    :func:`copy_batch_arguments`), as Python ints: what the fallbacks without C loop over."""
    if not count:
        return []
    columns = [
        list((ctypes.c_uint64 * count).from_address(address))
        for address in (dsts_address, srcs_address, sizes_address)
    ]
    return list(zip(*columns))


class DeviceMemory:
    """Plain device memory from :meth:`VmmDriver.device_alloc`: ``ptr``, ``size`` (whole
    granules), one chunk mapped over one reservation.

    :meth:`release` synchronizes the device (kernels may still read it), then unmaps, releases
    and frees; each step is done once, so a call after a driver failure retries what is left.
    Collected unreleased, it releases itself; a failure there is queued for a retry at the
    next use of the driver (:mod:`jaxbuf._lifetime`). It calls into no framework, so it is safe
    from a DLPack deleter.
    """

    __slots__ = ("driver", "device_index", "ptr", "size", "_handle", "_mapped", "__weakref__")

    def __init__(self, driver: VmmDriver, device_index: int, ptr: int, size: int, handle: Any):
        self.driver = driver
        self.device_index = device_index
        self.ptr = ptr
        self.size = size
        self._handle = handle
        self._mapped = True

    @property
    def released(self) -> bool:
        return not self.ptr

    def release(self) -> None:
        if not self.ptr:
            return
        driver = self.driver
        driver.synchronize(self.device_index)
        if self._mapped:
            driver.unmap(self.ptr, self.size)
            self._mapped = False
        if self._handle is not None:
            driver.release(self._handle)
            self._handle = None
        driver.free_reserved(self.ptr, self.size)
        self.ptr = 0

    def __repr__(self) -> str:
        state = "released" if not self.ptr else f"ptr={self.ptr:#x}"
        return f"DeviceMemory({state}, size={self.size}, device={self.device_index})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("DeviceMemory cannot be pickled or copied: it owns a driver allocation")

    def __del__(self, _release: Any = release_when_collected) -> None:
        if getattr(self, "ptr", 0):
            _release(self.release, "a device copy's memory", driver=self.driver)
