"""Pinned host memory the device reads in place (UVA), and round-robin pools of it.

A :class:`UvaBuffer` is page-locked host memory mapped into the device's address space
(``cuMemHostAlloc`` + ``cuMemHostGetDevicePointer`` on CUDA, page-aligned ``mmap`` on the CPU
driver), allocated through the driver seam, so no framework is needed to make one. The host
writes it through numpy (``.np``); kernels of torch, JAX or Triton read the same bytes through
a device view, with no copy. :class:`NonUvaBuffer` has the same interface for platforms where
that is unavailable or unsafe (:func:`uva_unavailable_reason` says why): it copies explicitly.

:class:`UvaBufferPool` hands out one of ``max_concurrency`` slots per step, so the host can
fill step *t + 1* while the device still reads step *t*; :class:`UvaBackedTensor` keeps a host
source of truth and publishes it through a pool.

Lifetime: every array made from a buffer or handed out by a pool (numpy, torch, JAX, any
DLPack consumer) keeps that memory alive and mapped until the array goes; ``free()`` /
``close()`` mean "done" (no new exports), and dropping a buffer or pool without them is safe.

Modules: :mod:`jaxbuf.uva._buffers` (the buffers), :mod:`jaxbuf.uva._pool` (the pool),
:mod:`jaxbuf.uva._backed` (the backed tensor), :mod:`jaxbuf.uva._memory` (the allocations and
the owner of the views), :mod:`jaxbuf.uva._probe` (whether a device gets UVA). Import the
public names from here.

Examples
--------
>>> import numpy as np, jaxbuf.uva as uva
>>> pool = uva.UvaBufferPool(8, "int32", device="cpu", framework="view")
>>> view = pool.copy_to_uva([1, 2, 3])
>>> view.shape, view.to_numpy().tolist()
((3,), [1, 2, 3])
>>> pool.close()
"""

from __future__ import annotations

from .._checks import DEFAULT_MAX_CONCURRENCY, MAX_CONCURRENCY
from ._backed import UvaBackedTensor
from ._buffers import NonUvaBuffer, UvaBuffer, async_copy_to_device
from ._pool import UvaBufferPool
from ._probe import (
    _probe_aliasing,  # noqa: F401 - the probe's pieces, reached as jaxbuf.uva._... by tests
    _uva_unavailable_reason,  # noqa: F401
    is_uva_available,
    uva_unavailable_reason,
)

__all__ = [
    "DEFAULT_MAX_CONCURRENCY",
    "MAX_CONCURRENCY",
    "NonUvaBuffer",
    "UvaBackedTensor",
    "UvaBuffer",
    "UvaBufferPool",
    "async_copy_to_device",
    "is_uva_available",
    "uva_unavailable_reason",
]
