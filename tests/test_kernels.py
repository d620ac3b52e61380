"""The Triton staged-write kernel (under the interpreter on the CPU) against the numpy reference.

Launches pass ``interpret=True`` explicitly, so these tests do not depend on whether
``TRITON_INTERPRET`` was set before Triton was first imported. The ``gpu`` tests run the compiled
kernel on CUDA memory.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbuf.kernels import (
    apply_staged_writes_numpy,
    has_overlap,
    make_group_table,
    make_write_table,
    pack_contents,
    row_segments,
)

triton = pytest.importorskip("triton", reason="triton is not installed")
from jaxbuf.kernels.staged_write import apply_staged_writes  # noqa: E402

DTYPES = [np.int32, np.int64, np.float32, np.float16, ml_dtypes.bfloat16, np.int8]


def _random_values(rng, dtype, n):
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype == ml_dtypes.bfloat16:
        # Random bit patterns (NaN payloads included) check that only bits move.
        bits = rng.integers(0, 2 ** (8 * dtype.itemsize), n, dtype=np.uint64)
        return bits.astype(f"u{dtype.itemsize}").view(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


class Case:
    """Targets, tables and contents for one apply; ``expected`` from the numpy reference."""

    def __init__(self, targets, writes):
        self.targets = targets
        self.expected = [t.copy() for t in targets]
        groups, rows, starts, values = zip(*writes) if writes else ((), (), (), ())
        self.contents, offsets = pack_contents(list(values))
        lengths = [v.shape[0] for v in values]
        self.groups, self.rows, self.starts, self.lengths = groups, rows, starts, lengths
        self.write_table = make_write_table(groups, rows, starts, offsets, lengths)
        self.group_table = make_group_table(
            [t.ctypes.data for t in targets],
            [t.strides[0] // t.itemsize for t in targets],
            [t.itemsize for t in targets],
        )
        expected_table = make_group_table(
            [t.ctypes.data for t in self.expected], self.group_table[:, 1], self.group_table[:, 2]
        )
        apply_staged_writes_numpy(self.write_table, expected_table, self.contents)

    def check(self):
        for got, want in zip(self.targets, self.expected):
            np.testing.assert_array_equal(
                got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}")
            )


def _random_case(rng, num_groups=3, num_writes=20, max_len=40, overlap=False):
    targets = []
    for _ in range(num_groups):
        dtype = DTYPES[rng.integers(len(DTYPES))]
        targets.append(_random_values(rng, dtype, 6 * 64).reshape(6, 64))
    writes, used = [], set()
    for _ in range(num_writes):
        group = int(rng.integers(num_groups))
        row = int(rng.integers(6))
        length = int(rng.integers(0, max_len + 1))
        start = int(rng.integers(0, 64 - length + 1))
        if not overlap:
            cells = {(group, row, c) for c in range(start, start + length)}
            if cells & used:
                continue
            used |= cells
        writes.append((group, row, start, _random_values(rng, targets[group].dtype, length)))
    return Case(targets, writes)


def test_exact_ragged_writes():
    target = np.zeros((3, 8), np.int32)
    case = Case(
        [target],
        [
            (0, 0, 0, np.array([1, 2, 3], np.int32)),
            (0, 2, 5, np.array([4, 5, 6], np.int32)),
            (0, 1, 2, np.array([7], np.int32)),
            (0, 1, 4, np.array([], np.int32)),
        ],
    )
    apply_staged_writes(case.write_table, case.group_table, case.contents, interpret=True)
    np.testing.assert_array_equal(
        target, [[1, 2, 3, 0, 0, 0, 0, 0], [0, 0, 7, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 4, 5, 6]]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_bits_exact_per_dtype(dtype):
    rng = np.random.default_rng(0)
    target = _random_values(rng, dtype, 4 * 33).reshape(4, 33)
    case = Case([target], [(0, r, r, _random_values(rng, dtype, 30 - r)) for r in range(4)])
    apply_staged_writes(case.write_table, case.group_table, case.contents, interpret=True)
    case.check()


@pytest.mark.parametrize("serial", [False, True])
def test_writes_longer_than_block(serial):
    rng = np.random.default_rng(1)
    target = np.zeros((2, 1000), np.float32)
    case = Case(
        [target],
        [
            (0, 0, 3, _random_values(rng, np.float32, 997)),
            (0, 1, 0, _random_values(rng, np.float32, 130)),
        ],
    )
    apply_staged_writes(
        case.write_table,
        case.group_table,
        case.contents,
        serial=serial,
        block_size=64,
        interpret=True,
    )
    case.check()


def test_mixed_dtypes_one_launch_and_one_group_never_written():
    rng = np.random.default_rng(2)
    targets = [
        np.zeros((4, 16), d)
        for d in (np.int32, np.int64, np.float32, np.float16, ml_dtypes.bfloat16)
    ]
    untouched = 3
    writes = [
        (g, g % 4, g, _random_values(rng, targets[g].dtype, 9))
        for g in range(len(targets))
        if g != untouched
    ]
    case = Case(targets, writes)
    apply_staged_writes(case.write_table, case.group_table, case.contents, interpret=True)
    case.check()
    assert not targets[untouched].any()


def test_strided_rows():
    # row_stride larger than the row: a view into a wider table.
    base = np.zeros((3, 20), np.int64)
    view = base[:, 4:10]
    case = Case([np.ascontiguousarray(view)], [(0, 1, 2, np.arange(3, dtype=np.int64))])
    group_table = make_group_table([view.ctypes.data], [20], [8])
    apply_staged_writes(case.write_table, group_table, case.contents, interpret=True)
    np.testing.assert_array_equal(view, case.expected[0])
    assert base[:, :4].sum() == 0 and base[:, 10:].sum() == 0


def test_overlapping_writes_serial_later_wins():
    target = np.zeros((2, 10), np.int32)
    writes = [
        (0, 0, 0, np.full(8, 1, np.int32)),
        (0, 0, 2, np.full(3, 2, np.int32)),
        (0, 0, 4, np.full(6, 3, np.int32)),
        (0, 1, 0, np.full(4, 4, np.int32)),
        (0, 1, 1, np.full(2, 5, np.int32)),
    ]
    case = Case([target], writes)
    assert has_overlap(case.groups, case.rows, case.starts, case.lengths)
    apply_staged_writes(
        case.write_table,
        case.group_table,
        case.contents,
        serial=True,
        block_size=16,
        interpret=True,
    )
    np.testing.assert_array_equal(
        target, [[1, 1, 2, 2, 3, 3, 3, 3, 3, 3], [4, 5, 5, 4, 0, 0, 0, 0, 0, 0]]
    )


@pytest.mark.parametrize("seed", range(8))
def test_random_rounds_against_reference(seed):
    rng = np.random.default_rng(100 + seed)
    overlap = seed % 2 == 1
    case = _random_case(rng, num_groups=int(rng.integers(1, 5)), overlap=overlap)
    serial = has_overlap(case.groups, case.rows, case.starts, case.lengths)
    apply_staged_writes(
        case.write_table,
        case.group_table,
        case.contents,
        serial=serial,
        block_size=16,
        interpret=True,
    )
    case.check()


@pytest.mark.parametrize("seed", range(6))
def test_row_segmented_serial_launch_later_wins(seed):
    """Overlapping writes grouped by row: one program per row, each in staging order."""
    rng = np.random.default_rng(200 + seed)
    case = _random_case(rng, num_groups=int(rng.integers(1, 4)), num_writes=40, overlap=True)
    staged = case.write_table.copy()
    segments = row_segments(case.write_table)
    # Same writes, grouped by (group, row), each row's writes still in staging order.
    order = np.lexsort((staged[:, 1], staged[:, 0]))
    np.testing.assert_array_equal(case.write_table, staged[order])
    keys = case.write_table[:, :2]
    assert segments[0] == 0 and segments[-1] == len(staged)
    for first, end in zip(segments[:-1], segments[1:]):
        assert end > first and (keys[first:end] == keys[first]).all()
    assert len(np.unique(keys, axis=0)) == len(segments) - 1
    apply_staged_writes(
        case.write_table,
        case.group_table,
        case.contents,
        serial=True,
        segments=segments,
        block_size=16,
        interpret=True,
    )
    case.check()


@pytest.mark.parametrize("serial", [False, True])
def test_kernel_compiles_for_hopper(serial):
    """The kernel goes through Triton's CUDA compiler (to sm_90 machine code) without a GPU,
    so CI catches what the interpreter accepts and the compiler rejects."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        pytest.skip(f"this Triton cannot compile offline: {error}")
    from triton.runtime.jit import JITFunction

    from jaxbuf.kernels.staged_write import _apply_staged_writes_kernel

    # Under TRITON_INTERPRET the decorated kernel is interpreted: compile its function.
    kernel = JITFunction(_apply_staged_writes_kernel.fn)
    signature = {
        "write_table_addr": "i64",
        "group_table_addr": "i64",
        "contents_addr": "i64",
        "num_writes": "i32",
        "segments_addr": "i64",
        "BLOCK_SIZE": "constexpr",
        "SERIAL": "constexpr",
    }
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={"BLOCK_SIZE": 1024, "SERIAL": serial}
    )
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except (RuntimeError, FileNotFoundError) as error:
        if "ptxas" in str(error):
            pytest.skip(f"no ptxas here: {error}")
        raise
    assert compiled.asm["cubin"]


