"""``BufferView``: a typed window on memory that jaxbuf owns, consumable through DLPack.

A view is a pointer, a size, a dtype, a shape, a device and the owner that keeps the memory
alive. It holds no memory itself: the owner (an ``ExtensibleTensor``, a ``UvaBuffer``, ...)
does, and every framework array made from a view aliases the owner's memory. Every export (a
DLPack capsule, and so every numpy, torch or JAX array made from the view) holds the owner's
``export_anchor``, which keeps the memory alive until the array is gone, also after the owner
is freed; a view of a freed owner exports nothing (the owner's ``RuntimeError``).
:func:`uint8_tensor_from_ptr` (the seed's name) makes a view that no owner backs, over memory
the caller keeps mapped.

The owner is reached only through the owner contract (:class:`jaxbuf._owner.MemoryOwner`:
``ready_event``, ``driver``, ``check_exportable``, ``export_anchor``). ``to_torch`` and
``to_jax`` hand the view to the framework adapters of :mod:`jaxbuf.interop`; this module
imports no framework.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _dlpack, _exchange, interop
from ._checks import as_int, as_shape
from .devices import Device, as_device
from .drivers.base import K_DL_CPU, K_DL_CUDA, K_DL_CUDA_HOST, K_DL_ROCM, K_DL_ROCM_HOST
from .dtypes import DType, DTypeLike, canonical_dtype, uint8

_HOST_DEVICE_TYPES = (K_DL_CPU, K_DL_CUDA_HOST, K_DL_ROCM_HOST)
_STREAM_DEVICE_TYPES = (K_DL_CUDA, K_DL_CUDA_HOST, K_DL_ROCM, K_DL_ROCM_HOST)
#: The stream ``stream=None`` names (the array API): CUDA's legacy default stream is 1 in
#: DLPack's numbering, ROCm's default stream 0. jaxbuf's own copies run on it too.
_DEFAULT_STREAM = {K_DL_CUDA: 1, K_DL_CUDA_HOST: 1, K_DL_ROCM: 0, K_DL_ROCM_HOST: 0}


class _NumpyHolder:
    """Hands ``np.from_dlpack`` one prepared capsule (numpy takes only objects with
    ``__dlpack__``): the array then owns the export like any consumer, holding its anchor
    (the memory) and counting in its live exports until it is gone."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (K_DL_CPU, 0)


def _check_pair(value: Any, name: str) -> None:
    """``value`` must be a tuple of two ints (an IntEnum counts: DLPack device types are)."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is type(value[1]) is int:
        return  # the common case, checked cheaply: max_version comes with every export
    ints = isinstance(value, tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
    if not ints or len(value) != 2:
        raise TypeError(f"{name} must be None or a tuple of two ints, got {value!r}")


def _order_after_owner(view: BufferView, stream: int | None) -> None:
    """Make ``stream`` (a DLPack stream number; None: a host view, nothing to order) wait for
    the owner's pending producer work (its ``ready_event``; an owner without one has none)."""
    if stream is None:
        return
    # No cache of the waits made: an owner re-records the same event object for its next
    # writes (a staged writer's events), so "this stream already waited for it" goes stale.
    event = getattr(view.owner, "ready_event", None)
    if event is not None:
        view.owner.driver.stream_wait_event(stream, event, view.device.index)


def _wait_for_producer(owner: Any) -> None:
    """Block until the owner's pending device work (its ``ready_event``) is done."""
    event = getattr(owner, "ready_event", None)
    if event is not None:
        owner.driver.event_synchronize(event)


def _check_copy(copy: Any) -> bool | None:
    if copy is None:
        return None
    if not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be True, False or None, got {copy!r}")
    return bool(copy)


def _readable_runs(view: BufferView, nbytes: int) -> list[tuple[int, int]]:
    """The parts of the view's first ``nbytes`` that hold memory, as ``(start, end)``
    addresses: the owner's ``committed_ranges`` (see :mod:`jaxbuf._owner`), or the whole
    range for an owner whose memory is all backed (one without that member)."""
    committed_ranges = getattr(view.owner, "committed_ranges", None)
    if committed_ranges is None:
        return [(view.ptr, view.ptr + nbytes)]
    return committed_ranges(view.ptr, nbytes)


