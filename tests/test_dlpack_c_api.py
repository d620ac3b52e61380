"""DLPack's C exchange API (dlpack.h 1.3): ``BufferView.__dlpack_c_exchange_api__`` read and
called through ctypes, and the exchanges with torch (both ways) and tvm-ffi built on it.

The functions are called as a consumer calls them: with the GIL held (``PYFUNCTYPE``, which
raises the Python error a failing function sets), except the allocator and the deleter, which
consumers may call without it (``CFUNCTYPE`` releases it). Cases where a bug would take the
interpreter down (memory read after a free) run in a child process.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest
from dlpack_producer import (
    CHILD_PRODUCER,
    assert_normal_exit,
    capsule_pointer,
    make_view,
    read_back,
    run_child,
)

from jaxbuf import _capsule, _dlpack
from jaxbuf.views import BufferView

K_DL_CPU, K_DL_CUDA, K_DL_HEXAGON = 1, 2, 16
POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)

ManagedPointer = ctypes.POINTER(_dlpack.DLManagedTensorVersioned)
SET_ERROR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
ALLOCATOR = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.POINTER(_dlpack.DLTensor),
    ctypes.POINTER(ManagedPointer),
    ctypes.c_void_p,
    SET_ERROR,
)
FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ManagedPointer))
TO_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ManagedPointer, ctypes.POINTER(ctypes.c_void_p))
DLTENSOR_FROM_PY = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.py_object, ctypes.POINTER(_dlpack.DLTensor)
)
CURRENT_STREAM = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)
)
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.argtypes = (ctypes.py_object,)
_capsule_name.restype = ctypes.c_char_p
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_capsule_pointer.restype = ctypes.c_void_p
_decref = ctypes.pythonapi.Py_DecRef
_decref.argtypes = (ctypes.c_void_p,)


class ExchangeAPIHeader(ctypes.Structure):
    _fields_ = [("version", _dlpack.DLPackVersion), ("prev_api", ctypes.c_void_p)]


class ExchangeAPI(ctypes.Structure):
    """``DLPackExchangeAPI``: the header, then five function pointers (the order of dlpack.h)."""

    _fields_ = [
        ("header", ExchangeAPIHeader),
        ("managed_tensor_allocator", ctypes.c_void_p),
        ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
        ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
        ("dltensor_from_py_object_no_sync", ctypes.c_void_p),
        ("current_work_stream", ctypes.c_void_p),
    ]


def exchange_api(cls) -> ExchangeAPI:
    capsule = cls.__dlpack_c_exchange_api__
    assert _capsule_name(capsule) == b"dlpack_exchange_api"
    return ExchangeAPI.from_address(_capsule_pointer(capsule, b"dlpack_exchange_api"))


API = exchange_api(BufferView)


def from_py(obj, api: ExchangeAPI = API) -> _dlpack.DLManagedTensorVersioned:
    """``managed_tensor_from_py_object_no_sync(obj)``: the managed tensor (the caller owes its
    deleter a call)."""
    out = ManagedPointer()
    assert FROM_PY(api.managed_tensor_from_py_object_no_sync)(obj, ctypes.byref(out)) == 0
    return out.contents


def delete(managed: _dlpack.DLManagedTensorVersioned) -> None:
    """Call the managed tensor's deleter, without the GIL (as a consumer thread may)."""
    DELETER(managed.deleter)(ctypes.addressof(managed))


def to_py(managed: _dlpack.DLManagedTensorVersioned, api: ExchangeAPI = API):
    """``managed_tensor_to_py_object_no_sync(managed)``: the object (ownership moved)."""
    out = ctypes.c_void_p()
    assert TO_PY(api.managed_tensor_to_py_object_no_sync)(ctypes.byref(managed), out) == 0
    obj = ctypes.cast(out, ctypes.py_object).value
    _decref(out)  # the new reference the function returned
    return obj


def fields(tensor: _dlpack.DLTensor) -> tuple:
    ndim = tensor.ndim
    return (
        tensor.data or 0,
        (tensor.device.device_type, tensor.device.device_id),
        ndim,
        (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes),
        tuple(tensor.shape[i] for i in range(ndim)),
        tuple(tensor.strides[i] for i in range(ndim)),
        tensor.byte_offset,
    )


@pytest.fixture
def float_view(device):
    tensor, view, expected = make_view(device, "float32", (2, 3))
    yield view, expected
    del view
    tensor.free()


