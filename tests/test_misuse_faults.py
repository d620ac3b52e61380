"""Crash, leak and data-loss paths outside the crash matrix: copies of uncommitted memory,
releases under JAX's asynchronous dispatch or under live imports, failed releases where no
caller can see them, the address-space quarantine, a rebound host array, free() racing an
export, and unclear errors. Cases that could die by a signal run in a child process
(``run_child`` of the crash matrix) and must exit normally."""

from __future__ import annotations

import gc
import importlib.util
import warnings

import numpy as np
import pytest
from test_crash_matrix import run_child

import jaxbuf
from jaxbuf import interop
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import DriverError
from jaxbuf.sharing import ImportedBuffer, export_layout
from jaxbuf.testing import FaultInjectingDriver

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
MiB = 1 << 20


def cpu_driver() -> FaultInjectingDriver:
    return FaultInjectingDriver(get_vmm_driver("cpu"))


# -- copies read committed bytes only ----------------------------------------------------------
@pytest.mark.parametrize("debug", ["0", "1"], ids=["normal", "debug"])
def test_copy_of_a_full_view_reads_committed_bytes_and_zeros_the_rest(monkeypatch, debug):
    # In debug mode (JAXBUF_DEBUG=1) a stray read of an uncommitted byte by a copy would fault.
    monkeypatch.setenv("JAXBUF_DEBUG", debug)
    body = r"""
from jaxbuf.sharing import ImportedBuffer, export_layout
buf = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu", num_segments=2)
never_grown = np.from_dlpack(buf.full_view(), copy=True)
assert never_grown.shape == (8 * MiB,) and not never_grown.any()
buf.resize_per_segment_(4096, zero_new=True)
buf.segment_view(1).to_numpy()[:] = 7
copied = np.from_dlpack(buf.full_view(), copy=True)
assert copied.sum() == 7 * 4096, copied.sum()
layout, fds = export_layout(buf)
imported = ImportedBuffer(layout, list(fds))
from_import = np.from_dlpack(imported.full_view(), copy=True)
assert (from_import == copied).all()
imported.close()
if not jaxbuf.drivers.get_vmm_driver("cpu").debug:  # in debug mode this read faults
    print(buf.full_view().to_numpy()[-4:])  # uncommitted CPU pages read as zeros
buf.free()
done()
"""
    assert run_child(body, "cpu") == "works"


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_printing_a_full_view_in_torch_does_not_kill_the_interpreter(monkeypatch):
    # Without debug mode: with it the read faults, as on CUDA (tests/test_debug_mode.py).
    monkeypatch.setenv("JAXBUF_DEBUG", "0")
    body = r"""
buf = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
print(buf.full_view().to_torch())
buf.resize_per_segment_(64, zero_new=True)
buf.release_physical()
print(buf.full_view().to_torch().sum())
buf.free()
done()
"""
    assert run_child(body, "cpu") == "works"


# -- release_physical waits for the frameworks, as free() does ---------------------------------
def test_release_physical_waits_for_the_frameworks(monkeypatch):
    calls = []
    monkeypatch.setattr(interop, "quiesce", lambda device: calls.append(device))
    buf = jaxbuf.ExtensibleTensor(4 * MiB, device="cpu")
    buf.resize_per_segment_(MiB)
    buf.release_physical()
    assert calls == [jaxbuf.Device("cpu")]
    buf.free()


@pytest.mark.skipif(not HAS_JAX, reason="JAX is not installed")
def test_release_physical_under_jax_async_dispatch_does_not_fault():
    body = r"""
import jax, jax.numpy as jnp
buf = jaxbuf.ExtensibleTensor(64 * MiB, device="cpu")
buf.resize_per_segment_(64 * MiB, zero_new=True)
x = buf.segment_view(0).to_jax("float32", (16 * MiB,))

@jax.jit
def slow(x):
    for _ in range(30):
        x = jnp.sin(x) + 1.0
    return x.sum()

result = slow(x)  # dispatched, still running
buf.release_physical()
float(result)
buf.free()
done()
"""
    assert run_child(body, "cpu", timeout=300) == "works"


