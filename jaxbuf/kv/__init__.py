"""The KV cache as an inference engine uses it: vLLM's newest names and semantics.

* :class:`ExtensibleKVCacheBuilder` stands in for the engine's allocation of each KV-cache
  tensor (:meth:`~ExtensibleKVCacheBuilder.reserve`: a flat view over the full capacity) and
  :meth:`~ExtensibleKVCacheBuilder.finish` hands them over with one block committed;
* :class:`ExtensibleKVCacheBuffers` commits every tensor in lockstep, in blocks
  (``commit``, ``ensure_blocks``, ``extend``, ``release_physical`` / ``recommit``,
  ``defragment=True`` for RDMA registration), with views of every layer over the full
  capacity and views trimmed to the committed blocks;
* :class:`DeviceParamTable` keeps per-request scalars and short rows (block tables) at a
  fixed device address and uploads them with one copy, only when a host value changed; JAX
  gets them as values (``arrays("jax")``), so a sync never waits for JAX;
* :class:`KVCacheStep` runs a jitted JAX decode step over the cache's layers, at a cost
  that follows the committed blocks: in place where JAX writes donated imports in place
  (:func:`donation_in_place`), over a bucket of the committed blocks elsewhere.

Modules: :mod:`jaxbuf.kv._builder`, :mod:`jaxbuf.kv._buffers`, :mod:`jaxbuf.kv._param_table`
and the JAX wings :mod:`jaxbuf.kv._jax_step` (JAX imported inside its functions only) and
:mod:`jaxbuf.kv._jax_table` (imported on a table's first ``arrays("jax")``).

Examples
--------
>>> import jaxbuf
>>> builder = jaxbuf.ExtensibleKVCacheBuilder(num_blocks_capacity=64, device="cpu")
>>> flat = builder.reserve(64 * 4096, num_segments=2)   # K and V planes, 2 KiB each a block
>>> kv = builder.finish()
>>> kv.num_blocks_committed, flat.nbytes
(1, 262144)
>>> kv.commit(8)
>>> k, v = kv.committed_views(0, "float32")
>>> k.shape
(8, 512)
>>> kv.free()
>>> table = jaxbuf.DeviceParamTable(4, {"temperature": "float32", "top_k": "int32"}, "cpu")
>>> table["temperature"].np[:] = 0.7
>>> table.sync(), table.sync()
(True, False)
>>> table.close()
"""

from ._buffers import ExtensibleKVCacheBuffers
from ._builder import ExtensibleKVCacheBuilder
from ._jax_step import KVCacheStep, donation_in_place
from ._param_table import FIELD_ALIGNMENT, DeviceParamTable, ParamField

__all__ = [
    "FIELD_ALIGNMENT",
    "DeviceParamTable",
    "ExtensibleKVCacheBuffers",
    "ExtensibleKVCacheBuilder",
    "KVCacheStep",
    "ParamField",
    "donation_in_place",
]
