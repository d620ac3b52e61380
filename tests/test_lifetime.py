"""Object lifetime: interpreter exit, garbage-collection cycles, release and free under views.

Documented behaviour tested here:

* Views, framework arrays, pools and writers may be alive at interpreter exit: nothing is
  freed through the driver once the interpreter is finalizing, and the process exits cleanly.
* An object graph with a cycle through an ``ExtensibleTensor``, a ``UvaBufferPool`` or a
  ``StagedWriteTensor`` is collected by ``gc.collect()``, which frees its driver resources,
  without a ``ResourceWarning`` or an unraisable exception.
* ``release_physical()`` while views exist: views keep their address. Until memory is committed
  again, on the CPU driver the range is a read-only zero mapping: reading gives zeros (never
  stale bytes), a write dies with ``SIGSEGV`` (in debug mode, ``JAXBUF_DEBUG=1``, a read
  too). After a grow the same views work again; freshly committed CPU memory reads zeros.
* ``free()`` means "I am done": arrays exported before it (numpy, torch, JAX,
  unconsumed capsules) keep reading their memory, ``live_exports`` counts them, and the memory
  goes with the last one (``released``); with none it goes at once. Views taken before
  ``free()`` raise ``RuntimeError`` at every export. ``free()`` waits for JAX's pending work
  first, so the README's donated JAX step followed by ``free()`` never faults. Owners refuse
  pickling and copying.
* A raw pointer (not an export) used after ``free()``: on the CPU driver the freed range stays
  reserved ``PROT_NONE`` in the driver's bounded quarantine, so the access dies with
  ``SIGSEGV`` instead of reading another allocation placed at the same address.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import importlib.util
import mmap
import pickle
import signal
import subprocess
import sys
import textwrap
import warnings
import weakref

import _forkserver
import numpy as np
import pytest

import jaxbuf
from jaxbuf import interop
from jaxbuf.drivers import HostVmmDriver

GRANULE = 2 << 20
HAS_HINT = importlib.util.find_spec("jaxbuf.drivers._host_calls") is not None  # the SIGSEGV line


def run_python(source: str, timeout: float = 120, spawn: bool = False):
    """Run ``source`` in a fresh interpreter, forked from one with the frameworks imported
    unless ``spawn`` (a case about what gets imported)."""
    prelude = "import os\nos.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')\n"
    command = [sys.executable, "-X", "dev", "-c", prelude + textwrap.dedent(source)]
    return _forkserver.run(command, timeout=timeout, spawn=spawn)


def assert_clean_exit(result: subprocess.CompletedProcess, marker: str = "done") -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker in result.stdout, result.stdout
    for bad in ("Traceback", "Exception ignored", "ResourceWarning", "Fatal Python error"):
        assert bad not in result.stderr, result.stderr[-3000:]


def assert_segfault(result: subprocess.CompletedProcess, marker: str) -> None:
    assert marker in result.stdout, (result.stdout, result.stderr[-3000:])
    assert result.returncode == -signal.SIGSEGV, (
        result.returncode,
        result.stdout,
        result.stderr[-3000:],
    )
    assert "READ" not in result.stdout, result.stdout


# -- interpreter exit ----------------------------------------------------------------------
EXIT_WITH_VIEWS = """
import jaxbuf
buf = jaxbuf.ExtensibleTensor(2 << 20, device={device!r}, num_segments=2)
buf.resize_per_segment_(4096, zero_new=True)
view = buf.segment_view(1)
if {framework!r} == "torch":
    array = view.to_torch(dtype="float32", shape=(1024,))
    array += 1
    total = float(array.sum())
else:
    array = view.to_jax(dtype="float32", shape=(1024,))
    total = float(array.sum())
assert total == ({framework!r} == "torch") * 1024.0, total
orphan = jaxbuf.ExtensibleTensor(2 << 20, device={device!r})
orphan.resize_per_segment_(4096, zero_new=True)
orphan_array = orphan.full_view().view(shape=4096).to_torch() if {framework!r} == "torch" \
    else orphan.segment_view(0).to_jax()