# -- an import keeps the mappings of its live arrays -------------------------------------------
def test_update_keeps_chunks_mapped_under_live_arrays():
    body = r"""
from jaxbuf.sharing import ImportedBuffer, export_layout
owner = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
owner.resize_per_segment_(2 * MiB, zero_new=True)
owner.segment_view(0).to_numpy()[:] = 5
layout, fds = export_layout(owner)
imported = ImportedBuffer(layout, list(fds))
array = imported.segment_view(0).to_numpy()
owner.release_physical()
layout2, fds2 = export_layout(owner, since=layout)
imported.update(layout2, list(fds2))
assert (array == 5).all()  # still mapped: the array is alive
assert imported.committed_sizes == [0]
owner.resize_per_segment_(2 * MiB, zero_new=True)  # a new chunk where the old one is
layout3, fds3 = export_layout(owner, since=layout2)
raises(RuntimeError, lambda: imported.update(layout3, list(fds3)), "drop those arrays")
assert (array == 5).all()
del array
layout4, fds4 = export_layout(owner)
imported.update(layout4, list(fds4))  # no export left: the old chunk goes, the new maps
assert imported.committed_sizes == [2 * MiB]
imported.close()
owner.free()
done()
"""
    assert run_child(body, "cpu") == "works"


def test_a_failed_release_in_an_import_keeps_the_handle_for_a_retry():
    owner = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
    owner.resize_per_segment_(2 * MiB)
    driver = cpu_driver()
    layout, fds = export_layout(owner)
    imported = ImportedBuffer(layout, list(fds), driver=driver)
    driver.fail_on("release")
    with pytest.raises(DriverError):
        imported.close()
    imported.close()  # retries the release of the handle kept
    driver.assert_clean()
    owner.free()


def test_a_failed_release_in_update_keeps_the_handle_for_a_retry():
    owner = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
    owner.resize_per_segment_(2 * MiB)
    driver = cpu_driver()
    layout, fds = export_layout(owner)
    imported = ImportedBuffer(layout, list(fds), driver=driver)
    owner.release_physical()
    layout2, fds2 = export_layout(owner, since=layout)
    driver.fail_on("release")
    with pytest.raises(DriverError):
        imported.update(layout2, list(fds2))
    imported.close()
    driver.assert_clean()
    owner.free()


# -- deferred releases never fail silently -----------------------------------------------------
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_a_release_failing_in_a_deleter_is_reported_once_and_retried():
    driver = cpu_driver()
    buf = jaxbuf.ExtensibleTensor(4 * MiB, device="cpu", driver=driver)
    buf.resize_per_segment_(MiB)
    tensor = buf.segment_view(0).to_torch()
    buf.free()  # the tensor holds the memory: released when it goes
    driver.fail_on("release")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del tensor
        gc.collect()
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(messages) == 1 and "retried" in messages[0], messages
    assert len(driver.live_handles) == 1  # queued, not released yet
    assert jaxbuf._lifetime.deferred_releases(driver) == ["the ExtensibleTensor's memory"]
    other = jaxbuf.ExtensibleTensor(4 * MiB, device="cpu", driver=driver)  # the next use
    other.free()
    driver.assert_clean()


def test_pinned_memory_failing_in_a_finalizer_is_queued_not_leaked():
    driver = cpu_driver()
    buf = jaxbuf.UvaBuffer(16, "int32", device="cpu", driver=driver)
    array = buf.np
    buf.free()  # the array holds the pinned block: released when it goes
    driver.fail_on("host_free")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del array
        gc.collect()
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(messages) == 1 and "retried" in messages[0], messages
    assert jaxbuf._lifetime.deferred_releases(driver) == ["pinned host memory"]
    jaxbuf.UvaBuffer(16, "int32", device="cpu", driver=driver).free()  # the next use
    driver.assert_clean()


# -- the quarantine never makes a reservation fail ---------------------------------------------
def test_quarantine_does_not_exhaust_a_limited_address_space():
    body = r"""
import resource
def address_space():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
limit = address_space() + 8 * 1024 * MiB
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
for i in range(24):
    buf = jaxbuf.ExtensibleTensor(1024 * MiB, device="cpu")
    buf.free()
done()
"""
    assert run_child(body, "cpu") == "works"