class ReadOnlyOwner:
    """An owner whose memory is mapped read-only (as an ImportedBuffer sent read_only=True)."""

    read_only = True

    def __init__(self) -> None:
        self.export_anchor = _capsule.ExportAnchor(type(self))

    def check_exportable(self) -> None:
        return None


# -- the table ---------------------------------------------------------------------------------


def test_the_type_carries_a_dlpack_1_3_table():
    """A capsule named ``dlpack_exchange_api`` on the type (consumers look it up there), over
    a static table of version 1.3 with no older table chained and every function set."""
    capsule = BufferView.__dlpack_c_exchange_api__
    assert _capsule_name(capsule) == b"dlpack_exchange_api"
    assert _capsule_pointer(capsule, b"dlpack_exchange_api") == _capsule.EXCHANGE_API_ADDRESS
    assert (API.header.version.major, API.header.version.minor) == (1, 3)
    assert API.header.prev_api is None
    for name, _ in ExchangeAPI._fields_[1:]:
        assert getattr(API, name), f"{name} is NULL"
    assert _dlpack.exchange_api_of(BufferView) is capsule
    assert _dlpack.exchange_api_of(object) is None


@pytest.mark.parametrize("shape", [(), (4,), (2, 3), (3, 1), (0, 4), (2, 0, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool", "complex64"])
def test_the_managed_tensor_is_what_dlpack_exports(device, dtype, shape):
    """``managed_tensor_from_py_object_no_sync`` gives the tensor of
    ``__dlpack__(max_version=(1, 3))``: version, flags, every DLTensor field, explicit strides
    whenever ``ndim > 0``, the owner's anchor in ``manager_ctx`` (counted as a live export),
    jaxbuf's deleter, which gives the export back exactly once."""
    tensor, view, _ = make_view(device, dtype, shape)
    anchor = tensor.export_anchor
    start = anchor.live_exports
    capsule = view.__dlpack__(max_version=(1, 3))
    expected = _dlpack.DLManagedTensorVersioned.from_address(capsule_pointer(capsule))
    managed = from_py(view)
    assert anchor.live_exports == start + 2
    # dlpack.h: the version of the header the producer follows, the table's own.
    table_version = (API.header.version.major, API.header.version.minor)
    assert (managed.version.major, managed.version.minor) == table_version == (1, 3)
    assert managed.flags == expected.flags == 0
    assert fields(managed.dl_tensor) == fields(expected.dl_tensor)
    if len(shape) > 0:
        assert managed.dl_tensor.strides, "NULL strides with ndim > 0"
    assert managed.manager_ctx == id(anchor)
    assert managed.deleter == _dlpack.VERSIONED_DELETER_ADDRESS
    delete(managed)
    assert anchor.live_exports == start + 1
    del capsule, expected
    assert anchor.live_exports == start
    tensor.free()


def test_a_read_only_owner_is_flagged_both_ways():
    """Over a read-only owner the managed tensor carries ``READ_ONLY``, as the versioned
    capsule does (same payload); numpy arrays stay read-only, legacy capsules have no flags."""
    data = np.arange(6, dtype=np.float32)
    view = BufferView(data.ctypes.data, data.nbytes, "float32", (2, 3), owner=ReadOnlyOwner())
    managed = from_py(view)
    assert managed.flags & _dlpack.FLAG_READ_ONLY
    capsule = view.__dlpack__(max_version=(1, 3))
    flags = _dlpack.DLManagedTensorVersioned.from_address(capsule_pointer(capsule)).flags
    assert flags == managed.flags == _dlpack.FLAG_READ_ONLY
    delete(managed)
    assert not view.to_numpy().flags.writeable
    writable = BufferView(data.ctypes.data, data.nbytes, "float32")
    managed = from_py(writable)
    assert managed.flags == 0
    delete(managed)


def test_the_dltensor_is_borrowed_from_the_view():
    """``dltensor_from_py_object_no_sync`` fills the caller's DLTensor with the view's fields,
    shape and strides pointing into the view's own payload (alive as long as the view), and
    exports nothing (no count, nothing to delete)."""
    tensor, view, _ = make_view("cpu", "int32", (3, 4))
    anchor = tensor.export_anchor
    out = _dlpack.DLTensor()
    assert DLTENSOR_FROM_PY(API.dltensor_from_py_object_no_sync)(view, ctypes.byref(out)) == 0
    managed = from_py(view)
    assert fields(out) == fields(managed.dl_tensor)
    assert fields(out)[5] == (4, 1)
    payload = view._versioned_payload[0]
    base = ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p).value
    shape_address = ctypes.cast(out.shape, ctypes.c_void_p).value
    assert base <= shape_address < base + len(payload)
    assert anchor.live_exports == 1  # the managed tensor only
    delete(managed)
    assert anchor.live_exports == 0
    del view
    tensor.free()


@pytest.mark.parametrize("device_type", [K_DL_CPU, K_DL_CUDA, 3, 10])
def test_the_work_stream_is_the_default_one(device_type):
    """jaxbuf's device work goes on the legacy default stream (handle NULL); the CPU has none."""
    stream = ctypes.c_void_p(12345)
    assert CURRENT_STREAM(API.current_work_stream)(device_type, 0, ctypes.byref(stream)) == 0
    assert stream.value is None


def test_no_work_stream_on_an_unknown_device():
    stream = ctypes.c_void_p()
    with pytest.raises(BufferError, match="device type 16"):
        CURRENT_STREAM(API.current_work_stream)(K_DL_HEXAGON, 0, ctypes.byref(stream))


@pytest.mark.parametrize(
    "payload",
    [b"short", (b"\0" * 64, 0, 64, False), (b"\0" * 81, 32, 80, True), [b"\0" * 80, 32, 80, True]],
)
def test_a_malformed_payload_is_refused(payload):
    """The C reads only a payload of the versioned layout that ``_dlpack.pack_payload`` makes:
    anything else is a ValueError, with nothing exported or borrowed."""
    tensor, view, _ = make_view("cpu", "float32", (4,))
    view._versioned_payload = payload
    with pytest.raises(ValueError, match="malformed DLPack payload"):
        FROM_PY(API.managed_tensor_from_py_object_no_sync)(view, ctypes.byref(ManagedPointer()))
    with pytest.raises(ValueError, match="malformed DLPack payload"):
        DLTENSOR_FROM_PY(API.dltensor_from_py_object_no_sync)(
            view, ctypes.byref(_dlpack.DLTensor())
        )
    assert tensor.export_anchor.live_exports == 0
    del view
    tensor.free()


# -- the allocator -----------------------------------------------------------------------------


def prototype(shape, code=2, bits=32, lanes=1, device_type=K_DL_CPU):
    extents = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    tensor = _dlpack.DLTensor()
    tensor.device.device_type, tensor.device.device_id = device_type, 0
    tensor.ndim = len(shape)
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = code, bits, lanes
    tensor.shape = ctypes.cast(extents, ctypes.POINTER(ctypes.c_int64))
    return tensor, extents


class ErrorSink:
    """A consumer's ``SetError``: records every (kind, message) it is given."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []
        self.callback = SET_ERROR(self._record)

    def _record(self, context, kind, message) -> None:
        self.errors.append((kind.decode(), message.decode()))


def allocate(tensor: _dlpack.DLTensor, sink: ErrorSink) -> tuple[int, ManagedPointer]:
    out = ManagedPointer()
    status = ALLOCATOR(API.managed_tensor_allocator)(
        ctypes.byref(tensor), ctypes.byref(out), None, sink.callback
    )
    return status, out


def test_the_allocator_makes_a_host_tensor_without_the_gil():
    """A consumer's allocation request (tvm-ffi makes it with the GIL released): host memory,
    64-byte aligned, row-major strides, kept alive by the tensor until its deleter runs."""
    tensor, _extents = prototype((3, 5))
    sink = ErrorSink()
    status, out = allocate(tensor, sink)
    assert (status, sink.errors) == (0, [])
    managed = out.contents
    data, device, ndim, dtype, shape, strides, offset = fields(managed.dl_tensor)
    assert (device, ndim, dtype, shape, strides, offset) == (
        (1, 0),
        2,
        (2, 32, 1),
        (3, 5),
        (5, 1),
        0,
    )
    assert data % 64 == 0
    assert managed.manager_ctx and managed.deleter == _dlpack.VERSIONED_DELETER_ADDRESS
    block = ctypes.cast(managed.manager_ctx, ctypes.py_object).value.target
    keeper = weakref.ref(block)
    del block
    array = np.ctypeslib.as_array(ctypes.cast(data, ctypes.POINTER(ctypes.c_float)), (3, 5))
    array[:] = 7
    assert float(array.sum()) == 105
    del array
    delete(managed)
    gc.collect()
    assert keeper() is None


def test_an_empty_allocation_holds_nothing():
    tensor, _extents = prototype((0, 4))
    status, out = allocate(tensor, ErrorSink())
    assert status == 0
    assert not out.contents.dl_tensor.data and not out.contents.manager_ctx
    delete(out.contents)


@pytest.mark.parametrize(
    "request_, kind, message",
    [
        (dict(shape=(4,), lanes=2), "ValueError", "single-lane"),
        (dict(shape=(4,), bits=12), "ValueError", "whole-byte"),
        (dict(shape=(4, -1)), "ValueError", "negative extent"),
        (dict(shape=(1 << 62, 1 << 62)), "ValueError", "overflows"),
        (dict(shape=(4,), device_type=K_DL_HEXAGON), "BufferError", "not DLPack type 16"),
    ],
)
def test_the_allocator_reports_errors_through_set_error(request_, kind, message):
    """A request jaxbuf cannot serve fails with -1 and one ``SetError`` call naming the Python
    exception type, leaves ``out`` NULL and no Python exception pending."""
    tensor, _extents = prototype(**request_)
    sink = ErrorSink()
    status, out = allocate(tensor, sink)
    assert status == -1 and not out
    assert len(sink.errors) == 1 and sink.errors[0][0] == kind
    assert message in sink.errors[0][1]


# -- importing a consumer's tensor -------------------------------------------------------------


def test_a_managed_tensor_imports_as_a_view_that_owns_it():
    """``managed_tensor_to_py_object_no_sync`` takes the tensor: a view over the same bytes,
    whose owner calls the tensor's deleter (once) when the view and its exports are gone."""
    tensor, source, expected = make_view("cpu", "float32", (2, 3))
    anchor = tensor.export_anchor
    view = to_py(from_py(source))
    assert isinstance(view, BufferView)
    assert (view.ptr, view.shape, view.dtype.name) == (source.ptr, (2, 3), "float32")
    assert np.array_equal(view.to_numpy(), expected)
    assert anchor.live_exports == 1
    exported = view.to_numpy()
    del view
    gc.collect()
    assert anchor.live_exports == 1  # the numpy array still holds the imported tensor
    del exported
    gc.collect()
    assert anchor.live_exports == 0
    tensor.free()


def test_a_read_only_tensor_imports_as_a_read_only_view():
    data = np.arange(6, dtype=np.float32)
    source = BufferView(data.ctypes.data, data.nbytes, "float32", (2, 3), owner=ReadOnlyOwner())
    view = to_py(from_py(source))
    assert view.owner.read_only
    assert not view.to_numpy().flags.writeable


def test_a_strided_tensor_is_refused_and_deleted():
    """A layout no view describes: ``BufferError``, and the tensor is deleted (its export given
    back), since the importer owns it either way."""
    tensor, source, _ = make_view("cpu", "float32", (2, 3))
    anchor = tensor.export_anchor
    managed = from_py(source)
    managed.dl_tensor.strides[0], managed.dl_tensor.strides[1] = 1, 2  # column-major
    with pytest.raises(BufferError, match="strided"):
        to_py(managed)
    assert anchor.live_exports == 0
    del source
    tensor.free()


# -- errors, in a child: a wrong answer here could read freed memory ------------------------


def test_a_freed_view_exports_nothing_through_the_c_api():
    """A view of a freed owner: each producer call fails with the owner's error set as a Python
    exception (no pointer out, no count, no crash); so does ``to_torch``'s exchange. An object
    of another type is a TypeError. And a tensor taken before ``free()`` keeps the memory
    readable until its deleter runs, which then releases it."""
    script = (
        CHILD_PRODUCER
        + """
import ctypes, gc, weakref
sys.path.insert(0, {tests!r})
from test_dlpack_c_api import API, DLTENSOR_FROM_PY, FROM_PY, ManagedPointer, delete, from_py
from jaxbuf import _dlpack

tensor, view = producer("cpu", np.arange(1000, dtype=np.float32))
managed = from_py(view)
allocation = weakref.ref(tensor.export_anchor.target)
tensor.free()
data = ctypes.cast(managed.dl_tensor.data, ctypes.POINTER(ctypes.c_float))
assert sum(data[i] for i in range(1000)) == float(np.arange(1000).sum())
for call, out in ((FROM_PY(API.managed_tensor_from_py_object_no_sync), ManagedPointer()),
                  (DLTENSOR_FROM_PY(API.dltensor_from_py_object_no_sync), _dlpack.DLTensor())):
    try:
        call(view, ctypes.byref(out))
    except RuntimeError as error:
        assert "freed" in str(error), error
    else:
        raise AssertionError("a freed view was exported")
    assert not isinstance(out, ManagedPointer) or not out
    try:
        call(object(), ctypes.byref(out))
    except TypeError as error:
        assert "BufferView" in str(error), error
    else:
        raise AssertionError("another type was exported")
try:
    view.to_torch()
except RuntimeError as error:
    assert "freed" in str(error), error
else:
    raise AssertionError("to_torch of a freed view")
assert allocation() is not None
delete(managed)
gc.collect()
assert allocation() is None
print("done")
"""
    ).format(tests=str(__import__("pathlib").Path(__file__).parent))
    assert_normal_exit(run_child(script))


def test_a_consumer_that_fails_gets_its_tensor_deleted_once():
    """``exchange_to`` with a consumer whose import fails: one that deleted the tensor (as
    dlpack.h asks) is not followed by a second delete, one that failed before taking it has
    it deleted by jaxbuf; either way the export is given back and the error raised. In a
    child: a double delete would abort."""
    script = (
        CHILD_PRODUCER
        + """
import ctypes
sys.path.insert(0, {tests!r})
from test_dlpack_c_api import TO_PY, ExchangeAPI, delete
from jaxbuf import _dlpack

capsule_new = ctypes.pythonapi.PyCapsule_New
capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
capsule_new.restype = ctypes.py_object
NAME = b"dlpack_exchange_api"

def consumer(deletes):
    def import_(managed, out):
        if deletes:
            delete(managed.contents)
        return -1
    table = ExchangeAPI()
    table.header.version.major, table.header.version.minor = 1, 3
    callback = TO_PY(import_)
    table.managed_tensor_to_py_object_no_sync = ctypes.cast(callback, ctypes.c_void_p).value
    return capsule_new(ctypes.addressof(table), NAME, None), (table, callback)

tensor, view = producer("cpu", np.arange(16, dtype=np.float32))
anchor = tensor.export_anchor
for deletes in (True, False, True):
    api, keep = consumer(deletes)
    try:
        _dlpack.exchange_to(api, view, None)
    except BufferError as error:
        assert "refused" in str(error), error
    else:
        raise AssertionError("a failing consumer returned a tensor")
    assert anchor.live_exports == 0, (deletes, anchor.live_exports)
print("done")
"""
    ).format(tests=str(__import__("pathlib").Path(__file__).parent))
    assert_normal_exit(run_child(script))


def test_a_null_py_object_is_refused():
    """A C caller passing NULL for the object gets a ValueError naming it, not a crash (in a
    child: the unfixed functions dereference it)."""
    script = """
import ctypes, sys
sys.path.insert(0, {tests!r})
from test_dlpack_c_api import API, ManagedPointer
from jaxbuf import _dlpack

for name, out in (("managed_tensor_from_py_object_no_sync", ManagedPointer()),
                  ("dltensor_from_py_object_no_sync", _dlpack.DLTensor())):
    call = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(getattr(API, name))
    try:
        call(None, ctypes.addressof(out))
    except ValueError as error:
        assert "py_object is NULL" in str(error) and name in str(error), error
    else:
        raise AssertionError(name + " took a NULL object")
print("done")
""".format(tests=str(__import__("pathlib").Path(__file__).parent))
    assert_normal_exit(run_child(script))


def test_null_data_under_elements_is_refused_and_deleted():
    """A consumer's tensor with ``data = NULL`` and elements describes no memory: refused with
    ``BufferError`` (no view at address 0 for numpy or torch to read), the tensor deleted."""
    tensor, source, _ = make_view("cpu", "float32", (4,))
    anchor = tensor.export_anchor
    managed = from_py(source)
    managed.dl_tensor.data = None
    managed.dl_tensor.byte_offset = 64
    with pytest.raises(BufferError, match="NULL data"):
        to_py(managed)
    assert anchor.live_exports == 0
    del source
    tensor.free()


def test_an_empty_tensor_may_have_null_data():
    tensor, source, _ = make_view("cpu", "float32", (0, 4))
    view = to_py(from_py(source))
    assert (view.ptr, view.nbytes, view.shape) == (0, 0, (0, 4))
    assert view.to_numpy().shape == (0, 4)
    del view
    gc.collect()
    tensor.free()


# What each malformed field of a consumer's tensor is refused with, by
# managed_tensor_to_py_object_no_sync (a BufferError naming the field).
MALFORMED = {
    "strided": "strided",
    "major version 2": "major version 2",
    "major version 0": "major version 0",
    "null data": "NULL data",
    "negative extent": "extent -2",
    "null shape": "NULL shape",
    "negative ndim": "ndim -1",
    "huge ndim": "ndim 100000",
    "offset wraps": "wraps",
}


def test_a_refused_foreign_tensor_keeps_its_error_and_is_deleted_once():
    """A consumer's own tensor (its deleter a Python callback, as through ctypes), refused for
    each malformed field: the caller gets the ``BufferError`` itself (not a ``SystemError`` or
    ``PyObject is NULL``), the deleter runs once with no exception pending, nothing is
    reported as ignored. In a child: the stderr is checked."""
    script = """
import ctypes, sys
sys.path.insert(0, {tests!r})
import numpy as np
from test_dlpack_c_api import API, DELETER, MALFORMED, TO_PY
from jaxbuf import _dlpack

data = np.arange(6, dtype=np.float32)
shape = (ctypes.c_int64 * 2)(2, 3)
strides = (ctypes.c_int64 * 2)(3, 1)
deleted = []

def on_delete(address):
    deleted.append(address)
    int("0")  # Python code that works only with no exception pending

deleter = DELETER(on_delete)
to_py = TO_PY(API.managed_tensor_to_py_object_no_sync)
for case, message in MALFORMED.items():
    managed = _dlpack.DLManagedTensorVersioned()
    managed.version.major, managed.version.minor = 1, 3
    managed.deleter = ctypes.cast(deleter, ctypes.c_void_p).value
    tensor = managed.dl_tensor
    tensor.data, tensor.ndim = data.ctypes.data, 2
    tensor.device.device_type = 1
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = 2, 32, 1
    shape[:] = (2, 3)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    if case == "strided":
        strides[0], strides[1] = 1, 2
    elif case.startswith("major"):
        managed.version.major = int(case[-1])
    elif case == "null data":
        tensor.data = None
    elif case == "negative extent":
        shape[1] = -2
    elif case == "null shape":
        tensor.shape = None
    elif case == "negative ndim":
        tensor.ndim = -1
    elif case == "huge ndim":
        tensor.ndim = 100000
    elif case == "offset wraps":
        tensor.byte_offset = 2**64 - 16
    out = ctypes.c_void_p()
    deleted.clear()
    try:
        to_py(ctypes.byref(managed), ctypes.byref(out))
    except BufferError as error:
        assert message in str(error), (case, error)
    else:
        raise AssertionError(case + " was imported")
    assert deleted == [ctypes.addressof(managed)], (case, deleted)
    assert not out.value
    strides[0], strides[1] = 3, 1
print("done")
""".format(tests=str(__import__("pathlib").Path(__file__).parent))
    assert_normal_exit(run_child(script))


# -- torch, both ways ------------------------------------------------------------------------


torch_only = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torch is not installed"
)


def torch_api():
    torch = pytest.importorskip("torch")
    if _dlpack.exchange_api_of(torch.Tensor) is None:
        pytest.skip(f"torch {torch.__version__} has no __dlpack_c_exchange_api__")
    return torch, exchange_api(torch.Tensor)


def check_cuda_torch(torch, device: str) -> None:
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")


@torch_only
def test_to_torch_goes_through_torch_exchange_api(float_view, device):
    """``to_torch`` hands the managed tensor to torch's ``managed_tensor_to_py_object_no_sync``:
    the tensor aliases the view, holds one export, and writes show through both ways."""
    torch, _ = torch_api()
    check_cuda_torch(torch, device)
    view, expected = float_view
    from jaxbuf import interop

    adapter = interop.get("torch")
    anchor = view.owner.export_anchor
    start = anchor.live_exports
    t = view.to_torch()
    assert adapter._exchange_api is torch.Tensor.__dlpack_c_exchange_api__
    assert t.data_ptr() == view.ptr and t.device.type == device and t.shape == (2, 3)
    assert t.stride() == (3, 1)
    assert np.array_equal(t.cpu().numpy(), expected)
    assert anchor.live_exports == start + 1
    t[1, 2] = 42
    if device == "cuda":
        torch.cuda.synchronize()
    assert read_back(view)[1, 2] == 42
    del t
    gc.collect()
    assert anchor.live_exports == start


@torch_only
def test_to_torch_without_torch_exchange_api_uses_capsules(float_view, device, monkeypatch):
    """The fallback of a torch without the exchange API: the capsule path, same tensor."""
    torch, _ = torch_api()
    check_cuda_torch(torch, device)
    view, expected = float_view
    import jaxbuf.interop.torch as torch_adapter
    from jaxbuf import interop

    adapter = interop.get("torch")
    view.to_torch()  # binds the importer
    monkeypatch.setattr(adapter, "_exchange_api", None)
    monkeypatch.setattr(torch_adapter, "exchange_to", None)  # a call through it would fail
    t = view.to_torch()
    assert t.data_ptr() == view.ptr and np.array_equal(t.cpu().numpy(), expected)


@torch_only
def test_a_torch_tensor_imports_as_a_view(device):
    """torch's ``managed_tensor_from_py_object_no_sync`` into jaxbuf's importer: a view over the
    tensor's storage, which stays alive while the view does; a strided tensor is refused."""
    torch, torch_table = torch_api()
    check_cuda_torch(torch, device)
    source = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    view = to_py(from_py(source, torch_table))
    assert (view.ptr, view.shape, view.dtype.name, view.device.platform) == (
        source.data_ptr(),
        (3, 4),
        "float32",
        device,
    )
    storage = weakref.ref(source.untyped_storage()) if hasattr(source, "untyped_storage") else None
    del source
    gc.collect()
    assert np.array_equal(read_back(view), np.arange(12, dtype=np.float32).reshape(3, 4))
    back = view.to_torch()  # and on to torch again, through the exchange
    assert float(back.sum()) == 66
    del storage
    strided = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4).t()
    with pytest.raises(BufferError, match="strided"):
        to_py(from_py(strided, torch_table))


