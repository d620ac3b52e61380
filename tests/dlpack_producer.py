"""The producer the ported DLPack tests share: a ``BufferView`` over an ``ExtensibleTensor``.

Upstream suites make their arrays with their own library (``np.arange``, ``make_tensor``,
``jnp.array``); the ports make them here instead, so every consumer reads jaxbuf's memory:
:func:`make_view` fills a view from a numpy reference on the CPU or the GPU, :func:`read_back`
copies a view's bytes back to numpy through the driver (not through DLPack, so a DLPack bug
cannot hide itself), and :func:`run_child` runs lifetime scenarios in a child process, where
a use-after-free dies by a signal instead of taking pytest down.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import sys
import textwrap

import _forkserver
import numpy as np

import jaxbuf
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.dtypes import SUPPORTED_DTYPES, canonical_dtype
from jaxbuf.views import BufferView

# Every dtype jaxbuf exports, and the subsets upstream suites parametrize over.
ALL_DTYPES = SUPPORTED_DTYPES
NUMPY_DTYPES = tuple(name for name in ALL_DTYPES if name != "bfloat16")  # numpy's DLPack
X64_DTYPES = ("int64", "uint64", "float64", "complex128")  # JAX needs jax_enable_x64

# JAX's shape lists (tests/array_interoperability_test.py), scalar and empty shapes included.
NONEMPTY_SHAPES = [(), (4,), (3, 4), (2, 3, 4), (3, 1), (1, 4), (2, 1, 4)]
EMPTY_SHAPES = [(0,), (0, 4), (3, 0), (2, 0, 1)]
ALL_SHAPES = NONEMPTY_SHAPES + EMPTY_SHAPES

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer.restype = ctypes.c_void_p
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.argtypes = [ctypes.py_object]
_get_name.restype = ctypes.c_char_p


def capsule_name(capsule) -> str:
    return _get_name(capsule).decode()


def capsule_pointer(capsule) -> int:
    return _get_pointer(capsule, _get_name(capsule))


def reference(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Random values of ``dtype`` (small, exactly representable) in a numpy array."""
    rng = np.random.default_rng(seed)
    np_dtype = canonical_dtype(dtype).numpy
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    values = rng.integers(-8 if np.dtype(np_dtype).kind in "ifc" else 0, 9, shape)
    if dtype.startswith("complex"):
        return (values + 1j * rng.integers(-8, 9, shape)).astype(np_dtype)
    return values.astype(np_dtype)


def make_view(
    device: str, dtype: str, shape: tuple[int, ...], values: np.ndarray | None = None
) -> tuple[jaxbuf.ExtensibleTensor, BufferView, np.ndarray]:
    """``(tensor, view, expected)``: a view of ``shape`` and ``dtype`` at the start of a fresh
    ``ExtensibleTensor`` on ``device``, holding ``values`` (default: :func:`reference`)."""
    expected = reference(shape, dtype) if values is None else values
    nbytes = math.prod(shape) * canonical_dtype(dtype).itemsize
    tensor = jaxbuf.ExtensibleTensor(jaxbuf.granule_size(device), device=device)
    tensor.resize_segments_([nbytes])
    view = tensor.segment_view(0).view(dtype, shape)
    write(view, expected)
    return tensor, view, expected


def write(view: BufferView, values: np.ndarray) -> None:
    """Copy ``values`` into ``view`` through the driver and wait for it."""
    host = np.ascontiguousarray(values)
    if host.nbytes:
        driver = get_vmm_driver(view.device)
        driver.copy(view.ptr, host.ctypes.data, host.nbytes, view.device.index)
        driver.synchronize(view.device.index)


def read_back(view: BufferView) -> np.ndarray:
    """The view's current bytes as a numpy array of its dtype and shape (a host copy)."""
    dtype = view.dtype.numpy
    out = np.empty(view.shape, dtype)
    if out.nbytes:
        driver = get_vmm_driver(view.device)
        driver.synchronize(view.device.index)
        driver.copy(out.ctypes.data, view.ptr, out.nbytes, view.device.index)
        driver.synchronize(view.device.index)
    return out


def run_child(source: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``source`` in a fresh interpreter (the repository's jaxbuf on its path)."""
    command = [sys.executable, "-c", textwrap.dedent(source)]
    return _forkserver.run(command, timeout=timeout)


def assert_normal_exit(result: subprocess.CompletedProcess, marker: str = "done") -> None:
    """The child printed ``marker`` and exited 0: no signal, no traceback, no ignored error."""
    detail = f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail
    assert marker in result.stdout, detail
    assert "Exception ignored" not in result.stderr, detail


# The child's producer, as a source snippet: the same view make_view builds, for ``DEVICE``.
CHILD_PRODUCER = """
import gc, os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
import jaxbuf
from jaxbuf.drivers import get_vmm_driver

def producer(device, values):
    tensor = jaxbuf.ExtensibleTensor(jaxbuf.granule_size(device), device=device)
    tensor.resize_segments_([values.nbytes])
    view = tensor.segment_view(0).view(values.dtype.name, values.shape)
    driver = get_vmm_driver(device)
    driver.copy(view.ptr, values.ctypes.data, values.nbytes, view.device.index)
    driver.synchronize(view.device.index)
    return tensor, view
"""
