"""The CUDA driver's work on the memory: copies, memsets, events and kernel launches, each
ordered on a stream (a mixin of :class:`jaxbuf.drivers.cuda.CudaVmmDriver`).

Producer work (memset, copy, ready events) goes on the legacy default stream of the device's
primary context; consumer work (a staged apply's copy and launch, its event) on the stream the
caller names. The methods use the driver's binding (``self._cu``), ``_check`` and
``ensure_context``.

The calls a staged apply makes (context check, event query, copy, launch, event record) go
through ``self._calls``, a :class:`jaxbuf.drivers._cuda_calls.EntryPoints` over the driver's
own function pointers (``cuGetProcAddress``), when the C extension is built and the driver
is the real one: cuda.bindings' argument and result conversions cost 1-3 µs a call on an
H200 host, as much as the driver's work. The context check, copy and launch go as one call
(:meth:`CudaStreamWork.copy_and_launch`). ``c_calls_reason`` says why they are not used.
"""

from __future__ import annotations

from typing import Any, NoReturn

from jaxbuf.drivers.base import DriverError, settle_failed_launch

__all__ = ["MAX_SPARE_EVENTS", "CudaStreamWork"]

#: Events a driver keeps per device for reuse (see :meth:`CudaStreamWork.destroy_event`).
MAX_SPARE_EVENTS = 64