@torch_only
def test_torch_reads_jaxbuf_through_its_own_c_api_and_back():
    """torch's exchange consumer and producer on jaxbuf objects: a tensor built by torch from
    jaxbuf's managed tensor, exported again by torch, imported by jaxbuf, same bytes."""
    torch, torch_table = torch_api()
    tensor, view, expected = make_view("cpu", "int16", (5,))
    anchor = tensor.export_anchor
    t = to_py(from_py(view), torch_table)
    assert isinstance(t, torch.Tensor) and t.data_ptr() == view.ptr
    again = to_py(from_py(t, torch_table))
    assert again.ptr == view.ptr and np.array_equal(again.to_numpy(), expected)
    assert anchor.live_exports == 1  # torch holds jaxbuf's tensor; jaxbuf holds torch's
    del t, again
    gc.collect()
    assert anchor.live_exports == 0
    del view
    tensor.free()


class PendingOwner:
    """An owner with a pending write and a driver that records the stream waits it is asked
    for: the ordering logic, run without a GPU (nothing here touches the memory)."""

    def __init__(self, fail: bool = False) -> None:
        self.export_anchor = _capsule.ExportAnchor(type(self))
        self.ready_event = object()
        self.driver = self
        self.waits: list[tuple[int, int]] = []
        self.fail = fail

    def check_exportable(self) -> None:
        return None

    def stream_wait_event(self, stream: int, event: object, index: int) -> None:
        if self.fail:
            raise RuntimeError("stream_wait_event failed")
        self.waits.append((stream, index))


