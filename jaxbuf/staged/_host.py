"""Staging on the host: argument checks, value conversion, and a tensor's staging state.

What :class:`~jaxbuf.staged.StagedWriteTensor` and :class:`~jaxbuf.fused.FusedStagedWriter`
share below the public classes:

* the checks of their constructor arguments (shape, dtype, backend, ``max_concurrency``);
* the conversion of ``values`` to the target dtype: the slow path of ``stage_write``, which
  refuses any value the conversion would change beyond a float's rounding;
* :class:`StagingState`, a tensor's staged writes (two ``bytearray``\\ s) and the C stager over
  them: the whole interface between a tensor and the writers that apply it;
* the optional C extension ``jaxbuf._staging`` (``Stager``, ``pack``, ``clear``); every name
  is None without it, and the Python paths do everything it does, only slower. The stager also
  indexes the staged writes by row as they come, so that packing resolves overlapping writes
  (later wins) without sorting; see ``jaxbuf/_staging.c``.

Nothing here allocates device memory or launches anything.
"""

from __future__ import annotations

import importlib.util
import math
import struct
from typing import Any

import numpy as np

from . import interop
from ._checks import as_int as as_index
from ._checks import as_max_concurrency
from .devices import Device
from .dtypes import DType, canonical_dtype

try:  # the C fast paths (optional: the Python/numpy paths do everything they do)
    from ._staging import Stager as _Stager
    from ._staging import clear as c_clear
    from ._staging import expand_elements as c_expand_elements
    from ._staging import pack as c_pack
except ImportError:  # pragma: no cover - built by setup.py wherever a compiler is
    _Stager = c_clear = c_pack = c_expand_elements = None

#: Target dtypes a StagedWriteTensor accepts.
SUPPORTED_DTYPES = ("int32", "int64", "float32", "float16", "bfloat16")
#: ``backend`` values: the Triton kernel (compiled on CUDA, interpreted on the CPU) or the
#: numpy reference (CPU only, chosen explicitly).
BACKENDS = ("triton", "numpy")

GROUP_FIELDS = 3  # a row of the kernel's group table: out_ptr, row_stride, elem_size
WRITE_FIELDS = 5  # a row of its write table: group, row, start, content_offset (bytes), length
RECORD_BYTES = WRITE_FIELDS * 8
#: One staged write as a row of the kernel's write table (int64 fields), packed in C.
pack_record = struct.Struct(f"={WRITE_FIELDS}q").pack
#: struct codes for the scalar fast path of stage_write_elem (bfloat16 has none).
STRUCT_CODES = {"int32": "=i", "int64": "=q", "float32": "=f", "float16": "=e"}


class FreedError(RuntimeError, ValueError):
    """Use of a freed :class:`~jaxbuf.staged.StagedWriteTensor` or a closed
    :class:`~jaxbuf.fused.FusedStagedWriter`.

    A ``RuntimeError``, as the owner contract says of every freed owner, and a ``ValueError``,
    which earlier releases raised here: handlers written for either keep working.
    """


# -- argument checks -------------------------------------------------------------------------
def target_shape(size: Any) -> tuple[tuple[int, ...], int, int]:
    """``(shape, num_rows, row_len)`` for ``size``: an int n (a 1-D target of n rows of one
    element, as in the seed) or ``(num_rows, row_len)``."""
    if isinstance(size, (tuple, list)):
        dims = tuple(as_index(d, "size") for d in size)
        if len(dims) == 1:
            dims = (dims[0],)
        elif len(dims) != 2:
            raise ValueError(f"size must be an int or (num_rows, row_len), got {size!r}")
    else:
        dims = (as_index(size, "size"),)
    if any(d < 0 for d in dims):
        raise ValueError(f"size must be non-negative, got {size!r}")
    if math.prod(dims) >= 1 << 60:  # times an itemsize of up to 8: past int64 / size_t
        raise ValueError(f"size {size!r} is too large: {math.prod(dims)} elements")
    if len(dims) == 1:
        return dims, dims[0], 1
    return dims, dims[0], dims[1]


def check_dtype(dtype: Any) -> DType:
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


check_max_concurrency = as_max_concurrency


def check_backend(backend: Any, device: Device) -> str:
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
        ends = (values[0], values[-1]) if len(values) else (0, 0)
        if not (min(ends) >= -(2**63) and max(ends) < 2**63):
            raise ValueError(f"{values!r} does not fit in int64")
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    adapter = interop.adapter_for(values)
    if adapter is not None:
        # A framework's array (torch, JAX, ...): staging data lives on the host, so a device
        # array is copied there.
        return adapter.to_numpy(values)
    not_a_sequence = (str, bytes, bytearray, memoryview, dict, set, frozenset)
    if isinstance(values, not_a_sequence) or not hasattr(values, "__iter__"):
        raise TypeError(
            "values must be a list, tuple, range, generator, numpy array, torch tensor or JAX "
            f"array of numbers, got {type(values).__name__}"
            + ("; use stage_write_elem for one value" if np.isscalar(values) else "")
        )
    items = list(values)  # a generator or another iterable, consumed once
    return np.asarray(items) if items else np.empty(0, np.int64)


