"""The array API's DLPack conformance tests, with a ``BufferView`` as the array under test.

Source: data-apis ``array-api-tests``, ``array_api_tests/test_dlpack.py``
(``test_dlpack_device``, ``test_dunder_dlpack``, ``test_from_dlpack``), rewritten with
hypothesis strategies of our own over views of an ``ExtensibleTensor``; numpy, an array API
library, is the ``from_dlpack`` consumer (torch and JAX have their own files).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import pytest
from dlpack_producer import ALL_DTYPES, NUMPY_DTYPES, make_view
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbuf.dtypes import canonical_dtype


class DLPackDeviceEnum(IntEnum):
    """``__dlpack_device__`` device types the array API lists."""

    CPU = 1
    CUDA = 2
    CPU_PINNED = 3
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    CUDA_MANAGED = 13
    ONE_API = 14


# Shapes with at least one dimension, sides of at most 2 (the suite's hh.shapes(min_dims=1,
# max_side=2)); one buffer per device, large enough for any of them.
SHAPES = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture
def producer(device):
    """``make(dtype, shape)``: a filled view of a fresh buffer; all are freed afterwards."""
    made = []

    def make(dtype, shape):
        tensor, view, expected = make_view(device, dtype, shape)
        made.append(tensor)
        return view, expected

    yield make
    for tensor in made:
        tensor.free()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dlpack_device(producer, dtype):
    """``__dlpack_device__`` returns ``(device_type, device_id)``: a listed enum and an int."""
    view, _ = producer(dtype, (3,))
    device_type, device_id = view.__dlpack_device__()
    assert DLPackDeviceEnum(int(device_type))
    assert isinstance(device_id, int)


@SETTINGS
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=SHAPES,
    copy_kw=st.sampled_from([{}, {"copy": True}, {"copy": False}, {"copy": None}]),
    max_version_kw=st.one_of(
        st.just({}), st.tuples(st.integers(0, 2), st.just(0)).map(lambda v: {"max_version": v})
    ),
    dl_device_kw=st.sampled_from([{}, {"dl_device": (DLPackDeviceEnum.CPU, 0)}]),
)
def test_dunder_dlpack(producer, dtype, shape, copy_kw, max_version_kw, dl_device_kw):
    """Every combination of ``copy``, ``max_version`` and ``dl_device=(kDLCPU, 0)`` succeeds,
    except what the standard says must raise: ``copy=False`` when reaching the host needs a
    copy (a GPU view), a ``BufferError``."""
    view, _ = producer(dtype, shape)
    kwargs = {**copy_kw, **max_version_kw, **dl_device_kw}
    needs_copy = bool(dl_device_kw) and view.__dlpack_device__()[0] != DLPackDeviceEnum.CPU
    if needs_copy and copy_kw.get("copy") is False:
        with pytest.raises(BufferError):
            view.__dlpack__(**kwargs)
    else:
        view.__dlpack__(**kwargs)


@SETTINGS
@given(
    dtype=st.sampled_from(NUMPY_DTYPES),
    shape=SHAPES,
    copy_kw=st.sampled_from([{}, {"copy": True}, {"copy": False}]),
    ask_device=st.booleans(),
)
def test_from_dlpack(producer, dtype, shape, copy_kw, ask_device):
    """``y = from_dlpack(x, **device_kw, **copy_kw)``: on the asked device (numpy: the host),
    equal to ``x``; ``copy=False`` shares memory, ``copy=True`` does not; a cross-device
    ``copy=False`` is the producer's BufferError."""
    view, expected = producer(dtype, shape)
    on_host = view.__dlpack_device__()[0] == DLPackDeviceEnum.CPU
    device_kw = {"device": "cpu"} if ask_device or not on_host else {}
    if not on_host and copy_kw.get("copy") is False:
        with pytest.raises(BufferError):
            np.from_dlpack(view, **device_kw, **copy_kw)
        return
    y = np.from_dlpack(view, **device_kw, **copy_kw)
    assert y.device == "cpu"
    assert y.dtype == canonical_dtype(dtype).numpy and y.shape == shape
    np.testing.assert_array_equal(y, expected)
    if y.size and on_host:
        shares = y.ctypes.data == view.ptr
        assert shares == (copy_kw.get("copy") is not True)