if {framework!r} == "torch":
    del orphan  # the torch tensor keeps the buffer alive
print("done", flush=True)
"""


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_views_alive_at_interpreter_exit(device, framework):
    assert_clean_exit(run_python(EXIT_WITH_VIEWS.format(device=device, framework=framework)))


EXIT_WITH_POOLS_AND_WRITERS = """
import numpy as np
import jaxbuf
device = {device!r}
backend = "numpy" if device == "cpu" else "triton"
pools = [jaxbuf.UvaBufferPool((8, 2), "int32", device=device, framework=framework)
         for framework in ("view", "torch", "jax")]
arrays = [pool.copy_to_uva(np.arange(6, dtype=np.int32).reshape(3, 2)) for pool in pools]
backed = jaxbuf.UvaBackedTensor(16, "float32", device=device, framework="torch")
backed.np[:4] = 1.5
backed_view = backed.copy_to_uva(4)
swt = jaxbuf.StagedWriteTensor((4, 8), "int32", device=device, backend=backend)
swt.stage_write(1, 0, [1, 2, 3])
swt.apply_write()
swt.stage_write(2, 0, [4])  # staged, never applied
other = jaxbuf.StagedWriteTensor(8, "float32", device=device, uva_instead_of_gpu=True,
                                 backend=backend)
other.stage_write_elem(3, 2.5)
writer = jaxbuf.FusedStagedWriter(device, 4, backend=backend)
writer.apply([swt, other])
target = swt.to_torch()
print("done", int(target[1, 2]), flush=True)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pools_and_writers_alive_at_interpreter_exit(device):
    result = run_python(EXIT_WITH_POOLS_AND_WRITERS.format(device=device))
    assert_clean_exit(result, "done 3")


def test_jax_donated_view_does_not_crash():
    result = run_python("""
        import warnings
        import numpy as np, jax, jax.numpy as jnp
        import jaxbuf
        buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
        buf.resize_per_segment_(4096, zero_new=True)
        view = buf.segment_view(0)
        view.to_numpy().view(np.float32)[:] = 2.0
        array = view.to_jax(dtype="float32", shape=(1024,))
        step = jax.jit(lambda x: x * 3 + 1, donate_argnums=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable" is allowed
            result = step(array)
            result = step(result)  # a donated JAX-owned result, donated again
        assert float(result[0]) == 22.0, result
        del array, result
        # Whatever JAX did with the donation, the buffer's bytes are jaxbuf's to free.
        first = float(view.to_numpy().view(np.float32)[0])
        assert first in (2.0, 7.0), first  # in place (donation honoured) or untouched
        buf.free()
        print("done", flush=True)
    """)
    assert_clean_exit(result)


# -- garbage-collection cycles -------------------------------------------------------------
class CountingDriver(HostVmmDriver):
    """The CPU driver counting live reservations and pinned blocks."""

    def __init__(self) -> None:
        super().__init__(quarantine_bytes=0)
        self.reservations = 0
        self.host_blocks = 0

    def reserve(self, size, alignment=0):
        ptr = super().reserve(size, alignment)
        self.reservations += 1
        return ptr

    def free_reserved(self, ptr, size):
        super().free_reserved(ptr, size)
        self.reservations -= 1

    def host_alloc(self, size, device_index):
        result = super().host_alloc(size, device_index)
        self.host_blocks += 1
        return result

    def host_free(self, host_ptr):
        super().host_free(host_ptr)
        self.host_blocks -= 1


class Node:
    """A graph node; ``node.me = node`` makes the cycle."""


def _extensible(driver):
    buf = jaxbuf.ExtensibleTensor(2 * GRANULE, "cpu", num_segments=2, driver=driver)
    buf.resize_per_segment_(8192, zero_new=True)
    torch = pytest.importorskip("torch")
    return buf, [buf.segment_view(0), buf.segment_view(1).to_torch(), torch.ones(1)]


