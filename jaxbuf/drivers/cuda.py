"""The CUDA driver: :class:`CudaVmmDriver` on ``cuda.bindings.driver`` (cuda-python).

Every driver call's result goes through :meth:`CudaVmmDriver._check`, the only place that
knows the binding's result shape (a tuple ``(CUresult, *values)``) and turns a failure into a
:class:`~jaxbuf.drivers.base.DriverError` named by ``cuGetErrorName``.

Contexts: jaxbuf uses each device's *primary* context, the one the CUDA runtime (and so
torch and JAX) also uses, so pointers and streams are shared with the frameworks. It
retains it itself, so it works before either framework touched the device.

Out of memory: :meth:`~CudaVmmDriver.create` asks the hooks of
:data:`jaxbuf.drivers.base.out_of_memory_hooks` to return cached memory (the framework
adapters register one: torch empties its caching allocator) and retries once. This module
imports no framework.

ROCm seam: the binding is held on the instance (``self._cu``), so a HIP driver is a subclass
that passes its own binding: ``platform`` still ``"cuda"`` (torch calls ROCm devices
``cuda``), ``dlpack_device_type = K_DL_ROCM``, ``dlpack_host_device_type = K_DL_ROCM_HOST``,
and a binding namespace whose ``cu*`` names map to hip-python's ``hip*`` calls (they mirror
the ``cuMem*`` ones), with the enum names the methods read (``CUresult``, ``CUstream``, ...).
``_error_name`` and ``_probe`` are methods to override where HIP differs. The method bodies
map one to one.

Two concepts live in mixins of their own: what chunks are created with (the allocation
property, the shareable handle-type chain, the RDMA flag, ``cuMemCreate``'s step-down) in
:mod:`jaxbuf.drivers._cuda_alloc`, and work ordered on streams in
:mod:`jaxbuf.drivers._cuda_streams`.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NoReturn

from jaxbuf._errors import attempt
from jaxbuf.drivers._cuda_alloc import CudaAllocation
from jaxbuf.drivers._cuda_streams import CudaStreamWork
from jaxbuf.drivers.base import (
    K_DL_CUDA,
    K_DL_CUDA_HOST,
    DriverError,
    VmmDriver,
    batch_triples,
    copy_batch_arguments,
    release_cached_memory,
)

try:
    from cuda.bindings import driver as _cu
except ImportError:  # cuda-bindings is an optional extra; unavailable_reason says so.
    _cu = None
# The module itself, which tests may replace as `_cu`: only a driver on it makes C calls.
_CUDA_BINDINGS = _cu

# cuda-bindings loads libcuda lazily, on the first driver call, through cuda-pathfinder,
# which raises DynamicLibNotFoundError when no NVIDIA driver is installed. It is a
# RuntimeError, as is what older loaders raise (a failed dlopen), so RuntimeError is caught;
# OSError covers a loader that lets dlopen's error through.
_LIBRARY_NOT_FOUND: tuple[type[Exception], ...] = (RuntimeError, OSError)
try:
    from cuda.pathfinder import DynamicLibNotFoundError

    _LIBRARY_NOT_FOUND = (DynamicLibNotFoundError, *_LIBRARY_NOT_FOUND)
except ImportError:
    pass


#: The DLPack stream number :meth:`CudaVmmDriver.copy_batch` enqueues on: the calling thread's
#: per-thread default stream, since ``cuMemcpyBatchAsync`` refuses the legacy default stream
#: (where ``memset`` and ``copy`` go). It is a blocking stream: a batch is ordered after the
#: work already on the legacy default stream and before what is enqueued there later, as a
#: ``copy`` is.
COPY_BATCH_STREAM = 2


def _is_wsl() -> bool:
    try:
        with open("/proc/version", encoding="utf-8", errors="replace") as version:
            return "microsoft" in version.read().lower()
    except OSError:
        return False


class CudaVmmDriver(CudaAllocation, CudaStreamWork, VmmDriver):
    """CUDA virtual memory management through ``cuda.bindings.driver``.

    Invariants:

    * Methods that take a ``device_index`` first make that device's primary context
      current on the calling thread (:meth:`ensure_context`); the others (``reserve``,
      ``map``, ``unmap``, ``release``, ``free_reserved``) act in the thread's current
      context, so callers make one current first.
    * Primary contexts are retained once per device and never released: they live as long
      as the process, as the runtime's own do.
    * The object holds no driver resources, so it needs no ``__del__``.
    * Thread-safe: the one shared instance serves every thread (contexts are made current
      per thread; retaining one is locked); callers serialize calls on the same allocation.
    """

    platform = "cuda"
    dlpack_device_type = K_DL_CUDA
    dlpack_host_device_type = K_DL_CUDA_HOST

    _UNPROBED: Any = object()

    def __init__(
        self, binding: Any = None, *, shareable: str = "posix", rdma: str | bool = False
    ) -> None:
        """``binding``: the driver-API module the methods call (default ``cuda.bindings.driver``,
        looked up when the driver is made; a HIP subclass passes its own).

        ``shareable``: the best handle type chunks are created with, so that other processes
        and hosts can map them. Chunks walk the chain fabric (``CU_MEM_HANDLE_TYPE_FABRIC``,
        with the POSIX descriptor too: multi-node NVLink, needs an IMEX channel) -> POSIX
        descriptor (``jaxbuf.sharing`` on one host) -> none, from ``shareable`` down,
        skipping what the device does not report and stepping down for good when
        ``cuMemCreate`` refuses one. ``"posix"`` is the default: fabric is opt-in (it
        matters across hosts only, and costs one refused ``cuMemCreate`` per device
        without IMEX); ``"none"`` asks for no shareable handle.
        ``rdma``: create chunks ``gpuDirectRDMACapable`` (NICs read and write them directly,
        as NIXL/UCX over InfiniBand need); opt-in like fabric: False (the default) never,
        ``"auto"`` where the device reports ``GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED``
        (dropped for good if ``cuMemCreate`` refuses it), True to require it.
        :meth:`allocation_options` reports what chunks get, and why not more.
        """
        cu = _cu if binding is None else binding
        self._init_allocation(cu, shareable, rdma)  # validates both before any state
        self._cu = cu
        if cu is not None:
            self._success = cu.CUresult.CUDA_SUCCESS
            self._not_supported = cu.CUresult.CUDA_ERROR_NOT_SUPPORTED
            # DLPack stream numbers (dlpack.h, __dlpack__): 1 is the legacy default stream,
            # 2 the per-thread default stream; any other value is a CUstream pointer. Both
            # constants equal their DLPack number today; spelled out so the mapping does not
            # rest on it.
            self._dlpack_streams = {1: cu.CU_STREAM_LEGACY, 2: cu.CU_STREAM_PER_THREAD}
            # Producer work (memset, copy, ready events) goes on the legacy default stream of
            # the device's primary context: it orders against every blocking stream, which is
            # what torch's and JAX's default streams are, so no framework stream needs to be
            # known here.
            self._producer_stream = cu.CUstream(0)
        self._unavailable_reason: Any = self._UNPROBED
        self._device_count = 0
        self._lock = threading.Lock()
        # device index -> (retained primary CUcontext, its address as an int).
        self._primary_contexts: dict[int, tuple[Any, int]] = {}
        # device indices (owner first, then peers) -> [CUmemAccessDesc], built once:
        # set_access is on the append path.
        self._access_descs: dict[tuple[int, ...], list[Any]] = {}
        # (device, peer) -> cuDeviceCanAccessPeer(device, peer).
        self._peer_access: dict[tuple[int, int], bool] = {}
        # host pointer -> device index of host_alloc, so host_free can pick the context.
        self._host_devices: dict[int, int] = {}
        self._confidential_computing_reason: Any = self._UNPROBED
        self._init_stream_work()

    # -- results -----------------------------------------------------------------------
    def _error_name(self, error: Any) -> str:
        """``CUDA_ERROR_...`` for a ``CUresult``, from the driver when it knows it."""
        try:
            status, name = self._cu.cuGetErrorName(error)
        except _LIBRARY_NOT_FOUND:  # libcuda not loadable: fall back to the enum's name
            status, name = None, None
        if status == self._success and name:
            return name.decode() if isinstance(name, bytes) else str(name)
        return getattr(error, "name", str(error))

    def _check(self, result: tuple, call: str, **sizes: Any) -> Any:
        """Unpack a binding result ``(CUresult, *values)``.

        Returns None, the one value, or the tuple of values; raises
        ``DriverError(call, error_name, **sizes)`` when the ``CUresult`` is not success.
        """
        error = result[0]
        if error != self._success:
            raise DriverError(call, self._error_name(error), **sizes)
        if len(result) == 1:
            return None
        if len(result) == 2:
            return result[1]
        return result[1:]

    # -- probing --------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """None when CUDA VMM works here, else one sentence saying why not. Cached."""
        if self._unavailable_reason is self._UNPROBED:
            self._unavailable_reason = self._probe()
        return self._unavailable_reason

    def _probe(self) -> str | None:
        if self._cu is None:
            return "cuda-bindings is not installed (pip install jaxbuf[cuda])."
        try:
            (error,) = self._cu.cuInit(0)
        except _LIBRARY_NOT_FOUND as exc:
            detail = str(exc).strip().rstrip(".")
            return f"No NVIDIA driver: libcuda could not be loaded ({detail})."
        if error != self._success:
            return f"cuInit failed with {self._error_name(error)}."
        error, count = self._cu.cuDeviceGetCount()
        if error != self._success:
            return f"cuDeviceGetCount failed with {self._error_name(error)}."
        if count == 0:
            return "No CUDA device is visible."
        attribute = (
            self._cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        )
        for index in range(count):
            error, supported = self._cu.cuDeviceGetAttribute(attribute, index)
            if error != self._success:
                return (
                    f"cuDeviceGetAttribute on device {index} failed with {self._error_name(error)}."
                )
            if not supported:
                return f"CUDA device {index} does not support virtual memory management."
        if _is_wsl():
            # WSL's CUDA lacks parts of VMM and mapped pinned memory that jaxbuf relies on.
            return "CUDA virtual memory management is not supported under WSL."
        self._device_count = count
        # cuInit has run, so the driver's entry points can be asked for. A stand-in binding
        # (a HIP subclass's, a test's) keeps every call in the binding.
        if self._cu is _CUDA_BINDINGS:
            self._calls = self._load_calls()
            if self._calls is not None:
                self._calls = self._with_memcpy_batch(self._calls)
        else:
            self.c_calls_reason = "the driver runs on a stand-in binding"
        return None

    def _with_memcpy_batch(self, calls: Any) -> Any:
        """``calls`` whose ``copy_batch`` makes one ``cuMemcpyBatchAsync`` per batch when the
        installed driver has it (CUDA 12.8+), else ``calls`` itself (a C loop of
        ``cuMemcpyAsync``).

        The symbol is asked for in the newest ABI the driver's version has (13.0's
        ``cuMemcpyBatchAsync_v2``, without ``failIdx``, else 12.8's), never a newer one (a
        driver refuses a version newer than itself with ``CUDA_ERROR_INVALID_VALUE``); C
        calls the pointer with the signature of the version it was asked for.
        """
        from jaxbuf.drivers._cuda_calls import MEMCPY_BATCH_SYMBOL, MEMCPY_BATCH_VERSIONS

        cu = self._cu
        error, driver_version = cu.cuDriverGetVersion()
        if error != self._success:
            return calls
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        for version in MEMCPY_BATCH_VERSIONS:  # newest first
            if version > driver_version:
                continue
            result = cu.cuGetProcAddress(MEMCPY_BATCH_SYMBOL.encode(), version, flags)
            if result[0] == self._success and int(result[1]):
                return calls.with_memcpy_batch(int(result[1]), version)
        return calls

    @property
    def copy_batch_method(self) -> str:
        """How :meth:`copy_batch` copies here, in words (probes CUDA)."""
        self.unavailable_reason()
        calls = self._calls
        if calls is None:
            return "cuMemcpyAsync per copy through cuda.bindings"
        if calls.memcpy_batch_version:
            return f"cuMemcpyBatchAsync (ABI {calls.memcpy_batch_version}) from C"
        return "cuMemcpyAsync per copy from C"

    def device_count(self) -> int:
        """Number of CUDA devices (0 when :meth:`unavailable_reason` is not None)."""
        self.unavailable_reason()
        return self._device_count

    def confidential_computing_reason(self) -> str | None:
        """A sentence when confidential computing is on (the GPU then cannot read pinned
        host memory in place, which UVA buffers need), else None. Cached.

        The CUDA driver API has no attribute for it, so NVML is asked: through
        ``cuda.bindings.nvml`` or ``pynvml`` (nvidia-ml-py), whichever imports. With
        neither, or when NVML fails, this returns None: the UVA probe tests access itself.
        """
        if self._confidential_computing_reason is self._UNPROBED:
            self._confidential_computing_reason = _probe_confidential_computing()
        return self._confidential_computing_reason

    # -- context --------------------------------------------------------------------
    def ensure_context(self, device_index: int) -> None:
        """Make ``device_index``'s primary context current on this thread.

        Fast when it already is: one ``cuCtxGetCurrent`` and an int compare (in C, with the
        driver's C calls).
        """
        cached = self._primary_contexts.get(device_index)
        if cached is not None:
            calls = self._calls
            if calls is not None:  # both calls in C (see _cuda_streams)
                error = calls.make_current(cached[1])
                if error:
                    self._raise_code(error, "cuCtxSetCurrent", device=device_index)
                return
            error, current = self._cu.cuCtxGetCurrent()
            if error == self._success and int(current) == cached[1]:
                return
            context = cached[0]
        else:
            context = self._retain_primary_context(device_index)
        self._check(self._cu.cuCtxSetCurrent(context), "cuCtxSetCurrent", device=device_index)

    def _retain_primary_context(self, device_index: int) -> Any:
        reason = self.unavailable_reason()
        if reason is not None:
            raise DriverError("ensure_context", f"CUDA unavailable: {reason}", device=device_index)
        if not isinstance(device_index, int) or not 0 <= device_index < self._device_count:
            raise IndexError(
                f"CUDA device index {device_index!r} out of range ({self._device_count} devices)"
            )
        with self._lock:  # two threads must not both retain (one retain would leak)
            cached = self._primary_contexts.get(device_index)
            if cached is None:
                device = self._check(
                    self._cu.cuDeviceGet(device_index), "cuDeviceGet", device=device_index
                )
                context = self._check(
                    self._cu.cuDevicePrimaryCtxRetain(device),
                    "cuDevicePrimaryCtxRetain",
                    device=device_index,
                )
                cached = (context, int(context))
                self._primary_contexts[device_index] = cached
        return cached[0]

    # -- batched copies -------------------------------------------------------------
    def copy_batch(self, dsts, srcs, sizes, device_index: int) -> Any:
        """The whole batch in one C call, enqueued on ``device_index``'s
        :data:`COPY_BATCH_STREAM` in its primary context: one ``cuMemcpyBatchAsync`` where
        the driver has it, else a loop of ``cuMemcpyAsync`` in C (a Python loop through
        cuda.bindings where the C calls are off; :attr:`copy_batch_method` says which).
        Returns a ``CUevent`` recorded after the copies (:meth:`record_event`), which the
        caller gives back with :meth:`destroy_event`. Copies of size 0 are skipped. See
        :meth:`VmmDriver.copy_batch` for the arrays and the failure contract.
        """
        calls, cached = self._calls, self._primary_contexts.get(device_index)
        if calls is None or cached is None:
            copy_batch_arguments(dsts, srcs, sizes)  # bad input changes nothing, first
            self.ensure_context(device_index)
            cached = self._primary_contexts[device_index]
        stream = self._dlpack_streams[COPY_BATCH_STREAM]
        if calls is not None:  # it checks the arrays itself, as copy_batch_arguments does
            failure = calls.copy_batch(cached[1], dsts, srcs, sizes, stream)
        else:
            count, *addresses = copy_batch_arguments(dsts, srcs, sizes)
            failure = 0
            for index, (dst, src, size) in enumerate(batch_triples(count, *addresses)):
                if size:
                    (error,) = self._cu.cuMemcpyAsync(dst, src, size, stream)
                    if error != self._success:
                        failure = ("cuMemcpyAsync", int(error), index)
                        break
        if failure:  # the arrays' addresses name the failed copy
            count, *addresses = copy_batch_arguments(dsts, srcs, sizes)
            self._raise_copy_batch(failure, count, addresses, device_index)
        try:
            return self.record_event(COPY_BATCH_STREAM, device_index)
        except BaseException as error:
            what = "waiting for the copies of the batch whose event failed"
            attempt(error, what, self.synchronize, device_index)
            raise

    def _raise_copy_batch(
        self, failure: tuple, count: int, addresses: list[int], device_index: int
    ) -> NoReturn:
        """Raise the DriverError of ``copy_batch``'s ``failure``, ``(call, CUresult, index)``,
        once no copy it enqueued is in flight (the device is synchronized)."""
        call, code, index = failure
        details: dict[str, Any] = {"count": count, "device": device_index}
        if 0 <= index < count:
            dst, src, size = (ctypes.c_uint64.from_address(a + 8 * index).value for a in addresses)
            details.update(index=index, dst=hex(dst), src=hex(src), size=size)
        error = self._code_error(code, call, **details)
        if call != "cuCtxSetCurrent":  # copies before the failed one may be enqueued
            what = "waiting for the copies enqueued before the failed one"
            attempt(error, what, self.synchronize, device_index)
        raise error

    # -- virtual memory -------------------------------------------------------------
    def reserve(self, size: int, alignment: int = 0) -> int:
        """``cuMemAddressReserve``: ``size`` bytes of address space, no memory behind it."""
        ptr = self._check(
            self._cu.cuMemAddressReserve(size, alignment, 0, 0),
            "cuMemAddressReserve",
            size=size,
            alignment=alignment,
        )
        return int(ptr)

    def free_reserved(self, ptr: int, size: int) -> None:
        self._check(
            self._cu.cuMemAddressFree(ptr, size), "cuMemAddressFree", ptr=hex(ptr), size=size
        )

    def create(self, size: int, device_index: int) -> Any:
        """``cuMemCreate``: one pinned chunk on ``device_index``; returns its
        ``CUmemGenericAllocationHandle``.

        On out-of-memory, the hooks of :data:`~jaxbuf.drivers.base.out_of_memory_hooks` are
        asked to return cached memory (frameworks already imported: torch empties its cache)
        and, when one did, the call is retried once.
        """
        self.ensure_context(device_index)
        try:
            return self._create(size, device_index)
        except DriverError as error:
            if not error.out_of_memory or not release_cached_memory(error):
                raise
        # A framework's cache release may have switched this thread's context.
        self.ensure_context(device_index)
        return self._create(size, device_index)

    def release(self, handle: Any) -> None:
        self._check(self._cu.cuMemRelease(handle), "cuMemRelease", handle=int(handle))

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self._check(self._cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap", ptr=hex(ptr), size=size)

    def unmap(self, ptr: int, size: int) -> None:
        self._check(self._cu.cuMemUnmap(ptr, size), "cuMemUnmap", ptr=hex(ptr), size=size)

    def export_handle(self, handle: Any) -> int:
        """``cuMemExportToShareableHandle`` as a POSIX file descriptor the caller owns.

        The chunk must have been created exportable: :meth:`create` asks for
        ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` where the device supports it; otherwise
        the driver reports ``CUDA_ERROR_INVALID_VALUE`` or ``CUDA_ERRORself._not_supported``."""
        fd = self._check(
            self._cu.cuMemExportToShareableHandle(
                handle,
                self._cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ),
            "cuMemExportToShareableHandle",
            handle=int(handle),
        )
        return int(fd)

    def import_handle(self, fd: int, size: int, device_index: int) -> Any:
        """``cuMemImportFromShareableHandle`` of a POSIX descriptor, in ``device_index``'s
        context (the chunk stays on the device that created it). The caller keeps ``fd``:
        the import takes its own reference to the allocation."""
        self.ensure_context(device_index)
        # cuda.bindings passes an int osHandle as the void* value itself, which is how
        # the driver wants a POSIX descriptor: (void *)(uintptr_t)fd.
        return self._check(
            self._cu.cuMemImportFromShareableHandle(
                fd, self._cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
            "cuMemImportFromShareableHandle",
            fd=fd,
            size=size,
            device=device_index,
        )

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        """``cuMemSetAccess`` read/write for ``device_index`` over whole mapped chunks."""
        self.set_access_many(ptr, size, (device_index,))

    def set_access_many(self, ptr: int, size: int, device_indices: Any) -> None:
        """One ``cuMemSetAccess`` granting read/write to every device of
        ``device_indices`` (an array of ``CUmemAccessDesc``, cached per device tuple).

        The first device's primary context is made current (the owner's, by convention).
        Peers must be able to access the owner (:meth:`can_access_peer`); the driver
        refuses a device that cannot (``CUDA_ERROR_INVALID_DEVICE``).
        """
        key = tuple(dict.fromkeys(int(index) for index in device_indices))
        if not key:
            raise ValueError("set_access_many needs at least one device index")
        descs = self._access_descs.get(key)
        if descs is None:
            descs = []
            for index in key:
                desc = self._cu.CUmemAccessDesc()
                desc.location.type = self._cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = index
                desc.flags = self._cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                descs.append(desc)
            self._access_descs[key] = descs
        self.ensure_context(key[0])
        devices: dict[str, Any] = {"device": key[0]} if len(key) == 1 else {"devices": list(key)}
        self._check(
            self._cu.cuMemSetAccess(ptr, size, descs, len(descs)),
            "cuMemSetAccess",
            ptr=hex(ptr),
            size=size,
            **devices,
        )

    def can_access_peer(self, device_index: int, peer_index: int) -> bool:
        """``cuDeviceCanAccessPeer(device_index, peer_index)``: whether ``device_index``
        can access memory that lives on ``peer_index``. Cached per ordered pair."""
        if device_index == peer_index:
            return True
        key = (device_index, peer_index)
        allowed = self._peer_access.get(key)
        if allowed is None:
            allowed = bool(
                self._check(
                    self._cu.cuDeviceCanAccessPeer(device_index, peer_index),
                    "cuDeviceCanAccessPeer",
                    device=device_index,
                    peer=peer_index,
                )
            )
            self._peer_access[key] = allowed
        return allowed

    # -- pinned host memory ---------------------------------------------------------
    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        """``cuMemHostAlloc`` (mapped, portable) and ``cuMemHostGetDevicePointer``.
        Returns ``(host_ptr, device_ptr)`` as ints."""
        self.ensure_context(device_index)
        flags = self._cu.CU_MEMHOSTALLOC_DEVICEMAP | self._cu.CU_MEMHOSTALLOC_PORTABLE
        host_ptr = int(
            self._check(
                self._cu.cuMemHostAlloc(size, flags),
                "cuMemHostAlloc",
                size=size,
                device=device_index,
            )
        )
        try:
            device_ptr = self._check(
                self._cu.cuMemHostGetDevicePointer(host_ptr, 0),
                "cuMemHostGetDevicePointer",
                host_ptr=hex(host_ptr),
                device=device_index,
            )
        except DriverError:
            self._cu.cuMemFreeHost(host_ptr)  # nothing half-done; the lookup error is reported
            raise
        self._host_devices[host_ptr] = device_index
        return host_ptr, int(device_ptr)

    def host_free(self, host_ptr: int) -> None:
        # Forget the block *before* freeing it: once freed, another thread's host_alloc may
        # get the same address, and its record must not be dropped by this call.
        device_index = self._host_devices.pop(host_ptr, None)
        try:
            if device_index is not None:
                # cuMemFreeHost needs a context; the caller's thread may have none.
                self.ensure_context(device_index)
            self._check(self._cu.cuMemFreeHost(host_ptr), "cuMemFreeHost", host_ptr=hex(host_ptr))
        except BaseException:
            if device_index is not None:
                self._host_devices[host_ptr] = device_index  # not freed: still ours
            raise


def _probe_confidential_computing() -> str | None:
    enabled = None
    try:
        from cuda.bindings import nvml

        nvml.init_v2()
        try:
            # NVML_CC_SYSTEM_FEATURE_ENABLED == 1
            enabled = int(nvml.system_get_conf_compute_state().cc_feature) == 1
        finally:
            nvml.shutdown()
    except Exception:  # noqa: BLE001
        # A probe, not cleanup: older cuda-bindings lack the nvml module or call, or NVML
        # is absent or fails (ImportError, AttributeError, NvmlError, RuntimeError from
        # the loader). Try nvidia-ml-py; any failure means "unknown", never a crash.
        enabled = None
    if enabled is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                state = pynvml.nvmlSystemGetConfComputeState()
                enabled = int(state.ccFeature) == pynvml.NVML_CC_SYSTEM_FEATURE_ENABLED
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - as above: unknown, not fatal
            enabled = None
    if enabled:
        return "Confidential computing is enabled: the GPU cannot read pinned host memory in place."
    return None
