"""The KV cache as an engine holds it: one :class:`~jaxbuf.ExtensibleTensor` per KV-cache
tensor, committed together in blocks (:class:`ExtensibleKVCacheBuffers`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from .._checks import as_count, as_int, as_shape
from .._errors import Cleanup, ClosedError
from ..devices import Device
from ..dtypes import DTypeLike, canonical_dtype
from ..extensible import ExtensibleTensor
from ..views import BufferView

__all__ = ["ExtensibleKVCacheBuffers"]

_logger = logging.getLogger("jaxbuf.kv")


def _check_entries(buffers: Any, capacity: int) -> list[tuple[ExtensibleTensor, int]]:
    """``buffers`` as a list of ``(ExtensibleTensor, bytes_per_block_per_segment)``, each
    segment able to hold ``capacity`` blocks; TypeError / ValueError naming the bad entry."""
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Sequence):
        raise TypeError(
            "buffers must be a sequence of (ExtensibleTensor, bytes_per_block_per_segment) "
            f"pairs, got {buffers!r}"
        )
    entries: list[tuple[ExtensibleTensor, int]] = []
    for i, entry in enumerate(buffers):
        if not isinstance(entry, Sequence) or len(entry) != 2:
            raise TypeError(f"buffers[{i}] must be a (tensor, bytes_per_block) pair, got {entry!r}")
        tensor, block_bytes = entry
        if not isinstance(tensor, ExtensibleTensor):
            raise TypeError(f"buffers[{i}][0] must be an ExtensibleTensor, got {tensor!r}")
        block_bytes = as_count(block_bytes, f"buffers[{i}] bytes_per_block_per_segment")
        tensor.check_exportable()  # ClosedError for a freed tensor
        smallest = min(tensor.segment_capacities)
        if capacity * block_bytes > smallest:
            raise ValueError(
                f"buffers[{i}]: {capacity} blocks of {block_bytes} bytes per segment need "
                f"{capacity * block_bytes} bytes, but a segment holds {smallest}"
            )
        if any(tensor is other for other, _ in entries):
            raise ValueError(f"buffers[{i}] repeats a tensor already in the list")
        if entries and tensor.device != entries[0][0].device:
            raise ValueError(
                f"buffers[{i}] is on {tensor.device}, buffers[0] on {entries[0][0].device}: "
                "one KV cache lives on one device"
            )
        entries.append((tensor, block_bytes))
    return entries


class ExtensibleKVCacheBuffers:
    """Grow-only physical backing of a KV cache: one :class:`~jaxbuf.ExtensibleTensor` per
    KV-cache tensor, each segment committed as a prefix of whole blocks, all in lockstep.

    ``buffers`` lists ``(tensor, bytes_per_block_per_segment)``: block ``b`` of segment ``s``
    of a tensor lies at ``segment_offsets[s] + b * bytes_per_block_per_segment``, where it
    stays. Layouts whose block dimension is outermost have one segment per tensor; a
    layer-compact layout has one per layer.

    Invariants kept between calls:

    * every segment of every tensor has at least :attr:`num_blocks_committed` blocks
      committed (mapped, readable and writable), at most :attr:`num_blocks_capacity`;
    * a commit zeroes only the blocks it adds; blocks committed before keep their bytes, and
      every pointer and view (taken over the full capacity) stays valid across commits;
    * a request at or below the committed count changes nothing, ``defragment`` or not;
    * bad input raises (``TypeError`` / ``ValueError`` naming it) before anything changes.
      A driver failure part way through a commit leaves :attr:`num_blocks_committed` as it
      was (tensors grown before the failure keep their zeroed blocks; a retry continues).

    Not thread-safe: one thread commits, releases and frees. Not picklable or copyable.
    """

    def __init__(self, buffers: Sequence[tuple[ExtensibleTensor, int]], num_blocks_capacity: int):
        capacity = as_count(num_blocks_capacity, "num_blocks_capacity")
        self.buffers: list[tuple[ExtensibleTensor, int]] = _check_entries(buffers, capacity)
        self.num_blocks_capacity = capacity
        self._committed = self._blocks_held(0)
        self._to_recommit = 0
        self._freed = False

    def _blocks_held(self, default: int) -> int:
        """Whole blocks every segment of every tensor has committed (``default`` for none)."""
        return min(
            (min(t.committed_sizes) // block_bytes for t, block_bytes in self.buffers),
            default=default,
        )

    def _check_open(self) -> None:
        if self._freed:
            raise ClosedError("ExtensibleKVCacheBuffers")

    def _check_count(self, num_blocks: Any) -> int:
        n = as_int(num_blocks, "num_blocks")
        if not 0 <= n <= self.num_blocks_capacity:
            raise ValueError(
                f"num_blocks must be in 0..{self.num_blocks_capacity} (num_blocks_capacity), "
                f"got {n}"
            )
        return n

    # -- growing --------------------------------------------------------------------------
    def commit(self, num_blocks: int, defragment: bool = False) -> None:
        """Grow the committed prefix of every segment to ``num_blocks`` blocks, zeroing only
        the new ones.

        A request at or below :attr:`num_blocks_committed` returns without touching the
        mapping, ``defragment`` included: an engine re-running warmup while the cache holds
        live data must not lose it. With ``defragment=True`` a real grow first releases every
        physical chunk, so each segment's prefix is mapped again as one driver allocation,
        as RDMA registration needs; the existing blocks are then **discarded** (zeroed), so
        this is for before real KV data exists (right after warmup). ValueError, before
        anything changes, when two segments' prefixes would share a granule (they cannot be
        one allocation each).
        """
        n = self._check_count(num_blocks)
        if not isinstance(defragment, bool):
            raise TypeError(f"defragment must be a bool, got {defragment!r}")
        self._check_open()
        if n <= self._committed:
            return
        if defragment:
            self._check_defragmentable(n)
            if self.physical_bytes:
                self._release()
        try:
            for tensor, block_bytes in self.buffers:
                target = n * block_bytes
                # Never below a segment's size: grow-only, and a tensor grown by an earlier
                # failed commit already holds (zeroed) blocks of this one.
                sizes = [max(size, target) for size in tensor.committed_sizes]
                tensor.resize_segments_(sizes, zero_new=True)
        except BaseException:
            self._committed = self._blocks_held(self._committed)
            raise
        self._committed = n

    def _check_defragmentable(self, num_blocks: int) -> None:
        """ValueError when two segments' first ``num_blocks`` blocks share a granule."""
        for i, (tensor, block_bytes) in enumerate(self.buffers):
            granule, size, previous_end = tensor.granularity, num_blocks * block_bytes, 0
            for s, offset in enumerate(tensor.segment_offsets):
                first = offset // granule * granule
                if s and previous_end > first:
                    raise ValueError(
                        f"cannot defragment buffers[{i}]: segments {s - 1} and {s} would share "
                        f"the granule at byte offset {first} (granularity {granule}) with "
                        f"{num_blocks} blocks of {block_bytes} bytes committed; each segment "
                        "can be one allocation only when no granule holds two segments' blocks"
                    )
                previous_end = -(-(offset + size) // granule) * granule

    def ensure_blocks(self, num_blocks: int) -> None:
        """Commit at least ``num_blocks`` blocks, capped at :attr:`num_blocks_capacity`
        (warmup writes a prefix of real block ids, which may exceed what is committed)."""
        n = as_int(num_blocks, "num_blocks")
        if n < 0:
            raise ValueError(f"num_blocks must be non-negative, got {n}")
        self.commit(min(n, self.num_blocks_capacity))

    def extend(self, num_blocks: int, defragment: bool = False) -> None:
        """Grow to ``num_blocks`` blocks once the memory left after warmup is known: a
        :meth:`commit`. No view needs rebuilding: each block stays at its offset."""
        self.commit(num_blocks, defragment=defragment)
        _logger.info("Extended KV cache to %d blocks.", self._committed)

    # -- sleeping -------------------------------------------------------------------------
    def _release(self) -> None:
        try:
            for tensor, _ in self.buffers:
                tensor.release_physical()  # a refusing registration raises before it changes
        finally:
            self._committed = self._blocks_held(0)

    def release_physical(self) -> None:
        """Discard all physical memory (sleep): pointers and views stay valid, the data is
        gone, and :attr:`num_blocks_committed` becomes 0. :meth:`recommit` maps the count
        committed before (a second release keeps that count). A mapping listener that
        refuses (a transfer in flight) raises; tensors released before it stay released."""
        self._check_open()
        if self._committed:
            self._to_recommit = self._committed
        self._release()

    def recommit(self) -> None:
        """Commit the block count of the last :meth:`release_physical` again, zeroed."""
        self.commit(self._to_recommit)

    def free(self) -> None:
        """Free every tensor (each keeps its memory while arrays over it live; see
        :meth:`ExtensibleTensor.free`). Safe to call twice; a failure is retried by the next
        call."""
        cleanup = Cleanup("ExtensibleKVCacheBuffers.free")
        for tensor, _ in self.buffers:
            cleanup.run(tensor.free)
        self._freed = True
        self._committed = 0
        cleanup.raise_first()
        self.buffers = []

    def __enter__(self) -> ExtensibleKVCacheBuffers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "ExtensibleKVCacheBuffers cannot be pickled or copied: its tensors own device "
            "memory; share a tensor with jaxbuf.sharing.send_buffer instead"
        )

    __copy__ = __deepcopy__ = __reduce_ex__

    # -- state ----------------------------------------------------------------------------
    @property
    def num_blocks_committed(self) -> int:
        """Blocks every segment holds, mapped and readable (0 after a release or free)."""
        return self._committed

    @property
    def physical_bytes(self) -> int:
        """Physical memory mapped, summed over the tensors (granule-rounded per segment)."""
        return sum(tensor.physical_bytes for tensor, _ in self.buffers)

    @property
    def bytes_per_block_per_segment(self) -> list[int]:
        """Each tensor's block size in one segment (a transfer layout's ``block_bytes``)."""
        return [block_bytes for _, block_bytes in self.buffers]

    @property
    def tensors(self) -> list[ExtensibleTensor]:
        """The tensors, in the order of :attr:`buffers`."""
        return [tensor for tensor, _ in self.buffers]

    @property
    def device(self) -> Device | None:
        """The first tensor's device (None without tensors)."""
        return self.buffers[0][0].device if self.buffers else None

    @property
    def freed(self) -> bool:
        return self._freed

    def __len__(self) -> int:
        return len(self.buffers)

    def __repr__(self) -> str:
        state = "freed" if self._freed else "open"
        return (
            f"ExtensibleKVCacheBuffers({len(self.buffers)} tensor(s), "
            f"num_blocks_committed={self._committed}, "
            f"num_blocks_capacity={self.num_blocks_capacity}, "
            f"physical_bytes={self.physical_bytes}, {state})"
        )

    # -- views ----------------------------------------------------------------------------
    def full_view(self, index: int) -> BufferView:
        """Uint8 view of tensor ``index``'s whole reservation (what the builder's ``reserve``
        returned): committed blocks may be touched, the rest may not (see
        :meth:`ExtensibleTensor.full_view`)."""
        self._check_open()
        # The neutral method: a face's tensor (jaxbuf.torch) returns framework arrays.
        return ExtensibleTensor.full_view(self._entry(index)[0])

    def segment_views(
        self,
        index: int,
        num_blocks: int | None = None,
        dtype: DTypeLike | None = None,
        block_shape: Any = None,
    ) -> list[BufferView]:
        """Views of the first ``num_blocks`` blocks (default: the capacity) of each segment of
        tensor ``index``: uint8 bytes, or ``dtype`` in shape ``(num_blocks, *block_shape)``
        (``block_shape`` default: one dimension, the block's elements).

        Over the capacity, the views never change as the cache grows: one framework array per
        segment, imported once, serves every step (only committed blocks may be touched)."""
        self._check_open()
        tensor, block_bytes = self._entry(index)
        n = self.num_blocks_capacity if num_blocks is None else self._check_count(num_blocks)
        shape, element = _block_shape(block_bytes, dtype, block_shape)
        base = ExtensibleTensor.full_view(tensor)  # neutral, as in full_view
        return [
            BufferView(
                base.ptr + offset,
                n * block_bytes,
                element,
                (n, *shape),
                base.device,
                base.owner,
                base.dlpack_device_type,
            )
            for offset in tensor.segment_offsets
        ]

    def committed_views(
        self, index: int, dtype: DTypeLike | None = None, block_shape: Any = None
    ) -> list[BufferView]:
        """:meth:`segment_views` trimmed to the committed blocks: what a connector registers
        (every byte mapped)."""
        return self.segment_views(index, self._committed, dtype, block_shape)

    def layer_views(
        self, dtype: DTypeLike | None = None, block_shape: Any = None, num_blocks: int | None = None
    ) -> list[BufferView]:
        """:meth:`segment_views` of every tensor, in order: one view per layer in a
        layer-compact layout; one per tensor, its layers inside each block (in
        ``block_shape``), where blocks are outermost."""
        return [
            view
            for index in range(len(self.buffers))
            for view in self.segment_views(index, num_blocks, dtype, block_shape)
        ]

    def _entry(self, index: Any) -> tuple[ExtensibleTensor, int]:
        i = as_int(index, "index")
        if not 0 <= i < len(self.buffers):
            raise IndexError(f"buffer index {index!r} out of range for {len(self.buffers)}")
        return self.buffers[i]


def _block_shape(block_bytes: int, dtype: Any, block_shape: Any) -> tuple[tuple[int, ...], Any]:
    """``(block shape, element dtype)`` of one block of ``block_bytes``; ValueError when the
    shape does not fill the block exactly."""
    element = canonical_dtype("uint8" if dtype is None else dtype)
    if block_shape is None:
        if block_bytes % element.itemsize:
            raise ValueError(f"a block of {block_bytes} bytes is not a whole number of {element}")
        return (block_bytes // element.itemsize,), element
    shape = as_shape(block_shape, "block_shape")
    if math.prod(shape) * element.itemsize != block_bytes:
        raise ValueError(
            f"block_shape {shape} of {element} is {math.prod(shape) * element.itemsize} "
            f"bytes, not the block's {block_bytes}"
        )
    return shape, element
