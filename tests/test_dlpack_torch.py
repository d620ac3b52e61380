"""torch as the consumer of a ``BufferView``: a port of PyTorch's own DLPack tests.

Source: PyTorch, ``test/test_dlpack.py`` (class ``TestTorchDlPack``), rewritten with a view
over an ``ExtensibleTensor`` as the producer where PyTorch uses ``make_tensor``. Tests of
torch's own exports (conjugate bit, sparse, requires_grad) have no counterpart: a view is
dense and plain. The lifetime tests run in a child process.
"""

from __future__ import annotations

import numpy as np
import pytest
from dlpack_producer import (
    ALL_DTYPES,
    CHILD_PRODUCER,
    assert_normal_exit,
    capsule_name,
    make_view,
    read_back,
    run_child,
)

from jaxbuf import _dlpack

torch = pytest.importorskip("torch", reason="torch is not installed")
from torch.utils.dlpack import from_dlpack  # noqa: E402

K_DL_HEXAGON = 16


def as_numpy(tensor) -> np.ndarray:
    """A host numpy copy of a torch tensor (bfloat16 through its bits)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        from jaxbuf.dtypes import canonical_dtype

        return tensor.view(torch.int16).numpy().view(canonical_dtype("bfloat16").numpy)
    return tensor.numpy()


def check_cuda_torch(device: str) -> None:
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")


@pytest.fixture
def view5(device):
    """``make_tensor((5,), dtype=torch.float32)``, in jaxbuf memory."""
    check_cuda_torch(device)
    tensor, view, expected = make_view(device, "float32", (5,))
    yield view, expected
    del view
    tensor.free()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dlpack_capsule_conversion(device, dtype):
    check_cuda_torch(device)
    tensor, view, expected = make_view(device, dtype, (5,))
    z = from_dlpack(view.__dlpack__())
    np.testing.assert_array_equal(as_numpy(z), expected)
    assert z.data_ptr() == view.ptr
    del view, z
    tensor.free()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dlpack_protocol_conversion(device, dtype):
    check_cuda_torch(device)
    tensor, view, expected = make_view(device, dtype, (5,))
    z = torch.from_dlpack(view)
    assert str(z.dtype) == f"torch.{dtype}"  # test_from_dlpack_dtype
    np.testing.assert_array_equal(as_numpy(z), expected)
    assert z.data_ptr() == view.ptr
    assert z.device.type == view.device.platform
    del view, z
    tensor.free()


def test_dlpack_shared_storage(view5):
    view, expected = view5
    z = from_dlpack(view.__dlpack__())
    z[0] = z[0] + 20.0
    expected = expected.copy()
    expected[0] += 20.0
    np.testing.assert_array_equal(read_back(view), expected)


@pytest.mark.gpu
def test_dlpack_conversion_with_streams(cuda_device):
    """The consumer's stream is ordered after the producer's pending work at the exchange."""
    check_cuda_torch(cuda_device)
    tensor, view, expected = make_view(cuda_device, "float32", (5,))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        z = torch.from_dlpack(view)
        result = z + 1
    stream.synchronize()
    np.testing.assert_array_equal(as_numpy(result), expected + 1)
    del view, z
    tensor.free()


@pytest.mark.gpu
def test_dlpack_conversion_with_diff_streams(cuda_device):
    check_cuda_torch(cuda_device)
    tensor, view, expected = make_view(cuda_device, "float32", (5,))
    stream_a, stream_b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(stream_a):
        z = torch.from_dlpack(view.__dlpack__(stream=stream_b.cuda_stream))
        stream_a.synchronize()
    stream_b.synchronize()
    np.testing.assert_array_equal(as_numpy(z), expected)
    del view, z
    tensor.free()


def test_dlpack_tensor_invalid_stream(view5):
    view, _ = view5
    with pytest.raises(TypeError):
        view.__dlpack__(stream=object())


def test_dlpack_invalid_cpu_stream():
    tensor, view, _ = make_view("cpu", "float32", (5,))
    with pytest.raises(BufferError, match="stream must be None"):
        view.__dlpack__(stream=0)
    del view
    tensor.free()


@pytest.mark.gpu
def test_dlpack_invalid_cuda_streams(cuda_device):
    tensor, view, _ = make_view(cuda_device, "float32", (5,))
    with pytest.raises(BufferError, match="stream 0"):
        view.__dlpack__(stream=0)
    del view
    tensor.free()


def test_automatically_select_in_creation(view5):
    """``torch.tensor`` of an object with DLPack methods goes through them (a copy)."""
    view, expected = view5
    new_tensor = torch.tensor(view)
    np.testing.assert_array_equal(as_numpy(new_tensor), expected)
    assert new_tensor.data_ptr() != view.ptr


@pytest.mark.parametrize("max_version", [None, (0, 8), (1, 0), (2, 0)])
def test_max_version(view5, max_version):
    view, expected = view5
    kwargs = {} if max_version is None else {"max_version": max_version}
    versioned = max_version is not None and max_version[0] >= 1
    capsule = view.__dlpack__(**kwargs)
    assert capsule_name(capsule) == ("dltensor_versioned" if versioned else "dltensor")
    np.testing.assert_array_equal(as_numpy(torch.from_dlpack(capsule)), expected)


def _from_dlpack(view, out_device=None, copy=None):
    out = torch.from_dlpack(view, device=out_device, copy=copy)
    expected_device = torch.device(view.device.platform if out_device is None else out_device)
    assert out.device.type == expected_device.type
    np.testing.assert_array_equal(as_numpy(out), read_back(view))
    # Moved (not copied) only when copy=False, or copy=None on the same device.
    same_device = expected_device.type == view.device.platform
    if copy is False or (copy is None and same_device):
        assert out.data_ptr() == view.ptr
    else:
        assert out.data_ptr() != view.ptr
    return out


def test_copy(view5):
    view, _ = view5
    _from_dlpack(view, copy=True)
    _from_dlpack(view, out_device=str(view.device), copy=True)
    _from_dlpack(view, out_device="cpu", copy=True)
    if view.device.platform != "cpu":  # another device: copied
        _from_dlpack(view, out_device="cpu")


def test_no_copy(view5):
    view, _ = view5
    _from_dlpack(view)
    _from_dlpack(view, copy=False)
    _from_dlpack(view, out_device=str(view.device))
    _from_dlpack(view, out_device=str(view.device), copy=False)


@pytest.mark.gpu
def test_needs_copy_error(cuda_device):
    check_cuda_torch(cuda_device)
    tensor, view, _ = make_view(cuda_device, "float32", (5,))
    # Our BufferError ("copy=False forbids it"), or torch's own check ("cannot move ...").
    with pytest.raises((BufferError, ValueError), match="copy|cannot move"):
        torch.from_dlpack(view, device="cpu", copy=False)
    del view
    tensor.free()


def test_unsupported_device_error(view5):
    view, _ = view5
    with pytest.raises(BufferError, match="cannot export to device"):
        view.__dlpack__(max_version=(1, 0), dl_device=(K_DL_HEXAGON, 0))


def test_numpy_dlpack_protocol_conversion(view5):
    """Another consumer (numpy) and back: numpy's array of the view, then torch of that."""
    view, expected = view5
    if view.device.platform != "cpu":
        pytest.skip("numpy reads host memory only")
    arr = np.from_dlpack(view)
    np.testing.assert_array_equal(arr, expected)
    res = torch.from_dlpack(arr)
    assert res.data_ptr() == view.ptr