def _pool(driver):
    pool = jaxbuf.UvaBufferPool(
        (8, 2), "int32", device="cpu", driver=driver, buffer_cls=jaxbuf.UvaBuffer
    )
    return pool, [pool.copy_to_uva([[1, 2], [3, 4]]), pool.copy_to_uva(np.ones((20, 2), np.int32))]


def _staged(driver):
    swt = jaxbuf.StagedWriteTensor((4, 8), "int32", device="cpu", backend="numpy", driver=driver)
    swt.stage_write(0, 0, [1, 2])
    swt.apply_write()
    swt.stage_write(1, 0, [3])
    uva = jaxbuf.StagedWriteTensor(
        8, "int32", device="cpu", backend="numpy", driver=driver, uva_instead_of_gpu=True
    )
    return swt, [swt.gpu, uva, uva.gpu]


@pytest.mark.parametrize(
    "make",
    [_extensible, _pool, _staged],
    ids=["ExtensibleTensor", "UvaBufferPool", "StagedWriteTensor"],
)
def test_cycles_are_collected_and_free_their_memory(make, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    driver = CountingDriver()
    obj, extras = make(driver)
    assert driver.reservations or driver.host_blocks
    node = Node()
    node.me, node.obj, node.extras = node, obj, extras
    if not isinstance(obj, jaxbuf.StagedWriteTensor):  # slotted; it cycles through its view
        obj.back = node
    extras.append(node)  # views and arrays point back into the cycle too
    ref = weakref.ref(obj)
    del obj, extras, node
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
        gc.collect()
    assert ref() is None
    assert (driver.reservations, driver.host_blocks) == (0, 0)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unraisable, unraisable


def test_a_cycle_through_a_numpy_array_is_collected_and_frees_the_memory():
    """numpy arrays are invisible to the cycle collector; ``to_numpy()``'s array holds the
    export anchor (the ExtensibleTensor's virtual buffer, the memory), not the handle, so a
    cycle through the array and the handle is still collected, and the memory goes with the
    array. Before the owner contract the array held the handle and the cycle leaked until an
    explicit ``free()``."""
    driver = CountingDriver()
    buf = jaxbuf.ExtensibleTensor(GRANULE, "cpu", driver=driver)
    buf.resize_per_segment_(4096)
    node = Node()
    node.me, node.array, buf.back = node, buf.segment_view(0).to_numpy(), node
    node.array[:] = 7  # the memory is live while the array is
    ref = weakref.ref(buf)
    del buf, node
    gc.collect()
    assert ref() is None
    assert driver.reservations == 0


def test_staged_write_tensor_in_a_cycle_through_its_writer():
    driver = CountingDriver()
    swt = jaxbuf.StagedWriteTensor((4, 8), "int32", device="cpu", backend="numpy", driver=driver)
    writer = jaxbuf.FusedStagedWriter("cpu", 4, backend="numpy", driver=driver)
    swt.stage_write(0, 0, [1])
    writer.apply([swt])
    writer.peer = (swt, writer)
    ref = weakref.ref(swt)
    del swt, writer
    gc.collect()
    assert ref() is None
    assert (driver.reservations, driver.host_blocks) == (0, 0)


# -- release_physical under live views -----------------------------------------------------
def test_release_physical_keeps_views_and_recommit_revives_them():
    buf = jaxbuf.ExtensibleTensor(2 * GRANULE, "cpu", num_segments=2)
    buf.resize_per_segment_(4096, zero_new=True)
    view = buf.segment_view(1)
    array = view.to_numpy()
    array[:] = 7
    ptr = view.ptr
    buf.release_physical()
    assert buf.physical_bytes == 0 and buf.committed_sizes == [0, 0]
    assert view.ptr == ptr and buf.segment_view(1).ptr == ptr  # the address never moves
    buf.resize_per_segment_(4096)  # no zero_new: fresh CPU pages are zero anyway
    assert (array == 0).all()  # the old array works again, over new memory
    torch = pytest.importorskip("torch")
    assert torch.equal(view.to_torch(), torch.zeros(4096, dtype=torch.uint8))
    array[:] = 3
    assert ctypes.string_at(ptr, 4) == b"\x03" * 4
    buf.free()


@pytest.mark.parametrize("debug", ["0", "1"], ids=["normal", "debug"])
def test_after_release_physical_the_cpu_reads_zeros_and_a_write_faults(monkeypatch, debug):
    """Without debug mode; with it (``JAXBUF_DEBUG=1``) the read faults already, as on CUDA."""
    monkeypatch.setenv("JAXBUF_DEBUG", debug)
    result = run_python("""
        import jaxbuf
        buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
        buf.resize_per_segment_(4096, zero_new=True)
        array = buf.segment_view(0).to_numpy()
        array[:] = 9
        buf.release_physical()
        print("released", int(array.max()), flush=True)  # zeros, never the stale 9
        array[0] = 1
        print("WROTE", flush=True)
    """)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-3000:])
    assert "WROTE" not in result.stdout
    if debug == "1":
        assert "released" not in result.stdout, result.stdout
        assert "(CPU driver, debug mode)" in result.stderr or not HAS_HINT, result.stderr[-3000:]
    else:
        assert "released 0" in result.stdout, (result.stdout, result.stderr[-3000:])


