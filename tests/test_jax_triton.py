"""apply_staged_writes(method="triton"): the Triton staged-write kernel from JAX via jax_triton.

On the CPU: the method selection and its errors; the XLA scatter (the CPU's path) against a
numpy model on random batches; the Triton kernel source itself, run under Triton's interpreter
with torch CPU tensors, against the same model; and, where jax_triton is installed, the whole
``method="triton"`` path lowered for CUDA in a subprocess with jaxlib's GPU bindings stubbed
(the kernel really compiles to sm_90 PTX, and the custom call aliases the array). On a GPU
(``gpu`` marker): the kernel against the scatter, in place on donated arrays, inside ``jit``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import CUDA_REASON, TORCH_REASON, row_writes_model

jax = pytest.importorskip("jax", reason="jax is not installed")
pytest.importorskip("triton", reason="triton is not installed")
import jax.numpy as jnp  # noqa: E402

from jaxbuf.jax_ops import apply_staged_writes, pack_writes  # noqa: E402
from jaxbuf.staged import _jax_apply as jax_staged  # noqa: E402
from jaxbuf.staged import _jax_triton as jax_triton_apply  # noqa: E402

SHAPE = (12, 70)
DTYPES = ["float32", "int32", "float16", "bfloat16", "int64", "int8", "bool"]
X64 = {"int64", "uint64", "float64"}


def _x64(dtype: str):
    """JAX narrows 64-bit dtypes unless x64 is on."""
    return jax.enable_x64(True) if dtype in X64 else contextlib.nullcontext()


def _values(rng, length: int, dtype: str) -> np.ndarray:
    np_dtype = jnp.dtype(dtype)
    if np_dtype == np.bool_:
        return rng.integers(0, 2, length).astype(bool)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), length).astype(np_dtype)
    return (rng.standard_normal(length) * 100).astype(np_dtype)


def _random_writes(rng, num_writes: int, dtype: str, shape=SHAPE, max_len=40, spill=False):
    """Row writes, overlapping at random; with ``spill`` some run past the last row or
    column (dropped at apply time)."""
    rows, starts, values_list = [], [], []
    for _ in range(num_writes):
        length = int(rng.integers(0, max_len + 1))
        if spill and rng.random() < 0.3:
            rows.append(int(rng.integers(0, shape[0] + 3)))
            starts.append(int(rng.integers(0, shape[1] + 5)))
        else:
            rows.append(int(rng.integers(shape[0])))
            starts.append(int(rng.integers(0, max(1, shape[1] - length + 1))))
        values_list.append(_values(rng, length, dtype))
    return rows, starts, values_list


def _batches(dtype: str, seed: int, count: int = 4, spill: bool = False):
    """(initial array, writes) pairs, batch sizes from empty to a few dozen."""
    rng = np.random.default_rng(seed)
    for size in [0, 1, *rng.integers(2, 48, count - 2)]:
        array = _values(rng, SHAPE[0] * SHAPE[1], dtype).reshape(SHAPE)
        yield array, _random_writes(rng, int(size), dtype, spill=spill)


@pytest.fixture
def fresh_reason():
    """jax_triton_unavailable_reason() recomputed inside the test and afterwards."""
    jax_triton_apply.jax_triton_unavailable_reason.cache_clear()
    yield
    jax_triton_apply.jax_triton_unavailable_reason.cache_clear()


# -- method selection and errors (CPU) ----------------------------------------------------------
def test_default_is_the_scatter_everywhere():
    # Chosen by the numbers (see apply_staged_writes): also on a GPU, where jax_triton runs.
    array = jnp.zeros(SHAPE, jnp.int32)
    packed = pack_writes([1], [2], [[7, 8]], "int32")
    lowered = jax.jit(apply_staged_writes).lower(array, packed).as_text()
    assert "triton_kernel_call" not in lowered and "scatter" in lowered
    got = jax.jit(apply_staged_writes)(array, packed)
    assert np.asarray(got)[1, 2:4].tolist() == [7, 8]


def test_the_default_never_calls_triton_even_where_it_runs(monkeypatch):
    monkeypatch.setattr(jax_staged, "_platform", lambda array: "gpu")
    monkeypatch.setattr(jax_staged, "_triton_unavailable_reason", lambda: None)
    monkeypatch.setattr(
        jax_triton_apply, "apply_packed_writes", lambda *a: pytest.fail("triton chosen")
    )
    packed = pack_writes([0], [0], [[1]], "int32")
    got = apply_staged_writes(jnp.zeros(SHAPE, jnp.int32), packed)
    assert int(got[0, 0]) == 1


def test_pallas_is_never_the_default(monkeypatch):
    monkeypatch.setattr(jax_staged, "_apply_pallas", lambda *a: pytest.fail("pallas chosen"))
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(jax_staged, "_platform", lambda array, p=platform: p)
        monkeypatch.setattr(jax_staged, "_triton_unavailable_reason", lambda: "none here")
        apply_staged_writes(jnp.zeros(SHAPE, jnp.int32), pack_writes([0], [0], [[1]], "int32"))


def test_triton_on_the_cpu_is_a_clear_error():
    array = jax.device_put(jnp.zeros(SHAPE, jnp.int32), jax.devices("cpu")[0])
    packed = pack_writes([0], [0], [[1]], "int32")
    with pytest.raises(ValueError, match=r"method='triton' runs on a GPU.*cpu.*scatter"):
        apply_staged_writes(array, packed, method="triton")
    if jax.default_backend() == "cpu":  # traced: the default backend decides
        with pytest.raises(ValueError, match="runs on a GPU"):
            jax.jit(lambda a, p: apply_staged_writes(a, p, method="triton"))(array, packed)
    with pytest.raises(ValueError, match="no interpreter"):
        apply_staged_writes(array, packed, method="triton", interpret=True)


def test_unknown_method_names_the_choices():
    packed = pack_writes([0], [0], [[1]], "int32")
    with pytest.raises(ValueError, match=r"triton.*scatter.*pallas.*'magic'"):
        apply_staged_writes(jnp.zeros(SHAPE, jnp.int32), packed, method="magic")


def test_triton_without_jax_triton_names_it(monkeypatch, fresh_reason):
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import jax_triton -> ImportError
    reason = jax_triton_apply.jax_triton_unavailable_reason()
    assert reason is not None and "jax_triton cannot be imported" in reason
    assert "jaxbuf[jax-triton]" in reason
    monkeypatch.setattr(jax_staged, "_platform", lambda array: "gpu")
    packed = pack_writes([0], [0], [[1]], "int32")
    with pytest.raises(ImportError, match="method='triton'.*jax_triton"):
        apply_staged_writes(jnp.zeros(SHAPE, jnp.int32), packed, method="triton")
    with pytest.raises(ImportError, match="jax_triton"):
        jax_triton_apply.apply_packed_writes(jnp.zeros(SHAPE, jnp.int32), packed)
    # The default quietly takes the scatter instead.
    got = apply_staged_writes(jnp.zeros(SHAPE, jnp.int32), packed)
    assert int(got[0, 0]) == 1


@pytest.mark.parametrize("cache_dir", [None, "/somewhere/triton-cache"])
def test_importing_jax_triton_keeps_tritons_cache_dir(
    monkeypatch, tmp_path, fresh_reason, cache_dir
):
    # jax_triton 0.3.1 sets TRITON_CACHE_DIR="" at import, which breaks every later compile by
    # Triton's own JIT (the torch launcher) in the process; a stand-in module does the same.
    (tmp_path / "jax_triton").mkdir()
    (tmp_path / "jax_triton" / "__init__.py").write_text(
        'import os\nos.environ["TRITON_CACHE_DIR"] = ""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    if cache_dir is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    try:
        assert jax_triton_apply.jax_triton_unavailable_reason() is None
        assert sys.modules["jax_triton"].__file__.startswith(str(tmp_path))
    finally:
        sys.modules.pop("jax_triton", None)  # monkeypatch puts back a real one it removed
    assert os.environ.get("TRITON_CACHE_DIR") == cache_dir


def test_old_jax_or_triton_names_the_needed_version(monkeypatch, fresh_reason):
    import triton

    from jaxbuf.interop.jax import JAX_FLOORS

    monkeypatch.setattr(jax, "__version__", "0.8.1")
    reason = jax_triton_apply.jax_triton_unavailable_reason()
    assert reason is not None and JAX_FLOORS["jax_triton"] in reason and "0.8.1" in reason
    jax_triton_apply.jax_triton_unavailable_reason.cache_clear()
    monkeypatch.undo()
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    reason = jax_triton_apply.jax_triton_unavailable_reason()
    assert reason is not None and "Triton >= 3.6" in reason and "3.5.1" in reason


def test_bad_kernel_arguments_raise_before_jax_triton_is_needed():
    packed = pack_writes([0], [0], [[1]], "complex64")
    with pytest.raises(TypeError, match="complex64"):
        jax_triton_apply.apply_packed_writes(jnp.zeros(SHAPE, jnp.complex64), packed)
    packed = pack_writes([0], [0], [[1]], "int32")
    with pytest.raises(ValueError, match="power of two"):
        jax_triton_apply.apply_packed_writes(jnp.zeros(SHAPE, jnp.int32), packed, block_size=48)
    with pytest.raises(ValueError, match="num_warps"):
        jax_triton_apply.apply_packed_writes(jnp.zeros(SHAPE, jnp.int32), packed, num_warps=3)


@pytest.mark.parametrize(
    ("num_writes", "num_values", "expected"),
    [
        (16, 16 + 128, (32, 1)),
        (256, 4096 + 128, (32, 1)),
        (16, 2048, (128, 1)),
        (16, 8192, (512, 2)),
        (16, 1 << 20, (1024, 4)),
        (0, 0, (32, 1)),
    ],
)
def test_launch_config(num_writes, num_values, expected):
    assert jax_triton_apply.launch_config(num_writes, num_values) == expected


# -- the scatter, the CPU's path, against the model ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_matches_the_numpyrow_writes_model(dtype):
    with _x64(dtype):
        step = jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))
        for array, writes in _batches(dtype, seed=1):
            got = step(jnp.asarray(array), pack_writes(*writes, dtype, shape=SHAPE))
            np.testing.assert_array_equal(np.asarray(got), row_writes_model(array, *writes))


def test_scatter_drops_what_falls_outside():
    for array, writes in _batches("int32", seed=2, count=6, spill=True):
        got = apply_staged_writes(
            jnp.asarray(array), pack_writes(*writes, "int32"), method="scatter"
        )
        np.testing.assert_array_equal(np.asarray(got), row_writes_model(array, *writes))


def test_default_method_donated_in_jit_matches_therow_writes_model():
    step = jax.jit(apply_staged_writes, donate_argnums=0)
    rng = np.random.default_rng(3)
    array = _values(rng, SHAPE[0] * SHAPE[1], "float32").reshape(SHAPE)
    state, expected = jnp.asarray(array), array
    for _ in range(5):
        writes = _random_writes(rng, int(rng.integers(0, 30)), "float32")
        state = step(
            state,
            pack_writes(
                *writes, "float32", shape=SHAPE, min_write_bucket=32, min_content_bucket=1024
            ),
        )
        expected = row_writes_model(expected, *writes)
    np.testing.assert_array_equal(np.asarray(state), expected)


# -- the kernel source, under Triton's interpreter ----------------------------------------------
def _torch(values: np.ndarray):
    import torch

    values = np.ascontiguousarray(values)
    if values.dtype == jnp.dtype("bfloat16"):  # torch.from_numpy has no ml_dtypes bfloat16
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def _run_interpreted(array: np.ndarray, packed, block_size: int) -> np.ndarray:
    """The kernel as jax_triton launches it (operands, then scalars, then the aliased output),
    on host memory under the interpreter."""
    target = _torch(array.copy())
    kernel = jax_triton_apply.interpreted_kernel()
    kernel[(packed.num_writes,)](
        _torch(packed.buffer),
        target,
        array.shape[0],
        array.shape[1],
        target,
        NUM_WRITES=packed.num_writes,
        BLOCK_SIZE=block_size,
    )
    if array.dtype == jnp.dtype("bfloat16"):
        import torch

        return target.view(torch.int16).numpy().view(array.dtype)
    return target.numpy()


@pytest.mark.skipif(TORCH_REASON is not None, reason=TORCH_REASON or "")
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_kernel_matches_the_numpyrow_writes_model(dtype):
    for array, writes in _batches(dtype, seed=4, spill=True):
        packed = pack_writes(*writes, dtype)
        block, _ = jax_triton_apply.launch_config(packed.rows.shape[0], packed.values.shape[0])
        # A block shorter than the writes exercises the block loop of the shared body.
        for block_size in sorted({block, 16}):
            got = _run_interpreted(array, packed, block_size)
            np.testing.assert_array_equal(got, row_writes_model(array, *writes))


# -- the jax_triton lowering for CUDA, offline --------------------------------------------------
_LOWER_FOR_CUDA = textwrap.dedent("""
    import numpy as np
    from jax._src.lib import gpu_triton

    # jaxlib's CUDA-only Triton bindings, stubbed; the rest of the path is real.
    kernels = []

    class Kernel:
        def __init__(self, *args):
            kernels.append(args)

    class KernelCall:
        def __init__(self, *args):
            pass

        def to_proto(self, name, metadata):
            return b""

    gpu_triton.get_compute_capability = lambda device: 90
    gpu_triton.get_serialized_metadata = lambda *args: b""
    gpu_triton.TritonKernel = Kernel
    gpu_triton.TritonKernelCall = KernelCall
    gpu_triton.create_array_parameter = lambda *args: args
    gpu_triton.create_scalar_parameter = lambda *args: args
    import jax
    import jax.numpy as jnp

    from jaxbuf.jax_ops import pack_writes
    from jaxbuf.staged import _jax_apply as jax_staged
    from jaxbuf.staged._jax_triton import JAX_TRITON_ALIAS

    jax_staged._platform = lambda array: "gpu"  # lowering for CUDA from a CPU process
    for dtype in ("int32", "bfloat16", "float16", "int8"):
        kernels.clear()
        array = jnp.zeros((64, 128), dtype)
        packed = pack_writes([1, 2], [0, 5], [np.ones(3), np.ones(40)], dtype)
        step = jax.jit(
            lambda a, p: jax_staged.apply_staged_writes(a, p, method="triton"), donate_argnums=0
        )
        text = step.trace(array, packed).lower(lowering_platforms=("cuda",)).as_text()
        call = next(line for line in text.splitlines() if "@triton_kernel_call" in line)
        assert "output_operand_aliases" in call, call
        assert f"operand_index = {JAX_TRITON_ALIAS}" in call, call  # the array
        assert "scatter" not in text, text
        (name, warps, ctas, shared, ptx, ttir, capability), = kernels
        assert name == "_apply_packed_writes_kernel" and capability == 90
        assert ".target sm_90" in ptx and "st.global" in ptx
    print("lowered")