def test_reserve_drains_the_quarantine_on_enomem(monkeypatch):
    from jaxbuf.drivers import host

    driver = host.HostVmmDriver()
    ptr = driver.reserve(MiB)
    driver.free_reserved(ptr, MiB)
    assert driver.quarantined[0] == 1
    real_mmap, failures = host.mmap_or_raise, []

    def mmap_failing_once(addr, size, *args, **details):
        if addr is None and not failures:
            failures.append(size)
            raise DriverError("mmap", "ENOMEM", size=size)
        return real_mmap(addr, size, *args, **details)

    monkeypatch.setattr(host, "mmap_or_raise", mmap_failing_once)
    ptr = driver.reserve(MiB)
    assert failures and driver.quarantined == (0, 0)
    driver.free_reserved(ptr, MiB)
    driver.flush_quarantine()


def test_a_lowered_budget_trims_the_quarantine_when_a_range_is_unmapped_at_once():
    from jaxbuf.drivers import host

    driver = host.HostVmmDriver(quarantine_bytes=8 * MiB)
    for _ in range(3):
        driver.free_reserved(driver.reserve(2 * MiB), 2 * MiB)
    assert driver.quarantined == (3, 6 * MiB)
    driver.quarantine_bytes = 3 * MiB  # as a lowered RLIMIT_AS lowers it
    driver.free_reserved(driver.reserve(4 * MiB), 4 * MiB)  # beyond the budget: unmapped now
    assert driver.quarantined == (1, 2 * MiB)
    driver.flush_quarantine()


# -- a rebound host array ----------------------------------------------------------------------
def test_nonuva_refuses_a_rebound_array_of_another_shape():
    buf = jaxbuf.NonUvaBuffer(1024, "int32", device="cpu")
    buf.np = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match=r"rebound to an array of shape \(4,\)"):
        buf.uva()
    buf.np = np.full(1024, 3, np.int32)  # the same shape and dtype is fine
    assert (buf.uva().to_numpy() == 3).all()
    buf.free()


# -- free() racing an export on another thread -------------------------------------------------
def test_free_racing_an_export_ends_in_an_error_never_a_signal():
    body = r"""
import threading
sys.setswitchinterval(1e-6)  # switch threads often: the race window is a few bytecodes
outcomes = {"exported": 0, "refused": 0}
for _ in range(300):
    buf = jaxbuf.ExtensibleTensor(2 * MiB, device="cpu")
    buf.resize_per_segment_(4096, zero_new=True)
    view = buf.segment_view(0)
    arrays = []
    def export():
        for _ in range(200):
            try:
                arrays.append(view.to_numpy())
            except RuntimeError:
                outcomes["refused"] += 1
                return
    thread = threading.Thread(target=export)
    thread.start()
    buf.free()
    thread.join()
    for array in arrays:
        assert int(array.sum()) == 0  # every array made reads live memory
    outcomes["exported"] += len(arrays)
    del arrays
print(outcomes)
done()
"""
    assert run_child(body, "cpu", timeout=300) == "works"


@pytest.mark.parametrize("close", ["free", "uva_free", "import_close"])
def test_free_racing_a_copy_export_ends_in_an_error_never_a_signal(close):
    """A copy export reads the owner's bytes: it holds an export while it does, so a free()
    (or an import's close()) on another thread waits for it; before, 128 MiB copies racing
    free() died with SIGSEGV in the driver's copy."""
    body = r"""
import threading
import numpy as np
from jaxbuf.sharing import ImportedBuffer, export_layout
sys.setswitchinterval(1e-5)
size = 128 * MiB
outcomes = {"copied": 0, "refused": 0}
for _ in range(6):
    tensor = jaxbuf.ExtensibleTensor(size, device="cpu")
    tensor.resize_per_segment_(size, zero_new=True)
    if CLOSE == "free":
        view, close = tensor.segment_view(0), tensor.free
    elif CLOSE == "uva_free":
        owner = jaxbuf.UvaBuffer(size, "uint8", device="cpu")
        view, close = owner.view, owner.free
    else:
        layout, fds = export_layout(tensor)
        imported = ImportedBuffer(layout, list(fds))
        view, close = imported.segment_view(0), imported.close
    started = threading.Event()
    def copy():
        started.set()
        for _ in range(3):
            try:
                array = np.from_dlpack(view, copy=True)
                assert int(array[::4096].sum()) == 0
                outcomes["copied"] += 1
            except RuntimeError:
                outcomes["refused"] += 1
                return
    thread = threading.Thread(target=copy)
    thread.start()
    started.wait()
    close()
    thread.join()
    if CLOSE != "free":
        tensor.free()
print(outcomes)
done()
""".replace("CLOSE", repr(close))
    assert run_child(body, "cpu", timeout=300) == "works"


