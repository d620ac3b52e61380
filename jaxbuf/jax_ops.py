"""Staged row writes on one 2-D JAX array inside ``jit``: the public face of the JAX wing of
staged writes (implemented in :mod:`jaxbuf.staged`).

Stage writes in a :class:`StagedWrites` (the C stager of :class:`jaxbuf.StagedWriteTensor`;
overlaps resolved, later wins), :meth:`~StagedWrites.pack` them, and call
:func:`apply_staged_writes` inside ``jax.jit`` with the array donated: an XLA scatter on every
platform by default, the GPU included (``method="triton"`` runs the Triton kernel through
``jax_triton`` on a GPU). :class:`PackRing` packs into pinned memory the apply reads in place
(no host-to-device transfer per call), and :meth:`PackRing.apply` is the whole fast path.

Importing this module imports no framework (JAX is imported inside the functions that need it).

Examples
--------
>>> import jax, jax.numpy as jnp, numpy as np
>>> from jaxbuf.jax_ops import StagedWrites, apply_staged_writes
>>> staged = StagedWrites(2, 4, "int32")
>>> staged.stage_write(1, 1, np.array([7, 8], np.int32))
>>> out = jax.jit(apply_staged_writes)(jnp.zeros((2, 4), jnp.int32), staged.pack())
>>> np.asarray(out).tolist()
[[0, 0, 0, 0], [0, 7, 8, 0]]
"""

from jaxbuf.staged._jax_apply import apply_staged_writes
from jaxbuf.staged._jax_packed import MIN_BUCKET, PALLAS_BLOCK_SIZE, PackedWrites, bucket_size
from jaxbuf.staged._jax_ring import PackRing
from jaxbuf.staged._jax_staging import StagedWrites, pack_writes

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
