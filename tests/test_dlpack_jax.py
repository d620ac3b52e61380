"""JAX as the consumer of a ``BufferView``: ports of JAX's own DLPack interoperability tests.

Sources: JAX, ``tests/array_interoperability_test.py`` (``DLPackTest``: the round trips,
``testNumpyToJax`` with ``copy`` and alignment) and ``tests/pytorch_interoperability_test.py``
(``testTorchToJax``: the imported array goes into a ``jax.jit`` computation), rewritten with
a view over an ``ExtensibleTensor`` as the producer where JAX uses numpy or torch arrays.
64-bit dtypes run under ``jax.enable_x64`` (JAX narrows them otherwise, as upstream skips
them). The lifetime tests run in a child process.
"""

from __future__ import annotations

import contextlib
import gc
import time

import numpy as np
import pytest
from dlpack_producer import (
    ALL_DTYPES,
    ALL_SHAPES,
    CHILD_PRODUCER,
    X64_DTYPES,
    assert_normal_exit,
    make_view,
    reference,
    run_child,
    write,
)

from jaxbuf import _dlpack
from jaxbuf.dtypes import canonical_dtype
from jaxbuf.views import BufferView

jax = pytest.importorskip("jax", reason="jax is not installed")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.dlpack")


def jax_device(device: str):
    """The JAX device a view on ``device`` imports onto (skip when JAX has none there)."""
    platform = "cpu" if device == "cpu" else "gpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError as error:
        pytest.skip(f"JAX has no {platform} device: {error}")


def x64(dtype: str):
    """``jax.enable_x64`` for the 64-bit dtypes (JAX narrows them otherwise)."""
    return jax.enable_x64(True) if dtype in X64_DTYPES else contextlib.nullcontext()


def wait_for(condition, timeout: float = 10.0) -> bool:
    """JAX may release an imported buffer on one of its own threads, a moment later."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("shape", ALL_SHAPES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_jax_array_round_trip(device, shape, dtype):
    """``testJaxArrayRoundTrip``: imports land on the view's device, zero-copy, as often as
    asked ("we can create multiple arrays")."""
    target = jax_device(device)
    tensor, view, expected = make_view(device, dtype, shape)
    with x64(dtype):
        for _ in range(2):
            y = jax.dlpack.from_dlpack(view)
            assert y.devices() == {target}
            assert y.dtype == expected.dtype and y.shape == shape
            np.testing.assert_array_equal(np.asarray(y), expected)
            if y.size:
                assert y.unsafe_buffer_pointer() == view.ptr
    del y, view
    tensor.free()


@pytest.mark.parametrize("shape", [(4,), (3, 4), (0,), ()])
@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "int64", "complex64"])
@pytest.mark.parametrize("copy", [False, True, None])
@pytest.mark.parametrize("aligned", [False, True])
def test_numpy_to_jax_copy_and_alignment(device, shape, dtype, copy, aligned):
    """``testNumpyToJax``: ``jnp.from_dlpack(x, device=..., copy=...)``. JAX imports in place
    only aligned memory; from a misaligned view ``copy=False`` is JAX's error."""
    target = jax_device(device)
    if not aligned and device != "cpu":
        pytest.skip("upstream checks JAX's alignment rule on its CPU client only")
    if copy is True and device != "cpu":
        # Seen on the H200 with jax 0.11.2: dlpack_managed_tensor_to_buffer raises
        # UNIMPLEMENTED (the PJRT C API supports no copying HostBufferSemantics on CUDA).
        pytest.skip("JAX's PJRT C API cannot import a CUDA DLPack tensor with copy=True")
    tensor, base, _ = make_view(device, "uint8", (256,))
    expected = reference(shape, dtype)
    offset = 0 if aligned else canonical_dtype(dtype).itemsize  # aligned to the item only
    view = BufferView(
        base.ptr + offset,
        expected.nbytes,
        dtype,
        shape,
        base.device,
        tensor,
        base.dlpack_device_type,
    )
    write(view, expected)
    with x64(dtype):
        if copy is False and not aligned and expected.size:
            with pytest.raises(ValueError, match="requires a copy"):
                jnp.from_dlpack(view, device=target, copy=copy)
        else:
            y = jnp.from_dlpack(view, device=target, copy=copy)
            np.testing.assert_array_equal(np.asarray(y), expected)
            if copy is False and expected.size:
                assert y.unsafe_buffer_pointer() == view.ptr
            del y
    del view, base
    tensor.free()


@pytest.mark.parametrize("shape", [(), (4,), (3, 4), (2, 0, 1)])
@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d != "bool"])
def test_imported_array_goes_into_jit(device, shape, dtype):
    """``testTorchToJax``: the imported array is an ordinary input of a jitted function."""
    jax_device(device)
    tensor, view, expected = make_view(device, dtype, shape)
    with x64(dtype):
        y = jax.dlpack.from_dlpack(view)
        z = jax.jit(lambda x: x + 1)(y)
        np.testing.assert_array_equal(np.asarray(z), expected + expected.dtype.type(1))
    del y, z, view
    tensor.free()


@pytest.mark.parametrize("release", ["del", "delete"])
def test_jax_releases_the_export_when_its_array_dies(device, release):
    """JAX calls the deleter when its array is gone (``del``, or ``Array.delete()``),
    possibly a moment later from one of its threads: the export count follows."""
    jax_device(device)
    tensor, view, expected = make_view(device, "int32", (3, 4))
    anchor = _dlpack.anchor_for(tensor)
    y = jax.dlpack.from_dlpack(view)
    np.testing.assert_array_equal(np.asarray(y), expected)
    assert anchor.live_exports == 1
    if release == "delete":
        y.delete()
    else:
        del y
    assert wait_for(lambda: anchor.live_exports == 0)
    del view
    tensor.free()


# -- lifetime: the array outlives its producer (child processes) -----------------------------


@pytest.mark.parametrize("route", ["jax.dlpack", "jnp.from_dlpack", "to_jax"])
def test_array_outlives_producer(device, route):
    """Drop the view and the ``ExtensibleTensor`` (no ``free()``): the JAX array still reads,
    also inside a jitted function."""
    script = (
        CHILD_PRODUCER
        + f"""
import jax, jax.dlpack, jax.numpy as jnp
if {device!r} != "cpu" and not jax.devices("gpu"):
    print("done"); sys.exit(0)
tensor, view = producer({device!r}, np.arange(1000, dtype=np.float32))
route = {route!r}
if route == "jax.dlpack":
    y = jax.dlpack.from_dlpack(view)
elif route == "jnp.from_dlpack":
    y = jnp.from_dlpack(view, copy=False)
else:
    y = view.to_jax()
assert y.unsafe_buffer_pointer() == view.ptr
del view, tensor
gc.collect()
assert float(y.sum()) == float(np.arange(1000).sum())
assert float(jax.jit(lambda x: (x * 2).sum())(y)) == 2 * float(np.arange(1000).sum())
del y
gc.collect()
print("done")
"""
    )
    assert_normal_exit(run_child(script))


def test_array_outlives_free():
    """``free()`` with a live JAX array: the array keeps its memory until its last consumer goes."""
    script = (
        CHILD_PRODUCER
        + """
import jax, jax.dlpack
tensor, view = producer("cpu", np.arange(1000, dtype=np.float32))
y = jax.dlpack.from_dlpack(view)
tensor.free()
assert float(y.sum()) == float(np.arange(1000).sum())
print("done")
"""
    )
    assert_normal_exit(run_child(script))
