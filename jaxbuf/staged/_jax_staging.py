"""The JAX launcher of the staged writes: row writes applied to one 2-D array inside ``jit``.

The host stages a step's writes in a :class:`StagedWrites` (the C stager that
:class:`jaxbuf.staged.StagedWriteTensor` uses: no Python loop per write) and packs them into a
:class:`PackedWrites` (one int32 host buffer, so a jitted apply makes one host-to-device
transfer) whose shapes are bucketed (write count and content length rounded up to powers of
two, at least 16), so a steady decode loop reuses one compiled step;
:func:`pack_writes` does both for one batch of lists. Inside ``jit``,
:func:`apply_staged_writes` applies them on a GPU with the Triton staged-write kernel through
``jax_triton`` (:mod:`jaxbuf.kernels.jax_triton_apply`), which aliases the array to its output
(a donated array is updated in place), and elsewhere with an XLA scatter (the deprecated
Pallas-Triton kernel is kept as ``method="pallas"``). Overlapping writes are resolved on the
host as the torch side resolves them (the stager's row index, later writes winning, the earlier
ones trimmed to their visible pieces), so every path sees disjoint writes and its result does not
depend on execution order.

This is the JAX counterpart of :mod:`jaxbuf.kernels.staged_write` (the Triton launcher), and
like it a launcher that imports its framework (JAX, lazily, inside the functions that trace).
``jaxbuf.jax_ops`` re-exports it under its old name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxbuf._checks import as_count, as_int, as_optional_bool
from jaxbuf._staging_host import StagingState, c_expand_elements, convert, pack_record
from jaxbuf.dtypes import canonical_dtype

from .reference import resolve_later_wins

__all__ = [
    "PackedWrites",
    "StagedWrites",
    "pack_writes",
    "apply_staged_writes",
    "bucket_size",
    "PALLAS_BLOCK_SIZE",
    "MIN_BUCKET",
]

MIN_BUCKET = 16
# Elements one Pallas program copies per step. ``values`` carries this much padding past its
# bucket so a block read that starts inside the contents never leaves the array.
PALLAS_BLOCK_SIZE = 128
_DROPPED_INDEX = np.iinfo(np.int32).max  # out of range for any array: scatter drops it


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
    :class:`~jaxbuf.kernels.jax_ring.PackRing`'s, by default) leave them out, and the
    scatter computes them on the device from the write columns: the host writes, and the
    device reads across the bus, less than half the bytes; when every write has one length
    (:attr:`uniform`), by a division instead of a search. :attr:`num_writes`,
    :attr:`num_values`, :attr:`dtype`, :attr:`expanded` and :attr:`uniform` are the pytree's
    static data, so ``jit`` traces once per bucket and layout.

    The five fields are properties slicing the buffer: numpy views on the host (no copy); JAX
    slices and bitcasts (``lax.bitcast_convert_type``) when the buffer is a JAX array, e.g.
    inside ``jit``. As with the NamedTuple this class replaces, iterating or indexing a
    ``PackedWrites`` gives the fields in that order, and ``PackedWrites(rows, starts, lengths,
    offsets, values)`` builds one from host columns (copied into a new buffer).
    """

    __slots__ = ("_buffer", "_num_writes", "_num_values", "_dtype", "_expanded", "_uniform")
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
            if column.size and (column.min() < 0 or column.max() > _DROPPED_INDEX):
                raise ValueError(f"{name} must be in [0, 2**31 - 1], got {column!r}")
        if values.ndim != 1:
            raise ValueError(f"values must be 1-D, got shape {values.shape}")
        packed = _allocate(columns[0].shape[0], values.shape[0], values.dtype, True)
        for i, column in enumerate(columns):
            packed._column(i)[:] = column
        packed.values[:] = values
        _expand_elements(packed)
        self._set(packed._buffer, packed._num_writes, packed._num_values, packed._dtype, True)

    def _set(
        self,
        buffer: Any,
        num_writes: int,
        num_values: int,
        dtype: np.dtype,
        expanded: bool,
        uniform: bool = False,
    ) -> None:
        self._buffer, self._num_writes = buffer, num_writes
        self._num_values, self._dtype, self._expanded = num_values, dtype, expanded
        self._uniform = uniform

    @classmethod
    def _wrap(
        cls,
        buffer: Any,
        num_writes: int,
        num_values: int,
        dtype: np.dtype,
        expanded: bool = True,
        uniform: bool = False,
    ):
        """A PackedWrites over ``buffer`` as is (no checks: also a tracer or a placeholder
        that JAX unflattens with)."""
        packed = object.__new__(cls)
        packed._set(buffer, num_writes, num_values, dtype, expanded, uniform)
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
        start = 4 * self._num_writes + _value_words(self._num_values, self._dtype)
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
            f"dtype={self._dtype}, expanded={self._expanded}, uniform={self._uniform}, "
            f"buffer={type(self._buffer).__name__})"
        )


