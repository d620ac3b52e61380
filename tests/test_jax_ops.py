"""jaxbuf.jax_ops: staged writes on one 2-D JAX array inside jit, against a numpy model."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from conftest import row_writes_model

jax = pytest.importorskip("jax", reason="jax is not installed")
import jax.numpy as jnp  # noqa: E402

from jaxbuf.jax_ops import (  # noqa: E402
    MIN_BUCKET,
    PackedWrites,
    StagedWrites,
    apply_staged_writes,
    bucket_size,
    pack_writes,
)

METHODS = ["pallas", "scatter"]
SHAPE = (6, 40)


def _random_writes(rng, num_writes, dtype, shape=SHAPE, max_len=30):
    rows, starts, values_list = [], [], []
    for _ in range(num_writes):
        length = int(rng.integers(0, max_len + 1))
        rows.append(int(rng.integers(shape[0])))
        starts.append(int(rng.integers(0, shape[1] - length + 1)))
        values_list.append((rng.standard_normal(length) * 100).astype(dtype))
    return rows, starts, values_list


@pytest.fixture(scope="module")
def apply_jit():
    return jax.jit(apply_staged_writes, static_argnames="method")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["float32", "int32", "float16", "bfloat16"])
def test_random_writes_match_numpyrow_writes_model(apply_jit, method, dtype):
    np_dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    for _ in range(4):
        array = (rng.standard_normal(SHAPE) * 100).astype(np_dtype)
        writes = _random_writes(rng, int(rng.integers(0, 20)), np_dtype)
        got = apply_jit(jnp.asarray(array), pack_writes(*writes, dtype, shape=SHAPE), method=method)
        np.testing.assert_array_equal(np.asarray(got), row_writes_model(array, *writes))


@pytest.mark.parametrize("method", METHODS)
def test_overlapping_writes_later_wins(apply_jit, method):
    rows = [0, 0, 0, 1, 1, 0]
    starts = [0, 2, 4, 0, 1, 9]
    values_list = [[1] * 8, [2] * 3, [3] * 6, [4] * 4, [5] * 2, [6]]
    array = np.zeros((2, 10), np.int32)
    got = apply_jit(
        jnp.asarray(array), pack_writes(rows, starts, values_list, "int32"), method=method
    )
    np.testing.assert_array_equal(
        np.asarray(got), row_writes_model(array, rows, starts, values_list)
    )
    np.testing.assert_array_equal(np.asarray(got)[0], [1, 1, 2, 2, 3, 3, 3, 3, 3, 6])


@pytest.mark.parametrize("method", METHODS)
def test_random_overlapping_writes(apply_jit, method):
    rng = np.random.default_rng(3)
    for _ in range(5):
        array = rng.integers(-9, 9, (3, 12)).astype(np.int32)
        writes = _random_writes(rng, 12, np.int32, shape=(3, 12), max_len=8)
        got = apply_jit(jnp.asarray(array), pack_writes(*writes, "int32"), method=method)
        np.testing.assert_array_equal(np.asarray(got), row_writes_model(array, *writes))


@pytest.mark.parametrize("method", METHODS)
def test_writes_longer_than_a_pallas_block(apply_jit, method):
    array = np.zeros((2, 700), np.float32)
    writes = ([1, 0], [5, 0], [np.arange(600, dtype=np.float32), np.ones(700, np.float32)])
    got = apply_jit(jnp.asarray(array), pack_writes(*writes, "float32"), method=method)
    np.testing.assert_array_equal(np.asarray(got), row_writes_model(array, *writes))


@pytest.mark.parametrize("method", METHODS)
def test_jit_with_donation_updates_in_place(method):
    step = jax.jit(lambda a, p: apply_staged_writes(a, p, method=method), donate_argnums=0)
    array = jnp.zeros(SHAPE, jnp.float32)
    expected = np.zeros(SHAPE, np.float32)
    rng = np.random.default_rng(5)
    pointer = array.unsafe_buffer_pointer()
    for _ in range(3):
        writes = _random_writes(rng, 10, np.float32)
        array = step(array, pack_writes(*writes, "float32"))
        expected = row_writes_model(expected, *writes)
        assert array.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(array), expected)


@pytest.mark.parametrize("method", METHODS)
def test_no_recompilation_within_a_bucket(method):
    traces = []

    def step(array, packed):
        traces.append(1)  # runs only while tracing
        return apply_staged_writes(array, packed, method=method)

    step = jax.jit(step, donate_argnums=0)
    rng = np.random.default_rng(6)
    array = jnp.zeros((8, 64), jnp.int32)
    expected = np.zeros((8, 64), np.int32)
    for _ in range(100):
        # 17..32 disjoint writes (distinct (row, start) cells) of 1..4 elements: up to 128
        # elements, inside the 32-write bucket; the content floor covers the largest step.
        num_writes = int(rng.integers(17, 33))
        cells = rng.choice(8 * 16, num_writes, replace=False)
        rows = list(cells // 16)
        starts = list((cells % 16) * 4)
        values_list = [rng.integers(-99, 99, int(rng.integers(1, 5))) for _ in cells]
        packed = pack_writes(rows, starts, values_list, "int32", min_content_bucket=128)
        assert packed.rows.shape == (32,) and packed.values.shape == (128 + 128,)
        array = step(array, packed)
        expected = row_writes_model(expected, rows, starts, values_list)
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(array), expected)


def test_pack_writes_buckets_and_padding():
    packed = pack_writes([0, 1], [0, 2], [[1.0, 2.0], [3.0]], "float32")
    assert isinstance(packed, PackedWrites)
    assert packed.rows.shape == (MIN_BUCKET,)
    assert packed.values.shape == (MIN_BUCKET + 128,)
    assert list(packed.lengths[:3]) == [2, 1, 0]
    assert list(packed.offsets[:3]) == [0, 2, 3]
    assert [bucket_size(n) for n in (0, 1, 16, 17, 100)] == [16, 16, 16, 32, 128]


@pytest.mark.parametrize(
    "rows, starts, values_list, dtype, error",
    [
        ([0], [0], [[1.5]], "int32", ValueError),  # would drop a fraction
        ([0], [0], [[2**40]], "int32", ValueError),  # would wrap around
        ([6], [0], [[1]], "int32", IndexError),  # row out of range
        ([0], [38], [[1, 2, 3]], "int32", IndexError),  # past the end of the row
        ([-1], [0], [[1]], "int32", IndexError),
        ([0, 1], [0], [[1]], "int32", ValueError),  # ragged argument lists
    ],
)
def test_pack_writes_rejects_bad_input(rows, starts, values_list, dtype, error):
    with pytest.raises(error):
        pack_writes(rows, starts, values_list, dtype, shape=SHAPE)


def test_apply_rejects_bad_array_or_method():
    packed = pack_writes([0], [0], [[1.0]], "float32")
    with pytest.raises(ValueError, match="2-D"):
        apply_staged_writes(jnp.zeros(4, jnp.float32), packed)
    with pytest.raises(TypeError):
        apply_staged_writes(jnp.zeros((2, 2), jnp.int32), packed)
    with pytest.raises(ValueError, match="method"):
        apply_staged_writes(jnp.zeros((2, 2), jnp.float32), packed, method="magic")


@pytest.mark.parametrize(
    "dtype", ["int32", "float16", "bfloat16", "int8", "bool", "int64", "float64", "complex64"]
)
def test_packed_writes_is_one_buffer_and_bitcasts_in_jit(dtype):
    """One int32 leaf (one host-to-device transfer per apply); inside jit the fields are the
    host's values, bit for bit, for 1-, 2-, 4-, 8-byte and complex dtypes."""
    np_dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(8)
    values = [(rng.standard_normal(n) * 50).astype(np_dtype) for n in (3, 5, 1)]
    with jax.enable_x64(np_dtype.itemsize == 8):
        packed = pack_writes([0, 1, 2], [0, 4, 9], values, dtype, shape=(3, 10))
        (leaf,) = jax.tree_util.tree_leaves(packed)
        assert leaf is packed.buffer and leaf.dtype == np.int32 and leaf.ndim == 1
        host = [np.asarray(field) for field in packed]
        assert host[4].dtype == np_dtype and host[4].shape == (packed.num_values,)
        traced = jax.jit(lambda p: tuple(p))(packed)
        on_device = jax.device_put(packed)  # the same properties over a JAX array, eagerly
        for want, got_jit, got_eager in zip(host, traced, on_device):
            assert got_jit.dtype == want.dtype and got_eager.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got_jit), want)
            np.testing.assert_array_equal(np.asarray(got_eager), want)


