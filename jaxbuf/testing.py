"""Test utilities: a driver that fails chosen calls and tracks what is live.

:class:`FaultInjectingDriver` wraps any :class:`~jaxbuf.drivers.base.VmmDriver` (the CPU
driver, the CUDA driver) and delegates every call to it, after

* counting the call (per kind, and one global index over all kinds);
* failing it, when armed, with a :class:`~jaxbuf.drivers.base.DriverError` named like the
  real call (``cuMemCreate`` on CUDA, ``memfd_create`` on the CPU, error name
  ``INJECTED_FAULT``), raised *before* delegating, so the failed call has no effect, as a
  real driver failure has none;
* recording the live state the call changes: physical handles, reservations, mapped chunks,
  access grants, pinned host allocations and events.

:meth:`FaultInjectingDriver.check_invariants` checks the VMM rules the CUDA driver enforces
(nothing mapped without access, access over whole mapped chunks, no map over a mapping, no
release of an unknown handle, nothing mapped in a reservation being freed, ...), and
:meth:`FaultInjectingDriver.assert_clean` that nothing is left (no live handle, reservation or
pinned allocation).

Only stdlib and jaxbuf are imported; the module is public, for jaxbuf's tests and for
programs that build on jaxbuf and want to test their own error paths.

Examples
--------
>>> from jaxbuf.drivers import DriverError, get_vmm_driver
>>> from jaxbuf.extensible import ExtensibleTensor
>>> from jaxbuf.testing import FaultInjectingDriver
>>> driver = FaultInjectingDriver(get_vmm_driver("cpu"))
>>> buf = ExtensibleTensor(8 << 20, device="cpu", driver=driver)
>>> driver.fail_on("map")
>>> try:
...     buf.resize_per_segment_(4096)
... except DriverError as error:
...     print(error.call, error.error_name)
mmap INJECTED_FAULT
>>> driver.check_invariants()
>>> buf.resize_per_segment_(4096)  # the fault fired once; a retry succeeds
>>> buf.free()
>>> driver.assert_clean()
>>> driver.faults_injected
1
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxbuf._driver_books import Books, leftovers, problems, within
from jaxbuf.drivers.base import DriverError, VmmDriver

__all__ = ["FAULT_KINDS", "DriverCall", "FaultInjectingDriver", "InjectedFault", "InvariantError"]

#: Every kind of call the driver counts and can fail, in :class:`VmmDriver` order.
FAULT_KINDS = (
    "ensure_context",
    "granularity",
    "reserve",
    "free_reserved",
    "create",
    "release",
    "map",
    "unmap",
    "set_access",
    "move_mapping",
    "export_handle",
    "import_handle",
    "memset",
    "copy",
    "synchronize",
    "record_ready_event",
    "stream_wait_event",
    "destroy_event",
    "record_event",
    "event_query",
    "event_synchronize",
    "copy_batch",
    "copy_on_stream",
    "launch_kernel",
    "host_alloc",
    "host_free",
)

# The name of the platform call each kind stands for, per platform.
_CALL_NAMES = {
    "cuda": {
        "ensure_context": "cuCtxSetCurrent",
        "granularity": "cuMemGetAllocationGranularity",
        "reserve": "cuMemAddressReserve",
        "free_reserved": "cuMemAddressFree",
        "create": "cuMemCreate",
        "release": "cuMemRelease",
        "map": "cuMemMap",
        "unmap": "cuMemUnmap",
        "set_access": "cuMemSetAccess",
        "move_mapping": "cuMemMap",
        "export_handle": "cuMemExportToShareableHandle",
        "import_handle": "cuMemImportFromShareableHandle",
        "memset": "cuMemsetD8Async",
        "copy": "cuMemcpyAsync",
        "synchronize": "cuCtxSynchronize",
        "record_ready_event": "cuEventRecord",
        "stream_wait_event": "cuStreamWaitEvent",
        "destroy_event": "cuEventDestroy",
        "record_event": "cuEventRecord",
        "event_query": "cuEventQuery",
        "event_synchronize": "cuEventSynchronize",
        "copy_on_stream": "cuMemcpyAsync",
        "launch_kernel": "cuLaunchKernel",
        "host_alloc": "cuMemHostAlloc",
        "host_free": "cuMemFreeHost",
        "copy_batch": "cuMemcpyBatchAsync",
    },
    # The CPU driver names its calls after libc's; the rest keep the kind's own name.
    "cpu": {kind: kind for kind in FAULT_KINDS}
    | {"reserve": "mmap", "free_reserved": "munmap", "create": "memfd_create", "release": "close"}
    | {"map": "mmap", "unmap": "mmap", "move_mapping": "mremap", "export_handle": "dup"}
    | {"import_handle": "dup", "copy": "memmove", "host_alloc": "mmap", "host_free": "munmap"},
}


class InvariantError(AssertionError):
    """:meth:`FaultInjectingDriver.check_invariants` or ``assert_clean`` found a problem."""


class _SimulatedEvent:
    """Stands in for an event on a platform without asynchronous work (the CPU), so the
    event bookkeeping of the buffer layer (record, wait, destroy) is exercised there too."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<simulated event {id(self):#x}>"


