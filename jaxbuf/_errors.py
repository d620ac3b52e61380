"""jaxbuf's error vocabulary for misuse, and several cleanups reported as one error.

**Misuse.** One exception type per kind of misuse, the same for every owner of memory:

* :class:`ClosedError` (a ``RuntimeError``): an owner (``ExtensibleTensor``, ``UvaBuffer``,
  ``UvaBufferPool``, ``ImportedBuffer``, ``StagedWriteTensor``, ...) used after ``free()`` /
  ``close()``. The message names the owner and what was refused; ``owner`` and ``state``
  carry them for code. Also a ``ValueError``, which the UVA and staged owners raised
  before: handlers written for either keep working.
* :class:`ByteOrderError` (a ``TypeError``): a dtype of non-native byte order, which DLPack
  cannot describe.

Bad arguments stay the builtin ``ValueError`` / ``TypeError`` / ``IndexError`` naming the value;
a failed platform call is :class:`jaxbuf.drivers.base.DriverError`; what DLPack cannot honour
is ``BufferError``.

**Cleanups.**
Releasing memory is best effort over many pieces (chunks, slots, reservations): one failure
must not stop the rest from being released, and none may be lost. :class:`Cleanup` runs each
step, keeps going past failures and raises the first with the others attached as notes;
:func:`attempt` runs one rollback step on behalf of an error already being raised, so a
failed rollback becomes a note on that error instead of replacing it. :class:`Rollback` is
the undo stack of a multi-step acquisition built on it.

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

__all__ = ["ByteOrderError", "ClosedError", "Cleanup", "Rollback", "attempt", "raise_first"]


class ClosedError(RuntimeError, ValueError):
    """An owner of memory was used after ``free()`` or ``close()``.

    ``owner`` names the owner's kind (``"ExtensibleTensor"``), ``state`` is ``"freed"`` or
    ``"closed"``. The message reads ``the ExtensibleTensor has been freed`` (then ``: `` and
    ``detail``, when given, saying what was refused). A ``RuntimeError``, as the owner contract
    (:mod:`jaxbuf._owner`) says of every freed owner, and a ``ValueError``, which the UVA and
    staged owners raised before: handlers written for either keep working. Subclasses keep
    this constructor (``owner``, ``state``, ``detail``).

    Examples
    --------
    >>> error = ClosedError("UvaBufferPool", "closed", "copy_to_uva needs an open pool")
    >>> str(error)
    'the UvaBufferPool has been closed: copy_to_uva needs an open pool'
    >>> isinstance(error, RuntimeError), isinstance(error, ValueError), error.owner
    (True, True, 'UvaBufferPool')
    """

    def __init__(self, owner: str, state: str = "freed", detail: str = "") -> None:
        message = f"the {owner} has been {state}"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.owner = owner
        self.state = state
        self.detail = detail

    def __reduce__(self) -> Any:  # pickles (multiprocessing) with its fields, not the message
        return type(self), (self.owner, self.state, self.detail)


class ByteOrderError(TypeError):
    """A dtype of non-native byte order (``'>i4'`` on a little-endian host): DLPack describes
    native-order data only, so jaxbuf refuses it rather than hand out swapped values. A
    ``TypeError``, like every other dtype jaxbuf cannot take."""


def raise_first(errors: Sequence[BaseException], context: str) -> None:
    """Raise the first of ``errors`` with each other one noted as ``"{context}: also
    failed: ..."``; return when ``errors`` is empty. An interrupt (a ``BaseException`` that is
    not an ``Exception``: Ctrl-C, ``SystemExit``) goes first: it must reach the caller as
    itself."""
    if not errors:
        return
    errors = sorted(errors, key=lambda error: isinstance(error, Exception))  # stable
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"{context}: also failed: {other!r}")
    raise first


class Cleanup:
    """Collects the failures of several cleanup steps; :meth:`raise_first` reports them.

    ``context`` names the operation in the notes (``"UvaBufferPool.close"``). A transaction:
    every step runs, whatever the ones before raised, an interrupt included (a Ctrl-C or an
    exception from a signal handler during step 2 of 5 still runs steps 3 to 5, so nothing
    detached is left unreleased), and :meth:`raise_first` raises the interrupt first.
    """

    __slots__ = ("context", "errors")

    def __init__(self, context: str) -> None:
        self.context = context
        self.errors: list[BaseException] = []

    def run(self, step: Callable[..., Any], *args: Any) -> bool:
        """Call ``step(*args)``; True when it succeeded, False when it raised (kept)."""
        try:
            step(*args)
        except BaseException as error:  # noqa: BLE001 - kept, raised by raise_first
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


class Rollback:
    """The undo stack of a multi-step acquisition, as cuda.core's ``Transaction``: each step
    that acquires something registers its undo on the line after it (:meth:`push`).
    Leaving the ``with`` block by an exception (an interrupt included) runs every undo,
    newest first, whatever the others raised: a failed undo becomes a note on the error
    raised (never its replacement), and an interrupt raised by an undo reaches the caller
    after the rest ran. Leaving normally, or :meth:`commit`, keeps everything.

    ``context`` names the acquisition in the notes (``"DeviceParamTable"``).

    Examples
    --------
    >>> log = []
    >>> try:
    ...     with Rollback("making two things") as undo:
    ...         log.append("a")
    ...         undo.push(log.append, "undo a")
    ...         log.append("b")
    ...         undo.push(log.append, "undo b")
    ...         raise ValueError("the third failed")
    ... except ValueError:
    ...     pass
    >>> log
    ['a', 'b', 'undo b', 'undo a']
    """

    __slots__ = ("context", "_undos")

    def __init__(self, context: str) -> None:
        self.context = context
        self._undos: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def push(self, undo: Callable[..., Any], *args: Any) -> None:
        """Register ``undo(*args)``, run if the block fails after this line."""
        self._undos.append((undo, args))

    def commit(self) -> None:
        """Keep everything acquired so far: nothing is undone any more."""
        self._undos.clear()

    def __enter__(self) -> Rollback:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> bool:
        undos, self._undos = self._undos, []
        if error is None:
            return False
        interrupt: BaseException | None = None
        for undo, args in reversed(undos):
            try:
                undo(*args)
            except BaseException as undo_error:  # noqa: BLE001 - noted; an interrupt raised last
                error.add_note(f"{self.context}: undoing {undo!r} failed too: {undo_error!r}")
                if interrupt is None and not isinstance(undo_error, Exception):
                    interrupt = undo_error
        if interrupt is not None and isinstance(error, Exception):
            raise interrupt from error
        return False
