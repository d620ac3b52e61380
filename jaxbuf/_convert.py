"""Converting input values to a target dtype, refusing what the conversion would change.

One rule for every owner that takes values from users: the UVA pools (``copy_to_uva``) and the
staged writes (``stage_write``'s slow path, ``StagedWrites``). :func:`convert` returns a
C-contiguous 1-D numpy array of the target dtype, or raises ValueError / TypeError naming the
first value that would change beyond a float's rounding: integers out of range; non-integral,
NaN or infinite floats to an integer dtype (integral floats such as ``3.0`` are accepted);
finite values that overflow a float dtype; complex values to a real dtype, strings, objects.
Bools are 0 and 1. A complex target follows the float rule on each component (rounding and
NaN accepted, a finite value overflowing refused).

Below the buffers and the staged writes: imports only the framework adapters' lookup (to take
a torch tensor or a JAX array as input).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import interop

__all__ = ["convert", "convert_any", "convert_batch"]


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


def convert_any(values: Any, dtype: np.dtype, type_name: str) -> np.ndarray:
    """:func:`convert` for any numpy dtype: the staged-write dtypes through :func:`convert`;
    others (bool, complex) through numpy's conversion, refused where it changes a value."""
    if dtype.kind in "iuf" or dtype.name == "bfloat16":
        return convert(values, dtype, type_name)
    if dtype.kind == "c":
        return _convert_to_complex(values, dtype, type_name)
    source = np.asarray(values).reshape(-1) if np.ndim(values) <= 1 else np.asarray(values)
    if source.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {source.shape}")
    converted = np.ascontiguousarray(source.astype(dtype))
    if not np.array_equal(converted, source):
        raise ValueError(f"values do not fit {dtype} exactly")
    return converted


def _convert_to_complex(values: Any, dtype: np.dtype, type_name: str) -> np.ndarray:
    """:func:`convert_any` to a complex dtype, by the float rule applied to each component:
    rounding (complex128 to complex64) and NaN are accepted, as for float32; a finite value
    that overflows to infinity is refused, naming it. Bool, integer, float and complex
    inputs (numpy's same-kind casting); anything else is a TypeError."""
    source = _to_numpy(values)
    if source.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {source.shape}")
    if not (source.dtype.kind in "biufc" or source.dtype.name == "bfloat16"):
        raise TypeError(f"values of dtype {source.dtype} cannot be written to a {type_name} tensor")
    wide = source.astype(np.complex128) if source.dtype.kind != "c" else source
    with np.errstate(over="ignore", invalid="ignore"):
        result = np.ascontiguousarray(wide.astype(dtype))
        bad = (np.isinf(result.real) & np.isfinite(wide.real)) | (
            np.isinf(result.imag) & np.isfinite(wide.imag)
        )
    if bad.any():
        raise ValueError(f"value {_first_bad(bad, source)} overflows {type_name}")
    return result


def convert_batch(
    values_list: Any, count: int, dtype: np.dtype, type_name: str
) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` writes of ``values_list`` (a sequence of 1-D values, or one 2-D numpy
    array) converted by :func:`convert_any` and laid back to back, and their lengths (int64).

    One numpy concatenation and one conversion when numpy's promotion of the inputs to a
    common dtype loses nothing (then converting the whole equals converting each); else, and
    to name the write a conversion refuses (``write i: ...``), one write at a time."""
    if isinstance(values_list, np.ndarray) and values_list.ndim == 2:
        lengths = np.full(count, values_list.shape[1], np.int64)
        try:
            return convert_any(values_list.reshape(-1), dtype, type_name), lengths
        except (TypeError, ValueError):
            pass  # name the write below
    else:
        try:
            lengths = np.fromiter(map(len, values_list), np.int64, count)
            flat = np.concatenate(values_list)
        except (TypeError, ValueError):  # unsized items, scalars, mixed dimensions, ...
            flat = None
        if (
            flat is not None
            and flat.ndim == 1
            and flat.shape[0] == lengths.sum()
            and _promotion_lost_nothing(flat, dtype)
        ):
            try:
                return convert_any(flat, dtype, type_name), lengths
            except (TypeError, ValueError):
                pass  # name the write below
    arrays = []
    for i, values in enumerate(values_list):
        try:
            arrays.append(convert_any(values, dtype, type_name))
        except (TypeError, ValueError) as error:
            raise type(error)(f"write {i}: {error}") from None
    lengths = np.fromiter((a.shape[0] for a in arrays), np.int64, count)
    return np.concatenate(arrays), lengths


def _promotion_lost_nothing(flat: np.ndarray, target: np.dtype) -> bool:
    """Whether ``flat``, numpy's concatenation of the inputs, holds their values exactly
    enough that one conversion of it equals the conversions of each input."""
    kind = flat.dtype.kind
    if flat.dtype == target or kind in "iub":
        return True  # integer promotion is exact; promotion to the target is what each does
    if kind == "f" or flat.dtype.name == "bfloat16":
        if target.kind == "f" or target.name == "bfloat16":
            return True  # each input rounds to the target anyway
        # An integer target: integers promoted to float64 are exact below 2**53.
        with np.errstate(invalid="ignore"):
            return bool(np.all(np.abs(flat.astype(np.float64)) < 2.0**53))
    return False