# -- free() means "I am done" --------------------------------------------------------------
INTERRUPTED_FREE_OWNERS = {
    "ExtensibleTensor": """
        owner = jaxbuf.ExtensibleTensor(4 << 20, device="cpu")
        owner.resize_per_segment_(1 << 20, zero_new=True)
        array, free = owner.segment_view(0).to_numpy(), owner.free
    """,
    "StagedWriteTensor": """
        owner = jaxbuf.StagedWriteTensor((64, 64), "int32", device="cpu")
        array, free = owner.to_numpy(), owner.free
    """,
    "ImportedBuffer": """
        from jaxbuf.sharing import ImportedBuffer, export_layout
        source = jaxbuf.ExtensibleTensor(4 << 20, device="cpu")
        source.resize_per_segment_(1 << 20, zero_new=True)
        layout, fds = export_layout(source)
        owner = ImportedBuffer(layout, list(fds))
        array, free = owner.segment_view(0).to_numpy(), owner.close
    """,
}


@pytest.mark.parametrize("owner", INTERRUPTED_FREE_OWNERS)
def test_a_free_interrupted_after_its_close_leaves_the_memory_to_the_exports(owner):
    """The timer signal right after the close left the memory to a live export: the retried
    ``free()`` must not release it under the export (it did: ``SIGSEGV`` at the next read);
    the export keeps reading it and releases it when it goes."""
    result = run_python(
        """
        import gc
        import jaxbuf
        from jaxbuf import _owner
        """
        + INTERRUPTED_FREE_OWNERS[owner]
        + """
        array[:] = 5
        close = _owner.Lifetime.close
        def interrupted(self, release_now):
            _owner.Lifetime.close = close
            close(self, release_now)
            raise KeyboardInterrupt  # the timer signal, just after the close
        _owner.Lifetime.close = interrupted
        try:
            free()
        except KeyboardInterrupt:
            pass
        free()  # the retry
        assert not owner.released
        print("read", int(array.max()), flush=True)
        del array
        gc.collect()
        assert owner.released
        print("done", flush=True)
        """
    )
    assert "read 5" in result.stdout, (result.returncode, result.stdout, result.stderr[-3000:])
    assert_clean_exit(result)


def _grown(driver=None, fill: int = 7):
    """A one-segment buffer with 4096 committed bytes set to ``fill``."""
    buf = jaxbuf.ExtensibleTensor(GRANULE, "cpu", driver=driver)
    buf.resize_per_segment_(4096)
    buf.segment_view(0).to_numpy()[:] = fill
    return buf


