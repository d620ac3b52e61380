"""One ring of pinned slots with one reuse guard (:class:`PinnedSlotRing`).

Every owner of round-robin pinned staging memory (:class:`~jaxbuf.uva.UvaBufferPool`, the
fused staged writer, the JAX ``PackRing``) keeps ``count`` slots of pinned host memory that the
host fills and the device then reads. They differ in what a slot holds besides its buffer (a
subclass of :class:`PinnedSlot`), in how the device's reading is guarded (a guard object:
a :class:`DeviceEvent`, or a JAX array's readiness in the JAX wing) and in whether a busy slot
is waited for, refused, or left to the caller's promise (``mode``). They share the ring.

Invariant: **a slot is never written again, grown or released while the device may still
read it**, unless the owner's mode leaves that to the caller (``mode=None``: the seed's
contract), and even then never grown (its memory freed) under a pending guard. What the ring
knows of a slot is its ``guard``:

* ``None``: nothing may read the slot; it is free to write.
* :data:`UNRECORDED`: handed to the device, reader not (yet) known, for example because
  recording the event after the reader failed. Reusing it costs the ring's ``fallback``, a
  device-wide wait, so a lost event never lets a slot be reused early.
* a guard (anything with ``wait() -> bool`` and ``ready() -> bool``): reusing the slot waits
  for it; a ``wait()`` that returns False (the guard could not tell: a donated JAX array)
  falls back to the device-wide wait.

The ring holds no per-call state of its own: an owner's hot path reads ``slots[i]`` and a
slot's ``guard`` and ``capacity`` directly (documented fields), and calls into the ring only
when a slot is busy, too small, or closing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import Cleanup, ClosedError
from .._interrupts import deferred_interrupts
from .._lifetime import release_when_collected

__all__ = ["UNRECORDED", "DeviceEvent", "PinnedSlot", "PinnedSlotRing"]

_MODES = (None, "wait", "raise")


class _Unrecorded:
    """The guard of a slot handed to the device whose reader is not known."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNRECORDED"


#: A slot the device may read, with no guard to wait on: reused only after the fallback.
UNRECORDED: Any = _Unrecorded()


class DeviceEvent:
    """A driver event recorded on DLPack stream ``stream``: the guard of a slot whose
    reader was enqueued there before it (and, for staged writes, the written tensors' ready
    event). Destroyed by :meth:`release` or when the last holder lets go."""

    __slots__ = ("handle", "stream", "_driver")

    def __init__(self, driver: Any, handle: Any, stream: int) -> None:
        self.handle = handle
        self.stream = stream
        self._driver = driver

    def ready(self) -> bool:
        """Whether the work before the event is done (never blocks)."""
        return bool(self._driver.event_query(self.handle))

    def wait(self) -> bool:
        """Block until the work before the event is done; True (the event can tell)."""
        if not self._driver.event_query(self.handle):
            self._driver.event_synchronize(self.handle)
        return True

    def release(self) -> None:
        """Destroy the event now: a driver failure (an interrupt raised by the call
        included) reaches the caller with the handle kept, for the next ``release()`` (or
        the finalizer) to retry.

        Destroyed and forgotten as one step (:func:`deferred_interrupts`): a Ctrl-C landing
        as the destroy returns is delivered after the handle is forgotten, never taken for a
        failed destroy (a second one later), and a destroy that failed keeps the handle
        (none leaked). On a guarded pool's hot path on CUDA only (the CPU has no events):
        about 1.4 µs a release."""
        handle = self.handle
        if handle is not None:
            with deferred_interrupts():
                self._driver.destroy_event(handle)
                self.handle = None

    def __del__(self, _release: Any = release_when_collected) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            driver = self._driver
            _release(lambda: driver.destroy_event(handle), "a CUDA event", driver=driver)


class PinnedSlot:
    """One slot: ``buffer`` (pinned memory, None before its first allocation), its
    ``capacity`` (in the owner's unit: rows, bytes, words; -1 once the ring is closed, so any
    request exceeds it and reaches :meth:`PinnedSlotRing.grow`, which refuses), and
    ``guard`` (see the module docstring). Owners subclass it for what else a slot holds,
    keeping ``__slots__``, and override :meth:`refresh`."""

    __slots__ = ("buffer", "capacity", "guard")

    def __init__(self) -> None:
        self.buffer: Any = None
        self.capacity = 0
        self.guard: Any = None

    def refresh(self) -> None:
        """Update what the subclass derives from ``buffer``: called each time ``buffer``
        changed (None included), before the old buffer is released."""


