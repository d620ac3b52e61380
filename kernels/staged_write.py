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
import types
from typing import Any

import numpy as np
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from jaxbuf.drivers.base import settle_failed_launch

from .reference import CONTENT_ALIGNMENT, StagedLaunch, address_of

__all__ = ["CompiledLauncher", "apply_staged_writes", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 1024
_COMPILE_LOCK = threading.Lock()


def copy_elements(dst, src, length, BLOCK_SIZE: tl.constexpr):
    # The body the torch kernel below and the JAX one (jaxbuf.kernels.packed_write) share:
    # copy ``length`` elements from typed pointer ``src`` to ``dst`` (same element type), one
    # masked block at a time; a length <= 0 copies nothing. Triton inlines it into each caller.
    # `while` rather than `for ... in range(...)`: Triton 3.6's interpreter turns a tensor loop
    # bound into a Python int through a 1-element array, which NumPy >= 2.3 refuses. The loop
    # variable starts as a tensor of its final type, as Triton requires of loop-carried values.
    block_start = length * 0
    while block_start < length:
        offsets = block_start + tl.arange(0, BLOCK_SIZE)
        mask = offsets < length
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)
        block_start += BLOCK_SIZE


# A compiled-mode function whatever TRITON_INTERPRET says (``triton.jit`` would make it an
# InterpretedFunction there, which the compiler refuses inside a compiled kernel); interpreted
# kernels get an interpreted copy through :func:`interpreted`.
copy_elements = JITFunction(copy_elements)


@triton.jit(
    do_not_specialize=[
        "write_table_addr",
        "group_table_addr",
        "contents_addr",
        "num_writes",
        "segments_addr",
    ]
)
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
        # because Triton rejects a name bound to different types in two branches. Writes longer
        # than one block loop inside the program (copy_elements).
        if elem_size == 8:
            dst64 = out_addr.to(tl.pointer_type(tl.int64)) + element
            src64 = src_addr.to(tl.pointer_type(tl.int64))
            copy_elements(dst64, src64, length, BLOCK_SIZE)
        elif elem_size == 4:
            dst32 = out_addr.to(tl.pointer_type(tl.int32)) + element
            src32 = src_addr.to(tl.pointer_type(tl.int32))
            copy_elements(dst32, src32, length, BLOCK_SIZE)
        elif elem_size == 2:
            dst16 = out_addr.to(tl.pointer_type(tl.int16)) + element
            src16 = src_addr.to(tl.pointer_type(tl.int16))
            copy_elements(dst16, src16, length, BLOCK_SIZE)
        else:
            dst8 = out_addr.to(tl.pointer_type(tl.int8)) + element
            src8 = src_addr.to(tl.pointer_type(tl.int8))
            copy_elements(dst8, src8, length, BLOCK_SIZE)
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
            raise RuntimeError(
                "jaxbuf.kernels.staged_write was imported with TRITON_INTERPRET=1; "
                "cannot launch it compiled in this process"
            )
    elif not interpret:
        return _apply_staged_writes_kernel
    if _interpreted_kernel is None:
        _interpreted_kernel = interpreted(_apply_staged_writes_kernel)
    return _interpreted_kernel


def interpreted(kernel: Any) -> Any:
    """``kernel`` (a ``triton.jit`` function, compiled-mode or interpreted) under Triton's
    interpreter, with the ``@triton.jit`` helpers it calls interpreted too.

    The interpreter runs the kernel's Python source against its module's globals, where a
    helper such as :func:`copy_elements` is a compiled-mode function that refuses to be called
    from Python. The interpreted kernel therefore runs over a copy of those globals in which
    each such helper is interpreted (one level: the helpers here call no others).
    """
    from triton.runtime.interpreter import InterpretedFunction

    fn = kernel.fn
    namespace = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        if isinstance(namespace.get(name), JITFunction):
            namespace[name] = InterpretedFunction(namespace[name].fn)
    rebound = types.FunctionType(
        fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__
    )
    return InterpretedFunction(rebound)


