"""StagedWriteTensor and FusedStagedWriter against a numpy model, on the CPU and on CUDA.

On the CPU the Triton kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET),
which is slow: sizes stay small there. The ``gpu`` tests repeat the order-sensitive cases many
times and check stream ordering with a side stream.
"""

from __future__ import annotations

import importlib.util

import _forkserver
import ml_dtypes
import numpy as np
import pytest

from jaxbuf.staged import SUPPORTED_DTYPES, FusedStagedWriter, StagedWriteTensor

pytest.importorskip("triton", reason="triton is not installed")

BF16 = np.dtype(ml_dtypes.bfloat16)
INPUT_KINDS = ["list", "tuple", "range", "generator", "numpy", "torch", "jax"]


# -- helpers ---------------------------------------------------------------------------------
def _np_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def _read(swt: StagedWriteTensor) -> np.ndarray:
    """A host copy of the target, after the applied writes."""
    if not swt.device.is_cuda:
        return swt.to_numpy().copy()
    import torch

    tensor = swt.to_torch()  # orders torch's current stream after the writes
    if swt.dtype.name == "bfloat16":
        return tensor.view(torch.int16).cpu().numpy().view(BF16)
    return tensor.cpu().numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(_bits(got), _bits(np.ascontiguousarray(want, got.dtype)))


