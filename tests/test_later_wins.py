"""Later wins, exactly: staged batches with repeated and overlapping rows against a numpy model.

Where writes of one batch overlap, the C stager (``jaxbuf/_staging.c``) resolves them when the
batch is packed: earlier writes are dropped or split into their visible pieces, so the packed
table has no overlapping entries and the kernel runs in parallel. These tests draw batches with
hypothesis in four patterns (every write its own row, rows repeating without overlap, uniformly
random, heavy overlap), over several tensors of mixed dtypes in one apply, staged through both
the C fast path and the Python path, and check

* the targets equal a numpy model that applies every write in order, through
  ``FusedStagedWriter`` (numpy backend and interpreted Triton; C packer and numpy packer) and
  through the JAX path (``StagedWrites`` / ``pack_writes`` and the jitted XLA scatter);
* every packed table has no two overlapping entries, and the C resolution equals the Python
  one (:func:`jaxbuf.kernels.resolve_later_wins`) entry for entry.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbuf.kernels import has_overlap, resolve_later_wins
from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ["int32", "int64", "float32", "float16", "bfloat16"]
PATTERNS = ["own_row", "rows_repeat", "random", "heavy_overlap"]
SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _np_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def _values(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    """``n`` values exactly representable in ``dtype`` (small integers: exact in every one)."""
    return rng.integers(-1000, 1000, n).astype(dtype)


def _writes(rng: np.random.Generator, pattern: str, num_writes: int, shape: tuple[int, int]):
    """``(row, start, length)`` for each write of one tensor in ``pattern``."""
    num_rows, row_len = shape
    writes = []
    if pattern == "own_row":
        for row in rng.permutation(num_rows)[:num_writes].tolist():
            length = int(rng.integers(1, row_len + 1))
            writes.append((row, int(rng.integers(0, row_len - length + 1)), length))
    elif pattern == "rows_repeat":  # rows repeat, writes disjoint: cells of width 3 or less
        width = min(3, row_len)
        cells = rng.permutation(num_rows * (row_len // width))[:num_writes]
        for cell in cells.tolist():
            row, column = divmod(cell, row_len // width)
            writes.append((row, column * width, int(rng.integers(1, width + 1))))
    else:
        rows = min(2, num_rows) if pattern == "heavy_overlap" else num_rows
        for _ in range(num_writes):
            length = int(rng.integers(1, row_len + 1))
            start = int(rng.integers(0, row_len - length + 1))
            writes.append((int(rng.integers(rows)), start, length))
    return writes


@st.composite
def batches(draw, max_tensors: int = 3, max_writes: int = 24, dtypes=DTYPES, shapes=None):
    """``(seed, pattern, tensors)``: each tensor ``(dtype, shape, writes)``; shapes drawn from
    ``shapes`` when given (a jitted apply compiles once per shape), else up to 6 x 20."""
    seed = draw(st.integers(0, 2**32 - 1))
    pattern = draw(st.sampled_from(PATTERNS))
    rng = np.random.default_rng(seed)
    tensors = []
    for _ in range(draw(st.integers(1, max_tensors))):
        dtype = draw(st.sampled_from(dtypes))
        if shapes is None:
            shape = (draw(st.integers(1, 6)), draw(st.integers(1, 20)))
        else:
            shape = draw(st.sampled_from(shapes))
        num_writes = draw(st.integers(0, max_writes))
        tensors.append((dtype, shape, _writes(rng, pattern, num_writes, shape)))
    return seed, pattern, tensors


def _model_and_values(seed: int, tensors):
    """The values of every write and the model: each tensor's writes applied in order."""
    rng = np.random.default_rng(seed + 1)
    models, values = [], []
    for dtype, shape, writes in tensors:
        model = np.zeros(shape, _np_dtype(dtype))
        tensor_values = []
        for row, start, length in writes:
            v = _values(rng, model.dtype, length)
            model[row, start : start + length] = v
            tensor_values.append(v)
        models.append(model)
        values.append(tensor_values)
    return models, values


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(_bits(got), _bits(want.astype(got.dtype)))