def _allocate(num_writes: int, num_values: int, dtype: np.dtype, expanded: bool) -> PackedWrites:
    """A PackedWrites over a fresh, uninitialised buffer for these buckets. Fresh each time: a
    buffer handed to ``jit`` may still be in flight to the device, so none is reused."""
    _register_pytree()
    words = _packed_words(num_writes, num_values, dtype, expanded)
    buffer = np.empty(words, np.int32)
    return PackedWrites._wrap(buffer, num_writes, num_values, dtype, expanded)


def _value_words(num_values: int, dtype: np.dtype) -> int:
    """The int32 words ``num_values`` values of ``dtype`` take, rounded up."""
    return -(-num_values * dtype.itemsize // 4)


def _packed_words(num_writes: int, num_values: int, dtype: np.dtype, expanded: bool) -> int:
    """The int32 length of a PackedWrites buffer for these buckets (see its layout)."""
    elements = 2 * num_values if expanded else 0
    return 4 * num_writes + _value_words(num_values, dtype) + elements


def _expand_elements(packed: PackedWrites) -> None:
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
    element_rows[:] = element_cols[:] = _DROPPED_INDEX
    element_rows[at] = np.repeat(rows, lengths)
    element_cols[at] = np.minimum(np.repeat(starts, lengths) + within, _DROPPED_INDEX)


def _uniform_layout(lengths: np.ndarray, offsets: np.ndarray) -> bool:
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


def _register_pytree() -> None:
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
            (p._num_writes, p._num_values, p._dtype, p._expanded, p._uniform),
        ),
        lambda aux, leaves: PackedWrites._wrap(leaves[0], *aux),
    )


