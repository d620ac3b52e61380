"""DLPack capsules and BufferView: layouts, protocol semantics, consumers, lifetime."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import _forkserver
import numpy as np
import pytest

from jaxbuf import _dlpack
from jaxbuf.devices import Device, as_device
from jaxbuf.dtypes import SUPPORTED_DTYPES, canonical_dtype
from jaxbuf.views import BufferView

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer.restype = ctypes.c_void_p
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.argtypes = [ctypes.py_object]
_get_name.restype = ctypes.c_char_p


def aligned(array: np.ndarray, alignment: int = 256) -> np.ndarray:
    """A copy of ``array`` whose data is ``alignment``-aligned: JAX's CPU client imports
    zero-copy only from aligned memory (jaxbuf's own memory is page-aligned)."""
    raw = np.zeros(array.nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    out = raw[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def host_view(array: np.ndarray, dtype=None, shape=None) -> BufferView:
    return BufferView(
        array.ctypes.data,
        array.nbytes,
        dtype or array.dtype.name,
        shape if shape is not None else array.shape,
        owner=array,
    )


# -- capsule layout -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4)])
def test_legacy_capsule_layout(shape):
    data = np.zeros(max(1, int(np.prod(shape))), np.float32)
    capsule = host_view(data, shape=shape).__dlpack__()
    assert _get_name(capsule) == b"dltensor"
    managed = _dlpack.DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor"))
    tensor = managed.dl_tensor
    assert tensor.data == data.ctypes.data
    assert (tensor.device.device_type, tensor.device.device_id) == (1, 0)
    assert tensor.ndim == len(shape)
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (2, 32, 1)
    assert [tensor.shape[i] for i in range(len(shape))] == list(shape)
    assert [tensor.strides[i] for i in range(len(shape))] == list(_dlpack.contiguous_strides(shape))
    assert tensor.byte_offset == 0
    assert managed.deleter == _dlpack.LEGACY_DELETER_ADDRESS
    assert managed.manager_ctx is not None  # the ExportAnchor keeping ``data`` alive


def test_versioned_capsule_only_when_asked():
    view = host_view(np.zeros(4, np.int64))
    assert _get_name(view.__dlpack__()) == b"dltensor"
    assert _get_name(view.__dlpack__(max_version=(0, 8))) == b"dltensor"
    capsule = view.__dlpack__(max_version=(1, 0))
    assert _get_name(capsule) == b"dltensor_versioned"
    managed = _dlpack.DLManagedTensorVersioned.from_address(
        _get_pointer(capsule, b"dltensor_versioned")
    )
    assert (managed.version.major, managed.version.minor) == _dlpack.DLPACK_VERSION
    assert managed.flags == 0
    assert managed.dl_tensor.shape[0] == 4
    assert managed.deleter == _dlpack.VERSIONED_DELETER_ADDRESS
    assert managed.manager_ctx is not None


def test_unconsumed_capsules_do_not_leak():
    """Each unconsumed capsule's block is freed by the C destructor: RSS stays flat."""
    psutil = pytest.importorskip("psutil")
    view = host_view(np.zeros(8, np.uint8), shape=(1, 1, 1, 1, 1, 1, 1, 8))
    process = psutil.Process()
    for _ in range(20_000):  # warm up allocator arenas
        view.__dlpack__()
    before = process.memory_info().rss
    for _ in range(300_000):  # 300k x ~200 bytes = 60 MB if leaked
        view.__dlpack__(max_version=(1, 0))
        view.__dlpack__()
    assert process.memory_info().rss - before < 8 << 20


# -- protocol semantics ---------------------------------------------------------------------


def test_dlpack_errors():
    view = host_view(np.zeros(4, np.int32))
    assert view.__dlpack_device__() == (1, 0)
    with pytest.raises(TypeError, match="copy"):  # copy=True is honoured: tests/test_dlpack_*
        view.__dlpack__(copy="yes")
    with pytest.raises(BufferError, match="device"):
        view.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match="stream"):
        view.__dlpack__(stream=5)
    view.__dlpack__(copy=False, dl_device=(1, 0), stream=None)
    view.__dlpack__(stream=-1)


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_every_dtype_round_trips_through_numpy_and_torch(name):
    dtype = canonical_dtype(name)
    raw = np.random.default_rng(0).integers(0, 2, 64, dtype=np.uint8)
    if name == "bool":
        raw[:] = raw & 1
    view = host_view(raw, "uint8", (64,)).view(dtype)
    assert view.shape == (64 // dtype.itemsize,)
    np.testing.assert_array_equal(view.to_numpy().view(np.uint8), raw)
    pytest.importorskip("torch")
    tensor = view.to_torch()
    assert str(tensor.dtype) == f"torch.{name}"
    assert tensor.data_ptr() == raw.ctypes.data


@pytest.mark.parametrize(
    "dtype, shape, error",
    [
        ("float32", (5,), ValueError),  # 20 bytes > 16
        ("int64", (3,), ValueError),
        ("float32", (-1,), ValueError),
        ("float32", (1.5,), TypeError),
        ("float32", "4", TypeError),
        ("complex256", None, TypeError),
        (">i4", None, TypeError),  # byte-swapped: DLPack has native byte order only
        ("nonsense", None, TypeError),
        (None, (4, 5), ValueError),
    ],
)
def test_view_rejects_shapes_and_dtypes(dtype, shape, error):
    view = host_view(np.zeros(16, np.uint8))
    with pytest.raises(error):
        view.view(dtype, shape)


def test_view_rejects_misaligned_pointer_and_ragged_size():
    base = np.zeros(32, np.uint8)
    odd = BufferView(base.ctypes.data + 1, 16, "uint8", owner=base)
    with pytest.raises(ValueError, match="aligned"):
        odd.view("int32")
    ragged = BufferView(base.ctypes.data, 10, "uint8", owner=base)
    with pytest.raises(ValueError, match="whole number"):
        ragged.view("int32")
    assert ragged.view("int32", (2,)).shape == (2,)  # a prefix that fits is fine


def test_to_numpy_rejects_device_memory():
    view = BufferView(0x1000, 16, "uint8", None, Device("cuda", 0), None, 2)
    with pytest.raises(BufferError, match="host memory"):
        view.to_numpy()


def test_to_numpy_keeps_the_owner_alive():
    import gc
    import weakref

    class Owner:
        def __init__(self):
            self.data = np.arange(8, dtype=np.int32)

    owner = Owner()
    ref = weakref.ref(owner)
    array = BufferView(owner.data.ctypes.data, 32, "int32", owner=owner).to_numpy()
    del owner
    gc.collect()
    assert ref() is not None
    assert array.tolist() == list(range(8))
    del array
    gc.collect()
    assert ref() is None


# -- consumers ------------------------------------------------------------------------------


def test_consumers_alias_the_same_bytes(framework):
    data = aligned(np.arange(12, dtype=np.float32))
    view = host_view(data, shape=(3, 4))
    if framework == "torch":
        import torch

        for tensor in (view.to_torch(), torch.from_dlpack(view)):
            assert tensor.data_ptr() == data.ctypes.data
            assert tuple(tensor.shape) == (3, 4)
        view.to_torch()[1, 2] = -1.0
    else:
        import jax
        import jax.numpy as jnp

        for array in (view.to_jax(), jax.dlpack.from_dlpack(view), jnp.from_dlpack(view)):
            assert array.unsafe_buffer_pointer() == data.ctypes.data
            assert array.shape == (3, 4)
        data[6] = -1.0  # JAX arrays are immutable; the host write must show through
        assert float(view.to_jax()[1, 2]) == -1.0
    assert data[6] == -1.0
    assert np.from_dlpack(view)[1, 2] == -1.0


def test_typed_views_through_frameworks(framework):
    data = aligned(np.arange(8, dtype=np.int32))  # JAX imports in place only at 64 bytes
    view = host_view(data)
    if framework == "torch":
        import torch

        tensor = view.to_torch(dtype=torch.float16, shape=(4, 4))
        assert tensor.dtype == torch.float16 and tuple(tensor.shape) == (4, 4)
    else:
        import jax.numpy as jnp

        array = view.to_jax(dtype=jnp.bfloat16, shape=(16,))
        assert array.dtype == jnp.bfloat16 and array.shape == (16,)


# -- devices and dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", Device("cpu", 0)),
        ("cuda", Device("cuda", 0)),
        ("cuda:1", Device("cuda", 1)),
        ("gpu:2", Device("cuda", 2)),
        (3, Device("cuda", 3)),
        (np.int64(1), Device("cuda", 1)),
    ],
)
def test_as_device(spec, expected):
    assert as_device(spec) == expected


@pytest.mark.parametrize(
    "spec, error",
    [
        ("tpu", ValueError),
        ("cuda:x", ValueError),
        (-1, ValueError),
        (None, TypeError),
        (True, TypeError),
        (1.0, TypeError),
    ],
)
def test_as_device_rejects(spec, error):
    with pytest.raises(error):
        as_device(spec)


def test_as_device_accepts_framework_devices(framework):
    if framework == "torch":
        import torch

        assert as_device(torch.device("cpu")) == Device("cpu")
        assert as_device(torch.device("cuda", 1)) == Device("cuda", 1)
    else:
        import jax

        assert as_device(jax.devices("cpu")[0]) == Device("cpu")


def test_canonical_dtype_spellings(framework):
    assert canonical_dtype("int32") == canonical_dtype(np.int32) == canonical_dtype(np.dtype("i4"))
    if framework == "torch":
        import torch

        assert canonical_dtype(torch.bfloat16).name == "bfloat16"
        assert canonical_dtype(torch.int64).name == "int64"
    else:
        import jax.numpy as jnp

        assert canonical_dtype(jnp.bfloat16).name == "bfloat16"
        assert canonical_dtype(jnp.float16).name == "float16"
    for bad in (None, True, "complex256", ">f8", object(), [1]):
        with pytest.raises(TypeError):
            canonical_dtype(bad)


# -- lifetime (subprocesses) ----------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    return _forkserver.run([sys.executable, "-c", textwrap.dedent(code)], timeout=300)


def test_thousands_of_jax_imports_and_a_donated_array():
    pytest.importorskip("jax")
    result = _run(
        """
        import numpy as np, jax, jax.numpy as jnp
        from jaxbuf.views import BufferView
        raw = np.zeros(4096 + 64, np.uint8)  # to_jax imports in place only at 64 bytes
        data = raw[-raw.ctypes.data % 64 :][:4096].view(np.float32)
        view = BufferView(data.ctypes.data, data.nbytes, "float32", owner=data)
        for _ in range(5000):
            jax.dlpack.from_dlpack(view)        # each import ends in the capsule's deleter
        step = jax.jit(lambda x: x + 1, donate_argnums=0)
        out = step(view.to_jax())               # JAX may call the deleter early here
        out.block_until_ready()
        print(float(out.sum()))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1024.0"


def test_views_alive_at_interpreter_exit():
    result = _run(
        """
        import numpy as np, torch, jax
        from jaxbuf.views import BufferView
        raw = np.ones(1024 + 64, np.uint8)  # to_jax imports in place only at 64 bytes
        data = raw[-raw.ctypes.data % 64 :][:1024].view(np.float32)
        view = BufferView(data.ctypes.data, data.nbytes, "float32", owner=data)
        keep = [view.to_torch(), view.to_jax(), view.__dlpack__(),
                view.__dlpack__(max_version=(1, 0))]
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- to_jax: zero-copy or BufferError, never a silent copy ---------------------------------


@pytest.mark.parametrize("offset", [4, 16, 48])
def test_to_jax_refuses_a_view_jax_would_copy(offset):
    pytest.importorskip("jax")
    data = aligned(np.arange(64, dtype=np.float32), 64)
    view = BufferView(data.ctypes.data + offset, 128, "float32", owner=data)
    with pytest.raises(BufferError, match=f"{offset} bytes past a 64-byte boundary") as caught:
        view.to_jax()
    assert f"{view.ptr:#x}" in str(caught.value)
    in_place = host_view(data).to_jax()  # aligned: imported where it is
    assert in_place.unsafe_buffer_pointer() == data.ctypes.data


def test_to_jax_refuses_64_bit_dtypes_jax_would_narrow():
    jax = pytest.importorskip("jax")
    data = aligned(np.arange(8, dtype=np.int64))
    view = host_view(data)
    with jax.enable_x64(False), pytest.raises(BufferError, match="jax_enable_x64"):
        view.to_jax()
    with jax.enable_x64(True):
        array = view.to_jax()
        assert array.dtype == np.int64 and array.unsafe_buffer_pointer() == data.ctypes.data
        assert array.tolist() == list(range(8))


def test_to_jax_of_an_empty_view_needs_no_alignment():
    pytest.importorskip("jax")
    data = aligned(np.zeros(16, np.uint8), 64)
    assert BufferView(data.ctypes.data + 4, 0, "uint8", owner=data).to_jax().shape == (0,)


# -- __dlpack__(copy=True) on a device: memory through the driver, not a buffer module -------


def test_device_copy_memory_is_a_released_one_chunk_reservation():
    from jaxbuf._reservation import committed_buffer
    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.testing import FaultInjectingDriver

    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    memory = committed_buffer(driver, 5000, 0, "DLPack copy")
    assert memory.num_chunks == 1 and memory.physical_bytes >= 5000
    ctypes.memset(memory.base_ptr, 0x5A, 5000)  # mapped and writable
    anchor = _dlpack.ExportAnchor(memory)
    del memory
    assert not anchor.target.released
    del anchor  # the capsule's anchor was the last holder: the memory goes with it
    driver.assert_clean()
    for kind in ("reserve", "create", "map", "set_access"):
        driver.fail_on(kind)
        with pytest.raises(Exception, match="INJECTED_FAULT"):
            committed_buffer(driver, 5000, 0, "DLPack copy")
        driver.assert_clean()  # rolled back at once, nothing left for the collector


def test_views_import_no_buffer_module():
    import ast
    import pathlib

    import jaxbuf.views

    tree = ast.parse(pathlib.Path(jaxbuf.views.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(alias.name for alias in node.names)  # from . import extensible
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    buffers = ("extensible", "uva", "staged", "sharing", "fused")
    assert not [m for m in imported if m.rpartition(".")[2] in buffers], imported


def test_a_device_copy_lives_in_driver_memory_owned_by_its_capsule():
    """``__dlpack__(copy=True)`` on a device view copies into memory from the driver (a
    committed virtual buffer), kept by the capsule alone: exercised here with the CPU driver
    standing in for the device."""
    import gc

    from jaxbuf import views
    from jaxbuf.extensible import ExtensibleTensor

    tensor = ExtensibleTensor(2 << 20, device="cpu")
    tensor.resize_per_segment_(4096)
    view = tensor.segment_view(0)
    view.to_numpy()[:] = np.arange(4096) % 251
    # kDLCUDA (2): the device branch; the capsule is never consumed, only its bytes read.
    capsule = views._copy_capsule(view, 2, 0, versioned=False)
    data = ctypes.c_uint64.from_address(_get_pointer(capsule, b"dltensor")).value
    assert data != view.ptr
    tensor.free()  # the copy is the capsule's, not the tensor's
    assert tensor.released
    copied = np.ctypeslib.as_array((ctypes.c_uint8 * 4096).from_address(data))
    np.testing.assert_array_equal(copied, np.arange(4096) % 251)
    del copied, capsule
    gc.collect()
