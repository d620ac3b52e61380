"""Compatibility shim: ``apply_staged_writes(..., method="triton")``'s JAX side moved to
:mod:`jaxbuf.staged` (``_jax_triton``), its Triton kernel to :mod:`jaxbuf.kernels.packed_write`.

The names this module had keep working. Nothing but re-exports lives here: ``kernels/``
otherwise imports no owner (tests/test_architecture.py lists this shim).
"""

from jaxbuf.staged._jax_triton import (
    JAX_TRITON_ALIAS,
    TRITON_FLOOR,
    apply_packed_writes,
    apply_packed_writes_kernel,
    interpreted_kernel,
    jax_triton_unavailable_reason,
    launch_config,
    load_jax_triton,
)

__all__ = [
    "JAX_TRITON_ALIAS",
    "TRITON_FLOOR",
    "apply_packed_writes",
    "apply_packed_writes_kernel",
    "interpreted_kernel",
    "jax_triton_unavailable_reason",
    "launch_config",
    "load_jax_triton",
]