""")


@pytest.mark.skipif(CUDA_REASON is None, reason="a GPU is here: the gpu tests run the real path")
def test_triton_path_lowers_for_cuda_offline():
    # find_spec, not importorskip: jax_triton raises ImportError on import without a CUDA JAX.
    if importlib.util.find_spec("jax_triton") is None:
        pytest.skip("jax_triton is not installed")
    # A subprocess: the stubs must not leak into this one.
    result = subprocess.run(
        [sys.executable, "-c", _LOWER_FOR_CUDA],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    if result.returncode != 0 and "AttributeError" in result.stderr:
        pytest.skip(f"this jax_triton / jaxlib cannot be stubbed: {result.stderr[-500:]}")
    assert result.returncode == 0 and "lowered" in result.stdout, result.stderr[-3000:]


# -- on the GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_scatter_on_the_gpu(gpu_triton, dtype):
    with _x64(dtype):
        triton_step = jax.jit(lambda a, p: apply_staged_writes(a, p, method="triton"))
        scatter_step = jax.jit(lambda a, p: apply_staged_writes(a, p, method="scatter"))
        for array, writes in _batches(dtype, seed=5, count=6, spill=True):
            packed = pack_writes(*writes, dtype)
            via_triton = np.asarray(triton_step(jnp.asarray(array), packed))
            np.testing.assert_array_equal(
                via_triton, np.asarray(scatter_step(jnp.asarray(array), packed))
            )
            np.testing.assert_array_equal(via_triton, row_writes_model(array, *writes))


@pytest.mark.gpu
def test_the_default_scatter_updates_a_donated_gpu_array_in_place():
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (default backend {jax.default_backend()})")
    step = jax.jit(apply_staged_writes, donate_argnums=0)
    rng = np.random.default_rng(8)
    shape = (512, 1024)  # big enough that XLA would not hide a copy in a small pool
    initial = _values(rng, shape[0] * shape[1], "int32").reshape(shape)
    state, expected = jnp.asarray(initial), initial
    pointer = state.unsafe_buffer_pointer()
    for _ in range(4):
        writes = _random_writes(rng, 64, "int32", shape=shape, max_len=100)
        state = step(state, pack_writes(*writes, "int32", shape=shape, min_write_bucket=64))
        expected = row_writes_model(expected, *writes)
    assert state.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(state), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int32", "bfloat16", "int64"])
def test_triton_updates_a_donated_array_in_place(gpu_triton, dtype):
    with _x64(dtype):
        step = jax.jit(lambda a, p: apply_staged_writes(a, p, method="triton"), donate_argnums=0)
        rng = np.random.default_rng(6)
        shape = (512, 1024)  # big enough that XLA would not hide a copy in a small pool
        initial = _values(rng, shape[0] * shape[1], dtype).reshape(shape)
        state, expected = jnp.asarray(initial), initial
        pointer = state.unsafe_buffer_pointer()
        for _ in range(4):
            writes = _random_writes(rng, 64, dtype, shape=shape, max_len=100)
            packed = pack_writes(
                *writes, dtype, shape=shape, min_write_bucket=64, min_content_bucket=8192
            )
            state = step(state, packed)
            assert state.unsafe_buffer_pointer() == pointer, "the donated array was copied"
            expected = row_writes_model(expected, *writes)
        np.testing.assert_array_equal(np.asarray(state), expected)


@pytest.mark.gpu
def test_triton_without_donation_leaves_the_input_alone(gpu_triton):
    array = jnp.zeros(SHAPE, jnp.int32)
    packed = pack_writes([0, 3], [1, 5], [[1, 2], [3, 4, 5]], "int32")
    got = jax.jit(lambda a, p: apply_staged_writes(a, p, method="triton"))(array, packed)
    assert not np.asarray(array).any()
    np.testing.assert_array_equal(
        np.asarray(got),
        row_writes_model(np.zeros(SHAPE, np.int32), [0, 3], [1, 5], [[1, 2], [3, 4, 5]]),
    )


@pytest.mark.gpu
def test_triton_long_writes_loop_over_blocks(gpu_triton):
    shape = (8, 5000)
    rng = np.random.default_rng(7)
    writes = _random_writes(rng, 12, "float32", shape=shape, max_len=4000)
    packed = pack_writes(*writes, "float32", shape=shape)
    for block_size in (32, 1024):
        got = jax.jit(
            lambda a, p, b=block_size: jax_triton_apply.apply_packed_writes(a, p, block_size=b)
        )(jnp.zeros(shape, jnp.float32), packed)
        np.testing.assert_array_equal(
            np.asarray(got), row_writes_model(np.zeros(shape, np.float32), *writes)
        )
