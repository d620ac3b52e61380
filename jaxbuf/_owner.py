"""The owner contract: what a :class:`~jaxbuf.views.BufferView` may ask of the object whose
memory it views.

Whatever owns memory (``ExtensibleTensor``, ``ImportedBuffer``, ``UvaBuffer`` and the pinned
block behind its views, ``NonUvaBuffer``, pool slots, ``StagedWriteTensor``) implements
:class:`MemoryOwner`. Views and framework adapters use these public members and nothing else
of their owner (no private attributes), so a new kind of buffer is one class implementing
five members. A view's ``owner`` may also be None (a view over a foreign pointer): then there
is nothing to check, wait for or keep alive.

Lifetime: an export (a DLPack capsule, a numpy array) keeps ``export_anchor``
alive, and the anchor holds the allocation, so the memory outlives the owner handle while
arrays use it. ``free()`` on the owner means "I am done": no new exports
(``check_exportable`` raises), the memory goes when the last export does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: this module imports nothing of jaxbuf at run time
    from jaxbuf.devices import Device
    from jaxbuf.drivers.base import VmmDriver

__all__ = ["Lifetime", "MemoryOwner", "OwnedAllocation"]


@runtime_checkable
class MemoryOwner(Protocol):
    """The interface views use on the owner of their memory.

    ``device``
        Where the memory lives: a :class:`~jaxbuf.devices.Device`, or on the owners of the
        ``jaxbuf.torch`` / ``jaxbuf.jax`` faces that framework's device. Library code that
        may be handed a face's object reads ``jaxbuf.as_device(owner.device)``.
    ``driver``
        The :class:`~jaxbuf.drivers.base.VmmDriver` that allocated it; events come from it.
    ``ready_event``
        A driver event recorded after the owner's pending producer work (a zeroing memset, a
        copy, an applied write), or None when there is nothing to wait for. A consumer that
        names its stream is made to wait on it (``driver.stream_wait_event``). Read it on
        every export: it changes as the owner works.
    ``check_exportable()``
        Returns when new exports are allowed; raises ``RuntimeError`` naming the owner once
        it is freed or closed.
    ``export_anchor``
        The owner's one :class:`~jaxbuf._capsule.ExportAnchor` while it is open, None once it
        is freed (the export hot path reads only this: a live anchor means "exportable"). The
        object an export keeps alive. It holds the allocation, so the memory outlives the
        owner handle while arrays use it: the ``jaxbuf._capsule.ExportAnchor`` of the
        owner's :class:`Lifetime`, which counts the live exports (any other object is wrapped
        in an anchor that its live exports share).
    ``committed_ranges(ptr, nbytes)`` (optional)
        The parts of ``[ptr, ptr + nbytes)`` backed by memory, as sorted ``(start, end)``
        addresses: all a copy of a view (``__dlpack__(copy=True)``) reads; the rest of the copy
        is zeros. An owner without it has all of its views' bytes backed (a UVA buffer).
    """

    device: Device

    @property
    def driver(self) -> VmmDriver: ...

    @property
    def ready_event(self) -> Any | None: ...

    def check_exportable(self) -> None: ...

    @property
    def export_anchor(self) -> object: ...


class OwnedAllocation(Protocol):
    """What a :class:`Lifetime` manages: the object that holds the platform resources.

    It releases them in ``release()`` (raising on a driver failure, retryable) and, if it is
    collected unreleased, in its ``__del__`` through
    :func:`jaxbuf._lifetime.release_when_collected`; that is how memory goes when the last
    export of a freed owner is dropped. ``released`` says whether it has happened.
    """

    @property
    def released(self) -> bool: ...

    def release(self) -> None: ...


class Lifetime:
    """An owner's link to its allocation, implementing "``free()`` means I am done".

    While open, ``anchor`` is the one :class:`~jaxbuf._capsule.ExportAnchor` over the
    allocation: every export holds it, so ``anchor.live_exports`` counts the framework arrays
    alive. :meth:`close` drops the owner's claim: the allocation is released at once when
    nothing is exported, else when the last export drops the anchor (the allocation's own
    finalizer). After ``close`` only weak references remain here, so this object never keeps
    the memory alive.

    Hot path: owners implement ``check_exportable`` as ``if lifetime.anchor is None: raise``
    and ``export_anchor`` as ``lifetime.anchor`` (one attribute read each).
    """

    __slots__ = ("anchor", "_anchor_ref", "_allocation_ref")

    def __init__(self, allocation: OwnedAllocation) -> None:
        from jaxbuf._capsule import ExportAnchor  # C; imports nothing of jaxbuf

        self.anchor: Any = ExportAnchor(allocation)
        self._anchor_ref = weakref.ref(self.anchor)
        self._allocation_ref = weakref.ref(allocation)

    @property
    def closed(self) -> bool:
        return self.anchor is None

    @property
    def live_exports(self) -> int:
        """Framework arrays (DLPack capsules, numpy arrays) still holding the allocation."""
        anchor = self._anchor_ref()
        return 0 if anchor is None else anchor.live_exports

    @property
    def released(self) -> bool:
        """Whether the allocation's memory has been given back."""
        allocation = self._allocation_ref()
        return allocation is None or allocation.released

    def close(self, release_now: Callable[[Any], None]) -> bool:
        """Close; call ``release_now(allocation)`` when no export is alive and return True.

        With live exports nothing is released here (False): the allocation goes when the last
        export does. A failing ``release_now`` propagates with the lifetime closed; the owner
        keeps its own reference to the allocation so that a retry can finish the release.
        Idempotent: a second call returns False without calling anything.
        """
        anchor, self.anchor = self.anchor, None
        if anchor is None:
            return False
        allocation = anchor.target
        # One atomic step (C, with the GIL): from here an export that took the anchor before
        # this call is refused (ClosedError) instead of made over memory released below.
        if anchor.close():
            return False
        del anchor  # the allocation must not outlive this call through a local
        release_now(allocation)
        return True