class CudaStreamWork:
    """Copies, events and launches for :class:`~jaxbuf.drivers.cuda.CudaVmmDriver`."""

    _cu: Any
    _success: Any
    _producer_stream: Any
    _dlpack_streams: dict[int, Any]
    _primary_contexts: dict[int, tuple[Any, int]]

    def _init_stream_work(self) -> None:
        # Events given back by destroy_event, per device (an event belongs to its context),
        # for record_event to reuse: cuEventCreate + cuEventDestroy cost as much as the
        # record itself, and every staged apply records one. int(event) -> device index.
        self._spare_events: dict[int, list[Any]] = {}
        self._event_devices: dict[int, int] = {}
        # DLPack stream number -> CUstream, built once per stream (an apply records on one).
        self._stream_handles: dict[int, Any] = {}
        # Raw CUstream handle (0: legacy) -> CUstream, for copy_on_stream.
        self._raw_stream_handles: dict[int, Any] = {}
        # The hot calls in C (set once CUDA is probed), or None; and why not, when None.
        self._calls: Any = None
        self.c_calls_reason: str | None = "CUDA is not probed yet"
        self._not_ready = -1

    def _load_calls(self) -> Any:
        """An ``EntryPoints`` over the driver's pointers for ``_cuda_calls.SYMBOLS``, or None
        (then ``c_calls_reason`` says why). Needs cuInit to have run."""
        try:
            from jaxbuf.drivers._cuda_calls import CUDA_VERSION, SYMBOLS, EntryPoints
        except ImportError as error:
            self.c_calls_reason = f"the C extension is not built ({error})"
            return None
        cu = self._cu
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        addresses = []
        for name in SYMBOLS:
            try:
                result = cu.cuGetProcAddress(name.encode(), CUDA_VERSION, flags)
            except Exception as error:  # an older binding's signature: keep the bindings
                self.c_calls_reason = f"cuGetProcAddress({name}) raised {error!r}"
                return None
            if result[0] != self._success or not int(result[1]):
                self.c_calls_reason = f"cuGetProcAddress({name}) gave {result[:2]}"
                return None
            addresses.append(int(result[1]))
        self._not_ready = int(cu.CUresult.CUDA_ERROR_NOT_READY)
        self.c_calls_reason = None
        return EntryPoints(addresses)

    def _raise_code(self, code: int, call: str, **sizes: Any) -> NoReturn:
        """Raise the DriverError for the CUresult ``code`` a C call returned."""
        raise self._code_error(code, call, **sizes)

    def _code_error(self, code: int, call: str, **sizes: Any) -> DriverError:
        """The DriverError for the CUresult ``code`` a C call returned."""
        try:
            error = self._cu.CUresult(code)
        except ValueError:  # a code this binding's enum does not know
            return DriverError(call, f"CUresult {code}", **sizes)
        return DriverError(call, self._error_name(error), **sizes)

    def memset(self, ptr: int, value: int, size: int, device_index: int) -> None:
        """``cuMemsetD8Async`` on the legacy default stream."""
        self.ensure_context(device_index)
        self._check(
            self._cu.cuMemsetD8Async(ptr, value, size, self._producer_stream),
            "cuMemsetD8Async",
            ptr=hex(ptr),
            value=value,
            size=size,
            device=device_index,
        )

    def copy(self, dst: int, src: int, size: int, device_index: int) -> None:
        """``cuMemcpyAsync`` on the legacy default stream (unified addressing: any two
        device or mapped-host pointers)."""
        self.ensure_context(device_index)
        self._check(
            self._cu.cuMemcpyAsync(dst, src, size, self._producer_stream),
            "cuMemcpyAsync",
            dst=hex(dst),
            src=hex(src),
            size=size,
            device=device_index,
        )

    def copy_on_stream(self, dst: int, src: int, size: int, stream: Any) -> None:
        """``cuMemcpyAsync`` on the raw ``stream`` handle, in the current context."""
        calls = self._calls
        if calls is not None:
            error = calls.copy(dst, src, size, stream)
            if error:
                self._raise_code(error, "cuMemcpyAsync", dst=hex(dst), src=hex(src), size=size)
            return
        handle = self._raw_stream_handles.get(stream)
        if handle is None:
            handle = self._raw_stream_handles[stream] = self._cu.CUstream(stream)
            if len(self._raw_stream_handles) > MAX_SPARE_EVENTS:
                self._raw_stream_handles.clear()
        result = self._cu.cuMemcpyAsync(dst, src, size, handle)
        if result[0] != self._success:
            self._check(result, "cuMemcpyAsync", dst=hex(dst), src=hex(src), size=size)

    def synchronize(self, device_index: int) -> None:
        self.ensure_context(device_index)
        self._check(self._cu.cuCtxSynchronize(), "cuCtxSynchronize", device=device_index)

    def memory_info(self, device_index: int) -> tuple[int, int]:
        """``cuMemGetInfo``: ``(free_bytes, total_bytes)`` of ``device_index``."""
        self.ensure_context(device_index)
        free, total = self._check(self._cu.cuMemGetInfo(), "cuMemGetInfo", device=device_index)
        return int(free), int(total)

    def stream_wait_event(self, stream: int, event: Any, device_index: int) -> None:
        """Make the consumer ``stream`` wait for ``event``.

        ``stream`` is a DLPack stream number: 1 the legacy default stream, 2 the
        per-thread default stream, else a ``CUstream`` address. 0 is ambiguous for CUDA
        and is refused, as DLPack says.
        """
        if not isinstance(stream, int) or stream <= 0:
            raise ValueError(
                f"invalid CUDA stream {stream!r} for DLPack: expected 1, 2 or a stream handle"
            )
        handle = self._cu.CUstream(self._dlpack_streams.get(stream, stream))
        self.ensure_context(device_index)
        self._check(
            self._cu.cuStreamWaitEvent(handle, event, 0),
            "cuStreamWaitEvent",
            stream=hex(stream),
            device=device_index,
        )

    def destroy_event(self, event: Any) -> None:
        """Give back an event from :meth:`record_event`: kept (up to
        :data:`MAX_SPARE_EVENTS` per device) for the next record, else destroyed. Nobody
        holds it any more, so recording it again later changes nothing anyone waits on."""
        spare = self._spare_events.get(self._event_devices.get(int(event), -1))
        if spare is not None and len(spare) < MAX_SPARE_EVENTS:
            spare.append(event)
            return
        self._event_devices.pop(int(event), None)
        self._check(self._cu.cuEventDestroy(event), "cuEventDestroy")

    def record_event(self, stream: int, device_index: int) -> Any:
        """A ``CUevent`` (timing disabled) recorded on the consumer ``stream`` (a DLPack
        stream number, as in :meth:`stream_wait_event`). The caller gives it back with
        :meth:`destroy_event`."""
        if not isinstance(stream, int) or stream <= 0:
            raise ValueError(f"invalid CUDA stream {stream!r}: expected 1, 2 or a stream handle")
        handle = self._stream_handles.get(stream)
        if handle is None:
            handle = self._cu.CUstream(self._dlpack_streams.get(stream, stream))
            if len(self._stream_handles) >= MAX_SPARE_EVENTS:
                self._stream_handles.clear()
            self._stream_handles[stream] = handle
        calls, cached = self._calls, self._primary_contexts.get(device_index)
        spare = self._spare_events.get(device_index)
        if spare and calls is not None and cached is not None:
            # The hot path (every staged apply): a spare event, the context check and the
            # record in one C call.
            event = spare.pop()
            failure = calls.record_in(cached[1], event, handle)
            if failure:
                self.destroy_event(event)
                call, code = failure
                self._raise_code(code, call, stream=hex(stream), device=device_index)
            return event
        self.ensure_context(device_index)
        try:
            event = spare.pop()  # type: ignore[union-attr]
        except (AttributeError, IndexError):  # no spare list yet, or none spare
            event = self._new_event(device_index)
        if calls is not None:
            error = calls.record(event, handle)
            if error:
                self.destroy_event(event)
                self._raise_code(error, "cuEventRecord", stream=hex(stream))
            return event
        (error,) = self._cu.cuEventRecord(event, handle)
        if error != self._success:
            self.destroy_event(event)  # back to the spares; the record error is reported
            self._check((error,), "cuEventRecord", stream=hex(stream))
        return event

    def _new_event(self, device_index: int) -> Any:
        event = self._check(
            self._cu.cuEventCreate(self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING),
            "cuEventCreate",
            device=device_index,
        )
        self._event_devices[int(event)] = device_index
        self._spare_events.setdefault(device_index, [])
        return event

    def event_query(self, event: Any) -> bool:
        """``cuEventQuery``: True when done, False while ``CUDA_ERROR_NOT_READY``."""
        calls = self._calls
        if calls is not None:
            error = calls.query(event)
            if error == 0:
                return True
            if error == self._not_ready:
                return False
            self._raise_code(error, "cuEventQuery")
        (error,) = self._cu.cuEventQuery(event)
        if error == self._success:
            return True
        if error == self._cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise DriverError("cuEventQuery", self._error_name(error))

    def event_synchronize(self, event: Any) -> None:
        self._check(self._cu.cuEventSynchronize(event), "cuEventSynchronize")

    # -- kernels --------------------------------------------------------------------
    def copy_and_launch(self, device_index, stream, copy, function, grid, block, shared, args):
        """The context check, copy and launch in one C call (see the base class for the
        contract); through the separate calls before the context is first retained, for a
        grid or block of more than one dimension, or without the C calls."""
        calls = self._calls
        cached = self._primary_contexts.get(device_index)
        if calls is None or cached is None or grid[1:] != (1, 1) or block[1:] != (1, 1):
            return super().copy_and_launch(
                device_index, stream, copy, function, grid, block, shared, args
            )
        dst, src, size = copy if copy is not None else (0, 0, 0)
        failure = calls.copy_and_launch(
            cached[1], dst, src, size, function, grid[0], block[0], shared, stream, args
        )
        if failure:
            self._raise_copy_and_launch(failure, device_index, stream, copy, grid, block)

    def _raise_copy_and_launch(self, failure, device_index, stream, copy, grid, block) -> NoReturn:
        call, code = failure
        if call == "cuLaunchKernel":
            details = {"grid": grid, "block": block, "stream": stream}
        elif call == "cuMemcpyAsync":
            dst, src, size = copy
            details = {"dst": hex(dst), "src": hex(src), "size": size}
        else:
            details = {"device": device_index}
        error = self._code_error(code, call, **details)
        if call == "cuLaunchKernel":
            settle_failed_launch(self, error, copy, device_index)
        raise error

    def launch_kernel(self, function, grid, block, shared, stream, args) -> None:
        """``cuLaunchKernel`` (``kernelParams=args``) in the current context: the hot path."""
        calls = self._calls
        if calls is not None:
            error = calls.launch(function, *grid, *block, shared, stream, args)
            if error:
                self._raise_code(error, "cuLaunchKernel", grid=grid, block=block, stream=stream)
            return
        result = self._cu.cuLaunchKernel(function, *grid, *block, shared, stream, args, 0)
        if result[0] != self._success:
            self._check(result, "cuLaunchKernel", grid=grid, block=block, stream=stream)