def _assert_disjoint(table: np.ndarray) -> None:
    assert not has_overlap(table[:, 0], table[:, 1], table[:, 2], table[:, 4])
    assert (table[:, 4] > 0).all()


@pytest.fixture(params=["c", "numpy"])
def packer(request, monkeypatch):
    """The writer packs with the C extension, or with its numpy fallback."""
    import jaxbuf.staged._packing as packing

    if request.param == "numpy":
        monkeypatch.setattr(packing, "c_pack", None)
    elif packing.c_pack is None:
        pytest.skip("jaxbuf._staging is not built")
    return request.param


def _run_fused(backend: str, seed: int, tensors, monkeypatch) -> list[np.ndarray]:
    """Stage ``tensors``' writes (numpy arrays through C, lists through Python, mixed), apply
    them in one launch, check the launched table, return the targets."""
    models, values = _model_and_values(seed, tensors)
    swts = [StagedWriteTensor(shape, dtype, "cpu", backend=backend) for dtype, shape, _ in tensors]
    writer = FusedStagedWriter("cpu", 4, backend=backend)
    tables = []
    launch = writer._launch

    def recording(args, raw_stream, host_tables=None, copy=None):
        # One parallel launch of every resolved write (the launch value has no serial mode).
        assert args.num_writes == host_tables[0].shape[0]
        tables.append(host_tables[0].copy())
        return launch(args, raw_stream, host_tables, copy)

    monkeypatch.setattr(writer, "_launch", recording)
    try:
        rng = np.random.default_rng(seed + 2)
        for swt, (_, _, writes), tensor_values in zip(swts, tensors, values):
            for (row, start, _), v in zip(writes, tensor_values):
                swt.stage_write(row, start, v if rng.random() < 0.7 else v.tolist())
        writer.apply(swts)
        if any(writes for _, _, writes in tensors):
            (table,) = tables
            _assert_disjoint(table)
        results = [swt.to_numpy().copy() for swt in swts]
    finally:
        writer.close()
        for swt in swts:
            swt.close()
    for got, want in zip(results, models):
        _assert_same(got, want)
    return tables


@SETTINGS
@given(batches())
def test_fused_numpy_backend_later_wins(packer, monkeypatch, batch):
    seed, _, tensors = batch
    _run_fused("numpy", seed, tensors, monkeypatch)


@settings(SETTINGS, max_examples=12)
@given(batches(max_tensors=2, max_writes=10))
def test_fused_interpreted_triton_later_wins(monkeypatch, batch):
    pytest.importorskip("triton", reason="triton is not installed")
    seed, _, tensors = batch
    _run_fused("triton", seed, tensors, monkeypatch)


