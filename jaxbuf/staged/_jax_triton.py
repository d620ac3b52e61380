"""The Triton staged-write kernel run from JAX inside ``jit``, through ``jax_triton`` (GPU only).

:func:`apply_packed_writes` applies a :class:`jaxbuf.kernels.jax_staged.PackedWrites` to one
2-D array with ``jax_triton.triton_call``, the array aliased to the result
(``input_output_aliases``): a donated array is updated in place, with no copy. This is
``apply_staged_writes(..., method="triton")``, available on a GPU where ``jax_triton``
imports.

One kernel source for torch and JAX: the copy loop is :func:`jaxbuf.kernels.staged_write.
copy_elements`, the body the torch launcher's kernel runs for each write. The entry here
differs from the torch one in how a write finds its target, because the torch kernel's
pointer tables cannot be expressed through ``jax_triton``: they hold the target's absolute
address in memory (the group table), and under XLA that address exists only inside the custom
call at run time, where ``jax_triton`` hands the kernel typed pointers to its operands. So
:data:`apply_packed_writes_kernel` takes the packed writes' one buffer
(:attr:`~jaxbuf.kernels.jax_staged.PackedWrites.buffer`: four int32 columns, then the values'
bytes) and the array as operands and calls the shared body; it reads the values through a
pointer of the array's element type, so no bit-width branches are needed, and XLA passes the
buffer to the kernel as it arrived from the host (no slicing kernels before the call).

The writes are pairwise disjoint (the packer resolves overlaps, later writes winning), so the
kernel runs one program per write, fully parallel, in any order. Elements that fall outside
the array are dropped, as the XLA scatter's ``mode="drop"`` drops them.

Importing this module needs Triton only; ``jax_triton`` and JAX are imported on first use.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import triton.language as tl
from triton.runtime.jit import JITFunction

from .staged_write import copy_elements, interpreted

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

#: jax_triton 0.3.1 (the release these calls are written against) needs this Triton.
TRITON_FLOOR = (3, 6)
#: The operand index of the array among ``triton_call``'s array arguments (the packed buffer,
#: array), aliased to output 0.
JAX_TRITON_ALIAS = 1
_MIN_BLOCK = 32  # one warp, one element per thread
_MAX_BLOCK = 1024  # longer writes loop inside their program
# The dtypes jax_triton 0.3.1 maps to Triton pointer types.
_DTYPES = frozenset(
    [f"{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64)]
    + ["bool", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]
)


def _apply_packed_writes_kernel(
    packed,  # *int32: PackedWrites.buffer: rows, starts, lengths, offsets ([W] each), values
    array,  # *T [num_rows, num_cols]: the input, aliased to out (unused: out is written)
    num_rows,  # int: array.shape[0]
    num_cols,  # int: array.shape[1], also the row stride (the array is C-contiguous)
    out,  # *T: the output, the same buffer as array
    NUM_WRITES: tl.constexpr,  # W, the write bucket (static per bucket, as the grid is)
    BLOCK_SIZE: tl.constexpr,  # elements copied per step
):
    write = tl.program_id(0)
    row = tl.load(packed + write).to(tl.int64)  # target row of each write
    start = tl.load(packed + NUM_WRITES + write).to(tl.int64)  # first column
    length = tl.load(packed + 2 * NUM_WRITES + write).to(tl.int64)  # 0 for padding writes
    offset = tl.load(packed + 3 * NUM_WRITES + write).to(tl.int64)  # into values, elements
    # The contents, back to back from int32 index 4W (byte 16W, aligned for any T): a pointer
    # cast, as the host's numpy view of the same bytes.
    values = (packed + 4 * NUM_WRITES).to(out.dtype)
    # Clip the write to its row, dropping what falls outside the array (the scatter path's
    # mode="drop"); a write past the last row or column copies nothing.
    length = tl.where(row < num_rows, tl.minimum(length, num_cols - start), 0)
    copy_elements(out + row * num_cols + start, values + offset, length, BLOCK_SIZE)


# A compiled-mode function whatever TRITON_INTERPRET says: jax_triton compiles it, and the
# interpreter runs it only through interpreted_kernel().
apply_packed_writes_kernel = JITFunction(_apply_packed_writes_kernel)


@functools.cache
def interpreted_kernel() -> Any:
    """:data:`apply_packed_writes_kernel` under Triton's interpreter, with its shared body
    interpreted too; launched with torch CPU tensors (the CPU tests run it this way, since
    ``jax_triton`` needs a GPU)."""
    return interpreted(apply_packed_writes_kernel)


@functools.cache
def jax_triton_unavailable_reason() -> str | None:
    """Why ``method="triton"`` cannot run in this process, or None when it can: ``jax_triton``
    missing or failing to import (it needs a JAX built with GPU support), JAX or Triton older
    than it needs. Computed once."""
    import triton

    from jaxbuf.interop.jax import JAX_FLOORS, require_jax

    try:
        require_jax("jax_triton (apply_staged_writes method='triton')", JAX_FLOORS["jax_triton"])
    except ImportError as error:
        return str(error)
    version = triton.__version__
    if _version_prefix(version) < TRITON_FLOOR:
        floor = ".".join(map(str, TRITON_FLOOR))
        return (
            f"jax_triton needs Triton >= {floor}, but Triton {version} is installed; "
            f"upgrade with: pip install -U 'triton>={floor}'"
        )
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


def _version_prefix(version: str) -> tuple[int, int]:
    """``"3.6.0+git..."`` -> ``(3, 6)``; an unparseable version counts as new enough."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (1 << 30, 0)


def load_jax_triton() -> Any:
    """The ``jax_triton`` module; ImportError saying what is missing when it cannot run."""
    reason = jax_triton_unavailable_reason()
    if reason is not None:
        raise ImportError(f"apply_staged_writes(method='triton') is unavailable: {reason}")
    import jax_triton

    return jax_triton


def launch_config(num_writes: int, num_values: int) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` for a bucket of ``num_writes`` writes over ``num_values``
    content elements: a block about the mean write length (a power of two from 32 to 1024,
    so short writes do not leave most lanes masked off), and one warp per 256 elements of it
    (1 to 4). Static per bucket, so one compiled kernel per bucket."""
    mean = -(-max(num_values, 1) // max(num_writes, 1))
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << (mean - 1).bit_length()))
    return block, max(1, min(4, block // 256))


def apply_packed_writes(
    array: Any, packed: Any, *, block_size: int | None = None, num_warps: int | None = None
) -> Any:
    """Return ``array`` with ``packed``'s writes applied by the Triton kernel; jit-able.

    ``packed`` is a :class:`~jaxbuf.kernels.jax_staged.PackedWrites` of the array's dtype
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