def test_packed_writes_from_columns():
    """The NamedTuple-style constructor copies host columns into one buffer; bad columns
    raise before anything is built."""
    packed = PackedWrites([1, 0], [2, 0], [2, 1], [0, 2], np.array([7, 8, 9], np.int32))
    assert (packed.num_writes, packed.num_values, packed.dtype) == (2, 3, np.int32)
    assert packed.buffer.shape == (4 * 2 + 3 + 2 * 3,)  # columns, values, element indices
    assert packed.element_rows.tolist() == [1, 1, 0] and packed.element_cols.tolist() == [2, 3, 0]
    got = jax.jit(apply_staged_writes)(jnp.zeros((2, 4), jnp.int32), packed)
    np.testing.assert_array_equal(np.asarray(got), [[9, 0, 0, 0], [0, 0, 7, 8]])
    # Contents not starting at offset 0 and an empty write in the middle: the element before
    # the first offset belongs to no write and is dropped; the empty write copies nothing.
    values = np.array([5, 7, 8, 9], np.int32)
    packed = PackedWrites([1, 0, 0], [2, 3, 0], [2, 0, 1], [1, 3, 3], values)
    got = jax.jit(apply_staged_writes)(jnp.zeros((2, 4), jnp.int32), packed)
    np.testing.assert_array_equal(np.asarray(got), [[9, 0, 0, 0], [0, 0, 7, 8]])
    with pytest.raises(ValueError, match="one length"):
        PackedWrites([0, 1], [0], [1], [0], np.zeros(1, np.int32))
    with pytest.raises(TypeError, match="starts"):
        PackedWrites([0], [0.5], [1], [0], np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="lengths"):
        PackedWrites([0], [0], [-1], [0], np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="values must be 1-D"):
        PackedWrites([0], [0], [1], [0], np.zeros((1, 1), np.int32))
    with pytest.raises(TypeError, match="PackedWrites"):
        apply_staged_writes(jnp.zeros((2, 4), jnp.int32), tuple(packed))


