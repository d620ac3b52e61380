"""A Ctrl-C (or an exception from a signal handler) in the middle of cleanup: the cleanup is
a transaction, so afterwards nothing is leaked, nothing is released twice, and the object is
usable or closes cleanly on the next call. Interrupts are injected at every driver call of a
release with the fault-injecting driver (each case the same on the CPU driver as on CUDA's
calls: the bookkeeping is the driver-independent part)."""

from __future__ import annotations

import contextlib
import signal

import pytest

import jaxbuf
from jaxbuf import _lifetime
from jaxbuf._errors import Cleanup
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.testing import FaultInjectingDriver

MiB = 1 << 20


def _grown(driver: FaultInjectingDriver) -> jaxbuf.ExtensibleTensor:
    tensor = jaxbuf.ExtensibleTensor(16 * MiB, "cpu", driver=driver)
    for size in (2 * MiB, 4 * MiB, 6 * MiB):  # three chunks
        tensor.resize_per_segment_(size)
    return tensor


@pytest.mark.parametrize("kind", ["unmap", "release"])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_an_interrupt_during_release_physical_releases_each_chunk_once(kind, nth):
    """KeyboardInterrupt at the nth unmap or release of release_physical: it reaches the
    caller; every other chunk is released; the chunk it cut short stays tracked and the next
    call finishes it; the driver ends with no live handle, nothing released twice."""
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    tensor = _grown(driver)
    driver.fail_on(kind, nth, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        tensor.release_physical()
    assert driver.problems() == []
    assert tensor.physical_bytes <= 2 * MiB  # at most the one chunk cut short
    tensor.resize_per_segment_(8 * MiB, zero_new=True)  # usable
    assert not tensor.segment_view(0).to_numpy()[6 * MiB :].any()
    tensor.free()
    assert driver.problems() == [] and not driver.live_handles and not driver.reservations


def test_cleanup_runs_every_step_and_raises_the_interrupt_first():
    ran = []
    cleanup = Cleanup("closing")

    def step(name, error=None):
        ran.append(name)
        if error is not None:
            raise error

    cleanup.run(step, "a", ValueError("a failed"))
    cleanup.run(step, "b", KeyboardInterrupt())
    cleanup.run(step, "c")
    assert ran == ["a", "b", "c"]  # the interrupt did not stop the cleanup half-way
    with pytest.raises(KeyboardInterrupt) as caught:
        cleanup.raise_first()
    assert any("a failed" in note for note in caught.value.__notes__)


def test_an_interrupt_inside_the_deferred_retry_keeps_the_release_queued():
    """A KeyboardInterrupt while a finalizer's failed release was retried dropped it from the
    queue: the memory leaked for good. The one cut short and those not reached stay queued."""
    driver = object()  # the queue is keyed by driver: this one is the test's alone
    done = []
    interrupts = [KeyboardInterrupt()]

    def release(name):
        def run():
            if interrupts:
                raise interrupts.pop()
            done.append(name)

        return run

    with _lifetime._deferred_lock:
        _lifetime._deferred.extend(
            [(driver, release("first"), "first"), (driver, release("second"), "second")]
        )
    with pytest.raises(KeyboardInterrupt):
        _lifetime.retry_deferred(driver)
    assert _lifetime.deferred_releases(driver) == ["first", "second"]
    _lifetime.retry_deferred(driver)
    assert done == ["first", "second"] and _lifetime.deferred_releases(driver) == []


@pytest.mark.parametrize(
    "kind, nth",
    [("unmap", 1), ("unmap", 3), ("release", 1), ("release", 2), ("free_reserved", 1),
     ("free_reserved", 2)],
)  # fmt: skip
def test_an_interrupt_in_defragment_cleanup_leaks_nothing(kind, nth):
    """KeyboardInterrupt at the nth unmap, release or free_reserved of a defragment's cleanup
    (the old chunks and the two temporary reservations, after the swap): the bytes are kept,
    what was cut short is retried by the next release, and once the buffer is freed the driver
    holds no handle and no reservation (a Ctrl-C there leaked a whole segment's chunks and
    both temporary reservations)."""
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    tensor = _grown(driver)
    tensor.segment_view(0).to_numpy()[:] = 5
    driver.fail_on(kind, nth, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        tensor.defragment()  # the cleanup: 3 x (unmap, release), then 2 x free_reserved
    driver.disarm()
    assert (tensor.segment_view(0).to_numpy() == 5).all()  # the bytes survive
    assert tensor.num_physical_chunks == 1  # the swap was done before the interrupt
    tensor.free()
    assert driver.problems() == [] and not driver.live_handles and not driver.reservations


def test_an_interrupt_while_a_chunk_is_created_leaves_no_memfd_open(monkeypatch):
    """A signal handler raising KeyboardInterrupt during a grow's posix_fallocate left the
    memfd open, its pages committed, after free(): the descriptor is closed on the way out."""
    import os

    from jaxbuf.drivers.host import HostVmmDriver

    def interrupted(fd, offset, length):
        raise KeyboardInterrupt

    driver = HostVmmDriver()
    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "posix_fallocate", interrupted)
    tensor = jaxbuf.ExtensibleTensor(16 * MiB, "cpu", driver=driver)
    with pytest.raises(KeyboardInterrupt):
        tensor.resize_per_segment_(4 * MiB)
    monkeypatch.undo()
    assert tensor.committed_sizes == [0] and tensor.physical_bytes == 0
    tensor.resize_per_segment_(4 * MiB)  # usable
    tensor.free()
    assert set(os.listdir("/proc/self/fd")) <= before


@pytest.mark.parametrize(
    "kind", ["synchronize", "reserve", "create", "map", "set_access", "copy", "move_mapping"]
)
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_an_interrupt_in_defragment_swap_rolls_back_and_leaks_nothing(kind, nth):
    """KeyboardInterrupt at a call of defragment's first half (the new chunk, the copy, the
    swap): the rollback puts the old chunks back, the bytes are kept, and once freed the
    driver holds nothing."""
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    tensor = _grown(driver)
    tensor.segment_view(0).to_numpy()[:] = 5
    driver.fail_on(kind, nth, KeyboardInterrupt())
    # Some positions are past the calls this defragment makes: it completes then.
    with contextlib.suppress(KeyboardInterrupt):
        tensor.defragment()
    driver.disarm()
    assert (tensor.segment_view(0).to_numpy() == 5).all()
    tensor.free()
    assert driver.problems() == [] and not driver.live_handles and not driver.reservations


def test_an_endpoint_close_interrupted_in_a_peer_import_finishes_next_time(monkeypatch):
    """Ctrl-C while an endpoint closes a same-host peer's import: the import was forgotten
    before it was closed, so the retried close() left it mapped. It is forgotten only once
    closed now, and the second close() finishes: no mapping, no thread, no socket left."""
    import threading

    from jaxbuf.sharing import ImportedBuffer
    from jaxbuf.transfer import KVEndpoint, KVLayout

    owner = jaxbuf.ExtensibleTensor(8 * MiB, "cpu")
    owner.resize_per_segment_(2 * MiB)
    mine = jaxbuf.ExtensibleTensor(8 * MiB, "cpu")
    mine.resize_per_segment_(2 * MiB)
    served = KVEndpoint("served", owner, KVLayout(4096))
    endpoint = KVEndpoint("importer", mine, KVLayout(4096))
    threads = threading.active_count()
    peer = endpoint.connect(served.metadata())
    imported = peer.link.imports[0]
    close, interrupts = ImportedBuffer.close, [KeyboardInterrupt()]

    def interrupted_once(self):
        if interrupts:
            raise interrupts.pop()
        close(self)

    monkeypatch.setattr(ImportedBuffer, "close", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        endpoint.close()
    assert not imported.released and not endpoint.closed
    endpoint.close()
    assert imported.released and endpoint.closed
    served.close()
    assert threading.active_count() <= threads
    owner.free()
    mine.free()


# -- every release path, interrupted at each of its driver calls -----------------------------
def _staged(driver, uva):
    swt = jaxbuf.StagedWriteTensor(
        (4, 8), "int32", "cpu", uva_instead_of_gpu=uva, backend="numpy", driver=driver
    )
    swt.stage_write(1, 0, [1, 2, 3])
    swt.apply_write()  # the writer and its pinned slot exist: free() releases them too
    return swt


def _writer(driver):
    swt = jaxbuf.StagedWriteTensor((4, 8), "int32", "cpu", backend="numpy", driver=driver)
    writer = jaxbuf.FusedStagedWriter("cpu", 16, 2, backend="numpy", driver=driver)
    swt.stage_write(0, 0, [7])
    writer.apply((swt,))
    swt.free()
    return writer


def _pool(driver):
    pool = jaxbuf.UvaBufferPool(64, "int32", 3, "cpu", driver=driver)
    for _ in range(3):
        pool.copy_to_uva(list(range(10)))
    return pool


_OWNERS = {
    "ExtensibleTensor": _grown,
    "StagedWriteTensor": lambda driver: _staged(driver, uva=False),
    "StagedWriteTensor-uva": lambda driver: _staged(driver, uva=True),
    "FusedStagedWriter": _writer,
    "UvaBufferPool": _pool,
    "UvaBuffer": lambda driver: jaxbuf.UvaBuffer(4096, "uint8", "cpu", driver=driver),
}


@pytest.mark.parametrize("name", list(_OWNERS))
def test_an_interrupt_at_any_call_of_free_releases_everything_once(name):
    """KeyboardInterrupt at each driver call ``free()`` makes, in turn: it reaches the caller,
    nothing is released twice, and the next ``free()`` releases everything that is left."""
    make = _OWNERS[name]
    probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
    calls = probe.count_calls(make(probe).free)
    assert calls > 0
    for nth in range(calls):
        driver = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
        owner = make(driver)
        driver.fail_at(driver.call_count + nth, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            owner.free()
        owner.free()  # finishes what the interrupt cut short
        owner.free()  # and is idempotent after that
        assert driver.problems() == [], f"interrupt at call {nth} of {calls}"
        driver.assert_clean()  # before the owner is collected: free() itself released it all
        assert not driver.live_events, f"interrupt at call {nth}: events leaked"
        assert driver.faults_injected == 1


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("cls", ["UvaBuffer", "NonUvaBuffer"])
def test_an_interrupted_free_never_releases_under_a_live_export(monkeypatch, cls, where):
    """Found by the state machine's timer signal (SIGSEGV reading an export): a Ctrl-C in
    UvaBuffer.free() before its lifetime closed, or after it closed with exports alive, was
    taken for a failed release and the buffer reopened over a new lifetime, so the next
    free() released the memory under the exports. NonUvaBuffer.free() interrupted after the
    close, before it forgot the allocation, did the same on the next call. The exports keep
    the memory until the last one goes, whatever the interrupt cut short."""
    from jaxbuf import _owner

    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    buf = getattr(jaxbuf, cls)((4, 1024), "int32", "cpu", driver=driver)
    buf.np[...] = 7
    if cls == "NonUvaBuffer":
        buf.uva()
    held = buf.view.to_numpy()
    close, interrupts = _owner.Lifetime.close, [KeyboardInterrupt()]

    def interrupted_once(self, release_now):
        if where == "after" and interrupts:
            close(self, release_now)
        if interrupts:
            raise interrupts.pop()
        return close(self, release_now)

    monkeypatch.setattr(_owner.Lifetime, "close", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        buf.free()
    buf.free()  # released the memory under `held` before the fix
    assert not buf.released and (held == 7).all()
    del held
    assert buf.released
    driver.disarm()
    driver.assert_clean()


def test_an_interrupt_in_a_finalizers_release_queues_it(monkeypatch):
    """Found by the state machine (a KeyboardInterrupt at host_free while a dropped buffer
    was collected): the finalizer caught Exception only, so the interrupt went to "Exception
    ignored" and the release was lost, the pinned block with it. It is queued like any failed
    release now (retried at the driver's next use), and the interrupt still goes where
    Python sends an exception raised in a finalizer."""
    import gc
    import sys

    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    buf = jaxbuf.UvaBuffer((4, 1024), "int32", "cpu", driver=driver)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    driver.fail_on("host_free", 1, KeyboardInterrupt())
    with pytest.warns(ResourceWarning, match="retried"):
        del buf
        gc.collect()
    assert [type(report.exc_value) for report in unraisable] == [KeyboardInterrupt]
    assert driver.pinned  # not freed yet, but queued:
    assert _lifetime.deferred_releases(driver)
    _lifetime.retry_deferred(driver)
    driver.assert_clean()


@pytest.mark.parametrize("owner", ["ExtensibleTensor", "ImportedBuffer"])
def test_a_copy_export_racing_free_refuses_rather_than_copy_zeros(monkeypatch, owner):
    """Found by the state machine's copy-export race: a copy (np.from_dlpack(copy=True))
    on another thread, landing inside free() (or an import's close()) after it had emptied
    the committed sizes but before it closed, read no committed range and returned zeros for
    the bytes, with no error. The interleaving is forced here: the copy runs as the free
    closes. The owner closes first now, and the copy refuses (ClosedError) or copies the
    true bytes."""
    import numpy as np

    from jaxbuf import ClosedError, _owner
    from jaxbuf.sharing import ImportedBuffer, export_layout

    tensor = jaxbuf.ExtensibleTensor(4 * MiB, "cpu")
    tensor.resize_per_segment_(MiB)
    tensor.segment_view(0).to_numpy()[:] = 9
    close, source = tensor.free, tensor
    if owner == "ImportedBuffer":
        layout, fds = export_layout(tensor)
        imported = ImportedBuffer(layout, list(fds))
        close, source = imported.close, imported
    view = source.segment_view(0)
    lifetime_close, copies = _owner.Lifetime.close, []

    def copy_in_between(self, release_now):
        if not copies:  # "another thread", as this free closes
            try:
                copies.append(np.from_dlpack(view, copy=True))
            except ClosedError as error:
                copies.append(error)
        return lifetime_close(self, release_now)

    monkeypatch.setattr(_owner.Lifetime, "close", copy_in_between)
    close()
    monkeypatch.undo()
    assert copies and (isinstance(copies[0], ClosedError) or (copies[0] == 9).all())
    tensor.free()


# -- an interrupt that lands just after a release returned --------------------------------
class _SignalAfter(FaultInjectingDriver):
    """Raises SIGINT just after the ``nth`` call of ``kind`` returned, once armed: Python
    runs the handler at the next bytecode, so the ``KeyboardInterrupt`` lands where a Ctrl-C
    during a slow driver call lands, between the call (a release, or an acquisition: a
    chunk created or mapped, a reservation, an event) and the line that records it."""

    def __init__(self, inner, kind):
        super().__init__(inner, simulate_events=True)
        self.kind, self.left = kind, 0

    def _after(self, kind):
        if kind == self.kind and self.left:
            self.left -= 1
            if not self.left:
                signal.raise_signal(signal.SIGINT)


#: The calls that release something, and those that acquire something.
RELEASES = ("unmap", "release", "free_reserved", "host_free", "destroy_event")
ACQUISITIONS = ("create", "map", "set_access", "reserve", "host_alloc", "import_handle")
ACQUISITIONS += ("record_ready_event", "record_event")


def _signalling(kind):
    def call(self, *args, **kwargs):
        result = getattr(FaultInjectingDriver, kind)(self, *args, **kwargs)
        self._after(kind)
        return result

    call.__name__ = kind
    return call


for _kind in (*RELEASES, *ACQUISITIONS, "move_mapping"):
    setattr(_SignalAfter, _kind, _signalling(_kind))


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (a test runner may have replaced it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("kind", ["unmap", "release", "free_reserved", "host_free"])
@pytest.mark.parametrize("name", list(_OWNERS))
def test_an_interrupt_just_after_a_release_returned_releases_nothing_twice(
    name, kind, python_sigint
):
    """The interrupt is held back until the release is recorded, then reaches the caller;
    the next ``free()`` finishes without releasing anything twice. Before, such an interrupt
    left the released chunk, reservation or pinned block tracked: the retry unmapped,
    released or freed it again (on CUDA a double ``cuMemRelease``)."""
    make = _OWNERS[name]
    probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True, record_calls=True)
    owner = make(probe)
    start = len(probe.log)
    owner.free()
    calls = sum(call.kind == kind for call in probe.log[start:])
    if not calls:
        pytest.skip(f"{name}.free() makes no {kind} call")
    for nth in range(1, calls + 1):
        driver = _SignalAfter(get_vmm_driver("cpu"), kind)
        owner = make(driver)
        driver.left = nth
        with pytest.raises(KeyboardInterrupt):
            owner.free()
        owner.free()
        assert driver.problems() == [], f"interrupt after {kind} {nth} of {calls}"
        driver.assert_clean()


def test_deferred_interrupts_deliver_after_the_block_and_restore_the_handler(python_sigint):
    from jaxbuf._interrupts import deferred_interrupts

    ran = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        signal.raise_signal(signal.SIGINT)
        ran.append("after the signal")  # held back: the block runs to its end
        with deferred_interrupts():  # nested: the outer block delivers
            ran.append("nested")
        ran.append("end")
    assert ran == ["after the signal", "nested", "end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with deferred_interrupts():  # nothing arrived: nothing raised
        pass


# -- an interrupt that lands just after an acquisition returned -----------------------------
def _grow_scenario(driver, owners):
    tensor = jaxbuf.ExtensibleTensor(16 * MiB, "cpu", driver=driver)
    owners.append(tensor)
    for size in (2 * MiB, 4 * MiB, 6 * MiB):
        tensor.resize_per_segment_(size, zero_new=True)


def _import_scenario(driver, owners):
    from jaxbuf.sharing import ImportedBuffer, export_layout

    source = owners[0]
    layout, fds = export_layout(source)
    owners.append(ImportedBuffer(layout, list(fds), driver=driver))


def _kv_commit_scenario(driver, owners):
    builder = jaxbuf.ExtensibleKVCacheBuilder(8, "cpu", driver=driver)
    owners.append(builder)
    builder.reserve(8 * MiB, 2)
    kv = builder.finish()
    owners[-1] = kv  # a finished builder hands its tensors over: the cache frees them
    kv.commit(5)
    kv.commit(8)


def _defragment_scenario(driver, owners):
    tensor = jaxbuf.ExtensibleTensor(16 * MiB, "cpu", driver=driver)
    owners.append(tensor)
    for size in (2 * MiB, 4 * MiB, 6 * MiB):
        tensor.resize_per_segment_(size)
    tensor.segment_view(0).to_numpy()[:] = 7
    tensor.defragment()
    assert (tensor.segment_view(0).to_numpy() == 7).all()


_ACQUIRING = {
    "grow": _grow_scenario,
    "import": _import_scenario,
    "kv_commit": _kv_commit_scenario,
    "defragment": _defragment_scenario,
}


def _release_all(owners):
    import gc

    for owner in reversed(owners):
        if isinstance(owner, jaxbuf.ExtensibleTensor):
            owner.free()
        elif hasattr(owner, "close"):
            owner.close()
        else:
            owner.free()
    owners.clear()
    gc.collect()


@pytest.mark.parametrize("kind", (*ACQUISITIONS, "move_mapping"))
@pytest.mark.parametrize("name", list(_ACQUIRING))
def test_an_interrupt_just_after_an_acquisition_returned_leaves_nothing_untracked(
    name, kind, python_sigint
):
    """A Ctrl-C delivered as ``create``, ``map``, ``reserve`` (...) returns, during a grow, an
    import or a KV-cache commit: the interrupt reaches the caller once what the call made is
    recorded (or rolled back), the object stays usable, and freeing it leaves the driver
    clean. Before, a chunk mapped as the interrupt landed was marked failed while mapped:
    its handle was released under the mapping and it was forgotten, and ``free()`` freed the
    address range with it still mapped."""
    from jaxbuf._lifetime import retry_deferred

    scenario = _ACQUIRING[name]
    source = jaxbuf.ExtensibleTensor(16 * MiB, "cpu")  # what an import maps: three chunks
    for size in (2 * MiB, 4 * MiB, 6 * MiB):
        source.resize_per_segment_(size)
    try:
        probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True, record_calls=True)
        owners = [source] if name == "import" else []
        scenario(probe, owners)
        calls = sum(call.kind == kind for call in probe.log)
        _release_all(owners[1:] if name == "import" else owners)
        if not calls:
            pytest.skip(f"the {name} makes no {kind} call")
        for nth in range(1, calls + 1):
            driver = _SignalAfter(get_vmm_driver("cpu"), kind)
            driver.left = nth
            owners = [source] if name == "import" else []
            with pytest.raises(KeyboardInterrupt):
                scenario(driver, owners)
            assert driver.problems() == [], f"interrupt after {kind} {nth} of {calls}"
            _release_all(owners[1:] if name == "import" else owners)
            retry_deferred(driver)
            assert driver.problems() == [], f"interrupt after {kind} {nth} of {calls}"
            driver.assert_clean()
            assert not driver.live_events, f"interrupt after {kind} {nth}: events leaked"
    finally:
        source.free()


def _param_table(driver):
    table = jaxbuf.DeviceParamTable(4, {"temperature": "float32"}, "cpu", 2, driver=driver)
    for value in (0.5, 0.7, 0.9):  # events on both staging slots and the owner
        table["temperature"].np[:] = value
        table.sync()
    return table


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_an_interrupt_as_a_param_table_event_is_destroyed_reaches_close(
    nth, python_sigint, monkeypatch
):
    """A Ctrl-C as ``DeviceEvent.__del__`` destroys an event during ``DeviceParamTable.close``
    was taken for a failed destroy: "Exception ignored in DeviceEvent.__del__", ``close()``
    returned normally, and the queued retry destroyed the event a second time. The destroy
    is recorded before the interrupt is delivered, and the interrupt reaches ``close()``'s
    caller."""
    import gc
    import sys

    from jaxbuf._lifetime import deferred_releases, retry_deferred

    probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True, record_calls=True)
    table = _param_table(probe)
    start = len(probe.log)
    table.close()
    calls = sum(call.kind == "destroy_event" for call in probe.log[start:])
    if nth > calls:
        pytest.skip(f"close() destroys {calls} event(s)")
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    driver = _SignalAfter(get_vmm_driver("cpu"), "destroy_event")
    table = _param_table(driver)
    driver.left = nth
    with pytest.raises(KeyboardInterrupt):
        table.close()
    table.close()
    gc.collect()
    assert unraisable == []
    assert deferred_releases(driver) == []
    retry_deferred(driver)
    assert driver.problems() == []
    driver.assert_clean()
    assert not driver.live_events


def test_an_interrupt_as_a_finalizer_destroys_an_event_queues_no_second_destroy(
    python_sigint, monkeypatch
):
    """A dropped ``DeviceEvent`` whose destroy returns as a Ctrl-C lands: the destroy is
    done, so nothing is queued for a retry (which destroyed it twice); the interrupt goes
    where Python sends an exception raised in a finalizer."""
    import sys

    from jaxbuf._lifetime import deferred_releases
    from jaxbuf.uva._slots import DeviceEvent

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    driver = _SignalAfter(get_vmm_driver("cpu"), "destroy_event")
    event = DeviceEvent(driver, driver.record_ready_event(0), 1)
    driver.left = 1
    del event
    assert [type(report.exc_value) for report in unraisable] == [KeyboardInterrupt]
    assert deferred_releases(driver) == []
    assert driver.problems() == [] and not driver.live_events


# -- pools, staged writers: an interrupt at any instant of their life ---------------------
def _guarded_pool_scenario(driver, owners):
    pool = jaxbuf.UvaBufferPool(64, "int32", 2, "cpu", guarded="wait", driver=driver)
    owners.append(pool)
    for rows in (10, 20, 30, 40):
        pool.copy_to_uva(list(range(rows)))
    pool.close()


def _growing_pool_scenario(driver, owners):
    pool = jaxbuf.UvaBufferPool(4, "int32", 2, "cpu", driver=driver)
    owners.append(pool)
    for rows in (3, 40, 9, 300, 1000):  # grows both slots, twice
        pool.copy_to_uva(list(range(rows)))
    pool.close()


def _fused_writer_scenario(driver, owners):
    swt = jaxbuf.StagedWriteTensor((4, 8), "int32", "cpu", backend="numpy", driver=driver)
    owners.append(swt)
    writer = jaxbuf.FusedStagedWriter("cpu", 16, 2, backend="numpy", driver=driver)
    owners.append(writer)
    for value in range(3):
        swt.stage_write(value, 0, [value] * 5)
        writer.apply((swt,))
    swt.free()
    writer.free()


def _param_table_scenario(driver, owners):
    table = jaxbuf.DeviceParamTable(4, {"temperature": "float32"}, "cpu", 2, driver=driver)
    owners.append(table)
    for value in (0.5, 0.7, 0.9):
        table["temperature"].np[:] = value
        table.sync()
    table.close()


def _non_uva_scenario(driver, owners):
    buffer = jaxbuf.NonUvaBuffer((4, 256), "int32", "cpu", driver=driver)
    owners.append(buffer)
    for value in range(3):
        buffer.np[...] = value
        buffer.uva()  # the host values copied to the device buffer, an event recorded
    buffer.free()


_LIVES = {
    "guarded_pool": _guarded_pool_scenario,
    "growing_pool": _growing_pool_scenario,
    "fused_writer": _fused_writer_scenario,
    "param_table": _param_table_scenario,
    "non_uva": _non_uva_scenario,
}


def _finish(owners, driver):
    import gc

    from jaxbuf._lifetime import retry_deferred

    for owner in reversed(owners):
        owner.free() if hasattr(owner, "free") else owner.close()
    owners.clear()
    gc.collect()
    retry_deferred(driver)
    assert driver.problems() == []
    driver.assert_clean()
    assert not driver.live_events, "events leaked"


@pytest.mark.parametrize("name", list(_LIVES))
def test_an_interrupt_at_any_call_of_a_pool_or_writer_leaks_nothing(name):
    """A KeyboardInterrupt at each driver call of a guarded pool's, a growing pool's or a
    fused writer's whole life (construction, copies, growth, applies, teardown): it reaches
    the caller, and freeing what exists then leaves the driver with no handle, pinned block
    or event, nothing released twice."""
    scenario = _LIVES[name]
    probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
    owners: list = []
    calls = probe.count_calls(lambda: scenario(probe, owners))
    _finish(owners, probe)
    for nth in range(calls):
        driver = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
        driver.fail_at(driver.call_count + nth, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            scenario(driver, owners)
        driver.disarm()
        try:
            _finish(owners, driver)
        except AssertionError as error:
            raise AssertionError(f"interrupt at call {nth} of {calls}: {error}") from None


@pytest.mark.parametrize("kind", RELEASES + ACQUISITIONS)
@pytest.mark.parametrize("name", list(_LIVES))
def test_an_interrupt_just_after_a_pool_or_writer_call_returned_leaks_nothing(
    name, kind, python_sigint
):
    """The same lives, with the Ctrl-C landing just after each call of ``kind`` returned."""
    scenario = _LIVES[name]
    probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True, record_calls=True)
    owners: list = []
    scenario(probe, owners)
    _finish(owners, probe)
    calls = sum(call.kind == kind for call in probe.log)
    if not calls:
        pytest.skip(f"the {name} makes no {kind} call")
    for nth in range(1, calls + 1):
        driver = _SignalAfter(get_vmm_driver("cpu"), kind)
        driver.left = nth
        with pytest.raises(KeyboardInterrupt):
            scenario(driver, owners)
        try:
            _finish(owners, driver)
        except AssertionError as error:
            raise AssertionError(f"interrupt after {kind} {nth} of {calls}: {error}") from None


def test_host_create_interrupted_at_random_instants_leaks_no_memfd():
    """A timer signal (its handler raising KeyboardInterrupt) at seeded random instants of
    ``HostVmmDriver.create`` and ``import_handle``: every call either returns a chunk or
    raises, and once the chunks are released (or collected) no descriptor is left open. The
    memfd leaked when the signal landed as ``memfd_create`` (or ``dup``) returned."""
    import gc
    import os
    import random

    from jaxbuf.drivers.host import HostVmmDriver

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    driver = HostVmmDriver()
    source = driver.create(64 * 1024, 0)
    rng = random.Random(20261204)
    before = set(os.listdir("/proc/self/fd"))
    previous = signal.signal(signal.SIGALRM, interrupt)
    outcomes = {"made": 0, "interrupted": 0}
    try:
        for _ in range(1500):
            chunk = None
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 80e-6))
                if rng.random() < 0.5:
                    chunk = driver.create(64 * 1024, 0)
                else:
                    chunk = driver.import_handle(source.fd, 64 * 1024, 0)
                signal.setitimer(signal.ITIMER_REAL, 0)
                outcomes["made"] += 1
            except KeyboardInterrupt:
                signal.setitimer(signal.ITIMER_REAL, 0)
                outcomes["interrupted"] += 1
            if chunk is not None:
                driver.release(chunk)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    gc.collect()
    left = set(os.listdir("/proc/self/fd")) - before
    driver.release(source)
    assert outcomes["made"] and outcomes["interrupted"], outcomes
    assert not left, f"{len(left)} descriptor(s) left open after {outcomes}"


def test_a_signal_while_a_block_is_entered_leaves_later_blocks_deferring(
    python_sigint, monkeypatch
):
    """A signal delivered while ``deferred_interrupts`` replaced the handlers raised out of
    ``__enter__`` with the nesting depth still counted: every later block took itself for
    a nested one and held nothing back (found by the memfd timer test). The failed entry
    leaves no trace now."""
    from jaxbuf import _interrupts
    from jaxbuf._interrupts import deferred_interrupts

    install, calls = _interrupts._install, []

    def interrupted_install():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        install()

    monkeypatch.setattr(_interrupts, "_install", interrupted_install)
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        raise AssertionError("the block ran")
    assert _interrupts._depth == 0
    ran = []
    with pytest.raises(KeyboardInterrupt), deferred_interrupts():
        signal.raise_signal(signal.SIGINT)
        ran.append("held back")
    assert ran == ["held back"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- a timer signal at seeded random instants of whole lives --------------------------------
def _tensor_life(driver, owners):
    tensor = jaxbuf.ExtensibleTensor(16 * MiB, "cpu", driver=driver)
    owners.append(tensor)
    for size in (2 * MiB, 6 * MiB):
        tensor.resize_per_segment_(size, zero_new=True)
        view = tensor.segment_view(0)
        view.to_numpy()[:16] = 1
        del view
    tensor.release_physical()
    tensor.resize_per_segment_(4 * MiB)
    tensor.defragment()
    tensor.free()


def _kv_life(driver, owners):
    builder = jaxbuf.ExtensibleKVCacheBuilder(8, "cpu", driver=driver)
    owners.append(builder)
    builder.reserve(8 * MiB, 2)
    kv = builder.finish()
    owners[-1] = kv
    kv.commit(4)
    kv.release_physical()
    kv.recommit()
    kv.commit(8)
    kv.free()


_TIMED = {
    "tensor": _tensor_life,
    "kv_cache": _kv_life,
    "guarded_pool": _guarded_pool_scenario,
    "growing_pool": _growing_pool_scenario,
    "fused_writer": _fused_writer_scenario,
    "param_table": _param_table_scenario,
    "non_uva": _non_uva_scenario,
}


# The timer may land in a finalizer, where Python reports the interrupt as ignored.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", list(_TIMED))
def test_a_timer_interrupt_at_random_instants_leaves_everything_at_baseline(name):
    """SIGALRM, its handler raising KeyboardInterrupt, at seeded random instants of a whole
    life (a tensor grown, viewed, released, defragmented and freed; a KV cache committed,
    slept and woken; pools, staged writes, a parameter table): whatever the instant, freeing
    what exists then leaves the driver's invariants holding, no handle, mapping,
    reservation, pinned block or event alive, and no descriptor open."""
    import os
    import random
    import time

    scenario = _TIMED[name]
    probe = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
    owners: list = []
    start = time.perf_counter()
    scenario(probe, owners)
    duration = time.perf_counter() - start
    _finish(owners, probe)
    rng = random.Random(f"{name}-20261204")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = set(os.listdir("/proc/self/fd"))
    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupted = 0
    try:
        for i in range(int(os.environ.get("JAXBUF_TIMER_RUNS", "60"))):  # more: a soak
            driver = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.2 * duration))
                scenario(driver, owners)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                signal.setitimer(signal.ITIMER_REAL, 0)
                interrupted += 1
            try:
                _finish(owners, driver)
            except AssertionError as error:
                raise AssertionError(f"run {i}: {error}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted, "the timer never landed"
    left = set(os.listdir("/proc/self/fd")) - before
    assert not left, f"{len(left)} descriptor(s) left open"


def test_a_rollback_undoes_newest_first_and_keeps_the_error():
    """``Rollback``: on a failure every registered undo runs, newest first, a failed one a
    note on the error (not its replacement), an interrupt raised by one after the rest;
    leaving normally, or after ``commit()``, undoes nothing."""
    from jaxbuf._errors import Rollback

    ran = []

    def undo(name, error=None):
        ran.append(name)
        if error is not None:
            raise error

    with pytest.raises(ValueError, match="step 4") as caught, Rollback("building") as rollback:
        for name, error in (("a", None), ("b", RuntimeError("b stuck")), ("c", None)):
            rollback.push(undo, name, error)
        raise ValueError("step 4 failed")
    assert ran == ["c", "b", "a"]
    assert any("building: undoing" in n and "b stuck" in n for n in caught.value.__notes__)
    ran.clear()
    with pytest.raises(KeyboardInterrupt) as caught, Rollback("building") as rollback:
        rollback.push(undo, "a")
        rollback.push(undo, "b", KeyboardInterrupt())
        raise ValueError("failed")
    assert ran == ["b", "a"] and isinstance(caught.value.__cause__, ValueError)
    ran.clear()
    with Rollback("building") as rollback:
        rollback.push(undo, "a")
    with pytest.raises(ValueError), Rollback("building") as rollback:
        rollback.push(undo, "b")
        rollback.commit()
        raise ValueError("after the commit")
    assert ran == []
