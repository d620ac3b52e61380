"""Triton staged-write kernel on raw pointers, and its launcher.

One launch applies W row writes across G target tables of possibly different dtypes. The host
converts every value to its target's dtype beforehand, so the kernel only moves bits: it picks an
int8/int16/int32/int64 view by the group's element size.

Tables (int64, C-contiguous, built by the caller, e.g. with :func:`make_write_table`):

- write table ``[W, 5]``: ``group, row, start, content_offset, length`` per write. ``start`` and
  ``length`` count elements; ``content_offset`` counts bytes into ``contents`` and is a multiple of
  the group's element size.
- group table ``[G, 3]``: ``out_ptr, row_stride, elem_size`` per target table. ``out_ptr`` is the
  address of element ``[0, 0]``, ``row_stride`` counts elements, ``elem_size`` is 1, 2, 4 or 8.

Writes in a parallel launch have no defined order among themselves; when two overlap, launch with
``serial=True`` (writes grouped by target row with :func:`jaxbuf.kernels.row_segments`; one
program per row walks its writes in table order, so later writes win).
:func:`jaxbuf.kernels.has_overlap` tells which is needed.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import triton
import triton.language as tl

from .reference import CONTENT_ALIGNMENT, IntsAt, address_of

__all__ = ["CompiledLauncher", "apply_staged_writes", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 1024
_COMPILE_LOCK = threading.Lock()


@triton.jit(do_not_specialize=["write_table_addr", "group_table_addr", "contents_addr",
                               "num_writes", "segments_addr"])
def _apply_staged_writes_kernel(
    write_table_addr,  # int64 address of the int64 [W, 5] write table
    group_table_addr,  # int64 address of the int64 [G, 3] group table
    contents_addr,  # int64 address of the contents bytes (8-byte aligned)
    num_writes,  # W: number of write-table rows to apply
    segments_addr,  # SERIAL only: int64 address of int64 [S + 1] segment bounds in the table
    BLOCK_SIZE: tl.constexpr,  # elements copied per step; longer writes loop
    SERIAL: tl.constexpr,  # program p applies writes [segments[p], segments[p + 1]) in order
):
    # Addresses arrive as integers, not typed pointer arguments: the Triton interpreter only
    # accepts torch tensors as pointer arguments, and integers work unchanged on both.
    # An address below 2**31 arrives as int32 (Triton types ints by value); widen it first.
    write_table = write_table_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    group_table = group_table_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    contents_addr = contents_addr.to(tl.int64)
    # `while` rather than `for ... in range(...)`: Triton 3.6's interpreter turns a tensor loop
    # bound into a Python int through a 1-element array, which NumPy >= 2.3 refuses.
    # Loop variables start as tensors of their final types, as Triton requires of loop-carried
    # values.
    if SERIAL:
        # Writes that may overlap sit in one segment (the host groups them by target row), and
        # a segment's writes run in table order inside one program: later writes win, while
        # segments still run in parallel.
        segments = segments_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
        write = tl.load(segments + tl.program_id(0))
        end_write = tl.load(segments + tl.program_id(0) + 1)
    else:
        write = tl.program_id(0)
        end_write = write + 1
    while write < end_write:
        fields = write_table + write * 5
        group = tl.load(fields + 0)
        row = tl.load(fields + 1)
        start = tl.load(fields + 2)
        content_offset = tl.load(fields + 3)
        length = tl.load(fields + 4)
        group_fields = group_table + group * 3
        out_addr = tl.load(group_fields + 0)
        row_stride = tl.load(group_fields + 1)
        elem_size = tl.load(group_fields + 2)
        element = row * row_stride + start
        # Source and target addresses stay integers until cast to the element's pointer type:
        # Triton 3.6's interpreter cannot bitcast one pointer type to another.
        src_addr = contents_addr + content_offset
        # One branch per element size, each with its own pointer type; names differ per branch
        # because Triton rejects a name bound to different types in two branches. The block
        # loop is written out in each branch because the interpreter cannot call a nested
        # @triton.jit helper from an on-demand interpreted kernel. Writes longer than one block
        # loop inside the program.
        if elem_size == 8:
            dst64 = out_addr.to(tl.pointer_type(tl.int64)) + element
            src64 = src_addr.to(tl.pointer_type(tl.int64))
            block_start = length * 0
            while block_start < length:
                offsets = block_start + tl.arange(0, BLOCK_SIZE)
                mask = offsets < length
                tl.store(dst64 + offsets, tl.load(src64 + offsets, mask=mask), mask=mask)
                block_start += BLOCK_SIZE
        elif elem_size == 4:
            dst32 = out_addr.to(tl.pointer_type(tl.int32)) + element
            src32 = src_addr.to(tl.pointer_type(tl.int32))
            block_start = length * 0
            while block_start < length:
                offsets = block_start + tl.arange(0, BLOCK_SIZE)
                mask = offsets < length
                tl.store(dst32 + offsets, tl.load(src32 + offsets, mask=mask), mask=mask)
                block_start += BLOCK_SIZE
        elif elem_size == 2:
            dst16 = out_addr.to(tl.pointer_type(tl.int16)) + element
            src16 = src_addr.to(tl.pointer_type(tl.int16))
            block_start = length * 0
            while block_start < length:
                offsets = block_start + tl.arange(0, BLOCK_SIZE)
                mask = offsets < length
                tl.store(dst16 + offsets, tl.load(src16 + offsets, mask=mask), mask=mask)
                block_start += BLOCK_SIZE
        else:
            dst8 = out_addr.to(tl.pointer_type(tl.int8)) + element
            src8 = src_addr.to(tl.pointer_type(tl.int8))
            block_start = length * 0
            while block_start < length:
                offsets = block_start + tl.arange(0, BLOCK_SIZE)
                mask = offsets < length
                tl.store(dst8 + offsets, tl.load(src8 + offsets, mask=mask), mask=mask)
                block_start += BLOCK_SIZE
        if SERIAL:
            # Different threads may write the same element for consecutive writes; the barrier
            # makes the later write's stores come after the earlier one's.
            tl.debug_barrier()
        write += 1


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_interpreted_kernel = None


def _kernel(interpret: bool):
    """The kernel object to launch: compiled, or under the Triton interpreter.

    ``triton.jit`` picks the interpreter when the module is imported (``TRITON_INTERPRET=1``);
    building the interpreted form on demand makes ``interpret=True`` work whatever the import
    order was.
    """
    global _interpreted_kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_apply_staged_writes_kernel, InterpretedFunction):
        if not interpret:
            raise RuntimeError("jaxbuf.kernels.staged_write was imported with TRITON_INTERPRET=1; "
                               "cannot launch it compiled in this process")
        return _apply_staged_writes_kernel
    if not interpret:
        return _apply_staged_writes_kernel
    if _interpreted_kernel is None:
        _interpreted_kernel = InterpretedFunction(_apply_staged_writes_kernel.fn)
    return _interpreted_kernel


def apply_staged_writes(write_table: Any, group_table: Any, contents: Any,
                        num_writes: int | None = None, *, serial: bool = False,
                        segments: Any = None, block_size: int = DEFAULT_BLOCK_SIZE,
                        interpret: bool | None = None, stream: Any = None) -> None:
    """Apply ``num_writes`` staged writes with one kernel launch.

    ``write_table``, ``group_table`` and ``contents`` are each an int address, a C-contiguous
    numpy array, or an object with ``data_ptr()`` (torch tensor, jaxbuf view). The kernel reads
    them in place: on the GPU they must be device-visible (device memory or UVA-mapped pinned host
    memory, so no copy is made); under the interpreter they are host memory. ``num_writes`` may be
    omitted only when ``write_table`` is a numpy array. ``serial=True`` (needed when writes
    overlap; later writes win) runs one program per segment of ``segments`` (int64 ``[S + 1]``
    bounds into the table, device-visible like the tables; see
    :func:`jaxbuf.kernels.row_segments`), each
    applying its writes in table order; without ``segments``, one program applies every write.
    Otherwise one program per write. ``interpret`` defaults to the ``TRITON_INTERPRET`` environment variable. ``stream``
    (a ``torch.cuda.Stream``) defaults to torch's current stream; the launch is asynchronous
    there.
    """
    if isinstance(write_table, np.ndarray):
        if write_table.dtype != np.int64 or write_table.ndim != 2 or write_table.shape[1] != 5:
            raise ValueError(f"write_table must be int64 [W, 5], got {write_table.dtype} "
                             f"{list(write_table.shape)}")
        if num_writes is None:
            num_writes = write_table.shape[0]
        elif num_writes > write_table.shape[0]:
            raise ValueError(f"num_writes {num_writes} exceeds the write table's "
                             f"{write_table.shape[0]} rows")
    elif num_writes is None:
        raise ValueError("num_writes is required when write_table is not a numpy array")
    if isinstance(group_table, np.ndarray) and (
            group_table.dtype != np.int64 or group_table.ndim != 2 or group_table.shape[1] != 3):
        raise ValueError(f"group_table must be int64 [G, 3], got {group_table.dtype} "
                         f"{list(group_table.shape)}")
    if num_writes < 0:
        raise ValueError(f"num_writes must be >= 0, got {num_writes}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    write_table_addr = address_of(write_table)
    group_table_addr = address_of(group_table)
    contents_addr = address_of(contents)
    if contents_addr % CONTENT_ALIGNMENT:
        raise ValueError(f"contents address {contents_addr:#x} is not "
                         f"{CONTENT_ALIGNMENT}-byte aligned")
    if num_writes == 0:
        return
    if interpret is None:
        interpret = _interpret_requested()
    kernel = _kernel(interpret)
    segments_addr, grid = 0, (num_writes,)
    if serial:
        if segments is None:
            segments = np.array([0, num_writes], dtype=np.int64)
            if not interpret:  # the device must read it
                import torch

                segments = torch.from_numpy(segments).cuda()
        num_segments = _segment_count(segments)
        segments_addr, grid = address_of(segments), (num_segments,)
    args = (write_table_addr, group_table_addr, contents_addr, num_writes, segments_addr)
    if stream is None or interpret:
        kernel[grid](*args, BLOCK_SIZE=block_size, SERIAL=serial)
        return
    import torch

    with torch.cuda.stream(stream):
        kernel[grid](*args, BLOCK_SIZE=block_size, SERIAL=serial)


def _segment_count(segments: Any) -> int:
    shape = getattr(segments, "shape", None)
    if shape is None or len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"segments must be a 1-D int64 array of S + 1 >= 2 bounds, got {shape}")
    return int(shape[0]) - 1


class CompiledLauncher:
    """Launches the compiled Triton kernel through its cached launcher.

    ``kernel[grid](...)`` re-binds and re-specialises its arguments on every call (tens of
    microseconds of Python); the arguments here never change type (three int64 addresses and
    an int32 count), so after one ``warmup`` compile per ``serial`` value the compiled
    kernel's launcher is called directly, on an explicit stream. Triton's launch hooks
    (profilers) are not called on this path. Triton releases before 3.3 launch differently:
    there every launch goes through :func:`apply_staged_writes`.

    ``launcher(write_table, group_table, contents, num_writes, serial, raw_stream, ...)``
    takes int addresses (device-visible) and a raw ``CUstream`` handle; extra positional
    arguments are ignored, so it is interchangeable with the CPU launchers of
    :mod:`jaxbuf.staged`.
    """

    # Compiled with addresses past 2**32 so the address parameters are int64 whatever the
    # first real addresses are.
    _WARMUP_ADDRESS = 1 << 40

    def __init__(self, device_index: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.device_index = device_index
        self.block_size = block_size
        self._compiled: dict[bool, tuple] = {}
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
        self._fast = version >= (3, 3)

    def _compile(self, serial: bool) -> tuple:
        import torch

        kernel = _kernel(False)
        address = self._WARMUP_ADDRESS
        # One compile at a time: writers driven from several threads compile their first
        # launch together, and Triton's per-kernel caches are not meant for that.
        with _COMPILE_LOCK, torch.cuda.device(self.device_index):
            compiled = kernel.warmup(address, address, address, 1 << 20, address,
                                     BLOCK_SIZE=self.block_size, SERIAL=serial, grid=(1,))  # fmt: skip
            if hasattr(compiled, "result"):  # an asynchronous compile
                compiled = compiled.result()
            compiled._init_handles()
        entry = (compiled.run, compiled.function, compiled.packed_metadata)
        self._compiled[serial] = entry
        return entry

    def __call__(self, wt, gt, contents, num_writes, serial, raw_stream, *_host_tables,
                 segments: int = 0, num_segments: int = 1) -> None:
        if num_writes >= 1 << 31:
            raise ValueError(f"{num_writes} writes exceed one launch's int32 count")
        if not self._fast:
            import torch

            apply_staged_writes(wt, gt, contents, num_writes, serial=serial,
                                segments=IntsAt(segments, num_segments + 1) if serial
                                else None, block_size=self.block_size, interpret=False,
                                stream=torch.cuda.ExternalStream(raw_stream))  # fmt: skip
            return
        entry = self._compiled.get(serial)
        if entry is None:
            entry = self._compile(serial)
        run, function, metadata = entry
        # The launcher takes every kernel argument, constexprs included, as JITFunction.run
        # passes them.
        run(num_segments if serial else num_writes, 1, 1, raw_stream, function, metadata, None,
            None, None, wt, gt, contents, num_writes, segments, self.block_size, serial)  # fmt: skip

