"""The DLPack Python specification, clause by clause, with a ``BufferView`` as the producer.

Sources (the clauses are paraphrased in each test's docstring; the tests are written here):

* DLPack, "Python Specification for DLPack",
  https://dmlc.github.io/dlpack/latest/python_spec.html (capsule names and renaming, the
  destructor, the deleter's threads, versioned capsules, ``stream``/``dl_device``/``copy``);
* the array API's ``array.__dlpack__`` and ``array.__dlpack_device__`` pages,
  https://data-apis.org/array-api/latest/API_specification/generated/array_api.array.__dlpack__.html;
* ``dlpack.h`` v1.x (``DLDataTypeCode``, the flags, NULL data for size-zero tensors).

The producer's side of the ownership model is tested here too: every capsule holds
an :class:`~jaxbuf._capsule.ExportAnchor` in ``manager_ctx`` and counts in its
``live_exports`` until its deleter runs.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import numpy as np
import pytest
from dlpack_producer import (
    ALL_DTYPES,
    CHILD_PRODUCER,
    EMPTY_SHAPES,
    assert_normal_exit,
    capsule_name,
    capsule_pointer,
    make_view,
    read_back,
    run_child,
    write,
)

from jaxbuf import _capsule, _dlpack
from jaxbuf.dtypes import canonical_dtype
from jaxbuf.views import BufferView

K_DL_CPU, K_DL_CUDA = 1, 2
K_DL_HEXAGON = 16
DTYPE_CODES = {"int": 0, "uint": 1, "float": 2, "bfloat": 4, "complex": 5, "bool": 6}


def dl_code(name: str) -> int:
    return DTYPE_CODES[name.rstrip("0123456789")]


def managed_tensor(capsule):
    """The ctypes struct behind a capsule (legacy or versioned, by its name)."""
    address = capsule_pointer(capsule)
    if capsule_name(capsule).endswith("versioned"):
        return _dlpack.DLManagedTensorVersioned.from_address(address)
    return _dlpack.DLManagedTensor.from_address(address)


@pytest.fixture
def float_view(device):
    tensor, view, expected = make_view(device, "float32", (2, 3))
    yield view, expected
    del view
    tensor.free()


# -- capsules: names, versions, fields -------------------------------------------------------


VERSIONED = "dltensor_versioned"


@pytest.mark.parametrize(
    "max_version, name",
    [(None, "dltensor"), ((0, 8), "dltensor"), ((1, 0), VERSIONED), ((2, 0), VERSIONED)],
)
def test_capsule_name_follows_max_version(float_view, max_version, name):
    """A producer returns a versioned capsule only when the consumer's ``max_version`` major
    is >= 1, and never a version above the consumer's (the consumer checks)."""
    view, _ = float_view
    capsule = view.__dlpack__(max_version=max_version)
    assert capsule_name(capsule) == name
    if name.endswith("versioned"):
        managed = managed_tensor(capsule)
        version = (managed.version.major, managed.version.minor)
        assert version == _dlpack.DLPACK_VERSION
        assert version[0] <= max_version[0]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("versioned", [False, True])
def test_dl_tensor_describes_the_view(device, dtype, versioned):
    """``DLTensor``: data, device, ndim, dtype (code, bits, lanes = 1), shape, compact row-major
    strides (in elements) and ``byte_offset`` 0; the versioned header has no flags set (the
    view is writable and was not copied)."""
    tensor, view, _ = make_view(device, dtype, (2, 3, 4))
    capsule = view.__dlpack__(max_version=(1, 0) if versioned else None)
    managed = managed_tensor(capsule)
    dl = managed.dl_tensor
    assert dl.data == view.ptr
    assert (dl.device.device_type, dl.device.device_id) == view.__dlpack_device__()
    assert dl.ndim == 3
    itemsize = canonical_dtype(dtype).itemsize
    assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (dl_code(dtype), 8 * itemsize, 1)
    assert [dl.shape[i] for i in range(3)] == [2, 3, 4]
    assert [dl.strides[i] for i in range(3)] == [12, 4, 1]
    assert dl.byte_offset == 0
    if versioned:
        assert managed.flags == 0
        assert managed.deleter == _dlpack.VERSIONED_DELETER_ADDRESS
    else:
        assert managed.deleter == _dlpack.LEGACY_DELETER_ADDRESS
    assert managed.manager_ctx is not None
    del capsule, view
    tensor.free()


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_size_zero_tensor_has_null_data(device, shape, max_version):
    """dlpack.h: a tensor with no elements has a NULL data pointer."""
    tensor, view, _ = make_view(device, "int32", shape)
    capsule = view.__dlpack__(max_version=max_version)
    dl = managed_tensor(capsule).dl_tensor
    assert dl.data is None
    assert [dl.shape[i] for i in range(len(shape))] == list(shape)
    del view
    tensor.free()