def stand_in_cuda_view(owner: PendingOwner, data: np.ndarray) -> BufferView:
    from jaxbuf.devices import Device

    return BufferView(
        data.ctypes.data, data.nbytes, "float32", (2, 3), Device("cuda", 1), owner, K_DL_CUDA
    )


def test_exports_order_after_pending_writes_without_a_gpu(monkeypatch):
    """The producer functions order the legacy default stream (DLPack 1, what
    ``current_work_stream`` names) on the view's device; ``exchange_to`` orders the stream it
    is given; a failed wait fails the export and gives it back."""
    data = np.zeros(6, np.float32)
    owner = PendingOwner()
    view = stand_in_cuda_view(owner, data)
    managed = from_py(view)
    assert owner.waits == [(1, 1)] and owner.export_anchor.live_exports == 1
    assert (managed.dl_tensor.device.device_type, managed.dl_tensor.device.device_id) == (2, 1)
    delete(managed)
    imported = _dlpack.exchange_to(BufferView.__dlpack_c_exchange_api__, view, 12345)
    assert owner.waits[-1] == (12345, 1) and imported.ptr == view.ptr
    assert imported.device.platform == "cuda" and imported.device.index == 1
    del imported
    failing = PendingOwner(fail=True)
    view = stand_in_cuda_view(failing, data)
    with pytest.raises(RuntimeError, match="stream_wait_event failed"):
        from_py(view)
    with pytest.raises(RuntimeError, match="stream_wait_event failed"):
        _dlpack.exchange_to(BufferView.__dlpack_c_exchange_api__, view, 7)
    assert failing.export_anchor.live_exports == 0