class InjectedFault(NamedTuple):
    """One fault that fired: what :attr:`FaultInjectingDriver.injected` lists. The error
    itself is not kept (its traceback would keep the objects of the failed call alive)."""

    kind: str
    call_index: int
    message: str


class DriverCall(NamedTuple):
    """One call in :attr:`FaultInjectingDriver.log` (kept with ``record_calls=True``).

    ``kind`` is a :data:`FAULT_KINDS` name, or ``"set_access_many"``: that call is logged
    (with ``devices``) but not counted, since it is made of one counted, faultable
    ``set_access`` per device, logged after it. ``call_index`` is the global index of a
    counted call (None for ``set_access_many``); ``args`` are the call's details, pointers as
    hex strings, as in an injected error's message. A call that failed is logged too.
    """

    kind: str
    call_index: int | None
    args: dict[str, Any]


class _Fault:
    __slots__ = ("kind", "nth", "error")

    def __init__(self, kind: str | None, nth: int, error: Any) -> None:
        self.kind = kind  # None: nth is a global call index
        self.nth = nth
        self.error = error


class FaultInjectingDriver(VmmDriver):
    """A :class:`VmmDriver` that delegates to ``inner``, counts calls, fails armed ones and
    tracks live state.

    Parameters
    ----------
    inner : VmmDriver
        The driver doing the work (``get_vmm_driver("cpu")``, ``CudaVmmDriver()``, ...).
    record_calls : bool
        Keep every call in :attr:`log` (default False: a long run keeps nothing).
    simulate_events : bool
        When ``inner`` returns no event (the CPU driver), return a stand-in object from
        ``record_ready_event`` / ``record_event`` instead of None, and handle the event calls
        on stand-ins here (never passing them to ``inner``), so event lifetimes are tracked
        and faultable on the CPU as on CUDA. Default False: exactly ``inner``'s behaviour.

    Attributes
    ----------
    calls : collections.Counter
        Calls made so far, per kind (failed ones included).
    call_count : int
        Calls made so far over all kinds; the next call has global index ``call_count``.
    faults_injected : int
        Faults that fired on this driver. ``FaultInjectingDriver.total_faults_injected``
        sums over every instance of the process.
    injected : list of InjectedFault
        The faults that fired, in order: ``(kind, call_index, message)``.
    violations : list of str
        Protocol errors seen at call time (release of an unknown handle, ...); also raised by
        :meth:`check_invariants`.
    log : list of DriverCall
        Every call in order, when ``record_calls`` (empty otherwise); clear it at will.

    Counted kinds are :data:`FAULT_KINDS`; ``unavailable_reason`` and ``device_count`` are
    passed through uncounted. Not thread-safe.
    """

    total_faults_injected = 0

    def __init__(
        self, inner: VmmDriver, *, simulate_events: bool = False, record_calls: bool = False
    ) -> None:
        if not isinstance(inner, VmmDriver):
            raise TypeError(f"inner must be a VmmDriver, got {inner!r}")
        self.inner = inner
        self.platform = inner.platform
        self.dlpack_device_type = inner.dlpack_device_type
        self.dlpack_host_device_type = inner.dlpack_host_device_type
        self.host_alloc_zeroed = inner.host_alloc_zeroed
        self.simulate_events = bool(simulate_events)
        self._names = _CALL_NAMES.get(inner.platform, _CALL_NAMES["cpu"])
        self.calls: collections.Counter[str] = collections.Counter()
        self.call_count = 0
        self.faults_injected = 0
        self.injected: list[InjectedFault] = []
        self.violations: list[str] = []
        self.record_calls = bool(record_calls)
        self.log: list[DriverCall] = []
        self._faults: list[_Fault] = []
        # Live state. Handles and events are keyed by id() and the object is kept, so an id
        # cannot be reused while it is tracked.
        self.created = 0
        self.released = 0
        self.live_handles: dict[int, Any] = {}
        self.reservations: dict[int, int] = {}  # base -> size
        self.mapped: dict[int, list] = {}  # ptr -> [size, handle, accessible]
        self.pinned: dict[int, int] = {}  # host_ptr -> size
        self.live_events: dict[int, Any] = {}

    def __repr__(self) -> str:
        return (
            f"FaultInjectingDriver({self.inner!r}, calls={self.call_count}, "
            f"faults_injected={self.faults_injected})"
        )

    # -- arming ------------------------------------------------------------------------------
    def fail_on(self, kind: str, nth: int = 1, error: Any = None) -> None:
        """Fail the ``nth`` call of ``kind`` from now on (1: the next one).

        ``error``: None for a :class:`DriverError` named like the real call, an exception
        instance to raise, or a callable ``(kind) -> exception``. Several faults may be armed
        at once; each fires once.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        if isinstance(nth, bool) or not isinstance(nth, int) or nth < 1:
            raise ValueError(f"nth must be a positive int, got {nth!r}")
        self._faults.append(_Fault(kind, self.calls[kind] + nth, error))

    def fail_at(self, global_call_index: int, error: Any = None) -> None:
        """Fail the call whose global index (0-based, over all kinds, since construction) is
        ``global_call_index``; ``call_count`` is the index of the next call."""
        if isinstance(global_call_index, bool) or not isinstance(global_call_index, int):
            raise TypeError(f"global_call_index must be an int, got {global_call_index!r}")
        if global_call_index < self.call_count:
            raise ValueError(
                f"call {global_call_index} already happened (call_count={self.call_count})"
            )
        self._faults.append(_Fault(None, global_call_index, error))

    def disarm(self) -> None:
        """Drop every armed fault that has not fired."""
        self._faults.clear()

    @property
    def armed(self) -> int:
        """Number of armed faults that have not fired yet."""
        return len(self._faults)

    def _enter(self, kind: str, **details: Any) -> None:
        index = self.call_count
        self.call_count += 1
        self.calls[kind] += 1
        if self.record_calls:
            self.log.append(DriverCall(kind, index, details))
        if not self._faults:
            return
        count = self.calls[kind]
        for fault in self._faults:
            if (fault.kind == kind and fault.nth == count) or (
                fault.kind is None and fault.nth == index
            ):
                self._faults.remove(fault)
                error = fault.error
                if error is None:
                    error = DriverError(
                        self._names[kind], "INJECTED_FAULT", kind=kind, call_index=index, **details
                    )
                elif callable(error) and not isinstance(error, BaseException):
                    error = error(kind)
                self.faults_injected += 1
                FaultInjectingDriver.total_faults_injected += 1
                self.injected.append(InjectedFault(kind, index, str(error)))
                raise error

    # -- checks ------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every broken invariant, as sentences (empty when all hold)."""
        return problems(self._books())

    def _books(self) -> Books:
        """A copy of the books that no driver call changed while it was taken.

        Judging allocates, so a garbage collection may run during a check, and a finalizer
        there (a buffer dropped in a reference cycle, released) makes driver calls. Books read
        partly before that release and partly after it describe a state the memory was never
        in (a chunk still mapped, its handle and reservation already gone), so the check
        judges a copy, taken again when a driver call came between its parts (each part is
        one C call that runs no finalizer once it has started copying).
        """
        while True:
            calls = self.call_count
            books = Books(
                list(self.violations),
                self.created,
                self.released,
                dict(self.live_handles),
                dict(self.reservations),
                dict(self.mapped),
                dict(self.pinned),
            )
            if self.call_count == calls:
                return books

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` listing every broken invariant."""
        found = self.problems()
        if found:
            raise InvariantError("; ".join(found))

    def assert_clean(self) -> None:
        """:meth:`check_invariants`, and no live handle, reservation or pinned allocation
        (events are reported by ``live_events``, not checked here)."""
        found = leftovers(self._books())
        if found:
            raise InvariantError("; ".join(found))

    def mapped_bytes(self, ptr: int | None = None, size: int | None = None) -> int:
        """Bytes of the chunks mapped within ``[ptr, ptr + size)`` (everywhere when None)."""
        if ptr is None:
            return sum(s for s, _, _ in self.mapped.values())
        return sum(s for p, (s, _, _) in self.mapped.items() if ptr <= p < ptr + size)

    def _in_reservation(self, ptr: int, size: int) -> bool:
        return within(self.reservations, ptr, size)

    # -- probing (uncounted) -----------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        return self.inner.unavailable_reason()

    def device_count(self) -> int:
        return self.inner.device_count()

    def __getattr__(self, name: str) -> Any:
        # Driver-specific extras (confidential_computing_reason, ...) pass through.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- context and granularity -------------------------------------------------------------
    def ensure_context(self, device_index: int) -> None:
        self._enter("ensure_context", device=device_index)
        self.inner.ensure_context(device_index)

    def granularity(self, device_index: int) -> int:
        self._enter("granularity", device=device_index)
        return self.inner.granularity(device_index)

    # -- virtual memory ----------------------------------------------------------------------
    def reserve(self, size: int, alignment: int = 0) -> int:
        self._enter("reserve", size=size, alignment=alignment)
        ptr = self.inner.reserve(size, alignment)
        self.reservations[ptr] = size
        return ptr

    def free_reserved(self, ptr: int, size: int) -> None:
        self._enter("free_reserved", ptr=hex(ptr), size=size)
        if self.reservations.get(ptr) != size:
            self.violations.append(f"free_reserved({ptr:#x}, {size}) is not a live reservation")
        if self.mapped_bytes(ptr, size):
            self.violations.append(f"free_reserved({ptr:#x}) with chunks still mapped")
        self.inner.free_reserved(ptr, size)
        self.reservations.pop(ptr, None)

    def create(self, size: int, device_index: int) -> Any:
        self._enter("create", size=size, device=device_index)
        handle = self.inner.create(size, device_index)
        self.created += 1
        self.live_handles[id(handle)] = handle
        return handle

    def release(self, handle: Any) -> None:
        self._enter("release")
        if id(handle) not in self.live_handles:
            self.violations.append("release of an unknown or already released handle")
        self.inner.release(handle)
        if self.live_handles.pop(id(handle), None) is not None:
            self.released += 1

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self._enter("map", ptr=hex(ptr), size=size)
        if id(handle) not in self.live_handles:
            self.violations.append(f"map at {ptr:#x} of an unknown or released handle")
        if not self._in_reservation(ptr, size):
            self.violations.append(f"map at {ptr:#x} ({size} bytes) outside every reservation")
        for p, (s, _, _) in self.mapped.items():
            if p < ptr + size and ptr < p + s:
                self.violations.append(f"map at {ptr:#x} over the chunk mapped at {p:#x}")
        self.inner.map(ptr, size, handle)
        self.mapped[ptr] = [size, handle, False]

    def unmap(self, ptr: int, size: int) -> None:
        self._enter("unmap", ptr=hex(ptr), size=size)
        entry = self.mapped.get(ptr)
        if entry is None or entry[0] != size:
            self.violations.append(f"unmap({ptr:#x}, {size}) is not one whole mapped chunk")
        self.inner.unmap(ptr, size)
        self.mapped.pop(ptr, None)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self._enter("set_access", ptr=hex(ptr), size=size)
        # CUDA: the range must be made of whole mapped chunks, with no hole.
        cursor, covered = ptr, []
        while cursor < ptr + size:
            entry = self.mapped.get(cursor)
            if entry is None:
                self.violations.append(
                    f"set_access over [{ptr:#x}, +{size}) reaches unmapped {cursor:#x}"
                )
                break
            covered.append(entry)
            cursor += entry[0]
        else:
            if cursor != ptr + size:
                self.violations.append(f"set_access over [{ptr:#x}, +{size}) splits a chunk")
        self.inner.set_access(ptr, size, device_index)
        for entry in covered:
            entry[2] = True

    def set_access_many(self, ptr: int, size: int, device_indices: Any) -> None:
        # The base class's default: one counted ``set_access`` per device, so each grant can
        # fail on its own. Only logged here, so a test sees which calls were grouped.
        if self.record_calls:
            args = {"ptr": hex(ptr), "size": size, "devices": tuple(device_indices)}
            self.log.append(DriverCall("set_access_many", None, args))
        super().set_access_many(ptr, size, device_indices)

    def can_access_peer(self, device_index: int, peer_index: int) -> bool:
        return self.inner.can_access_peer(device_index, peer_index)

    def move_mapping(self, handle: Any, src_ptr: int, dst_ptr: int, size: int) -> None:
        self._enter("move_mapping", src=hex(src_ptr), dst=hex(dst_ptr), size=size)
        entry = self.mapped.get(src_ptr)
        if entry is None or entry[0] != size or entry[1] is not handle:
            self.violations.append(f"move_mapping from {src_ptr:#x}: not that chunk's mapping")
        if not self._in_reservation(dst_ptr, size) or self.mapped_bytes(dst_ptr, size):
            self.violations.append(f"move_mapping to {dst_ptr:#x}: not free reserved space")
        self.inner.move_mapping(handle, src_ptr, dst_ptr, size)
        self.mapped.pop(src_ptr, None)
        # The contract: access must be granted again at the new address.
        self.mapped[dst_ptr] = [size, handle, False]

    def export_handle(self, handle: Any) -> int:
        self._enter("export_handle")
        if id(handle) not in self.live_handles:
            self.violations.append("export_handle of an unknown or released handle")
        return self.inner.export_handle(handle)

    def import_handle(self, fd: int, size: int, device_index: int) -> Any:
        self._enter("import_handle", fd=fd, size=size, device=device_index)
        handle = self.inner.import_handle(fd, size, device_index)
        self.created += 1
        self.live_handles[id(handle)] = handle
        return handle

    # -- work on the memory ------------------------------------------------------------------
    def memset(self, ptr: int, value: int, size: int, device_index: int) -> None:
        self._enter("memset", ptr=hex(ptr), size=size)
        self.inner.memset(ptr, value, size, device_index)

    def copy(self, dst: int, src: int, size: int, device_index: int) -> None:
        self._enter("copy", dst=hex(dst), src=hex(src), size=size)
        self.inner.copy(dst, src, size, device_index)

    def copy_batch(self, dsts: Any, srcs: Any, sizes: Any, device_index: int) -> Any:
        # One counted call for the whole batch, as the drivers make it; the event it returns
        # (CUDA, or a stand-in with simulate_events) is tracked like a recorded one.
        self._enter("copy_batch", count=len(sizes) if hasattr(sizes, "__len__") else sizes)
        return self._track_event(self.inner.copy_batch(dsts, srcs, sizes, device_index))

    def synchronize(self, device_index: int) -> None:
        self._enter("synchronize", device=device_index)
        self.inner.synchronize(device_index)

    def memory_info(self, device_index: int) -> Any:
        return self.inner.memory_info(device_index)  # a probe: uncounted

    def _track_event(self, event: Any) -> Any:
        if event is None and self.simulate_events:
            event = _SimulatedEvent()
        if event is not None:
            self.live_events[id(event)] = event
        return event

    def record_ready_event(self, device_index: int) -> Any:
        self._enter("record_ready_event", device=device_index)
        return self._track_event(self.inner.record_ready_event(device_index))

    def record_event(self, stream: int, device_index: int) -> Any:
        self._enter("record_event", stream=stream, device=device_index)
        return self._track_event(self.inner.record_event(stream, device_index))

    def _check_event(self, call: str, event: Any) -> bool:
        """Whether ``event`` goes to ``inner`` (False for a simulated one)."""
        if id(event) not in self.live_events:
            self.violations.append(f"{call} of an unknown or destroyed event")
        return not isinstance(event, _SimulatedEvent)

    def stream_wait_event(self, stream: int, event: Any, device_index: int) -> None:
        self._enter("stream_wait_event", stream=stream)
        if self._check_event("stream_wait_event", event):
            self.inner.stream_wait_event(stream, event, device_index)

    def destroy_event(self, event: Any) -> None:
        self._enter("destroy_event")
        if self._check_event("destroy_event", event):
            self.inner.destroy_event(event)
        self.live_events.pop(id(event), None)

    def event_query(self, event: Any) -> bool:
        self._enter("event_query")
        if self._check_event("event_query", event):
            return self.inner.event_query(event)
        return True

    def event_synchronize(self, event: Any) -> None:
        self._enter("event_synchronize")
        if self._check_event("event_synchronize", event):
            self.inner.event_synchronize(event)

    # -- a staged apply's copy and launch -------------------------------------------------
    # copy_and_launch is not wrapped: the base class's makes these calls (and ensure_context)
    # in turn through this wrapper, so each can fail on its own.
    def copy_on_stream(self, dst: int, src: int, size: int, stream: Any) -> None:
        self._enter("copy_on_stream", dst=hex(dst), src=hex(src), size=size, stream=stream)
        self.inner.copy_on_stream(dst, src, size, stream)

    def launch_kernel(self, function, grid, block, shared, stream, args) -> None:
        self._enter("launch_kernel", grid=grid, block=block, stream=stream)
        self.inner.launch_kernel(function, grid, block, shared, stream, args)

    # -- pinned host memory ------------------------------------------------------------------
    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        self._enter("host_alloc", size=size, device=device_index)
        host_ptr, device_ptr = self.inner.host_alloc(size, device_index)
        self.pinned[host_ptr] = size
        return host_ptr, device_ptr

    def host_free(self, host_ptr: int) -> None:
        self._enter("host_free", host_ptr=hex(host_ptr))
        if host_ptr not in self.pinned:
            self.violations.append(f"host_free({host_ptr:#x}) of an unknown allocation")
        self.inner.host_free(host_ptr)
        self.pinned.pop(host_ptr, None)

    # -- sweeping ----------------------------------------------------------------------------
    def count_calls(self, operation: Callable[[], Any]) -> int:
        """Run ``operation`` unfaulted and return how many driver calls it made."""
        before = self.call_count
        operation()
        return self.call_count - before