def test_dlpack_device(device):
    """``__dlpack_device__`` is ``(device_type, device_id)``: ``(kDLCPU, 0)`` on the host,
    ``(kDLCUDA, ordinal)`` on a GPU."""
    tensor, view, _ = make_view(device, "uint8", (4,))
    expected = (K_DL_CPU, 0) if device == "cpu" else (K_DL_CUDA, view.device.index)
    assert view.__dlpack_device__() == expected
    del view
    tensor.free()


# -- the capsule's lifetime: manager_ctx, deleter, destructor ---------------------------------


def test_every_capsule_holds_the_anchor_until_its_deleter_runs(float_view):
    """``manager_ctx`` holds the producer's anchor; the count of live exports follows the
    capsules: an unconsumed capsule's destructor calls the deleter, which drops it."""
    view, _ = float_view
    anchor = _dlpack.anchor_for(view.owner)
    assert isinstance(anchor, _capsule.ExportAnchor)
    start = anchor.live_exports
    capsules = [view.__dlpack__(), view.__dlpack__(max_version=(1, 0))]
    assert anchor.live_exports == start + 2
    assert [managed_tensor(c).manager_ctx for c in capsules] == [id(anchor)] * 2
    del capsules
    assert anchor.live_exports == start


def test_a_consumed_capsule_is_renamed_and_released_by_its_consumer(float_view):
    """A consumer renames the capsule ``used_dltensor`` and calls the deleter itself when its
    array dies; the destructor of a used capsule does nothing (no double release)."""
    torch = pytest.importorskip("torch")
    view, expected = float_view
    anchor = _dlpack.anchor_for(view.owner)
    start = anchor.live_exports
    capsule = view.__dlpack__()
    tensor = torch.utils.dlpack.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_dltensor"
    del capsule
    assert anchor.live_exports == start + 1
    np.testing.assert_array_equal(tensor.cpu().numpy(), expected)
    del tensor
    assert anchor.live_exports == start


def test_a_capsule_is_consumed_at_most_once(float_view):
    """The spec: a capsule may be consumed only once (the rename marks it)."""
    torch = pytest.importorskip("torch")
    view, _ = float_view
    capsule = view.__dlpack__()
    first = torch.utils.dlpack.from_dlpack(capsule)
    with pytest.raises(RuntimeError, match="consumed only once"):
        torch.utils.dlpack.from_dlpack(capsule)
    del first


_SET_NAME = ctypes.pythonapi.PyCapsule_SetName
_SET_NAME.argtypes = [ctypes.py_object, ctypes.c_char_p]
_USED_NAME = ctypes.c_char_p(b"used_dltensor")  # a capsule keeps a pointer to its name
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a foreign call: ctypes releases the GIL