def pending_cuda_view(monkeypatch):
    """A CUDA view whose owner has a pending write (a zeroing memset on the producer stream),
    and the DLPack streams its driver is asked to order after it."""
    import jaxbuf

    buffer = jaxbuf.ExtensibleTensor(64 << 20, device="cuda")
    buffer.resize_segments_([64 << 20], zero_new=True)
    assert buffer.ready_event is not None, "the zeroing memset left no pending write"
    waits: list[int] = []
    wait = buffer.driver.stream_wait_event

    def recording_wait(stream, event, index):
        waits.append(stream)
        return wait(stream, event, index)

    monkeypatch.setattr(buffer.driver, "stream_wait_event", recording_wait)
    return buffer, buffer.segment_view(0).view("float32"), waits


@torch_only
@pytest.mark.gpu
def test_to_torch_orders_torchs_stream_after_pending_writes(monkeypatch):
    """On the exchange path as on the capsule path, torch's current stream (a side stream
    here) is made to wait for the owner's pending writes before the tensor exists."""
    torch, _ = torch_api()
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    buffer, view, waits = pending_cuda_view(monkeypatch)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tensor = view.to_torch()
        total = float(tensor.sum())
    assert waits == [stream.cuda_stream]
    assert total == 0.0
    del tensor, view
    buffer.free()