def wait_for(condition, timeout: float = 10.0) -> bool:
    """JAX may run a capsule's deleter a moment later, from one of its threads."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.01)
    return True


def _export(framework: str, view):
    if framework == "numpy":
        return view.to_numpy()
    if framework == "capsule":
        return view.__dlpack__()  # never consumed: its destructor ends the export
    if framework == "torch":
        return pytest.importorskip("torch").from_dlpack(view)
    pytest.importorskip("jax")
    return view.to_jax()


def _read(framework: str, array) -> int:
    if framework == "capsule":
        return 7  # a capsule holds the memory but reads nothing
    if framework == "torch":
        return int(array.sum())
    return int(np.asarray(array).astype(np.int64).sum())


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax", "capsule"])
def test_free_with_a_live_export_releases_with_the_last_export(framework):
    driver = CountingDriver()
    buf = _grown(driver)
    array = _export(framework, buf.segment_view(0))
    assert buf.live_exports == 1 and not buf.released
    buf.free()
    # The handle is done with the memory; the array still reads it.
    assert buf.base_ptr == 0 and buf.committed_sizes == [0] and buf.physical_bytes == 0
    assert _read(framework, array) == (7 * 4096 if framework != "capsule" else 7)
    assert buf.live_exports == 1 and not buf.released and driver.reservations == 1
    with pytest.raises(RuntimeError, match="freed"):
        buf.segment_view(0)
    buf.free()  # idempotent, also with exports alive
    del array
    assert wait_for(lambda: buf.released)
    assert buf.live_exports == 0 and driver.reservations == 0


def test_free_without_exports_releases_at_once():
    driver = CountingDriver()
    buf = _grown(driver)
    array = buf.segment_view(0).to_numpy()
    del array  # an export that is gone holds nothing
    assert buf.live_exports == 0
    buf.free()
    assert buf.released and driver.reservations == 0


def test_two_exports_the_memory_goes_with_the_last():
    driver = CountingDriver()
    buf = _grown(driver)
    first, second = buf.segment_view(0).to_numpy(), buf.segment_view(0).__dlpack__()
    buf.free()
    assert buf.live_exports == 2
    del first
    assert buf.live_exports == 1 and not buf.released
    del second
    assert buf.released and driver.reservations == 0


@pytest.mark.parametrize("route", ["__dlpack__", "to_numpy", "to_torch", "to_jax", "copy"])
def test_a_view_taken_before_free_refuses_to_export(route):
    buf = _grown()
    view = buf.segment_view(0)
    buf.free()
    assert buf.released
    export = {
        "__dlpack__": view.__dlpack__,
        "to_numpy": view.to_numpy,
        "to_torch": lambda: (pytest.importorskip("torch"), view.to_torch()),
        "to_jax": lambda: (pytest.importorskip("jax"), view.to_jax()),
        "copy": lambda: view.__dlpack__(copy=True),
    }[route]
    with pytest.raises(RuntimeError, match="the ExtensibleTensor has been freed"):
        export()


def test_every_method_needing_memory_raises_after_free():
    buf = _grown()
    array = buf.segment_view(0).to_numpy()  # alive: free() only lets go
    buf.free()
    for call in (
        lambda: buf.segment_view(0),
        buf.full_view,
        lambda: buf.resize_per_segment_(8192),
        buf.release_physical,
        buf.defragment,
        lambda: buf.grant_access([]),
        lambda: buf.segments_backed_by_one_chunk([0]),
        buf.check_exportable,
    ):
        with pytest.raises(RuntimeError, match="the ExtensibleTensor has been freed"):
            call()
    assert (buf.num_bytes, buf.physical_bytes, buf.num_physical_chunks, buf.base_ptr) == (
        0,
        0,
        0,
        0,
    )
    assert int(array[0]) == 7


@pytest.mark.parametrize("how", [pickle.dumps, copy.copy, copy.deepcopy])
def test_owners_refuse_pickling_and_copying(how):
    buf = _grown()
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        how(buf)
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        how(buf.export_anchor.target)  # the allocation itself
    buf.free()


def test_export_anchor_is_the_lifetime_anchor():
    """One attribute read on the hot path: the ExportAnchor itself, stable while open."""
    from jaxbuf._capsule import ExportAnchor

    buf = _grown()
    anchor = buf.export_anchor
    assert type(anchor) is ExportAnchor and buf.export_anchor is anchor
    capsule = buf.segment_view(0).__dlpack__()
    assert anchor.live_exports == buf.live_exports == 1
    del capsule
    buf.free()
    assert buf.export_anchor is None and anchor.live_exports == 0


class _Quiescing(interop.Adapter):
    name = "quiescing-test"

    def __init__(self) -> None:
        self.devices: list = []

    def is_array(self, x) -> bool:
        return False

    def quiesce(self, device) -> None:
        self.devices.append(device)


def test_free_quiesces_the_frameworks_before_releasing():
    adapter = interop.register(_Quiescing())
    try:
        buf = _grown()
        array = buf.segment_view(0).to_numpy()
        buf.free()
        assert adapter.devices == []  # exports alive: nothing is released, nothing waited for
        del array
        buf = _grown()
        buf.free()
        assert adapter.devices == [buf.device]
    finally:
        interop.unregister(adapter.name)


def test_jax_quiesce_waits_for_pending_computations():
    """JAX dispatches asynchronously, on the CPU too: quiesce returns once JAX's pending
    work on the platform is done (what free() waits for before unmapping)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    # On JAX's CPU device also where its default is a GPU: quiesce(cpu) waits for the CPU.
    x = jax.device_put(jnp.ones((1024, 1024), jnp.float32), jax.devices("cpu")[0])
    x.block_until_ready()
    out = jax.jit(lambda a: jnp.linalg.matrix_power(a / 1024, 16).sum())(x)
    running = not out.is_ready()  # most likely: the step takes a while
    interop.get("jax").quiesce(jaxbuf.Device("cpu"))
    assert out.is_ready(), running
    interop.get("jax").quiesce(jaxbuf.Device("cuda"))  # no GPU backend here: nothing to wait for