@pytest.mark.parametrize("use_thread", [False, True])
def test_the_deleter_runs_without_the_gil_on_any_thread(use_thread):
    """The spec: the deleter may be called from any thread, without the GIL (JAX does). It
    takes the GIL itself before dropping the anchor; the last drop releases the producer."""

    class Owner:  # any object: anchor_for wraps it
        pass

    owner = Owner()
    data = np.arange(4, dtype=np.float32)
    view = BufferView(data.ctypes.data, data.nbytes, "float32", owner=owner)
    capsule = view.__dlpack__()
    anchor = _dlpack.anchor_for(owner)
    assert anchor.live_exports == 1
    address = capsule_pointer(capsule)
    _SET_NAME(capsule, _USED_NAME)  # consumed: the destructor leaves the deleter to us
    deleter = _DELETER(_dlpack.DLManagedTensor.from_address(address).deleter)
    dead = weakref.ref(owner)
    del view, owner, capsule
    if use_thread:
        worker = threading.Thread(target=deleter, args=(address,))
        worker.start()
        worker.join()
    else:
        deleter(address)
    assert anchor.live_exports == 0
    del anchor
    assert dead() is None


def test_a_capsule_dropped_while_an_exception_propagates_keeps_the_exception(float_view):
    """numpy's ``test_dlpack_destructor_exception``: the deleter runs with an exception set
    and must neither clear nor replace it."""
    view, _ = float_view

    def export_then_raise():
        _capsule_alive = view.__dlpack__(max_version=(1, 0))  # noqa: F841 - dies in unwinding
        raise KeyError("the original error")

    with pytest.raises(KeyError, match="the original error"):
        export_then_raise()


def test_capsules_and_arrays_alive_at_interpreter_exit(device):
    """Capsules (unconsumed, consumed by numpy/torch, in a cycle, held by a daemon thread)
    alive at exit: the deleter does nothing with Python while finalizing; a normal exit."""
    script = (
        CHILD_PRODUCER
        + f"""
import threading, time
tensor, view = producer({device!r}, np.arange(16, dtype=np.float32))
unconsumed = [view.__dlpack__(), view.__dlpack__(max_version=(1, 0))]
arrays = []
if {device!r} == "cpu":
    arrays.append(np.from_dlpack(view))
try:
    import torch
    arrays.append(torch.from_dlpack(view))
except ImportError:
    pass
class Cycle:
    pass
cycle = Cycle()
cycle.me, cycle.capsule = cycle, view.__dlpack__()
def hold(capsule=view.__dlpack__()):
    time.sleep(60)
threading.Thread(target=hold, daemon=True).start()
del view, tensor
print("done", flush=True)
"""
    )
    assert_normal_exit(run_child(script))


# -- stream, dl_device, copy ------------------------------------------------------------------


def test_stream_rules(float_view, device):
    """``stream``: an int or None; on the CPU only None (and -1, "no synchronisation"); on
    CUDA, 0 is disallowed (ambiguous), 1 is the legacy default stream."""
    view, _ = float_view
    view.__dlpack__(stream=None)
    view.__dlpack__(stream=-1)
    for bad in (object(), 1.5, True, "1"):
        with pytest.raises(TypeError, match="stream"):
            view.__dlpack__(stream=bad)
    if device == "cpu":
        for stream in (0, 1, 2, 5):
            with pytest.raises(BufferError, match="stream"):
                view.__dlpack__(stream=stream)
    else:
        with pytest.raises(BufferError, match="stream 0"):
            view.__dlpack__(stream=0)
        view.__dlpack__(stream=1)


def test_dl_device_the_own_device_is_zero_copy(float_view):
    """``dl_device`` equal to ``__dlpack_device__()`` exports in place (copy None or False)."""
    view, _ = float_view
    for copy in (None, False):
        capsule = view.__dlpack__(dl_device=view.__dlpack_device__(), copy=copy)
        assert managed_tensor(capsule).dl_tensor.data == view.ptr


