"""Interrupts held back while a release and its bookkeeping run.

A Ctrl-C (or an exception raised by any Python signal handler) is delivered between
bytecodes, and a signal that arrives during a slow driver call (a ``munmap`` of 512 MiB, a
``cuMemUnmap``) is delivered right after the call returns: the release has happened, but
the line that records it has not run. Treated as a failure of that call, the retry then
releases twice (a double ``cuMemRelease``, or ``close`` of a descriptor another thread
reopened). No ``try`` closes that window; holding the interrupt back until the bookkeeping
is done does.

:func:`deferred_interrupts` does that the way trio protects its own critical sections:
while the block runs, every signal that has a Python handler gets a recording handler; on
leaving, the handlers go back and each recorded signal is handed to its handler, so the
``KeyboardInterrupt`` reaches the caller after the block, as itself. Python runs signal
handlers only in the main thread, so a block on any other thread has nothing to hold back
and costs nothing. Only short blocks belong here (never a wait that may not return): a
held-back Ctrl-C waits for the block.
"""

from __future__ import annotations

import _signal  # signal's functions without its enum conversions (5 µs a call there)
import signal
import threading
from typing import Any

#: The signals a Python handler is commonly installed for (SIGINT's is Python's default).
_SIGNALS = tuple(
    int(getattr(signal, name))
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGHUP",
        "SIGUSR1",
        "SIGUSR2",
    )
    if hasattr(signal, name)
)

_main_thread = threading.main_thread()
_get_ident = threading.get_ident
#: Depth of nested blocks on the main thread (only it runs signal handlers).
_depth = 0
#: Each held-back signal: (signum, frame), handed to its handler when the block ends.
_pending: list[tuple[int, Any]] = []
#: The handler a recording handler stands in for, per signal. Kept after a block ends, so a
#: recording handler left installed (an interrupt while the handlers were being put back)
#: behaves as the one it replaced.
_replaced: dict[int, Any] = {}


def _record(signum: int, frame: Any) -> None:
    """The stand-in handler: holds the signal back inside a block, else delivers it."""
    if _depth:
        _pending.append((signum, frame))
        return
    _replaced[signum](signum, frame)


def _install() -> None:
    for signum in _SIGNALS:
        handler = _signal.getsignal(signum)
        if handler is _record or not callable(handler):
            continue  # SIG_DFL, SIG_IGN or a C handler: no Python code runs, nothing to defer
        _replaced[signum] = handler
        _signal.signal(signum, _record)


def _restore() -> None:
    for signum in _SIGNALS:
        if _signal.getsignal(signum) is _record:
            _signal.signal(signum, _replaced[signum])


class deferred_interrupts:  # noqa: N801 - used as a function: ``with deferred_interrupts():``
    """Run the block with signal handlers held back; deliver what arrived on leaving.

    For a driver call that releases something together with the line that records the
    release: nothing in between can raise, so a retry never releases twice. With
    ``collect``, what the handlers raise on leaving is appended there instead of raised (a
    cleanup that goes on with its other steps and raises the interrupt first at its end).
    The outermost block delivers: a nested one holds back for it. About 1 µs a block on
    the main thread, nothing on another.
    """

    __slots__ = ("collect", "outermost")

    def __init__(self, collect: list[BaseException] | None = None) -> None:
        self.collect = collect
        self.outermost = False

    def __enter__(self) -> None:
        global _depth
        if _get_ident() != _main_thread.ident:
            return  # no handler runs on this thread: nothing can land in the block
        if _depth == 0:
            # Install before counting: an interrupt landing in _install() leaves no count
            # behind (a count left without its __exit__ would stop every later block from
            # installing, so none would hold anything back).
            self.outermost = True
            try:
                _install()
            except BaseException:
                # A signal delivered while the handlers were being replaced (before its
                # recording one took over): the block never runs and __exit__ is never
                # called, so leave no trace.
                self.outermost = False
                _restore()
                raise
        _depth += 1

    def __exit__(self, *exc_info: object) -> None:
        global _depth
        if _get_ident() != _main_thread.ident:
            return
        _depth -= 1
        if not self.outermost:
            return
        _restore()
        pending, _pending[:] = list(_pending), []
        for signum, frame in pending:
            if self.collect is None:
                _replaced[signum](signum, frame)  # raises here: after the block, as itself
                continue
            try:
                _replaced[signum](signum, frame)
            except BaseException as error:  # noqa: BLE001 - the caller raises it
                self.collect.append(error)