def test_free_racing_a_zeroing_grow_ends_in_an_error_never_a_signal():
    """free() on one thread while another's resize_per_segment_(zero_new=True) zeroes the new
    memory died with SIGSEGV: the grow now holds an export while it writes."""
    body = r"""
import threading, time
outcomes = {"grown": 0, "refused": 0}
for round_ in range(8):
    buf = jaxbuf.ExtensibleTensor(1 << 30, device="cpu")
    started = threading.Event()
    def grow():
        started.set()
        for step in range(1, 9):
            try:
                buf.resize_per_segment_(step * 64 * MiB, zero_new=True)
                outcomes["grown"] += 1
            except RuntimeError:  # freed meanwhile: a ClosedError
                outcomes["refused"] += 1
                return
    thread = threading.Thread(target=grow)
    thread.start()
    started.wait()
    time.sleep(0.002 * round_)
    buf.free()
    thread.join()
print(outcomes)
done()
"""
    assert run_child(body, "cpu", timeout=300) == "works"


def test_a_listener_calling_back_into_its_buffer_is_refused():
    """A mapping listener whose mapped() releases the buffer left it claiming 4 MiB committed
    over no memory, and the next write died with SIGSEGV: every call that would change the
    buffer from inside a listener is refused, the change being told of is undone (mapped) or
    refused (unmapping), and the buffer stays usable."""
    body = r"""
import numpy as np
calls = {
    "release": lambda buf: buf.release_physical(),
    "grow": lambda buf: buf.resize_per_segment_(6 * MiB),
    "defragment": lambda buf: buf.defragment(),
    "free": lambda buf: buf.free(),
}
class Reentrant:  # calls back into the buffer the first time it is told `event`
    def __init__(self, buf, event, call):
        self.buf, self.event, self.call, self.armed = buf, event, call, True
    def _told(self, event):
        if event == self.event and self.armed:
            self.armed = False
            self.call(self.buf)
    def mapped(self, chunks):
        self._told("mapped")
    def unmapping(self, chunks):
        self._told("unmapping")
for event in ("mapped", "unmapping"):
    for name, call in calls.items():
        buf = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
        buf.resize_per_segment_(2 * MiB)
        listener = Reentrant(buf, event, call)
        try:
            if event == "mapped":  # told of the chunks mapped now, as it is attached
                buf.add_mapping_listener(listener)
            else:
                buf.add_mapping_listener(listener)
                buf.release_physical()
        except RuntimeError as error:
            assert "from its mapping listener" in str(error), error
        else:
            raise AssertionError(f"{name} from {event} was not refused")
        committed = buf.committed_sizes[0]
        assert buf.physical_bytes >= committed > 0, (name, event, committed, buf.physical_bytes)
        view = buf.segment_view(0).to_numpy()
        view[:] = 7  # every committed byte is mapped: no fault
        assert int(view[-1]) == 7
        buf.resize_per_segment_(4 * MiB)  # usable: a grow tells the listener, now disarmed
        buf.free()
done()
"""
    assert run_child(body, "cpu", timeout=120) == "works"


# -- clear errors ------------------------------------------------------------------------------
def test_a_view_of_2_63_bytes_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"nbytes must be in \[0, 2\*\*63\)"):
        jaxbuf.BufferView(4096, 2**63)


@pytest.mark.parametrize("consume", ["numpy", "torch"])
def test_the_buffer_itself_is_not_an_array(consume):
    if consume == "torch" and not HAS_TORCH:
        pytest.skip("torch is not installed")
    buf = jaxbuf.ExtensibleTensor(4 * MiB, device="cpu")
    if consume == "torch":
        import torch

        call = torch.from_dlpack
    else:
        call = np.asarray
    with pytest.raises(TypeError, match="take a view first.*segment_view"):
        call(buf)
    buf.free()
