"""The Triton kernel that applies a JAX pack's writes (launched through ``jax_triton``).

:data:`apply_packed_writes_kernel` applies the writes of one packed buffer (the layout of
:class:`jaxbuf.jax_ops.PackedWrites`: four int32 columns ``rows``, ``starts``, ``lengths``,
``offsets`` of ``NUM_WRITES`` entries, then the values' bytes) to one C-contiguous 2-D array.
The JAX side that calls it inside ``jit`` is ``apply_staged_writes(..., method="triton")``
(:mod:`jaxbuf.staged._jax_triton`).

One kernel source for torch and JAX: the copy loop is :func:`jaxbuf.kernels.staged_write.
copy_elements`, the body the torch launcher's kernel runs for each write. The entry here
differs from the torch one in how a write finds its target, because the torch kernel's
pointer tables cannot be expressed through ``jax_triton``: they hold the target's absolute
address in memory (the group table), and under XLA that address exists only inside the custom
call at run time, where ``jax_triton`` hands the kernel typed pointers to its operands. So this
kernel takes the packed buffer and the array as operands; it reads the values through a
pointer of the array's element type, so no bit-width branches are needed.

The writes are pairwise disjoint (the packer resolves overlaps, later writes winning), so the
kernel runs one program per write, fully parallel, in any order. Elements that fall outside
the array are dropped, as the XLA scatter's ``mode="drop"`` drops them.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .staged_write import copy_elements, interpreted

__all__ = [
    "TRITON_FLOOR",
    "apply_packed_writes_kernel",
    "interpreted_kernel",
    "launch_config",
    "triton_too_old_reason",
]

#: jax_triton 0.3.1 (the release the JAX side is written against) needs this Triton.
TRITON_FLOOR = (3, 6)
_MIN_BLOCK = 32  # one warp, one element per thread
_MAX_BLOCK = 1024  # longer writes loop inside their program


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


def triton_too_old_reason() -> str | None:
    """Why the installed Triton is too old for ``jax_triton`` (None when it is not)."""
    version = triton.__version__
    if _version_prefix(version) < TRITON_FLOOR:
        floor = ".".join(map(str, TRITON_FLOOR))
        return (
            f"jax_triton needs Triton >= {floor}, but Triton {version} is installed; "
            f"upgrade with: pip install -U 'triton>={floor}'"
        )
    return None


def _version_prefix(version: str) -> tuple[int, int]:
    """``"3.6.0+git..."`` -> ``(3, 6)``; an unparseable version counts as new enough."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (1 << 30, 0)


def launch_config(num_writes: int, num_values: int) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` for a bucket of ``num_writes`` writes over ``num_values``
    content elements: a block about the mean write length (a power of two from 32 to 1024,
    so short writes do not leave most lanes masked off), and one warp per 256 elements of it
    (1 to 4). Static per bucket, so one compiled kernel per bucket."""
    mean = -(-max(num_values, 1) // max(num_writes, 1))
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << (mean - 1).bit_length()))
    return block, max(1, min(4, block // 256))
