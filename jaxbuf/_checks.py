"""Argument checks shared by the public entry points: ints and shapes, named in every error.

Bad input raises ``TypeError`` / ``ValueError`` naming the value before anything changes; numpy
integers are accepted, bools are not (``True`` is an int to Python, never a size here).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def as_int(value: Any, name: str) -> int:
    """``value`` as a Python int; TypeError naming it for bool, float, str, None, ..."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {value!r} of type {type(value).__name__}"
        ) from None


def as_count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as a Python int of at least ``minimum``; TypeError / ValueError naming it."""
    count = as_int(value, name)
    if count < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {count}")
    return count


def as_shape(shape: Any, name: str = "shape") -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints, numpy integers accepted) as a tuple of
    non-negative Python ints; TypeError / ValueError naming it otherwise."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {shape!r}")
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {shape!r}") from None
    for dim in dims:
        if isinstance(dim, bool) or not hasattr(dim, "__index__"):
            raise TypeError(f"{name} entries must be ints, got {shape!r}")
        if operator.index(dim) < 0:
            raise ValueError(f"{name} entries must be non-negative, got {shape!r}")
    return tuple(operator.index(dim) for dim in dims)


#: Slots of a UVA pool or staging ring when ``max_concurrency`` is None: the step being read
#: and the step being written. A constant documenting the constructor default, not a setting.
DEFAULT_MAX_CONCURRENCY = 2
#: The most slots a pool or writer may have. A slot is a step in flight (written by the host,
#: or still read by the device); pipelines keep a few. The bound refuses a mistaken count
#: (2**40) before a constructor spends minutes pinning memory for it.
MAX_CONCURRENCY = 1024


def as_max_concurrency(value: Any) -> int:
    """``max_concurrency`` checked: None -> the default, else 1 to :data:`MAX_CONCURRENCY`."""
    if value is None:
        return DEFAULT_MAX_CONCURRENCY
    count = as_count(value, "max_concurrency")
    if count > MAX_CONCURRENCY:
        raise ValueError(
            f"max_concurrency must be at most {MAX_CONCURRENCY} (each slot is a step in flight "
            f"and a separate pinned allocation), got {count}"
        )
    return count


def as_optional_bool(value: Any, name: str) -> bool | None:
    """``value`` when it is True, False or None; TypeError naming it otherwise (an int or a
    string would silently pick a branch)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {value!r}")
    return value


def as_seconds(value: Any, name: str) -> float:
    """A non-negative number of seconds (an int or a float, not a bool or a string), or the
    ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not value >= 0:  # NaN too
        raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    return float(value)
