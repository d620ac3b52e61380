"""The child process of tests/test_c_fuzz.py: builds arguments from recipes and calls the C
entry points of ``jaxbuf._staging`` (the stager and packer) and ``jaxbuf._capsule`` with them.

A request ``("run", {"calls": [...]})`` runs one example's calls in order, on fresh objects,
and replies with each call's outcome: ``("ok", repr)``, ``("raised", type_name, message)`` or,
for an exception of a type no entry point may raise, ``("undocumented", traceback)``. A crash
kills this process, and the runner reports the signal.
"""

from __future__ import annotations

import gc
import traceback

import numpy as np

# What the raw entry points may raise for bad arguments: the documented types, plus what
# CPython's own argument conversion raises (OverflowError for an int past the C type,
# MemoryError for a size no allocation can meet).
ALLOWED = (ValueError, TypeError, IndexError, BufferError, RuntimeError, OverflowError, MemoryError)

DTYPES = ("int32", "int64", "float32", "float16", "uint8", "int16", "float64", "bool", ">i4")


class Example:
    """The objects of one example: stagers, their buffers, anchors, kept values."""

    def __init__(self) -> None:
        from jaxbuf import _capsule, _staging

        self.staging, self.capsule = _staging, _capsule
        self.stagers: list = []
        self.buffers: list[bytearray] = []
        self.kept: list = []  # keeps every value a call saw alive until the example ends

    # -- recipes -----------------------------------------------------------------------------
    def build(self, recipe):
        kind, *rest = recipe
        if kind == "int":
            return rest[0]
        if kind == "float":
            return rest[0]
        if kind == "bool":
            return rest[0]
        if kind == "none":
            return None
        if kind == "str":
            return rest[0]
        if kind == "bytes":
            return bytes(rest[0])
        if kind == "bytearray":
            value = bytearray(rest[0])
            self.buffers.append(value)
            return value
        if kind == "buffer":  # one of the example's bytearrays (a stager's records, ...)
            return self.buffers[rest[0] % len(self.buffers)] if self.buffers else bytearray()
        if kind == "array":
            dtype, shape, layout, values = rest
            size = int(np.prod(shape)) if shape else 1
            data = np.resize(np.asarray(values or [0], np.int64), max(size * 2, 1))
            array = data.astype(np.dtype(dtype))
            if layout == "strided":
                array = array[: size * 2 : 2]
            else:
                array = array[:size]
            array = array.reshape(shape)
            if layout == "fortran" and array.ndim >= 2:
                array = np.asfortranarray(array)
            if layout == "readonly":
                array.flags.writeable = False
            return array
        if kind == "memoryview":
            return memoryview(self.build(rest[0]))
        if kind == "list":
            return [self.build(item) for item in rest[0]]
        if kind == "tuple":
            return tuple(self.build(item) for item in rest[0])
        if kind == "stager":
            return self.stagers[rest[0] % len(self.stagers)] if self.stagers else None
        if kind == "raw_stager":  # made without __init__: no buffers
            return self.staging.Stager.__new__(self.staging.Stager)
        if kind == "object":
            return object()
        if kind == "owner":
            return _Owner(rest[0])
        if kind == "anchor":
            return self.capsule.ExportAnchor(self.build(rest[0]))
        raise AssertionError(f"unknown recipe {recipe!r}")

    # -- calls -------------------------------------------------------------------------------
    def call(self, target: str, args: list):
        values = [self.build(recipe) for recipe in args]
        self.kept.append(values)
        staging, capsule = self.staging, self.capsule
        if target == "Stager":
            stager = staging.Stager(*values)
            self.stagers.append(stager)
            return stager
        if target == "Stager.__init__":
            stager = self.stagers[0] if self.stagers else staging.Stager.__new__(staging.Stager)
            return stager.__init__(*values)
        if target.startswith("stager."):
            stager = values[0]
            if stager is None:
                return None
            return getattr(stager, target.split(".", 1)[1])(*values[1:])
        if target == "buffer.extend":  # Python appending to a stager's buffers behind it
            return values[0].extend(values[1])
        if target == "buffer.truncate":
            del values[0][values[1] :]
            return None
        if target == "pack":
            # The slot is a real buffer of the claimed capacity: pack trusts its address (a
            # pinned slot's pointer), which no caller can check.
            stagers, groups, capacity = values
            slot = np.zeros(max(0, min(int(capacity), 1 << 16)) // 8 + 1, np.int64)
            self.kept.append(slot)
            capacity = min(int(capacity), slot.nbytes)
            return staging.pack(stagers, groups, slot.ctypes.data, capacity)
        if target == "pack_raw":
            return staging.pack(*values)
        if target == "clear":
            return staging.clear(*values)
        if target == "expand_elements":
            return staging.expand_elements(*values)
        if target == "new_capsule":
            return capsule.new_capsule(*values)
        if target == "new_capsule_payload":
            # A payload of the right layout for a fake pointer: the capsule is never consumed,
            # only dropped (its destructor runs the deleter).
            versioned, ndim, anchor = values
            size = (40 if versioned else 64) + 16 * ndim
            payload = bytes(size)
            tensor_offset = 32 if versioned else 0
            return capsule.new_capsule(payload, tensor_offset, size - 16 * ndim, versioned, anchor)
        if target == "anchor_for":
            return capsule.anchor_for(*values)
        if target == "anchor_of":
            return capsule.anchor_of(*values)
        if target == "ExportAnchor":
            return capsule.ExportAnchor(*values)
        raise AssertionError(f"unknown target {target!r}")

    def run(self, calls) -> list:
        outcomes = []
        for target, args in calls:
            try:
                result = self.call(target, args)
                outcomes.append(("ok", _short(result)))
            except ALLOWED as error:
                outcomes.append(("raised", type(error).__name__, str(error)))
            except BaseException:  # noqa: BLE001 - reported to the runner as a failure
                outcomes.append(("undocumented", traceback.format_exc()))
        # Drop everything (capsule destructors, deleters, anchors) inside the example.
        self.kept.clear()
        self.stagers.clear()
        self.buffers.clear()
        gc.collect()
        return outcomes


class _Owner:
    """An owner whose contract attributes are whatever the recipe says."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    @property
    def export_anchor(self):
        if self.mode == "raises":
            raise RuntimeError("export_anchor raised")
        if self.mode == "none":
            return None
        if self.mode == "int":
            return 7
        raise AttributeError("export_anchor")

    def check_exportable(self):
        if self.mode in ("raises", "freed"):
            raise RuntimeError("freed")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 200 else text[:200] + "..."


def exchange(tensor: dict) -> tuple:
    """``managed_tensor_to_py_object_no_sync`` of a consumer's tensor built from ``tensor``
    (random fields: version, data, ndim, shape, strides, byte_offset, dtype, device, flags,
    deleter), through the table ``BufferView.__dlpack_c_exchange_api__`` points at.

    Replies ``("ok", (ptr, nbytes, shape))`` or ``("raised", type, message)``; either way
    the deleter must have run exactly once once the view is gone, with no exception pending
    (it calls Python code that fails with one), else ``("undocumented", why)``."""
    import ctypes

    from jaxbuf import _dlpack
    from jaxbuf.views import BufferView

    deleted: list[int] = []

    def on_delete(address):
        deleted.append(address)
        int("0")  # works only with no exception pending

    deleter_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    deleter = deleter_type(on_delete)
    to_py_type = ctypes.PYFUNCTYPE(
        ctypes.c_int,
        ctypes.POINTER(_dlpack.DLManagedTensorVersioned),
        ctypes.POINTER(ctypes.c_void_p),
    )
    api = ctypes.pythonapi.PyCapsule_GetPointer
    api.argtypes, api.restype = (ctypes.py_object, ctypes.c_char_p), ctypes.c_void_p
    table = api(BufferView.__dlpack_c_exchange_api__, b"dlpack_exchange_api")
    # The header (version, prev_api), then allocator, from, to: the third function pointer.
    to_py = to_py_type(ctypes.c_void_p.from_address(table + 8 + 8 + 2 * 8).value)

    data = np.zeros(256, np.uint8)
    shape = (ctypes.c_int64 * 64)(*tensor["shape"])  # the caller's arrays hold what ndim says
    strides = (ctypes.c_int64 * 64)(*tensor["strides"])
    managed = _dlpack.DLManagedTensorVersioned()
    managed.version.major, managed.version.minor = tensor["version"]
    managed.flags = tensor["flags"]
    managed.deleter = ctypes.cast(deleter, ctypes.c_void_p).value if tensor["deleter"] else None
    dl = managed.dl_tensor
    dl.data = data.ctypes.data if tensor["data"] else None
    dl.ndim = tensor["ndim"]
    dl.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)) if tensor["shape_set"] else None
    dl.strides = (
        ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)) if tensor["strides_set"] else None
    )
    dl.byte_offset = tensor["byte_offset"]
    dl.device.device_type, dl.device.device_id = tensor["device"]
    dl.dtype.code, dl.dtype.bits, dl.dtype.lanes = tensor["dtype"]
    out = ctypes.c_void_p()
    try:
        to_py(ctypes.byref(managed), ctypes.byref(out))
    except ALLOWED as error:
        reply = ("raised", type(error).__name__, str(error))
    except BaseException:  # noqa: BLE001 - reported to the runner as a failure
        return ("undocumented", traceback.format_exc())
    else:
        view = ctypes.cast(out, ctypes.py_object).value
        ctypes.pythonapi.Py_DecRef.argtypes = (ctypes.c_void_p,)
        ctypes.pythonapi.Py_DecRef(out)
        reply = ("ok", (view.ptr, view.nbytes, view.shape))
        if view.nbytes and not view.ptr:
            return ("undocumented", f"a view at address 0 over {view.nbytes} bytes")
        del view
        gc.collect()
    expected = [ctypes.addressof(managed)] if tensor["deleter"] else []
    if deleted != expected:
        return ("undocumented", f"deleter calls {deleted}, expected {expected}")
    return reply


def handle(op: str, kwargs: dict):
    if op == "start":
        return ("ok", "started")
    if op == "run":
        return ("ok", Example().run(kwargs["calls"]))
    if op == "exchange":
        return ("ok", [exchange(tensor) for tensor in kwargs["tensors"]])
    raise AssertionError(op)


if __name__ == "__main__":
    from _child import serve

    serve(handle)
