"""One dtype vocabulary for numpy, torch, JAX and DLPack.

``canonical_dtype`` accepts a numpy dtype (or scalar type), a torch dtype, a JAX dtype and a
string, and returns a :class:`DType`. Framework dtype objects are recognised, and made
(:meth:`DType.torch`, :meth:`DType.jax`), by the framework adapters of :mod:`jaxbuf.interop`,
imported when needed: this module imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from ._errors import ByteOrderError

# DLPack type codes (dlpack.h, DLDataTypeCode).
K_DL_INT = 0
K_DL_UINT = 1
K_DL_FLOAT = 2
K_DL_BFLOAT = 4
K_DL_COMPLEX = 5
K_DL_BOOL = 6


@dataclass(frozen=True)
class DType:
    """A dtype jaxbuf can hand out through DLPack. ``name`` is numpy's spelling."""

    name: str
    itemsize: int
    dlpack_code: int

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (bfloat16 through ml_dtypes, which JAX installs)."""
        return _numpy_dtype(self.name)

    def torch(self) -> Any:
        """This dtype as a ``torch.dtype`` (through the torch adapter)."""
        from . import interop

        return interop.get("torch").dtype(self)

    def jax(self) -> Any:
        """This dtype as JAX's dtype (through the JAX adapter)."""
        from . import interop

        return interop.get("jax").dtype(self)

    def __str__(self) -> str:
        return self.name


_DTYPES = {
    dtype.name: dtype
    for dtype in [
        DType("bool", 1, K_DL_BOOL),
        *(DType(f"int{8 * size}", size, K_DL_INT) for size in (1, 2, 4, 8)),
        *(DType(f"uint{8 * size}", size, K_DL_UINT) for size in (1, 2, 4, 8)),
        DType("float16", 2, K_DL_FLOAT),
        DType("bfloat16", 2, K_DL_BFLOAT),
        DType("float32", 4, K_DL_FLOAT),
        DType("float64", 8, K_DL_FLOAT),
        DType("complex64", 8, K_DL_COMPLEX),
        DType("complex128", 16, K_DL_COMPLEX),
    ]
}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_DTYPES)

if TYPE_CHECKING:  # the framework types, for type checkers only: no framework is imported
    import torch

    DTypeLike: TypeAlias = str | np.dtype | type | DType | torch.dtype
else:
    DTypeLike: TypeAlias = str | np.dtype | type | DType | Any
#: What a ``dtype=`` argument accepts: a name (``"int32"``, ``"bfloat16"``, also spellings
#: copied from reprs such as ``"torch.float32"``), a numpy dtype or scalar type
#: (``np.float16``), a :class:`DType`, a ``torch.dtype`` or a JAX dtype (``jnp.bfloat16``), of
#: native byte order (else :class:`~jaxbuf.ByteOrderError`). Parsed by :func:`canonical_dtype`;
#: the supported ones are :data:`SUPPORTED_DTYPES`.

uint8 = _DTYPES["uint8"]


@cache
def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as error:  # pragma: no cover - ml_dtypes comes with jax
            raise TypeError(
                "bfloat16 in numpy needs ml_dtypes (pip install jaxbuf[jax])"
            ) from error
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


#: Short spellings torch and JAX users type (``torch.half`` is "half"; "bf16" is the mixed
#: precision flags' spelling).
_SHORT_NAMES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}


@lru_cache(maxsize=256)
def _canonical_by_key(key: Any) -> DType | None:
    if isinstance(key, str):
        # Spellings copied from reprs are accepted: "torch.float32", "dtype('int32')".
        name = key.removeprefix("torch.").removeprefix("dtype(").strip("')\"")
        name = _SHORT_NAMES.get(name, name)
    else:
        # A framework's dtype object (torch.float32, jnp.bfloat16) is named by its adapter;
        # anything else (numpy dtypes and scalar types) by numpy.
        from . import interop

        name = interop.dtype_name(key)
        if name is None:
            name = str(key)
    if name in _DTYPES:
        return _DTYPES[name]
    try:
        numpy_dtype = np.dtype(key)
    except (TypeError, ValueError):
        return None
    if not numpy_dtype.isnative:
        # DLPack has no byte order: exporting '>i4' as int32 would hand out swapped values.
        raise ByteOrderError(
            f"dtype {key!r} has non-native byte order ({numpy_dtype.str!r}); DLPack describes "
            f"native-order data only: convert it first, e.g. array.astype("
            f"{numpy_dtype.newbyteorder('=').str!r})"
        )
    return _DTYPES.get(numpy_dtype.name)


def canonical_dtype(dtype: Any) -> DType:
    """Return the :class:`DType` for ``dtype`` or raise ``TypeError`` naming it.

    Examples
    --------
    >>> canonical_dtype("int32").itemsize
    4
    >>> canonical_dtype(np.float16).name
    'float16'
    """
    if isinstance(dtype, DType):
        return dtype
    if dtype is None or isinstance(dtype, bool):
        raise TypeError(f"dtype must be a dtype or a dtype name, got {dtype!r}")
    try:
        result = _canonical_by_key(dtype)
    except ByteOrderError:
        raise
    except TypeError:  # unhashable input
        result = None
    if result is None:
        raise TypeError(
            f"unsupported dtype {dtype!r}; jaxbuf supports {', '.join(SUPPORTED_DTYPES)}"
        )
    return result