def test_quiesce_never_imports_a_framework():
    result = run_python(
        """
        import sys
        import jaxbuf
        buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
        buf.resize_per_segment_(4096)
        buf.free()
        assert buf.released
        assert not {"torch", "jax"} & set(sys.modules), sorted(sys.modules)
        print("done", flush=True)
    """,
        spawn=True,
    )
    assert_clean_exit(result)


# The README's JAX example on the CPU, in its GPU form: no block_until_ready, no del, before
# free(). JAX lets go of the donated import at dispatch while the step may still read it;
# free() waits for JAX's pending work. Before, this died with SIGSEGV three times out of three.
README_JAX_ON_CPU = """
    import jax, jax.numpy as jnp
    import jaxbuf

    cache = jaxbuf.ExtensibleTensor(64 << 20, device="cpu", num_segments=2)  # K and V
    cache.resize_per_segment_(2 << 20, zero_new=True)
    k = cache.segment_view(0).to_jax(dtype=jnp.bfloat16, shape=(256, 4096))
    assert k.unsafe_buffer_pointer() == cache.base_ptr
    cache.resize_per_segment_(8 << 20, zero_new=True)
    k = cache.segment_view(0).to_jax(dtype=jnp.bfloat16, shape=(1024, 4096))
    step = jax.jit(lambda x: x.at[0].set(1), donate_argnums=0)
    k = step(k)
    cache.free()
    assert float(k[0, 0]) == 1.0 and float(k[1, 0]) == 0.0
    print("done", flush=True)
"""


@pytest.mark.slow
def test_readme_jax_example_with_free_right_after_a_donated_step():
    pytest.importorskip("jax")
    for run in range(10):
        result = run_python(README_JAX_ON_CPU)
        assert result.returncode == 0, (run, result.returncode, result.stderr[-3000:])
        assert "done" in result.stdout, (run, result.stdout)


