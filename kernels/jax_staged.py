"""Compatibility shim: the JAX wing of staged writes moved to :mod:`jaxbuf.staged`; its public
face is :mod:`jaxbuf.jax_ops`.

``from jaxbuf.kernels.jax_staged import StagedWrites`` (and the other public names) keeps
working; new code imports them from :mod:`jaxbuf.jax_ops`. Nothing but re-exports lives here:
``kernels/`` otherwise imports no owner (tests/test_architecture.py lists this shim).
"""

from jaxbuf.jax_ops import (
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
    "PackedWrites",
    "StagedWrites",
    "apply_staged_writes",
    "bucket_size",
    "pack_writes",
]
