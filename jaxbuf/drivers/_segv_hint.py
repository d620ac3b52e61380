"""The CPU driver's side of the SIGSEGV hint (``jaxbuf/drivers/_host_calls.c``): the driver
tells the extension of every reservation and of what befell it, so that a fault inside one
prints one line naming jaxbuf, the reservation and the likely cause before the usual handler
runs. A hint only: without the optional extension a fault is the bare ``SIGSEGV`` it was."""

from __future__ import annotations

try:  # optional (setup.py)
    from jaxbuf.drivers import _host_calls
except ImportError:
    _host_calls = None

__all__ = ["FREED", "READ_ONLY", "STRICT", "UNMAPPED", "forget", "watch"]

# What the hint says a reservation went through (the bits of _host_calls.c); STRICT: a
# debug-mode reservation, PROT_NONE where uncommitted, so a read faults there too; READ_ONLY:
# a chunk imported read-only is mapped in it, so a write faults on committed memory too.
UNMAPPED, FREED, STRICT, READ_ONLY = 2, 4, 8, 16


def watch(ptr: int, size: int, bits: int = 0) -> None:
    """Tell the hint of a new reservation (``bits=0``) or of what befell one
    (:data:`UNMAPPED`, :data:`FREED`, :data:`READ_ONLY`), or that it is strict
    (:data:`STRICT`); nothing without the extension."""
    if _host_calls is None:
        return
    if bits:
        _host_calls.mark_reservation(ptr, size, bits)
    else:
        _host_calls.watch_reservation(ptr, size)


def forget(ptr: int, size: int) -> None:
    """Tell the hint that the reservations inside ``[ptr, ptr + size)`` go back to the kernel
    (call it before ``munmap``): whatever is mapped there next is not jaxbuf's, and a fault
    in it gets no line."""
    if _host_calls is not None:
        _host_calls.forget_reservation(ptr, size)
