"""A Triton kernel that copies a list of (destination, source, bytes) pieces in one launch.

A KV-cache transfer moves hundreds of scattered blocks. ``cuMemcpyBatchAsync`` submits each
copy on its own (about 5 us apiece on an H200: 1,024 blocks of 64 KiB take 5 ms, 11 GB/s), so
many small copies go through this kernel instead: one program per piece, each piece at most
:data:`PIECE_BYTES` (the caller splits longer copies, so that a 64 MiB block is spread over
every SM rather than copied by one program).

The piece table is int64 ``[n, 3]`` (dst, src, nbytes) in device memory, uploaded by the copy
the launch enqueues first (read from pinned host memory, each program would wait on PCIe).
Every address and size is a multiple of :data:`ALIGNMENT` (pieces move as int64 elements;
the caller checks, and copies anything else with ``driver.copy_batch``). :func:`launcher`
compiles once per device and launches with one ``cuLaunchKernel`` through the driver seam
(:class:`~jaxbuf.kernels.cuda_launch.DirectLauncher`).
"""

from __future__ import annotations

import threading
from typing import Any

import triton
import triton.language as tl

from .staged_write import copy_elements, interpreted

__all__ = ["ALIGNMENT", "PIECE_BYTES", "copy_pieces_interpreted", "launcher"]

PIECE_BYTES = 16 * 1024
"""The most one program copies: longer copies are split into pieces of this size (16, 32 and
64 KiB measured alike on an H200 for 64 KiB blocks; 16 KiB spreads one 64 MiB copy best)."""
ALIGNMENT = 8
"""Every address and size in the table is a multiple of this."""
_TILE = 1024  # int64 elements per step: 8 KiB, 64 bytes a thread with 4 warps
_LOCK = threading.Lock()
_launchers: dict[tuple[int, int], Any] = {}


@triton.jit(do_not_specialize=["table_addr", "count"])
def _copy_pieces_kernel(table_addr, count, TILE: tl.constexpr):
    # The table arrives as an integer address (the interpreter takes no raw pointers).
    table = table_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    row = table + tl.program_id(0).to(tl.int64) * 3
    dst = tl.load(row + 0).to(tl.pointer_type(tl.int64))
    src = tl.load(row + 1).to(tl.pointer_type(tl.int64))
    length = tl.load(row + 2) // 8
    copy_elements(dst, src, length, TILE)


def copy_pieces_interpreted(table_addr: int, count: int) -> None:
    """Run the kernel under Triton's interpreter over host memory (the tests' reference)."""
    kernel = interpreted(_copy_pieces_kernel)
    kernel[(count,)](table_addr, count, TILE=_TILE)


def launcher(driver: Any, device_index: int) -> Any:
    """``launch(count, stream, table_addr, copy=None)``: the compiled kernel on
    ``device_index``, launched with one ``cuLaunchKernel`` on raw stream ``stream``, after
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
        compiled = _copy_pieces_kernel.warmup(1 << 40, 1 << 20, TILE=_TILE, grid=(1,))
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        compiled._init_handles()
    direct = DirectLauncher(compiled, driver, ("table_addr", "count"))
    bound = direct.bind(device_index)

    def launch(count: int, stream: Any, table_addr: int, copy: Any = None) -> None:
        bound(count, stream, table_addr, count, copy=copy)

    launch.launcher = direct  # the closure holds raw addresses: keep the launcher alive
    return launch