def test_num_writes_prefix_only():
    target = np.zeros((1, 4), np.int32)
    case = Case([target], [(0, 0, 0, np.array([1], np.int32)), (0, 0, 1, np.array([2], np.int32))])
    apply_staged_writes(case.write_table, case.group_table, case.contents, 1, interpret=True)
    np.testing.assert_array_equal(target, [[1, 0, 0, 0]])


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(write_table=np.zeros((2, 4), np.int64)), ValueError),
        (dict(write_table=np.zeros((2, 5), np.int32)), ValueError),
        (dict(group_table=np.zeros((1, 2), np.int64)), ValueError),
        (dict(num_writes=3), ValueError),
        (dict(block_size=48), ValueError),
        (dict(contents="nope"), TypeError),
    ],
)
def test_rejects_bad_arguments(bad, error):
    target = np.zeros((1, 4), np.int32)
    case = Case([target], [(0, 0, 0, np.array([1, 2], np.int32))] * 2)
    args = dict(
        write_table=case.write_table,
        group_table=case.group_table,
        contents=case.contents,
        num_writes=None,
        block_size=16,
    )
    args.update(bad)
    with pytest.raises(error):
        apply_staged_writes(
            args.pop("write_table"),
            args.pop("group_table"),
            args.pop("contents"),
            args.pop("num_writes"),
            interpret=True,
            **args,
        )
    assert not target.any()


