"""Growable device byte buffers whose base pointer never moves.

An :class:`ExtensibleTensor` reserves address space for its maximum size once, then backs
it with physical memory on demand through a :class:`~jaxbuf.drivers.base.VmmDriver`
(CUDA virtual memory management on a GPU, ``mmap``/``memfd`` on the CPU). Views taken
before a grow stay valid after it, so a CUDA graph captured over the buffer keeps working.

The reservation and its chunks are a :class:`~jaxbuf._reservation.VirtualBuffer` (defragmenting
in :mod:`jaxbuf._defragment`); this module adds the segments, the public API and the ownership
rules of :mod:`jaxbuf._owner`: every export keeps the virtual buffer alive, and :meth:`free`
means "I am done".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jaxbuf import interop
from jaxbuf._checks import as_int as _as_int
from jaxbuf._defragment import defragment_segments
from jaxbuf._errors import ClosedError, attempt
from jaxbuf._interrupts import deferred_interrupts
from jaxbuf._lifetime import release_or_retry_later, release_when_collected
from jaxbuf._owner import Lifetime
from jaxbuf._peers import check_peers, parse_peer_specs
from jaxbuf._reservation import MIN_GRANULARITY, MappingListener, commit_granule, round_up
from jaxbuf._reservation import VirtualBuffer as _VirtualBuffer
from jaxbuf._resolve import resolve
from jaxbuf._segments import SegmentedReservation
from jaxbuf.devices import Device, DeviceLike
from jaxbuf.drivers.base import VmmDriver
from jaxbuf.views import BufferView, uint8_tensor_from_ptr

__all__ = ["SEGMENT_ALIGNMENT", "ExtensibleTensor", "granule_size", "uint8_tensor_from_ptr"]

# Sizes must fit DLPack's int64 shapes (and size_t, which ctypes would silently wrap), after
# rounding up to the granule.
_MAX_BYTES = (1 << 63) - MIN_GRANULARITY
#: Every segment starts at a multiple of this many bytes of the (granule-aligned) reservation,
#: so every segment view is aligned for any consumer: JAX imports host memory in place only at
#: 64-byte alignment (it copies otherwise), and CUDA's own allocations are 256-byte aligned.
SEGMENT_ALIGNMENT = 256


def _as_size(value: Any, name: str) -> int:
    """A non-negative int, or TypeError / ValueError naming ``value``."""
    size = _as_int(value, name)
    if size < 0:
        raise ValueError(f"{name} must be non-negative, got {size}")
    return size


def _as_size_list(values: Any, name: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {values!r}")
    return [_as_size(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _segment_capacities(max_num_bytes: int, num_segments: Any, capacities: Any) -> list[int]:
    """The validated segment capacities (equal ones, or the explicit list)."""
    num_segments = _as_int(num_segments, "num_segments")
    if num_segments < 1:
        raise ValueError(f"num_segments must be positive, got {num_segments}")
    if capacities is None:
        if max_num_bytes % num_segments != 0:
            raise ValueError(
                f"max_num_bytes ({max_num_bytes}) must be divisible by "
                f"num_segments ({num_segments})"
            )
        return [max_num_bytes // num_segments] * num_segments
    capacities = _as_size_list(capacities, "segment_capacities")
    if not capacities or any(c <= 0 for c in capacities):
        raise ValueError(f"segment_capacities must be non-empty and positive, got {capacities}")
    if num_segments not in (1, len(capacities)):
        raise ValueError(
            f"num_segments ({num_segments}) does not match the {len(capacities)} segment_capacities"
        )
    if sum(capacities) != max_num_bytes:
        raise ValueError(
            f"segment_capacities sum to {sum(capacities)}, not max_num_bytes ({max_num_bytes})"
        )
    return capacities


def _aligned_offsets(capacities: list[int]) -> tuple[list[int], int]:
    """Each segment's start (the previous end rounded up to :data:`SEGMENT_ALIGNMENT`) and
    the end of the last one."""
    offsets, end = [], 0
    for capacity in capacities:
        start = round_up(end, SEGMENT_ALIGNMENT)
        offsets.append(start)
        end = start + capacity
    return offsets, end


def granule_size(device_index: DeviceLike | None = None, driver: VmmDriver | None = None) -> int:
    """Commit granule of a device: the driver granularity, floored at 2 MiB.

    ``device_index`` is the seed's parameter: an int names a CUDA device, as there; any
    device spec (``"cpu"``, a ``Device``, a ``torch.device``) works too, and None means
    :func:`jaxbuf.default_device`. The result is a multiple of the driver granularity (the
    floor is rounded up to one).

    Examples
    --------
    >>> import jaxbuf
    >>> jaxbuf.granule_size("cpu") % (2 * 1024 * 1024)
    0
    """
    device, driver = resolve(device_index, driver)
    return commit_granule(driver, device.index)


def _refuse_copy(*args: Any) -> Any:
    raise TypeError(
        "an ExtensibleTensor cannot be pickled or copied: it owns a device reservation and "
        "the memory mapped into it, which no other object or process can take over; share "
        "it with jaxbuf.sharing.send_buffer, or copy its bytes through a view "
        "(segment_view(i).to_numpy().copy())"
    )


class ExtensibleTensor(SegmentedReservation):
    """A device byte buffer that grows without moving its base pointer.

    The reservation is divided into contiguous segments whose committed bytes form a
    prefix of each: ``num_segments`` equal segments by default, or the explicit
    ``segment_capacities`` (in bytes, summing to ``max_num_bytes``). Segment ``i`` starts at
    ``segment_offsets[i]``: the previous segment's end rounded up to
    :data:`SEGMENT_ALIGNMENT` (256) bytes, so every segment view imports zero-copy into any
    framework (capacities that are multiples of 256 leave no gaps).

    Invariants kept between calls:

    * ``base_ptr`` never changes until :meth:`free`; views stay valid across grows.
    * each segment's committed size only grows (until :meth:`release_physical`), never
      beyond its capacity, and its prefix is backed by mapped, accessible memory;
    * committed memory is tracked as sorted runs of granules, so the cost of a grow does
      not depend on how much is already committed;
    * a failed call (bad input or a driver error) leaves sizes and mappings as they were:
      chunks a failing grow created are unmapped and released again.

    Ownership: the memory (a :class:`~jaxbuf._reservation.VirtualBuffer`) is held by this
    handle and by every export of it (DLPack capsules, ``to_numpy``/``to_torch``/``to_jax``
    arrays); :attr:`live_exports` counts those. :meth:`free` means "I am done" (see there);
    :meth:`release_physical` is the one operation that invalidates live arrays.

    Not thread-safe: callers serialize mutation (resizes, release, free). Not copyable or
    picklable (``TypeError``): share it with :mod:`jaxbuf.sharing`.

    Parameters
    ----------
    max_num_bytes : int
        Bytes of address space to reserve (rounded up to the granule).
    device : str, int, torch.device, jax.Device or Device, optional
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ... Default: :func:`jaxbuf.devices.default_device`.
    num_segments : int
        Number of equal segments; must divide ``max_num_bytes``.
    segment_capacities : sequence of int, optional
        Explicit positive segment sizes summing to ``max_num_bytes``.
    driver : VmmDriver, optional
        Default: ``jaxbuf.drivers.get_vmm_driver(device)``.
    peer_devices : device spec or sequence of them, optional
        Other devices of the same platform granted read/write access to every committed
        run (now and after each grow); see :meth:`grant_access`. Each must exist, differ
        from ``device`` and be able to access it (CUDA: ``cuDeviceCanAccessPeer``).

    Examples
    --------
    >>> import jaxbuf
    >>> buf = jaxbuf.ExtensibleTensor(8 << 20, device="cpu", num_segments=2)
    >>> buf.resize_per_segment_(1024, zero_new=True)
    >>> buf.segment_view(1).nbytes
    1024
    >>> ptr = buf.base_ptr
    >>> buf.resize_segments_([4096, 2048])
    >>> buf.base_ptr == ptr, buf.num_bytes
    (True, 6144)
    >>> buf.free()
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: DeviceLike | None = None,
        num_segments: int = 1,
        segment_capacities: Sequence[int] | None = None,
        driver: VmmDriver | None = None,
        peer_devices: Any = (),
    ) -> None:
        self._buffer: _VirtualBuffer | None = None
        self._peer_devices: tuple[Device, ...] = ()
        self._ready_event: Any = None
        # Validate everything before the first driver call.
        max_num_bytes = _as_size(max_num_bytes, "max_num_bytes")
        if max_num_bytes >= _MAX_BYTES:
            raise ValueError(
                f"max_num_bytes must be below 2**63 - 2 MiB = {_MAX_BYTES} (the reservation, "
                f"rounded up to the 2 MiB granule, must fit DLPack's int64 shapes), got "
                f"{max_num_bytes}"
            )
        capacities = _segment_capacities(max_num_bytes, num_segments, segment_capacities)
        offsets, extent = _aligned_offsets(capacities)
        if extent >= _MAX_BYTES:
            raise ValueError(
                f"the segments, each starting at a multiple of {SEGMENT_ALIGNMENT} bytes, "
                f"span {extent} bytes: that must be below 2**63 - 2 MiB = {_MAX_BYTES}"
            )
        peers = parse_peer_specs(peer_devices, None)
        self._device, self._driver = resolve(device, driver)
        check_peers(peers, self._device, self._driver)

        self._max_num_bytes = max_num_bytes
        self._segment_capacities = capacities
        self._segment_offsets = offsets
        self._extent = extent
        self._committed = [0] * len(capacities)
        buffer = _VirtualBuffer(
            extent,
            self._device.index,
            self._driver,
            commit_granule(self._driver, self._device.index),
        )
        if peers:
            # Nothing is committed yet: this only records the peers for later commits.
            buffer.grant_access(tuple(peer.index for peer in peers))
            self._peer_devices = tuple(peers)
        # Reported after free() too, as before the ownership model.
        self._capacity_bytes, self._granularity = buffer.reserved_size, buffer.granularity
        self._buffer = buffer
        self._lifetime = Lifetime(buffer)

    # -- the owner contract (jaxbuf._owner.MemoryOwner): the export hot path ------------
    def check_exportable(self) -> None:
        """:class:`~jaxbuf.ClosedError` once :meth:`free` was called (no new views or exports)."""
        if self._lifetime.anchor is None:
            raise ClosedError("ExtensibleTensor")

    @property
    def export_anchor(self) -> Any:
        """The :class:`~jaxbuf._capsule.ExportAnchor` every export holds: it keeps the virtual
        buffer (the reservation and its chunks, not this handle) alive and counts the exports.
        The handle has no ``__del__``, so a handle in a reference cycle with its own arrays
        (torch tensors and numpy arrays, invisible to the cycle collector through their
        capsules) is still collected; the memory goes with the last of them."""
        return self._lifetime.anchor

    @property
    def live_exports(self) -> int:
        """Framework arrays (DLPack capsules, ``to_numpy`` arrays) alive over this memory,
        also after :meth:`free`."""
        return self._lifetime.live_exports

    @property
    def released(self) -> bool:
        """Whether the memory has been given back: after :meth:`free`, at once or when the
        last export was dropped."""
        return self._lifetime.released

    def _live_buffer(self) -> _VirtualBuffer:
        if self._lifetime.anchor is None:
            raise ClosedError("ExtensibleTensor")
        return self._buffer  # type: ignore[return-value]  # set while the lifetime is open

    def _live_base_ptr(self) -> int:
        return self._live_buffer().base_ptr

    # -- views ----------------------------------------------------------------------
    def full_view(self) -> BufferView:
        """Uint8 view spanning every segment, committed or not.

        What may be touched: the committed prefix of each segment (:attr:`committed_sizes`,
        from :attr:`segment_offsets`), read and written. Beyond it, on the CPU driver,
        reading gives zeros (in debug mode, ``JAXBUF_DEBUG=1``, it faults) and writing faults
        (``SIGSEGV``); on CUDA any access faults the context. A copy
        (``__dlpack__(copy=True)``, ``np.from_dlpack(view, copy=True)``) reads only committed
        bytes and holds zeros elsewhere, on every platform; printing a framework array of this
        view on the CPU shows those zeros (without debug mode).
        """
        return self._view(0, self._extent)

    # -- growing --------------------------------------------------------------------
    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> None:
        """Grow every segment's committed prefix to ``bytes_per_segment``."""
        size = bytes_per_segment
        if type(size) is not int or size < 0:  # exact ints, the hot path, skip the checks
            size = _as_size(size, "bytes_per_segment")
        self._grow([size] * self.num_segments, zero_new)

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Grow each segment's committed prefix to ``sizes[i]`` bytes.

        Grow-only. With ``zero_new`` only the newly committed bytes are zeroed (on the
        driver's producer stream; a view's ``__dlpack__(stream=...)`` orders the
        consumer after it). All sizes are validated before anything is committed.

        On a driver error the sizes stay as they were. A failure while committing
        unmaps and releases every chunk this call created; a failure while zeroing
        leaves the new memory committed (mapped and accessible) but unclaimed, so a
        retry only zeroes.
        """
        self._grow(_as_size_list(sizes, "sizes"), zero_new)

    def _grow(self, new_sizes: list[int], zero_new: bool) -> None:
        """:meth:`resize_segments_` once ``new_sizes`` are known to be non-negative ints."""
        if not isinstance(zero_new, bool):  # "no" is truthy: never guess what was meant
            raise TypeError(f"zero_new must be a bool, got {zero_new!r}")
        if len(new_sizes) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(new_sizes)}")
        for old, new, capacity in zip(self._committed, new_sizes, self._segment_capacities):
            if new < old:
                raise ValueError(
                    f"ExtensibleTensor is grow-only: cannot resize from {old} "
                    f"to {new} bytes per segment"
                )
            if new > capacity:
                raise ValueError(
                    f"requested {new} bytes per segment exceeds the segment capacity {capacity}"
                )
        buffer = self._live_buffer()
        grown = [
            (start + old, start + new)
            for start, old, new in zip(self._segment_offsets, self._committed, new_sizes)
            if new > old
        ]
        if not grown:
            return
        buffer.ensure_committed_ranges(grown)
        if zero_new:
            driver, index = self._driver, self._device.index
            # The zeroing writes the memory for seconds at a time (512 MiB): an export held
            # meanwhile keeps it mapped should another thread free() (callers serialize, but
            # a race must end in an error, never a signal).
            # The base class's view, not full_view(): a subclass (the torch and JAX faces)
            # returns a framework array from full_view().
            held = self._view(0, self._extent).held_export()
            try:
                for start, end in grown:
                    driver.memset(buffer.base_ptr + start, 0, end - start, index)
                with deferred_interrupts():  # recorded as it is made: no event left untracked
                    self._set_ready_event(driver.record_ready_event(index))
            except BaseException as error:
                # Memsets already issued would have no event ordering them before later
                # consumers (a grow without zeroing records none): let them finish here.
                attempt(error, "synchronizing after the failed zeroing", driver.synchronize, index)
                raise
            finally:
                del held
        self._committed = new_sizes

    # -- peer access ----------------------------------------------------------------
    def grant_access(self, devices: Any) -> None:
        """Grant other devices (one spec or a sequence) read/write access to every
        committed run, and to every run committed later.

        Devices that are already peers are skipped. All devices are validated before any
        grant (same platform, not the owner, existing, peer-capable). On a driver failure
        :attr:`peer_devices` is unchanged (runs granted before the failure stay readable
        by the new devices; later grows do not grant them).
        """
        parsed = parse_peer_specs(devices, self._device.platform)
        new = [peer for peer in parsed if peer not in self._peer_devices]
        check_peers(new, self._device, self._driver)
        buffer = self._live_buffer()
        if not new:
            return
        buffer.grant_access(tuple(peer.index for peer in new))
        self._peer_devices = self._peer_devices + tuple(new)

    @property
    def peer_devices(self) -> tuple[Device, ...]:
        """Devices other than :attr:`device` granted access (in the order granted)."""
        return self._peer_devices

    def __del__(self, _release: Any = release_when_collected) -> None:
        # A tensor collected unfreed (its creator interrupted before handing it out): its
        # memory frees itself (the reservation's own finalizer); the ready event is ours.
        event = getattr(self, "_ready_event", None)
        if event is not None:
            self._ready_event, driver = None, self._driver
            _release(lambda: driver.destroy_event(event), "a ready event", driver=driver)

    def _set_ready_event(self, event: Any) -> None:
        with deferred_interrupts():  # swapped and the old one destroyed as one step
            previous, self._ready_event = self._ready_event, event
            if previous is not None:
                driver = self._driver  # a failed destroy is retried, the event never leaked
                release_or_retry_later(lambda: driver.destroy_event(previous), "an event", driver)

    # -- registrations that follow the memory ----------------------------------------
    def add_mapping_listener(self, listener: MappingListener) -> None:
        """Attach a registration that follows the memory (a
        :class:`~jaxbuf._reservation.MappingListener`): it is told ``mapped(chunks)`` of the
        chunks mapped now and after every grow, recommit and defragment, and
        ``unmapping(chunks)`` before :meth:`release_physical`, :meth:`defragment` or
        :meth:`free` unmaps any (raising there refuses the operation, before it changes
        anything). Chunks are ``(offset, size)`` from :attr:`base_ptr`. With no listener
        attached the grow path costs what it did.
        """
        self._live_buffer().add_mapping_listener(listener)

    def remove_mapping_listener(self, listener: MappingListener) -> None:
        """Detach ``listener`` (told ``unmapping`` of the chunks mapped now). After
        :meth:`free` every listener is detached already: then this does nothing."""
        if self._lifetime.anchor is None:
            return
        self._live_buffer().remove_mapping_listener(listener)

    def mapped_chunks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every driver allocation mapped now, by offset."""
        return self._live_buffer().mapped_chunks()

    # -- releasing ------------------------------------------------------------------
    def release_physical(self) -> None:
        """Drop all physical pages but keep the reservation and its views.

        Waits first for the frameworks' pending work (:func:`jaxbuf.interop.quiesce`), as
        :meth:`free` does, then for the device. Every committed size becomes 0. The one
        operation that invalidates live arrays: they keep their address; until a grow, on the
        CPU reading them gives zeros (in debug mode, ``JAXBUF_DEBUG=1``, it faults) and
        writing faults (``SIGSEGV``), on CUDA any access faults. After a grow they work
        (fresh CPU memory reads zeros; CUDA memory is undefined without ``zero_new``).

        A mapping listener (:meth:`add_mapping_listener`) that refuses raises here with
        nothing changed; a driver failure while releasing still drops the sizes.
        """
        buffer = self._live_buffer()
        # A registration that refuses (a transfer in flight) refuses before anything
        # changes, so the sizes stand; a driver failure after that drops them (see above).
        buffer.tell_unmapping()
        interop.quiesce(self._device)  # JAX's dispatched work may still read the pages
        try:
            buffer.release_physical(listeners_told=True)
        finally:
            self._committed = [0] * self.num_segments

    def free(self) -> None:
        """Say "I am done": no new views or exports; the memory goes with the last export.

        Without live exports the memory is released now: first the frameworks that may still
        run work on it are waited for (:func:`jaxbuf.interop.quiesce`: JAX's pending
        computations, torch's CUDA device), then the devices with access are synchronized
        and everything is unmapped and freed. With live exports (:attr:`live_exports`) this
        handle lets go of the memory and the last export releases it (synchronizing the
        devices first, but not the frameworks: see below). Afterwards every method that
        needs the memory raises ``RuntimeError``, views taken earlier raise at
        ``__dlpack__`` / ``to_*``, the sizes and :attr:`base_ptr` read 0, and
        :attr:`released` tells when the memory is gone.

        JAX gives an imported array's memory back early when the array is donated
        (``jax.jit(..., donate_argnums=...)``): the export ends at dispatch, while the step
        may still be reading. Call ``free()`` after such a step (it waits for JAX), not
        before it. On the CPU driver a stale raw pointer faults (``SIGSEGV``) rather than
        reading another allocation: the freed range stays reserved ``PROT_NONE`` in the
        driver's bounded quarantine (see :class:`~jaxbuf.drivers.host.HostVmmDriver`).

        Safe to call more than once. A driver failure while releasing propagates; the
        committed sizes are 0 already (a failed release may have unmapped some chunks) and
        calling ``free()`` again finishes the release.
        """
        buffer = self._buffer
        if buffer is None:
            return
        buffer._check_not_telling("free")  # from a listener: refused before anything changes
        if not self._lifetime.closed:
            # "I am done" ends every registration now, even while exports keep the memory
            # mapped; a refusal (a transfer in flight) propagates before anything changes.
            buffer.remove_all_mapping_listeners()
        try:
            if self._lifetime.closed:
                # A release that failed before: retry it. Unless exports hold the memory: a
                # free() interrupted after the close left it to them, the last one releases it.
                if not self._lifetime.live_exports:
                    self._release_now(buffer)
            else:
                self._lifetime.close(self._release_now)
        finally:
            # After the close, never before: a copy export on another thread that read the
            # sizes before the close then sees it (and refuses), instead of copying zeros.
            self._committed = [0] * self.num_segments
        # The ready event goes first: a free() an interrupt cuts short here is retried whole.
        self._set_ready_event(None)
        # Released, or left to the exports (the anchor holds the buffer; its __del__ runs
        # when the last export goes): either way this handle holds it no more, nor the
        # views it kept.
        self._buffer = None
        self._views = None

    close = free

    def _release_now(self, buffer: _VirtualBuffer) -> None:
        interop.quiesce(self._device)
        buffer.release()

    def __enter__(self) -> ExtensibleTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    __reduce_ex__ = __copy__ = __deepcopy__ = _refuse_copy

    # -- properties -----------------------------------------------------------------
    @property
    def bytes_per_segment(self) -> int:
        """Committed prefix size of each segment (ValueError when they differ)."""
        return self._uniform(self._committed)

    @property
    def segment_capacity_bytes(self) -> int:
        """Maximum size of each segment (ValueError when they differ)."""
        return self._uniform(self._segment_capacities)

    @staticmethod
    def _uniform(values: list[int]) -> int:
        if any(v != values[0] for v in values):
            raise ValueError(f"segments differ: {values}")
        return values[0]

    @property
    def capacity_bytes(self) -> int:
        """Reserved bytes: the segments (with their alignment gaps, none when capacities are
        multiples of 256) rounded up to the granule."""
        return self._capacity_bytes

    @property
    def physical_bytes(self) -> int:
        """Physically mapped bytes, including granule rounding (0 once freed)."""
        return 0 if self._buffer is None else self._buffer.physical_bytes

    @property
    def num_physical_chunks(self) -> int:
        """Number of driver allocations currently mapped into the reservation."""
        return 0 if self._buffer is None else self._buffer.num_chunks

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """Whether each segment's first ``sizes[i]`` bytes lie within a single driver
        allocation, as RDMA registration of the segment requires."""
        checked = _as_size_list(sizes, "sizes")
        if len(checked) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(checked)}")
        for i, (size, capacity) in enumerate(zip(checked, self._segment_capacities)):
            if size > capacity:
                raise ValueError(f"sizes[{i}] = {size} exceeds the segment capacity {capacity}")
        buffer = self._live_buffer()
        return [
            buffer.chunk_containing(offset, size)
            for offset, size in zip(self._segment_offsets, checked)
        ]

    def defragment(self) -> list[int]:
        """Remap each segment's committed prefix as **one** driver allocation, keeping its
        bytes and :attr:`base_ptr`, as RDMA registration requires (UCX, ibverbs with
        dma-buf and GPUDirect register one allocation, not a region spanning several).

        Afterwards ``segments_backed_by_one_chunk(committed_sizes)`` is True for every
        committed segment. Returns the indices of the segments that were remapped (those
        already in one chunk, or empty, are skipped). Views stay valid; the device is
        synchronized first, and the call must not race consumers' kernels on the buffer.

        Rule: a granule (:attr:`granularity`) is never split between chunks, so two
        committed segments sharing a granule (a boundary that is not a granule multiple)
        cannot each be one chunk: ValueError names them, before anything changes. Later
        grows of a segment add chunks again; call ``defragment`` after the last grow.

        Failure semantics: segment by segment. A driver failure rolls the failing segment
        back (old chunks, bytes and access restored) and propagates; segments remapped
        before it stay remapped. Peak extra memory is one segment's committed size.
        """
        buffer = self._live_buffer()
        return defragment_segments(buffer, self._segment_offsets, self._committed)

    @property
    def granularity(self) -> int:
        """Commit granule in bytes (see :func:`granule_size`)."""
        return self._granularity

    @property
    def base_ptr(self) -> int:
        """Address of the reservation (0 once freed)."""
        return 0 if self._buffer is None else self._buffer.base_ptr

    def __repr__(self) -> str:
        lifetime = getattr(self, "_lifetime", None)
        if self._buffer is not None:
            state = "open"
        elif lifetime is None or lifetime.released:
            state = "freed"
        else:
            state = f"freed, {lifetime.live_exports} live export(s)"
        return (
            f"ExtensibleTensor(device={self._device}, dtype=uint8, "
            f"shape=({self._max_num_bytes},), committed={self._committed}, "
            f"nbytes={sum(self._committed)}, physical_bytes={self.physical_bytes}, {state})"
        )