def _source_values(rng, dtype_name: str, n: int, kind: str) -> np.ndarray:
    """Values exactly representable in the target dtype and in the input kind's own dtype
    (JAX without x64 holds int32 / float32 at most)."""
    dtype = _np_dtype(dtype_name)
    if dtype_name in ("int32", "int64"):
        if kind == "jax" or dtype_name == "int32":
            info = np.iinfo(np.int32)
        else:
            info = np.iinfo(np.int64)
        if kind == "range":
            first = int(rng.integers(info.min // 2, info.max // 2))
            return np.arange(first, first + n, dtype=dtype)
        return rng.integers(info.min, info.max, n, dtype=np.int64, endpoint=True).astype(dtype)
    if kind == "range":
        first = int(rng.integers(-100, 100))
        return np.arange(first, first + n).astype(dtype)
    return (rng.standard_normal(n) * 100).astype(np.float32).astype(dtype)


def _as_kind(values: np.ndarray, kind: str):
    if kind == "numpy":
        return values
    if kind == "list":
        return values.astype(np.float64).tolist() if values.dtype.kind != "i" else values.tolist()
    if kind == "tuple":
        return tuple(_as_kind(values, "list"))
    if kind == "generator":
        return (v for v in _as_kind(values, "list"))
    if kind == "range":
        start = int(values[0]) if len(values) else 0
        return range(start, start + len(values))
    if kind == "torch":
        torch = pytest.importorskip("torch")
        if values.dtype == BF16:
            return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(values.copy())
    if kind == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(values)
    raise AssertionError(kind)


def _random_round(rng, swt, model, kind, num_writes, overlap):
    """Stage ``num_writes`` random writes on ``swt`` and apply them to ``model`` in order."""
    num_rows, row_len = model.shape
    if overlap:
        rows = rng.integers(num_rows, size=num_writes)
    else:  # one write per row at most
        rows = rng.permutation(num_rows)[:num_writes]
    for row in rows.tolist():
        length = int(rng.integers(1, row_len + 1))
        start = int(rng.integers(0, row_len - length + 1))
        values = _source_values(rng, swt.dtype.name, length, kind)
        swt.stage_write(row, start, _as_kind(values, kind))
        model[row, start : start + length] = values


@pytest.fixture
def cleanup():
    """Tensors and writers made by a test are freed after it, pass or fail."""
    made = []
    yield made.append
    for obj in reversed(made):
        obj.close()


@pytest.fixture(params=["c", "numpy"])
def packer(request, monkeypatch):
    """The writer packs a slot with the C extension, or with its numpy fallback."""
    import jaxbuf.staged._packing as packing

    if request.param == "numpy":
        monkeypatch.setattr(packing, "c_pack", None)
    elif packing.c_pack is None:
        pytest.skip("jaxbuf._staging is not built")
    return request.param


def _swt(cleanup, *args, **kwargs) -> StagedWriteTensor:
    swt = StagedWriteTensor(*args, **kwargs)
    cleanup(swt)
    return swt


# -- exact writes ----------------------------------------------------------------------------
@pytest.mark.parametrize("uva", [False, True], ids=["device-memory", "uva"])
def test_exact_ragged_writes(device, uva, cleanup):
    swt = _swt(cleanup, (6, 10), "int32", device=device, uva_instead_of_gpu=uva)
    swt.stage_write(0, 0, [1, 2, 3])
    swt.stage_write(2, 4, np.array([4, 5, 6, 7, 8, 9], dtype=np.int32))
    swt.stage_write(5, 9, [10])
    swt.stage_write(3, 0, list(range(10)))
    swt.stage_write(4, 1, [])  # empty: staged as nothing
    assert swt.num_staged_writes == 4
    swt.apply_write()
    assert swt.num_staged_writes == 0
    expected = np.zeros((6, 10), np.int32)
    expected[0, :3] = [1, 2, 3]
    expected[2, 4:] = [4, 5, 6, 7, 8, 9]
    expected[5, 9] = 10
    expected[3] = np.arange(10)
    _assert_same(_read(swt), expected)
    assert swt.gpu.shape == (6, 10) and swt.gpu.dtype.name == "int32"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_float_writes(device, dtype, cleanup):
    swt = _swt(cleanup, (3, 5), dtype, device=device)
    swt.stage_write(0, 1, [0.5, -1.25, 3.0])
    swt.stage_write(2, 0, np.array([1.5, 2.5], dtype=_np_dtype(dtype)))
    swt.stage_write(1, 3, [7, -8])  # ints into a float target
    swt.stage_write_elem(1, 0.25)
    swt.apply_write()
    expected = np.zeros((3, 5), _np_dtype(dtype))
    expected[0, 1:4] = [0.5, -1.25, 3.0]
    expected[2, :2] = [1.5, 2.5]
    expected[1, 3:5] = [7, -8]
    expected[1, 0] = 0.25
    _assert_same(_read(swt), expected)


def test_float_rounding_is_accepted(cleanup):
    swt = _swt(cleanup, (1, 2), "float16", device="cpu", backend="numpy")
    swt.stage_write(0, 0, [0.1, 2049])  # neither is a float16; both round
    swt.apply_write()
    _assert_same(_read(swt), np.array([[0.1, 2049]]).astype(np.float16))


def test_stage_write_elem_on_1d_target(device, cleanup):
    swt = _swt(cleanup, 8, "int64", device=device)
    assert swt.gpu.shape == (8,) and (swt.num_rows, swt.row_len) == (8, 1)
    swt.stage_write_elem(3, 2**40)
    swt.stage_write_elem(np.int64(7), -5)
    swt.stage_write(0, 0, [11])
    swt.apply_write()
    _assert_same(_read(swt), np.array([11, 0, 0, 2**40, 0, 0, 0, -5]))
    with pytest.raises(IndexError):
        swt.stage_write(0, 0, [1, 2])  # a row of a 1-D target holds one element


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_randomized_rounds_against_numpy_model(device, dtype, kind, cleanup):
    if kind == "jax" and device == "cuda":
        pytest.importorskip("jax")
    rng = np.random.default_rng([SUPPORTED_DTYPES.index(dtype), INPUT_KINDS.index(kind)])
    swt = _swt(cleanup, (5, 12), dtype, device=device)
    model = np.zeros((5, 12), _np_dtype(dtype))
    for round_index in range(3):
        _random_round(rng, swt, model, kind, num_writes=6, overlap=round_index == 2)
        swt.apply_write()
        _assert_same(_read(swt), model)


def test_writes_longer_than_a_block(device, cleanup):
    swt = _swt(cleanup, (3, 3000), "float32", device=device)
    long_values = np.arange(2990, dtype=np.float32) + 0.5
    swt.stage_write(1, 7, long_values)
    swt.stage_write(2, 0, np.full(3000, -2.0, np.float32))
    swt.apply_write()
    expected = np.zeros((3, 3000), np.float32)
    expected[1, 7:2997] = long_values
    expected[2] = -2.0
    _assert_same(_read(swt), expected)


# -- the fused writer ------------------------------------------------------------------------
def _count_launches(writer, monkeypatch):
    calls = []
    launch = writer._launch

    def counting(args, *rest, **kwargs):
        calls.append(args.num_writes)
        return launch(args, *rest, **kwargs)

    monkeypatch.setattr(writer, "_launch", counting)
    return calls


def test_fused_writer_several_tables_one_never_staged(device, packer, cleanup, monkeypatch):
    tables = [_swt(cleanup, (4, 6), "int32", device=device) for _ in range(4)]
    writer = FusedStagedWriter(device, 8)
    cleanup(writer)
    launches = _count_launches(writer, monkeypatch)
    models = [np.zeros((4, 6), np.int32) for _ in tables]
    for step in range(3):
        for index, (swt, model) in enumerate(zip(tables, models)):
            if index == 2:
                continue  # never staged
            row = (step + index) % 4
            values = np.arange(index + 1, dtype=np.int32) + 100 * step
            swt.stage_write(row, 1, values)
            model[row, 1 : 2 + index] = values
        writer.apply(tables)
        assert all(t.num_staged_writes == 0 for t in tables)
        for swt, model in zip(tables, models):
            _assert_same(_read(swt), model)
    assert launches == [3, 3, 3]  # one launch per apply, of the writes staged
    writer.apply(tables)  # nothing staged: no launch
    assert len(launches) == 3


def test_mixed_dtypes_in_one_apply(device, packer, cleanup, monkeypatch):
    rng = np.random.default_rng(7)
    tables = [_swt(cleanup, (3, 9), dtype, device=device) for dtype in SUPPORTED_DTYPES]
    writer = FusedStagedWriter(device, 4)
    cleanup(writer)
    launches = _count_launches(writer, monkeypatch)
    models = [np.zeros((3, 9), _np_dtype(d)) for d in SUPPORTED_DTYPES]
    for _ in range(2):
        for swt, model in zip(tables, models):
            # Odd lengths put the next table's contents at a padded offset.
            _random_round(rng, swt, model, "numpy", num_writes=3, overlap=False)
        writer.apply(tables)
        for swt, model in zip(tables, models):
            _assert_same(_read(swt), model)
    assert len(launches) == 2


def _overlap_trial(rng, swt, writer_apply, num_writes=12, rows=2):
    model = _read(swt)
    num_rows, row_len = model.shape
    for _ in range(num_writes):
        row = int(rng.integers(rows))  # few rows: plenty of overlap
        length = int(rng.integers(1, row_len + 1))
        start = int(rng.integers(0, row_len - length + 1))
        values = rng.integers(-(2**31), 2**31, length).astype(np.int32)
        swt.stage_write(row, start, values)
        model[row, start : start + length] = values
    writer_apply()
    _assert_same(_read(swt), model)


def test_overlapping_writes_later_wins(device, packer, cleanup):
    rng = np.random.default_rng(3)
    swt = _swt(cleanup, (2, 40), "int32", device=device)
    for _ in range(10):
        _overlap_trial(rng, swt, swt.apply_write)


def test_overlapping_writes_across_many_rows(device, packer, cleanup):
    """Overlap in some rows among many: the launch is grouped by row, later still wins."""
    rng = np.random.default_rng(5)
    swt = _swt(cleanup, (16, 24), "int32", device=device)
    for _ in range(6):
        _overlap_trial(rng, swt, swt.apply_write, num_writes=40, rows=16)


@pytest.mark.gpu
def test_overlapping_writes_later_wins_200_trials_on_gpu(cleanup):
    rng = np.random.default_rng(4)
    swt = _swt(cleanup, (64, 2048), "int32", device="cuda")
    for trial in range(200):
        _overlap_trial(rng, swt, swt.apply_write, num_writes=64, rows=2 if trial % 2 else 64)


@pytest.mark.gpu
def test_large_applies_read_a_device_copy_and_match_the_model(cleanup):
    """Applies that pack at least DEVICE_COPY_MIN_BYTES are copied to device memory on the
    launch stream first; the result is the same later-wins result, slot reuse included."""
    from jaxbuf.staged._fused import DEVICE_COPY_MIN_BYTES

    rng = np.random.default_rng(11)
    shape = (256, 1024)
    tables = [StagedWriteTensor(shape, "int32", "cuda") for _ in range(2)]
    for table in tables:
        cleanup(table)
    writer = FusedStagedWriter("cuda", 64, max_concurrency=2)
    cleanup(writer)
    models = [np.zeros(shape, np.int32) for _ in tables]
    for round_ in range(6):
        large = round_ % 2 == 0  # small and large applies alternate over the two slots
        for table, model in zip(tables, models):
            for _ in range(1500 if large else 20):
                row, start = int(rng.integers(0, 8)), int(rng.integers(0, 1000))
                values = rng.integers(-(2**31), 2**31, int(rng.integers(1, 24)), dtype=np.int64)
                values = values.astype(np.int32)[: shape[1] - start]
                table.stage_write(row, start, values)
                model[row, start : start + len(values)] = values
        writer.apply(tables)
        copied = [slot.device_copy is not None for slot in writer._slots]
        assert any(copied) or not large
        for table, model in zip(tables, models):
            np.testing.assert_array_equal(table.to_torch().cpu().numpy(), model)
    assert max(slot.capacity for slot in writer._slots) >= DEVICE_COPY_MIN_BYTES


def test_overlaps_resolved_before_a_parallel_launch(packer, cleanup, monkeypatch):
    """Overlapping writes are resolved when packed (the earlier one trimmed to what stays
    visible), so every launch is the parallel one and its table has no overlap."""
    swt = _swt(cleanup, (4, 8), "int32", device="cpu", backend="numpy")
    swt.apply_write()  # nothing staged
    swt.stage_write(0, 0, [1])
    swt.apply_write()
    launches = _count_launches(swt._writer, monkeypatch)
    tables = []
    launch = swt._writer._launch

    def recording(args, raw_stream, host_tables=None, copy=None):
        tables.append(host_tables[0][:, 1:].copy())  # row, start, content_offset, length
        return launch(args, raw_stream, host_tables, copy)

    monkeypatch.setattr(swt._writer, "_launch", recording)
    swt.stage_write(1, 0, [1, 2])
    swt.stage_write(1, 4, [3, 4])  # same row, disjoint: kept as they are
    swt.stage_write(2, 0, [5])
    swt.apply_write()
    swt.stage_write(3, 0, [1, 2])
    swt.stage_write(3, 1, [9])  # overlaps: the first write keeps only its element 0
    swt.apply_write()
    assert launches == [3, 2]  # one launch per apply; the overlap resolved to two pieces
    assert tables[0].tolist() == [[1, 0, 0, 2], [1, 4, 8, 2], [2, 0, 16, 1]]
    assert tables[1].tolist() == [[3, 0, 0, 1], [3, 1, 8, 1]]
    _assert_same(
        _read(swt)[1:], np.array([[1, 2, 0, 0, 3, 4, 0, 0], [5] + [0] * 7, [1, 9] + [0] * 6])
    )


def test_fused_writer_rejects_bad_lists(device, cleanup):
    a = _swt(cleanup, (2, 2), "int32", device=device)
    writer = FusedStagedWriter(device, 2)
    cleanup(writer)
    a.stage_write(0, 0, [1])
    with pytest.raises(ValueError, match="twice"):
        writer.apply([a, a])
    with pytest.raises(TypeError):
        writer.apply([a, object()])
    assert a.num_staged_writes == 1  # nothing applied, nothing cleared
    if device != "cpu":
        b = _swt(cleanup, (2, 2), "int32", device="cpu")
        b.stage_write(0, 0, [1])
        with pytest.raises(ValueError, match="writer applies on"):
            writer.apply([a, b])


def test_output_ptrs_redirect_writes(device, cleanup):
    a = _swt(cleanup, (2, 4), "int32", device=device)
    b = _swt(cleanup, (4, 4), "int32", device=device)
    writer = FusedStagedWriter(device, 4)
    cleanup(writer)
    a.stage_write(1, 1, [5, 6])
    # Write a's rows as every other row of b.
    writer.apply([a], output_ptrs=[b.gpu.ptr], output_strides=[8])
    expected = np.zeros((4, 4), np.int32)
    expected[2, 1:3] = [5, 6]
    _assert_same(_read(b), expected)
    _assert_same(_read(a), np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError):
        writer.apply([a], output_ptrs=[b.gpu.ptr], output_strides=None)


def test_slots_grow_past_max_writes(device, packer, cleanup):
    swt = _swt(cleanup, (64, 300), "int64", device=device, max_concurrency=1)
    writer = FusedStagedWriter(device, 1, max_concurrency=1)
    cleanup(writer)
    expected = np.zeros((64, 300), np.int64)
    for step in range(2):
        for row in range(64):
            values = np.full(300, row * 1000 + step, np.int64)
            swt.stage_write(row, 0, values)
            expected[row] = values
        writer.apply([swt])
        _assert_same(_read(swt), expected)


# -- rejected input --------------------------------------------------------------------------
BAD_WRITES = [
    (IndexError, lambda s: s.stage_write(-1, 0, [1])),
    (IndexError, lambda s: s.stage_write(4, 0, [1])),
    (IndexError, lambda s: s.stage_write(0, -1, [1])),
    (IndexError, lambda s: s.stage_write(0, 5, [1])),
    (IndexError, lambda s: s.stage_write(0, 3, [1, 2, 3])),
    (IndexError, lambda s: s.stage_write(1, 0, np.arange(6, dtype=np.int32))),
    (IndexError, lambda s: s.stage_write_elem(9, 1)),
    (TypeError, lambda s: s.stage_write(True, 0, [1])),
    (TypeError, lambda s: s.stage_write(1.0, 0, [1])),
    (TypeError, lambda s: s.stage_write(0, "0", [1])),
    (ValueError, lambda s: s.stage_write(0, 0, [1.5])),
    (ValueError, lambda s: s.stage_write(0, 0, [2**31])),
    (ValueError, lambda s: s.stage_write(0, 0, np.array([2**40]))),
    (ValueError, lambda s: s.stage_write(0, 0, [float("nan")])),
    (ValueError, lambda s: s.stage_write(0, 0, np.array([1.0, np.inf]))),
    (ValueError, lambda s: s.stage_write(0, 0, np.array([-(2**31) - 1]))),
    (ValueError, lambda s: s.stage_write_elem(0, 2**31)),
    (ValueError, lambda s: s.stage_write_elem(0, 0.5)),
    (TypeError, lambda s: s.stage_write(0, 0, "12")),
    (TypeError, lambda s: s.stage_write(0, 0, 5)),
    (TypeError, lambda s: s.stage_write(0, 0, [1 + 2j])),
    (TypeError, lambda s: s.stage_write(0, 0, [None])),
    (ValueError, lambda s: s.stage_write(0, 0, np.zeros((2, 2), np.int32))),
    (ValueError, lambda s: s.stage_write(0, 0, [[1, 2]])),
    (ValueError, lambda s: s.stage_write(0, 0, (1, 2.5))),
    (ValueError, lambda s: s.stage_write(0, 0, np.array([1, 2**31], np.uint32))),
]


@pytest.mark.parametrize("error, write", BAD_WRITES)
def test_rejected_writes_stage_nothing(device, error, write, cleanup):
    swt = _swt(cleanup, (4, 5), "int32", device=device)
    swt.stage_write(2, 1, [7, 8])
    with pytest.raises(error):
        write(swt)
    assert swt.num_staged_writes == 1
    swt.apply_write()
    expected = np.zeros((4, 5), np.int32)
    expected[2, 1:3] = [7, 8]
    _assert_same(_read(swt), expected)


@pytest.mark.parametrize(
    "dtype, values",
    [
        ("float16", [70000.0]),
        ("float16", [1, 2**20]),
        ("bfloat16", [1e39]),
        ("float32", np.array([1e300])),
        ("int64", [2**63]),
        ("int64", np.array([2.0**63])),
    ],
)
def test_overflow_is_rejected(dtype, values, cleanup):
    swt = _swt(cleanup, (1, 2), dtype, device="cpu", backend="numpy")
    with pytest.raises(ValueError):
        swt.stage_write(0, 0, values)
    assert swt.num_staged_writes == 0


def test_integral_floats_and_bools_are_accepted_for_int_targets(cleanup):
    swt = _swt(cleanup, (2, 3), "int64", device="cpu", backend="numpy")
    swt.stage_write(0, 0, [1.0, -(2.0**63), 2.0**62])
    swt.stage_write_elem(0, np.float32(4.0))
    swt.stage_write(1, 0, [True, False])
    swt.stage_write(1, 2, np.array([True]))
    swt.apply_write()
    _assert_same(_read(swt), np.array([[4, -(2**63), 2**62], [1, 0, 1]]))


@pytest.mark.parametrize(
    "dtype", ["int8", "uint8", "float64", "bool", "int16", "complex64", "not-a-dtype"]
)
def test_bad_dtypes_rejected(dtype):
    with pytest.raises(TypeError, match="int32, int64, float32, float16, bfloat16"):
        StagedWriteTensor((2, 2), dtype, device="cpu")


@pytest.mark.parametrize("size", [(2, 3, 4), -1, (2, -3), (2.0, 3), "4"])
def test_bad_sizes_rejected(size):
    with pytest.raises((TypeError, ValueError)):
        StagedWriteTensor(size, "int32", device="cpu")


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="backend"):
        StagedWriteTensor((2, 2), "int32", device="cpu", backend="cupy")
    with pytest.raises(ValueError, match="max_concurrency"):
        StagedWriteTensor((2, 2), "int32", device="cpu", max_concurrency=0)
    with pytest.raises(ValueError, match="max_writes"):
        FusedStagedWriter("cpu", 0)


def test_missing_triton_names_the_numpy_backend(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(ImportError, match="backend='numpy'"):
        StagedWriteTensor((2, 2), "int32", device="cpu")


@pytest.mark.gpu
def test_numpy_backend_refused_on_gpu():
    with pytest.raises(ValueError, match="backend='numpy'"):
        StagedWriteTensor((2, 2), "int32", device="cuda", backend="numpy")
    with pytest.raises(ValueError, match="backend='numpy'"):
        FusedStagedWriter("cuda", 4, backend="numpy")


# -- backends --------------------------------------------------------------------------------
def test_numpy_backend_equals_triton(cleanup):
    rng = np.random.default_rng(11)
    pair = [_swt(cleanup, (6, 20), "float16", device="cpu", backend=b) for b in ("triton", "numpy")]
    model = np.zeros((6, 20), np.float16)
    for round_index in range(3):
        state = rng.bit_generator.state
        for swt in pair:
            rng.bit_generator.state = state
            _random_round(rng, swt, model, "numpy", num_writes=8, overlap=round_index > 0)
            swt.apply_write()
        _assert_same(_read(pair[0]), _read(pair[1]))
        _assert_same(_read(pair[0]), model)


# -- lifetime --------------------------------------------------------------------------------
def test_free_is_idempotent_and_final(device):
    with StagedWriteTensor((2, 3), "float32", device=device) as swt:
        swt.stage_write(0, 0, [1.0])
        swt.apply_write()
        swt.stage_write(1, 0, [2.0])
    assert swt.freed and swt.num_staged_writes == 0
    swt.free()
    swt.close()
    with pytest.raises(ValueError, match="freed"):
        swt.stage_write(0, 0, [1.0])
    with pytest.raises(ValueError, match="freed"):
        swt.gpu
    writer = FusedStagedWriter(device, 4)
    writer.close()
    writer.close()


# Ownership: an exported array keeps the target memory; free() means "I am done".
FREE_WITH_LIVE_EXPORT = """
import gc
import numpy as np
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.staged import StagedWriteTensor
from jaxbuf.testing import FaultInjectingDriver

driver = FaultInjectingDriver(get_vmm_driver("cpu"))
def made():
    swt = StagedWriteTensor((4, 8), "int32", "cpu", uva_instead_of_gpu={uva},
                            backend="numpy", driver=driver)
    swt.stage_write(1, 2, np.array([7, 8, 9], np.int32))
    swt.apply_write()
    return swt
swt = made()
array = {consume}
swt.free()
assert swt.freed and not swt.released and swt.live_exports == 1, repr(swt)
# New tensors must not land on the freed tensor's memory while the array uses it.
others = [made() for _ in range(4)]
for other in others:
    other.stage_write(1, 2, [-1, -1, -1])
    other.apply_write()
assert np.asarray({read})[1, 2:5].tolist() == [7, 8, 9]
del array
gc.collect()
assert swt.released and swt.live_exports == 0, repr(swt)
for other in others:
    other.free()
driver.assert_clean()
print("done")
"""
CONSUMERS = {
    "numpy": ("swt.to_numpy()", "array"),
    "numpy-dlpack": ("np.from_dlpack(swt.gpu)", "array"),
    "torch": ("__import__('torch').from_dlpack(swt.gpu)", "array.numpy()"),
    "jax": ("__import__('jax').dlpack.from_dlpack(swt.gpu)", "array"),
}


@pytest.mark.parametrize("uva", [False, True], ids=["device-memory", "uva"])
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_free_with_a_live_export_keeps_the_memory_until_it_is_dropped(consumer, uva):
    import sys

    module = {"torch": "torch", "jax": "jax"}.get(consumer)
    if module is not None:
        pytest.importorskip(module, reason=f"{module} is not installed")
    consume, read = CONSUMERS[consumer]
    source = FREE_WITH_LIVE_EXPORT.format(uva=uva, consume=consume, read=read)
    result = _forkserver.run([sys.executable, "-X", "dev", "-c", source], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done" in result.stdout, result.stdout
    for bad in ("Traceback", "Exception ignored", "ResourceWarning", "Fatal Python error"):
        assert bad not in result.stderr, result.stderr[-3000:]


def test_free_without_exports_releases_at_once_after_quiescing(monkeypatch):
    from jaxbuf import interop

    swt = StagedWriteTensor((2, 4), "int32", device="cpu", backend="numpy")
    swt.stage_write(0, 0, [1, 2])
    swt.apply_write()
    quiesced = []
    monkeypatch.setattr(
        interop, "quiesce", lambda device: quiesced.append((device, swt.released)), raising=False
    )
    assert swt.live_exports == 0 and not swt.released
    swt.free()
    # Quiesced before the release (the buffers beneath may quiesce again on their own).
    assert swt.released and quiesced and quiesced[0] == (swt.device, False)
    calls = len(quiesced)
    swt.free()
    assert len(quiesced) == calls


def test_every_use_after_free_raises(device):
    swt = StagedWriteTensor((2, 3), "int32", device=device)
    other = StagedWriteTensor((2, 3), "int32", device=device)
    view = swt.gpu
    swt.stage_write(0, 0, [1])
    swt.free()  # drops the staged write: an apply after free() must not look like it ran
    uses = (
        swt.apply_write,
        lambda: swt.stage_write(0, 0, [1]),
        lambda: swt.stage_write(0, 0, np.array([1], np.int32)),  # the C fast path
        lambda: swt.stage_write_elem(0, 1),
        lambda: swt.gpu,
        view.__dlpack__,  # a view taken before free()
        swt.check_exportable,
    )
    for use in uses:
        with pytest.raises(RuntimeError, match="freed"):
            use()
    writer = FusedStagedWriter(device, 4)
    other.stage_write(1, 0, [5])
    with pytest.raises(RuntimeError, match="freed"):
        writer.apply([other, swt])
    assert other.num_staged_writes == 1  # refused whole: nothing applied, nothing cleared
    writer.apply([other])
    assert _read(other)[1].tolist() == [5, 0, 0]
    writer.close()
    other.stage_write(0, 0, [1])
    with pytest.raises(RuntimeError, match="closed"):
        writer.apply([other])
    other.free()


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_owners_refuse_pickling_and_copying(how, cleanup):
    import copy
    import pickle

    swt = _swt(cleanup, (2, 2), "int32", device="cpu", backend="numpy")
    writer = FusedStagedWriter("cpu", 2, backend="numpy")
    cleanup(writer)
    operation = {"pickle": pickle.dumps, "copy": copy.copy, "deepcopy": copy.deepcopy}[how]
    for obj in (swt, writer):
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            operation(obj)


def test_clear_staged_writes(cleanup):
    swt = _swt(cleanup, (2, 2), "int32", device="cpu", backend="numpy")
    swt.stage_write(0, 0, [1, 2])
    swt.stage_write_elem(1, 3)
    swt.clear_staged_writes()
    assert swt.num_staged_writes == 0
    swt.apply_write()
    _assert_same(_read(swt), np.zeros((2, 2), np.int32))


# -- consumers and streams -------------------------------------------------------------------
def test_frameworks_see_the_writes(device, framework, cleanup):
    swt = _swt(cleanup, (3, 4), "float32", device=device)
    swt.stage_write(1, 0, [1.0, 2.0, 3.0, 4.0])
    swt.apply_write()
    expected = np.zeros((3, 4), np.float32)
    expected[1] = [1, 2, 3, 4]
    if framework == "torch":
        import torch

        tensor = torch.from_dlpack(swt.gpu)
        assert tensor.data_ptr() == swt.gpu.ptr
        np.testing.assert_array_equal(tensor.cpu().numpy(), expected)
    else:
        import jax

        array = jax.dlpack.from_dlpack(swt.gpu)
        assert array.unsafe_buffer_pointer() == swt.gpu.ptr
        np.testing.assert_array_equal(np.asarray(array), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [True, False])
def test_side_stream_steps_two_in_flight(guarded, cleanup):
    import torch

    side = torch.cuda.Stream()
    swt = _swt(cleanup, (16, 64), "int32", device="cuda", max_concurrency=2)
    writer = FusedStagedWriter("cuda", 8, max_concurrency=2, guarded=guarded)
    cleanup(writer)
    rng = np.random.default_rng(5)
    model = np.zeros((16, 64), np.int32)
    snapshots, expected, done = [], [], []
    with torch.cuda.stream(side):
        target = swt.to_torch()
        for step in range(24):
            if not guarded and step >= 2:
                done[step - 2].synchronize()  # the caller's promise: two in flight at most
            for _ in range(8):
                row, start = int(rng.integers(16)), int(rng.integers(60))
                values = rng.integers(0, 2**31, 4).astype(np.int32)
                swt.stage_write(row, start, values)
                model[row, start : start + 4] = values
            torch.cuda._sleep(200_000)  # keep the device behind the host
            writer.apply([swt], stream=side)
            snapshots.append(target.clone())
            event = torch.cuda.Event()
            event.record(side)
            done.append(event)
            expected.append(model.copy())
    torch.cuda.synchronize()
    for step, (snapshot, want) in enumerate(zip(snapshots, expected)):
        np.testing.assert_array_equal(snapshot.cpu().numpy(), want, err_msg=f"step {step}")


@pytest.mark.gpu
def test_consumers_on_another_stream_wait_for_the_writes(framework, cleanup):
    import torch

    side = torch.cuda.Stream()
    swt = _swt(cleanup, (4, 1 << 16), "float32", device="cuda")
    values = np.arange(1 << 16, dtype=np.float32)
    swt.stage_write(3, 0, values)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the write lands long after the host moves on
        swt.apply_write()
    if framework == "torch":
        tensor = torch.from_dlpack(swt.gpu)  # on the current stream, which waits
        got = tensor[3].clone().cpu().numpy()
    else:
        import jax

        got = np.asarray(jax.dlpack.from_dlpack(swt.gpu))[3]
    np.testing.assert_array_equal(got, values)


def test_c_and_python_staging_paths_agree(cleanup):
    """The C fast path and the Python path stage byte-identical records and contents."""
    rng = np.random.default_rng(12)
    fast = _swt(cleanup, (8, 16), "int64", device="cpu", backend="numpy")
    slow = _swt(cleanup, (8, 16), "int64", device="cpu", backend="numpy")
    slow._stage_fast = None
    random_values = rng.integers(-(2**63), 2**63 - 1, 12)
    for swt in (fast, slow):
        swt.stage_write(1, 2, np.arange(5, dtype=np.int64))
        swt.stage_write(2, 0, np.arange(10, dtype=np.int64)[::2])  # not contiguous
        swt.stage_write(3, 1, np.arange(3, dtype=">i8"))  # another byte order
        swt.stage_write(4, 0, np.arange(3, dtype=np.int32))  # another dtype
        swt.stage_write(np.int64(5), 0, np.arange(2, dtype=np.int64))  # a numpy index
        swt.stage_write(6, 4, random_values)
        swt.stage_write(7, 0, np.array([], np.int64))
    assert bytes(fast.staging.records) == bytes(slow.staging.records)
    assert bytes(fast.staging.contents) == bytes(slow.staging.contents)
    for error, bad in ((IndexError, (8, 0)), (IndexError, (0, 15)), (TypeError, (True, 0))):
        with pytest.raises(error):
            fast.stage_write(*bad, np.arange(2, dtype=np.int64))
    assert fast.num_staged_writes == slow.num_staged_writes == 6


class _ArraySubclass(np.ndarray):
    pass


def _unusual_arrays(dtype: str) -> dict[str, np.ndarray]:
    """Value arrays the C stager must not read as plain arrays of the target dtype (they take
    the converting path) beside ones it may; every one holds 1, 2, 3, 4 as the target dtype."""
    plain = np.arange(1, 5, dtype=dtype)
    swapped = plain.astype(plain.dtype.newbyteorder())
    readonly = plain.copy()
    readonly.flags.writeable = False
    return {
        "plain": plain,
        "byte-swapped": swapped,
        "strided": np.repeat(plain, 2)[::2],
        "other dtype": plain.astype(np.float64 if dtype == "int32" else np.int16),
        "subclass": plain.view(_ArraySubclass),
        "read-only": readonly,
        "2-D row": plain.reshape(1, 4)[0],
        "from a 2-D column": np.ascontiguousarray(plain.reshape(4, 1))[:, 0],
    }


@pytest.mark.parametrize("dtype", ["int32", "float32", "float16", "int64"])
def test_every_kind_of_value_array_is_staged_exactly(dtype, cleanup):
    # The C stager reads exact, contiguous, native-order numpy arrays of the target dtype
    # through numpy's C API; every other array goes through the buffer protocol or converts.
    arrays = _unusual_arrays(dtype)
    swt = _swt(cleanup, (len(arrays), 8), dtype, device="cpu")
    for row, values in enumerate(arrays.values()):
        swt.stage_write(row, row % 4, values)
    swt.apply_write()
    want = np.zeros((len(arrays), 8), dtype)
    for row in range(len(arrays)):
        want[row, row % 4 : row % 4 + 4] = [1, 2, 3, 4]
    _assert_same(_read(swt), want)
    # The same through the JAX stager's bulk path (one C loop, or the converting fallback).
    pytest.importorskip("jax")
    from jaxbuf.jax_ops import StagedWrites

    staged = StagedWrites(len(arrays), 8, dtype)
    staged.stage_writes(
        list(range(len(arrays))), [r % 4 for r in range(len(arrays))], list(arrays.values())
    )
    packed = staged.pack()
    got = np.zeros((len(arrays), 8), dtype)
    kept = packed.element_rows != 2**31 - 1
    got[packed.element_rows[kept], packed.element_cols[kept]] = packed.values[kept]
    np.testing.assert_array_equal(got, want)


# -- sizes, errors and the vocabulary shared with the other owners ---------------------------
def test_a_tensors_own_writer_is_sized_for_the_writes_staged(cleanup):
    # A tall tensor with one staged write: the slots are sized for that write (and grow by
    # powers of two), never for one write per row (2**20 rows would reserve 128 MiB a slot).
    swt = _swt(cleanup, (2**20, 1), "int32", device="cpu", backend="numpy")
    swt.stage_write_elem(5, 3)
    swt.apply_write()
    writer = swt._writer
    assert 0 < writer.nbytes <= 64 << 10, writer
    for row in range(2000):  # more than the first slot holds: it grows
        swt.stage_write_elem(row, row)
    swt.apply_write()
    assert writer.nbytes <= 1 << 20, writer
    assert swt.to_numpy()[1999, 0] == 1999 and swt.to_numpy()[5, 0] == 5


def test_apply_takes_any_iterable_once_and_names_what_is_not_a_tensor(cleanup):
    swt = _swt(cleanup, (4, 4), "int32", device="cpu", backend="numpy")
    writer = FusedStagedWriter("cpu", 4, backend="numpy")
    cleanup(writer)
    swt.stage_write(1, 1, [7])
    writer.apply(t for t in [swt])  # a generator: read once, and applied
    assert swt.num_staged_writes == 0 and swt.to_numpy()[1, 1] == 7
    pytest.importorskip("jax")
    from jaxbuf.jax_ops import StagedWrites

    swt.stage_write(0, 0, [1])
    staged = StagedWrites(4, 4, "int32")
    staged.stage_write(0, 0, [1])
    for bad, named in (
        ([staged], "StagedWrites.*apply_staged_writes"),
        ([swt, 3], "int"),
        (5, "int"),
    ):
        with pytest.raises(TypeError, match=named):
            writer.apply(bad)
    assert swt.num_staged_writes == 1 and staged.num_staged_writes == 1  # nothing applied


def test_the_writer_takes_the_seeds_argument_order(cleanup):
    writer = FusedStagedWriter("cpu", 8, 3, backend="numpy")
    cleanup(writer)
    assert (writer.max_writes, writer.max_concurrency, str(writer.device)) == (8, 3, "cpu")
    with pytest.raises(TypeError, match=r"\(device, max_writes, max_concurrency\)"):
        FusedStagedWriter(8, "cpu", backend="numpy")  # the order jaxbuf once had
    with pytest.raises(ValueError, match="max_writes must be"):
        FusedStagedWriter("cpu", 0, backend="numpy")
    with pytest.raises(ValueError, match="device_copy_min_bytes"):
        FusedStagedWriter("cpu", 8, backend="numpy", device_copy_min_bytes=-1)


def test_staged_classes_print_their_state(cleanup):
    swt = _swt(cleanup, (4, 8), "int32", device="cpu", backend="numpy")
    assert swt.nbytes == 4 * 8 * 4
    writer = FusedStagedWriter("cpu", 4, backend="numpy")
    cleanup(writer)
    assert repr(writer) == (
        "FusedStagedWriter(device=cpu, max_writes=4, max_concurrency=2, backend='numpy', nbytes=0)"
    )
    swt.stage_write(0, 0, [1])
    writer.apply([swt])
    assert writer.nbytes > 0 and f"nbytes={writer.nbytes}" in repr(writer)
    writer.close()
    assert writer.closed and repr(writer).endswith("closed)")
