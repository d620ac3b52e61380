"""numpy as the consumer of a ``BufferView``: a port of numpy's own DLPack tests.

Source: numpy, ``numpy/_core/tests/test_dlpack.py`` (class ``TestDLPack``), rewritten with a
view over an ``ExtensibleTensor`` as the producer where numpy uses its own arrays. numpy reads
host memory only, so on CUDA the tests ask for the host (``device="cpu"``), which makes the
producer copy (``__dlpack__(dl_device=(kDLCPU, 0))``). The refcount tests count the anchor's
live exports (the producer's reference held by each capsule), and the lifetime tests run in a
child process.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from dlpack_producer import (
    CHILD_PRODUCER,
    NUMPY_DTYPES,
    assert_normal_exit,
    make_view,
    read_back,
    run_child,
)

from jaxbuf import _dlpack
from jaxbuf.views import BufferView


@pytest.fixture
def arange5(device):
    """numpy's ``np.arange(5)``, in jaxbuf memory."""
    tensor, view, _ = make_view(device, "int64", (5,), np.arange(5))
    yield view
    del view
    tensor.free()


def host_kwargs(view: BufferView) -> dict:
    """numpy imports host memory only: ask the producer for the host on a GPU view."""
    return {} if view.device.platform == "cpu" else {"device": "cpu"}


@pytest.mark.parametrize("max_version", [(0, 0), None, (1, 0), (100, 3)])
def test_dunder_dlpack_refcount(arange5, max_version):
    """Each capsule holds one reference to the producer's anchor, dropped with the capsule."""
    anchor = _dlpack.anchor_for(arange5.owner)
    start_exports, start_refs = anchor.live_exports, sys.getrefcount(anchor)
    capsule = arange5.__dlpack__(max_version=max_version)
    assert anchor.live_exports == start_exports + 1
    assert sys.getrefcount(anchor) - start_refs == 1
    del capsule
    assert anchor.live_exports == start_exports
    assert sys.getrefcount(anchor) == start_refs


def test_dunder_dlpack_stream(arange5, device):
    arange5.__dlpack__(stream=None)
    if device == "cpu":
        with pytest.raises(BufferError, match="stream must be None"):
            arange5.__dlpack__(stream=1)
    else:
        arange5.__dlpack__(stream=1)  # CUDA's legacy default stream


def test_dunder_dlpack_copy(arange5):
    """Argument parsing of ``copy`` (honouring it: ``test_copy``)."""
    arange5.__dlpack__(copy=True)
    arange5.__dlpack__(copy=None)
    arange5.__dlpack__(copy=False)
    with pytest.raises(TypeError, match="copy"):
        arange5.__dlpack__(copy=np.array([1, 2, 3]))


def test_from_dlpack_refcount(arange5):
    anchor = _dlpack.anchor_for(arange5.owner)
    start = anchor.live_exports
    y = np.from_dlpack(arange5, **host_kwargs(arange5))
    if arange5.device.platform == "cpu":
        assert anchor.live_exports == start + 1  # the array holds the view's memory
    del y
    assert anchor.live_exports == start


def test_to_numpy_counts_as_an_export(device):
    if device != "cpu":
        pytest.skip("to_numpy needs host memory")
    tensor, view, expected = make_view(device, "float32", (2, 3))
    anchor = _dlpack.anchor_for(tensor)
    array = view.to_numpy()
    derived = array[1:]
    assert array.flags.writeable and anchor.live_exports == 1
    np.testing.assert_array_equal(array, expected)
    del array
    assert anchor.live_exports == 1  # the derived view still holds the memory
    del derived
    assert anchor.live_exports == 0


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_dtype_passthrough(device, dtype):
    tensor, view, expected = make_view(device, dtype, (5,))
    y = np.from_dlpack(view, **host_kwargs(view))
    assert y.dtype == expected.dtype
    np.testing.assert_array_equal(y, expected)
    if device == "cpu":
        np.testing.assert_array_equal(view.to_numpy(), expected)
    del view, y
    tensor.free()


def test_bfloat16_through_to_numpy():
    """numpy's importer has no bfloat16; ``to_numpy`` still gives an ml_dtypes array."""
    tensor, view, expected = make_view("cpu", "bfloat16", (3, 2))
    array = view.to_numpy()
    assert array.dtype == expected.dtype
    np.testing.assert_array_equal(array, expected)
    assert array.ctypes.data == view.ptr
    del view, array
    tensor.free()


def test_invalid_byte_swapping(arange5):
    with pytest.raises(TypeError, match="byte order"):
        arange5.view(np.dtype("=i8").newbyteorder())


