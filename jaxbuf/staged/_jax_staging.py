"""The JAX wing's host side: :class:`StagedWrites`, row writes for one 2-D JAX array.

The host stages a step's writes in a :class:`StagedWrites` (the C stager that
:class:`jaxbuf.StagedWriteTensor` uses: no Python loop per write) and packs them into a
:class:`~jaxbuf.staged._jax_packed.PackedWrites` (one int32 host buffer, so a jitted apply makes
one host-to-device transfer, or a :class:`~jaxbuf.jax_ops.PackRing` slot the device reads in
place); :func:`pack_writes` does both for one batch of lists. The packed layout lives in
:mod:`jaxbuf.staged._jax_packed`, the jit-side apply in :mod:`jaxbuf.staged._jax_apply`; users
import all of it from :mod:`jaxbuf.jax_ops`.

Nothing here imports JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._checks import as_count, as_int, as_optional_bool
from .._convert import convert_any, convert_batch
from ..dtypes import canonical_dtype
from ._host import StagingState, pack_record
from ._jax_pack import Packer, PackPlan, plan_pack, write_pack
from ._jax_packed import DROPPED_INDEX, MIN_BUCKET, PackedWrites

__all__ = ["StagedWrites", "pack_writes"]


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
    >>> from jaxbuf.jax_ops import StagedWrites
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
            if not 0 <= value <= DROPPED_INDEX:
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

    @property
    def nbytes(self) -> int:
        """The host bytes the staged writes take (their records and values)."""
        return len(self._staging.records) + len(self._staging.contents)

    def clear(self) -> None:
        """Drop every staged write."""
        self._staging.clear()

    def __repr__(self) -> str:
        return (
            f"StagedWrites(num_rows={self.num_rows}, row_len={self.row_len}, "
            f"dtype={self.dtype}, staged={self.num_staged_writes}, nbytes={self.nbytes})"
        )

    def __enter__(self) -> StagedWrites:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Leaving a ``with`` block drops what is still staged (nothing is applied)."""
        self.clear()

    # A copy is independent: its own stager over copies of the staged bytes (a shared stager
    # would let packing the copy clear the original). deepcopy and pickle make the same copy.
    def __copy__(self) -> StagedWrites:
        return _restore(*self._state())

    def __deepcopy__(self, memo: dict) -> StagedWrites:
        return self.__copy__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _restore, self._state()

    def _state(self) -> tuple:
        staging = self._staging
        return (
            self.num_rows,
            self.row_len,
            self.dtype.name,
            self.min_write_bucket,
            self.min_content_bucket,
            self._shape_known,
            bytes(staging.records),
            bytes(staging.contents),
        )

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
        return convert_any(values, self._np_dtype, self.dtype.name)

    def _flatten(self, values_list: Any, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Every write's values back to back, converted, and their lengths (int64)."""
        return convert_batch(values_list, count, self._np_dtype, self.dtype.name)

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

        ``ring``: a :class:`~jaxbuf.jax_ops.PackRing` to pack into its next pinned slot, so
        the jitted apply reads the writes in place (no host-to-device transfer per call); same
        as ``ring.pack(self, clear=clear, expand=expand)``. Default: a fresh numpy buffer.
        ``expand``: write every value's row and column too (see
        :attr:`PackedWrites.expanded`); default True, or the ring's choice."""
        as_optional_bool(expand, "expand")
        if ring is not None:
            if not isinstance(ring, Packer):
                raise TypeError(f"ring must be a PackRing, got {ring!r}")
            return ring.pack(self, clear=clear, expand=expand)
        expand = True if expand is None else expand
        plan = self.plan_pack()
        # A fresh buffer each time: one handed to jit may still be in flight to the device.
        return self.pack_into(plan, np.empty(plan.words(expand), np.int32), clear, expand)

    # The two steps of pack, for a packer that owns its memory (PackRing): size the pack, find
    # room for it, write it there. Between the two nothing changes, so a packer that fails to
    # find room leaves the staged writes as they were.
    def plan_pack(self) -> PackPlan:
        """Resolve the staged writes (later wins) and size their pack: a :class:`PackPlan`
        whose :meth:`~PackPlan.words` is the int32 length of the buffer :meth:`pack_into`
        fills. Changes nothing staged."""
        return plan_pack(
            self._staging, self._np_dtype, self.min_write_bucket, self.min_content_bucket
        )

    def pack_into(
        self, plan: PackPlan, buffer: np.ndarray, clear: bool, expand: bool
    ) -> PackedWrites:
        """Write the pack :meth:`plan_pack` sized into ``buffer`` (host int32, exactly
        ``plan.words(expand)`` long, any contents) and return a PackedWrites over it; then,
        when ``clear``, nothing is staged any more. Stage nothing between the two calls."""
        packed = write_pack(self._staging, plan, buffer, expand, self.packed_shape)
        if clear:
            self._staging.clear()
        return packed

    @property
    def packed_shape(self) -> tuple[int, int] | None:
        """``(num_rows, row_len)``, the shape the writes are checked against and their packs
        carry (:attr:`PackedWrites.shape`), so an apply refuses an array too small for them;
        None when unchecked (:func:`pack_writes` without a shape)."""
        return (self.num_rows, self.row_len) if self._shape_known else None


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
    :class:`~jaxbuf.jax_ops.PackRing`'s pinned slot; ``expand``: as in
    :meth:`StagedWrites.pack`.
    """
    if shape is None:
        num_rows = row_len = DROPPED_INDEX - 1
    else:
        num_rows, row_len = (as_int(d, "shape") for d in shape)
    arguments = (num_rows, row_len, dtype, min_write_bucket, min_content_bucket, shape is not None)
    if ring is None:
        staged = new_staged_writes(*arguments)
        staged.stage_writes(rows, starts, values_list)
        return staged.pack(expand=expand)
    if not isinstance(ring, Packer):
        raise TypeError(f"ring must be a PackRing, got {ring!r}")
    staged = ring.scratch_writes(arguments)
    try:
        staged.stage_writes(rows, starts, values_list)
        return ring.pack(staged, expand=expand)
    except BaseException:
        staged.clear()  # nothing of a failed call stays staged for the next one
        raise


def new_staged_writes(
    num_rows: int,
    row_len: int,
    dtype: Any,
    min_write_bucket: int,
    min_content_bucket: int,
    shape_known: bool,
) -> StagedWrites:
    """A StagedWrites for :func:`pack_writes`: ``shape_known`` False when no shape was given
    (the bounds are then int32's, and an out-of-range write is a ValueError)."""
    staged = StagedWrites(
        num_rows,
        row_len,
        dtype,
        min_write_bucket=min_write_bucket,
        min_content_bucket=min_content_bucket,
    )
    staged._shape_known = shape_known
    return staged


def _restore(
    num_rows: int,
    row_len: int,
    dtype: str,
    min_write_bucket: int,
    min_content_bucket: int,
    shape_known: bool,
    records: bytes,
    contents: bytes,
) -> StagedWrites:
    """A StagedWrites with these staged bytes (what copy and pickle make); the C stager
    indexes records appended to its buffer when it next resolves them."""
    staged = new_staged_writes(
        num_rows, row_len, dtype, min_write_bucket, min_content_bucket, shape_known
    )
    staged._staging.records.extend(records)
    staged._staging.contents.extend(contents)
    return staged
