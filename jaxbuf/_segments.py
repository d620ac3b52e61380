"""Segment layout shared by :class:`~jaxbuf.ExtensibleTensor` and its import into another
process (:class:`~jaxbuf.sharing.ImportedBuffer`): both are a reservation split into
segments, each with a committed prefix, seen through uint8 :class:`~jaxbuf.views.BufferView`s.

Both own the memory their views show, so the owner contract
(:class:`jaxbuf._owner.MemoryOwner`) is implemented here, once.
"""

from __future__ import annotations

from typing import Any

from jaxbuf._checks import as_int
from jaxbuf.devices import Device
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.dtypes import uint8
from jaxbuf.views import BufferView


class SegmentedReservation:
    """Views and layout properties over ``_segment_offsets``, ``_segment_capacities`` and
    ``_committed`` (committed prefix size of each segment), on ``_device`` through ``_driver``,
    and the owner contract of those views (:class:`jaxbuf._owner.MemoryOwner`).

    Subclasses set those attributes and ``_ready_event`` (the driver event after their last
    producer work, or None) and implement :meth:`_live_base_ptr`.
    """

    _device: Device
    _driver: VmmDriver
    _ready_event: Any
    _segment_offsets: list[int]
    _segment_capacities: list[int]
    _committed: list[int]

    def _live_base_ptr(self) -> int:
        """The reservation's address; RuntimeError once it is freed or closed."""
        raise NotImplementedError

    #: Whether :meth:`_view` keeps the views it made, by ``(ptr, nbytes)``: the framework
    #: faces turn it on for the tensors users take over and over. A kept view is a template
    #: without an owner (its capsule payloads packed once); each call hands out a copy owned
    #: by this handle, so a face's ``segment_view`` costs one import and a copy, not a view
    #: and a pack too. Templates refer to nothing: no cycle through the handle, so a handle
    #: dropped without ``free()`` goes at once (also with the cycle collector off or frozen),
    #: as jaxbuf's own owners (a NonUvaBuffer's device memory) rely on.
    _reuse_views: bool = False
    _views: dict[tuple[int, int], BufferView] | None = None

    def _view(self, offset: int, nbytes: int) -> BufferView:
        ptr = self._live_base_ptr() + offset  # ClosedError once freed, kept view or not
        if not self._reuse_views:
            return self._new_view(ptr, nbytes)
        views = self._views
        if views is None:
            views = self._views = {}
        template = views.get((ptr, nbytes))
        if template is not None:
            return template._with_owner(self)
        if len(views) > 2 * len(self._committed) + 2:  # old sizes, after growth
            views.clear()
        view = self._new_view(ptr, nbytes)
        view._pack_versioned()  # as this owner's (read-only or not), then kept ownerless
        views[ptr, nbytes] = view._with_owner(None)
        return view

    def _new_view(self, ptr: int, nbytes: int) -> BufferView:
        return BufferView(
            ptr=ptr,
            nbytes=nbytes,
            dtype=uint8,
            shape=(nbytes,),
            device=self._device,
            owner=self,
            dlpack_device_type=self._driver.dlpack_device_type,
        )

    def segment_view(self, index: int) -> BufferView:
        """Uint8 view over one segment's committed prefix, sized exactly to it."""
        i = index if type(index) is int else as_int(index, "segment index")
        if not 0 <= i < len(self._committed):
            raise IndexError(
                f"segment index {index!r} out of range for {len(self._committed)} segment(s)"
            )
        return self._view(self._segment_offsets[i], self._committed[i])

    # -- the owner contract (jaxbuf._owner.MemoryOwner) ------------------------------------
    @property
    def device(self) -> Device:
        return self._device

    @property
    def driver(self) -> VmmDriver:
        """The driver that allocated the reservation."""
        return self._driver

    @property
    def ready_event(self) -> Any:
        """The driver event after the pending producer work (a zeroing memset), or None."""
        return self._ready_event

    def check_exportable(self) -> None:
        """RuntimeError naming the buffer once it is freed or closed."""
        self._live_base_ptr()

    @property
    def export_anchor(self) -> object:
        """What an export keeps alive: the buffer itself (see :mod:`jaxbuf._owner`)."""
        return self

    def _not_an_array(self, *args: Any, **kwargs: Any) -> Any:
        name = type(self).__name__
        raise TypeError(
            f"an {name} is not an array: take a view first, e.g. "
            f"torch.from_dlpack(buf.segment_view(0)), np.asarray(buf.segment_view(0).to_numpy()) "
            f"or buf.full_view() (see {name}.full_view for what it may touch)"
        )

    # torch.from_dlpack / np.asarray / jnp.asarray of the buffer itself: a clear TypeError.
    __dlpack__ = __dlpack_device__ = __array__ = _not_an_array

    def committed_ranges(self, ptr: int, nbytes: int) -> list[tuple[int, int]]:
        """The committed bytes of ``[ptr, ptr + nbytes)``: ``(start, end)`` addresses, sorted
        and disjoint, one per segment prefix it meets (O(segments)). What a copy of a view may
        read (see :mod:`jaxbuf._owner`); empty once freed or closed."""
        base = self._live_base_ptr()
        end = ptr + nbytes
        runs = []
        for offset, size in zip(self._segment_offsets, self._committed):
            start, stop = max(ptr, base + offset), min(end, base + offset + size)
            if start < stop:
                runs.append((start, stop))
        return runs

    @property
    def nbytes(self) -> int:
        """Committed bytes, summed over all segments (``nbytes``, as on views and UVA
        buffers)."""
        return sum(self._committed)

    @property
    def num_bytes(self) -> int:
        """The seed's name for :attr:`nbytes` (kept as an alias)."""
        return sum(self._committed)

    @property
    def committed_sizes(self) -> list[int]:
        """Committed prefix size of every segment."""
        return list(self._committed)

    @property
    def num_segments(self) -> int:
        return len(self._segment_capacities)

    @property
    def segment_capacities(self) -> list[int]:
        return list(self._segment_capacities)

    @property
    def segment_offsets(self) -> list[int]:
        """Byte offset of each segment within the reservation."""
        return list(self._segment_offsets)