def _copy_capsule(view: BufferView, device_type: int, device_id: int, versioned: bool):
    """A capsule over a fresh copy of ``view``'s bytes, on the host (``device_type`` kDLCPU) or
    on the view's own device, kept alive by the capsule alone (``copy=True`` of the array API:
    the producer owns the copy). The copy is complete when this returns.

    Only committed bytes are read: where the view reaches past them (a ``full_view()``) the
    copy holds zeros, on every platform (an uncommitted CUDA address must never be touched).
    """
    nbytes = math.prod(view.shape) * view.dtype.itemsize
    anchor_target: Any = None
    data = 0  # no elements: NULL data, nothing to copy or keep alive
    if nbytes:
        driver = getattr(view.owner, "driver", None) or _driver_of(view.device)
        index = view.device.index
        # The copy runs on the default stream: order it after the owner's pending writes,
        # which may sit on a non-blocking stream (torch's) the default stream does not wait for.
        _order_after_owner(view, _DEFAULT_STREAM.get(view.dlpack_device_type))
        runs = _readable_runs(view, nbytes)
        # A free() on another thread after this copy took its export empties the committed
        # ranges (the export keeps the memory mapped): refuse then, rather than hand out
        # zeros for the bytes. Owners close first and empty them after, so ranges read
        # before the close are the true ones and this check sees any close before them.
        check_exportable = getattr(view.owner, "check_exportable", None)
        if check_exportable is not None:
            check_exportable()
        whole = runs == [(view.ptr, view.ptr + nbytes)]
        if device_type == K_DL_CPU:
            anchor_target = (np.empty if whole else np.zeros)(nbytes, np.uint8)
            data = anchor_target.ctypes.data
        else:  # the view's device, through the owner's driver
            anchor_target = driver.device_alloc(nbytes, index)
            data = anchor_target.ptr
            if not whole:
                driver.memset(data, 0, nbytes, index)
        _copy_runs(driver, index, data, view.ptr, runs)
    dtype = view.dtype
    payload = _dlpack.pack_payload(
        data,
        device_type,
        device_id,
        dtype.dlpack_code,
        dtype.itemsize * 8,
        view.shape,
        versioned=versioned,
        is_copied=True,
    )
    return _dlpack.new_capsule(payload, _dlpack.anchor_for(anchor_target))


def _copy_runs(driver: Any, index: int, dst: int, src: int, runs: list[tuple[int, int]]) -> None:
    """Copy each run (addresses from ``src`` on) to the same offset from ``dst``, on the
    producer stream (so after the owner's pending writes), and wait for it (so any consumer
    stream, and the host, sees the finished copy)."""
    for start, end in runs:
        driver.copy(dst + (start - src), start, end - start, index)
    event = driver.record_event(1, index)
    if event is not None:
        try:
            driver.event_synchronize(event)
        finally:
            driver.destroy_event(event)


def _driver_of(device: Device) -> Any:
    """The driver of a view over a foreign pointer (no owner to ask)."""
    from .drivers import get_vmm_driver

    return get_vmm_driver(device)


_NOT_A_TENSOR = (
    "a BufferView is jaxbuf's framework-neutral view, not a tensor. Take a torch tensor with "
    ".to_torch() or a JAX array with .to_jax(), or import the classes from jaxbuf.torch "
    "(torch tensors everywhere, as vLLM) or jaxbuf.jax (jax.Array everywhere)"
)