def test_rejects_unaligned_contents_and_bad_elem_size():
    target = np.zeros((1, 4), np.int32)
    case = Case([target], [(0, 0, 0, np.array([1], np.int32))])
    with pytest.raises(ValueError, match="aligned"):
        apply_staged_writes(
            case.write_table, case.group_table, case.contents.ctypes.data + 4, interpret=True
        )
    with pytest.raises(ValueError, match="elem_size"):
        make_group_table([target.ctypes.data], [4], [3])
    assert not target.any()


def _brute_force_overlap(groups, rows, starts, lengths):
    seen = set()
    for g, r, s, n in zip(groups, rows, starts, lengths):
        cells = {(g, r, c) for c in range(s, s + n)}
        if cells & seen:
            return True
        seen |= cells
    return False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 12), st.integers(0, 5)),
        max_size=12,
    )
)
def test_has_overlap_matches_brute_force(writes):
    columns = list(zip(*writes)) if writes else [(), (), (), ()]
    assert has_overlap(*columns) == _brute_force_overlap(*columns)


@pytest.mark.gpu
@pytest.mark.parametrize("serial", [False, True])
def test_compiled_kernel_on_cuda_memory(serial):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    for trial in range(50 if serial else 10):
        case = _random_case(rng, num_groups=4, num_writes=64, max_len=64, overlap=serial)
        targets = [
            torch.from_numpy(t.view(f"u{t.itemsize}").astype(f"i{t.itemsize}")).cuda()
            for t in case.targets
        ]
        group_table = case.group_table.copy()
        group_table[:, 0] = [t.data_ptr() for t in targets]
        write_table = torch.from_numpy(case.write_table).cuda()
        contents = torch.from_numpy(case.contents).cuda()
        apply_staged_writes(
            write_table,
            torch.from_numpy(group_table).cuda(),
            contents,
            case.write_table.shape[0],
            serial=serial,
            block_size=32,
            interpret=False,
        )
        torch.cuda.synchronize()
        for got, want in zip(targets, case.expected):
            np.testing.assert_array_equal(
                got.cpu().numpy(), want.view(f"i{want.itemsize}"), err_msg=f"trial {trial}"
            )
