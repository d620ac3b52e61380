"""CuPy as the consumer of a ``BufferView``: a port of CuPy's own DLPack tests.

Source: CuPy, ``tests/cupy_tests/core_tests/test_dlpack.py`` (``TestDLPackConversion``,
``TestDLTensorMemory``: the deleter tests, consumption at most once), rewritten with a view
over an ``ExtensibleTensor`` on the GPU as the producer. CuPy's memory-pool block counts become
the anchor's ``live_exports``. Skipped where CuPy is not installed, and on the CPU (CuPy
imports CUDA memory only).
"""

from __future__ import annotations

import numpy as np
import pytest
from dlpack_producer import (
    CHILD_PRODUCER,
    assert_normal_exit,
    capsule_name,
    make_view,
    run_child,
)

from jaxbuf import _dlpack

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

# CuPy's list, plus the complex and bool types later versions exchange.
CUPY_DTYPES = [
    *(f"{kind}{bits}" for kind in ("uint", "int") for bits in (8, 16, 32, 64)),
    *("float16", "float32", "float64", "complex64", "complex128", "bool"),
]


@pytest.fixture
def gpu_device(device):
    if device == "cpu":
        pytest.skip("CuPy imports CUDA memory only")
    return device


@pytest.mark.parametrize("dtype", CUPY_DTYPES)
def test_conversion(gpu_device, dtype):
    tensor, view, expected = make_view(gpu_device, dtype, (2, 3))
    capsule = view.__dlpack__()
    array = cupy.from_dlpack(capsule)
    np.testing.assert_array_equal(cupy.asnumpy(array), expected)
    assert array.data.ptr == view.ptr
    protocol = cupy.from_dlpack(view)  # the object itself, through __dlpack__(stream=...)
    np.testing.assert_array_equal(cupy.asnumpy(protocol), expected)
    del array, protocol, capsule, view
    tensor.free()


def test_deleter(gpu_device):
    """An unconsumed capsule's destructor releases its export."""
    tensor, view, _ = make_view(gpu_device, "float64", (10,))
    anchor = _dlpack.anchor_for(tensor)
    capsule = view.__dlpack__()
    assert anchor.live_exports == 1
    del view
    assert anchor.live_exports == 1
    del capsule
    assert anchor.live_exports == 0
    tensor.free()


def test_deleter_of_a_consumed_capsule(gpu_device):
    """A consumed capsule's export goes with the consumer's array, not with the capsule."""
    tensor, view, _ = make_view(gpu_device, "float64", (10,))
    anchor = _dlpack.anchor_for(tensor)
    capsule = view.__dlpack__()
    array = cupy.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_dltensor"
    del view
    assert anchor.live_exports == 1
    del array
    assert anchor.live_exports == 0
    del capsule
    assert anchor.live_exports == 0
    tensor.free()


def test_multiple_consumption_error(gpu_device):
    tensor, view, _ = make_view(gpu_device, "float64", (10,))
    capsule = view.__dlpack__()
    first = cupy.from_dlpack(capsule)
    with pytest.raises(ValueError, match="consumed multiple times"):
        cupy.from_dlpack(capsule)
    del first, capsule, view
    tensor.free()


def test_array_outlives_producer(gpu_device):
    script = (
        CHILD_PRODUCER
        + f"""
import cupy
tensor, view = producer({gpu_device!r}, np.arange(1000, dtype=np.float32))
array = cupy.from_dlpack(view)
del view, tensor
gc.collect()
assert float(array.sum()) == float(np.arange(1000).sum())
del array
print("done")
"""
    )
    assert_normal_exit(run_child(script))
