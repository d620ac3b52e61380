"""The pinned-slot ring: a slot is reused, grown or released only once its guard says the
device is done (or after the device-wide fallback), whatever its owner."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbuf.drivers.host import HostVmmDriver
from jaxbuf.uva import UvaBuffer, UvaBufferPool
from jaxbuf.uva._slots import UNRECORDED, DeviceEvent, PinnedSlot, PinnedSlotRing


class _Guard:
    """A guard the test completes by hand; counts its waits."""

    def __init__(self, done: bool = False, can_tell: bool = True) -> None:
        self.done = done
        self.can_tell = can_tell
        self.waits = 0
        self.released = 0

    def ready(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waits += 1
        self.done = True
        return self.can_tell

    def release(self) -> None:
        self.released += 1


class _Buffer:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.freed = False


class _Recorder:
    """The ring's callables, recording what the ring asks for."""

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.released: list[_Buffer] = []
        self.fallbacks = 0
        self.fail_allocate = False
        self.fail_release = False

    def allocate(self, capacity: int) -> _Buffer:
        if self.fail_allocate:
            raise MemoryError(f"cannot allocate {capacity}")
        self.allocated.append(capacity)
        return _Buffer(capacity)

    def release(self, buffer: _Buffer) -> None:
        if self.fail_release:
            raise RuntimeError("release failed")
        buffer.freed = True
        self.released.append(buffer)

    def fallback(self) -> None:
        self.fallbacks += 1


class _CountingSlot(PinnedSlot):
    __slots__ = ("refreshed_with",)

    def __init__(self) -> None:
        super().__init__()
        self.refreshed_with: list = []

    def refresh(self) -> None:
        self.refreshed_with.append(self.buffer)


def _ring(mode="wait", count=2, owns_guards=False):
    calls = _Recorder()
    ring = PinnedSlotRing(
        count,
        calls.allocate,
        calls.release,
        calls.fallback,
        mode=mode,
        owns_guards=owns_guards,
        slot_type=_CountingSlot,
        name="TestRing",
    )
    return ring, calls


def test_a_free_slot_is_reused_without_waiting():
    ring, calls = _ring()
    slot = ring.slots[0]
    ring.wait(slot, 0)
    assert slot.guard is None and calls.fallbacks == 0


def test_wait_mode_reuses_a_slot_only_once_its_guard_is_done():
    ring, calls = _ring(owns_guards=True)
    slot, guard = ring.slots[1], _Guard()
    slot.guard = guard
    ring.wait(slot, 1)
    assert guard.waits == 1 and guard.done
    assert slot.guard is None and calls.fallbacks == 0
    assert guard.released == 1  # the ring's own guard goes once waited for


def test_a_shared_guard_is_not_released_by_the_ring():
    ring, _ = _ring(owns_guards=False)
    slot, guard = ring.slots[0], _Guard()
    slot.guard = guard
    ring.wait(slot, 0)
    assert guard.released == 0 and slot.guard is None


def test_raise_mode_refuses_a_busy_slot_and_keeps_its_guard():
    ring, calls = _ring(mode="raise")
    slot, guard = ring.slots[1], _Guard()
    slot.guard = guard
    with pytest.raises(RuntimeError, match="TestRing slot 1 is reused while the device"):
        ring.wait(slot, 1)
    assert slot.guard is guard and guard.waits == 0
    guard.done = True
    ring.wait(slot, 1)
    assert slot.guard is None


@pytest.mark.parametrize("mode", ["wait", "raise"])
def test_an_unrecorded_slot_costs_the_device_wide_wait(mode):
    ring, calls = _ring(mode=mode)
    slot = ring.slots[0]
    slot.guard = UNRECORDED  # handed out; its event could not be recorded
    if mode == "raise":
        with pytest.raises(RuntimeError, match="is reused"):
            ring.wait(slot, 0)
        assert slot.guard is UNRECORDED and calls.fallbacks == 0
    else:
        ring.wait(slot, 0)
        assert calls.fallbacks == 1 and slot.guard is None