@pytest.mark.parametrize("expander", ["c", "numpy"])
@pytest.mark.parametrize("seed", range(4))
def test_element_indices_name_every_value_target(monkeypatch, expander, seed):
    """Each packed value's element row and column is where the model puts it; padding is
    2**31 - 1 (dropped). The C loop and its numpy fallback agree."""
    from jaxbuf.staged import _jax_packed

    if expander == "numpy":
        monkeypatch.setattr(_jax_packed, "c_expand_elements", None)
    elif _jax_packed.c_expand_elements is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(seed)
    rows, starts, values_list = _random_writes(rng, int(rng.integers(0, 40)), "int32")
    packed = pack_writes(rows, starts, values_list, "int32", shape=SHAPE)
    element_rows, element_cols = packed.element_rows, packed.element_cols
    kept = element_rows != 2**31 - 1
    # Scattering the values by the element indices is the model's later-wins result ...
    got = np.zeros(SHAPE, np.int32)
    got[element_rows[kept], element_cols[kept]] = packed.values[kept]
    np.testing.assert_array_equal(
        got, row_writes_model(np.zeros(SHAPE, np.int32), rows, starts, values_list)
    )
    # ... with every target named once (the writes were made disjoint) and padding dropped.
    targets = element_rows[kept].astype(np.int64) * SHAPE[1] + element_cols[kept]
    assert len(set(targets.tolist())) == targets.size
    assert (element_cols[~kept] == 2**31 - 1).all()
    assert kept.sum() == int(packed.lengths.sum())


