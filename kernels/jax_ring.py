"""Compatibility shim: :class:`PackRing` moved to :mod:`jaxbuf.staged`; import it from
:mod:`jaxbuf.jax_ops`.

Nothing but the re-export lives here: ``kernels/`` otherwise imports no owner
(tests/test_architecture.py lists this shim).
"""

from jaxbuf.jax_ops import PackRing

__all__ = ["PackRing"]
