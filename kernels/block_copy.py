"""A Triton kernel that copies a list of (destination, source, bytes) in one launch.

A KV-cache transfer moves hundreds of scattered blocks. ``cuMemcpyBatchAsync`` submits each
copy on its own (about 5 us apiece on an H200: 1,024 blocks of 64 KiB take 5 ms, 11 GB/s), so
many small copies, and large ones, go through this kernel instead. Each copy is cut into
pieces of at most :data:`PIECE_BYTES`, one program a piece, so that a 64 MiB copy is spread
over every SM; the cutting happens on the device (program ``p`` takes piece ``p % pieces`` of
copy ``p // pieces``), as numpy would take longer to cut a 1,024-block list on the host than
the kernel takes to copy it.

The table is three uint64 columns in device memory, one after the other: ``count``
destinations, then sources, then sizes (the caller uploads it with the copy the launch
enqueues first). Every address and size is a multiple of :data:`ALIGNMENT` (the kernel moves
int64 elements; the caller checks, and copies anything else with ``driver.copy_batch``).
:func:`launcher` compiles once per device and launches with one ``cuLaunchKernel`` through
the driver seam (:class:`~jaxbuf.kernels.cuda_launch.DirectLauncher`). Device time on an H200:
1,024 scattered 64 KiB blocks in 38 us, torch's one copy of the same 64 MiB in 35 us.
"""

from __future__ import annotations

import threading
from typing import Any

import triton
import triton.language as tl

from .staged_write import copy_elements, interpreted

__all__ = ["ALIGNMENT", "PIECE_BYTES", "copy_interpreted", "launcher", "pieces_per_copy"]

PIECE_BYTES = 16 * 1024
"""The most one program copies (16, 32 and 64 KiB measured alike on an H200 for 64 KiB
blocks; 16 KiB spreads one 64 MiB copy best)."""
ALIGNMENT = 8
"""Every address and size in the table is a multiple of this."""
_TILE = 1024  # int64 elements per step: 8 KiB, 64 bytes a thread with 4 warps
_LOCK = threading.Lock()
_launchers: dict[tuple[int, int], Any] = {}


@triton.jit(do_not_specialize=["table_addr", "count", "pieces"])
def _copy_kernel(table_addr, count, pieces, PIECE: tl.constexpr, TILE: tl.constexpr):
    # The table arrives as an integer address (the interpreter takes no raw pointers).
    table = table_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    program = tl.program_id(0).to(tl.int64)
    index = program // pieces
    start = (program % pieces) * PIECE
    size = tl.load(table + 2 * count + index)
    length = (tl.minimum(size - start, PIECE)) // 8  # <= 0 past the end: nothing copied
    dst = (tl.load(table + index) + start).to(tl.pointer_type(tl.int64))
    src = (tl.load(table + count + index) + start).to(tl.pointer_type(tl.int64))
    copy_elements(dst, src, length, TILE)


def pieces_per_copy(largest: int) -> int:
    """Programs per copy for a list whose largest copy is ``largest`` bytes."""
    return max(1, -(-largest // PIECE_BYTES))


def copy_interpreted(table_addr: int, count: int, largest: int) -> None:
    """Run the kernel under Triton's interpreter over host memory (the tests' reference)."""
    pieces = pieces_per_copy(largest)
    kernel = interpreted(_copy_kernel)
    kernel[(count * pieces,)](table_addr, count, pieces, PIECE=PIECE_BYTES, TILE=_TILE)


def launcher(driver: Any, device_index: int) -> Any:
    """``launch(count, largest, stream, table_addr, copy=None)``: the compiled kernel on
    ``device_index`` over the ``count`` copies of the table at ``table_addr`` (the largest of
    ``largest`` bytes), launched with one ``cuLaunchKernel`` on raw stream ``stream`` after
    the copy ``copy`` = ``(dst, src, size)`` on that stream (the table's upload). Compiled
    once per driver and device; raises what Triton or the direct launcher raise when it
    cannot be made (the caller then copies with ``driver.copy_batch``)."""
    key = (id(driver), device_index)
    with _LOCK:
        launch = _launchers.get(key)
        if launch is None:
            launch = _launchers[key] = _compile(driver, device_index)
    return launch


def _compile(driver: Any, device_index: int) -> Any:
    import torch

    from .cuda_launch import DirectLauncher

    with torch.cuda.device(device_index):
        # Warmed up with an address past 2**32: the address parameter is int64 thereafter.
        compiled = _copy_kernel.warmup(
            1 << 40, 1 << 20, 1 << 20, PIECE=PIECE_BYTES, TILE=_TILE, grid=(1,)
        )
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        compiled._init_handles()
    direct = DirectLauncher(compiled, driver, ("table_addr", "count", "pieces"))
    bound = direct.bind(device_index)

    def launch(count: int, largest: int, stream: Any, table_addr: int, copy: Any = None) -> None:
        pieces = pieces_per_copy(largest)
        bound(count * pieces, stream, table_addr, count, pieces, copy=copy)

    launch.launcher = direct  # the closure holds raw addresses: keep the launcher alive
    return launch