def apply_staged_writes(
    write_table: Any,
    group_table: Any,
    contents: Any,
    num_writes: int | None = None,
    *,
    serial: bool = False,
    segments: Any = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    interpret: bool | None = None,
    stream: Any = None,
) -> None:
    """Apply ``num_writes`` staged writes with one kernel launch.

    ``write_table``, ``group_table`` and ``contents`` are each an int address, a C-contiguous
    numpy array, or an object with ``data_ptr()`` (torch tensor, jaxbuf view). The kernel reads
    them in place: on the GPU they must be device-visible (device memory or UVA-mapped pinned host
    memory, so no copy is made); under the interpreter they are host memory. ``num_writes`` may be
    omitted only when ``write_table`` is a numpy array. ``serial=True`` (needed when writes
    overlap; later writes win) runs one program per segment of ``segments`` (int64 ``[S + 1]``
    bounds into the table, device-visible like the tables; see
    :func:`jaxbuf.kernels.row_segments`), each applying its writes in table order; without
    ``segments``, one program applies every write. Otherwise one program per write.
    ``interpret`` defaults to the ``TRITON_INTERPRET`` environment variable. ``stream`` (a
    ``torch.cuda.Stream``) defaults to torch's current stream; the launch is asynchronous
    there.
    """
    if isinstance(write_table, np.ndarray):
        if write_table.dtype != np.int64 or write_table.ndim != 2 or write_table.shape[1] != 5:
            raise ValueError(
                f"write_table must be int64 [W, 5], got {write_table.dtype} "
                f"{list(write_table.shape)}"
            )
        if num_writes is None:
            num_writes = write_table.shape[0]
        elif num_writes > write_table.shape[0]:
            raise ValueError(
                f"num_writes {num_writes} exceeds the write table's {write_table.shape[0]} rows"
            )
    elif num_writes is None:
        raise ValueError("num_writes is required when write_table is not a numpy array")
    if isinstance(group_table, np.ndarray) and (
        group_table.dtype != np.int64 or group_table.ndim != 2 or group_table.shape[1] != 3
    ):
        raise ValueError(
            f"group_table must be int64 [G, 3], got {group_table.dtype} {list(group_table.shape)}"
        )
    if num_writes < 0:
        raise ValueError(f"num_writes must be >= 0, got {num_writes}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    write_table_addr = address_of(write_table)
    group_table_addr = address_of(group_table)
    contents_addr = address_of(contents)
    if contents_addr % CONTENT_ALIGNMENT:
        raise ValueError(
            f"contents address {contents_addr:#x} is not {CONTENT_ALIGNMENT}-byte aligned"
        )
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
    """Launches the compiled Triton kernel: directly with ``cuLaunchKernel`` where it can, else
    through Triton's launcher.

    Triton compiles the parallel kernel once (a ``warmup``, cached here): the arguments never
    change type (three int64 addresses, an int32 count, an int64 address), so launches skip
    ``kernel[grid](...)``, which re-binds and re-specialises them on every call (tens of
    microseconds). The cached kernel is then launched

    * directly (Triton 3.3+, with a driver that launches kernels): a
      :class:`~jaxbuf.kernels.cuda_launch.DirectLauncher` rewrites the five values in its
      prepacked argument buffer and calls the driver seam's ``copy_and_launch`` (context
      check, the optional copy and ``cuLaunchKernel``, one C call on CUDA); a few
      microseconds;
    * else through Triton's launcher (``CompiledKernel.run``). :attr:`fallback_reason` says
      why in one line; it is None while every kernel compiled so far launches directly.
      Before Triton 3.3 every launch goes through :func:`apply_staged_writes`.

    ``direct=False``, or the environment variable ``JAXBUF_DIRECT_LAUNCH=0``, keeps Triton's
    launcher. Triton's launch hooks (profilers) are called on neither path.

    ``launcher(args, raw_stream, tables=None, copy=None)`` takes a :class:`StagedLaunch`
    (device-visible addresses and the write count) and a raw ``CUstream`` handle (0: the
    legacy default stream); it makes the device's context current on the calling thread, and
    enqueues ``copy`` = ``(dst, src, size)`` (the staging slot's device copy) on the stream
    before the launch. It keeps ``copy_and_launch``'s contract: when it raises, nothing was
    launched and the copy has completed. The grid is one program per write: the writes are
    disjoint (the kernel's ``SERIAL`` mode is :func:`apply_staged_writes`'s). ``tables`` (the
    host views) is ignored, so it is interchangeable with the CPU launchers of the staged
    writes. Not thread-safe: one writer drives it.
    """

    # Compiled with addresses past 2**32 so the address parameters are int64 whatever the
    # first real addresses are.
    _WARMUP_ADDRESS = 1 << 40
    #: The kernel's runtime arguments, in the order launches pass them.
    RUNTIME_ARGUMENTS = (
        "write_table_addr",
        "group_table_addr",
        "contents_addr",
        "num_writes",
        "segments_addr",
    )

    def __init__(
        self,
        device_index: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        driver: Any = None,
        direct: bool = True,
    ) -> None:
        self.device_index = device_index
        self.block_size = block_size
        if driver is None:
            from jaxbuf.drivers import driver_for_platform

            driver = driver_for_platform("cuda")
        self._driver = driver
        version = _triton_version()
        self._legacy = version < (3, 3)
        # launch(grid, stream, wt, gt, contents, num_writes, segments, copy=None), made on
        # first use
        self._launch: Any = None
        self.fallback_reason: str | None = _direct_unavailable_reason(version, driver, direct)

    @property
    def direct(self) -> bool:
        """Whether every kernel compiled so far launches with ``cuLaunchKernel``."""
        return self.fallback_reason is None

    def _compile(self) -> Any:
        """The compiled parallel kernel, its handles loaded on this launcher's device."""
        import torch

        kernel = _kernel(False)
        address = self._WARMUP_ADDRESS
        # One compile at a time: writers driven from several threads compile their first
        # launch together, and Triton's per-kernel caches are not meant for that.
        with _COMPILE_LOCK, torch.cuda.device(self.device_index):
            compiled = kernel.warmup(
                address,
                address,
                address,
                1 << 20,
                address,
                BLOCK_SIZE=self.block_size,
                SERIAL=False,
                grid=(1,),
            )
            if hasattr(compiled, "result"):  # an asynchronous compile
                compiled = compiled.result()
            compiled._init_handles()
        return compiled

    def _prepare(self) -> Any:
        """The launch function: direct where possible (else the reason is kept in
        :attr:`fallback_reason`)."""
        from .cuda_launch import DirectLauncher, DirectLaunchUnavailable

        if self._legacy:
            launch = self._through_apply()
        else:
            compiled = self._compile()
            launch = None
            if self.fallback_reason is None:
                try:
                    launcher = DirectLauncher(compiled, self._driver, self.RUNTIME_ARGUMENTS)
                    launch = launcher.bind(self.device_index)
                except DirectLaunchUnavailable as error:
                    self.fallback_reason = str(error)
            if launch is None:
                launch = self._through_triton(compiled)
        self._launch = launch
        return launch

    def _through_triton(self, compiled: Any) -> Any:
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        block_size = self.block_size
        before = self._before_launch

        def launch(grid, stream, wt, gt, contents, num_writes, segments, copy=None):
            before(stream, copy)
            if not grid:
                return
            try:
                # Triton's launcher takes every kernel argument, constexprs included, as
                # JITFunction.run passes them.
                run(
                    grid,
                    1,
                    1,
                    stream,
                    function,
                    metadata,
                    None,
                    None,
                    None,
                    wt,
                    gt,
                    contents,
                    num_writes,
                    segments,
                    block_size,
                    False,  # SERIAL
                )
            except BaseException as error:
                self._after_failed_launch(error, copy)
                raise

        return launch

    def _through_apply(self) -> Any:
        block_size = self.block_size
        before = self._before_launch

        def launch(grid, stream, wt, gt, contents, num_writes, segments, copy=None):
            import torch

            before(stream, copy)
            try:
                apply_staged_writes(
                    wt,
                    gt,
                    contents,
                    num_writes,
                    block_size=block_size,
                    interpret=False,
                    stream=torch.cuda.ExternalStream(stream),
                )
            except BaseException as error:
                self._after_failed_launch(error, copy)
                raise

        return launch

    def _before_launch(self, stream: int, copy: Any) -> None:
        """What ``driver.copy_and_launch`` does before its launch, for Triton's launchers:
        the device's context current, ``copy`` enqueued on ``stream`` (its call with no
        program to launch)."""
        self._driver.copy_and_launch(self.device_index, stream, copy, 0, (0, 1, 1), (1, 1, 1), 0, 0)

    def _after_failed_launch(self, error: BaseException, copy: Any) -> None:
        """``copy_and_launch``'s contract for Triton's launchers: when the launch fails, a
        copy enqueued before it has completed, so its source may be rewritten."""
        settle_failed_launch(self._driver, error, copy, self.device_index)

    def __call__(
        self, args: StagedLaunch, raw_stream: int, tables: Any = None, copy: Any = None
    ) -> None:
        wt, gt, contents, num_writes = args
        if num_writes >= 1 << 31:
            raise ValueError(f"{num_writes} writes exceed one launch's int32 count")
        launch = self._launch
        if launch is None:
            launch = self._prepare()
        # One program per write (no segments: 0). A grid of 0 launches nothing.
        launch(num_writes, raw_stream, wt, gt, contents, num_writes, 0, copy=copy)


def _triton_version() -> tuple[int, int]:
    parts = []
    for part in triton.__version__.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())  # "3.6.0+git..." or "3.6rc1"
        parts.append(int(digits or 0))
    return tuple(parts)


def _direct_unavailable_reason(version: tuple[int, int], driver: Any, direct: bool) -> str | None:
    """Why no kernel of a launcher may launch directly, before any is compiled; None: try."""
    if not direct:
        return "direct launch disabled by the caller (direct=False)"
    setting = os.environ.get("JAXBUF_DIRECT_LAUNCH", "1").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return f"direct launch disabled by JAXBUF_DIRECT_LAUNCH={setting}"
    if version < (3, 3):
        return (
            f"Triton {triton.__version__} predates 3.3; the parameters of its compiled "
            "kernels are not known here"
        )
    from jaxbuf.drivers.base import VmmDriver

    launch_kernel = getattr(type(driver), "launch_kernel", None)
    if launch_kernel is None or launch_kernel is VmmDriver.launch_kernel:
        return f"{type(driver).__name__} does not implement launch_kernel"
    reason = driver.unavailable_reason()
    if reason is not None:
        return f"the driver is unavailable: {reason}"
    return None
