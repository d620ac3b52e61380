"""Staged row writes on one 2-D JAX array inside ``jit``: the old name of
:mod:`jaxbuf.kernels.jax_staged`, the JAX launcher of the staged-write kernel.

The fast path: stage writes in a :class:`StagedWrites` (the C stager of
:class:`jaxbuf.staged.StagedWriteTensor`; overlaps resolved, later wins),
:meth:`~StagedWrites.pack` them, and call :func:`apply_staged_writes` inside ``jax.jit`` with
the array donated (the Triton kernel through ``jax_triton`` on a GPU, in place; an XLA
scatter on the CPU). :class:`PackRing` packs into pinned memory the apply reads in place
(no host-to-device transfer per call), and :meth:`PackRing.apply` is the whole fast path.

Kept so ``jaxbuf.jax_ops`` keeps working; it imports no framework itself (the launcher imports
JAX inside the functions that need it).
"""

from jaxbuf.kernels.jax_ring import PackRing
from jaxbuf.kernels.jax_staged import (
    MIN_BUCKET,
    PALLAS_BLOCK_SIZE,
    PackedWrites,
    StagedWrites,
    apply_staged_writes,
    bucket_size,
    pack_writes,
)

__all__ = [
    "MIN_BUCKET",
    "PALLAS_BLOCK_SIZE",
    "PackRing",
    "PackedWrites",
    "StagedWrites",
    "apply_staged_writes",
    "bucket_size",
    "pack_writes",
]