def test_dl_device_host_of_a_device_view(float_view, device):
    """``dl_device=(kDLCPU, 0)``: a host view exports in place; a CUDA view is copied to host
    memory the capsule owns (``copy=None`` or True), and ``copy=False`` is a BufferError."""
    view, expected = float_view
    capsule = view.__dlpack__(dl_device=(K_DL_CPU, 0), max_version=(1, 0))
    managed = managed_tensor(capsule)
    dl = managed.dl_tensor
    assert (dl.device.device_type, dl.device.device_id) == (K_DL_CPU, 0)
    host = np.from_dlpack(_Capsule(capsule, (K_DL_CPU, 0)))
    np.testing.assert_array_equal(host, expected)
    if device == "cpu":
        assert dl.data == view.ptr
    else:
        assert dl.data != view.ptr
        assert managed.flags & _dlpack.FLAG_IS_COPIED
        with pytest.raises(BufferError, match="copy=False"):
            view.__dlpack__(dl_device=(K_DL_CPU, 0), copy=False)
    with pytest.raises(BufferError, match="stream"):
        view.__dlpack__(dl_device=(K_DL_CPU, 0), stream=5)


@pytest.mark.parametrize("dl_device", [(K_DL_CUDA, 7), (K_DL_HEXAGON, 0), (10, 0)])
def test_dl_device_elsewhere_is_a_buffer_error(float_view, dl_device):
    """A device the producer cannot export to: BufferError (the array API's choice)."""
    view, _ = float_view
    with pytest.raises(BufferError, match="cannot export"):
        view.__dlpack__(dl_device=dl_device)


@pytest.mark.parametrize("bad", [[1, 0], (1,), (1, 0, 0), ("1", 0), (1.0, 0), (True, 0)])
def test_malformed_dl_device_and_max_version(float_view, bad):
    view, _ = float_view
    with pytest.raises(TypeError, match="dl_device"):
        view.__dlpack__(dl_device=bad)
    with pytest.raises(TypeError, match="max_version"):
        view.__dlpack__(max_version=bad)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_copy_true_exports_a_copy_the_capsule_owns(float_view, max_version):
    """``copy=True``: the producer must copy; the copy is the capsule's (it outlives the
    view), the versioned flags say IS_COPIED, and writes to the source do not reach it."""
    view, expected = float_view
    capsule = view.__dlpack__(copy=True, max_version=max_version)
    managed = managed_tensor(capsule)
    assert managed.dl_tensor.data != view.ptr
    assert (managed.dl_tensor.device.device_type, managed.dl_tensor.device.device_id) == (
        view.__dlpack_device__()
    )
    if max_version:
        assert managed.flags == _dlpack.FLAG_IS_COPIED
    write(view, np.zeros_like(expected))
    copied = BufferView(managed.dl_tensor.data, view.nbytes, "float32", (2, 3), view.device)
    np.testing.assert_array_equal(read_back(copied), expected)
    del copied, managed, capsule  # the copy is freed with its capsule
    gc.collect()


def test_copy_true_of_an_empty_view(device):
    tensor, view, _ = make_view(device, "float32", (0, 3))
    capsule = view.__dlpack__(copy=True)
    dl = managed_tensor(capsule).dl_tensor
    assert dl.data is None and dl.shape[0] == 0
    del view
    tensor.free()


@pytest.mark.parametrize("bad", ["yes", 1, 0, np.array([1, 2, 3])])
def test_copy_must_be_a_bool_or_none(float_view, bad):
    view, _ = float_view
    with pytest.raises(TypeError, match="copy"):
        view.__dlpack__(copy=bad)


# -- dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [">i4", "<i4", ">f8", "<c8", "=u2"])
def test_only_native_byte_order(spelling):
    """DLPack has no byte order: a byte-swapped dtype is refused, not exported as native."""
    dtype = np.dtype(spelling)
    if dtype.isnative:
        assert canonical_dtype(spelling).name == dtype.name
    else:
        with pytest.raises(TypeError, match="byte order"):
            canonical_dtype(spelling)
        with pytest.raises(TypeError, match="byte order"):
            BufferView(np.zeros(2, np.int64).ctypes.data, 16).view(spelling)


@pytest.mark.parametrize("name, code, bits", [("complex64", 5, 64), ("complex128", 5, 128)])
def test_complex_dtypes(name, code, bits):
    dtype = canonical_dtype(name)
    assert (dtype.dlpack_code, dtype.itemsize * 8) == (code, bits)
    assert canonical_dtype(np.dtype(name)) is dtype


