"""A compiled Triton kernel launched by one ``cuLaunchKernel``, with prepacked arguments.

Triton compiles; this module only launches. Triton's own launcher re-reads and converts every
argument on every call (and allocates scratch memory where a kernel needs it), which costs
several microseconds of Python and C per launch. A :class:`DirectLauncher` does that work
once: it reads the compiled kernel's parameter list, lays the values out in one buffer beside
an array of pointers to them (CUDA's ``kernelParams``), and per launch rewrites only the
runtime values (one ``struct.pack_into``) before calling the driver seam's
:meth:`~jaxbuf.drivers.base.VmmDriver.launch_kernel`. ``cuLaunchKernel`` copies the values
while it enqueues, so the buffer may be rewritten as soon as the call returns.

The parameters a compiled Triton kernel takes (Triton 3.3 and later): its arguments that are
not ``constexpr``, in order, typed by the compile's signature, then the hidden pointers
Triton appends, each present when the metadata names its size: ``global_scratch``
(``global_scratch_size``, 3.3+) and ``profile_scratch`` (``profile_scratch_size``). A kernel
whose scratch size is not 0 needs memory per launch, which only Triton's launcher allocates.

Never silently wrong: every assumption is checked when the launcher is made, and a kernel
that breaks one raises :class:`DirectLaunchUnavailable` with a one-line reason (the caller
then keeps Triton's launcher). The layout is also checked against the ``.param`` list of the
kernel's PTX, the text the binary was assembled from.
"""

from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "ArgumentLayout",
    "DirectLaunchUnavailable",
    "DirectLauncher",
    "PackedArguments",
    "argument_layout",
    "kernel_parameters",
    "ptx_parameter_sizes",
]

#: Triton signature type -> (struct code, size in bytes) of the value the kernel receives.
#: Pointers are 64-bit addresses. Types not listed (fp16/bf16 scalars, tensor descriptors,
#: tuples) are refused rather than guessed.
_SCALAR_CODES = {
    "i8": ("b", 1),
    "i16": ("h", 2),
    "i32": ("i", 4),
    "i64": ("q", 8),
    "u8": ("B", 1),
    "u16": ("H", 2),
    "u32": ("I", 4),
    "u64": ("Q", 8),
    "fp32": ("f", 4),
    "f32": ("f", 4),
    "fp64": ("d", 8),
}
_POINTER = ("Q", 8)
#: The hidden pointer parameters Triton appends, with the metadata field that announces each.
HIDDEN_PARAMETERS = (
    ("global_scratch", "global_scratch_size"),
    ("profile_scratch", "profile_scratch_size"),
)
#: Above this, Triton launches with an extra attribute (oversized shared memory) that
#: ``cuLaunchKernel`` cannot express.
_MAX_PLAIN_SHARED = 228 * 1024


class DirectLaunchUnavailable(RuntimeError):
    """A compiled kernel cannot be launched directly; the message is the one-line reason."""


class Parameter(NamedTuple):
    """One parameter of a compiled kernel: its name, Triton type, and whether it is one of
    Triton's hidden pointers (always passed as NULL here)."""

    name: str
    type: str
    hidden: bool = False


def kernel_parameters(compiled: Any) -> tuple[Parameter, ...]:
    """Every parameter ``compiled`` (a Triton ``CompiledKernel``) takes, in order: its
    non-constexpr arguments, then Triton's hidden pointers (see the module docstring).

    Raises :class:`DirectLaunchUnavailable` when the kernel object does not show what this
    needs (no ``src.signature``, no argument names).
    """
    src = getattr(compiled, "src", None)
    signature = getattr(src, "signature", None)
    arg_names = getattr(getattr(src, "fn", None), "arg_names", None)
    if not isinstance(signature, dict) or arg_names is None:
        raise DirectLaunchUnavailable(
            "the compiled kernel shows no signature (src.signature, src.fn.arg_names)"
        )
    metadata = getattr(compiled, "metadata", None)

    def index_of(key: Any) -> int:
        # Triton keys arguments by name (3.3+), by index, or by an index path (constants).
        if isinstance(key, str):
            if key not in arg_names:
                raise DirectLaunchUnavailable(f"the signature names {key!r}, not an argument")
            return list(arg_names).index(key)
        if isinstance(key, tuple):
            if len(key) != 1:
                raise DirectLaunchUnavailable(f"tuple argument {key} is not supported")
            return int(key[0])
        return int(key)

    constants = {index_of(key) for key in getattr(src, "constants", None) or {}}
    parameters = []
    for key, kind in sorted(signature.items(), key=lambda item: index_of(item[0])):
        index = index_of(key)
        if kind == "constexpr" or index in constants:
            continue
        if not isinstance(kind, str):
            raise DirectLaunchUnavailable(f"argument {arg_names[index]!r} has type {kind!r}")
        parameters.append(Parameter(arg_names[index], kind))
    for name, size_field in HIDDEN_PARAMETERS:
        if hasattr(metadata, size_field):
            parameters.append(Parameter(name, "*i8", hidden=True))
    return tuple(parameters)