@pytest.mark.gpu
def test_the_c_export_orders_the_default_stream_after_pending_writes(monkeypatch):
    """``managed_tensor_from_py_object_no_sync`` orders what ``current_work_stream`` names
    (the legacy default stream, DLPack number 1), as ``__dlpack__(stream=None)`` does; the
    borrowed DLTensor too."""
    buffer, view, waits = pending_cuda_view(monkeypatch)
    managed = from_py(view)
    assert waits == [1]
    assert (managed.dl_tensor.device.device_type, managed.dl_tensor.device.device_id) == (2, 0)
    delete(managed)
    out = _dlpack.DLTensor()
    assert DLTENSOR_FROM_PY(API.dltensor_from_py_object_no_sync)(view, ctypes.byref(out)) == 0
    assert waits == [1, 1] and out.data == view.ptr
    del view
    buffer.free()


# -- tvm-ffi ---------------------------------------------------------------------------------


def tvm():
    return pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")


class _CapsuleRefusingView(BufferView):
    """A view whose ``__dlpack__`` fails: only the C exchange API can read it."""

    __slots__ = ()

    def __dlpack__(self, **kwargs):
        raise AssertionError("__dlpack__ was called: the C exchange API was not used")


def refusing(view: BufferView) -> _CapsuleRefusingView:
    return _CapsuleRefusingView(
        view.ptr, view.nbytes, view.dtype, view.shape, view.device, view.owner,
        view.dlpack_device_type,
    )  # fmt: skip


