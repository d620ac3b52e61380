"""The CPU driver: CUDA's virtual-memory model reproduced on the host with ``mmap``.

==================  ==========================================================
VMM call            host implementation
==================  ==========================================================
``reserve``         ``mmap(PROT_READ, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``: reads zeros
                    (debug mode: ``PROT_NONE``, so a read faults too)
``create``          ``memfd_create`` + ``ftruncate`` (+ ``posix_fallocate``), mode 0600, sealed
``map``             ``mmap(fd, MAP_SHARED|MAP_FIXED)`` at the address, then ``close(fd)``
``unmap``           ``mmap(PROT_READ, ... MAP_FIXED)`` over the range (reserved, reads zeros;
                    debug mode: ``PROT_NONE``)
``move_mapping``    ``mremap(MREMAP_FIXED|MREMAP_DONTUNMAP)``, then the source re-reserved
                    (as by ``unmap``)
``export_handle``   ``open("/proc/self/map_files/<start>-<end>")`` of the chunk's mapping
``import_handle``   ``dup`` of the received memfd (mapped, then closed, like a created chunk)
                    after checking its seals; a read-only descriptor is mapped ``PROT_READ``
``free_reserved``   ``mmap(PROT_NONE, ... MAP_FIXED)``, then quarantine (``munmap`` later)
``host_alloc``      anonymous private ``mmap`` (RW)
==================  ==========================================================

**Uncommitted memory reads zeros.** A reservation, and every range a chunk is unmapped from,
is a read-only private anonymous mapping: reading it gives zeros (the kernel's one shared zero
page: no memory, no commit charge, as ``MAP_NORESERVE`` and read-only), writing it faults
(``SIGSEGV``). So printing or copying a view that reaches past the committed bytes (a
``full_view()``, a view kept over ``release_physical()``) shows zeros there instead of killing
the process; only a write there is fatal. CUDA has no such mapping: there an uncommitted
address faults the context, and only committed bytes may be touched at all.

**Debug mode.** ``HostVmmDriver(debug=True)``, or ``JAXBUF_DEBUG=1`` in the environment when
the driver is built (the shared one at its first use: a CPU buffer, ``granule_size("cpu")``;
set it before that; see :mod:`jaxbuf._debug`), maps reservations and every released range
``PROT_NONE`` instead: a *read* of uncommitted or released memory then faults as on CUDA
(``SIGSEGV``, with the hint line saying so) instead of returning zeros. Committed memory
behaves the same in both modes, and so does the cost of growing and releasing (the same
``mmap`` calls, another protection). A driver decides once, when built
(:attr:`HostVmmDriver.debug`): every range of its reservations has one protection. The
kernel protects whole pages and the buffers commit whole granules (2 MiB on the CPU), so bytes
past a committed size but inside its last granule stay readable and writable in both modes.

**Sealed chunks.** Every chunk's memfd is created with ``MFD_ALLOW_SEALING`` and sealed
``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: whoever holds a descriptor of it (a peer it was
exported to) cannot change its size, so no mapping of it, the owner's included, can ever fault
with ``SIGBUS`` past a truncated end; :meth:`HostVmmDriver.import_handle` refuses a descriptor
that is not sealed against shrinking, so a hostile owner cannot do that to an importer either.
The memfd's mode is 0600 (memfds start as 0777): a process of another uid that was given a
read-only descriptor (:meth:`HostVmmDriver.export_read_only_handle`) cannot reopen it
read-write through ``/proc/<pid>/fd``. A process of the same uid (or root) can: for it
read-only is a guard against mistakes, not a security boundary.

**Quarantine.** ``free_reserved`` does not hand the range back to the kernel at once: it
replaces it with a fresh ``PROT_NONE`` reservation (dropping any pages) and parks it in a bounded
FIFO (``quarantine_bytes`` of address space, ``quarantine_ranges`` ranges); only the oldest
ranges beyond those bounds are ``munmap``-ed. A stale view of a freed buffer then faults
(``SIGSEGV``) instead of reading whatever a later ``mmap`` placed at the same address. A range
larger than the whole budget is unmapped at once. :meth:`HostVmmDriver.flush_quarantine` unmaps
everything parked. Parked ranges count against the address-space limit (``RLIMIT_AS``): under a
finite limit the budget is at most a quarter of it, and a ``reserve`` that fails with
``ENOMEM`` drains the quarantine and retries once (CuPy's habit with its pinned-memory cache),
so freed buffers never make a new one fail while nothing is alive.

Like the CUDA driver, this one trusts its caller (the buffer layer) to pass addresses inside its
own reservations: ``MAP_FIXED`` replaces whatever is mapped there. Arguments the kernel would
reject (a misaligned address, a non-positive size, a device other than 0) raise
:class:`DriverError` with ``EINVAL``/``ENODEV``, as ``CUDA_ERROR_INVALID_VALUE`` would.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import stat
import sys

from jaxbuf._debug import debug_enabled
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf.drivers import _posix as posix
from jaxbuf.drivers._posix import (
    MAP_FAILED,
    check_args,
    check_device,
    errno_name,
    mmap_or_raise,
    munmap_or_raise,
    typed_libc,
)
from jaxbuf.drivers._quarantine import Quarantine
from jaxbuf.drivers._segv_hint import FREED, READ_ONLY, STRICT, UNMAPPED, watch
from jaxbuf.drivers.base import (
    K_DL_CPU,
    DriverError,
    VmmDriver,
    batch_triples,
    copy_batch_arguments,
)

try:  # optional (setup.py): copy_batch's loop in C, with the GIL released
    from jaxbuf.drivers import _host_calls
except ImportError:
    _host_calls = None

__all__ = ["HostChunk", "HostVmmDriver"]

# Seals of every chunk: fixed size (no SIGBUS for any mapping), and no further seals (a peer
# cannot add F_SEAL_FUTURE_WRITE and break the other importers' mappings).
_CHUNK_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class HostChunk:
    """One physical chunk: a ``memfd`` of ``size`` bytes.

    States: *created* (``fd`` open) -> *mapped* (``fd`` closed, ``fd == -1``; the mapping
    now owns the pages; ``ptr`` is its address, kept current by ``move_mapping``, so that
    ``export_handle`` can reopen the file through ``/proc/self/map_files``) -> *released*.
    ``read_only``: imported from a read-only descriptor, so :meth:`HostVmmDriver.map` maps it
    ``PROT_READ`` (a write faults) and it is never exported read-write.
    A chunk can be mapped **once**: closing the descriptor at map time keeps the process at
    zero open descriptors per mapped chunk, and the pages live exactly as long as the
    mapping (``unmap`` frees them; a descriptor exported to another process, or that
    process's mapping of it, keeps them alive there). :meth:`HostVmmDriver.release`
    may come before or after ``unmap``, as with ``cuMemRelease``.
    """

    __slots__ = ("fd", "size", "mapped", "released", "ptr", "read_only")

    def __init__(self, fd: int, size: int, read_only: bool = False) -> None:
        self.fd = fd
        self.size = size
        self.mapped = False
        self.released = False
        self.ptr = 0
        self.read_only = read_only

    def __repr__(self) -> str:
        state = "released" if self.released else "mapped" if self.mapped else "created"
        access = ", read-only" if self.read_only else ""
        return f"HostChunk(fd={self.fd}, size={self.size}, {state}{access})"

    def close_descriptor(self, _close=os.close) -> None:  # noqa: ANN001 - bound at exit
        """Close the memfd of a chunk never mapped (its only reference to the pages)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _close(fd)

    def __del__(self, _suppress=contextlib.suppress) -> None:  # noqa: ANN001 - bound at exit
        with _suppress(AttributeError, OSError):  # a chunk lost to an interrupt: its memfd
            self.close_descriptor()  # is no one's (Linux frees the fd even on an error)


class HostVmmDriver(VmmDriver):
    """The CPU :class:`VmmDriver` (Linux). One device, index 0; all work is synchronous.

    State: ``_host_allocations`` (``host_ptr -> size`` of live :meth:`host_alloc` blocks), so
    :meth:`host_free` knows what to ``munmap``; and the quarantine of freed reservations (see
    the module docstring and :mod:`jaxbuf.drivers._quarantine`), bounded by
    ``quarantine_bytes`` of address space (default 64 GiB, at most a quarter of a finite
    ``RLIMIT_AS``) and ``quarantine_ranges`` ranges (default 4096). ``quarantine_bytes=0``
    unmaps at once, as plain ``munmap``.

    ``debug`` (``True``/``False``; ``None``: ``JAXBUF_DEBUG`` now) is read once, here, and kept
    as :attr:`debug`: uncommitted and released ranges are then ``PROT_NONE`` (any access
    faults) instead of readable zeros. See "Debug mode" in the module docstring.

    Thread-safe: the one shared instance serves every thread; calls on distinct allocations
    may run concurrently (callers serialize calls on the same allocation).
    """

    platform = "cpu"
    dlpack_device_type = K_DL_CPU
    dlpack_host_device_type = K_DL_CPU
    host_alloc_zeroed = True  # a fresh anonymous mmap: the kernel zeroes its pages

    def __init__(
        self,
        *,
        quarantine_bytes: int = 64 << 30,
        quarantine_ranges: int = 4096,
        debug: bool | None = None,
    ) -> None:
        self.debug = debug_enabled(debug)  # TypeError for a bad override, before anything
        # Uncommitted memory: readable zeros, or (debug) no access at all, as on CUDA.
        self._reserved_prot = posix.PROT_NONE if self.debug else posix.PROT_RESERVED
        self._quarantine = Quarantine(quarantine_bytes, quarantine_ranges)
        self._host_allocations: dict[int, int] = {}

    def __repr__(self) -> str:
        return "HostVmmDriver(debug=True)" if self.debug else "HostVmmDriver()"

    @property
    def quarantine_bytes(self) -> int:
        return self._quarantine.max_bytes

    @quarantine_bytes.setter
    def quarantine_bytes(self, value: int) -> None:  # applied at the next free
        self._quarantine.max_bytes = value

    @property
    def quarantine_ranges(self) -> int:
        return self._quarantine.max_ranges

    @quarantine_ranges.setter
    def quarantine_ranges(self, value: int) -> None:
        self._quarantine.max_ranges = value

    @property
    def quarantined(self) -> tuple[int, int]:
        """``(ranges, bytes)`` of freed reservations parked as ``PROT_NONE``."""
        return self._quarantine.counts

    def flush_quarantine(self) -> None:
        """``munmap`` every parked range (their addresses may then be reused)."""
        self._quarantine.flush()

    # -- probing --------------------------------------------------------------------
    @functools.cached_property
    def _unavailable_reason(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"the CPU driver needs Linux (memfd_create, MAP_NORESERVE), not {sys.platform}."
        if not hasattr(os, "memfd_create"):
            return "the CPU driver needs os.memfd_create, which this Python lacks."
        try:
            typed_libc()
        except (OSError, AttributeError) as exc:
            return f"the CPU driver could not load libc's mmap/munmap: {exc}."
        return None

    def unavailable_reason(self) -> str | None:
        return self._unavailable_reason

    def device_count(self) -> int:
        return 0 if self._unavailable_reason else 1

    # -- context and granularity ----------------------------------------------------
    def ensure_context(self, device_index: int) -> None:
        check_device("ensure_context", device_index)

    def granularity(self, device_index: int) -> int:
        check_device("granularity", device_index)
        return mmap.PAGESIZE

    # -- virtual memory -------------------------------------------------------------
    def reserve(self, size: int, alignment: int = 0) -> int:
        check_args("reserve", size, alignment=alignment)
        if not isinstance(alignment, int) or alignment < 0 or alignment % mmap.PAGESIZE:
            raise DriverError("reserve", "EINVAL", size=size, alignment=alignment)
        if alignment <= mmap.PAGESIZE:
            base = self._reserve_address_space(size, alignment)
            self._watch(base, size)
            return base
        # mmap only promises page alignment: over-reserve, then trim both ends.
        padded = size + alignment - mmap.PAGESIZE
        raw = self._reserve_address_space(padded, alignment)
        base = -(-raw // alignment) * alignment
        try:
            if base > raw:
                munmap_or_raise(raw, base - raw)
            if raw + padded > base + size:
                munmap_or_raise(base + size, raw + padded - (base + size))
        except DriverError:
            munmap_or_raise(raw, padded)  # unmapping already-trimmed pieces is harmless
            raise
        self._watch(base, size)
        return base

    def _watch(self, base: int, size: int) -> None:
        """Tell the SIGSEGV hint of a new reservation, and that a read in it faults too."""
        watch(base, size)
        if self.debug:
            watch(base, size, STRICT)

    def _reserve_address_space(self, size: int, alignment: int) -> int:
        """A fresh reservation; on ``ENOMEM`` the quarantine is drained, then one retry."""
        try:
            return mmap_or_raise(
                None, size, self._reserved_prot, posix.MAP_RESERVE_FLAGS, -1, alignment=alignment
            )
        except DriverError as error:
            if error.error_name != "ENOMEM" or not self.quarantined[0]:
                raise
            self.flush_quarantine()
        return mmap_or_raise(
            None, size, self._reserved_prot, posix.MAP_RESERVE_FLAGS, -1, alignment=alignment
        )

    def free_reserved(self, ptr: int, size: int) -> None:
        check_args("munmap", size, ptr)
        watch(ptr, size, FREED)
        self._quarantine.free(ptr, size)

    def create(self, size: int, device_index: int) -> HostChunk:
        check_device("memfd_create", device_index)
        check_args("memfd_create", size)
        with deferred_interrupts():  # created and owned as one step (see HostChunk.__del__)
            try:
                fd = os.memfd_create("jaxbuf-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError as exc:
                raise DriverError("memfd_create", errno_name(exc.errno), size=size) from None
            chunk = HostChunk(fd, size)
        call = "fchmod"
        try:
            os.fchmod(fd, 0o600)  # see "Sealed chunks" in the module docstring
            call = "ftruncate"
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
            call = "fcntl(F_ADD_SEALS)"
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _CHUNK_SEALS)
        except OSError as exc:
            chunk.close_descriptor()
            raise DriverError(call, errno_name(exc.errno), size=size) from None
        except BaseException:
            # An interrupt (a signal handler raising during posix_fallocate's seconds of
            # work): the memfd, its pages committed already, is no one's else.
            chunk.close_descriptor()
            raise
        return chunk

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
                name = errno_name(exc.errno)
                raise DriverError("close", name, fd=fd, size=handle.size) from None

    def map(self, ptr: int, size: int, handle: HostChunk) -> None:
        check_args("mmap", size, ptr)
        if handle.released or handle.mapped:
            state = "released" if handle.released else "mapped"
            raise DriverError("mmap", "EBADF", ptr=hex(ptr), size=size, state=state)
        if size != handle.size:
            raise DriverError("mmap", "EINVAL", ptr=hex(ptr), size=size, chunk_size=handle.size)
        prot = mmap.PROT_READ if handle.read_only else posix.PROT_READ_WRITE
        mmap_or_raise(ptr, size, prot, mmap.MAP_SHARED | posix.MAP_FIXED, handle.fd, ptr=hex(ptr))
        # The mapping holds its own reference to the memfd; dropping the descriptor keeps
        # open descriptors independent of the number of mapped chunks.
        fd, handle.fd = handle.fd, -1
        handle.mapped = True
        handle.ptr = ptr
        os.close(fd)
        if handle.read_only:  # a write there faults although committed: the hint says so
            watch(ptr, size, READ_ONLY)

    def unmap(self, ptr: int, size: int) -> None:
        check_args("mmap", size, ptr)
        # One MAP_FIXED call swaps the shared pages for a fresh reservation (as reserve's);
        # munmap + mmap would leave a window in which another thread could take the range.
        mmap_or_raise(
            ptr,
            size,
            self._reserved_prot,
            posix.MAP_RESERVE_FLAGS | posix.MAP_FIXED,
            -1,
            ptr=hex(ptr),
        )
        watch(ptr, size, UNMAPPED)

    def move_mapping(self, handle: HostChunk, src_ptr: int, dst_ptr: int, size: int) -> None:
        """Move the chunk's mapping with ``mremap`` (the pages move, nothing is copied), then
        re-reserve the source range with one ``MAP_FIXED`` reservation mapping (as ``unmap`` does).

        ``MREMAP_DONTUNMAP`` (Linux >= 5.13 for shared mappings) keeps the source range
        mapped until the re-reservation replaces it, so no other thread can take it in
        between. Older kernels fall back to a plain move and a ``MAP_FIXED_NOREPLACE``
        re-reservation; should another thread's ``mmap`` have taken the hole in that
        instant, ``DriverError(EEXIST)`` reports it *after* the move (the reservation then
        lacks that range).

        A Ctrl-C is held back until it returns (between the two calls: mapped twice).
        """
        with deferred_interrupts():
            self._move_mapping(handle, src_ptr, dst_ptr, size)

    def _move_mapping(self, handle: HostChunk, src_ptr: int, dst_ptr: int, size: int) -> None:
        check_args("mremap", size, src_ptr)
        check_args("mremap", size, dst_ptr)
        watch(src_ptr, size, UNMAPPED)  # the source is left uncommitted (a hint: before)
        if handle.released or not handle.mapped or handle.ptr != src_ptr or handle.size != size:
            raise DriverError(
                "mremap",
                "EINVAL",
                src=hex(src_ptr),
                dst=hex(dst_ptr),
                size=size,
                chunk=repr(handle),
            )
        libc = typed_libc()
        flags = posix.MREMAP_MAYMOVE | posix.MREMAP_FIXED
        result = libc.mremap(src_ptr, size, size, flags | posix.MREMAP_DONTUNMAP, dst_ptr)
        keep_source = True
        if result is None or result == MAP_FAILED:
            code = ctypes.get_errno()
            if code != errno.EINVAL:
                raise DriverError(
                    "mremap", errno_name(code), src=hex(src_ptr), dst=hex(dst_ptr), size=size
                )
            keep_source = False  # a kernel without MREMAP_DONTUNMAP for shared mappings
            result = libc.mremap(src_ptr, size, size, flags, dst_ptr)
            if result is None or result == MAP_FAILED:
                raise DriverError(
                    "mremap",
                    errno_name(ctypes.get_errno()),
                    src=hex(src_ptr),
                    dst=hex(dst_ptr),
                    size=size,
                )
        reserve_flags = posix.MAP_RESERVE_FLAGS | (
            posix.MAP_FIXED if keep_source else posix.MAP_FIXED_NOREPLACE
        )
        try:
            mmap_or_raise(
                src_ptr,
                size,
                self._reserved_prot,
                reserve_flags,
                -1,
                ptr=hex(src_ptr),
                moved_to=hex(dst_ptr),
            )
        except DriverError:
            if keep_source:
                # Move the pages back over the stale source mapping, so that nothing
                # changed; dst becomes a hole, re-reserved (it was a reservation).
                back = libc.mremap(dst_ptr, size, size, flags, src_ptr)
                if back is not None and back != MAP_FAILED:
                    mmap_or_raise(
                        dst_ptr,
                        size,
                        self._reserved_prot,
                        posix.MAP_RESERVE_FLAGS | posix.MAP_FIXED_NOREPLACE,
                        -1,
                        ptr=hex(dst_ptr),
                    )
                    raise
            handle.ptr = dst_ptr
            raise
        handle.ptr = dst_ptr

    def export_handle(self, handle: HostChunk) -> int:
        """A new read-write descriptor (close-on-exec) for the chunk's memfd: a ``dup`` while
        the chunk is unmapped, else the mapping's file reopened through
        ``/proc/self/map_files`` (the driver keeps no descriptor per mapped chunk), which needs
        CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE: ``DriverError(EPERM)`` says so otherwise.
        A chunk imported read-only is refused (``EACCES``): it is never upgraded."""
        if handle.read_only:
            raise DriverError(
                "export_handle", "EACCES", size=handle.size, state="imported read-only"
            )
        return self._export(handle, read_only=False)

    def export_read_only_handle(self, handle: HostChunk) -> int:
        """A new ``O_RDONLY`` descriptor for the chunk's memfd (reopened through
        ``/proc/self/fd`` or ``/proc/self/map_files``): an importer can map it ``PROT_READ``
        only; ``mprotect`` cannot add write access and ``write``/``fallocate`` on it fail.
        See "Sealed chunks" in the module docstring for what a same-uid process can still do.
        """
        return self._export(handle, read_only=True)

    def _export(self, handle: HostChunk, read_only: bool) -> int:
        if handle.released:
            raise DriverError("export_handle", "EBADF", size=handle.size, state="released")
        if handle.fd >= 0:
            if not read_only:
                try:
                    return os.dup(handle.fd)
                except OSError as exc:
                    raise DriverError("dup", errno_name(exc.errno), fd=handle.fd) from None
            path = f"/proc/self/fd/{handle.fd}"  # a dup would share the read-write file
        else:
            path = f"/proc/self/map_files/{handle.ptr:x}-{handle.ptr + handle.size:x}"
        access = os.O_RDONLY if read_only else os.O_RDWR
        try:
            fd = os.open(path, access | os.O_CLOEXEC)
        except OSError as exc:
            details: dict[str, object] = {"path": path, "size": handle.size}
            if exc.errno in (errno.EPERM, errno.EACCES) and handle.fd < 0:
                details["hint"] = posix.MAP_FILES_HINT
            raise DriverError("open", errno_name(exc.errno), **details) from None
        try:
            file_size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise DriverError("fstat", errno_name(exc.errno), path=path) from None
        if file_size != handle.size:  # not this chunk's memfd: never hand it out
            os.close(fd)
            raise DriverError("open", "EINVAL", path=path, size=handle.size, file_size=file_size)
        return fd

    def import_handle(self, fd: int, size: int, device_index: int) -> HostChunk:
        """A created-state :class:`HostChunk` over a ``dup`` of ``fd`` (the caller keeps
        ``fd``); :meth:`map` closes the duplicate, as for a chunk from :meth:`create`.

        ``fd`` must be a regular file of exactly ``size`` bytes sealed with
        ``F_SEAL_SHRINK`` (a jaxbuf chunk's memfd): were it not sealed, its sender could
        truncate it and every access to our mapping would die with ``SIGBUS``. Refused
        otherwise with ``DriverError(EINVAL)`` naming the reason. A descriptor opened
        read-only gives a read-only chunk (mapped ``PROT_READ``); write-only is refused."""
        check_device("import_handle", device_index)
        check_args("import_handle", size)
        try:
            access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                seals = 0  # not a file that can be sealed
            # Sealed first, measured second: the size can no longer shrink below this.
            info = os.fstat(fd)
        except (OSError, TypeError, ValueError, OverflowError) as exc:
            name = errno_name(getattr(exc, "errno", None) or errno.EBADF)
            raise DriverError("fstat", name, fd=fd) from None
        if not stat.S_ISREG(info.st_mode) or access == os.O_WRONLY:
            reason = "not a readable memfd"
            raise DriverError("import_handle", "EINVAL", fd=fd, size=size, reason=reason)
        if not seals & fcntl.F_SEAL_SHRINK:
            reason = "not sealed with F_SEAL_SHRINK: its sender could truncate it (SIGBUS)"
            raise DriverError(
                "import_handle", "EINVAL", fd=fd, size=size, seals=hex(seals), reason=reason
            )
        if info.st_size != size:
            raise DriverError("import_handle", "EINVAL", fd=fd, size=size, file_size=info.st_size)
        try:
            with deferred_interrupts():  # duplicated and owned as one step
                return HostChunk(os.dup(fd), size, read_only=access == os.O_RDONLY)
        except OSError as exc:
            raise DriverError("dup", errno_name(exc.errno), fd=fd) from None

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        # map() already maps read/write; only the arguments are checked.
        check_device("set_access", device_index)
        check_args("set_access", size, ptr)

    # -- work on the memory ---------------------------------------------------------
    def memset(self, ptr: int, value: int, size: int, device_index: int) -> None:
        check_device("memset", device_index)
        if size < 0:
            raise DriverError("memset", "EINVAL", ptr=hex(ptr), size=size)
        ctypes.memset(ptr, value, size)

    def copy(self, dst: int, src: int, size: int, device_index: int) -> None:
        check_device("memmove", device_index)
        if size < 0:
            raise DriverError("memmove", "EINVAL", dst=hex(dst), src=hex(src), size=size)
        ctypes.memmove(dst, src, size)

    def copy_batch(self, dsts, srcs, sizes, device_index: int) -> None:
        """Every triple's ``memmove``, in order, done when it returns: one C call with the GIL
        released (``jaxbuf.drivers._host_calls``), a ``ctypes.memmove`` loop without it. See
        :meth:`VmmDriver.copy_batch` for the arrays."""
        check_device("copy_batch", device_index)
        if _host_calls is not None:  # it checks the arrays itself, as below
            _host_calls.copy_batch(dsts, srcs, sizes)
            return
        count, *addresses = copy_batch_arguments(dsts, srcs, sizes)
        for dst, src, size in batch_triples(count, *addresses):
            ctypes.memmove(dst, src, size)

    def synchronize(self, device_index: int) -> None:
        check_device("synchronize", device_index)

    # -- pinned host memory ---------------------------------------------------------
    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        # Not mlock'ed: RLIMIT_MEMLOCK is small by default and the CPU reads it in place anyway.
        check_device("host_alloc", device_index)
        check_args("mmap", size, pages=False)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        ptr = mmap_or_raise(None, size, posix.PROT_READ_WRITE, flags, -1)
        self._host_allocations[ptr] = size
        return ptr, ptr

    def host_free(self, host_ptr: int) -> None:
        # Forget the block *before* munmap: once unmapped, another thread's host_alloc may
        # get the same address, and its record must not be deleted by this call.
        size = self._host_allocations.pop(host_ptr, None)
        if size is None:
            raise DriverError("munmap", "EINVAL", ptr=hex(host_ptr), state="not from host_alloc")
        try:
            munmap_or_raise(host_ptr, size)
        except DriverError:
            self._host_allocations[host_ptr] = size  # still mapped: still ours
            raise