class ArgumentLayout(NamedTuple):
    """Where each parameter's value sits in the argument buffer.

    ``offsets[i]``/``sizes[i]`` for parameter ``i`` (each at its natural alignment);
    ``nbytes`` the buffer size; ``runtime_format`` the ``struct`` format that writes the
    runtime (non-hidden) values, in parameter order, from offset 0 (hidden values stay 0).
    """

    parameters: tuple[Parameter, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    runtime_format: str

    @property
    def runtime_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters if not p.hidden)


def argument_layout(parameters: Sequence[Parameter]) -> ArgumentLayout:
    """The buffer layout of ``parameters``; :class:`DirectLaunchUnavailable` for a type this
    module does not pack, or a hidden parameter before a runtime one."""
    offsets, sizes = [], []
    runtime_format = "<"
    position = end = 0
    seen_hidden = False
    for parameter in parameters:
        if parameter.type.startswith("*"):
            code, size = _POINTER
        elif parameter.type in _SCALAR_CODES:
            code, size = _SCALAR_CODES[parameter.type]
        else:
            raise DirectLaunchUnavailable(
                f"argument {parameter.name!r} has type {parameter.type!r}, not packed here"
            )
        offset = -(-end // size) * size  # natural alignment
        offsets.append(offset)
        sizes.append(size)
        end = offset + size
        if parameter.hidden:
            seen_hidden = True
            continue
        if seen_hidden:
            raise DirectLaunchUnavailable(f"argument {parameter.name!r} follows a hidden one")
        padding = offset - position
        runtime_format += (f"{padding}x" if padding > 1 else "x" * padding) + code
        position = end
    nbytes = max(-(-end // 8) * 8, 8)
    return ArgumentLayout(tuple(parameters), tuple(offsets), tuple(sizes), nbytes, runtime_format)


class PackedArguments:
    """The ``kernelParams`` of one kernel: a buffer with every parameter's value at its
    offset, and an array of pointers into it, both made once.

    ``address`` is what ``cuLaunchKernel`` takes; :meth:`pack` rewrites every runtime value
    (``struct.error`` for a value that does not fit its type: no launch follows, and the next
    pack rewrites whatever was half written). Not thread-safe: one launcher's buffer serves
    one thread.
    """

    __slots__ = ("layout", "buffer", "pointers", "address", "_pack_into", "_format")

    def __init__(self, layout: ArgumentLayout) -> None:
        self.layout = layout
        self.buffer = ctypes.create_string_buffer(layout.nbytes)  # zeroed: hidden ones NULL
        base = ctypes.addressof(self.buffer)
        count = max(len(layout.offsets), 1)
        self.pointers = (ctypes.c_void_p * count)(*(base + o for o in layout.offsets))
        self.address = ctypes.addressof(self.pointers)
        self._format = struct.Struct(layout.runtime_format)
        self._pack_into = self._format.pack_into

    def pack(self, *values: Any) -> None:
        """Write the runtime values, in parameter order."""
        self._pack_into(self.buffer, 0, *values)

    def values(self) -> tuple:
        """Every parameter's current value, read back through the pointer array (what the
        driver will read): for tests and error messages."""
        read = []
        for parameter, pointer, size in zip(
            self.layout.parameters, self.pointers, self.layout.sizes
        ):
            code = (
                _POINTER[0]
                if parameter.type.startswith("*")
                else (_SCALAR_CODES[parameter.type][0])
            )
            read.append(struct.unpack("<" + code, ctypes.string_at(pointer, size))[0])
        return tuple(read)


_PTX_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\((?P<params>[^)]*)\)", re.S)
_PTX_PARAM = re.compile(
    r"\.param\s+(?:\.align\s+\d+\s+)?\.[busf](?P<bits>\d+)\b[^,]*?(?:\[(?P<count>\d+)\])?\s*(?:,|$)"
)


def ptx_parameter_sizes(ptx: str) -> tuple[int, ...]:
    """The byte size of each ``.param`` of the (first) ``.entry`` in ``ptx``."""
    match = _PTX_ENTRY.search(ptx)
    if match is None:
        raise DirectLaunchUnavailable("the kernel's PTX has no .entry")
    sizes = []
    for param in _PTX_PARAM.finditer(match.group("params").strip()):
        sizes.append(int(param.group("bits")) // 8 * int(param.group("count") or 1))
    return tuple(sizes)


class DirectLauncher:
    """Launches one compiled Triton kernel with ``driver.launch_kernel`` (``cuLaunchKernel``).

    ``launcher(grid, stream, *values)`` enqueues ``grid`` programs (one dimension) on the raw
    CUDA ``stream`` handle, ``values`` being the runtime arguments in ``runtime_names``
    order; a grid of 0 launches nothing. The calling thread must have the kernel's context
    current (the fused writer makes it so). Triton's launch hooks (profilers) are not called.

    Construction checks everything the direct path assumes and raises
    :class:`DirectLaunchUnavailable` (one line) when one does not hold: the loaded function
    handle, a plain launch (one CTA per program, no cooperative or programmatic-dependent
    launch, no tensor descriptors or instrumentation), no scratch memory, the expected
    argument names, packable types, and the layout matching the PTX's parameters.
    """

    __slots__ = (
        "function",
        "block",
        "shared",
        "arguments",
        "runtime_names",
        "_launch_kernel",
        "_copy_and_launch",
    )

    def __init__(self, compiled: Any, driver: Any, runtime_names: Sequence[str]) -> None:
        metadata = getattr(compiled, "metadata", None)
        function = getattr(compiled, "function", None)
        if not function:
            raise DirectLaunchUnavailable(
                "the compiled kernel exposes no loaded CUfunction (CompiledKernel.function)"
            )
        num_warps = getattr(metadata, "num_warps", None)
        shared = getattr(metadata, "shared", None)
        if not isinstance(num_warps, int) or not isinstance(shared, int):
            raise DirectLaunchUnavailable("the kernel's metadata lacks num_warps or shared")
        _check_plain_launch(metadata, shared)
        layout = argument_layout(kernel_parameters(compiled))
        if layout.runtime_names != tuple(runtime_names):
            raise DirectLaunchUnavailable(
                f"the kernel takes {layout.runtime_names}, the launcher passes "
                f"{tuple(runtime_names)}"
            )
        ptx = (getattr(compiled, "asm", None) or {}).get("ptx")
        if not isinstance(ptx, str):
            raise DirectLaunchUnavailable("no PTX to check the parameter layout against")
        declared = ptx_parameter_sizes(ptx)
        if declared != layout.sizes:
            raise DirectLaunchUnavailable(
                f"the PTX declares parameters of {declared} bytes, the signature gives "
                f"{layout.sizes}"
            )
        launch_kernel = getattr(type(driver), "launch_kernel", None)
        base = _base_launch_kernel()
        if launch_kernel is None or launch_kernel is base:
            raise DirectLaunchUnavailable(f"{type(driver).__name__} cannot launch kernels")
        self.function = int(function)
        self.block = (num_warps * int(getattr(metadata, "warp_size", 32) or 32), 1, 1)
        self.shared = shared
        self.arguments = PackedArguments(layout)
        self.runtime_names = layout.runtime_names
        self._launch_kernel = driver.launch_kernel
        self._copy_and_launch = driver.copy_and_launch

    def __call__(self, grid: int, stream: Any, *values: Any) -> None:
        self.arguments.pack(*values)
        if grid > 0:
            self._launch_kernel(
                self.function, (grid, 1, 1), self.block, self.shared, stream, self.arguments.address
            )

    def bind(self, device_index: int) -> Any:
        """``launch(grid, stream, *values, copy=None)``: as calling this launcher, but through
        ``driver.copy_and_launch`` on ``device_index``: its context made current, and the
        copy ``copy`` = ``(dst, src, size)`` enqueued first on the same stream (one C call
        with the CUDA driver). A closure over everything it reads (no attribute lookups: it
        runs on every apply)."""
        pack_into, buffer = self.arguments._pack_into, self.arguments.buffer
        copy_and_launch, function = self._copy_and_launch, self.function
        block, shared, address = self.block, self.shared, self.arguments.address

        def launch(grid: int, stream: Any, *values: Any, copy: Any = None) -> None:
            pack_into(buffer, 0, *values)
            copy_and_launch(
                device_index, stream, copy, function, (grid, 1, 1), block, shared, address
            )

        # The closure holds raw addresses only: the launcher (its buffer and pointer array)
        # must live as long as the closure does.
        launch.launcher = self
        return launch


def _check_plain_launch(metadata: Any, shared: int) -> None:
    """Refuse what Triton launches with ``cuLaunchKernelEx`` attributes or extra memory."""
    if getattr(metadata, "num_ctas", 1) != 1:
        raise DirectLaunchUnavailable(f"the kernel runs {metadata.num_ctas} CTAs per program")
    cluster = getattr(metadata, "cluster_dims", None)
    if cluster is not None and tuple(cluster) not in ((), (1, 1, 1), (0, 0, 0)):
        raise DirectLaunchUnavailable(f"the kernel uses thread-block clusters {cluster}")
    for flag in ("launch_cooperative_grid", "launch_pdl"):
        if getattr(metadata, flag, False):
            raise DirectLaunchUnavailable(f"the kernel asks for {flag}")
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, field, 0):
            raise DirectLaunchUnavailable(
                f"the kernel needs {field}={getattr(metadata, field)} bytes, which only "
                "Triton's launcher allocates"
            )
    if getattr(metadata, "tensordesc_meta", None):
        raise DirectLaunchUnavailable("the kernel takes tensor descriptors")
    if getattr(metadata, "instrumentation_mode", ""):
        raise DirectLaunchUnavailable(
            f"the kernel is instrumented ({metadata.instrumentation_mode})"
        )
    if shared > _MAX_PLAIN_SHARED:
        raise DirectLaunchUnavailable(f"the kernel needs {shared} bytes of shared memory")


def _base_launch_kernel() -> Any:
    from jaxbuf.drivers.base import VmmDriver

    return VmmDriver.launch_kernel
