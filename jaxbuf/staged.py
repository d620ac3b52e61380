"""Staged row writes: stage on the host, apply many with one kernel launch.

A :class:`StagedWriteTensor` is a 2-D target in memory jaxbuf owns (device memory through the
driver, or pinned host memory the device reads in place). :meth:`~StagedWriteTensor.stage_write`
records ``target[row, start:start + len(values)] = values`` on the host; the writes staged so far
are applied by :meth:`~StagedWriteTensor.apply_write` (one tensor) or
:meth:`FusedStagedWriter.apply` (many tensors, of mixed dtypes) with **one** launch of the Triton
kernel of :mod:`jaxbuf.kernels`.

Staging costs a few hundred nanoseconds and does not depend on how much is staged: each write
appends one packed record (a row of the kernel's write table) to one ``bytearray`` and its
values' bytes to another; nothing is a Python list of values. A numpy array of the target's
dtype is staged by one call into the small C extension ``jaxbuf._staging`` (about 0.2 µs), a
list or tuple is packed and range-checked by ``struct``; everything else goes through numpy.
At apply time the extension lays the tables and values straight into a pinned (UVA) slot the
device reads in place (no separate host-to-device copy), and the launch goes through Triton's
cached launcher. Without the extension, the same happens in Python and numpy, only slower.

Order is defined: writes staged before one apply take effect in staging order, so where two
overlap the later one wins, on the GPU as on the CPU. Overlap is detected on the host (a repeated
row is the cheap first test); only then does the launch run its writes in order (still one
launch).

Examples
--------
>>> import numpy as np, jaxbuf.staged as staged
>>> swt = staged.StagedWriteTensor((4, 8), "int32", device="cpu", backend="numpy")
>>> swt.stage_write(1, 2, np.array([7, 8, 9], dtype=np.int32))
>>> swt.stage_write(3, 0, [1, 2])
>>> swt.stage_write_elem(0, 5)
>>> swt.num_staged_writes
3
>>> swt.apply_write()
>>> swt.to_numpy()[:, :5].tolist()
[[5, 0, 0, 0, 0], [0, 0, 7, 8, 9], [0, 0, 0, 0, 0], [1, 2, 0, 0, 0]]
>>> swt.close()
"""

from __future__ import annotations

import importlib.util
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import interop
from ._checks import as_count
from ._checks import as_int as _as_index
from ._errors import Cleanup, attempt
from ._lifetime import release_when_collected
from ._resolve import resolve
from .devices import Device
from .drivers.base import VmmDriver
from .dtypes import DType, canonical_dtype
from .views import BufferView

__all__ = ["FusedStagedWriter", "StagedWriteTensor", "SUPPORTED_DTYPES", "BACKENDS"]

#: Target dtypes a :class:`StagedWriteTensor` accepts.
SUPPORTED_DTYPES = ("int32", "int64", "float32", "float16", "bfloat16")
#: ``backend`` values: the Triton kernel (compiled on CUDA, interpreted on the CPU) or the
#: numpy reference (CPU only, chosen explicitly).
BACKENDS = ("triton", "numpy")

_DEFAULT_MAX_CONCURRENCY = 2
_BLOCK_SIZE = 1024  # elements one kernel program copies per step; longer writes loop
_GROUP_FIELDS = 3  # out_ptr, row_stride, elem_size
_WRITE_FIELDS = 5  # group, row, start, content_offset (bytes), length
_MAX_CACHED_LAYOUTS = 64
# struct codes for the scalar fast path of stage_write_elem (bfloat16 has none).
_STRUCT_CODES = {"int32": "=i", "int64": "=q", "float32": "=f", "float16": "=e"}
_ndarray = np.ndarray
try:  # the C fast paths (optional: the Python/numpy paths do everything they do)
    from ._staging import Stager as _Stager
    from ._staging import clear as _clear
    from ._staging import pack as _pack
except ImportError:  # pragma: no cover - built by setup.py wherever a compiler is
    _Stager = _clear = _pack = None
_RECORD_BYTES = _WRITE_FIELDS * 8
# One staged write as a row of the kernel's write table, packed in C.
_pack_record = struct.Struct(f"={_WRITE_FIELDS}q").pack


# -- validation helpers ----------------------------------------------------------------------
def _target_shape(size: Any) -> tuple[tuple[int, ...], int, int]:
    """``(shape, num_rows, row_len)`` for ``size``: an int n (a 1-D target of n rows of one
    element, as in the seed) or ``(num_rows, row_len)``."""
    if isinstance(size, (tuple, list)):
        dims = tuple(_as_index(d, "size") for d in size)
        if len(dims) == 1:
            dims = (dims[0],)
        elif len(dims) != 2:
            raise ValueError(f"size must be an int or (num_rows, row_len), got {size!r}")
    else:
        dims = (_as_index(size, "size"),)
    if any(d < 0 for d in dims):
        raise ValueError(f"size must be non-negative, got {size!r}")
    if math.prod(dims) >= 1 << 60:  # times an itemsize of up to 8: past int64 / size_t
        raise ValueError(f"size {size!r} is too large: {math.prod(dims)} elements")
    if len(dims) == 1:
        return dims, dims[0], 1
    return dims, dims[0], dims[1]


def _check_dtype(dtype: Any) -> DType:
    try:
        resolved = canonical_dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"unsupported dtype {dtype!r} for a StagedWriteTensor; supported: "
            f"{', '.join(SUPPORTED_DTYPES)}"
        )
    return resolved


def _check_max_concurrency(max_concurrency: Any) -> int:
    if max_concurrency is None:
        return _DEFAULT_MAX_CONCURRENCY
    return as_count(max_concurrency, "max_concurrency")