class BufferView:
    """A dense, row-major view of ``nbytes`` bytes at ``ptr``.

    Invariants: ``prod(shape) * dtype.itemsize <= nbytes``; ``ptr`` is aligned to the
    itemsize. Views are immutable; :meth:`view` makes a new one. A view is not a tensor:
    indexing it, iterating it or calling a tensor method on it raises an error that names
    :meth:`to_torch`, :meth:`to_jax` and the faces (:mod:`jaxbuf.torch`, :mod:`jaxbuf.jax`).

    Thread-safety: a view may be exported from several threads at once.
    """

    __slots__ = (
        "ptr",
        "nbytes",
        "dtype",
        "shape",
        "device",
        "owner",
        "dlpack_device_type",
        "_legacy_payload",
        "_versioned_payload",
    )

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        dtype: DTypeLike = uint8,
        shape: Any = None,
        device: Device = Device("cpu"),
        owner: Any = None,
        dlpack_device_type: int = K_DL_CPU,
    ) -> None:
        ptr, nbytes = as_int(ptr, "ptr"), as_int(nbytes, "nbytes")
        if not 0 <= ptr < 1 << 64:
            raise ValueError(f"ptr must be in [0, 2**64), got {ptr!r}")
        if not 0 <= nbytes < 1 << 63:  # DLPack shapes are int64
            raise ValueError(f"nbytes must be in [0, 2**63), got {nbytes!r}")
        dtype = canonical_dtype(dtype)
        shape = (nbytes // dtype.itemsize,) if shape is None else as_shape(shape)
        needed = math.prod(shape) * dtype.itemsize
        if needed > nbytes:
            raise ValueError(
                f"shape {shape} of {dtype} needs {needed} bytes but the view has {nbytes}"
            )
        if ptr % dtype.itemsize:
            raise ValueError(f"pointer {ptr:#x} is not aligned to {dtype} ({dtype.itemsize} bytes)")
        # DLPack's shape and strides are int64. A non-empty shape fits (its bytes do), but a
        # zero-size one can still have huge extents and strides; checked only then (hot path).
        if not needed and any(n >= 1 << 63 for n in (*shape, *_dlpack.contiguous_strides(shape))):
            raise ValueError(f"shape {shape}: an extent or stride does not fit DLPack's int64")
        self.ptr = ptr
        self.nbytes = nbytes
        self.dtype: DType = dtype
        self.shape: tuple[int, ...] = shape
        self.device = device
        self.owner = owner
        self.dlpack_device_type = dlpack_device_type
        # A view is immutable, so its capsule payloads are packed once; an export is one C call.
        self._legacy_payload = self._pack(versioned=False)
        self._versioned_payload = None

    def __repr__(self) -> str:
        owner = self.owner
        if owner is None:
            state = "foreign"  # over a pointer nobody here owns
        else:
            state = "open" if getattr(owner, "export_anchor", None) is not None else "freed"
        return (
            f"BufferView(ptr={self.ptr:#x}, device={self.device}, dtype={self.dtype}, "
            f"shape={self.shape}, nbytes={self.nbytes}, {state})"
        )

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    # -- used as if it were a tensor: say where the tensors are -------------------------
    def __getattr__(self, name: str) -> Any:
        # Reached only for a name a view lacks (never on the hot paths): a tensor method,
        # most likely, called on the framework-neutral view.
        if name.startswith("_"):
            raise AttributeError(f"'BufferView' object has no attribute {name!r}")
        raise AttributeError(f"'BufferView' object has no attribute {name!r}: {_NOT_A_TENSOR}")

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(f"'BufferView' object is not subscriptable: {_NOT_A_TENSOR}")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(f"'BufferView' object does not support item assignment: {_NOT_A_TENSOR}")

    def __iter__(self) -> Any:
        raise TypeError(f"'BufferView' object is not iterable: {_NOT_A_TENSOR}")

    def __contains__(self, item: Any) -> bool:
        # Without it ``in`` falls back to __iter__ and Python replaces that error's message.
        raise TypeError(f"'BufferView' object does not support 'in': {_NOT_A_TENSOR}")

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        # Without it numpy (and jnp.asarray, through numpy) takes a view for a sequence, as
        # __len__ and __getitem__ say, and fails naming nothing: say where the arrays are.
        raise TypeError(
            "a BufferView does not convert implicitly (np.asarray, np.array, jnp.asarray): "
            f"take a numpy array of host memory with .to_numpy(); {_NOT_A_TENSOR}"
        )

    # -- reinterpretation -------------------------------------------------------------
    def view(self, dtype: DTypeLike | None = None, shape: Any = None) -> BufferView:
        """The same bytes as another dtype and/or shape (a prefix when smaller).

        Raises ``TypeError`` for an unsupported dtype and ``ValueError`` for a shape that does
        not fit or a pointer misaligned for the dtype.
        """
        dtype = self.dtype if dtype is None else canonical_dtype(dtype)
        if shape is None and self.nbytes % dtype.itemsize:
            raise ValueError(f"{self.nbytes} bytes is not a whole number of {dtype} elements")
        return BufferView(
            self.ptr, self.nbytes, dtype, shape, self.device, self.owner, self.dlpack_device_type
        )

    # -- DLPack -----------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.dlpack_device_type, self.device.index if self.device.is_cuda else 0)

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ):
        """Export as a DLPack capsule (array-API semantics).

        A versioned capsule is returned only when ``max_version`` asks for major version 1 or
        more (flagged ``READ_ONLY`` over a read-only owner); otherwise a legacy ``dltensor``
        capsule (what JAX asks for). The type's ``__dlpack_c_exchange_api__`` (DLPack's C
        exchange API, :mod:`jaxbuf._exchange`) hands out the same versioned tensor without a
        capsule. The capsule keeps the owner's memory alive (``owner.export_anchor``) until
        the consumer's array is gone.
        On CUDA, ``stream`` is the consumer's stream: it is made to wait for the owner's
        pending writes; ``-1`` means no synchronisation, ``None`` the device's default stream
        (CUDA's legacy default stream, as the standard defines it), ordered the same way. A
        copy (``copy=True``, or to the host) is ordered after those writes too.

        ``copy=True`` returns a capsule over a copy the capsule owns; ``dl_device`` may name
        the view's own device or, for any view, the host ``(kDLCPU, 0)``: a CUDA view is then
        copied to host memory (unless ``copy=False``), a pinned view is exported in place.
        ``BufferError`` for what cannot be honoured (another device, ``copy=False`` when a copy
        is needed); ``TypeError`` for malformed arguments; the owner's ``RuntimeError`` once it
        has been freed.
        """
        if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
            raise TypeError(f"stream must be None or an int, got {stream!r}")
        versioned = False
        if max_version is not None:
            _check_pair(max_version, "max_version")
            versioned = max_version[0] >= 1
        device_type = self.dlpack_device_type
        if dl_device is not None or copy is not None:  # the rare path: a device move or copy
            target, copy = self._target_device(dl_device, _check_copy(copy))
            if target[0] == K_DL_CPU and stream is not None and stream != -1:
                raise BufferError(f"stream must be None for an export to the host, got {stream!r}")
            if copy:
                # An export held while the bytes are read (a freed owner raises here): a
                # free() on another thread then waits for it instead of unmapping under it.
                held = self.held_export()
                try:
                    return _copy_capsule(self, target[0], target[1], versioned)
                finally:
                    del held  # unconsumed: its destructor gives the export back
            device_type = target[0]
        anchor = _dlpack.anchor_for(self.owner)
        if stream is None:  # the standard's default stream of the device (CUDA: legacy)
            # Inlined up to the event: the hot path of an owner with no pending work.
            if device_type in _STREAM_DEVICE_TYPES and getattr(self.owner, "ready_event", None):
                _order_after_owner(self, _DEFAULT_STREAM[device_type])
        elif stream != -1:
            self._wait_on_stream(stream, device_type)
        if device_type != self.dlpack_device_type:  # pinned memory exported to the host
            return _dlpack.new_capsule(self._pack(versioned, device_type), anchor)
        # The payloads were packed once (a view is immutable): an export is one C call.
        payload = self._legacy_payload
        if versioned:
            payload = self._versioned_payload or self._pack_versioned()
        return _dlpack.new_capsule(payload, anchor)

    def held_export(self) -> Any:
        """An export of this view that nothing consumes (a capsule): while it is referenced
        the owner's memory stays mapped, whatever ``free()`` another thread calls; dropping
        it gives the export back (and releases the memory if the owner was freed meanwhile).
        For jaxbuf's own reads and writes of the memory: ``ClosedError`` once freed."""
        return _dlpack.new_capsule(self._legacy_payload, _dlpack.anchor_for(self.owner))

    def _target_device(
        self, dl_device: Any, copy: bool | None
    ) -> tuple[tuple[int, int], bool | None]:
        """The device an export with ``dl_device`` goes to and whether it copies: the view's
        own device, or the host (in place for pinned memory, which the host reads once the
        producer is done; a copy for device memory). ``BufferError`` for anything else."""
        own_device = self.__dlpack_device__()
        if dl_device is not None:
            _check_pair(dl_device, "dl_device")
            dl_device = (int(dl_device[0]), dl_device[1])
        if dl_device is None or dl_device == own_device:
            return own_device, copy
        device_type = self.dlpack_device_type
        if dl_device == (K_DL_CPU, 0) and device_type in _HOST_DEVICE_TYPES:
            if not copy:  # a host consumer has no stream: wait for pending device writes
                _wait_for_producer(self.owner)
            return (K_DL_CPU, 0), copy
        if dl_device == (K_DL_CPU, 0) and device_type in _STREAM_DEVICE_TYPES:
            if copy is False:
                raise BufferError(
                    f"exporting this view on {self.device} to the host {dl_device} needs "
                    "a copy, and copy=False forbids it"
                )
            return (K_DL_CPU, 0), True
        raise BufferError(
            f"cannot export to device {dl_device}: the view lives on {own_device}; "
            f"only {own_device} or the host (1, 0) can be asked for"
        )

    def _wait_on_stream(self, stream: int, device_type: int) -> None:
        """Check the consumer's ``stream`` for ``device_type`` and order it after the owner's
        pending producer work."""
        if device_type not in _STREAM_DEVICE_TYPES:
            raise BufferError(f"stream must be None for a CPU view, got {stream!r}")
        if stream == 0 and device_type in (K_DL_CUDA, K_DL_CUDA_HOST):
            raise BufferError(
                "stream 0 is ambiguous on CUDA (the array API disallows it): "
                "pass 1 for the legacy default stream, 2 for per-thread"
            )
        _order_after_owner(self, stream)

    def _with_owner(self, owner: Any) -> BufferView:
        """This view (its payloads as packed) owned by ``owner``: no checks, no packing. How
        an owner's kept template, which refers to no owner, becomes the view it hands out."""
        view = object.__new__(BufferView)
        view.ptr = self.ptr
        view.nbytes = self.nbytes
        view.dtype = self.dtype
        view.shape = self.shape
        view.device = self.device
        view.owner = owner
        view.dlpack_device_type = self.dlpack_device_type
        view._legacy_payload = self._legacy_payload
        view._versioned_payload = self._versioned_payload
        return view

    def _pack_versioned(self) -> _dlpack.Payload:
        """The versioned payload, packed on first use and kept."""
        payload = self._versioned_payload = self._pack(versioned=True)
        return payload

    def _pack(
        self, versioned: bool, device_type: int | None = None, device_id: int | None = None
    ) -> _dlpack.Payload:
        """This view's managed tensor (``device_type`` / ``device_id`` override the device: a
        pinned view exported to the host is ``(kDLCPU, 0)``, a host shard of
        :mod:`jaxbuf.sharding` names the CPU device JAX places it on)."""
        if device_type is None:
            device_type = self.dlpack_device_type
        if device_id is None:
            device_id = self.device.index if device_type != K_DL_CPU and self.device.is_cuda else 0
        return _dlpack.pack_payload(
            self.ptr,
            device_type,
            device_id,
            self.dtype.dlpack_code,
            self.dtype.itemsize * 8,
            self.shape,
            versioned=versioned,
            # Mapped PROT_READ (a read-only import): a consumer that writes would fault.
            read_only=versioned and getattr(self.owner, "read_only", False),
        )

    # -- framework adapters -------------------------------------------------------------
    def to_numpy(self, dtype: DTypeLike | None = None, shape: Any = None) -> np.ndarray:
        """A numpy array over the same bytes (as ``dtype`` / ``shape`` when given, like
        :meth:`to_torch` and :meth:`to_jax`), host memory only, zero-copy and writable.

        The array is an export like a capsule: it keeps the owner's memory alive and counts
        in its live exports until it (and every array derived from it) is gone.
        """
        if dtype is not None or shape is not None:
            return self.view(dtype, shape).to_numpy()
        if self.dlpack_device_type not in _HOST_DEVICE_TYPES:
            raise BufferError(f"to_numpy needs host memory; this view is on {self.device}")
        anchor = _dlpack.anchor_for(self.owner)
        # Through numpy's DLPack importer (a versioned capsule, so the array is writable): the
        # fastest way numpy builds an array that holds an object, and the same lifetime and
        # count as any export. numpy cannot import bfloat16: its bits go as uint16.
        bfloat16 = self.dtype.name == "bfloat16"
        if self.dlpack_device_type == K_DL_CPU and not bfloat16:
            payload = self._versioned_payload or self._pack_versioned()
        else:
            if self.dlpack_device_type != K_DL_CPU:  # pinned: the host reads after the device
                _wait_for_producer(self.owner)
            host = self.view("uint16", self.shape) if bfloat16 else self
            payload = host._pack(True, K_DL_CPU)
        array = np.from_dlpack(_NumpyHolder(_dlpack.new_capsule(payload, anchor)))
        if getattr(self.owner, "read_only", False):  # mapped PROT_READ: a write would fault
            array.flags.writeable = False
        return array.view(self.dtype.numpy) if bfloat16 else array

    def to_torch(self, dtype: DTypeLike | None = None, shape: Any = None):
        """A torch tensor over the same bytes (as ``dtype`` / ``shape`` when given), zero-copy,
        on this view's device, through the torch adapter
        (:meth:`jaxbuf.interop.torch.TorchAdapter.from_view`): pending producer work is
        ordered before torch's current stream, and the tensor keeps the owner's memory alive.
        """
        target = self if dtype is None and shape is None else self.view(dtype, shape)
        adapter = _adapters.get("torch") or _adapter("torch")
        return adapter.from_view(target)

    def to_jax(self, dtype: DTypeLike | None = None, shape: Any = None):
        """A JAX array over the same bytes (as ``dtype`` / ``shape`` when given), zero-copy,
        through the JAX adapter (:meth:`jaxbuf.interop.jax.JaxAdapter.from_view`:
        ``jax.dlpack.from_dlpack(..., copy=False)``); the array keeps the owner's memory alive.

        Never a silent copy: ``BufferError`` where JAX would copy, naming why (a host view not
        64-byte aligned, a 64-bit dtype without ``jax_enable_x64``). Segment views of an
        ``ExtensibleTensor`` are always aligned.
        """
        target = self if dtype is None and shape is None else self.view(dtype, shape)
        adapter = _adapters.get("jax") or _adapter("jax")
        return adapter.from_view(target)