def test_tvm_ffi_from_dlpack_is_zero_copy_through_the_c_api(float_view, device):
    tvm_ffi = tvm()
    view, expected = float_view
    view = refusing(view)
    anchor = view.owner.export_anchor
    start = anchor.live_exports
    array = tvm_ffi.from_dlpack(view)
    assert array.data_ptr() == view.ptr and tuple(array.shape) == (2, 3)
    assert anchor.live_exports == start + 1
    del array
    gc.collect()
    assert anchor.live_exports == start


def test_tvm_ffi_functions_take_and_return_views(float_view, device):
    """A tvm-ffi function called on a view reads it through the C API, and a tensor it returns
    comes back as a jaxbuf view over the same bytes (``managed_tensor_to_py_object_no_sync``)."""
    tvm_ffi = tvm()
    view, expected = float_view
    view = refusing(view)
    anchor = view.owner.export_anchor
    start = anchor.live_exports
    tvm_ffi.get_global_func("testing.nop")(view)
    assert anchor.live_exports == start
    echoed = tvm_ffi.get_global_func("testing.echo")(view)
    assert isinstance(echoed, BufferView) and echoed.ptr == view.ptr
    assert np.array_equal(read_back(echoed), expected)
    assert anchor.live_exports == start + 1
    del echoed
    gc.collect()
    assert anchor.live_exports == start
