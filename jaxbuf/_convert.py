"""Converting input values to a target dtype, refusing what the conversion would change.

One rule for every owner that takes values from users: the UVA pools (``copy_to_uva``) and the
staged writes (``stage_write``'s slow path, ``StagedWrites``). :func:`convert` returns a
C-contiguous 1-D numpy array of the target dtype, or raises ValueError / TypeError naming the
first value that would change beyond a float's rounding: integers out of range; non-integral,
NaN or infinite floats to an integer dtype (integral floats such as ``3.0`` are accepted);
finite values that overflow a float dtype; complex, string or object values. Bools are 0 and 1.

Below the buffers and the staged writes: imports only the framework adapters' lookup (to take
a torch tensor or a JAX array as input).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import interop

__all__ = ["convert"]


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