def _check_backend(backend: Any, device: Device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "numpy" and device.is_cuda:
        raise ValueError(
            f"backend='numpy' applies writes through host pointers and cannot write {device} "
            "memory; use backend='triton' on a GPU"
        )
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise ImportError(
            "backend='triton' needs Triton, which is not installed; install it, or pass "
            "backend='numpy' (CPU only) explicitly"
        )
    return backend


# -- value conversion (the slow path of staging) ---------------------------------------------
def _is_float_dtype(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 has kind 'V'; it is still a float for conversion purposes.
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _first_bad(mask: np.ndarray, values: np.ndarray) -> str:
    index = int(np.flatnonzero(mask)[0])
    return f"{values[index]!r} at index {index}"


def _to_numpy(values: Any) -> np.ndarray:
    """Any accepted input kind as a numpy array (no dtype conversion yet)."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, (list, tuple)):
        return np.asarray(values) if values else np.empty(0, np.int64)
    if isinstance(values, range):
        if len(values) and not (-(2**63) <= min(values[0], values[-1])
                                and max(values[0], values[-1]) < 2**63):  # fmt: skip
            raise ValueError(f"{values!r} does not fit in int64")
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    adapter = interop.adapter_for(values)
    if adapter is not None:
        # A framework's array (torch, JAX, ...): staging data lives on the host, so a device
        # array is copied there.
        return adapter.to_numpy(values)
    if isinstance(values, (str, bytes, bytearray, memoryview, dict, set, frozenset)) or not hasattr(
        values, "__iter__"
    ):
        raise TypeError(
            "values must be a list, tuple, range, generator, numpy array, torch tensor or JAX "
            f"array of numbers, got {type(values).__name__}"
            + ("; use stage_write_elem for one value" if np.isscalar(values) else "")
        )
    items = list(values)  # a generator or another iterable, consumed once
    return np.asarray(items) if items else np.empty(0, np.int64)


def _convert(values: Any, dtype: np.dtype, type_name: str) -> np.ndarray:
    """``values`` as a C-contiguous 1-D array of ``dtype``, or ValueError / TypeError when
    that would change a value beyond a float's rounding (see :meth:`StagedWriteTensor.stage_write`)."""
    source = _to_numpy(values)
    if source.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {source.shape}")
    if source.dtype == dtype:
        return np.ascontiguousarray(source)
    kind = source.dtype.kind
    if kind == "b":  # False and True are 0 and 1 exactly, in every target dtype
        return source.astype(dtype)
    if not (kind in "iu" or _is_float_dtype(source.dtype)):
        raise TypeError(f"values of dtype {source.dtype} cannot be written to a {type_name} tensor")
    if source.size == 0:
        return np.empty(0, dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if kind in "iu":
            if not np.can_cast(source.dtype, dtype, casting="safe"):
                low, high = int(source.min()), int(source.max())
                if low < info.min or high > info.max:
                    bad = (source < info.min) | (source > info.max)
                    raise ValueError(
                        f"value {_first_bad(bad, source)} is out of range for {type_name}"
                    )
            return source.astype(dtype)
        wide = source.astype(np.float64)
        bad = ~np.isfinite(wide)
        if bad.any():
            raise ValueError(f"value {_first_bad(bad, source)} cannot be written to a "
                             f"{type_name} tensor")  # fmt: skip
        bad = np.trunc(wide) != wide
        if bad.any():
            raise ValueError(f"value {_first_bad(bad, source)} is not an integer; writing it to "
                             f"a {type_name} tensor would truncate it")  # fmt: skip
        # Powers of two, exact in float64: values must lie in [min, max + 1).
        bad = (wide < float(info.min)) | (wide >= float(info.max) + 1.0)
        if bad.any():
            raise ValueError(f"value {_first_bad(bad, source)} is out of range for {type_name}")
        return wide.astype(dtype)
    # Float targets: rounding to the nearest representable value is accepted; overflow to
    # infinity of a finite value is not.
    if kind in "iu" or source.dtype.name == "bfloat16":
        wide = source.astype(np.float64)
    else:
        wide = source
    with np.errstate(over="ignore", invalid="ignore"):
        result = wide.astype(dtype)
        bad = np.isinf(result.astype(np.float32)) & np.isfinite(wide)
    if bad.any():
        raise ValueError(f"value {_first_bad(bad, source)} overflows {type_name}")
    return result


def _new_stager(records: bytearray, contents: bytearray, num_rows: int, row_len: int,
                dtype: np.dtype) -> Any:  # fmt: skip
    """The C stager for a tensor, or None without the extension. A dtype numpy exports no
    buffer format for (bfloat16) gets a format no buffer has: its stage_write always takes
    the Python path, while the writer still packs it in C."""
    if _Stager is None:
        return None
    try:
        format = memoryview(np.empty(0, dtype)).format
    except (ValueError, TypeError, BufferError):
        format = "!"
    return _Stager(records, contents, num_rows, row_len, format, dtype.itemsize)


# -- events ----------------------------------------------------------------------------------
class _AppliedEvent:
    """A driver event recorded after one apply's launch, shared by the tensors it wrote and the
    staging slot it read; destroyed when the last of them lets go."""

    __slots__ = ("handle", "stream", "_driver")

    def __init__(self, driver: VmmDriver, handle: Any, stream: int) -> None:
        self.handle = handle
        self.stream = stream
        self._driver = driver

    def wait(self) -> None:
        """Block until the work before the event is done."""
        if not self._driver.event_query(self.handle):
            self._driver.event_synchronize(self.handle)

    def __del__(self, _release: Any = release_when_collected) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            _release(lambda: self._driver.destroy_event(handle), "a CUDA event")


# -- the tensor ------------------------------------------------------------------------------
class StagedWriteTensor:
    """A 2-D target whose row writes are staged on the host and applied in one launch.

    Invariants: the target (``gpu``) never moves and starts zeroed; staged writes are in
    bounds and already converted to the target dtype (a rejected write raises and stages
    nothing); writes take effect at the next apply, in staging order (later wins where they
    overlap); ``free()`` / ``close()`` release the memory once and may be called again.

    ``size`` is ``(num_rows, row_len)``, or an int ``n``: a 1-D target of ``n`` elements
    that is ``n`` rows of one element, as in the seed, so ``stage_write_elem(i, v)`` sets
    element ``i``. The target is device memory (an :class:`~jaxbuf.extensible.ExtensibleTensor`,
    committed whole, so it occupies at least one 2 MiB granule) or, with
    ``uva_instead_of_gpu``, pinned host memory the device reads in place (a
    :class:`~jaxbuf.uva.UvaBuffer`; slower to read, spares device memory).

    ``gpu`` is a :class:`~jaxbuf.views.BufferView` of the target, consumable through DLPack:
    ``torch.from_dlpack(swt.gpu)`` and ``jax.dlpack.from_dlpack(swt.gpu)`` (or
    :meth:`to_torch` / :meth:`to_jax`) alias the memory, and a consumer that passes its
    stream is ordered after the applied writes. Keep the tensor open while such arrays live.

    Thread-safety: one tensor is not thread-safe (one thread stages and applies it); separate
    tensors may be staged from separate threads.

    Parameters
    ----------
    size : int or (int, int)
    dtype : int32, int64, float32, float16 or bfloat16 (numpy, torch, JAX dtype or str)
    device : device spec, optional
        Default: :func:`jaxbuf.devices.default_device`.
    max_concurrency : int, optional
        Staging slots of the tensor's own writer (:meth:`apply_write`); default 2.
    uva_instead_of_gpu : bool
    backend : {"triton", "numpy"}
        How :meth:`apply_write` launches; ``"numpy"`` only on the CPU.
    driver : VmmDriver, optional
    """

    __slots__ = ("shape", "dtype", "device", "num_rows", "row_len", "max_concurrency",
                 "backend", "uva_instead_of_gpu", "_driver", "_np_dtype", "_records", "_contents",
                 "_stage_record", "_stage_contents", "_stage_fast", "_stager", "_pack", "_code", "_packers", "_target",
                 "_view", "_group_entry",
                 "_applied", "_writer", "_freed", "__weakref__")  # fmt: skip

    def __init__(
        self,
        size: Any,
        dtype: Any,
        device: Any = None,
        max_concurrency: int | None = None,
        uva_instead_of_gpu: bool = False,
        *,
        backend: str = "triton",
        driver: VmmDriver | None = None,
    ) -> None:
        self._target = None
        self._writer = None
        self._applied = None
        self._freed = True
        shape, num_rows, row_len = _target_shape(size)
        dtype = _check_dtype(dtype)
        max_concurrency = _check_max_concurrency(max_concurrency)
        device, driver = resolve(device, driver)
        backend = _check_backend(backend, device)
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.num_rows = num_rows
        self.row_len = row_len
        self.max_concurrency = max_concurrency
        self.backend = backend
        self.uva_instead_of_gpu = bool(uva_instead_of_gpu)
        self._driver = driver
        self._np_dtype = dtype.numpy
        code = _STRUCT_CODES.get(dtype.name)
        self._code = code
        self._pack = struct.Struct(code).pack if code is not None else None
        self._packers: dict[int, Any] = {}
        # One record per write, the bytes of a row of the kernel's write table
        # (group, row, start, content_offset, length); the apply fills group and offset.
        self._records = bytearray()
        self._contents = bytearray()
        # Bound once: clearing keeps these objects, and a call through a bound method skips
        # two attribute lookups on the hot path.
        self._stage_record = self._records.extend
        self._stage_contents = self._contents.extend
        self._stager = _new_stager(self._records, self._contents, num_rows, row_len,
                                   self._np_dtype)  # fmt: skip
        self._stage_fast = None if self._stager is None else self._stager.stage

        nbytes = num_rows * row_len * dtype.itemsize
        allocation = max(nbytes, 1)
        if self.uva_instead_of_gpu:
            from .uva import UvaBuffer

            target = UvaBuffer(allocation, "uint8", device, driver=driver)
            target.np[:] = 0  # pinned memory from the driver is not zeroed on CUDA
            ptr = target.device_ptr
        else:
            from .extensible import ExtensibleTensor

            target = ExtensibleTensor(allocation, device=device, driver=driver)
            try:
                target.resize_per_segment_(allocation, zero_new=True)
                # The zeroing ran on the driver's stream; applies run on torch's. Finish it
                # once here rather than ordering every apply after it.
                driver.synchronize(device.index)
            except BaseException:
                target.free()
                raise
            ptr = target.base_ptr
        self._target = target
        self._view = BufferView(ptr, allocation, dtype, shape, device, self,
                                driver.dlpack_device_type)  # fmt: skip
        # What the fused writer's group table needs, and what makes its cache key unique.
        self._group_entry = (ptr, row_len, dtype.itemsize, num_rows, device)
        self._freed = False

    # -- staging ---------------------------------------------------------------------------
    def stage_write(self, row: int, start: int, values: Any) -> None:
        """Stage ``target[row, start:start + len(values)] = values``.

        ``values``: a list, tuple, range, generator, numpy array, torch tensor (a CUDA one is
        copied to the host) or JAX array, 1-D. A 1-D C-contiguous numpy array of the target's
        dtype (with ``row`` and ``start`` Python ints) takes the fast path, one C call; a list
        or tuple is packed by ``struct``.
        Other inputs are converted through numpy. Values are refused (``ValueError`` /
        ``TypeError``, nothing staged) where conversion would change them beyond a float's
        rounding: integers out of the dtype's range; non-integral, NaN or infinite floats to
        an integer dtype (integral floats such as ``3.0`` are accepted); finite values that
        overflow a float dtype; complex, string or object values. Integers and floats to a
        float dtype round to the nearest representable value; bools are 0 and 1.

        ``IndexError`` (nothing staged) unless ``0 <= row < num_rows``, ``start >= 0`` and
        ``start + len(values) <= row_len``. An empty ``values`` stages nothing.
        """
        fast = self._stage_fast
        if fast is not None and fast(row, start, values):
            return  # staged by C: exact ints, a contiguous 1-D buffer of the dtype, in bounds
        kind = type(values)
        if kind is _ndarray and values.dtype is self._np_dtype and values.ndim == 1:
            n = len(values)
        elif (kind is list or kind is tuple) and self._code is not None:
            n = len(values)
            values = self._pack_sequence(values, n)
        else:
            values = _convert(values, self._np_dtype, self.dtype.name)
            n = len(values)
        if type(row) is not int or type(start) is not int:
            row, start = _as_index(row, "row"), _as_index(start, "start")
        if row < 0 or row >= self.num_rows or start < 0 or start + n > self.row_len:
            raise self._bounds_error(row, start, n)
        if not n:
            return
        try:
            self._stage_contents(values)  # the raw bytes, through the buffer protocol
        except TypeError:  # a non-contiguous array; nothing was appended
            self._stage_contents(np.ascontiguousarray(values))
        self._stage_record(_pack_record(0, row, start, 0, n))

    def _pack_sequence(self, values: list | tuple, n: int) -> Any:
        """A list or tuple as the target's bytes, range-checked by ``struct`` (C speed);
        anything ``struct`` refuses goes through the full conversion for its verdict."""
        pack = self._packers.get(n)
        if pack is None:
            pack = struct.Struct(f"={n}{self._code[1]}").pack
            if len(self._packers) < 4096:
                self._packers[n] = pack
        try:
            return pack(*values)
        except (struct.error, OverflowError, TypeError):
            return _convert(values, self._np_dtype, self.dtype.name)

    def stage_write_elem(self, row: int, value: Any) -> None:
        """Stage ``target[row, 0] = value`` (the seed's semantics; for a 1-D target, element
        ``row``). ``value`` is converted under the rules of :meth:`stage_write`."""
        pack = self._pack
        kind = type(value)
        if pack is not None and (kind is int or (kind is float and self.dtype.name[0] == "f")):
            try:
                data = pack(value)
            except (struct.error, OverflowError):
                data = _convert([value], self._np_dtype, self.dtype.name).tobytes()
        else:
            if kind is _ndarray or np.isscalar(value) or getattr(value, "ndim", None) == 0:
                adapter = interop.adapter_for(value)
                items = (np.asarray(value) if adapter is None else adapter.to_numpy(value))
                items = items.reshape(1)
            else:
                raise TypeError(
                    f"value must be one number, got {type(value).__name__}; use stage_write "
                    "for a sequence"
                )
            data = _convert(items, self._np_dtype, self.dtype.name).tobytes()
        if type(row) is not int:
            row = _as_index(row, "row")
        if row < 0 or row >= self.num_rows or self.row_len < 1:
            raise self._bounds_error(row, 0, 1)
        self._stage_contents(data)
        self._stage_record(_pack_record(0, row, 0, 0, 1))

    def _bounds_error(self, row: int, start: int, length: int) -> Exception:
        if self._freed:
            return ValueError("the StagedWriteTensor is freed")
        if not 0 <= row < self.num_rows:
            return IndexError(f"row {row} out of range for a tensor of {self.num_rows} rows")
        return IndexError(
            f"write of {length} element(s) at start {start} does not fit in row {row} of "
            f"length {self.row_len}"
        )

    def clear_staged_writes(self) -> None:
        """Drop every write staged since the last apply."""
        del self._records[:]
        del self._contents[:]

    @property
    def num_staged_writes(self) -> int:
        return len(self._records) // _RECORD_BYTES

    # -- applying --------------------------------------------------------------------------
    def apply_write(self, stream: Any = None) -> None:
        """Apply and clear the staged writes with one launch (see :meth:`FusedStagedWriter.apply`).

        Uses the tensor's own writer (made on first use), whose ``max_concurrency`` staging
        slots bound how many applies may be in flight; with the default guard the host waits
        rather than overwrite a slot the device still reads.
        """
        if not self._records:
            return
        writer = self._writer
        if writer is None:
            self._check_open()
            writer = self._writer = FusedStagedWriter(
                self.device, max(self.num_rows, 1), self.max_concurrency, backend=self.backend,
                driver=self._driver,
            )  # fmt: skip
        writer.apply((self,), stream=stream)

    # -- the owner contract of ``gpu`` (jaxbuf._owner.MemoryOwner) ----------------------------
    @property
    def driver(self) -> VmmDriver:
        return self._driver

    @property
    def ready_event(self) -> Any:
        """The event after the last applied writes (a consumer stream waits on it)."""
        applied = self._applied
        return None if applied is None else applied.handle

    def check_exportable(self) -> None:
        if self._freed:
            raise RuntimeError("the StagedWriteTensor is freed")

    @property
    def export_anchor(self) -> object:
        # This tensor, not its target's anchor: collecting the tensor frees the target
        # (__del__), so exports must keep the tensor itself alive until issue 12's anchors.
        return self

    # -- the target ------------------------------------------------------------------------
    @property
    def gpu(self) -> BufferView:
        """The target as a DLPack-consumable view (shape ``size``, dtype ``dtype``)."""
        self._check_open()
        return self._view

    def to_torch(self) -> Any:
        """A torch tensor aliasing the target, ordered after the applied writes."""
        return self.gpu.to_torch()

    def to_jax(self) -> Any:
        """A JAX array aliasing the target (keep the tensor open while it lives)."""
        return self.gpu.to_jax()

    def to_numpy(self) -> np.ndarray:
        """A numpy array aliasing the target: CPU targets only (``BufferError`` on a GPU)."""
        return self.gpu.to_numpy()

    def _check_open(self) -> None:
        if self._freed:
            raise ValueError("the StagedWriteTensor is freed")

    def free(self) -> None:
        """Wait for applied writes, release the target and the staging slots. Idempotent."""
        if not self._freed:
            self._freed = True
            self.clear_staged_writes()
            self.num_rows = 0  # every later stage_write fails its bounds check (and says why)
            if self._stager is not None:
                self._stager.close()
            self._group_entry = None
        elif self._writer is None and self._target is None:
            return
        # Each part is dropped only once it is freed: after a driver error, free() again
        # frees what is left.
        try:
            applied = self._applied
            if applied is not None:
                applied.wait()
                self._applied = None
        finally:
            try:
                writer = self._writer
                if writer is not None:
                    writer.close()
                    self._writer = None
            finally:
                target = self._target
                if target is not None:
                    target.free()
                    self._target = None

    close = free

    @property
    def freed(self) -> bool:
        return self._freed

    def __enter__(self) -> StagedWriteTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def __del__(self, _release: Any = release_when_collected) -> None:
        if not getattr(self, "_freed", True):
            _release(self.free, "a StagedWriteTensor")

    def __repr__(self) -> str:
        state = ", freed" if self._freed else f", staged={self.num_staged_writes}"
        return (f"StagedWriteTensor(shape={self.shape}, dtype={self.dtype}, "
                f"device={self.device}{state})")  # fmt: skip


# -- the fused writer ------------------------------------------------------------------------
class _Layout:
    """What a writer caches per distinct list of targets: the group table and row bound."""

    __slots__ = ("group_table", "group_bytes", "group_ids", "itemsizes", "itemsize_list",
                 "uniform_itemsize")  # fmt: skip

    def __init__(self, entries: Sequence[tuple]) -> None:
        # entries: (out_ptr, row_stride, elem_size, num_rows, device) per group
        self.group_table = np.array([e[:3] for e in entries], dtype=np.int64).reshape(-1)
        self.group_bytes = self.group_table.tobytes()
        self.group_ids = np.arange(len(entries), dtype=np.int64)
        self.itemsize_list = [e[2] for e in entries]
        self.itemsizes = np.array(self.itemsize_list, dtype=np.int64)
        self.uniform_itemsize = self.itemsize_list[0] if len(set(self.itemsize_list)) == 1 else 0


class FusedStagedWriter:
    """Applies the staged writes of several :class:`StagedWriteTensor` with one launch.

    Each apply builds the kernel's tables and packs every tensor's staged bytes into the next
    of ``max_concurrency`` pinned (UVA) staging slots, which the kernel reads in place; a slot
    grows (to a power of two) when an apply needs more. Tensors may have different dtypes.

    **Slot reuse.** A slot is written again ``max_concurrency`` applies later. With
    ``guarded=True`` (the default) the host first waits for the event recorded after that
    slot's launch, so a deep queue of applies stalls the host instead of corrupting an
    in-flight read (the check costs one event query). With ``guarded=False`` (the seed's
    contract) callers must not have more than ``max_concurrency`` applies in flight.

    Thread-safety: not thread-safe; one thread drives a writer.

    Parameters
    ----------
    device : device spec
    max_writes : int
        Writes per apply the slots are first sized for (they grow beyond).
    max_concurrency : int, optional
        Number of staging slots; default 2.
    backend : {"triton", "numpy"}
        ``"triton"``: the Triton kernel (compiled on CUDA, under Triton's interpreter on the
        CPU). ``"numpy"``: :func:`jaxbuf.kernels.apply_staged_writes_numpy`, CPU only; it is
        never chosen silently.
    guarded : bool
    driver : VmmDriver, optional
    """

    def __init__(
        self,
        device: Any,
        max_writes: int,
        max_concurrency: int | None = None,
        *,
        backend: str = "triton",
        guarded: bool = True,
        driver: VmmDriver | None = None,
    ) -> None:
        self._slots: list[Any] = []
        self._closed = True
        max_writes = _as_index(max_writes, "max_writes")
        if not 1 <= max_writes < 1 << 31:  # one launch counts its writes in int32
            raise ValueError(f"max_writes must be in [1, 2**31), got {max_writes}")
        max_concurrency = _check_max_concurrency(max_concurrency)
        device, driver = resolve(device, driver)
        self.backend = _check_backend(backend, device)
        self.device = device
        self.max_writes = max_writes
        self.max_concurrency = max_concurrency
        self.guarded = bool(guarded)
        self._driver = driver
        self._is_cuda = device.is_cuda
        # Room for the tables plus ~16 four-byte elements per write; slots grow beyond.
        self._initial_slot_bytes = 1 << (max_writes * (_WRITE_FIELDS * 8 + 64) + 4096
                                         - 1).bit_length()  # fmt: skip
        # Slots are made on first use (and regrown), so a capacity of 0 means "none yet".
        self._slots = [None] * max_concurrency
        self._slot_i64: list[np.ndarray | None] = [None] * max_concurrency
        self._slot_hosts = [0] * max_concurrency  # host addresses (the packer writes there)
        self._slot_ptrs = [0] * max_concurrency  # device-visible addresses (the kernel reads)
        self._slot_capacities = [0] * max_concurrency
        self._slot_events: list[_AppliedEvent | None] = [None] * max_concurrency
        # Row-segment bounds of a slot's serial (overlapping) apply, made when first needed.
        self._segment_buffers: list[Any] = [None] * max_concurrency
        self._curr = max_concurrency - 1
        self._layouts: dict[tuple, _Layout] = {}
        self._launch = _make_launcher(self.backend, device)
        self._closed = False

    # -- the hot path ------------------------------------------------------------------------
    def apply(self, tensors: Sequence[StagedWriteTensor], output_ptrs: Any = None,
              output_strides: Any = None, stream: Any = None) -> None:  # fmt: skip
        """Apply and clear the staged writes of ``tensors`` with one kernel launch.

        ``tensors`` may repeat no tensor; those with nothing staged cost nothing. As in the
        seed, ``output_ptrs`` / ``output_strides`` (sequences of ints, one per tensor) may
        redirect each tensor's writes to another address and row stride (in elements) of the
        same dtype; the caller then vouches for the bounds, and that no two targets overlap
        (overlap is detected within each tensor's writes). On CUDA the launch is enqueued on
        ``stream`` (a ``torch.cuda.Stream`` or a CUDA stream handle int) or torch's current
        stream, and every written tensor's ready event is recorded there, so DLPack consumers
        that pass their stream see the writes. Writes staged earlier take effect first; where
        two overlap the later wins. A tensor's staged writes are cleared only once the launch
        was enqueued.
        """
        if (output_ptrs is None) != (output_strides is None):
            raise ValueError("output_ptrs and output_strides go together; pass both or neither")
        try:
            staged_bytes = [len(t._records) for t in tensors]
        except (AttributeError, TypeError):
            raise TypeError(
                f"tensors must be a sequence of StagedWriteTensor, got {tensors!r}"
            ) from None
        if not sum(staged_bytes):
            return
        if self._closed:
            raise ValueError("the FusedStagedWriter is closed")
        if output_ptrs is None:
            key = tuple([t._group_entry for t in tensors])
        else:
            key = self._external_key(tensors, output_ptrs, output_strides)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._new_layout(tensors, key)
        num_groups = len(staged_bytes)

        i = self._curr + 1
        if i == self.max_concurrency:
            i = 0
        event = self._slot_events[i]
        if event is not None and self.guarded:
            event.wait()  # the device still reads this slot's previous apply
        if _pack is not None:
            stagers = [t._stager for t in tensors]
            num_writes, contents_start, total, repeated = _pack(
                stagers, layout.group_bytes, self._slot_hosts[i], self._slot_capacities[i])
            if total > self._slot_capacities[i]:
                self._grow(i, total, event)
                num_writes, contents_start, total, repeated = _pack(
                    stagers, layout.group_bytes, self._slot_hosts[i], self._slot_capacities[i])
        else:
            stagers = None
            num_writes, contents_start, total, bases, padded = _plan(tensors, staged_bytes,
                                                                     layout)  # fmt: skip
            if total > self._slot_capacities[i]:
                self._grow(i, total, event)
            repeated = _pack_numpy(tensors, staged_bytes, layout, self._slot_i64[i],
                                   num_writes, contents_start, bases, padded)  # fmt: skip
        self._slot_events[i] = None
        self._curr = i

        table_addr = self._slot_ptrs[i] + num_groups * _GROUP_FIELDS * 8
        group_addr = self._slot_ptrs[i]
        contents_addr = self._slot_ptrs[i] + contents_start
        serial = repeated and self._overlaps(i, num_groups, num_writes)
        segments = num_segments = 0
        if serial:
            segments, num_segments = self._row_segments(i, num_groups, num_writes, event)
        if self._is_cuda:
            driver, index = self._driver, self.device.index
            # The launch needs the device's context current in this thread (a fresh thread
            # has none); one cuCtxGetCurrent when it already is.
            driver.ensure_context(index)
            raw_stream = _raw_stream(stream, self.device)
            dlpack_stream = raw_stream or 1  # DLPack and CUDA agree on 1 (legacy) and 2
            # A tensor last written on another stream: order this launch after those writes.
            for t in tensors:
                applied = t._applied
                if applied is not None and applied.stream != dlpack_stream:
                    driver.stream_wait_event(dlpack_stream, applied.handle, index)
            self._launch(table_addr, group_addr, contents_addr, num_writes, serial, raw_stream,
                         None, None, segments=segments, num_segments=num_segments)  # fmt: skip
            # Enqueued: the writes are applied whatever fails next, so no longer staged.
            _clear_staged(tensors, stagers)
            try:
                handle = driver.record_event(dlpack_stream, index)
            except BaseException as error:
                self._synchronize_without_event(tensors, error)
                raise
            event = _AppliedEvent(driver, handle, dlpack_stream)
            self._slot_events[i] = event
            for t, n in zip(tensors, staged_bytes):
                if n:
                    t._applied = event
        else:
            tables = self._tables(i, num_groups, num_writes)
            self._launch(table_addr, group_addr, contents_addr, num_writes, serial, 0, *tables,
                         segments=segments, num_segments=num_segments)  # fmt: skip
            _clear_staged(tensors, stagers)

    def _synchronize_without_event(self, tensors: Sequence[StagedWriteTensor],
                                   error: BaseException) -> None:  # fmt: skip
        """The launch is enqueued but its event could not be recorded. With no event to wait
        on, the device is synchronized here so that the slot and the targets are safe to
        reuse; ``error`` gets notes saying so."""
        for t in tensors:
            t._applied = None
        what = "synchronizing after the failed event record"
        attempt(error, what, self._driver.synchronize, self.device.index)
        error.add_note("the staged writes were launched and are applied; they are no longer "
                       "staged")  # fmt: skip

    def _tables(self, i: int, num_groups: int, num_writes: int) -> tuple[np.ndarray, np.ndarray]:
        """Numpy views of slot ``i``'s write table and group table."""
        i64, table_start = self._slot_i64[i], num_groups * _GROUP_FIELDS
        return (i64[table_start: table_start + num_writes * _WRITE_FIELDS]
                .reshape(num_writes, _WRITE_FIELDS),
                i64[:table_start].reshape(num_groups, _GROUP_FIELDS))  # fmt: skip

    def _overlaps(self, i: int, num_groups: int, num_writes: int) -> bool:
        """Some row is written twice: whether two writes touch the same element."""
        from .kernels import has_overlap

        table = self._tables(i, num_groups, num_writes)[0]
        return has_overlap(table[:, 0], table[:, 1], table[:, 2], table[:, 4])

    def _row_segments(self, i: int, num_groups: int, num_writes: int,
                      event: _AppliedEvent | None) -> tuple[int, int]:  # fmt: skip
        """Group slot ``i``'s writes by target row, in order, for a serial launch (one program
        per row, so rows still run in parallel). Returns the device address of the segment
        bounds (in a pinned buffer kept with the slot) and the number of segments."""
        from .kernels import row_segments
        from .uva import UvaBuffer

        bounds = row_segments(self._tables(i, num_groups, num_writes)[0])
        buffer = self._segment_buffers[i]
        if buffer is None or len(buffer) < bounds.size:
            if event is not None:
                event.wait()  # the old buffer is freed: its reader must be done
            if buffer is not None:
                buffer.free()
            size = 1 << (bounds.size - 1).bit_length()
            buffer = self._segment_buffers[i] = UvaBuffer(size, "int64", self.device,
                                                          driver=self._driver)  # fmt: skip
        buffer.np[: bounds.size] = bounds
        return buffer.device_ptr, bounds.size - 1

    # -- slots -----------------------------------------------------------------------------
    def _grow(self, i: int, nbytes: int, event: _AppliedEvent | None) -> None:
        """Replace slot ``i`` by one of at least ``nbytes`` (a power of two)."""
        from .uva import UvaBuffer

        if event is not None:
            event.wait()  # the old slot is freed: its reader must be done, guarded or not
        size = max(self._initial_slot_bytes, 1 << (nbytes - 1).bit_length())
        slot = UvaBuffer(size, "uint8", self.device, driver=self._driver)
        old, self._slots[i] = self._slots[i], slot
        self._slot_i64[i] = slot.np.view(np.int64)
        self._slot_hosts[i] = slot.host_ptr
        self._slot_ptrs[i] = slot.device_ptr
        self._slot_capacities[i] = size
        if old is not None:
            old.free()

    # -- layouts ---------------------------------------------------------------------------
    def _external_key(self, tensors: Sequence[StagedWriteTensor], output_ptrs: Any,
                      output_strides: Any) -> tuple:  # fmt: skip
        ptrs = [_as_index(p, "output_ptrs entry") for p in _host_ints(output_ptrs)]
        strides = [_as_index(s, "output_strides entry") for s in _host_ints(output_strides)]
        if not len(ptrs) == len(strides) == len(tensors):
            raise ValueError(f"{len(tensors)} tensors but {len(ptrs)} output_ptrs and "
                             f"{len(strides)} output_strides")  # fmt: skip
        entries = []
        for t, ptr, stride in zip(tensors, ptrs, strides):
            entry = t._group_entry
            if entry is None:
                raise ValueError(f"{t!r} is freed")
            if ptr % entry[2] or stride < 0:
                raise ValueError(f"output pointer {ptr:#x} / stride {stride} do not suit "
                                 f"{t.dtype} elements")  # fmt: skip
            entries.append((ptr, stride, *entry[2:]))
        return tuple(entries)

    def _new_layout(self, tensors: Sequence[StagedWriteTensor], key: tuple) -> _Layout:
        seen = set()
        for t in tensors:
            if not isinstance(t, StagedWriteTensor):
                raise TypeError(f"tensors must be StagedWriteTensor, got {type(t).__name__}")
            if t._freed:
                raise ValueError(f"{t!r} is freed")
            if t.device != self.device:
                raise ValueError(f"{t!r} is on {t.device}; this writer applies on {self.device}")
            if id(t) in seen:
                raise ValueError(f"{t!r} appears twice in one apply")
            seen.add(id(t))
        if len(self._layouts) >= _MAX_CACHED_LAYOUTS:
            self._layouts.clear()
        layout = self._layouts[key] = _Layout(key)
        return layout

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight applies, free the staging slots. Idempotent.

        Best effort: a slot whose free fails (a driver error) stays, and the next
        ``close()`` retries it; the first error is raised, the others attached as notes."""
        slots, buffers, events = self._slots, self._segment_buffers, self._slot_events
        if self._closed and not any(x is not None for x in (*slots, *buffers, *events)):
            return
        self._closed = True
        for i, event in enumerate(events):
            if event is not None:
                event.wait()
                events[i] = None
        self._slot_i64 = [None] * len(slots)
        self._slot_capacities = [0] * len(slots)
        cleanup = Cleanup("FusedStagedWriter.close")
        for held in (slots, buffers):
            for i, slot in enumerate(held):
                if slot is not None and cleanup.run(slot.free):
                    held[i] = None
        cleanup.raise_first()

    free = close

    def __enter__(self) -> FusedStagedWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _release: Any = release_when_collected) -> None:
        if not getattr(self, "_closed", True):
            _release(self.close, "a FusedStagedWriter")


def _plan(tensors: Sequence[StagedWriteTensor], staged_bytes: Sequence[int],
          layout: _Layout) -> tuple:  # fmt: skip
    """The slot layout of an apply (what ``_staging.pack`` computes in C): group table, write
    table, then each tensor's values at an offset aligned to its element size."""
    num_groups = len(staged_bytes)
    num_writes = sum(staged_bytes) // _RECORD_BYTES
    contents_start = (num_groups * _GROUP_FIELDS + num_writes * _WRITE_FIELDS) * 8
    bases, padded, offset = [], False, 0
    for t, itemsize in zip(tensors, layout.itemsize_list):
        aligned = -(-offset // itemsize) * itemsize
        padded = padded or aligned != offset
        bases.append(aligned)
        offset = aligned + len(t._contents)
    return num_writes, contents_start, contents_start + offset, bases, padded


def _pack_numpy(tensors: Sequence[StagedWriteTensor], staged_bytes: Sequence[int],
                layout: _Layout, i64: np.ndarray, num_writes: int, contents_start: int,
                bases: Sequence[int], padded: bool) -> bool:  # fmt: skip
    """``_staging.pack`` in numpy: fill the slot; True when some row is written twice."""
    num_groups = len(staged_bytes)
    table_start = num_groups * _GROUP_FIELDS
    i64[:table_start] = layout.group_table
    flat = i64[table_start: contents_start // 8]
    u8 = i64.view(np.uint8)
    counts = [n // _RECORD_BYTES for n in staged_bytes]
    begin = 0
    for t, n, base in zip(tensors, counts, bases):
        if n:
            # Views of the staging buffers live only inside these statements: a buffer with
            # a live export cannot grow, and the next stage_write must.
            flat[begin * _WRITE_FIELDS: (begin + n) * _WRITE_FIELDS] = np.frombuffer(
                t._records, np.int64)
            at = contents_start + base
            u8[at: at + len(t._contents)] = np.frombuffer(t._contents, np.uint8)
            begin += n
    table = flat.reshape(num_writes, _WRITE_FIELDS)
    groups = np.repeat(layout.group_ids, counts)
    table[:, 0] = groups
    lengths = table[:, 4]
    if layout.uniform_itemsize:
        byte_lengths = lengths * layout.uniform_itemsize
    else:
        byte_lengths = lengths * np.repeat(layout.itemsizes, counts)
    ends = np.cumsum(byte_lengths)
    if padded:  # shift each group's offsets by its padding so far
        unpadded, shifts = 0, []
        for t, base in zip(tensors, bases):
            shifts.append(base - unpadded)
            unpadded += len(t._contents)
        ends += np.repeat(np.array(shifts, np.int64), counts)
    np.subtract(ends, byte_lengths, out=table[:, 3])
    # Repeated (group, row) pairs: a stable sort by key puts them side by side.
    keys = np.sort(groups * (1 + int(table[:, 1].max())) + table[:, 1])
    return bool((keys[1:] == keys[:-1]).any())


def _clear_staged(tensors: Sequence[StagedWriteTensor], stagers: Any) -> None:
    """Clear the staged writes of ``tensors`` (``stagers``: their C stagers, or None)."""
    if stagers is not None:
        _clear(stagers)
    else:
        for t in tensors:
            t.clear_staged_writes()


def _host_ints(values: Any) -> list:
    """A sequence, numpy array or framework array (torch, JAX, any device) as a list."""
    if type(values) is list or type(values) is tuple:
        return list(values)
    adapter = interop.adapter_for(values)
    if adapter is not None:
        return adapter.to_numpy(values).tolist()
    return list(values)


def _raw_stream(stream: Any, device: Device) -> int:
    """The CUDA stream handle to launch on: ``stream``'s, or the current stream of the loaded
    framework that has one (torch's: :func:`jaxbuf.interop.current_stream`), 0 for the legacy
    default stream."""
    if stream is None:
        dlpack_stream = interop.current_stream(device)
        # DLPack numbers the legacy default stream 1; CUDA's handle for it is 0. Any other
        # number (2, the per-thread stream, or a handle) is the CUDA handle itself.
        return 0 if dlpack_stream == interop.DLPACK_LEGACY_STREAM else dlpack_stream
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(f"stream must be a torch.cuda.Stream or a CUDA stream handle, got {stream!r}")
    return handle


# -- launchers ---------------------------------------------------------------------------------
def _make_launcher(backend: str, device: Device):
    """``launch(write_table_addr, group_table_addr, contents_addr, num_writes, serial,
    raw_stream, write_table_np, group_table_np)`` for ``backend`` on ``device``."""
    if backend == "numpy":
        from .kernels import apply_staged_writes_numpy

        def launch_numpy(wt, gt, contents, num_writes, serial, raw_stream, wt_np, gt_np,
                         segments=0, num_segments=0):  # fmt: skip
            # In table order: row-grouped serial tables keep each row's order, so later wins.
            apply_staged_writes_numpy(wt_np, gt_np, contents, num_writes)

        return launch_numpy
    if not device.is_cuda:
        from .kernels import IntsAt, apply_staged_writes

        def launch_interpreted(wt, gt, contents, num_writes, serial, raw_stream, wt_np, gt_np,
                               segments=0, num_segments=0):  # fmt: skip
            apply_staged_writes(wt, gt, contents, num_writes, serial=serial,
                                segments=IntsAt(segments, num_segments + 1) if serial else None,
                                block_size=_BLOCK_SIZE, interpret=True)  # fmt: skip

        return launch_interpreted
    from .kernels.staged_write import CompiledLauncher

    return CompiledLauncher(device.index, block_size=_BLOCK_SIZE)