def convert(values: Any, dtype: np.dtype, type_name: str) -> np.ndarray:
    """``values`` as a C-contiguous 1-D array of ``dtype``, or ValueError / TypeError when
    that would change a value beyond a float's rounding (see ``StagedWriteTensor.stage_write``).
    """
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
        return _convert_to_int(source, dtype, type_name)
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


def _convert_to_int(source: np.ndarray, dtype: np.dtype, type_name: str) -> np.ndarray:
    """:func:`convert` to an integer dtype: exact integers in range only."""
    info = np.iinfo(dtype)
    if source.dtype.kind in "iu":
        if not np.can_cast(source.dtype, dtype, casting="safe"):
            low, high = int(source.min()), int(source.max())
            if low < info.min or high > info.max:
                bad = (source < info.min) | (source > info.max)
                raise ValueError(f"value {_first_bad(bad, source)} is out of range for {type_name}")
        return source.astype(dtype)
    wide = source.astype(np.float64)
    bad = ~np.isfinite(wide)
    if bad.any():
        raise ValueError(
            f"value {_first_bad(bad, source)} cannot be written to a {type_name} tensor"
        )
    bad = np.trunc(wide) != wide
    if bad.any():
        raise ValueError(
            f"value {_first_bad(bad, source)} is not an integer; writing it to a {type_name} "
            "tensor would truncate it"
        )
    # Powers of two, exact in float64: values must lie in [min, max + 1).
    bad = (wide < float(info.min)) | (wide >= float(info.max) + 1.0)
    if bad.any():
        raise ValueError(f"value {_first_bad(bad, source)} is out of range for {type_name}")
    return wide.astype(dtype)


# -- a tensor's staging state ----------------------------------------------------------------
class StagingState:
    """A tensor's staged writes, and everything a writer may know of the tensor.

    This object is the whole interface between a ``StagedWriteTensor`` and the
    ``FusedStagedWriter`` that applies it (the tensor exposes it as ``_staging``; a writer
    touches nothing else of it). A writer reads ``records``, ``contents``, ``stager`` and
    ``group_entry``, clears the staged writes once its launch is enqueued (:meth:`clear`, or
    ``jaxbuf._staging.clear`` over the stagers), and sets ``applied``.

    ``records``
        ``bytearray``: one packed row of the kernel's write table per staged write (group,
        row, start, content_offset, length as int64); staging writes only row, start and
        length, the writer fills group and offset in its copy.
    ``contents``
        ``bytearray``: the staged values' bytes, in staging order, already of the target
        dtype. Both buffers are cleared in place, never replaced (bound methods of them are
        cached on the hot path).
    ``stager``
        The C ``jaxbuf._staging.Stager`` over the two buffers and the bounds, or None without
        the extension. It indexes every record appended to ``records`` (by itself or by the
        Python paths) by row; whoever empties the buffers resets it (:meth:`clear`, or
        ``jaxbuf._staging.clear``).
    ``group_entry``
        ``(out_ptr, row_stride, elem_size, num_rows, device)``: the writer's group-table row
        for the target and its layout-cache key; None once the tensor is freed.
    ``applied``
        The event (``jaxbuf._launch.AppliedEvent``) recorded after the last launch that wrote
        the target, or None: the tensor's ready event, and what a launch on another stream
        waits for.
    """

    __slots__ = ("records", "contents", "stager", "group_entry", "applied")

    def __init__(self, num_rows: int, row_len: int, dtype: np.dtype) -> None:
        self.records = bytearray()
        self.contents = bytearray()
        self.stager = _new_stager(self.records, self.contents, num_rows, row_len, dtype)
        self.group_entry: tuple | None = None
        self.applied: Any = None

    @property
    def num_writes(self) -> int:
        return len(self.records) // RECORD_BYTES

    def clear(self) -> None:
        """Drop the staged writes (and the C stager's index of them)."""
        del self.records[:]
        del self.contents[:]
        if self.stager is not None:
            self.stager.reset()

    def close(self) -> None:
        """The tensor is freed: drop the staged writes, refuse every later fast-path stage
        (the Python path says why) and every writer (``group_entry`` None)."""
        self.clear()
        self.group_entry = None
        if self.stager is not None:
            self.stager.close()


def _new_stager(
    records: bytearray, contents: bytearray, num_rows: int, row_len: int, dtype: np.dtype
) -> Any:
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