@pytest.mark.parametrize("dtype", ["int32", "float16", "int8", "bfloat16"])
@pytest.mark.parametrize("seed", range(3))
def test_unexpanded_packs_apply_the_same_through_the_device_side_indices(dtype, seed):
    """A pack without element indices (expand=False: the layout a GPU PackRing uses) is
    shorter by exactly those columns, and the scatter, which then computes every value's
    row and column inside jit, gives the expanded pack's (the model's) result."""
    rng = np.random.default_rng(seed)
    rows, starts, values_list = _random_writes(rng, int(rng.integers(0, 40)), dtype)
    expanded = pack_writes(rows, starts, values_list, dtype, shape=SHAPE)
    lean = pack_writes(rows, starts, values_list, dtype, shape=SHAPE, expand=False)
    assert expanded.expanded and not lean.expanded
    assert lean.buffer.shape[0] == expanded.buffer.shape[0] - 2 * expanded.num_values
    np.testing.assert_array_equal(lean.buffer, expanded.buffer[: lean.buffer.shape[0]])
    with pytest.raises(ValueError, match="no element indices"):
        lean.element_rows
    initial = np.asarray(rng.integers(-50, 50, SHAPE), jnp.dtype(dtype))
    apply = jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))
    want = row_writes_model(initial.copy(), rows, starts, values_list)
    for packed in (expanded, lean):
        np.testing.assert_array_equal(np.asarray(apply(jnp.asarray(initial), packed)), want)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_device_side_indices_equal_the_host_expansion(platform):
    """Both ways the scatter computes an unexpanded pack's indices inside jit (the GPU's
    binary search, the CPU's prefix sum; either runs anywhere) give exactly the element rows
    and columns the host writes into an expanded pack, padding included."""
    from jaxbuf.staged._jax_apply import _element_indices

    rng = np.random.default_rng(7)
    indices = jax.jit(lambda p: _element_indices(p, platform))
    for i in range(40):
        if i % 2:
            writes = _random_writes(rng, int(rng.integers(0, 40)), "int32")
        else:  # one length: uniform packs (the division) when no two overlap
            writes = _uniform_writes(
                rng, int(rng.integers(1, 12)), "int32", int(rng.integers(1, 9))
            )
        expanded = pack_writes(*writes, "int32", shape=SHAPE)
        rows, cols = indices(pack_writes(*writes, "int32", shape=SHAPE, expand=False))
        np.testing.assert_array_equal(np.asarray(rows), expanded.element_rows)
        np.testing.assert_array_equal(np.asarray(cols), expanded.element_cols)


@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_scatter_targets_are_unique_so_the_scatter_may_promise_it(expand, platform):
    """The scatter tells XLA its indices are unique (unique_indices=True), which XLA does not
    check: a broken promise would make colliding updates land in any order. So every
    (row, column) pair it scatters to, padding included, must differ, with overlapping
    writes (which the packer resolves) in every batch."""
    from jaxbuf.staged._jax_apply import _scatter_targets

    rng = np.random.default_rng(11)
    targets = jax.jit(lambda p: _scatter_targets(p, platform))
    for i in range(40):
        # Many long writes into 6 x 40: most batches overlap, and buckets leave padding.
        writes = _random_writes(rng, int(rng.integers(1, 40)), "int32")
        if i % 2:  # one length: uniform packs when no two overlap
            writes = _uniform_writes(
                rng, int(rng.integers(1, 12)), "int32", int(rng.integers(1, 9))
            )
        rows, cols = targets(pack_writes(*writes, "int32", shape=SHAPE, expand=expand))
        pairs = np.stack([np.asarray(rows), np.asarray(cols)], axis=1)
        assert len(np.unique(pairs, axis=0)) == len(pairs)


def _uniform_writes(rng, num_writes, dtype, length, shape=SHAPE):
    """``num_writes`` writes of one ``length``, anywhere (so some overlap)."""
    rows = [int(r) for r in rng.integers(0, shape[0], num_writes)]
    starts = [int(s) for s in rng.integers(0, shape[1] - length + 1, num_writes)]
    values = [(rng.standard_normal(length) * 100).astype(dtype) for _ in range(num_writes)]
    return rows, starts, values


def test_uniform_is_set_exactly_when_every_write_has_one_length():
    """An unexpanded pack is uniform when its (resolved) writes share one length: then the
    scatter divides instead of searching. Overlaps split writes into pieces and mixed lengths
    are not uniform; expanded packs never need it."""
    lean = {"shape": SHAPE, "expand": False}
    assert pack_writes([0, 1, 2], [0, 8, 16], [[1] * 4] * 3, "int32", **lean).uniform
    assert not pack_writes([0, 1], [0, 8], [[1] * 4, [1] * 3], "int32", **lean).uniform
    # The packer drops empty writes, so they do not break the layout.
    assert pack_writes([0, 1, 2], [0, 8, 16], [[1] * 4, [], [2] * 4], "int32", **lean).uniform
    # The second write covers the middle of the first: three pieces of lengths 1, 4, 3.
    assert not pack_writes([0, 0], [0, 1], [[1] * 8, [2] * 4], "int32", **lean).uniform
    assert not pack_writes([], [], [], "int32", **lean).uniform
    assert not pack_writes([0, 1, 2], [0, 8, 16], [[1] * 4] * 3, "int32", shape=SHAPE).uniform