@settings(SETTINGS, max_examples=60)
@given(batches())
def test_c_and_numpy_packers_emit_the_same_table(monkeypatch, batch):
    """The C resolution (incremental row index) equals the Python one, entry for entry."""
    import jaxbuf.staged._packing as packing

    if packing.c_pack is None:
        pytest.skip("jaxbuf._staging is not built")
    seed, _, tensors = batch
    from_c = _run_fused("numpy", seed, tensors, monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(packing, "c_pack", None)
        from_numpy = _run_fused("numpy", seed, tensors, patch)
    assert [t.tolist() for t in from_c] == [t.tolist() for t in from_numpy]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern_at_scale(packer, monkeypatch, pattern):
    """Hundreds of writes per tensor, 4 tensors of mixed dtypes (numpy backend)."""
    rng = np.random.default_rng(PATTERNS.index(pattern))
    tensors = []
    for dtype in ("int32", "float16", "bfloat16", "int64"):
        shape = (64, 48)
        tensors.append((dtype, shape, _writes(rng, pattern, 300, shape)))
    _run_fused("numpy", 11, tensors, monkeypatch)


def test_resolution_survives_clear_regrow_and_restage(packer, monkeypatch):
    """Cleared batches leave nothing behind in the row index; a slot that grows packs the same
    batch twice (the resolution is reused); a failed apply keeps the batch staged."""
    swt = StagedWriteTensor((4, 16), "int32", "cpu", backend="numpy")
    writer = FusedStagedWriter("cpu", 1, backend="numpy")
    try:
        swt.stage_write(0, 0, np.arange(16, dtype=np.int32))
        swt.clear_staged_writes()  # the row index forgets row 0
        swt.stage_write(0, 4, np.full(4, 7, np.int32))
        writer.apply([swt])
        expected = np.zeros((4, 16), np.int32)
        expected[0, 4:8] = 7
        _assert_same(swt.to_numpy(), expected)
        # Many overlapping writes: the first slot is too small, so the batch is packed twice.
        rng = np.random.default_rng(0)
        for _ in range(200):
            row, start = int(rng.integers(4)), int(rng.integers(0, 12))
            v = rng.integers(-99, 99, 4).astype(np.int32)
            swt.stage_write(row, start, v if rng.random() < 0.5 else v.tolist())
            expected[row, start : start + 4] = v
        launch = writer._launch

        def failing(*args, **kwargs):
            raise RuntimeError("launch failed")

        monkeypatch.setattr(writer, "_launch", failing)
        with pytest.raises(RuntimeError, match="launch failed"):
            writer.apply([swt])
        assert swt.num_staged_writes == 200  # still staged
        swt.stage_write(3, 15, [5])  # more after the failed apply
        expected[3, 15] = 5
        monkeypatch.setattr(writer, "_launch", launch)
        writer.apply([swt])
        _assert_same(swt.to_numpy(), expected)
    finally:
        writer.close()
        swt.close()


# -- the Python resolution, on its own -------------------------------------------------------
def _apply_table_in_order(table: np.ndarray, contents: np.ndarray, shape, groups: int):
    out = [np.full(shape, -1, np.int64) for _ in range(groups)]
    for group, row, start, offset, length in table.tolist():
        out[group][row, start : start + length] = contents[offset : offset + length]
    return out


_TABLE_WRITES = st.tuples(
    st.integers(0, 1), st.integers(0, 2), st.integers(0, 12), st.integers(0, 6)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TABLE_WRITES, max_size=16))
def test_resolve_later_wins_matches_in_order(writes):
    lengths = np.array([w[3] for w in writes], np.int64)
    offsets = np.cumsum(lengths) - lengths
    table = np.array(
        [(g, r, s, o, n) for (g, r, s, n), o in zip(writes, offsets.tolist())], np.int64
    ).reshape(-1, 5)
    contents = np.arange(int(lengths.sum()))
    resolved = resolve_later_wins(table)
    kept = resolved[resolved[:, 4] > 0]
    assert not has_overlap(kept[:, 0], kept[:, 1], kept[:, 2], kept[:, 4])
    want = _apply_table_in_order(table, contents, (3, 20), 2)
    got = _apply_table_in_order(resolved[::-1].copy(), contents, (3, 20), 2)  # any order
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# -- the JAX path ----------------------------------------------------------------------------
@pytest.fixture(params=["c", "python"])
def stager(request, monkeypatch):
    """StagedWrites on the C stager, or on its Python/numpy fallback."""
    import jaxbuf.staged._host as host

    if request.param == "python":
        monkeypatch.setattr(host, "_Stager", None)
    elif host._Stager is None:
        pytest.skip("jaxbuf._staging is not built")
    return request.param


@pytest.fixture(scope="module")
def scatter():
    jax = pytest.importorskip("jax", reason="jax is not installed")
    from jaxbuf.jax_ops import apply_staged_writes

    return jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))