class PinnedSlotRing:
    """``count`` :class:`PinnedSlot` of pinned memory reused round-robin under one guard.

    Parameters
    ----------
    count : int
        Number of slots (validated by the owner).
    allocate : callable
        ``allocate(capacity)``: a new pinned buffer of ``capacity`` (the owner's unit).
    release : callable
        ``release(buffer)``: frees a buffer the ring no longer holds (arrays over it keep its
        memory, as the owner contract of :class:`~jaxbuf.uva.UvaBuffer` says).
    fallback : callable
        The device-wide wait that makes an :data:`UNRECORDED` slot (or one whose guard cannot
        tell) safe: typically the driver's ``synchronize``, after the frameworks' pending work.
    mode : {None, "wait", "raise"}
        How :meth:`wait` treats a busy slot before a write: ``"wait"`` blocks,
        ``"raise"`` raises RuntimeError (nothing changed), None trusts the caller (the
        owner's hot path then skips :meth:`wait`; :meth:`grow` and :meth:`close` still wait).
    owns_guards : bool
        Whether a guard is the ring's alone, so :meth:`DeviceEvent.release` destroys it once
        waited for (a pool's events); False when it is shared (a staged apply's event is
        also the written tensors' ready event) and goes with its last holder.
    slot_type : type
        A :class:`PinnedSlot` subclass, made with no arguments.
    name : str
        The owner's name, for errors.
    """

    __slots__ = (
        "slots",
        "mode",
        "closed",
        "_allocate",
        "_release",
        "_fallback",
        "_owns_guards",
        "_name",
    )

    def __init__(
        self,
        count: int,
        allocate: Callable[[int], Any],
        release: Callable[[Any], Any],
        fallback: Callable[[], Any],
        *,
        mode: str | None = "wait",
        owns_guards: bool = False,
        slot_type: type = PinnedSlot,
        name: str = "PinnedSlotRing",
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be None, 'wait' or 'raise', got {mode!r}")
        self.slots: list[Any] = [slot_type() for _ in range(count)]
        self.mode = mode
        self.closed = False
        self._allocate = allocate
        self._release = release
        self._fallback = fallback
        self._owns_guards = owns_guards
        self._name = name

    # -- reuse ----------------------------------------------------------------------------
    def wait(self, slot: PinnedSlot, index: int | None = None) -> None:
        """Return once nothing may read ``slot`` (its guard then None); in ``"raise"`` mode
        raise RuntimeError instead of blocking (slot ``index`` named; the guard kept)."""
        guard = slot.guard
        if guard is None:
            return
        if self.mode == "raise" and (guard is UNRECORDED or not guard.ready()):
            raise RuntimeError(
                f"{self._name} slot {index} is reused while the device still reads it "
                f"(max_concurrency={len(self.slots)}); nothing was written"
            )
        self._settle(slot)

    def _settle(self, slot: PinnedSlot) -> None:
        """Block until nothing may read ``slot``, whatever the mode; clear its guard."""
        guard = slot.guard
        if guard is UNRECORDED or not guard.wait():
            self._fallback()
        slot.guard = None
        if self._owns_guards and guard is not UNRECORDED:
            guard.release()

    # -- growth ---------------------------------------------------------------------------
    def grow(self, slot: PinnedSlot, capacity: int) -> None:
        """Give ``slot`` a new buffer of ``capacity``: the old one's reader is waited for
        (its memory is released, whatever the mode), the new buffer allocated first (a
        failure leaves the slot as it was), then ``slot.refresh()``, then the old buffer
        released (a failure there reaches the caller with the slot already consistent).
        ClosedError once the ring is closed."""
        if self.closed:
            raise ClosedError(self._name, "closed")
        if slot.guard is not None:
            self._settle(slot)
        buffer = self._allocate(capacity)
        old, slot.buffer, slot.capacity = slot.buffer, buffer, capacity
        slot.refresh()
        if old is not None:
            self._release(old)

    # -- closing --------------------------------------------------------------------------
    def close(self, settle_unrecorded: bool = True) -> None:
        """Closed: every slot's capacity becomes -1 and growth raises ClosedError; each
        recorded guard is waited for (an :data:`UNRECORDED` one only when
        ``settle_unrecorded``: a finalizer makes no framework call), then every buffer is
        released, best effort: a slot whose release fails keeps its buffer, and the next
        ``close()`` retries it; the first error is raised, the others attached as notes.
        Safe to call twice."""
        self.closed = True
        for slot in self.slots:
            slot.capacity = -1
            guard = slot.guard
            if guard is not None and (settle_unrecorded or guard is not UNRECORDED):
                self._settle(slot)
            slot.guard = None
        cleanup = Cleanup(f"{self._name}.close")
        for slot in self.slots:
            buffer = slot.buffer
            if buffer is None:
                continue
            # Released and recorded as one step: an interrupt held back till both ran (it
            # would otherwise put a freed buffer back), then raised first at the end.
            with deferred_interrupts(collect=cleanup.errors):
                # What the slot derives from its buffer goes first: a host array kept there
                # would be a live export, holding the memory past its release.
                slot.buffer = None
                slot.refresh()
                if not cleanup.run(self._release, buffer):
                    slot.buffer = buffer
                    slot.refresh()
        cleanup.raise_first()

    @property
    def held(self) -> bool:
        """Whether any slot still holds a buffer or a guard."""
        return any(s.buffer is not None or s.guard is not None for s in self.slots)