# -- use after free --------------------------------------------------------------------------
USE_AFTER_FREE = """
import ctypes, mmap
import numpy as np
import jaxbuf
from jaxbuf.drivers import HostVmmDriver
driver = HostVmmDriver(quarantine_bytes={quarantine})
buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu", driver=driver)
buf.resize_per_segment_(4096, zero_new=True)
ptr = buf.base_ptr
# A raw alias, not an export (an export would keep the memory alive): free() releases under it.
array = np.ctypeslib.as_array((ctypes.c_uint8 * 4096).from_address(ptr))
buf.free()
# Another allocation asks for exactly that address (a hint, as any later mmap may land there).
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
other = libc.mmap(ptr, 4096, mmap.PROT_READ | mmap.PROT_WRITE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
ctypes.memset(other, 0x5A, 4096)
print("reused" if other == ptr else "elsewhere", flush=True)
print("READ", int(array[0]), flush=True)
"""


def test_view_used_after_free_faults_instead_of_reading_another_allocation():
    result = run_python(USE_AFTER_FREE.format(quarantine=64 << 30))
    assert_segfault(result, "elsewhere")


def test_without_the_quarantine_a_stale_view_reads_another_allocation():
    """Why the quarantine exists: with it off, the stale read returns someone else's bytes."""
    result = run_python(USE_AFTER_FREE.format(quarantine=0))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reused" in result.stdout and "READ 90" in result.stdout, result.stdout


def _mapped(ptr: int) -> bool:
    """Whether some mapping of this process contains ``ptr``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            if start <= ptr < end:
                return True
    return False


def test_quarantine_is_bounded_fifo():
    size = 16 * mmap.PAGESIZE
    driver = HostVmmDriver(quarantine_bytes=3 * size, quarantine_ranges=100)
    ptrs = [driver.reserve(size) for _ in range(5)]
    for ptr in ptrs:
        driver.free_reserved(ptr, size)
    assert driver.quarantined == (3, 3 * size)
    assert [_mapped(ptr) for ptr in ptrs] == [False, False, True, True, True]  # oldest go first

    by_count = HostVmmDriver(quarantine_bytes=1 << 40, quarantine_ranges=2)
    ptrs = [by_count.reserve(size) for _ in range(4)]
    for ptr in ptrs:
        by_count.free_reserved(ptr, size)
    assert by_count.quarantined == (2, 2 * size)
    assert [_mapped(ptr) for ptr in ptrs] == [False, False, True, True]

    big = driver.reserve(4 * size)  # larger than the whole budget: unmapped at once
    driver.free_reserved(big, 4 * size)
    assert driver.quarantined == (3, 3 * size) and not _mapped(big)

    driver.flush_quarantine()
    by_count.flush_quarantine()
    assert driver.quarantined == (0, 0) == by_count.quarantined
    assert not any(_mapped(ptr) for ptr in ptrs)


def test_quarantine_drops_pages_still_mapped():
    """free_reserved over a range with a chunk still mapped leaves only PROT_NONE behind."""
    driver = HostVmmDriver()
    base = driver.reserve(mmap.PAGESIZE)
    chunk = driver.create(mmap.PAGESIZE, 0)
    driver.map(base, mmap.PAGESIZE, chunk)
    driver.memset(base, 0xEE, mmap.PAGESIZE, 0)
    driver.release(chunk)
    driver.free_reserved(base, mmap.PAGESIZE)
    with open("/proc/self/maps") as maps:
        entry = next(
            line
            for line in maps
            if int(line.split("-")[0], 16) <= base < int(line.split()[0].split("-")[1], 16)
        )
    assert entry.split()[1] == "---p", entry
    driver.flush_quarantine()


@pytest.mark.parametrize("value", [-1, 1.5, None, True])
def test_quarantine_settings_are_validated(value):
    with pytest.raises(ValueError, match=repr(value).replace("(", r"\(")):
        HostVmmDriver(quarantine_bytes=value)
