"""Bad input at every public entry point: a clear error naming the value, and nothing changed.

One table (``CASES``), one test. A case names the object it acts on (made fresh by a factory),
the call, the exception expected (``None``: the call must succeed, as for numpy integer types)
and the value the message must repeat. The object's state is snapshotted before and after:
committed sizes, physical bytes and chunks, the bytes of the memory, staged writes, the pool's
slot index and slot contents; constructors are checked through a driver that counts what is
live (a failed constructor leaves no reservation, chunk or pinned block behind).

``ExtensibleTensor(2**62)`` is not in the table as a ValueError: it is well-formed, and the
platform refuses it (a ``DriverError`` whose ``out_of_memory`` is true, tested below). Sizes at
or past 2**63 cannot be expressed in DLPack's int64 shapes and are ValueErrors.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import jaxbuf
import jaxbuf.jax_ops
from jaxbuf import kernels
from jaxbuf.drivers import DriverError, HostVmmDriver

HUGE = 2**62
SEGMENT = 2 << 20
COMMITTED = 4096


class CountingDriver(HostVmmDriver):
    """The CPU driver, counting live reservations, chunks and pinned blocks."""

    def __init__(self) -> None:
        super().__init__(quarantine_bytes=0)
        self.live = {"reservations": 0, "chunks": 0, "host": 0}

    def reserve(self, size, alignment=0):
        ptr = super().reserve(size, alignment)
        self.live["reservations"] += 1
        return ptr

    def free_reserved(self, ptr, size):
        super().free_reserved(ptr, size)
        self.live["reservations"] -= 1

    def create(self, size, device_index):
        handle = super().create(size, device_index)
        self.live["chunks"] += 1
        return handle

    def release(self, handle):
        super().release(handle)
        self.live["chunks"] -= 1

    def host_alloc(self, size, device_index):
        result = super().host_alloc(size, device_index)
        self.live["host"] += 1
        return result

    def host_free(self, host_ptr):
        super().host_free(host_ptr)
        self.live["host"] -= 1


# -- objects under test and their snapshots ------------------------------------------------
def make_extensible():
    buf = jaxbuf.ExtensibleTensor(2 * SEGMENT, "cpu", num_segments=2)
    buf.resize_per_segment_(COMMITTED, zero_new=True)
    for i in range(2):
        buf.segment_view(i).to_numpy()[:] = np.arange(COMMITTED) % 251 + i
    return buf


def make_view():
    return make_extensible().segment_view(0)


def make_pool():
    pool = jaxbuf.UvaBufferPool((8, 2), "int32", device="cpu")
    pool.copy_to_uva(np.arange(6, dtype=np.int32).reshape(3, 2))
    return pool


def make_backed():
    tensor = jaxbuf.UvaBackedTensor((8, 2), "int32", device="cpu")
    tensor.np[:] = np.arange(16).reshape(8, 2)
    tensor.copy_to_uva(3)
    return tensor


def make_uva_buffer():
    buffer = jaxbuf.UvaBuffer(8, "int32", "cpu")
    buffer.np[:] = np.arange(8)
    return buffer


def make_staged():
    swt = jaxbuf.StagedWriteTensor((4, 8), "int32", device="cpu", backend="numpy")
    swt.stage_write(1, 2, [5, 6, 7])
    swt.apply_write()
    swt.stage_write(0, 0, [1, 2])
    return swt


def make_writer():
    return jaxbuf.FusedStagedWriter("cpu", 8, backend="numpy"), make_staged()


def make_counting_driver():
    return CountingDriver()


def snapshot(obj: Any) -> Any:
    """Everything a failed call must leave as it was."""
    if obj is None:
        return None
    if isinstance(obj, CountingDriver):
        return dict(obj.live)
    if isinstance(obj, jaxbuf.ExtensibleTensor):
        return (
            obj.committed_sizes,
            obj.physical_bytes,
            obj.num_physical_chunks,
            obj.base_ptr,
            [
                ctypes.string_at(obj.base_ptr + offset, size)
                for offset, size in zip(obj.segment_offsets, obj.committed_sizes)
            ],
        )
    if isinstance(obj, jaxbuf.BufferView):
        return (
            obj.ptr,
            obj.nbytes,
            obj.dtype,
            obj.shape,
            ctypes.string_at(obj.ptr, obj.nbytes),
            snapshot(obj.owner),
        )
    if isinstance(obj, jaxbuf.UvaBufferPool):
        return (obj.current_slot, [(slot.shape, slot.np.tobytes()) for slot in obj.slots])
    if isinstance(obj, jaxbuf.UvaBackedTensor):
        return (obj.np.tobytes(), obj.gpu.shape, snapshot(obj.pool))
    if isinstance(obj, jaxbuf.UvaBuffer):
        return (obj.shape, obj.np.tobytes(), obj.host_ptr)
    if isinstance(obj, jaxbuf.StagedWriteTensor):
        return (
            obj.num_staged_writes,
            bytes(obj.staging.records),
            bytes(obj.staging.contents),
            obj.to_numpy().tobytes(),
        )
    if isinstance(obj, tuple):
        return tuple(snapshot(part) for part in obj)
    if isinstance(obj, jaxbuf.FusedStagedWriter):
        return (obj._curr, [slot.capacity for slot in obj._slots])
    raise TypeError(f"no snapshot for {type(obj).__name__}")


# -- the table -----------------------------------------------------------------------------
NO_NAME = object()  # the message need not repeat a value (e.g. a structural mismatch)


@dataclass
class Case:
    id: str
    make: Callable[[], Any] | None
    call: Callable[[Any], Any]
    error: type[BaseException] | tuple | None  # None: must succeed
    names: Any = NO_NAME  # a value whose repr or str the message contains
    gpu: bool = False


def _et(*args, **kwargs):
    return lambda driver: jaxbuf.ExtensibleTensor(*args, driver=driver, **kwargs)


def _uva(*args, **kwargs):
    return lambda driver: jaxbuf.UvaBuffer(*args, driver=driver, **kwargs)


def _pool(*args, **kwargs):
    kwargs.setdefault("device", "cpu")
    return lambda driver: jaxbuf.UvaBufferPool(*args, driver=driver, **kwargs)


def _swt(size=(4, 8), dtype="int32", **kwargs):
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("backend", "numpy")
    return lambda driver: jaxbuf.StagedWriteTensor(size, dtype, driver=driver, **kwargs)


def _fsw(max_writes=8, **kwargs):
    kwargs.setdefault("backend", "numpy")
    device = kwargs.pop("device", "cpu")
    return lambda driver: jaxbuf.FusedStagedWriter(device, max_writes, driver=driver, **kwargs)


def _staged_into(swt, tensors_of):
    writer = jaxbuf.FusedStagedWriter("cpu", 8, backend="numpy")
    return writer.apply(tensors_of(swt))


BAD_SCALARS = [(1.5, TypeError), (True, TypeError), (None, TypeError), ("8", TypeError)]
drv = make_counting_driver

CASES = [
    # ExtensibleTensor constructor
    *[
        Case(f"ExtensibleTensor-max_num_bytes={v!r}", drv, _et(v, "cpu"), e, v)
        for v, e in [*BAD_SCALARS, (-1, ValueError), (2**63, ValueError), (2**70, ValueError)]
    ],
    Case("ExtensibleTensor-max_num_bytes=np.int64", drv, _et(np.int64(4096), "cpu"), None),
    Case("ExtensibleTensor-max_num_bytes=0", drv, _et(0, "cpu"), None),
    *[
        Case(f"ExtensibleTensor-num_segments={v!r}", drv, _et(4096, "cpu", num_segments=v), e, v)
        for v, e in [*BAD_SCALARS, (0, ValueError), (-2, ValueError), (3, ValueError)]
    ],
    Case(
        "ExtensibleTensor-segment_capacities=negative",
        drv,
        _et(4096, "cpu", segment_capacities=[5000, -904]),
        ValueError,
        -904,
    ),
    Case(
        "ExtensibleTensor-segment_capacities=str",
        drv,
        _et(4096, "cpu", segment_capacities="ab"),
        TypeError,
        "ab",
    ),
    Case(
        "ExtensibleTensor-segment_capacities=wrong-sum",
        drv,
        _et(4096, "cpu", segment_capacities=[1024, 1024]),
        ValueError,
        2048,
    ),
    Case(
        "ExtensibleTensor-segment_capacities=np.int32",
        drv,
        _et(4096, "cpu", segment_capacities=[np.int32(1024), np.int64(3072)]),
        None,
    ),
    *[
        Case(f"ExtensibleTensor-device={v!r}", drv, _et(4096, v), e, v)
        for v, e in [
            (1.5, TypeError),
            (True, TypeError),
            ("tpu", ValueError),
            ("cuda:x", ValueError),
            (-1, ValueError),
        ]
    ],
    Case(
        "ExtensibleTensor-device=cpu:1",
        None,
        lambda _: jaxbuf.ExtensibleTensor(4096, "cpu:1"),
        ValueError,
        "cpu",
    ),
    Case(
        "ExtensibleTensor-device=cuda-with-cpu-driver", drv, _et(4096, "cuda"), ValueError, "cuda:0"
    ),
    Case(
        "ExtensibleTensor-driver=str",
        None,
        lambda _: jaxbuf.ExtensibleTensor(4096, "cpu", driver="x"),
        TypeError,
        "x",
    ),
    # ExtensibleTensor methods
    *[
        Case(
            f"resize_per_segment_-{v!r}",
            make_extensible,
            lambda b, v=v: b.resize_per_segment_(v),
            e,
            v,
        )
        for v, e in [
            *BAD_SCALARS,
            (-1, ValueError),
            (0, ValueError),
            (COMMITTED - 1, ValueError),
            (SEGMENT + 1, ValueError),
            (HUGE, ValueError),
        ]
    ],
    Case(
        "resize_per_segment_-np.int32",
        make_extensible,
        lambda b: b.resize_per_segment_(np.int32(8192)),
        None,
    ),
    *[
        Case(f"resize_segments_-{v!r}", make_extensible, lambda b, v=v: b.resize_segments_(v), e, n)
        for v, e, n in [
            (None, TypeError, None),
            ("ab", TypeError, "ab"),
            (5, TypeError, 5),
            ([8192], ValueError, 1),
            ([8192] * 3, ValueError, 3),
            ([1.5, 8192], TypeError, 1.5),
            ([-1, 8192], ValueError, -1),
            ([8192, HUGE], ValueError, HUGE),
            ([8192, 100], ValueError, 100),
            ([None, 8192], TypeError, None),
        ]
    ],
    Case(
        "resize_segments_-numpy-array",
        make_extensible,
        lambda b: b.resize_segments_(np.array([8192, 4096], np.int64)),
        None,
    ),
    *[
        Case(f"segment_view-{v!r}", make_extensible, lambda b, v=v: b.segment_view(v), e, v)
        for v, e in [*BAD_SCALARS, (-1, IndexError), (2, IndexError), (HUGE, IndexError)]
    ],
    Case("segment_view-np.int64", make_extensible, lambda b: b.segment_view(np.int64(1)), None),
    *[
        Case(
            f"segments_backed_by_one_chunk-{v!r}",
            make_extensible,
            lambda b, v=v: b.segments_backed_by_one_chunk(v),
            e,
            n,
        )
        for v, e, n in [
            (None, TypeError, None),
            ([1], ValueError, 1),
            ([1, 2.5], TypeError, 2.5),
            ([-1, 0], ValueError, -1),
            ([HUGE, 0], ValueError, HUGE),
        ]
    ],
    Case(
        "segments_backed_by_one_chunk-np.int64",
        make_extensible,
        lambda b: b.segments_backed_by_one_chunk([np.int64(1), np.uint16(2)]),
        None,
    ),
    *[
        Case(f"granule_size-device={v!r}", None, lambda _, v=v: jaxbuf.granule_size(v), e, v)
        for v, e in [(1.5, TypeError), ("tpu", ValueError), (True, TypeError)]
    ],
    *[
        Case(f"as_device-{v!r}", None, lambda _, v=v: jaxbuf.as_device(v), e, v)
        for v, e in [
            (1.5, TypeError),
            (True, TypeError),
            (None, TypeError),
            ("tpu", ValueError),
            ("cuda:x", ValueError),
            (-3, ValueError),
        ]
    ],
    Case("as_device-np.int64", None, lambda _: jaxbuf.as_device(np.int64(1)), None),
    *[
        Case(f"canonical_dtype-{v!r}", None, lambda _, v=v: jaxbuf.canonical_dtype(v), TypeError, v)
        for v in [1.5, True, None, "complex256", "int33", np.datetime64, ">i4"]
    ],
    # BufferView
    *[
        Case(f"BufferView-ptr={v!r}", None, lambda _, v=v: jaxbuf.BufferView(v, 16), e, v)
        for v, e in [(1.5, TypeError), (None, TypeError), (True, TypeError), (-4096, ValueError)]
    ],
    *[
        Case(f"BufferView-nbytes={v!r}", None, lambda _, v=v: jaxbuf.BufferView(4096, v), e, v)
        for v, e in [(1.5, TypeError), ("16", TypeError), (-1, ValueError), (2**64, ValueError)]
    ],
    Case(
        "BufferView-misaligned",
        None,
        lambda _: jaxbuf.BufferView(4097, 16, "int32"),
        ValueError,
        "0x1001",
    ),
    Case(
        "BufferView-np.int64",
        None,
        lambda _: jaxbuf.BufferView(np.int64(4096), np.uint32(16), "int32", np.int64(4)),
        None,
    ),
    *[
        Case(f"view-dtype={v!r}", make_view, lambda w, v=v: w.view(v), TypeError, v)
        for v in [1.5, True, "complex256", "int33", ">f4"]
    ],
    *[
        Case(f"view-shape={v!r}", make_view, lambda w, v=v: w.view(shape=v), e, n)
        for v, e, n in [
            (1.5, TypeError, 1.5),
            ("ab", TypeError, "ab"),
            ((-1,), ValueError, -1),
            ((True,), TypeError, True),
            ((HUGE,), ValueError, HUGE),
            ((COMMITTED + 1,), ValueError, COMMITTED + 1),
            ((None,), TypeError, None),
        ]
    ],
    Case(
        "view-int32-of-odd-bytes",
        None,
        lambda _: jaxbuf.BufferView(4096, 3).view("int32"),
        ValueError,
        3,
    ),
    Case("view-shape=np.int64", make_view, lambda w: w.view("int32", (np.int64(8), 2)), None),
    Case(
        "to_torch-dtype=complex256",
        make_view,
        lambda w: w.to_torch("complex256"),
        TypeError,
        "complex256",
    ),
    Case(
        "to_torch-shape-too-big", make_view, lambda w: w.to_torch(shape=(HUGE,)), ValueError, HUGE
    ),
    Case(
        "to_jax-dtype=complex256",
        make_view,
        lambda w: w.to_jax("complex256"),
        TypeError,
        "complex256",
    ),
    Case("to_jax-shape-negative", make_view, lambda w: w.to_jax(shape=(-2,)), ValueError, -2),
    Case("__dlpack__-copy='yes'", make_view, lambda w: w.__dlpack__(copy="yes"), TypeError, "yes"),
    Case(
        "__dlpack__-dl_device=cuda",
        make_view,
        lambda w: w.__dlpack__(dl_device=(2, 0)),
        BufferError,
        (2, 0),
    ),
    Case("__dlpack__-stream-on-cpu", make_view, lambda w: w.__dlpack__(stream=5), BufferError, 5),
    *[
        Case(
            f"__dlpack__-max_version={v!r}",
            make_view,
            lambda w, v=v: w.__dlpack__(max_version=v),
            TypeError,
            v,
        )
        for v in ["x", (None, 1), 1, (1,)]
    ],
    Case(
        "__dlpack__-dl_device=str",
        make_view,
        lambda w: w.__dlpack__(dl_device="cpu"),
        TypeError,
        "cpu",
    ),
    # UvaBuffer / NonUvaBuffer / UvaBackedTensor
    *[
        Case(f"UvaBuffer-size={v!r}", drv, _uva(v, "int32", "cpu"), e, v)
        for v, e in [
            *BAD_SCALARS,
            (-1, ValueError),
            ((4, -2), ValueError),
            ((), ValueError),
            (HUGE, ValueError),
            ((HUGE, HUGE), ValueError),
        ]
    ],
    Case("UvaBuffer-size=np.int64", drv, _uva((np.int64(8), np.int32(2)), "int32", "cpu"), None),
    *[
        Case(f"UvaBuffer-dtype={v!r}", drv, _uva(8, v, "cpu"), TypeError, v)
        for v in [1.5, None, "complex256", True]
    ],
    Case(
        "UvaBuffer-device=cuda-with-cpu-driver", drv, _uva(8, "int32", "cuda"), ValueError, "cuda:0"
    ),
    Case(
        "UvaBuffer-driver=str",
        None,
        lambda _: jaxbuf.UvaBuffer(8, "int32", "cpu", driver="x"),
        TypeError,
        "x",
    ),
    *[
        Case(
            f"NonUvaBuffer-size={v!r}",
            drv,
            lambda d, v=v: jaxbuf.NonUvaBuffer(v, "int32", "cpu", driver=d),
            e,
            v,
        )
        for v, e in [(-1, ValueError), (HUGE, ValueError), (1.5, TypeError)]
    ],
    *[
        Case(f"uva-n={v!r}", make_uva_buffer, lambda b, v=v: b.uva(v), e, v)
        for v, e in [
            (1.5, TypeError),
            (True, TypeError),
            ("1", TypeError),
            (-1, IndexError),
            (9, IndexError),
            (HUGE, IndexError),
        ]
    ],
    Case("uva-n=np.int64", make_uva_buffer, lambda b: b.uva(np.int64(3)), None),
    *[
        Case(
            f"UvaBackedTensor-size={v!r}",
            drv,
            lambda d, v=v: jaxbuf.UvaBackedTensor(v, "int32", device="cpu", driver=d),
            e,
            v,
        )
        for v, e in [(-1, ValueError), (1.5, TypeError), (HUGE, ValueError)]
    ],
    *[
        Case(
            f"UvaBackedTensor.copy_to_uva-n={v!r}",
            make_backed,
            lambda t, v=v: t.copy_to_uva(v),
            e,
            v,
        )
        for v, e in [
            (1.5, TypeError),
            (True, TypeError),
            (-1, IndexError),
            (9, IndexError),
            (HUGE, IndexError),
        ]
    ],
    Case(
        "UvaBackedTensor.copy_to_uva-n=np.int64",
        make_backed,
        lambda t: t.copy_to_uva(np.int64(5)),
        None,
    ),
    # UvaBufferPool
    *[
        Case(f"UvaBufferPool-size={v!r}", drv, _pool(v, "int32"), e, v)
        for v, e in [*BAD_SCALARS, (-1, ValueError), (HUGE, ValueError)]
    ],
    *[
        Case(
            f"UvaBufferPool-max_concurrency={v!r}", drv, _pool(8, "int32", max_concurrency=v), e, v
        )
        for v, e in [
            (1.5, TypeError),
            (True, TypeError),
            ("2", TypeError),
            (0, ValueError),
            (-1, ValueError),
        ]
    ],
    Case(
        "UvaBufferPool-max_concurrency=np.int64",
        drv,
        _pool(8, "int32", max_concurrency=np.int64(3)),
        None,
    ),
    Case("UvaBufferPool-dtype=complex256", drv, _pool(8, "complex256"), TypeError, "complex256"),
    Case("UvaBufferPool-framework=tf", drv, _pool(8, "int32", framework="tf"), ValueError, "tf"),
    Case("UvaBufferPool-guarded=x", drv, _pool(8, "int32", guarded="x"), ValueError, "x"),
    Case("UvaBufferPool-buffer_cls=int", drv, _pool(8, "int32", buffer_cls=int), TypeError, "int"),
    Case(
        "UvaBufferPool-device=cuda-with-cpu-driver",
        drv,
        _pool(8, "int32", device="cuda"),
        ValueError,
        "cuda:0",
    ),
    *[
        Case(f"copy_to_uva-{name}", make_pool, lambda p, x=x: p.copy_to_uva(x), e, n)
        for name, x, e, n in [
            ("None", None, TypeError, "NoneType"),
            ("float", 1.5, TypeError, "float"),
            ("str", "ab", TypeError, "str"),
            ("dict", {"a": 1}, TypeError, "dict"),
            ("wrong-row-shape", np.zeros((3, 3), np.int32), ValueError, (3, 3)),
            ("1-D", np.zeros(2, np.int32), ValueError, (2,)),
            ("float-into-int", np.zeros((3, 2), np.float32), TypeError, "float32"),
            ("complex", np.zeros((3, 2), np.complex64), TypeError, "complex64"),
            ("ragged-list", [[1, 2], [3]], ValueError, NO_NAME),
        ]
    ],
    Case("copy_to_uva-grows", make_pool, lambda p: p.copy_to_uva(np.ones((20, 2), np.int64)), None),
    Case(
        "copy_to_gpu-out=ndarray",
        make_pool,
        lambda p: p.copy_to_gpu(np.zeros((2, 2), np.int32), out=np.zeros((2, 2))),
        TypeError,
        "ndarray",
    ),
    Case(
        "copy_to_gpu-wrong-row-shape",
        make_pool,
        lambda p: p.copy_to_gpu(np.zeros((2, 5), np.int32)),
        ValueError,
        (2, 5),
    ),
    Case(
        "async_copy_to_device-device=tpu",
        None,
        lambda _: jaxbuf.async_copy_to_device([1, 2], "tpu"),
        ValueError,
        "tpu",
    ),
    Case(
        "async_copy_to_device-framework=tf",
        None,
        lambda _: jaxbuf.async_copy_to_device([1, 2], "cpu", framework="tf"),
        ValueError,
        "tf",
    ),
    Case(
        "async_copy_to_device-dtype=complex256",
        None,
        lambda _: jaxbuf.async_copy_to_device([1, 2], "cpu", dtype="complex256"),
        TypeError,
        "complex256",
    ),
    # StagedWriteTensor
    *[
        Case(f"StagedWriteTensor-size={v!r}", drv, _swt(v), e, v)
        for v, e in [
            *BAD_SCALARS,
            (-1, ValueError),
            ((4, -1), ValueError),
            ((2, 3, 4), ValueError),
            ((HUGE, HUGE), ValueError),
        ]
    ],
    Case("StagedWriteTensor-size=np.int", drv, _swt((np.int64(4), np.int32(8))), None),
    *[
        Case(f"StagedWriteTensor-dtype={v!r}", drv, _swt(dtype=v), TypeError, v)
        for v in [1.5, None, "uint8", "complex64", True]
    ],
    *[
        Case(f"StagedWriteTensor-max_concurrency={v!r}", drv, _swt(max_concurrency=v), e, v)
        for v, e in [(1.5, TypeError), (True, TypeError), (0, ValueError)]
    ],
    Case(
        "StagedWriteTensor-max_concurrency=np.int64", drv, _swt(max_concurrency=np.int64(3)), None
    ),
    Case("StagedWriteTensor-backend=cuda", drv, _swt(backend="cuda"), ValueError, "cuda"),
    Case(
        "StagedWriteTensor-device=cuda-with-cpu-driver",
        drv,
        _swt(device="cuda"),
        ValueError,
        "cuda:0",
    ),
    *[
        Case(f"stage_write-{args!r}", make_staged, lambda s, a=args: s.stage_write(*a), e, n)
        for args, e, n in [
            ((4, 0, [1]), IndexError, 4),
            ((-1, 0, [1]), IndexError, -1),
            ((0, -1, [1]), IndexError, -1),
            ((0, 7, [1, 2]), IndexError, 7),
            ((HUGE, 0, [1]), IndexError, HUGE),
            ((0, HUGE, [1]), IndexError, HUGE),
            ((1.5, 0, [1]), TypeError, 1.5),
            ((None, 0, [1]), TypeError, None),
            ((0, None, [1]), TypeError, None),
            ((True, 0, [1]), TypeError, True),
            ((0, "0", [1]), TypeError, "0"),
            ((0, 0, [1.5]), ValueError, 1.5),
            ((0, 0, [2**40]), ValueError, 2**40),
            ((0, 0, [float("nan")]), ValueError, "nan"),
            ((0, 0, "ab"), TypeError, "str"),
            ((0, 0, None), TypeError, "NoneType"),
            ((0, 0, 5), TypeError, "int"),
            ((0, 0, np.zeros((2, 2), np.int32)), ValueError, (2, 2)),
            ((0, 0, [None]), TypeError, "object"),
            ((0, 0, np.zeros(2, np.complex64)), TypeError, "complex64"),
        ]
    ],
    Case(
        "stage_write-np.int",
        make_staged,
        lambda s: s.stage_write(np.int64(1), np.int32(0), np.arange(3, dtype=np.int16)),
        None,
    ),
    *[
        Case(
            f"stage_write_elem-{args!r}",
            make_staged,
            lambda s, a=args: s.stage_write_elem(*a),
            e,
            n,
        )
        for args, e, n in [
            ((4, 1), IndexError, 4),
            ((-1, 1), IndexError, -1),
            ((1.5, 1), TypeError, 1.5),
            ((None, 1), TypeError, None),
            ((0, 1.5), ValueError, 1.5),
            ((0, [1, 2]), TypeError, "list"),
            ((0, None), TypeError, "NoneType"),
            ((0, "a"), TypeError, NO_NAME),
            ((0, 2**40), ValueError, 2**40),
        ]
    ],
    Case(
        "stage_write_elem-np.int",
        make_staged,
        lambda s: s.stage_write_elem(np.int64(3), np.int32(9)),
        None,
    ),
    # FusedStagedWriter
    *[
        Case(f"FusedStagedWriter-max_writes={v!r}", drv, _fsw(v), e, v)
        for v, e in [*BAD_SCALARS, (0, ValueError), (-1, ValueError), (HUGE, ValueError)]
    ],
    Case("FusedStagedWriter-max_writes=np.int64", drv, _fsw(np.int64(8)), None),
    Case("FusedStagedWriter-max_concurrency=0", drv, _fsw(max_concurrency=0), ValueError, 0),
    Case("FusedStagedWriter-backend=x", drv, _fsw(backend="x"), ValueError, "x"),
    Case("FusedStagedWriter-device=tpu", drv, _fsw(device="tpu"), ValueError, "tpu"),
    Case(
        "FusedStagedWriter-device=cuda-with-cpu-driver",
        drv,
        _fsw(device="cuda"),
        ValueError,
        "cuda:0",
    ),
    Case("apply-tensors=None", make_writer, lambda ws: ws[0].apply(None), TypeError, None),
    Case("apply-tensors=[1]", make_writer, lambda ws: ws[0].apply([1]), TypeError, 1),
    Case(
        "apply-repeated-tensor",
        make_writer,
        lambda ws: ws[0].apply([ws[1], ws[1]]),
        ValueError,
        "twice",
    ),
    Case(
        "apply-output_ptrs-alone",
        make_writer,
        lambda ws: ws[0].apply([ws[1]], output_ptrs=[8]),
        ValueError,
        "output_strides",
    ),
    Case(
        "apply-output_ptrs-float",
        make_writer,
        lambda ws: ws[0].apply([ws[1]], output_ptrs=[1.5], output_strides=[8]),
        TypeError,
        1.5,
    ),
    Case(
        "apply-output_ptrs-count",
        make_writer,
        lambda ws: ws[0].apply([ws[1]], output_ptrs=[8, 16], output_strides=[8]),
        ValueError,
        2,
    ),
    Case(
        "apply-output_ptrs-misaligned",
        make_writer,
        lambda ws: ws[0].apply([ws[1]], output_ptrs=[4098], output_strides=[8]),
        ValueError,
        "0x1002",
    ),
    # JAX ops and kernel table builders
    *[
        Case(
            f"pack_writes-{name}",
            None,
            lambda _, a=a, k=k: jaxbuf.jax_ops.pack_writes(*a, **k),
            e,
            n,
        )
        for name, a, k, e, n in [
            ("counts-differ", ([0, 1], [0], [[1]], "int32"), {}, ValueError, 2),
            ("negative-row", ([-1], [0], [[1]], "int32"), {}, IndexError, -1),
            ("row-out-of-shape", ([5], [0], [[1]], "int32"), {"shape": (4, 8)}, IndexError, 5),
            ("dtype=complex256", ([0], [0], [[1]], "complex256"), {}, TypeError, "complex256"),
            ("fraction-into-int", ([0], [0], [[1.5]], "int32"), {}, ValueError, "int32"),
            ("row=1.5", ([1.5], [0], [[1]], "int32"), {}, TypeError, 1.5),
            ("row=str", (["a"], [0], [[1]], "int32"), {}, TypeError, "a"),
            ("row=None", ([None], [0], [[1]], "int32"), {}, TypeError, None),
            ("row=2**62", ([HUGE], [0], [[1]], "int32"), {}, ValueError, NO_NAME),
            ("np.int", (np.array([1], np.int16), [np.int64(0)], [[1]], "int32"), {}, None, None),
        ]
    ],
    Case(
        "apply_staged_writes-1-D",
        None,
        lambda _: jaxbuf.jax_ops.apply_staged_writes(
            np.zeros(4, np.int32), jaxbuf.jax_ops.pack_writes([0], [0], [[1]], "int32")
        ),
        ValueError,
        (4,),
    ),
    Case(
        "apply_staged_writes-method=x",
        None,
        lambda _: jaxbuf.jax_ops.apply_staged_writes(
            np.zeros((4, 4), np.int32),
            jaxbuf.jax_ops.pack_writes([0], [0], [[1]], "int32"),
            method="x",
        ),
        ValueError,
        "x",
    ),
    Case(
        "make_write_table-counts-differ",
        None,
        lambda _: kernels.make_write_table([0], [0, 1], [0], [0], [1]),
        ValueError,
        2,
    ),
    Case(
        "make_group_table-elem_size=3",
        None,
        lambda _: kernels.make_group_table([0], [0], [3]),
        ValueError,
        3,
    ),
    Case("pack_contents-ints", None, lambda _: kernels.pack_contents([1, 2]), TypeError, 1),
    Case(
        "has_overlap-counts-differ",
        None,
        lambda _: kernels.has_overlap([0], [0, 1], [0], [1]),
        ValueError,
        2,
    ),
    Case(
        "apply_staged_writes_numpy-float-table",
        None,
        lambda _: kernels.apply_staged_writes_numpy(
            np.zeros((1, 5)), np.zeros((1, 3), np.int64), 0
        ),
        ValueError,
        "float64",
    ),
    Case(
        "apply_staged_writes_numpy-num_writes",
        None,
        lambda _: kernels.apply_staged_writes_numpy(
            np.zeros((1, 5), np.int64), np.zeros((1, 3), np.int64), 0, 5
        ),
        ValueError,
        5,
    ),
    Case("address_of-str", None, lambda _: kernels.address_of("x"), TypeError, "str"),
    # Mismatched devices: only a GPU machine has two kinds of device memory.
    Case(
        "cuda-pool-copy_to_gpu-out=cpu-tensor",
        None,
        lambda _: _cuda_pool_into_cpu_tensor(),
        (TypeError, ValueError),
        "cpu",
        gpu=True,
    ),
    Case(
        "cuda-writer-applies-cpu-tensor",
        None,
        lambda _: _cuda_writer_on_cpu_tensor(),
        ValueError,
        "cpu",
        gpu=True,
    ),
    Case(
        "cuda-view-to_numpy",
        None,
        lambda _: _cuda_view().to_numpy(),
        BufferError,
        "cuda:0",
        gpu=True,
    ),
    Case(
        "cuda-view-dl_device=cpu",
        None,
        lambda _: _cuda_view().__dlpack__(dl_device=(1, 0), copy=False),
        BufferError,
        (1, 0),
        gpu=True,
    ),
    Case(
        "StagedWriteTensor-numpy-backend-on-cuda",
        None,
        lambda _: jaxbuf.StagedWriteTensor(8, "int32", "cuda", backend="numpy"),
        ValueError,
        "cuda:0",
        gpu=True,
    ),
]


def _cuda_view():
    buf = jaxbuf.ExtensibleTensor(SEGMENT, "cuda")
    buf.resize_per_segment_(COMMITTED)
    return buf.segment_view(0)


def _cuda_pool_into_cpu_tensor():
    import torch

    pool = jaxbuf.UvaBufferPool(8, "int32", device="cuda", framework="torch")
    out = torch.zeros(3, dtype=torch.int32)  # a CPU tensor where a CUDA one is expected
    before = snapshot(pool)
    try:
        return pool.copy_to_gpu([1, 2, 3], out=out)
    finally:
        assert snapshot(pool)[1] == before[1]


def _cuda_writer_on_cpu_tensor():
    writer = jaxbuf.FusedStagedWriter("cuda", 8)
    swt = jaxbuf.StagedWriteTensor(8, "int32", "cpu", backend="numpy")
    swt.stage_write_elem(0, 1)
    try:
        return writer.apply([swt])
    finally:
        assert swt.num_staged_writes == 1


def _param(case: Case):
    marks = [pytest.mark.gpu] if case.gpu else []
    return pytest.param(case, id=case.id, marks=marks)


def _mentions(message: str, value: Any) -> bool:
    return repr(value) in message or str(value) in message


def test_table_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.filterwarnings("ignore:UVA is unavailable")
@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_bad_input(case: Case):
    target = case.make() if case.make is not None else None
    before = snapshot(target)
    if case.error is None:
        result = case.call(target)
        _close(result)
        return
    with pytest.raises(case.error) as caught:
        case.call(target)
    if case.names is not NO_NAME:
        assert _mentions(str(caught.value), case.names), (
            f"{type(caught.value).__name__}: {caught.value} does not name {case.names!r}"
        )
    assert snapshot(target) == before, "a rejected call changed the state"
    if isinstance(target, CountingDriver):
        assert target.live == {"reservations": 0, "chunks": 0, "host": 0}
    _close(target)


def _close(obj: Any) -> None:
    if isinstance(obj, tuple):
        for part in obj:
            _close(part)
    elif isinstance(obj, jaxbuf.BufferView):
        _close(obj.owner)
    elif hasattr(obj, "close") and not isinstance(obj, CountingDriver):
        obj.close()


def test_an_unreservable_size_is_a_driver_error_naming_it():
    """2**62 bytes is well-formed but more address space than the machine has: the driver's
    ENOMEM, naming the (granule-rounded) size, and nothing left reserved."""
    driver = CountingDriver()
    with pytest.raises(DriverError) as caught:
        jaxbuf.ExtensibleTensor(HUGE, "cpu", driver=driver)
    assert caught.value.out_of_memory
    assert str(HUGE + SEGMENT)[:12] in str(caught.value)
    assert driver.live == {"reservations": 0, "chunks": 0, "host": 0}