def test_a_guard_that_cannot_tell_costs_the_device_wide_wait():
    ring, calls = _ring()
    slot = ring.slots[0]
    slot.guard = _Guard(can_tell=False)  # a donated JAX output, say
    ring.wait(slot, 0)
    assert calls.fallbacks == 1 and slot.guard is None


def test_growth_allocates_first_refreshes_then_releases_the_old():
    ring, calls = _ring()
    slot = ring.slots[0]
    ring.grow(slot, 8)
    first = slot.buffer
    assert (slot.capacity, calls.allocated, calls.released) == (8, [8], [])
    ring.grow(slot, 32)
    assert slot.capacity == 32 and slot.buffer is not first
    assert calls.released == [first] and slot.refreshed_with == [first, slot.buffer]


@pytest.mark.parametrize("mode", [None, "wait", "raise"])
def test_growth_waits_for_the_reader_whatever_the_mode(mode):
    ring, calls = _ring(mode=mode)
    slot, guard = ring.slots[0], _Guard()
    ring.grow(slot, 8)
    slot.guard = guard
    ring.grow(slot, 16)  # the old memory is released: its reader must be done first
    assert guard.waits == 1 and slot.guard is None
    slot.guard = UNRECORDED
    ring.grow(slot, 32)
    assert calls.fallbacks == 1


def test_a_failed_allocation_leaves_the_slot_as_it_was():
    ring, calls = _ring()
    slot = ring.slots[0]
    ring.grow(slot, 8)
    before = slot.buffer
    calls.fail_allocate = True
    with pytest.raises(MemoryError, match="16"):
        ring.grow(slot, 16)
    assert slot.buffer is before and slot.capacity == 8 and not before.freed


def test_close_waits_releases_and_refuses_growth():
    ring, calls = _ring()
    guard = _Guard()
    for slot in ring.slots:
        ring.grow(slot, 8)
    ring.slots[0].guard = guard
    ring.slots[1].guard = UNRECORDED
    ring.close()
    assert guard.waits == 1 and calls.fallbacks == 1
    assert all(s.buffer is None and s.guard is None for s in ring.slots)
    assert [s.capacity for s in ring.slots] == [-1, -1]  # every request exceeds it
    assert not ring.held
    with pytest.raises(RuntimeError, match="TestRing"):
        ring.grow(ring.slots[0], 8)
    ring.close()  # twice is fine
    assert len(calls.released) == 2


def test_close_from_a_finalizer_does_not_wait_device_wide():
    ring, calls = _ring()
    ring.grow(ring.slots[0], 8)
    ring.slots[0].guard = UNRECORDED
    ring.close(settle_unrecorded=False)
    assert calls.fallbacks == 0 and ring.slots[0].buffer is None


def test_close_keeps_a_buffer_whose_release_fails_and_retries_it():
    ring, calls = _ring()
    for slot in ring.slots:
        ring.grow(slot, 8)
    calls.fail_release = True
    with pytest.raises(RuntimeError, match="release failed"):
        ring.close()
    assert all(s.buffer is not None for s in ring.slots) and ring.held
    calls.fail_release = False
    ring.close()
    assert not ring.held and len(calls.released) == 2


def test_close_interrupted_in_a_release_frees_every_slot_on_the_next_close():
    """A Ctrl-C in a slot's host_free: the slot was detached first, so the retried close()
    freed nothing and the pinned block lived until garbage collection. The interrupt now
    reaches the caller after every other slot is released, the interrupted one keeps its
    buffer, and the next close() frees it."""
    ring, calls = _ring(count=3)
    for slot in ring.slots:
        ring.grow(slot, 8)
    interrupts = [KeyboardInterrupt()]
    release = calls.release

    def interrupted_once(buffer):
        if interrupts:
            raise interrupts.pop()
        release(buffer)

    ring._release = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        ring.close()
    assert len(calls.released) == 2 and sum(s.buffer is not None for s in ring.slots) == 1
    ring.close()
    assert not ring.held and len(calls.released) == 3