def test_tensor_deleter_releases_the_export(view5):
    """torch calls the deleter when its tensor dies: the export count follows the tensor."""
    view, _ = view5
    anchor = _dlpack.anchor_for(view.owner)
    start = anchor.live_exports
    z = torch.from_dlpack(view)
    derived = z[1:]
    del z
    assert anchor.live_exports == start + 1
    del derived
    assert anchor.live_exports == start


# -- lifetime: the tensor outlives its producer (child processes) ----------------------------


@pytest.mark.parametrize("route", ["torch.from_dlpack", "to_torch", "capsule-later"])
def test_tensor_outlives_producer(device, route):
    """Drop the view and the ``ExtensibleTensor`` (no ``free()``): the tensor still reads."""
    check_cuda_torch(device)
    script = (
        CHILD_PRODUCER
        + f"""
import torch
tensor, view = producer({device!r}, np.arange(1000, dtype=np.float32))
route = {route!r}
if route == "torch.from_dlpack":
    t = torch.from_dlpack(view)
elif route == "to_torch":
    t = view.to_torch()[10:]
else:
    capsule = view.__dlpack__()
del view, tensor
gc.collect()
if route == "capsule-later":
    t = torch.from_dlpack(capsule)
    del capsule
assert float(t.sum()) == float(np.arange(1000)[-t.numel():].sum())
del t
gc.collect()
print("done")
"""
    )
    assert_normal_exit(run_child(script))


def test_tensor_outlives_free():
    """``free()`` with a live tensor: the tensor keeps its memory until its last consumer goes."""
    script = (
        CHILD_PRODUCER
        + """
import torch
tensor, view = producer("cpu", np.arange(1000, dtype=np.float32))
t = torch.from_dlpack(view)
tensor.free()
assert float(t.sum()) == float(np.arange(1000).sum())
print("done")
"""
    )
    assert_normal_exit(run_child(script))