def bucket_size(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= ``n`` and >= ``minimum``."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class StagedWrites:
    """Row writes for one 2-D JAX array, staged on the host at C speed; :meth:`pack` makes the
    :class:`PackedWrites` that the jitted :func:`apply_staged_writes` takes.

    The JAX counterpart of :class:`jaxbuf.staged.StagedWriteTensor`'s staging, on the same C
    stager (``jaxbuf._staging``): :meth:`stage_write` of a numpy array of the target dtype is one
    C call, and :meth:`stage_writes` stages a whole batch with no Python loop per write (the
    values concatenated by numpy, staged by C). As writes are staged the stager indexes them by
    row, and :meth:`pack` resolves overlaps from that index, later writes winning, without
    sorting: overlapping writes come out as their visible pieces, so the packed writes are
    pairwise disjoint and every apply method's result is the in-order result.

    Invariants: staged writes are in bounds (``0 <= row < num_rows``, ``start >= 0``,
    ``start + len(values) <= row_len``) and converted to ``dtype``; a rejected write raises
    (ValueError / TypeError / IndexError, naming it) and stages nothing, and a rejected batch
    stages none of its writes. Without the C extension the same happens in numpy and Python,
    slower.

    Not thread-safe: one thread stages and packs an object.

    Parameters
    ----------
    num_rows, row_len : int
        The target array's shape; each below ``2**31 - 1`` (the packed indices are int32).
    dtype : numpy, JAX or str dtype
        The target array's dtype. Values are converted to it as
        :meth:`jaxbuf.staged.StagedWriteTensor.stage_write` converts them: integers must fit,
        floats may round but not overflow.
    min_write_bucket, min_content_bucket : int
        Floors of :meth:`pack`'s buckets; raising them to a loop's largest step keeps every
        step on one compiled shape.

    Examples
    --------
    >>> import numpy as np
    >>> from jaxbuf.kernels.jax_staged import StagedWrites
    >>> staged = StagedWrites(4, 8, "int32")
    >>> staged.stage_writes([0, 0, 3], [0, 2, 4], [np.arange(4, dtype=np.int32)] * 3)
    >>> packed = staged.pack()  # the later write at (0, 2) hides half of the first one
    >>> packed.starts[:4].tolist(), packed.lengths[:4].tolist(), packed.values[:10].tolist()
    ([0, 2, 4, 0], [2, 4, 4, 0], [0, 1, 0, 1, 2, 3, 0, 1, 2, 3])
    """

    __slots__ = (
        "num_rows",
        "row_len",
        "dtype",
        "min_write_bucket",
        "min_content_bucket",
        "_np_dtype",
        "_staging",
        "_stage_fast",
        "_shape_known",
    )

    def __init__(
        self,
        num_rows: int,
        row_len: int,
        dtype: Any,
        *,
        min_write_bucket: int = MIN_BUCKET,
        min_content_bucket: int = MIN_BUCKET,
    ) -> None:
        num_rows, row_len = as_int(num_rows, "num_rows"), as_int(row_len, "row_len")
        for name, value in (("num_rows", num_rows), ("row_len", row_len)):
            if not 0 <= value <= _DROPPED_INDEX:
                raise ValueError(f"{name} must be in [0, 2**31 - 1], got {value}")
        self.min_write_bucket = as_count(min_write_bucket, "min_write_bucket")
        self.min_content_bucket = as_count(min_content_bucket, "min_content_bucket")
        self.dtype = canonical_dtype(dtype)
        self._np_dtype = self.dtype.numpy
        self.num_rows, self.row_len = num_rows, row_len
        self._staging = StagingState(num_rows, row_len, self._np_dtype)
        stager = self._staging.stager
        self._stage_fast = None if stager is None else stager.stage
        self._shape_known = True  # False: pack_writes without a shape (bounds are int32's)

    @property
    def num_staged_writes(self) -> int:
        """Writes staged since the last :meth:`pack` / :meth:`clear` (empty ones excluded)."""
        return self._staging.num_writes

    def clear(self) -> None:
        """Drop every staged write."""
        self._staging.clear()

    # -- staging -----------------------------------------------------------------------------
    def stage_write(self, row: int, start: int, values: Any) -> None:
        """Stage ``array[row, start:start + len(values)] = values``.

        ``values``: a 1-D numpy array (of the target dtype: one C call), list, tuple, range,
        torch tensor or JAX array, converted under the rules of the class docstring. An empty
        ``values`` stages nothing.
        """
        fast = self._stage_fast
        if fast is not None and fast(row, start, values):
            return  # staged by C: exact ints, a contiguous 1-D buffer of the dtype, in bounds
        values = self._convert(values)
        row, start = as_int(row, "row"), as_int(start, "start")
        length = values.shape[0]
        if row < 0 or row >= self.num_rows or start < 0 or start + length > self.row_len:
            raise self._bounds_error(row, start, length)
        if length:
            staging = self._staging
            staging.contents.extend(values.view(np.uint8))
            staging.records.extend(pack_record(0, row, start, 0, length))

    def stage_writes(self, rows: Any, starts: Any, values_list: Any) -> None:
        """Stage ``array[rows[i], starts[i]:starts[i] + len(values_list[i])] = values_list[i]``
        for every ``i``, in order (where two overlap, the later wins), all or nothing.

        ``rows`` and ``starts``: sequences or arrays of integers. ``values_list``: a sequence of
        1-D values (numpy arrays, lists, JAX arrays, ...) or one 2-D numpy array (one write per
        row). The common cases take no Python loop per write: lists of Python ints and of
        numpy arrays of the target dtype are staged by one C loop; otherwise the values are
        concatenated by numpy, converted at once, and the writes checked and staged by one C
        call.
        """
        stager = self._staging.stager
        if stager is not None and stager.stage_many(rows, starts, values_list) < 0:
            return  # lists of plain writes (exact ints, numpy arrays of the dtype), in one C loop
        rows, starts = _as_indices(rows, "rows"), _as_indices(starts, "starts")
        count = len(values_list) if hasattr(values_list, "__len__") else -1
        if not rows.shape[0] == starts.shape[0] == count:
            given = "an unsized iterable" if count < 0 else count
            raise ValueError(
                f"got {rows.shape[0]} rows, {starts.shape[0]} starts and {given} values"
            )
        if not count:
            return
        flat, lengths = self._flatten(values_list, count)
        if stager is not None:
            bad = stager.stage_columns(rows, starts, lengths, flat.view(np.uint8))
        else:
            bad = self._stage_columns_numpy(rows, starts, lengths, flat)
        if bad >= 0:
            raise self._bounds_error(int(rows[bad]), int(starts[bad]), int(lengths[bad]), bad)

    def _stage_columns_numpy(
        self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray, flat: np.ndarray
    ) -> int:
        """``Stager.stage_columns`` without the extension: -1, or the first bad write."""
        bad = (rows < 0) | (rows >= self.num_rows) | (starts < 0)
        bad |= starts > self.row_len - lengths
        if bad.any():
            return int(np.flatnonzero(bad)[0])
        nonempty = lengths > 0
        zeros = np.zeros(int(nonempty.sum()), np.int64)
        records = np.stack([zeros, rows[nonempty], starts[nonempty], zeros, lengths[nonempty]], 1)
        self._staging.contents.extend(flat.view(np.uint8))
        self._staging.records.extend(records.tobytes())
        return -1

    def _convert(self, values: Any) -> np.ndarray:
        """``values`` as a C-contiguous 1-D array of the target dtype (or the error why not)."""
        dtype = self._np_dtype
        if dtype.kind in "iuf" or dtype.name == "bfloat16":
            return convert(values, dtype, self.dtype.name)
        # Other dtypes (bool, complex): numpy's conversion, refused where it changes a value.
        source = np.asarray(values).reshape(-1) if np.ndim(values) <= 1 else np.asarray(values)
        if source.ndim != 1:
            raise ValueError(f"values must be 1-D, got shape {source.shape}")
        converted = np.ascontiguousarray(source.astype(dtype))
        if not np.array_equal(converted, source):
            raise ValueError(f"values do not fit {dtype} exactly")
        return converted

    def _flatten(self, values_list: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Every write's values back to back, converted, and their lengths (int64).

        One numpy concatenation and one conversion when numpy's promotion of the inputs to a
        common dtype loses nothing (then converting the whole equals converting each); else,
        and to name the write a conversion refuses, one write at a time."""
        if isinstance(values_list, np.ndarray) and values_list.ndim == 2:
            lengths = np.full(count, values_list.shape[1], np.int64)
            try:
                return self._convert(values_list.reshape(-1)), lengths
            except (TypeError, ValueError):
                pass  # name the write below
        else:
            try:
                lengths = np.fromiter(map(len, values_list), np.int64, count)
                flat = np.concatenate(values_list)
            except (TypeError, ValueError):  # unsized items, scalars, mixed dimensions, ...
                flat = None
            if (
                flat is not None
                and flat.ndim == 1
                and flat.shape[0] == lengths.sum()
                and self._promotion_lost_nothing(flat)
            ):
                try:
                    return self._convert(flat), lengths
                except (TypeError, ValueError):
                    pass  # name the write below
        arrays = []
        for i, values in enumerate(values_list):
            try:
                arrays.append(self._convert(values))
            except (TypeError, ValueError) as error:
                raise type(error)(f"write {i}: {error}") from None
        lengths = np.fromiter((a.shape[0] for a in arrays), np.int64, count)
        return np.concatenate(arrays), lengths

    def _promotion_lost_nothing(self, flat: np.ndarray) -> bool:
        """Whether ``flat``, numpy's concatenation of the inputs, holds their values exactly
        enough that one conversion of it equals the conversions of each input."""
        kind = flat.dtype.kind
        if flat.dtype == self._np_dtype or kind in "iub":
            return True  # integer promotion is exact; promotion to the target is what each does
        if kind == "f" or flat.dtype.name == "bfloat16":
            target = self._np_dtype
            if target.kind == "f" or target.name == "bfloat16":
                return True  # each input rounds to the target anyway
            # An integer target: integers promoted to float64 are exact below 2**53.
            with np.errstate(invalid="ignore"):
                return bool(np.all(np.abs(flat.astype(np.float64)) < 2.0**53))
        return False

    def _bounds_error(self, row: int, start: int, length: int, index: int | None = None):
        where = "" if index is None else f"write {index} "
        described = f"{where}(row {row}, start {start}, length {length})"
        if row < 0 or start < 0:
            return IndexError(f"negative row or start: {described}")
        if not self._shape_known:
            return ValueError(f"{described} exceeds the int32 index range")
        return IndexError(
            f"{described} is out of bounds for shape ({self.num_rows}, {self.row_len})"
        )

    # -- packing -----------------------------------------------------------------------------
    def pack(
        self, *, clear: bool = True, ring: Any = None, expand: bool | None = None
    ) -> PackedWrites:
        """The staged writes, resolved (later wins) and padded to buckets, as
        :class:`PackedWrites`; then, unless ``clear=False``, nothing is staged any more.

        ``ring``: a :class:`~jaxbuf.kernels.jax_ring.PackRing` to pack into its next pinned
        slot, so the jitted apply reads the writes in place (no host-to-device transfer per
        call); same as ``ring.pack(self, clear=clear, expand=expand)``. Default: a fresh numpy
        buffer. ``expand``: write every value's row and column too (see
        :attr:`PackedWrites.expanded`); default True, or the ring's choice."""
        as_optional_bool(expand, "expand")
        if ring is not None:
            pack_into = getattr(ring, "pack", None)
            if pack_into is None or not hasattr(ring, "consumed_by"):
                raise TypeError(f"ring must be a PackRing, got {ring!r}")
            return pack_into(self, clear=clear, expand=expand)
        return self._pack_into(_allocate, clear, True if expand is None else expand)

    def _pack_into(self, allocate: Any, clear: bool, expand: bool) -> PackedWrites:
        """:meth:`pack` into ``allocate(num_writes, num_values, dtype, expand)``: a
        PackedWrites over a host (numpy) int32 buffer of exactly the packed length,
        uninitialised. A failing ``allocate`` leaves the staged writes as they were."""
        staging = self._staging
        stager = staging.stager
        if stager is not None:
            num_writes, total = stager.resolve()
        else:
            table = _resolved_table(staging)
            num_writes, total = table.shape[0], int(table[:, 4].sum())
        write_bucket = bucket_size(num_writes, self.min_write_bucket)
        content_bucket = bucket_size(total, self.min_content_bucket) + PALLAS_BLOCK_SIZE
        if content_bucket >= _DROPPED_INDEX:
            raise ValueError(f"{total} staged elements exceed the int32 index range")
        packed = allocate(write_bucket, content_bucket, self._np_dtype, expand)
        # Everything is written in place into the one buffer that jit will transfer (or, with
        # a ring, read in place).
        columns = packed._buffer[: 4 * write_bucket].reshape(4, write_bucket)
        value_words = _value_words(content_bucket, self._np_dtype)
        value_bytes = packed._buffer[4 * write_bucket : 4 * write_bucket + value_words]
        value_bytes = value_bytes.view(np.uint8)
        if stager is not None:
            stager.write_columns(*columns, value_bytes)
        else:
            _write_columns_numpy(staging, table, *columns, packed.values)
        # The buffer is uninitialised: pad explicitly (see PackedWrites' invariants).
        columns[:3, num_writes:] = 0
        columns[3, num_writes:] = total
        value_bytes[total * self._np_dtype.itemsize :] = 0
        if expand:
            _expand_elements(packed)
        else:
            packed._uniform = _uniform_layout(columns[2], columns[3])
        if clear:
            staging.clear()
        return packed


def _resolved_table(staging: StagingState) -> np.ndarray:
    """Without the C extension: the staged writes as a write table (content offsets in
    elements), resolved by :func:`~jaxbuf.kernels.resolve_later_wins`."""
    table = np.frombuffer(staging.records, np.int64).reshape(-1, 5).copy()
    table[:, 3] = np.cumsum(table[:, 4]) - table[:, 4]
    return resolve_later_wins(table)


def _write_columns_numpy(staging, table, rows, starts, lengths, offsets, values) -> None:
    """``Stager.write_columns`` without the extension: visible values back to back."""
    n = table.shape[0]
    staged = np.frombuffer(staging.contents, values.dtype).copy()
    rows[:n], starts[:n], lengths[:n] = table[:, 1], table[:, 2], table[:, 4]
    packed_offsets = np.cumsum(table[:, 4]) - table[:, 4]
    offsets[:n] = packed_offsets
    total = int(table[:, 4].sum())
    source = np.repeat(table[:, 3] - packed_offsets, table[:, 4]) + np.arange(total)
    values[:total] = staged[source]


def _as_indices(values: Any, name: str) -> np.ndarray:
    """``values`` as a flat C-contiguous int64 array; TypeError naming them unless every entry
    is an int (a float row would otherwise be truncated silently)."""
    array = np.asarray(values).reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {values!r}")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise IndexError(f"{name} out of range: {values!r}")
    return np.ascontiguousarray(array, np.int64)


def pack_writes(
    rows: Sequence[int],
    starts: Sequence[int],
    values_list: Sequence[Any],
    dtype: Any,
    *,
    shape: tuple[int, int] | None = None,
    min_write_bucket: int = MIN_BUCKET,
    min_content_bucket: int = MIN_BUCKET,
    ring: Any = None,
    expand: bool | None = None,
) -> PackedWrites:
    """Pack row writes for :func:`apply_staged_writes`: a :class:`StagedWrites` of one batch.

    ``values_list[i]`` (anything numpy converts) goes to ``array[rows[i], starts[i]:...]``.
    Values are converted to ``dtype``; a conversion that changes a value raises ValueError.
    With ``shape`` every write is bounds-checked (IndexError); without it, out-of-range elements
    are dropped at apply time (ValueError past the int32 index range). Where writes overlap, the
    later one wins. Raising the ``min_*_bucket`` floors to a loop's largest step keeps every
    step on one compiled shape. A loop that stages as it goes saves the batch's lists by using
    :class:`StagedWrites` directly. ``ring``: pack into a
    :class:`~jaxbuf.kernels.jax_ring.PackRing`'s pinned slot; ``expand``: as in
    :meth:`StagedWrites.pack`.
    """
    if shape is None:
        num_rows = row_len = _DROPPED_INDEX - 1
    else:
        num_rows, row_len = (as_int(d, "shape") for d in shape)
    arguments = (num_rows, row_len, dtype, min_write_bucket, min_content_bucket, shape is not None)
    if ring is None:
        staged = _new_staged_writes(*arguments)
        staged.stage_writes(rows, starts, values_list)
        return staged.pack(expand=expand)
    # A ring keeps one StagedWrites for this: its stager's buffers stay allocated (and their
    # pages mapped) from call to call, which a fresh one pays for every time (H200 host,
    # 4,096 writes: 503 -> 375 µs).
    scratch = getattr(ring, "_scratch", None)
    if scratch is None:
        raise TypeError(f"ring must be a PackRing, got {ring!r}")
    staged = scratch(arguments, _new_staged_writes)
    try:
        staged.stage_writes(rows, starts, values_list)
        return staged.pack(ring=ring, expand=expand)
    except BaseException:
        staged.clear()  # nothing of a failed call stays staged for the next one
        raise


def _new_staged_writes(
    num_rows: int,
    row_len: int,
    dtype: Any,
    min_write_bucket: int,
    min_content_bucket: int,
    shape_known: bool,
) -> StagedWrites:
    staged = StagedWrites(
        num_rows,
        row_len,
        dtype,
        min_write_bucket=min_write_bucket,
        min_content_bucket=min_content_bucket,
    )
    staged._shape_known = shape_known
    return staged


def _pallas_kernel(rows_ref, starts_ref, lengths_ref, offsets_ref, values_ref, array_ref, out_ref):
    """One program per write: copy its contents into the aliased output, a block at a time."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    del array_ref  # aliased to out_ref
    write = pl.program_id(0)
    row, start = rows_ref[write], starts_ref[write]
    length, offset = lengths_ref[write], offsets_ref[write]
    num_rows, num_cols = out_ref.shape

    def copy_block(block, carry):
        position = block * PALLAS_BLOCK_SIZE + jnp.arange(PALLAS_BLOCK_SIZE)
        # Out-of-range elements are dropped, matching the scatter path's mode="drop".
        mask = (position < length) & (start + position < num_cols) & (row < num_rows)
        block_values = plgpu.load(
            values_ref.at[pl.ds(offset + block * PALLAS_BLOCK_SIZE, PALLAS_BLOCK_SIZE)], mask=mask
        )
        plgpu.store(
            out_ref.at[row, pl.ds(start + block * PALLAS_BLOCK_SIZE, PALLAS_BLOCK_SIZE)],
            block_values,
            mask=mask,
        )
        return carry

    jax.lax.fori_loop(0, (length + PALLAS_BLOCK_SIZE - 1) // PALLAS_BLOCK_SIZE, copy_block, 0)


def _apply_pallas(array, packed: PackedWrites, interpret: bool):
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    call = pl.pallas_call(
        _pallas_kernel,
        out_shape=jax.ShapeDtypeStruct(array.shape, array.dtype),
        grid=(packed.num_writes,),
        input_output_aliases={5: 0},  # the array is updated in place when donated
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(),
        name="jaxbuf_apply_staged_writes",
    )
    return call(packed.rows, packed.starts, packed.lengths, packed.offsets, packed.values, array)


def _apply_scatter(array, packed: PackedWrites):
    rows, cols = _scatter_targets(packed, _platform(array))
    # unique_indices=True lets XLA store without ordering colliding updates: H200, 50 applies
    # chained, per apply at 256 / 4,096 writes, 2.80 / 3.39 µs without it, 2.64 / 3.06 µs
    # with it, plain JAX's a.at[r, c].set(v) 3.04 / 3.19 µs
    # (tools/experiments/scatter_variants.py).
    return array.at[rows, cols].set(packed.values, mode="drop", unique_indices=True)


def _scatter_targets(packed: PackedWrites, platform: str) -> tuple[Any, Any]:
    """Every value's (row, column), no two pairs equal: the packer made the writes disjoint,
    so kept values never share a target, and padding (row ``2**31 - 1``, dropped) gets its
    position as column. That makes ``unique_indices=True`` a true promise."""
    import jax.numpy as jnp

    if packed.expanded:
        # The host expanded every value's target: the scatter a JAX user writes, with
        # nothing computed on the device first.
        rows, cols = packed.element_rows, packed.element_cols
    else:
        rows, cols = _element_indices(packed, platform)
    position = jnp.arange(rows.shape[0], dtype=cols.dtype)
    return rows, jnp.where(rows == _DROPPED_INDEX, position, cols)


def _element_indices(packed: PackedWrites, platform: str) -> tuple[Any, Any]:
    """Inside ``jit``: every value's target row and column, computed from the write columns
    (what the host writes into an expanded pack), ``2**31 - 1`` for padding."""
    import jax.numpy as jnp

    num_values = packed.num_values
    element = jnp.arange(num_values, dtype=jnp.int32)
    if packed.uniform:
        # Write i holds values [i * L, (i + 1) * L): a division, no search. H200, the
        # `jax.staged` bench (a GPU ring's packs of 16-value writes, 50 applies chained, device
        # time per apply, sampled round by round against plain JAX's a.at[r, c].set(v)):
        # 3.07 / 4.61 µs against 3.58 / 5.41 µs at 256 / 4,096 writes; with the search
        # below it was 1.05-1.11x plain JAX's at 4,096. Values past the last write land on
        # padding (length 0) or, clamped, past the last write's end: dropped either way.
        length = jnp.maximum(packed.lengths[0], 1)
        write = jnp.minimum(element // length, packed.num_writes - 1)
        within = element - write * length
        valid = within < packed.lengths[write]
        return (
            jnp.where(valid, packed.rows[write], _DROPPED_INDEX),
            jnp.where(valid, packed.starts[write] + within, _DROPPED_INDEX),
        )
    # The write holding each value: the last write whose offset is <= it, i.e. the number of
    # offsets <= it minus one (offsets are non-decreasing; empty writes share their offset
    # with the next one and are skipped). Counted the way each platform does fastest
    # (H200, 50 applies chained, per apply at 256 / 4,096 writes: an unrolled binary search
    # 2.66 / 3.06 µs, a prefix sum of marks 3.87 / 3.41 µs, plain JAX's scatter from host
    # indices 2.49 / 3.06 µs); on the CPU the search, a dozen gathers over every value, made
    # the apply 2.5x slower than the prefix sum.
    if platform == "gpu":
        write = jnp.searchsorted(packed.offsets, element, side="right", method="scan_unrolled")
        write = write.astype(jnp.int32) - 1
    else:
        marks = jnp.zeros(num_values, jnp.int32).at[packed.offsets].add(1, mode="drop")
        write = jnp.cumsum(marks) - 1
    # One gather of each value's write (row, start, offset, length) instead of four.
    table = jnp.stack([packed.rows, packed.starts, packed.offsets, packed.lengths], axis=1)
    row, start, offset, length = table[jnp.maximum(write, 0)].T
    within = element - offset
    valid = (write >= 0) & (within < length)
    return (
        jnp.where(valid, row, _DROPPED_INDEX),
        jnp.where(valid, start + within, _DROPPED_INDEX),
    )


#: The ``method`` values of :func:`apply_staged_writes`.
METHODS = ("triton", "scatter", "pallas")


def _platform(array) -> str:
    """``"gpu"`` (CUDA or ROCm) or JAX's platform name for where ``array`` lives; while
    tracing, the default backend's (``jit`` compiles for it unless its arguments are
    committed elsewhere)."""
    import jax

    if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer):
        platform = next(iter(array.devices())).platform
    else:
        platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _triton_unavailable_reason() -> str | None:
    """Why ``method="triton"`` cannot run in this process (None when it can)."""
    try:
        from .jax_triton_apply import jax_triton_unavailable_reason
    except ImportError as error:
        if not (getattr(error, "name", None) or "").startswith("triton"):
            raise
        return f"Triton is not installed ({error})"
    return jax_triton_unavailable_reason()


def apply_staged_writes(
    array, packed: PackedWrites, *, method: str | None = None, interpret: bool | None = None
):
    """Return ``array`` with ``packed``'s writes applied; jit-able, traced once per bucket.

    ``method``:

    * ``"triton"``: the Triton staged-write kernel through ``jax_triton``
      (:mod:`jaxbuf.kernels.jax_triton_apply`), GPU only. ``array`` is aliased to the
      result, so a donated array is updated in place.
    * ``"scatter"``: ``array.at[rows, cols].set(..., mode="drop")``, an XLA scatter; every
      platform (the CPU's path).
    * ``"pallas"``: the Pallas kernel on Pallas's Triton backend, which JAX 0.11 deprecates;
      kept for comparison, never chosen by default. ``interpret`` defaults to True except on
      a GPU backend.
    * ``None`` (default): ``"scatter"``, on every platform. Chosen by the numbers: on an
      H200 the scatter's device time per apply over a GPU ring's packs (3.07 / 4.61 µs at
      256 / 4,096 writes of 16 int32, in a chain of 50) is below plain JAX's
      ``a.at[r, c].set(v)`` (3.58 / 5.41 µs, same run), while the Triton kernel's is 7.3 /
      9.5 µs: XLA records its fusions into CUDA graphs but launches a ``jax_triton`` custom
      call from the host, one at a time. The scatter promises XLA unique indices (the
      packer resolved every overlap). A donated array is updated in place by either.

    Raises ValueError for an unknown method, ``"triton"`` off the GPU or with ``interpret``,
    and ImportError naming what is missing when ``"triton"`` cannot run here.
    """
    import jax

    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    if array.ndim != 2:
        raise ValueError(f"array must be 2-D, got shape {tuple(array.shape)}")
    if not isinstance(packed, PackedWrites):
        raise TypeError(
            f"packed must be a PackedWrites (StagedWrites.pack, pack_writes), got {packed!r}"
        )
    if packed.dtype != array.dtype:
        raise TypeError(f"packed values are {packed.dtype}, array is {array.dtype}")
    if method is None or method == "scatter":
        return _apply_scatter(array, packed)
    if method == "triton":
        if interpret:
            raise ValueError(
                "method='triton' has no interpreter; use method='scatter' (or "
                "'pallas' with interpret=True)"
            )
        platform = _platform(array)
        if platform != "gpu":
            raise ValueError(
                f"method='triton' runs on a GPU, but the array is on {platform}; "
                "use method='scatter' (the default there)"
            )
        reason = _triton_unavailable_reason()
        if reason is not None:
            raise ImportError(f"apply_staged_writes(method='triton') is unavailable: {reason}")
        from .jax_triton_apply import apply_packed_writes

        return apply_packed_writes(array, packed)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _apply_pallas(array, packed, interpret)