def test_an_event_destroy_is_retried_after_a_failure_never_after_an_interrupt():
    """A failed destroy (an interrupt the call itself raised included) keeps the handle for a
    retry; a Ctrl-C delivered as the destroy returns (Python runs handlers between bytecodes)
    finds the event destroyed and forgotten: a retry would destroy it twice."""
    import signal

    destroyed, errors = [], [KeyboardInterrupt(), RuntimeError("busy")]
    signal_after = []

    class Driver:
        def destroy_event(self, handle):
            destroyed.append(handle)
            if errors:
                raise errors.pop()
            if signal_after:
                signal_after.pop()
                signal.raise_signal(signal.SIGINT)

    event = DeviceEvent.__new__(DeviceEvent)
    event._driver, event.handle = Driver(), 42
    with pytest.raises(RuntimeError):
        event.release()
    assert event.handle == 42  # failed: kept
    with pytest.raises(KeyboardInterrupt):
        event.release()
    assert event.handle == 42  # the call raised it, so it failed: kept
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signal_after.append(True)
        with pytest.raises(KeyboardInterrupt):
            event.release()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert event.handle is None  # destroyed as the interrupt landed: forgotten
    event.release()
    assert destroyed == [42, 42, 42]  # two failed calls and the one that destroyed it


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="'sometimes'"):
        PinnedSlotRing(1, int, print, print, mode="sometimes")


# -- a fault while recording the event: the slot is never reused early ---------------------
class _FlakyEventDriver(HostVmmDriver):
    """Fake pending events (complete on ``finish()``); ``fail_next_record`` fails one
    record; counts waits and device-wide synchronizes."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: set[int] = set()
        self.waited: list[int] = []
        self.synchronized = 0
        self.fail_next_record = False
        self._next = 0

    def record_event(self, stream, device_index):
        if self.fail_next_record:
            self.fail_next_record = False
            raise RuntimeError("injected: record_event failed")
        self._next += 1
        self.pending.add(self._next)
        return self._next

    def event_query(self, event):
        return event not in self.pending

    def event_synchronize(self, event):
        self.waited.append(event)
        self.pending.discard(event)

    def destroy_event(self, event):
        self.pending.discard(event)

    def synchronize(self, device_index):
        self.synchronized += 1
        self.pending.clear()


def test_a_failed_event_record_leaves_the_pool_slot_guarded():
    driver = _FlakyEventDriver()
    pool = UvaBufferPool(4, "int32", 2, "cpu", driver=driver, buffer_cls=UvaBuffer, guarded=True)
    pool.copy_to_uva([1, 1])  # slot 1, handed out: UNRECORDED
    driver.fail_next_record = True
    with pytest.raises(RuntimeError, match="record_event failed"):
        pool.copy_to_uva([2, 2])
    np.testing.assert_array_equal(pool.slots[0].np[:2], [0, 0])  # nothing written
    assert pool.current_slot == 1
    pool.copy_to_uva([2, 2])  # slot 0: records slot 1's readers now (event 1, pending)
    pool.copy_to_uva([3, 3])  # slot 1: waits for that event before writing
    assert driver.waited == [1]
    np.testing.assert_array_equal(pool.slots[1].np[:2], [3, 3])
    pool.close()


def test_an_unrecorded_slot_of_a_real_ring_waits_device_wide():
    driver = _FlakyEventDriver()
    ring = PinnedSlotRing(
        1,
        lambda words: UvaBuffer(words, "int32", "cpu", driver=driver),
        UvaBuffer.free,
        lambda: driver.synchronize(0),
    )
    slot = ring.slots[0]
    ring.grow(slot, 4)
    slot.guard = UNRECORDED  # launched; the event after it failed to record
    ring.wait(slot, 0)
    assert driver.synchronized == 1
    slot.guard = DeviceEvent(driver, driver.record_event(1, 0), 1)
    ring.wait(slot, 0)
    assert driver.waited == [1] and driver.synchronized == 1
    ring.close()
    assert slot.buffer is None
