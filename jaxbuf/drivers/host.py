"""The CPU driver: CUDA's virtual-memory model reproduced on the host with ``mmap``.

==================  ==========================================================
VMM call            host implementation
==================  ==========================================================
``reserve``         ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
``create``          ``memfd_create`` + ``ftruncate`` (+ ``posix_fallocate``)
``map``             ``mmap(fd, MAP_SHARED|MAP_FIXED)`` at the address, then ``close(fd)``
``unmap``           ``mmap(PROT_NONE, ... MAP_FIXED)`` over the range (stays reserved)
``free_reserved``   ``munmap``
``host_alloc``      anonymous private ``mmap`` (RW)
==================  ==========================================================

Like the CUDA driver, this one trusts its caller (the buffer layer) to pass addresses inside its
own reservations: ``MAP_FIXED`` replaces whatever is mapped there. Arguments the kernel would
reject (a misaligned address, a non-positive size, a device other than 0) raise
:class:`DriverError` with ``EINVAL``/``ENODEV``, as ``CUDA_ERROR_INVALID_VALUE`` would.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import platform as _platform
import sys

from jaxbuf.drivers.base import K_DL_CPU, DriverError, VmmDriver

__all__ = ["HostChunk", "HostVmmDriver"]

# Linux values; Python's mmap module exports none of PROT_NONE, MAP_FIXED, MAP_NORESERVE.
_PROT_NONE = 0
_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # the same on every Linux architecture
_MACHINE = _platform.machine().lower()
if _MACHINE.startswith(("ppc", "powerpc", "sparc")):
    _MAP_NORESERVE = 0x40
elif _MACHINE.startswith("mips"):
    _MAP_NORESERVE = 0x400
else:  # asm-generic: x86, arm, arm64, riscv, s390, ...
    _MAP_NORESERVE = 0x4000
_MAP_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc with typed ``mmap``/``munmap``; a private CDLL, so other users' argtypes stay theirs."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    return libc


def _errno_name(code: int) -> str:
    return errno.errorcode.get(code, f"errno {code}")


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int, **details: object) -> int:
    """``mmap`` or :class:`DriverError`; ``details`` go into the error message."""
    result = _libc().mmap(addr, size, prot, flags, fd, 0)
    if result is None or result == _MAP_FAILED:
        raise DriverError("mmap", _errno_name(ctypes.get_errno()), size=size, **details)
    return result


def _munmap(ptr: int, size: int) -> None:
    if _libc().munmap(ptr, size) != 0:
        raise DriverError("munmap", _errno_name(ctypes.get_errno()), ptr=hex(ptr), size=size)


class HostChunk:
    """One physical chunk: a ``memfd`` of ``size`` bytes.

    States: *created* (``fd`` open) -> *mapped* (``fd`` closed, ``fd == -1``; the mapping
    now owns the pages) -> *released*. A chunk can be mapped **once**: closing the descriptor
    at map time keeps the process at zero open descriptors per mapped chunk, and the pages
    live exactly as long as the mapping (``unmap`` frees them). :meth:`HostVmmDriver.release`
    may come before or after ``unmap``, as with ``cuMemRelease``.
    """

    __slots__ = ("fd", "size", "mapped", "released")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mapped = False
        self.released = False

    def __repr__(self) -> str:
        state = "released" if self.released else "mapped" if self.mapped else "created"
        return f"HostChunk(fd={self.fd}, size={self.size}, {state})"


class HostVmmDriver(VmmDriver):
    """The CPU :class:`VmmDriver` (Linux). One device, index 0; all work is synchronous.

    The only state is ``_host_allocations`` (``host_ptr -> size`` of live :meth:`host_alloc`
    blocks), so :meth:`host_free` knows what to ``munmap``.
    """

    platform = "cpu"
    dlpack_device_type = K_DL_CPU
    dlpack_host_device_type = K_DL_CPU

    def __init__(self) -> None:
        self._host_allocations: dict[int, int] = {}

    def __repr__(self) -> str:
        return "HostVmmDriver()"

    # -- probing --------------------------------------------------------------------
    @functools.cached_property
    def _unavailable_reason(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"the CPU driver needs Linux (memfd_create, MAP_NORESERVE), not {sys.platform}."
        if not hasattr(os, "memfd_create"):
            return "the CPU driver needs os.memfd_create, which this Python lacks."
        try:
            _libc()
        except (OSError, AttributeError) as exc:
            return f"the CPU driver could not load libc's mmap/munmap: {exc}."
        return None

    def unavailable_reason(self) -> str | None:
        return self._unavailable_reason

    def device_count(self) -> int:
        return 0 if self._unavailable_reason else 1

    # -- context and granularity ----------------------------------------------------
    def ensure_context(self, device_index: int) -> None:
        _check_device("ensure_context", device_index)

    def granularity(self, device_index: int) -> int:
        _check_device("granularity", device_index)
        return mmap.PAGESIZE

    # -- virtual memory -------------------------------------------------------------
    def reserve(self, size: int, alignment: int = 0) -> int:
        _check_args("reserve", size, alignment=alignment)
        if not isinstance(alignment, int) or alignment < 0 or alignment % mmap.PAGESIZE:
            raise DriverError("reserve", "EINVAL", size=size, alignment=alignment)
        if alignment <= mmap.PAGESIZE:
            return _mmap(None, size, _PROT_NONE, _MAP_RESERVE_FLAGS, -1, alignment=alignment)
        # mmap only promises page alignment: over-reserve, then trim both ends.
        padded = size + alignment - mmap.PAGESIZE
        raw = _mmap(None, padded, _PROT_NONE, _MAP_RESERVE_FLAGS, -1, alignment=alignment)
        base = -(-raw // alignment) * alignment
        try:
            if base > raw:
                _munmap(raw, base - raw)
            if raw + padded > base + size:
                _munmap(base + size, raw + padded - (base + size))
        except DriverError:
            _munmap(raw, padded)  # unmapping already-trimmed pieces is harmless
            raise
        return base

    def free_reserved(self, ptr: int, size: int) -> None:
        _check_args("munmap", size, ptr)
        _munmap(ptr, size)

    def create(self, size: int, device_index: int) -> HostChunk:
        _check_device("memfd_create", device_index)
        _check_args("memfd_create", size)
        try:
            fd = os.memfd_create("jaxbuf-chunk", os.MFD_CLOEXEC)
        except OSError as exc:
            raise DriverError("memfd_create", _errno_name(exc.errno), size=size) from None
        call = "ftruncate"
        try:
            os.ftruncate(fd, size)
            # Commit the pages now, as cuMemCreate does: running out of memory is then a
            # DriverError here instead of a SIGBUS on first touch. Kernels whose memfd
            # cannot fallocate keep lazy pages.
            call = "posix_fallocate"
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
        except OSError as exc:
            os.close(fd)
            raise DriverError(call, _errno_name(exc.errno), size=size) from None
        return HostChunk(fd, size)

    def release(self, handle: HostChunk) -> None:
        if handle.released:
            raise DriverError("release", "EBADF", size=handle.size, state="released")
        handle.released = True
        if handle.fd >= 0:
            fd, handle.fd = handle.fd, -1
            # Linux frees the descriptor even when close() reports an error, so the
            # handle is released either way.
            try:
                os.close(fd)
            except OSError as exc:
                name = _errno_name(exc.errno)
                raise DriverError("close", name, fd=fd, size=handle.size) from None

    def map(self, ptr: int, size: int, handle: HostChunk) -> None:
        _check_args("mmap", size, ptr)
        if handle.released or handle.mapped:
            state = "released" if handle.released else "mapped"
            raise DriverError("mmap", "EBADF", ptr=hex(ptr), size=size, state=state)
        if size != handle.size:
            raise DriverError("mmap", "EINVAL", ptr=hex(ptr), size=size, chunk_size=handle.size)
        _mmap(ptr, size, _PROT_READ_WRITE, mmap.MAP_SHARED | _MAP_FIXED, handle.fd, ptr=hex(ptr))
        # The mapping holds its own reference to the memfd; dropping the descriptor keeps
        # open descriptors independent of the number of mapped chunks.
        fd, handle.fd = handle.fd, -1
        handle.mapped = True
        os.close(fd)

    def unmap(self, ptr: int, size: int) -> None:
        _check_args("mmap", size, ptr)
        # One MAP_FIXED call swaps the shared pages for a fresh PROT_NONE reservation;
        # munmap + mmap would leave a window in which another thread could take the range.
        _mmap(ptr, size, _PROT_NONE, _MAP_RESERVE_FLAGS | _MAP_FIXED, -1, ptr=hex(ptr))

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        # map() already maps read/write; only the arguments are checked.
        _check_device("set_access", device_index)
        _check_args("set_access", size, ptr)

    # -- work on the memory ---------------------------------------------------------
    def memset(self, ptr: int, value: int, size: int, device_index: int) -> None:
        _check_device("memset", device_index)
        if size < 0:
            raise DriverError("memset", "EINVAL", ptr=hex(ptr), size=size)
        ctypes.memset(ptr, value, size)

    def copy(self, dst: int, src: int, size: int, device_index: int) -> None:
        _check_device("memmove", device_index)
        if size < 0:
            raise DriverError("memmove", "EINVAL", dst=hex(dst), src=hex(src), size=size)
        ctypes.memmove(dst, src, size)

    def synchronize(self, device_index: int) -> None:
        _check_device("synchronize", device_index)

    # -- pinned host memory ---------------------------------------------------------
    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        # Not mlock'ed: RLIMIT_MEMLOCK is small by default and the CPU reads it in place anyway.
        _check_device("host_alloc", device_index)
        _check_args("mmap", size, pages=False)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        ptr = _mmap(None, size, _PROT_READ_WRITE, flags, -1)
        self._host_allocations[ptr] = size
        return ptr, ptr

    def host_free(self, host_ptr: int) -> None:
        size = self._host_allocations.get(host_ptr)
        if size is None:
            raise DriverError("munmap", "EINVAL", ptr=hex(host_ptr), state="not from host_alloc")
        _munmap(host_ptr, size)
        del self._host_allocations[host_ptr]


def _check_device(call: str, device_index: int) -> None:
    if device_index != 0:
        raise DriverError(call, "ENODEV", device=device_index)


def _check_args(call: str, size: int, ptr: int | None = None, *, pages: bool = True,
                **details: object) -> None:
    """``size`` a positive int (a negative one would wrap to a huge ``size_t`` in ctypes);
    with ``pages``, ``size`` and ``ptr`` (when given) multiples of the page size."""
    valid = isinstance(size, int) and size > 0 and not (pages and size % mmap.PAGESIZE)
    if ptr is not None:
        valid = valid and isinstance(ptr, int) and not ptr % mmap.PAGESIZE
        details = {"ptr": hex(ptr) if isinstance(ptr, int) else ptr, **details}
    if not valid:
        raise DriverError(call, "EINVAL", size=size, **details)