def _check_packed(packed, shape) -> None:
    """PackedWrites invariants: disjoint writes, values back to back, padding at the end."""
    n = int((packed.lengths > 0).sum())
    assert (packed.lengths[:n] > 0).all() and not packed.lengths[n:].any()
    rows, starts, lengths = packed.rows[:n], packed.starts[:n], packed.lengths[:n]
    assert not has_overlap(np.zeros(n), rows, starts, lengths)
    ends = np.cumsum(lengths)
    np.testing.assert_array_equal(packed.offsets[:n], ends - lengths)
    assert (packed.offsets[n:] == (ends[-1] if n else 0)).all()
    assert (rows < shape[0]).all() and (starts + lengths <= shape[1]).all()


# JAX without x64 holds no int64; two shapes bound the number of compiled applies.
_JAX_BATCHES = batches(
    max_tensors=1,
    max_writes=40,
    dtypes=[d for d in DTYPES if d != "int64"],
    shapes=[(6, 20), (2, 7)],
)


@settings(SETTINGS, max_examples=60)
@given(_JAX_BATCHES)
def test_jax_staged_writes_later_wins(stager, scatter, batch):
    import jax.numpy as jnp

    from jaxbuf.jax_ops import StagedWrites, pack_writes

    seed, _, ((dtype, shape, writes),) = batch
    (model,), (values,) = _model_and_values(seed, [(dtype, shape, writes)])
    rows = [w[0] for w in writes]
    starts = [w[1] for w in writes]
    staged = StagedWrites(*shape, dtype)
    rng = np.random.default_rng(seed)
    half = int(rng.integers(0, len(writes) + 1))
    for row, start, v in zip(rows[:half], starts[:half], values[:half]):  # one at a time
        staged.stage_write(row, start, v if rng.random() < 0.7 else v.tolist())
    staged.stage_writes(rows[half:], starts[half:], values[half:])  # the rest in bulk
    packed = staged.pack()
    assert staged.num_staged_writes == 0
    _check_packed(packed, shape)
    by_lists = pack_writes(rows, starts, values, dtype, shape=shape)
    for a, b in zip(packed, by_lists):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    array = jnp.zeros(shape, packed.values.dtype)
    _assert_same(np.asarray(scatter(array, packed)), model)


def test_jax_bulk_inputs_and_errors(stager):
    """Bulk staging takes lists of lists, a 2-D array, numpy rows; a bad write stages
    nothing and names its index."""
    from jaxbuf.jax_ops import StagedWrites

    staged = StagedWrites(4, 8, "int32")
    staged.stage_writes(np.array([0, 1]), [0, 4], np.arange(8, dtype=np.int64).reshape(2, 4))
    staged.stage_writes([2, 2], [0, 1], [[1, 2, 3], [9.0]])  # later wins at (2, 1)
    staged.stage_writes([3], [0], [np.arange(8, dtype=np.int16)])
    for rows, starts, values, error, match in [
        ([0, 4], [0, 0], [[1], [2]], IndexError, "write 1"),
        ([0, 1], [0, 7], [[1], [2, 3]], IndexError, "write 1"),
        ([0, 1], [0, 0], [[1], [2.5]], ValueError, "write 1"),
        ([0, 1], [0, 0], [[1], [2**40]], ValueError, "write 1"),
        ([0.0], [0], [[1]], TypeError, "rows"),
        ([0, 1], [0], [[1], [2]], ValueError, "2 rows, 1 starts"),
    ]:
        before = staged.num_staged_writes
        with pytest.raises(error, match=match):
            staged.stage_writes(rows, starts, values)
        assert staged.num_staged_writes == before
    packed = staged.pack()
    got = np.zeros((4, 8), np.int32)
    for i in range(int((packed.lengths > 0).sum())):
        r, s, n, o = (int(x[i]) for x in packed[:4])
        got[r, s : s + n] = packed.values[o : o + n]
    expected = np.zeros((4, 8), np.int32)
    expected[0, :4], expected[1, 4:] = [0, 1, 2, 3], [4, 5, 6, 7]
    expected[2, :3], expected[2, 1], expected[3] = [1, 2, 3], 9, np.arange(8)
    np.testing.assert_array_equal(got, expected)