# -- the owner contract: exports of a freed owner, check order ----------------------------------


def test_a_view_of_a_freed_owner_does_not_export(device):
    """A view taken before ``free()`` raises at ``__dlpack__``/``to_numpy`` instead of
    exporting memory that is gone."""
    tensor, view, _ = make_view(device, "float32", (4,))
    tensor.free()
    with pytest.raises(RuntimeError, match="freed"):
        view.__dlpack__()
    with pytest.raises(RuntimeError, match="freed"):
        view.__dlpack__(copy=True)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="freed"):
            view.to_numpy()


def test_a_closed_owner_exports_nothing():
    """The owner contract: ``export_anchor`` is the owner's ExportAnchor while it is open (what
    capsules hold) and None once closed; then ``check_exportable()`` raises the owner's own
    error and nothing is exported (no capsule, no count). An owner whose check does not raise
    but whose anchor is gone is refused all the same."""

    class Owner:
        def __init__(self, raises: bool) -> None:
            self.anchor = _capsule.ExportAnchor(self.__class__)  # any object to keep alive
            self.closed = False
            self.raises = raises

        def check_exportable(self) -> None:
            if self.closed and self.raises:
                raise RuntimeError("Owner is closed")

        @property
        def export_anchor(self):
            return None if self.closed else self.anchor

    for raises, message in ((True, "closed"), (False, "freed")):
        owner = Owner(raises)
        data = np.zeros(4, np.int32)
        view = BufferView(data.ctypes.data, data.nbytes, "int32", owner=owner)
        capsule = view.__dlpack__()
        assert managed_tensor(capsule).manager_ctx == id(owner.anchor)
        assert owner.anchor.live_exports == 1
        owner.closed = True
        with pytest.raises(RuntimeError, match=message):
            view.__dlpack__()
        with pytest.raises(RuntimeError, match=message):
            view.to_numpy()
        assert owner.anchor.live_exports == 1
        del capsule
        assert owner.anchor.live_exports == 0


# -- ExportAnchor itself ------------------------------------------------------------------------


def test_export_anchor_object():
    class Target:
        pass

    target = Target()
    anchor = _capsule.ExportAnchor(target)
    assert anchor.target is target and anchor.live_exports == 0
    assert "ExportAnchor of Target" in repr(anchor)
    with pytest.raises(AttributeError):
        anchor.live_exports = 5
    with pytest.raises(AttributeError):
        anchor.target = None
    with pytest.raises(TypeError):

        class Sub(_capsule.ExportAnchor):  # not a base type: counts stay trustworthy
            pass

    assert weakref.ref(anchor)() is anchor
    with pytest.raises(TypeError, match="ExportAnchor"):
        _capsule.new_capsule(*_dlpack.pack_payload(0, 1, 0, 2, 32, (1,)), target)


def test_an_anchor_in_a_reference_cycle_is_collected():
    """The target may reference its anchor (an owner storing ``ExportAnchor(self)``): the
    anchor takes part in garbage collection, and the target's release runs."""

    class Owner:
        pass

    owner = Owner()
    owner.anchor = _capsule.ExportAnchor(owner)
    dead = weakref.ref(owner)
    del owner
    gc.collect()
    assert dead() is None


def test_objects_without_an_anchor_share_one_while_exports_live():
    class Owner:
        pass

    owner = Owner()
    data = np.zeros(4, np.int32)
    view = BufferView(data.ctypes.data, data.nbytes, "int32", owner=owner)
    first, second = view.__dlpack__(), view.__dlpack__()
    anchor = _dlpack.anchor_for(owner)
    assert anchor.target is owner and anchor.live_exports == 2
    assert managed_tensor(first).manager_ctx == managed_tensor(second).manager_ctx == id(anchor)
    dead = weakref.ref(owner)
    del view, owner, first
    assert dead() is not None and anchor.live_exports == 1
    del second, anchor
    assert dead() is None


class _Capsule:
    """Hands a consumer one prepared capsule through the protocol."""

    def __init__(self, capsule, device) -> None:
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device
