"""Freed reservations parked ``PROT_NONE`` before their address space goes back to the kernel
(:class:`Quarantine`), so a stale pointer into one faults instead of reading whatever a later
``mmap`` places there. The CPU driver's; see "Quarantine" in :mod:`jaxbuf.drivers.host`."""

from __future__ import annotations

import resource
import threading
from collections import deque

from jaxbuf.drivers import _posix as posix
from jaxbuf.drivers._posix import mmap_or_raise, munmap_or_raise
from jaxbuf.drivers._segv_hint import forget
from jaxbuf.drivers.base import DriverError

__all__ = ["Quarantine"]


class Quarantine:
    """A bounded FIFO of freed ranges: ``max_bytes`` of address space (at most a quarter of a
    finite ``RLIMIT_AS``, which parked ranges count against) and ``max_ranges`` ranges; the
    oldest beyond either bound are ``munmap``-ed. ``max_bytes=0`` unmaps at once.
    Thread-safe (the driver is shared between threads)."""

    def __init__(self, max_bytes: int, max_ranges: int) -> None:
        for name, value in (("quarantine_bytes", max_bytes), ("quarantine_ranges", max_ranges)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.max_bytes, self.max_ranges = max_bytes, max_ranges
        self._parked: deque[tuple[int, int]] = deque()  # (ptr, size), oldest first
        self._parked_bytes = 0
        self._lock = threading.Lock()

    @property
    def counts(self) -> tuple[int, int]:
        """``(ranges, bytes)`` parked now."""
        with self._lock:
            return len(self._parked), self._parked_bytes

    def budget(self) -> int:
        """``max_bytes``, capped at a quarter of a finite ``RLIMIT_AS``."""
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return self.max_bytes
        return min(self.max_bytes, soft // 4)

    def flush(self) -> None:
        """``munmap`` every parked range (their addresses may then be reused)."""
        with self._lock:
            parked, self._parked = list(self._parked), deque()
            self._parked_bytes = 0
        for ptr, size in parked:
            _unmap(ptr, size)

    def free(self, ptr: int, size: int) -> None:
        """Park the reservation ``[ptr, ptr + size)`` (dropping its pages), or unmap it when it
        does not fit; then unmap the oldest ranges beyond the bounds."""
        budget = self.budget()
        parked = False
        if size > budget or not self.max_ranges:
            _unmap(ptr, size)
        else:
            # One MAP_FIXED call drops whatever is still mapped and keeps the range reserved,
            # so a stale pointer into it faults rather than reading a later allocation's bytes.
            try:
                mmap_or_raise(
                    ptr,
                    size,
                    posix.PROT_NONE,
                    posix.MAP_RESERVE_FLAGS | posix.MAP_FIXED,
                    -1,
                    ptr=hex(ptr),
                )
                parked = True
            except DriverError:  # e.g. ENOMEM at vm.max_map_count: free without the guard
                _unmap(ptr, size)
        # Evicted down to the budget on every call, also when this range was not parked: a
        # lowered RLIMIT_AS lowers the budget below what is parked already.
        evicted = []
        with self._lock:
            if parked:
                self._parked.append((ptr, size))
                self._parked_bytes += size
            while self._parked_bytes > budget or len(self._parked) > self.max_ranges:
                old = self._parked.popleft()
                self._parked_bytes -= old[1]
                evicted.append(old)
        for old_ptr, old_size in evicted:
            _unmap(old_ptr, old_size)


def _unmap(ptr: int, size: int) -> None:
    """Hand a freed range back to the kernel; the SIGSEGV hint forgets it first, so that a
    fault in whatever is mapped there later is not reported as jaxbuf's."""
    forget(ptr, size)
    munmap_or_raise(ptr, size)