def test_uniform_layout_checks_lengths_and_offsets():
    from jaxbuf.staged._jax_packed import uniform_layout as _uniform_layout

    ints = lambda *v: np.array(v, np.int32)  # noqa: E731
    assert _uniform_layout(ints(4, 4, 4, 0, 0), ints(0, 4, 8, 12, 12))
    assert not _uniform_layout(ints(4, 4, 4, 0), ints(0, 4, 9, 12))  # a gap before write 2
    assert not _uniform_layout(ints(4, 0, 4, 0), ints(0, 4, 4, 8))  # an empty write inside
    assert not _uniform_layout(ints(0, 0), ints(0, 0))
    assert not _uniform_layout(ints(), ints())


@pytest.mark.parametrize("dtype", ["int32", "float16", "int8"])
@pytest.mark.parametrize("length", [1, 5, 16])
def test_uniform_packs_apply_like_the_model(dtype, length):
    """Uniform packs through the division, with and without overlaps (disjoint: uniform;
    overlapping: split into pieces, mixed), against the numpy model."""
    rng = np.random.default_rng(length)
    apply = jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))
    seen = set()
    for num_writes in (1, 3, 9, 30):
        rows, starts, values = _uniform_writes(rng, num_writes, dtype, length)
        packed = pack_writes(rows, starts, values, dtype, shape=SHAPE, expand=False)
        seen.add(packed.uniform)
        initial = np.asarray(rng.integers(-50, 50, SHAPE), jnp.dtype(dtype))
        want = row_writes_model(initial.copy(), rows, starts, values)
        np.testing.assert_array_equal(np.asarray(apply(jnp.asarray(initial), packed)), want)
    assert True in seen  # the division ran


def test_expand_must_be_a_bool():
    staged = StagedWrites(*SHAPE, "int32")
    staged.stage_write(0, 0, [1])
    for bad in ("yes", 1, 0.0):
        with pytest.raises(TypeError, match="expand"):
            staged.pack(expand=bad)
        with pytest.raises(TypeError, match="expand"):
            pack_writes([0], [0], [[1]], "int32", shape=SHAPE, expand=bad)
    assert staged.num_staged_writes == 1  # the refused packs changed nothing


def test_element_expansion_refuses_writes_outside_the_values():
    with pytest.raises(ValueError, match="outside"):
        PackedWrites([0], [0], [4], [0], np.array([1, 2, 3], np.int32))


def test_expand_elements_checks_its_columns():
    from jaxbuf.staged._host import c_expand_elements

    if c_expand_elements is None:
        pytest.skip("the C extension is not built")
    column = np.zeros(2, np.int32)
    out = np.zeros(4, np.int32), np.zeros(4, np.int32)
    with pytest.raises(TypeError, match="starts must be a 1-D C-contiguous int32"):
        c_expand_elements(column, np.zeros(2, np.int64), column, column, *out)
    with pytest.raises(ValueError, match="one length"):
        c_expand_elements(column, column, np.zeros(3, np.int32), column, *out)
    with pytest.raises(ValueError, match="element_cols must be a writable"):
        c_expand_elements(column, column, column, column, out[0], np.zeros(4, np.int64))
    assert out[0].tolist() == [0] * 4  # nothing written on an error


# -- copies, context, printing ---------------------------------------------------------------
@pytest.mark.parametrize(
    "make_copy",
    [copy.copy, copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_a_copy_of_staged_writes_is_independent(make_copy):
    staged = StagedWrites(*SHAPE, "int32")
    staged.stage_writes([0, 0, 3], [0, 2, 4], [np.arange(4, dtype=np.int32)] * 3)
    twin = make_copy(staged)
    assert twin is not staged and twin.num_staged_writes == 3
    packed_twin = twin.pack()  # clears the copy only
    assert staged.num_staged_writes == 3 and twin.num_staged_writes == 0
    np.testing.assert_array_equal(staged.pack().buffer, packed_twin.buffer)
    staged.stage_write(1, 0, [9])
    assert twin.num_staged_writes == 0  # staging the original stages nothing in the copy


def test_staged_writes_print_and_clear_on_leaving_a_with_block():
    with StagedWrites(2, 4, "float32") as staged:
        staged.stage_write(1, 0, [1.0, 2.0])
        assert repr(staged) == (
            f"StagedWrites(num_rows=2, row_len=4, dtype=float32, staged=1, nbytes={staged.nbytes})"
        )
        assert staged.nbytes == 40 + 8  # one record, two float32 values
    assert staged.num_staged_writes == 0
    packed = pack_writes([0], [0], [[1]], "int32", shape=(2, 4))
    assert packed.shape == (2, 4) and packed.nbytes == packed.buffer.nbytes
    assert "shape=(2, 4)" in repr(packed)
