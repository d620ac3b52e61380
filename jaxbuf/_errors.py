"""Several cleanups, one error: the first failure is raised, the others ride along as notes.

Releasing memory is best effort over many pieces (chunks, slots, reservations): one failure
must not stop the rest from being released, and none may be lost. :class:`Cleanup` runs each
step, keeps going past failures and raises the first with the others attached as notes;
:func:`attempt` runs one rollback step on behalf of an error already being raised, so a
failed rollback becomes a note on that error instead of replacing it.

A leaf module: it imports nothing of jaxbuf, so every layer (drivers included) may use it.

Examples
--------
>>> cleanup = Cleanup("close")
>>> cleanup.run(lambda: None)
True
>>> cleanup.run(lambda: 1 / 0)
False
>>> cleanup.raise_first()
Traceback (most recent call last):
ZeroDivisionError: division by zero
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def raise_first(errors: Sequence[BaseException], context: str) -> None:
    """Raise ``errors[0]`` with each later error noted as ``"{context}: also failed: ..."``;
    return when ``errors`` is empty."""
    if not errors:
        return
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"{context}: also failed: {other!r}")
    raise first


class Cleanup:
    """Collects the failures of several cleanup steps; :meth:`raise_first` reports them.

    ``context`` names the operation in the notes (``"UvaBufferPool.close"``). Only
    ``Exception`` is collected: a ``KeyboardInterrupt`` stops the cleanup at once.
    """

    __slots__ = ("context", "errors")

    def __init__(self, context: str) -> None:
        self.context = context
        self.errors: list[BaseException] = []

    def run(self, step: Callable[..., Any], *args: Any) -> bool:
        """Call ``step(*args)``; True when it succeeded, False when it raised (kept)."""
        try:
            step(*args)
        except Exception as error:  # noqa: BLE001 - kept, raised by raise_first
            self.errors.append(error)
            return False
        return True

    def add(self, errors: Sequence[BaseException]) -> None:
        """Keep errors collected elsewhere (a helper that returns its failures)."""
        self.errors.extend(errors)

    def raise_first(self) -> None:
        """Raise the first failure with the others as notes; nothing when all succeeded."""
        raise_first(self.errors, self.context)


def attempt(error: BaseException, what: str, step: Callable[..., Any], *args: Any) -> bool:
    """Run the rollback ``step(*args)`` while ``error`` propagates.

    True when it succeeded; when it raised, the failure is noted on ``error`` as
    ``"{what} failed too: ..."`` and False is returned (``error`` stays the one raised).
    """
    try:
        step(*args)
    except Exception as rollback_error:  # noqa: BLE001 - reported as a note
        error.add_note(f"{what} failed too: {rollback_error!r}")
        return False
    return True
