"""``apply_staged_writes(..., method="triton")``: the Triton kernel run from JAX inside ``jit``,
through ``jax_triton`` (GPU only).

:func:`apply_packed_writes` applies a :class:`jaxbuf.jax_ops.PackedWrites` to one 2-D array
with ``jax_triton.triton_call`` over :data:`jaxbuf.kernels.packed_write.apply_packed_writes_kernel`,
the array aliased to the result (``input_output_aliases``): a donated array is updated in
place, with no copy. XLA passes the pack's one buffer to the kernel as it arrived from the host
(no slicing kernels before the call). This is JAX code of the staged-write wing; the kernel
itself, over pointers, is in ``kernels/``.

Importing this module needs Triton (through the kernel); ``jax_triton`` and JAX are imported on
first use.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ..kernels.packed_write import (
    TRITON_FLOOR,
    apply_packed_writes_kernel,
    interpreted_kernel,
    launch_config,
    triton_too_old_reason,
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

#: The operand index of the array among ``triton_call``'s array arguments (the packed buffer,
#: array), aliased to output 0.
JAX_TRITON_ALIAS = 1
# The dtypes jax_triton 0.3.1 maps to Triton pointer types.
_DTYPES = frozenset(
    [f"{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64)]
    + ["bool", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]
)


@functools.cache
def jax_triton_unavailable_reason() -> str | None:
    """Why ``method="triton"`` cannot run in this process, or None when it can: ``jax_triton``
    missing or failing to import (it needs a JAX built with GPU support), JAX or Triton older
    than it needs. Computed once."""
    from ..interop.jax import JAX_FLOORS, require_jax

    try:
        require_jax("jax_triton (apply_staged_writes method='triton')", JAX_FLOORS["jax_triton"])
    except ImportError as error:
        return str(error)
    too_old = triton_too_old_reason()
    if too_old is not None:
        return too_old
    # jax_triton 0.3.1 sets TRITON_CACHE_DIR="" when imported, after which every kernel that
    # Triton itself compiles in this process (the torch launcher's) fails with "Could not
    # create or locate cache dir"; jax_triton's own compiles do not use that cache. Put back
    # what was there.
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton  # noqa: F401
    except ImportError as error:  # absent, or JAX without GPU support
        return (
            f"jax_triton cannot be imported ({error}); install it with "
            "pip install 'jaxbuf[jax-triton]' on a machine with a CUDA build of JAX"
        )
    finally:
        if cache_dir is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = cache_dir
    return None


def load_jax_triton() -> Any:
    """The ``jax_triton`` module; ImportError saying what is missing when it cannot run."""
    reason = jax_triton_unavailable_reason()
    if reason is not None:
        raise ImportError(f"apply_staged_writes(method='triton') is unavailable: {reason}")
    import jax_triton

    return jax_triton


def apply_packed_writes(
    array: Any, packed: Any, *, block_size: int | None = None, num_warps: int | None = None
) -> Any:
    """Return ``array`` with ``packed``'s writes applied by the Triton kernel; jit-able.

    ``packed`` is a :class:`~jaxbuf.jax_ops.PackedWrites` of the array's dtype
    with pairwise-disjoint writes; its one buffer is the kernel's first operand. The array is
    aliased to the result, so when the caller donates it (``jax.jit(...,
    donate_argnums=...)``) XLA updates it in place; without donation XLA copies it first.
    ``block_size`` / ``num_warps`` override :func:`launch_config`. Raises ImportError when
    ``jax_triton`` cannot run here (see :func:`jax_triton_unavailable_reason`) and TypeError for
    a dtype Triton has no pointer type for or values of another dtype than the array's.
    """
    import jax

    if str(array.dtype) not in _DTYPES:
        raise TypeError(
            f"method='triton' does not support dtype {array.dtype}; use method='scatter'"
        )
    num_writes = packed.num_writes
    default_block, default_warps = launch_config(num_writes, packed.num_values)
    block = default_block if block_size is None else block_size
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    warps = default_warps if num_warps is None else num_warps
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps}")
    if packed.dtype != array.dtype:  # the kernel reads the values as the array's type
        raise TypeError(f"packed values are {packed.dtype}, array is {array.dtype}")
    jt = load_jax_triton()
    if num_writes == 0 or array.size == 0:
        return array
    num_rows, num_cols = (int(n) for n in array.shape)
    return jt.triton_call(
        packed.buffer,
        array,
        num_rows,
        num_cols,
        kernel=apply_packed_writes_kernel,
        out_shape=jax.ShapeDtypeStruct(array.shape, array.dtype),
        grid=(num_writes,),
        input_output_aliases={JAX_TRITON_ALIAS: 0},
        num_warps=warps,
        num_stages=1,  # no loop to pipeline worth the registers
        name="jaxbuf_apply_staged_writes",
        NUM_WRITES=num_writes,
        BLOCK_SIZE=block,
    )
