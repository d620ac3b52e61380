"""The libc calls of the CPU driver (:mod:`jaxbuf.drivers.host`), each failing with a
:class:`~jaxbuf.drivers.base.DriverError` that names the call, its errno and its arguments;
and the argument checks the kernel would otherwise answer with ``EINVAL``/``ENODEV``."""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import platform

from jaxbuf.drivers.base import DriverError

__all__ = [
    "MAP_FAILED",
    "check_args",
    "check_device",
    "errno_name",
    "mmap_or_raise",
    "munmap_or_raise",
    "typed_libc",
]

MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def typed_libc() -> ctypes.CDLL:
    """libc with typed ``mmap``/``munmap``; a private CDLL, so other users' argtypes stay theirs."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    libc.mremap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    libc.mremap.restype = ctypes.c_void_p
    return libc


def errno_name(code: int) -> str:
    return errno.errorcode.get(code, f"errno {code}")


def mmap_or_raise(
    addr: int | None, size: int, prot: int, flags: int, fd: int, **details: object
) -> int:
    """``mmap`` or :class:`DriverError`; ``details`` go into the error message."""
    result = typed_libc().mmap(addr, size, prot, flags, fd, 0)
    if result is None or result == MAP_FAILED:
        raise DriverError("mmap", errno_name(ctypes.get_errno()), size=size, **details)
    return result


def munmap_or_raise(ptr: int, size: int) -> None:
    if typed_libc().munmap(ptr, size) != 0:
        raise DriverError("munmap", errno_name(ctypes.get_errno()), ptr=hex(ptr), size=size)


def check_device(call: str, device_index: int) -> None:
    if device_index != 0:
        raise DriverError(call, "ENODEV", device=device_index)


def check_args(
    call: str, size: int, ptr: int | None = None, *, pages: bool = True, **details: object
) -> None:
    """``size`` a positive int (a negative one would wrap to a huge ``size_t`` in ctypes);
    with ``pages``, ``size`` and ``ptr`` (when given) multiples of the page size."""
    # ctypes masks an int into size_t: a size past 2**63 would silently wrap to a small one.
    valid = isinstance(size, int) and 0 < size < 1 << 63 and not (pages and size % mmap.PAGESIZE)
    if ptr is not None:
        valid = valid and isinstance(ptr, int) and not ptr % mmap.PAGESIZE
        details = {"ptr": hex(ptr) if isinstance(ptr, int) else ptr, **details}
    if not valid:
        raise DriverError(call, "EINVAL", size=size, **details)


# Linux values; Python's mmap module exports none of PROT_NONE, MAP_FIXED, MAP_NORESERVE.
PROT_NONE = 0
# Reservations (and unmapped ranges) read as zeros and fault on writes; in debug mode they are
# PROT_NONE instead (a read faults too). See the host driver's docstring.
PROT_RESERVED = mmap.PROT_READ
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
MAP_FIXED = 0x10  # the same on every Linux architecture
_MACHINE = platform.machine().lower()
if _MACHINE.startswith(("ppc", "powerpc", "sparc")):
    MAP_NORESERVE = 0x40
elif _MACHINE.startswith("mips"):
    MAP_NORESERVE = 0x400
else:  # asm-generic: x86, arm, arm64, riscv, s390, ...
    MAP_NORESERVE = 0x4000
MAP_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
MAP_FIXED_NOREPLACE = 0x100000
# mremap flags (linux/mman.h), the same on every architecture.
MREMAP_MAYMOVE = 1
MREMAP_FIXED = 2
MREMAP_DONTUNMAP = 4  # Linux 5.7; for shared (memfd) mappings since 5.13
# Why exporting a mapped chunk (reopening /proc/self/map_files/<range>) failed, most often.
MAP_FILES_HINT = (
    "reopening a mapped chunk through /proc/self/map_files needs CAP_SYS_ADMIN or "
    "CAP_CHECKPOINT_RESTORE (run as root, or grant the capability to the exporting process)"
)