@pytest.mark.parametrize("ndim", range(33))
def test_higher_dims(device, ndim):
    shape = (1,) * ndim
    tensor, view, _ = make_view(device, "float64", shape)
    assert np.from_dlpack(view, **host_kwargs(view)).shape == shape
    del view
    tensor.free()


def test_dlpack_device(arange5, device):
    expected = (1, 0) if device == "cpu" else (2, arange5.device.index)
    assert arange5.__dlpack_device__() == expected
    y = np.from_dlpack(arange5, **host_kwargs(arange5))
    assert y.__dlpack_device__() == (1, 0)
    assert y[::2].__dlpack_device__() == (1, 0)


def dlpack_deleter_exception(view, max_version):
    _ = view.__dlpack__(max_version=max_version)
    raise RuntimeError


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_dlpack_destructor_exception(arange5, max_version):
    with pytest.raises(RuntimeError):
        dlpack_deleter_exception(arange5, max_version=max_version)


def test_writeable(arange5):
    """A versioned capsule without the read-only flag imports writable (numpy asks for one);
    a legacy-only producer's arrays are read-only in numpy, for backwards compatibility."""

    class OldDLPack:  # supports only the "old" protocol
        def __init__(self, view):
            self.view = view

        def __dlpack__(self, stream=None):
            return self.view.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.view.__dlpack_device__()

    if arange5.device.platform != "cpu":
        pytest.skip("numpy imports host memory only; a legacy producer cannot be asked for it")
    y = np.from_dlpack(arange5)
    assert y.flags.writeable
    y[0] = 42
    assert read_back(arange5)[0] == 42
    assert not np.from_dlpack(OldDLPack(arange5)).flags.writeable


def test_ndim0(device):
    tensor, view, expected = make_view(device, "float64", (), np.array(1.0))
    y = np.from_dlpack(view, **host_kwargs(view))
    np.testing.assert_array_equal(y, expected)
    assert y.shape == ()
    del view, y
    tensor.free()


def test_size1dims_arrays(device):
    tensor, view, expected = make_view(device, "float64", (10, 5, 1))
    np.testing.assert_array_equal(np.from_dlpack(view, **host_kwargs(view)), expected)
    del view
    tensor.free()


def test_copy(arange5, device):
    if device == "cpu":
        x = arange5.to_numpy()
        assert np.may_share_memory(x, np.from_dlpack(arange5))
        assert np.may_share_memory(x, np.from_dlpack(arange5, copy=False))
        assert not np.may_share_memory(x, np.from_dlpack(arange5, copy=True))
    else:
        with pytest.raises(BufferError, match="copy=False"):
            np.from_dlpack(arange5, device="cpu", copy=False)
    copied = np.from_dlpack(arange5, copy=True, **host_kwargs(arange5))
    np.testing.assert_array_equal(copied, np.arange(5))
    assert copied.ctypes.data != arange5.ptr


def test_device(arange5, device):
    arange5.__dlpack__(dl_device=(1, 0))
    np.from_dlpack(arange5, device="cpu")
    if device == "cpu":
        np.from_dlpack(arange5, device=None)
    with pytest.raises(BufferError):
        arange5.__dlpack__(dl_device=(10, 0))
    with pytest.raises(ValueError):
        np.from_dlpack(arange5, device="gpu")


# -- lifetime: the array outlives its producer (child processes) -----------------------------


@pytest.mark.parametrize("route", ["from_dlpack", "to_numpy", "capsule-later"])
def test_array_outlives_producer(route):
    """Drop the view and the ``ExtensibleTensor`` (no ``free()``): the array still reads its
    values; the memory goes with the last array."""
    script = (
        CHILD_PRODUCER
        + f"""
tensor, view = producer("cpu", np.arange(1000, dtype=np.float32))
route = {route!r}
if route == "from_dlpack":
    array = np.from_dlpack(view)
elif route == "to_numpy":
    array = view.to_numpy()[10:]
else:
    capsule = view.__dlpack__(max_version=(1, 0))
del view, tensor
gc.collect()
if route == "capsule-later":
    class Holder:
        def __dlpack__(self, **kwargs):
            return capsule
        def __dlpack_device__(self):
            return (1, 0)
    array = np.from_dlpack(Holder())
    del capsule
assert float(array.sum()) == float(np.arange(1000)[-array.size:].sum())
del array
gc.collect()
print("done")
"""
    )
    assert_normal_exit(run_child(script))


def test_array_outlives_free():
    """``free()`` means "I am done": an array exported before it keeps reading its values and
    the memory goes with the last array."""
    script = (
        CHILD_PRODUCER
        + """
tensor, view = producer("cpu", np.arange(1000, dtype=np.float32))
array = np.from_dlpack(view)
tensor.free()
assert float(array.sum()) == float(np.arange(1000).sum())
print("done")
"""
    )
    assert_normal_exit(run_child(script))
