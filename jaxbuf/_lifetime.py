"""Releasing platform resources from ``__del__``, the same way everywhere.

An object that owns driver resources frees them when it is collected, but a collector has no
caller to raise to, and at interpreter exit the platform runtime may already be gone (a driver
call there can abort the process; the process returns its memory anyway). So: never while the
interpreter is finalizing, and a failure is never silent:

* with a ``driver`` named, the failed release is **queued**: retried at the next use of that
  driver (:func:`retry_deferred`, which the allocations call when they reserve or release)
  and at interpreter exit (an ``atexit`` hook), and reported once, when it is queued, as a
  ``ResourceWarning`` naming what is retried. The queue holds the release (and so the
  object) until a retry succeeds.
* without one, the failure becomes a ``ResourceWarning`` naming what leaked, instead of an
  "Exception ignored" line or silence.
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from jaxbuf._interrupts import deferred_interrupts

__all__ = [
    "deferred_releases",
    "release_or_retry_later",
    "release_when_collected",
    "retry_deferred",
]

# (driver, release, what) of the releases that failed in a finalizer, oldest first.
_deferred: list[tuple[Any, Callable[[], object], str]] = []
_deferred_lock = threading.RLock()  # a finalizer may run while it is held (GC)


def release_when_collected(
    release: Callable[[], object],
    what: str,
    driver: Any = None,
    _is_finalizing: Callable[[], bool] = sys.is_finalizing,
    _warn: Callable[..., None] = warnings.warn,
) -> None:
    """Call ``release()`` on behalf of a ``__del__``; see the module docstring.

    Callers bind this function as a default argument of ``__del__``, so it is reachable even
    after module globals are cleared at exit; its own helpers are bound the same way.
    """
    if _is_finalizing():
        return
    # Released and recorded as one step: an interrupt landing as the release returns is held
    # back (delivered after it, or by an enclosing block: a close() that dropped the object),
    # never taken for a failed release, queued and released a second time.
    interrupts: list[BaseException] = []
    try:
        with deferred_interrupts(collect=interrupts):
            release()
    except BaseException as error:  # noqa: BLE001 - no caller to raise to: reported, not hidden
        if driver is None:
            _warn(
                f"jaxbuf: releasing {what} during garbage collection failed (it leaks): {error!r}",
                ResourceWarning,
                stacklevel=3,
            )
        else:
            with _deferred_lock:
                _deferred.append((driver, release, what))
            _warn(
                f"jaxbuf: releasing {what} during garbage collection failed: {error!r}; it is "
                "retried at the next use of its driver and at interpreter exit",
                ResourceWarning,
                stacklevel=3,
            )
        if not isinstance(error, Exception):
            # An interrupt (Ctrl-C, an exception from a signal handler) fails the release
            # like any other error: queued above, so nothing leaks. It goes on as Python
            # reports any exception in a finalizer (there is no caller to deliver it to).
            raise
    if interrupts:
        raise interrupts[0]  # after a release that happened: Python reports it, nothing queued


def release_or_retry_later(release: Callable[[], object], what: str, driver: Any) -> None:
    """Call ``release()`` for something already forgotten by its holder (an event a newer
    one replaced): released and forgotten as one step (an interrupt landing as it returns is
    delivered after it), and a failure, an interrupt raised by the call included, queues it
    for :func:`retry_deferred` before it propagates: never leaked, never released twice."""
    interrupts: list[BaseException] = []
    try:
        with deferred_interrupts(collect=interrupts):
            release()
    except BaseException:
        with _deferred_lock:
            _deferred.append((driver, release, what))
        raise
    if interrupts:
        raise interrupts[0]


def retry_deferred(driver: Any = None) -> None:
    """Retry the queued releases of ``driver`` (every driver's when None). Cheap when the
    queue is empty (one list check). A release that fails again stays queued, silently: it
    was reported when it was queued."""
    if not _deferred:
        return
    with _deferred_lock:
        mine = [entry for entry in _deferred if driver is None or entry[0] is driver]
        for entry in mine:
            _deferred.remove(entry)
    failed: list[Any] = []
    done = 0
    try:
        for entry in mine:
            # Released and counted as one step: an interrupt landing after a release returned
            # would queue it again, and the next retry would release it twice.
            with deferred_interrupts():
                try:
                    entry[1]()
                except Exception:  # noqa: BLE001 - reported when queued; kept for the next retry
                    failed.append(entry)
                done += 1
    finally:
        # An interrupt (Ctrl-C, an exception from a signal handler) between releases: those
        # not reached stay queued with those that failed.
        requeue = failed + mine[done:]
        if requeue:
            with _deferred_lock:
                _deferred[:0] = requeue


def deferred_releases(driver: Any = None) -> list[str]:
    """What is queued for a retry (of ``driver``, or of every driver): one name each."""
    with _deferred_lock:
        return [what for d, _, what in _deferred if driver is None or d is driver]


# At exit, before the interpreter finalizes (atexit hooks run first): the last retry.
atexit.register(retry_deferred)
