"""Staged row writes: stage on the host, apply many with one kernel launch.

A :class:`StagedWriteTensor` is a 2-D target in memory jaxbuf owns (device memory through the
driver, or pinned host memory the device reads in place). :meth:`~StagedWriteTensor.stage_write`
records ``target[row, start:start + len(values)] = values`` on the host; the writes staged so far
are applied by :meth:`~StagedWriteTensor.apply_write` (one tensor) or
:meth:`FusedStagedWriter.apply` (many tensors, of mixed dtypes) with **one** launch of the Triton
kernel of :mod:`jaxbuf.kernels`.

Staging costs a few hundred nanoseconds and does not depend on how much is staged: each write
appends one packed record (a row of the kernel's write table) to one ``bytearray`` and its
values' bytes to another; nothing is a Python list of values. A numpy array of the target's
dtype is staged by one call into the small C extension ``jaxbuf._staging`` (about 0.2 µs), a
list or tuple is packed and range-checked by ``struct``; everything else goes through numpy.
At apply time the extension lays the tables and values straight into a pinned (UVA) slot the
device reads in place (no separate host-to-device copy), and the launch goes through Triton's
cached launcher. Without the extension, the same happens in Python and numpy, only slower.

Order is defined: writes staged before one apply take effect in staging order, so where two
overlap the later one wins, on the GPU as on the CPU. The C stager indexes the writes by row as
they are staged; where two overlap, packing keeps only what later writes leave visible (the
earlier write dropped or split into pieces), so the one launch always runs every write in
parallel and costs the same whatever the pattern of rows (see ``jaxbuf/_staging.c``).

Ownership: the target memory is kept alive by the framework arrays made from ``gpu``
(``torch.from_dlpack(swt.gpu)``, :meth:`~StagedWriteTensor.to_numpy`, ...). ``free()`` means
"I am done": no new writes, applies or exports; the memory goes when the last such array does
(at once when there is none).

The package is the whole staged-write wing, one concept per private module:

* ``_host``: argument checks and :class:`~jaxbuf.staged._host.StagingState`, a tensor's
  staged writes and the C stager over them (the contract between a tensor and its writers);
* ``_tensor``: :class:`StagedWriteTensor`; ``_fused``: :class:`FusedStagedWriter`;
  ``_packing``: packing an apply into a staging slot; ``_launch``: the launchers and the
  applied event;
* the JAX wing, public as :mod:`jaxbuf.jax_ops`: ``_jax_staging`` (``StagedWrites``),
  ``_jax_packed`` (the ``PackedWrites`` layout), ``_jax_pack`` (packing into it),
  ``_jax_apply`` (the jit-side apply), ``_jax_ring`` (``PackRing``), ``_jax_triton`` (the
  ``jax_triton`` apply).

The kernels they launch take pointers and arrays and live in :mod:`jaxbuf.kernels`.

Examples
--------
>>> import numpy as np, jaxbuf.staged as staged
>>> swt = staged.StagedWriteTensor((4, 8), "int32", device="cpu", backend="numpy")
>>> swt.stage_write(1, 2, np.array([7, 8, 9], dtype=np.int32))
>>> swt.stage_write(3, 0, [1, 2])
>>> swt.stage_write_elem(0, 5)
>>> swt.num_staged_writes
3
>>> swt.apply_write()
>>> swt.to_numpy()[:, :5].tolist()
[[5, 0, 0, 0, 0], [0, 0, 7, 8, 9], [0, 0, 0, 0, 0], [1, 2, 0, 0, 0]]
>>> swt.close()
"""

from ._fused import FusedStagedWriter
from ._host import BACKENDS, SUPPORTED_DTYPES, FreedError
from ._tensor import StagedWriteTensor

__all__ = ["BACKENDS", "SUPPORTED_DTYPES", "FreedError", "FusedStagedWriter", "StagedWriteTensor"]