# DLPack's C exchange API (in C, jaxbuf/_exchange.c): the versioned tensor __dlpack__ makes,
# handed out in one C call. On the type, where consumers look for it.
BufferView.__dlpack_c_exchange_api__ = _exchange.register(BufferView, _order_after_owner)

# The adapters the to_* methods use, each looked up in the registry once: registry names are
# never replaced, so a kept reference stays the registry's answer.
_adapters: dict[str, Any] = {}


def _adapter(name: str) -> Any:
    adapter = _adapters[name] = interop.get(name)
    return adapter


def uint8_tensor_from_ptr(ptr: int, num_bytes: int, device_index: Any) -> BufferView:
    """A uint8 view of ``num_bytes`` of device memory at ``ptr``; the caller keeps it mapped.

    The seed's function, with the seed's parameters: ``device_index`` is an int naming a
    CUDA device, or any device spec (``"cpu"`` for memory of the CPU driver). The view is
    what every framework imports (``torch.from_dlpack``, ``jax.dlpack.from_dlpack``,
    ``np.from_dlpack`` for host memory, or :meth:`BufferView.to_torch` and friends),
    zero-copy. It owns nothing: no array made from it keeps the memory alive, so the caller
    must keep it mapped while any such array lives (an owner's own views, such as
    ``ExtensibleTensor.segment_view``, do that for you). ``TypeError`` / ``ValueError``
    name a bad argument; nothing is allocated.
    """
    num_bytes = as_int(num_bytes, "num_bytes")
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be non-negative, got {num_bytes}")
    device = as_device(device_index)
    driver = _driver_of(device)  # ValueError for an index the driver lacks
    return BufferView(ptr, num_bytes, uint8, (num_bytes,), device, None, driver.dlpack_device_type)
