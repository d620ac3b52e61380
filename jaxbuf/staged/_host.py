"""Staging on the host: argument checks and a tensor's staging state.

What :class:`~jaxbuf.StagedWriteTensor`, :class:`~jaxbuf.FusedStagedWriter` and the JAX wing's
``StagedWrites`` share below the public classes:

* the checks of their constructor arguments (shape, dtype, backend, ``max_concurrency``);
* (the conversion of ``values`` to the target dtype, the slow path of ``stage_write``, is
  :func:`jaxbuf._convert.convert`, below the buffers and the staged writes alike);
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

from .._checks import as_int as as_index
from .._checks import as_max_concurrency
from .._errors import ClosedError
from ..devices import Device
from ..dtypes import DType, canonical_dtype

try:  # the C fast paths (optional: the Python/numpy paths do everything they do)
    from .._staging import Stager as _Stager
    from .._staging import clear as c_clear
    from .._staging import expand_elements as c_expand_elements
    from .._staging import pack as c_pack
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


class FreedError(ClosedError):
    """Use of a freed :class:`~jaxbuf.StagedWriteTensor` or a closed
    :class:`~jaxbuf.FusedStagedWriter`: the staged writes' :class:`jaxbuf.ClosedError`
    (a ``RuntimeError`` and a ``ValueError``, as every owner's), kept by its own name for
    handlers written for it."""


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


# -- a tensor's staging state ----------------------------------------------------------------
class StagingState:
    """A tensor's staged writes, and everything a writer may know of the tensor.

    This object is the whole interface between a ``StagedWriteTensor`` and the
    ``FusedStagedWriter`` that applies it (the tensor exposes it as ``staging``; a writer
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
        The event (``jaxbuf.staged._launch.AppliedEvent``) recorded after the last launch that wrote
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
