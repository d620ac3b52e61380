"""A host array published to the device through a pool (:class:`UvaBackedTensor`).

It owns its pool and nothing else that holds memory: arrays it returned keep their slot's
memory (see :class:`~jaxbuf.uva.UvaBufferPool`), so closing or dropping it is always safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import interop
from .._checks import as_int
from ..devices import DeviceLike
from ..drivers.base import VmmDriver
from ..dtypes import DTypeLike, canonical_dtype
from ._buffers import _as_shape
from ._memory import _refuse_copy
from ._pool import UvaBufferPool


class UvaBackedTensor:
    """A host array (``np``, the source of truth) published to the device through a pool.

    Mutate ``np`` (or ``cpu``, a torch view of it) freely; :meth:`copy_to_uva` copies its
    first ``n`` rows into the next pool slot and returns the device view, also kept as
    ``gpu``. Arrays it returned keep their memory after :meth:`close` or when the tensor is
    dropped (see :class:`UvaBufferPool`). Not thread-safe; not picklable or copyable.
    """

    __reduce_ex__ = _refuse_copy

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        max_concurrency: int | None = None,
        device: DeviceLike | None = None,
        *,
        framework: str | None = None,
        guarded: bool | str = False,
        buffer_cls: type | None = None,
        driver: VmmDriver | None = None,
    ) -> None:
        shape, dtype = _as_shape(size), canonical_dtype(dtype)
        self.dtype = dtype
        self._cpu = None
        self._closed = False
        # The pool first: it validates everything (a huge size included) before allocating.
        self.pool = UvaBufferPool(
            shape,
            dtype,
            max_concurrency,
            device,
            buffer_cls=buffer_cls,
            framework=framework,
            guarded=guarded,
            driver=driver,
        )
        self.np = np.zeros(shape, dtype.numpy)
        self.max_concurrency = self.pool.max_concurrency
        self.gpu = self.pool.copy_to_uva(self.np)

    @property
    def cpu(self) -> Any:
        """A torch CPU tensor sharing ``np``'s memory (made on first use)."""
        if self._cpu is None:
            self._cpu = interop.get("torch").host_array(self.np)
        return self._cpu

    def copy_to_uva(self, n: int | None = None, stream: Any = None) -> Any:
        """Copy the first ``n`` rows of ``np`` (all when None) into the next pool slot and
        return them as the pool's framework says (also kept as ``gpu``)."""
        if n is not None:
            n = as_int(n, "n")
            if not 0 <= n <= len(self.np):
                raise IndexError(f"n={n!r} out of range for a tensor of {len(self.np)} rows")
        self.gpu = self.pool.copy_to_uva(self.np if n is None else self.np[:n], stream)
        return self.gpu

    @property
    def nbytes(self) -> int:
        """Bytes of ``np``, the host array published."""
        return self.np.nbytes

    @property
    def device(self) -> Any:
        """The pool's device."""
        return self.pool.device

    def close(self) -> None:
        """Close the pool (see :meth:`UvaBufferPool.close`)."""
        self.pool.close()
        self._closed = True

    def __enter__(self) -> UvaBackedTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"UvaBackedTensor(device={self.pool.device}, dtype={self.dtype}, "
            f"shape={self.np.shape}, nbytes={self.np.nbytes}, {state})"
        )
