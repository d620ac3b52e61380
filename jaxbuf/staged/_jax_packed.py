"""The JAX wing's packed layout: :class:`PackedWrites`, its buckets, and packing into it.

A :class:`PackedWrites` is every write of one step for one 2-D array in one int32 buffer (a JAX
pytree whose only leaf is that buffer, so a jitted apply costs one host-to-device transfer, or
none from a :class:`~jaxbuf.jax_ops.PackRing` slot). Its shapes are bucketed (write count and
content length rounded up to powers of two, at least :data:`MIN_BUCKET`), so a steady loop
reuses one compiled step.

Packing into this layout is :mod:`jaxbuf.staged._jax_pack`.

Nothing here imports JAX at module level (the pytree registration and the device-side bitcast
import it when first used).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._host import c_expand_elements

__all__ = [
    "DROPPED_INDEX",
    "MIN_BUCKET",
    "PALLAS_BLOCK_SIZE",
    "PackedWrites",
    "bucket_size",
]


MIN_BUCKET = 16
# Elements one Pallas program copies per step. ``values`` carries this much padding past its
# bucket so a block read that starts inside the contents never leaves the array.
PALLAS_BLOCK_SIZE = 128
#: A row or column out of range for any array: the scatter drops it (padding).
DROPPED_INDEX = np.iinfo(np.int32).max


class PackedWrites:
    """Writes for one 2-D array, padded to buckets, in ONE contiguous int32 buffer (a JAX pytree
    whose only leaf is that buffer, so a jitted apply costs one host-to-device transfer).

    Write ``i`` sets ``array[rows[i], starts[i] : starts[i] + lengths[i]]`` to
    ``values[offsets[i] : offsets[i] + lengths[i]]``. Invariants: the writes are pairwise
    disjoint; ``offsets`` is non-decreasing and the contents are packed back to back in write
    order; padding writes have length 0 and offset equal to the total content length; padding
    values are zero; ``values`` has length ``bucket_size(total) + PALLAS_BLOCK_SIZE``.

    Layout of :attr:`buffer` (1-D int32), ``W`` = :attr:`num_writes`: ``rows``, ``starts``,
    ``lengths``, ``offsets`` at ``[0, W)``, ``[W, 2W)``, ``[2W, 3W)``, ``[3W, 4W)``; then the
    values' bytes from int32 index ``4W`` (byte ``16W``: aligned for every dtype), zero-padded
    to a whole int32; then, when :attr:`expanded`, :attr:`element_rows` and
    :attr:`element_cols`, ``num_values`` int32 each: every value's target row and column
    (``2**31 - 1`` for padding: dropped), so the scatter apply is exactly the scatter a JAX
    user writes, with nothing to compute on the device first. Unexpanded packs (a GPU
    :class:`~jaxbuf.jax_ops.PackRing`'s, by default) leave them out, and the
    scatter computes them on the device from the write columns: the host writes, and the
    device reads across the bus, less than half the bytes; when every write has one length
    (:attr:`uniform`), by a division instead of a search. :attr:`num_writes`,
    :attr:`num_values`, :attr:`dtype`, :attr:`expanded` and :attr:`uniform` are the pytree's
    static data (with :attr:`shape`), so ``jit`` traces once per bucket and layout.

    The five fields are properties slicing the buffer: numpy views on the host (no copy); JAX
    slices and bitcasts (``lax.bitcast_convert_type``) when the buffer is a JAX array, e.g.
    inside ``jit``. As with the NamedTuple this class replaces, iterating or indexing a
    ``PackedWrites`` gives the fields in that order, and ``PackedWrites(rows, starts, lengths,
    offsets, values)`` builds one from host columns (copied into a new buffer).
    """

    __slots__ = (
        "_buffer",
        "_num_writes",
        "_num_values",
        "_dtype",
        "_expanded",
        "_uniform",
        "_shape",
    )
    _fields = ("rows", "starts", "lengths", "offsets", "values")

    def __init__(self, rows: Any, starts: Any, lengths: Any, offsets: Any, values: Any) -> None:
        columns = [np.asarray(c) for c in (rows, starts, lengths, offsets)]
        values = np.asarray(values)
        for name, column in zip(self._fields, columns):
            if column.ndim != 1 or column.shape[0] != columns[0].shape[0]:
                shapes = [c.shape for c in columns]
                raise ValueError(
                    f"rows, starts, lengths, offsets must be 1-D of one length, got shapes {shapes}"
                )
            if column.size and column.dtype.kind not in "iu":
                raise TypeError(f"{name} must be integers, got {column.dtype}")
            if column.size and (column.min() < 0 or column.max() > DROPPED_INDEX):
                raise ValueError(f"{name} must be in [0, 2**31 - 1], got {column!r}")
        if values.ndim != 1:
            raise ValueError(f"values must be 1-D, got shape {values.shape}")
        packed = allocate(columns[0].shape[0], values.shape[0], values.dtype, True)
        for i, column in enumerate(columns):
            packed._column(i)[:] = column
        packed.values[:] = values
        expand_elements(packed)
        self._set(packed._buffer, packed._num_writes, packed._num_values, packed._dtype, True)

    def _set(
        self,
        buffer: Any,
        num_writes: int,
        num_values: int,
        dtype: np.dtype,
        expanded: bool,
        uniform: bool = False,
        shape: tuple[int, int] | None = None,
    ) -> None:
        self._buffer, self._num_writes = buffer, num_writes
        self._num_values, self._dtype, self._expanded = num_values, dtype, expanded
        self._uniform, self._shape = uniform, shape

    @classmethod
    def from_buffer(
        cls,
        buffer: Any,
        num_writes: int,
        num_values: int,
        dtype: np.dtype,
        expanded: bool = True,
        uniform: bool = False,
        shape: tuple[int, int] | None = None,
    ) -> PackedWrites:
        """A PackedWrites over ``buffer`` as is, laid out as the class docstring says (no
        checks: also a tracer, or the placeholder JAX unflattens with). The packers' and
        :class:`~jaxbuf.jax_ops.PackRing`'s constructor; a user builds one with
        ``StagedWrites.pack`` or :func:`~jaxbuf.jax_ops.pack_writes`."""
        packed = object.__new__(cls)
        packed._set(buffer, num_writes, num_values, dtype, expanded, uniform, shape)
        return packed

    @property
    def buffer(self) -> Any:
        """The one array leaf: a 1-D int32 numpy array (or a JAX array, inside ``jit``)."""
        return self._buffer

    @property
    def num_writes(self) -> int:
        """The write bucket ``W``: the length of each int32 column."""
        return self._num_writes

    @property
    def num_values(self) -> int:
        """The length of :attr:`values` (the content bucket plus ``PALLAS_BLOCK_SIZE``)."""
        return self._num_values

    @property
    def dtype(self) -> np.dtype:
        """The values' (numpy) dtype: the target array's."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, int] | None:
        """The ``(num_rows, row_len)`` the writes were bounds-checked against (static): an
        apply refuses an array smaller than it, which would drop writes. None when unchecked
        (``pack_writes`` without ``shape``, or built from columns)."""
        return self._shape

    @property
    def nbytes(self) -> int:
        """The bytes of :attr:`buffer`: what a jitted apply transfers (or reads in place)."""
        return 4 * packed_words(self._num_writes, self._num_values, self._dtype, self._expanded)

    @property
    def expanded(self) -> bool:
        """Whether the buffer carries :attr:`element_rows` and :attr:`element_cols`."""
        return self._expanded

    @property
    def uniform(self) -> bool:
        """Whether the pack is unexpanded and its writes all have one length ``L > 0`` with
        their values back to back (write ``i``'s at ``i * L``; then padding): the scatter then
        finds each value's write by dividing by ``L`` instead of searching the offsets. Set
        by the packer; static, so alternating uniform and mixed packs trace twice."""
        return self._uniform

    def _column(self, index: int) -> Any:
        w = self._num_writes
        return self._buffer[index * w : (index + 1) * w]

    @property
    def rows(self) -> Any:
        """int32 [num_writes]: each write's row."""
        return self._column(0)

    @property
    def starts(self) -> Any:
        """int32 [num_writes]: each write's first column."""
        return self._column(1)

    @property
    def lengths(self) -> Any:
        """int32 [num_writes]: each write's element count (0 for padding)."""
        return self._column(2)

    @property
    def offsets(self) -> Any:
        """int32 [num_writes]: element offsets of the writes' contents into :attr:`values`."""
        return self._column(3)

    @property
    def values(self) -> Any:
        """:attr:`dtype` [num_values]: the contents back to back, then zeros."""
        words = self._buffer[4 * self._num_writes :]
        if isinstance(words, np.ndarray):
            nbytes = self._num_values * self._dtype.itemsize
            return words.view(np.uint8)[:nbytes].view(self._dtype)
        return _bitcast_words(words, self._dtype, self._num_values)

    def _element_column(self, index: int) -> Any:
        if not self._expanded:
            raise ValueError(
                f"{self!r} carries no element indices (packed unexpanded: the scatter computes "
                "them on the device); pack with expand=True to read them on the host"
            )
        start = 4 * self._num_writes + value_words(self._num_values, self._dtype)
        start += index * self._num_values
        return self._buffer[start : start + self._num_values]

    @property
    def element_rows(self) -> Any:
        """int32 [num_values]: the row each value goes to (``2**31 - 1``: none, dropped)."""
        return self._element_column(0)

    @property
    def element_cols(self) -> Any:
        """int32 [num_values]: the column each value goes to."""
        return self._element_column(1)

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __getitem__(self, index):
        return self.fields[index]

    @property
    def fields(self) -> tuple:
        """``(rows, starts, lengths, offsets, values)``."""
        return (self.rows, self.starts, self.lengths, self.offsets, self.values)

    def __repr__(self) -> str:
        return (
            f"PackedWrites(num_writes={self._num_writes}, num_values={self._num_values}, "
            f"dtype={self._dtype}, shape={self._shape}, expanded={self._expanded}, "
            f"uniform={self._uniform}, buffer={type(self._buffer).__name__})"
        )


def allocate(num_writes: int, num_values: int, dtype: np.dtype, expanded: bool) -> PackedWrites:
    """A PackedWrites over a fresh, uninitialised buffer for these buckets. Fresh each time: a
    buffer handed to ``jit`` may still be in flight to the device, so none is reused."""
    register_pytree()
    words = packed_words(num_writes, num_values, dtype, expanded)
    buffer = np.empty(words, np.int32)
    return PackedWrites.from_buffer(buffer, num_writes, num_values, dtype, expanded)


def value_words(num_values: int, dtype: np.dtype) -> int:
    """The int32 words ``num_values`` values of ``dtype`` take, rounded up."""
    return -(-num_values * dtype.itemsize // 4)


def packed_words(num_writes: int, num_values: int, dtype: np.dtype, expanded: bool) -> int:
    """The int32 length of a PackedWrites buffer for these buckets (see its layout)."""
    elements = 2 * num_values if expanded else 0
    return 4 * num_writes + value_words(num_values, dtype) + elements


def expand_elements(packed: PackedWrites) -> None:
    """Fill a host PackedWrites' element columns from its write columns (see its layout):
    one C loop, or numpy without the extension."""
    columns = (packed.rows, packed.starts, packed.lengths, packed.offsets)
    element_rows, element_cols = packed.element_rows, packed.element_cols
    if c_expand_elements is not None:
        c_expand_elements(*columns, element_rows, element_cols)
        return
    rows, starts, lengths, offsets = (c.astype(np.int64) for c in columns)
    total = int(lengths.sum())
    if np.any(offsets + lengths > element_rows.shape[0]):
        raise ValueError(f"a write falls outside {element_rows.shape[0]} elements")
    within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    at = np.repeat(offsets, lengths) + within
    element_rows[:] = element_cols[:] = DROPPED_INDEX
    element_rows[at] = np.repeat(rows, lengths)
    element_cols[at] = np.minimum(np.repeat(starts, lengths) + within, DROPPED_INDEX)


def uniform_layout(lengths: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether host write columns are :attr:`PackedWrites.uniform`: the first ``n`` writes
    of one length ``L > 0`` at offsets ``0, L, 2L, ...``, the rest padding (length 0)."""
    if not lengths.size or lengths[0] <= 0:
        return False
    length, n = int(lengths[0]), int(np.count_nonzero(lengths))
    return bool(
        (lengths[:n] == length).all()
        and (offsets[:n] == np.arange(0, n * length, length, dtype=offsets.dtype)).all()
    )


def _bitcast_words(words: Any, dtype: np.dtype, count: int) -> Any:
    """The first ``count`` elements of ``dtype`` in the int32 JAX array ``words`` (bits
    reinterpreted, little-endian as on the host)."""
    from jax import lax

    if dtype == np.bool_:  # bitcast_convert_type refuses bool; the host wrote 0 / 1 bytes
        return _bitcast_words(words, np.dtype(np.uint8), count) != 0
    if dtype.kind == "c":  # ... and complex: its real and imaginary parts, interleaved
        parts = _bitcast_words(words, np.dtype(f"f{dtype.itemsize // 2}"), 2 * count)
        return lax.complex(parts[0::2], parts[1::2])
    itemsize = dtype.itemsize
    if itemsize > 4:
        # The value words come first; the count is exact (no padding word for 8-byte items).
        words = lax.slice_in_dim(words, 0, count * itemsize // 4).reshape(-1, itemsize // 4)
    # Narrower types come out with a trailing axis of 4 // itemsize elements per word.
    elements = lax.bitcast_convert_type(words, dtype).reshape(-1)
    return lax.slice_in_dim(elements, 0, count)


_pytree_registered = False


def register_pytree() -> None:
    """Register :class:`PackedWrites` as a JAX pytree node, once, on first use (importing this
    module imports no JAX). Leaf: the buffer; static data: the buckets and dtype (hashable)."""
    global _pytree_registered
    if _pytree_registered:
        return
    _pytree_registered = True  # also without JAX: host-only use needs no registration
    try:
        from jax import tree_util
    except ImportError:
        return
    tree_util.register_pytree_node(
        PackedWrites,
        lambda p: (
            (p._buffer,),
            (p._num_writes, p._num_values, p._dtype, p._expanded, p._uniform, p._shape),
        ),
        lambda aux, leaves: PackedWrites.from_buffer(leaves[0], *aux),
    )


def bucket_size(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= ``n`` and >= ``minimum``."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())
