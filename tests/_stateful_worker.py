"""The child process of tests/test_state_machine.py: the public API's objects and a pure-numpy
model of their bytes and live handles.

The pytest process runs hypothesis and sends each step here; a step that kills this process
(a signal) fails one example, not the runner, and the next example starts a fresh worker.
Protocol over stdin/stdout: length-prefixed pickles. A request is ``(op, kwargs)``; the reply
is ``("ok", detail)``, ``("raised", type_name, message)`` for an exception of a documented type
(the model is then left as it was, and the invariants must still hold), or
``("violation", text)`` for a broken invariant or an undocumented exception. ``reset`` ends an
example: every reference is dropped, ``gc.collect()`` runs, and the example's
``FaultInjectingDriver`` must hold nothing (handles, reservations, mappings, pinned memory).

Only public API is used (``jaxbuf.*``, ``jaxbuf.jax_ops``, ``jaxbuf.testing``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import socket
import sys
import threading
import traceback
import warnings
from pathlib import Path

import numpy as np

MIB = 1 << 20

# The only exception types the public API documents (DriverError is a RuntimeError).
DOCUMENTED = (ValueError, TypeError, IndexError, BufferError, RuntimeError)
# What a step may end in besides: a KeyboardInterrupt the step armed (a driver call that
# raises it, or the timer signal). It counts as the failure of the one call it landed in.
FAILURES = (*DOCUMENTED, KeyboardInterrupt)

DTYPES = ("uint8", "int8", "int16", "int32", "float32", "float16", "bfloat16", "int64")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Violation(Exception):
    """An invariant broke: reported to the runner as a failure of the example."""


class Export:
    """One framework array over (or copied from) a model region."""

    __slots__ = (
        "owner",
        "kind",
        "obj",
        "segment",
        "nbytes",
        "snapshot",
        "zero_copy",
        "valid",
        "full",
    )

    def __init__(self, owner, kind, obj, segment, nbytes, snapshot, zero_copy, full=False):
        self.owner = owner  # the model object (EtModel, PoolModel)
        self.kind = kind
        self.obj = obj
        self.segment = segment
        self.nbytes = nbytes
        self.snapshot = snapshot  # bytes at export time (compared for copies)
        self.zero_copy = zero_copy
        self.valid = True  # False once release_physical invalidated it: never read again
        self.full = full  # a full_view() export: every segment, committed or not


class EtModel:
    """An ExtensibleTensor and the model of its committed bytes."""

    def __init__(self, obj, capacities):
        self.obj = obj
        self.capacities = list(capacities)
        self.offsets = obj.segment_offsets
        self.extent = self.offsets[-1] + self.capacities[-1]
        # Set by a driver failure of a grow, release or defragment (chunks may stay mapped
        # beyond the committed sizes, holding old bytes); cleared by a release_physical that
        # succeeded. While clear, every byte beyond the committed prefixes reads 0 on the CPU.
        self.dirty = False
        self.data = [np.zeros(0, np.uint8) for _ in capacities]
        self.known = [np.zeros(0, bool) for _ in capacities]
        self.freed = False
        self.dropped = False

    def grow(self, sizes, zero_new):
        for i, size in enumerate(sizes):
            old = self.data[i].size
            if size <= old:
                continue
            data = np.zeros(size, np.uint8)
            data[:old] = self.data[i]
            known = np.zeros(size, bool)
            known[:old] = self.known[i]
            known[old:] = zero_new
            self.data[i], self.known[i] = data, known

    def full_image(self, copy: bool):
        """What a ``full_view()`` reads: the committed prefixes, and zeros elsewhere (a copy
        holds zeros; the CPU reservation's pages read as zeros unless a failure left a chunk
        mapped beyond the sizes)."""
        data = np.zeros(self.extent, np.uint8)
        known = np.full(self.extent, copy or not self.dirty)
        for offset, segment, segment_known in zip(self.offsets, self.data, self.known):
            data[offset : offset + segment.size] = segment
            known[offset : offset + segment.size] = segment_known
        return data, known


class World:
    """Every object of one example, its model, and the invariants."""

    def __init__(self, device: str, framework: str) -> None:
        import jaxbuf
        from jaxbuf.drivers import get_vmm_driver

        self.jaxbuf = jaxbuf
        self.device = device
        self.framework = framework
        self.driver = _interruptible_driver()(get_vmm_driver(device))
        # Debug mode (JAXBUF_DEBUG=1): the CPU faults on uncommitted reads, as CUDA does.
        self.strict = device != "cpu" or getattr(get_vmm_driver(device), "debug", False)
        self.ets: dict[int, EtModel] = {}
        self.exports: list[Export] = []
        self.pools: dict[int, dict] = {}
        self.swts: dict[int, dict] = {}
        self.staged: dict[int, dict] = {}
        self.ring = None
        self.granule = jaxbuf.granule_size(device)
        self.share: dict = {}  # the shared tensor's model, last layout, importer's sizes
        self.memfds = _memfds()
        self.deferred = 0  # releases a finalizer reported as queued for a retry
        self.nonuvas: dict[int, dict] = {}

    # -- helpers ---------------------------------------------------------------------------
    def _read_view(self, view) -> np.ndarray:
        """The bytes of a BufferView, read by a fresh export (a copy on CUDA)."""
        if self.device == "cpu":
            return view.view("uint8").to_numpy()
        return np.from_dlpack(view.view("uint8"), device="cpu", copy=True)

    def _write_view(self, view, offset: int, data: np.ndarray) -> None:
        if self.device == "cpu":
            view.to_numpy()[offset : offset + data.size] = data
        else:
            import torch

            target = view.to_torch()
            target[offset : offset + data.size].copy_(torch.from_numpy(data))
            torch.cuda.synchronize()

    def _export_bytes(self, export: Export) -> np.ndarray:
        obj, kind = export.obj, export.kind
        if kind in ("numpy", "copy"):
            array = np.asarray(obj)
        elif kind == "torch":
            import torch

            array = obj.contiguous().view(torch.uint8).cpu().numpy() if obj.numel() else None
            if array is None:
                return np.zeros(0, np.uint8)
        elif kind == "jax":
            import jax.numpy as jnp

            # A fresh device copy reads the memory now (a JAX array caches its host value).
            array = np.asarray(jnp.array(obj, copy=True))
        else:
            raise AssertionError(kind)
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def _et(self, slot):
        model = self.ets.get(slot)
        if model is None or model.dropped:
            return None
        return model

    # -- ExtensibleTensor --------------------------------------------------------------------
    def et_create(self, slot, capacities, fault=None):
        if slot in self.ets and not self.ets[slot].dropped:
            return "slot taken"
        with self._fault(fault):
            obj = self.jaxbuf.ExtensibleTensor(
                sum(capacities),
                device=self.device,
                segment_capacities=capacities,
                driver=self.driver,
            )
        self.ets[slot] = EtModel(obj, capacities)
        return f"capacity {obj.capacity_bytes}"

    def et_grow(self, slot, sizes, zero_new, per_segment, fault=None):
        model = self._et(slot)
        if model is None:
            return "no tensor"
        caps = model.capacities
        if per_segment:
            sizes = [sizes[0]] * len(caps)
        else:
            sizes = (list(sizes) + [0] * len(caps))[: len(caps)]
        current = [d.size for d in model.data]
        valid = (
            not model.freed
            and all(0 <= s <= c for s, c in zip(sizes, caps))
            and all(s >= c for s, c in zip(sizes, current))
        )
        with self._fault(fault):
            try:
                if per_segment:
                    model.obj.resize_per_segment_(sizes[0], zero_new=zero_new)
                else:
                    model.obj.resize_segments_(sizes, zero_new=zero_new)
            except FAILURES as error:
                if _is_driver_error(error):
                    model.dirty = True
                if valid and not _is_driver_error(error):
                    raise Violation(f"valid grow to {sizes} raised {error!r}") from None
                if not valid:
                    _names_argument(error, [str(size) for size in sizes])
                raise
        if not valid:
            raise Violation(f"grow to {sizes} from {current} (caps {caps}) did not raise")
        model.grow(sizes, zero_new)
        return f"sizes {sizes}"

    def et_write(self, slot, segment, offset, data):
        model = self._et(slot)
        if model is None or model.freed:
            return "no live tensor"
        segment %= len(model.capacities)
        size = model.data[segment].size
        if size == 0:
            return "empty segment"
        data = np.frombuffer(data, np.uint8)[:size]
        offset %= size
        data = data[: size - offset]
        self._write_view(model.obj.segment_view(segment), offset, data)
        model.data[segment][offset : offset + data.size] = data
        model.known[segment][offset : offset + data.size] = True
        return f"{data.size} bytes at {offset}"

    def et_export(self, slot, segment, kind, dtype, shape_kind, copy, dl_device):
        """A view of ``dtype`` (and a 2-D shape, or a prefix) exported as ``kind``."""
        model = self._et(slot)
        if model is None:
            return "no tensor"
        segment %= len(model.capacities)
        if model.freed:
            view = None
            expect_freed = True
        else:
            expect_freed = False
        np_dtype = _np_dtype(dtype)
        size = model.data[segment].size
        count = size // np_dtype.itemsize
        if shape_kind == "2d" and count >= 2:
            shape = (2, count // 2)
        elif shape_kind == "prefix":
            shape = (count // 3,)
        else:
            shape = (count,)
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        try:
            view = model.obj.segment_view(segment).view(dtype, shape)
            if kind == "numpy":
                if copy or self.device != "cpu":  # numpy reads device memory as a copy
                    # A copy of the committed prefix (a full_view copy reads uncommitted
                    # pages: the invariant "copy=True touches only committed bytes" is
                    # fixed elsewhere; only segment views are copied here for now).
                    on_host = dl_device or self.device != "cpu"
                    obj = np.from_dlpack(view, copy=True, device="cpu" if on_host else None)
                    kind = "copy"
                else:
                    obj = view.to_numpy()
            elif kind == "torch":
                obj = view.to_torch()
            elif kind == "jax":
                obj = view.to_jax()
            else:
                raise AssertionError(kind)
        except DOCUMENTED as error:
            if expect_freed and isinstance(error, RuntimeError):
                raise
            if kind == "jax" and isinstance(error, BufferError):
                raise  # JAX refuses 64-bit without x64, or a copy: documented
            if kind == "numpy" and dtype == "bfloat16" and (copy or self.device != "cpu"):
                raise  # numpy's DLPack importer refuses bfloat16 (a copy on CUDA too)
            raise Violation(
                f"export of segment {segment} as {kind}/{dtype} {shape}: {error!r}"
            ) from None
        if expect_freed:
            raise Violation(f"segment_view of a freed tensor exported as {kind}")
        snapshot = model.data[segment][:nbytes].copy()
        known = model.known[segment][:nbytes].copy()
        export = Export(model, kind, obj, segment, nbytes, (snapshot, known), kind != "copy")
        self._check_export(export)
        self.exports.append(export)
        return f"{kind} {dtype} {shape}"

    def et_export_full(self, slot, kind, copy):
        """``full_view()`` exported as ``kind`` (a copy when ``copy``): committed bytes as the
        model says, zeros beyond them. Zero-copy only on the CPU without debug mode (on CUDA,
        and in debug mode, an uncommitted address must never be touched)."""
        model = self._et(slot)
        if model is None:
            return "no tensor"
        if not copy and self.strict:
            return "copies only on CUDA and in debug mode"
        try:
            view = model.obj.full_view()
            if copy and kind == "torch":
                import torch

                obj = torch.from_dlpack(view.__dlpack__(copy=True))
            elif copy:
                on_host = self.device != "cpu"
                obj = np.from_dlpack(view, copy=True, device="cpu" if on_host else None)
                kind = "copy"
            else:
                obj = getattr(view, f"to_{kind}")()
        except DOCUMENTED as error:
            if model.freed and isinstance(error, RuntimeError):
                raise
            raise Violation(f"export of the full view as {kind}: {error!r}") from None
        if model.freed:
            raise Violation(f"full_view of a freed tensor exported as {kind}")
        snapshot = model.full_image(copy=True) if copy else None
        export = Export(model, kind, obj, None, model.extent, snapshot, not copy, full=True)
        self._check_export(export)
        self.exports.append(export)
        return f"full view {kind}{' copy' if copy else ''}"

    def et_free_racing(self, slot, segment, kind, fault=None):
        """free() on this thread while another exports a segment view in a loop: the exporter
        ends in ClosedError (a RuntimeError) or success, never a signal; every array it made
        reads the model's bytes (it keeps the memory)."""
        import sys
        import threading

        model = self._et(slot)
        if model is None or model.freed:
            return "no live tensor"
        if kind == "numpy" and self.device != "cpu":
            return "numpy imports host memory only"
        segment %= len(model.capacities)
        view = model.obj.segment_view(segment)
        arrays, errors = [], []

        def export():
            try:
                for _ in range(100):
                    arrays.append(getattr(view, f"to_{kind}")())
            except BaseException as error:  # noqa: BLE001 - judged below
                errors.append(error)

        thread = threading.Thread(target=export)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the race window is a few bytecodes
        try:
            thread.start()
            self.et_free(slot, fault)
        finally:
            thread.join()
            sys.setswitchinterval(interval)
            if errors and not isinstance(errors[0], RuntimeError):
                raise Violation(f"an export racing free() raised {errors[0]!r}")
            nbytes = model.data[segment].size
            for array in arrays[-2:]:  # the model checks the last two from now on
                snapshot = (model.data[segment].copy(), model.known[segment].copy())
                export = Export(model, kind, array, segment, nbytes, snapshot, True)
                self._check_export(export)
                self.exports.append(export)
            for array in arrays[:-2]:
                actual = self._export_bytes(Export(model, kind, array, segment, 0, None, True))
                expected = model.data[segment]
                bad = np.flatnonzero((actual != expected) & model.known[segment])
                if actual.size != nbytes or bad.size:
                    raise Violation(f"an array exported while free() ran reads {actual[:8]}")
        return f"{len(arrays)} exported, {'refused' if errors else 'not refused'}"

    def et_release_physical(self, slot, fault=None):
        model = self._et(slot)
        if model is None:
            return "no tensor"
        try:
            with self._fault(fault):
                model.obj.release_physical()
        except KeyboardInterrupt:
            # The cleanup is a transaction: an interrupt is the failure of the one step it
            # cut short, the rest done; the documented outcome of a failed release follows.
            self._after_release_physical(model, failed=True)
            return "interrupted"
        except DOCUMENTED as error:
            if model.freed and isinstance(error, RuntimeError):
                raise
            if not _is_driver_error(error):
                raise
            # The documented outcome of a failed release: the sizes read 0 all the same.
            self._after_release_physical(model, failed=True)
            raise
        if model.freed:
            raise Violation("release_physical of a freed tensor did not raise")
        self._after_release_physical(model, failed=False)
        return "released"

    def _after_release_physical(self, model, failed):
        model.dirty = failed
        if self.share.get("model") is model:
            # The importer keeps the old pages, no longer the owner's, until the next send.
            self.share["valid"] = False
        model.data = [np.zeros(0, np.uint8) for _ in model.capacities]
        model.known = [np.zeros(0, bool) for _ in model.capacities]
        for export in self.exports:
            # A CPU full view stays readable: the reservation's pages read as zeros.
            if export.owner is model and export.zero_copy:
                export.valid = export.full and not self.strict

    def et_defragment(self, slot, fault=None):
        model = self._et(slot)
        if model is None:
            return "no tensor"
        try:
            with self._fault(fault):
                remapped = model.obj.defragment()
        except KeyboardInterrupt:
            # Drawn in the cleanup after the swap only: the span is one chunk, the bytes kept;
            # what the interrupt cut short is retried by the next release.
            model.dirty = True
            if self.share.get("model") is model:
                self.share["valid"] = False
            return "interrupted"
        except DOCUMENTED as error:
            model.dirty = model.dirty or _is_driver_error(error)
            raise
        if remapped and self.share.get("model") is model:
            self.share["valid"] = False  # as after release_physical
        if model.freed:
            raise Violation("defragment of a freed tensor did not raise")
        sizes = [d.size for d in model.data]
        one = model.obj.segments_backed_by_one_chunk(sizes)
        for i, (size, single) in enumerate(zip(sizes, one)):
            if size and not single:
                raise Violation(f"segment {i} ({size} bytes) is not one chunk after defragment")
        return f"remapped {remapped}"

    def et_free(self, slot, fault=None):
        model = self._et(slot)
        if model is None:
            return "no tensor"
        try:
            with self._fault(fault):
                model.obj.free()
        except DOCUMENTED as error:
            model.dirty = model.dirty or _is_driver_error(error)
            raise
        except KeyboardInterrupt:
            model.dirty = True
            _finishes(model.obj.free, "free()")
            raise
        finally:
            # free() is "I am done" even when a release fails: a second call finishes it.
            # The model keeps the bytes: exports taken before read them still.
            model.freed = True
        return "freed"

    def et_drop(self, slot, fault=None):
        model = self._et(slot)
        if model is None:
            return "no tensor"
        model.dropped = True
        del self.ets[slot]
        with self._deferred(fault) as reported:  # an unfreed tensor releases itself
            model.obj = None
        return f"dropped, {len(reported)} deferred"

    # -- interrupts at random instants (a timer signal) ---------------------------------------
    def et_timer(self, slot, action, delay_us, fraction, zero_new, then_free):
        """``action`` on the tensor with the timer signal due after ``delay_us``: completed, or
        interrupted anywhere, the tensor reads as the action's before or after (sizes all or
        nothing, committed bytes kept), the driver's books hold, and the tensor stays
        usable (the machine goes on with it) or, with ``then_free``, frees at once."""
        model = self._et(slot)
        if model is None or model.freed:
            return "no live tensor"
        obj = model.obj
        old = [d.size for d in model.data]
        new = [o + int((c - o) * fraction) for o, c in zip(old, model.capacities)]
        if action == "grow":
            call = lambda: obj.resize_segments_(new, zero_new=zero_new)  # noqa: E731
        elif action == "copy":
            view = obj.segment_view(0)
            call = lambda: np.from_dlpack(view, copy=True, device="cpu")  # noqa: E731
        elif action == "export":
            call = obj.segment_view(0).to_numpy if self.device == "cpu" else obj.full_view
        else:
            call = getattr(obj, action)
        with contextlib.suppress(KeyboardInterrupt):
            _TIMER.run(delay_us, call)
        fired = _TIMER.fired
        sizes = list(obj.committed_sizes)
        if action == "free":
            model.freed = True
            if fired:
                model.dirty = True
                _finishes(obj.free, "free()")
        elif action == "grow" and sizes == new:
            model.grow(new, zero_new)
        elif action == "release_physical" and (fired and not any(sizes) or not fired):
            self._after_release_physical(model, failed=fired)
        elif sizes != old:
            raise Violation(f"{action} interrupted at {delay_us} us left sizes {sizes} (was {old})")
        model.dirty = model.dirty or fired
        if then_free and not model.freed:
            model.freed = True
            _finishes(obj.free, "free()")
        return f"{action} {'interrupted' if fired else 'completed'}"

    def pool_timer(self, slot, action, delay_us, rows, seed):
        """A pool's copy or close with the timer signal due: a close finishes on the next
        call; a copy is done or not (the model drops the oldest result it checks)."""
        state = self.pools.get(slot)
        if state is None or state["closed"]:
            return "no open pool"
        pool = state["obj"]
        if action == "close":
            try:
                _TIMER.run(delay_us, pool.close)
            except KeyboardInterrupt:
                _finishes(pool.close, "UvaBufferPool.close()")
            state["closed"] = True
            return f"closed{', interrupted' if _TIMER.fired else ''}"
        x = np.random.default_rng(seed).integers(-100, 100, size=(rows, state["cols"]))
        x = x.astype(state["dtype"])
        with contextlib.suppress(KeyboardInterrupt):
            _TIMER.run(delay_us, pool.copy_to_uva, x)
        state["calls"] += 1  # copied or not: its result is not checked
        return f"copy {'interrupted' if _TIMER.fired else 'completed'}"

    def swt_timer(self, slot, action, delay_us):
        state = self.swts.get(slot)
        if state is None or state["freed"]:
            return "no live tensor"
        obj = state["obj"]
        with contextlib.suppress(KeyboardInterrupt):
            _TIMER.run(delay_us, obj.free if action == "free" else obj.apply_write)
        if action == "free":
            state["freed"], state["staged"] = True, []
            if _TIMER.fired:
                _finishes(obj.free, "StagedWriteTensor.free()")
        elif _TIMER.fired:
            self._resync_swt(state)
        else:
            for row, start, values in state["staged"]:
                state["target"][row, start : start + values.size] = values
            state["staged"] = []
        return f"{action} {'interrupted' if _TIMER.fired else 'completed'}"

    def uva_timer(self, action, delay_us, rows):
        """A UvaBuffer made, exported and freed with the timer signal due in one of the
        three: an interrupted constructor leaves nothing (checked at the end of the
        example), an interrupted free() finishes on the next call."""
        jaxbuf = self.jaxbuf
        make = functools.partial(jaxbuf.UvaBuffer, (rows, 64), "int32", self.device)
        make = functools.partial(make, driver=self.driver)
        if action == "create":
            try:
                buf = _TIMER.run(delay_us, make)
            except KeyboardInterrupt:
                return "create interrupted"
        else:
            buf = make()
        buf.np[...] = np.arange(buf.np.size, dtype=np.int32).reshape(buf.np.shape)
        held = buf.view.to_numpy() if self.device == "cpu" else buf.view.to_torch()
        try:
            if action == "export":
                _TIMER.run(delay_us, lambda: np.from_dlpack(buf.view, copy=True, device="cpu"))
            elif action == "free":
                _TIMER.run(delay_us, buf.free)
        except KeyboardInterrupt:
            pass
        _finishes(buf.free, "UvaBuffer.free()")
        expected = np.arange(buf.shape[0] * 64, dtype=np.int32)
        actual = held if self.device == "cpu" else held.cpu().numpy()
        if not np.array_equal(np.asarray(actual).reshape(-1), expected):
            raise Violation("an export of a UvaBuffer lost its bytes after an interrupt")
        return f"{action} {'interrupted' if _TIMER.fired else 'completed'}"

    # -- a second thread exporting while this one frees or closes ------------------------------
    def close_racing(self, owner, how, size_kib):
        """A UvaBuffer's free(), an ImportedBuffer's close() or an ExtensibleTensor's
        free() on this thread while another exports its view in a loop, zero-copy or as
        copies: the exporter ends in ClosedError (a RuntimeError) or success, never a
        signal, and every array it made reads the owner's bytes."""
        from jaxbuf.sharing import ImportedBuffer, export_layout

        if self.device != "cpu" and how == "numpy":
            return "numpy imports host memory only"
        jaxbuf, size = self.jaxbuf, size_kib * 1024
        pattern = (np.arange(size, dtype=np.int64) % 251).astype(np.uint8)
        source = None
        if owner == "uva":
            obj = jaxbuf.UvaBuffer(size, "uint8", self.device, driver=self.driver)
            obj.np[...] = pattern
            view, close = obj.view, obj.free
        else:
            source = jaxbuf.ExtensibleTensor(size, device=self.device, driver=self.driver)
            source.resize_per_segment_(size)
            self._write_view(source.segment_view(0), 0, pattern)
            view, close = source.segment_view(0), source.free
            if owner == "import":
                if self.device != "cpu":
                    return "imports are CPU only here"
                layout, fds = export_layout(source)
                obj = ImportedBuffer(layout, list(fds))
                view, close = obj.segment_view(0), obj.close
        arrays, errors = self._race(view, how, close)
        if source is not None:
            source.free()
        if errors and not isinstance(errors[0], RuntimeError):
            raise Violation(f"an export racing {owner}'s close raised {errors[0]!r}")
        for array in arrays:
            actual = self._export_bytes(Export(None, _kind(how), array, 0, 0, None, True))
            if not np.array_equal(actual, pattern):
                raise Violation(f"an array exported ({how}) while {owner} closed lost its bytes")
        return f"{len(arrays)} exported, {'refused' if errors else 'not refused'}"

    def _race(self, view, how, close):
        """Export ``view`` (``how``) in a loop on a second thread while ``close()`` runs
        here: the arrays made and the exporter's error, if any."""
        arrays, errors = [], []
        export = {
            "numpy": view.to_numpy,
            "torch": lambda: view.to_torch(),
            "jax": lambda: view.to_jax(),
            "np_copy": lambda: np.from_dlpack(view, copy=True, device="cpu"),
            "dlpack_copy": lambda: _torch_copy(view),
        }[how]

        started = threading.Event()

        def exporter():
            started.set()
            try:
                for _ in range(50):
                    arrays.append(export())
            except BaseException as error:  # noqa: BLE001 - judged by the caller
                errors.append(error)

        thread = threading.Thread(target=exporter)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the race window is a few bytecodes
        try:
            thread.start()
            started.wait()  # the close lands among the exports, not before the first
            close()
        finally:
            thread.join()
            sys.setswitchinterval(interval)
        return arrays, errors

    # -- mapping listeners that call back into their buffer ------------------------------------
    def et_listener(self, slot, call, trigger, fraction):
        """A listener that, every time it is told, calls ``call`` on its own buffer: each
        call is refused by name (RuntimeError, "from its mapping listener") with nothing
        changed, and the change it was told of (``trigger``) completes as without it."""
        model = self._et(slot)
        if model is None or model.freed:
            return "no live tensor"
        obj = model.obj
        listener = _Reentrant(obj, call, model.capacities)
        try:
            obj.add_mapping_listener(listener)
            if trigger == "grow":
                old = [d.size for d in model.data]
                new = [o + int((c - o) * fraction) for o, c in zip(old, model.capacities)]
                obj.resize_segments_(new)
                model.grow(new, False)
            elif trigger == "release_physical":
                obj.release_physical()
                self._after_release_physical(model, failed=False)
            elif trigger == "defragment":
                obj.defragment()
        except DOCUMENTED as error:
            if trigger == "defragment" and isinstance(error, ValueError):
                raise  # two segments share a granule: refused before anything changes
            raise Violation(f"{trigger} with a re-entrant listener raised {error!r}") from None
        finally:
            obj.remove_mapping_listener(listener)
        if listener.errors:
            raise Violation(f"a listener's {call} was not refused by name: {listener.errors}")
        return f"{listener.refused} call(s) refused"

    # -- exports -----------------------------------------------------------------------------
    def drop_export(self, index, fault=None):
        if not self.exports:
            return "none"
        export = self.exports.pop(index % len(self.exports))
        with self._deferred(fault) as reported:
            export.obj = None
        return f"dropped {export.kind}, {len(reported)} deferred"

    def collect(self, fault=None):
        with self._deferred(fault) as reported:
            gc.collect()
        return f"collected, {len(reported)} deferred"

    @contextlib.contextmanager
    def _deferred(self, fault):
        """Arms ``fault`` around code that only runs finalizers and DLPack deleters (a drop,
        a collection). Nothing may raise there, or go to ``sys.unraisablehook``; a release that
        fails is queued and reported once, by a ResourceWarning saying it is retried (at most
        one per fault that fired), never as a leak."""
        unraisable = []
        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        fired = self.driver.faults_injected
        reports: list[str] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with self._fault(fault):
                        yield reports
                except BaseException as error:  # noqa: BLE001 - reported as the violation
                    raise Violation(f"a drop raised {error!r}") from None
        finally:
            sys.unraisablehook = hook
        for report in unraisable:
            # An interrupt in a finalizer goes where Python sends any exception raised there
            # (its release queued for a retry, reported below); nothing else may.
            if not (_TIMER.step_interruptible and isinstance(report.exc_value, KeyboardInterrupt)):
                raise Violation(f"a finalizer raised {report.exc_value!r} (ignored)")
        reports += [
            str(w.message)
            for w in caught
            if issubclass(w.category, ResourceWarning) and str(w.message).startswith("jaxbuf")
        ]
        fired = self.driver.faults_injected - fired
        for report in reports:
            if "retried" not in report:
                raise Violation(f"a failed deferred release was lost: {report}")
        if len(reports) > fired:
            raise Violation(f"{len(reports)} deferred release(s) reported, {fired} fault(s)")
        self.deferred += len(reports)

    def _check_export(self, export: Export) -> None:
        if not export.valid:
            return
        model = export.owner
        if export.full and export.zero_copy:
            expected, known = model.full_image(copy=False)
        elif export.full:
            expected, known = export.snapshot
        elif export.zero_copy:
            expected = model.data[export.segment][: export.nbytes]
            known = model.known[export.segment][: export.nbytes]
            if expected.size < export.nbytes:
                raise Violation(f"{export.kind} export outlived its committed bytes")
        else:
            expected, known = export.snapshot
        actual = self._export_bytes(export)
        if actual.size != export.nbytes:
            raise Violation(f"{export.kind} export has {actual.size} bytes, not {export.nbytes}")
        if np.array_equal(actual, expected):
            return
        bad = np.flatnonzero((actual != expected) & known)
        if bad.size:
            raise Violation(
                f"{export.kind} export of segment {export.segment} differs from the model at "
                f"{bad.size} byte(s), first at {bad[0]}: {actual[bad[0]]} != {expected[bad[0]]}"
            )

    # -- UVA pools ----------------------------------------------------------------------------
    def pool_create(self, slot, rows, cols, dtype, max_concurrency, uva, framework):
        if slot in self.pools:
            return "slot taken"
        jaxbuf = self.jaxbuf
        buffer_cls = jaxbuf.UvaBuffer if uva else jaxbuf.NonUvaBuffer
        framework = {"fw": self.framework}.get(framework, framework)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pool = jaxbuf.UvaBufferPool(
                (rows, cols),
                dtype,
                max_concurrency,
                device=self.device,
                buffer_cls=buffer_cls,
                framework=framework,
                driver=self.driver,
            )
        self.pools[slot] = {
            "obj": pool,
            "cols": cols,
            "dtype": np.dtype(dtype),
            "k": max_concurrency,
            "results": [],  # (call index, object, expected)
            "calls": 0,
            "closed": False,
            "framework": framework,
        }
        return f"pool {framework} {'uva' if uva else 'nonuva'}"

    def pool_copy(self, slot, rows, seed, as_kind, fault=None):
        state = self.pools.get(slot)
        if state is None:
            return "no pool"
        rng = np.random.default_rng(seed)
        x = rng.integers(-100, 100, size=(rows, state["cols"])).astype(state["dtype"])
        source = x if as_kind == "numpy" else x.tolist()
        try:
            with self._fault(fault):
                result = state["obj"].copy_to_uva(source)
        except KeyboardInterrupt:
            # Whether the copy took its slot is unknown: the oldest result still checked
            # may have been overwritten, so the model stops checking it.
            state["calls"] += 1
            raise
        if state["closed"]:
            raise Violation("copy_to_uva on a closed pool did not raise")
        if state["framework"] == "view":
            # A view of a slot raises at export once growth or close() replaced the slot;
            # the array exported now keeps the slot's memory, as every export does.
            result = result.to_numpy() if self.device == "cpu" else result.to_torch()
        state["calls"] += 1
        state["results"].append((state["calls"], result, x))
        return f"{rows} rows"

    def pool_close(self, slot, fault=None):
        state = self.pools.get(slot)
        if state is None:
            return "no pool"
        try:
            with self._fault(fault):
                state["obj"].close()
        except KeyboardInterrupt:
            _finishes(state["obj"].close, "UvaBufferPool.close()")
            raise
        finally:
            state["closed"] = True
        return "closed"

    def pool_drop(self, slot, fault=None):
        return self._drop(self.pools, slot, fault)

    def _drop(self, objects, slot, fault):
        """Drop the last reference to ``objects[slot]`` with ``fault`` armed (see _deferred)."""
        if objects.get(slot) is None:
            return "none"
        with self._deferred(fault) as reported:
            del objects[slot]
        return f"dropped, {len(reported)} deferred"

    def _result_bytes(self, result, framework) -> np.ndarray:
        if isinstance(result, np.ndarray):
            return np.array(result)
        if framework in ("torch", "view"):
            return result.cpu().numpy()
        import jax.numpy as jnp

        return np.asarray(jnp.array(result, copy=True))

    def _check_pools(self):
        for slot, state in self.pools.items():
            # A slot is written again max_concurrency calls later: the results of the last
            # max_concurrency calls must read what was copied.
            for call, result, expected in state["results"]:
                if call <= state["calls"] - state["k"]:
                    continue
                actual = self._result_bytes(result, state["framework"])
                if actual.shape != expected.shape or not np.array_equal(actual, expected):
                    raise Violation(
                        f"pool {slot}: result of call {call} reads {actual.tolist()}, "
                        f"copied {expected.tolist()}"
                    )

    # -- NonUvaBuffer and its rebindable np ---------------------------------------------------
    def nonuva_create(self, slot, rows, cols, dtype, fault=None):
        if slot in self.nonuvas:
            return "slot taken"
        with self._fault(fault):
            obj = self.jaxbuf.NonUvaBuffer(
                (rows, cols), dtype, device=self.device, driver=self.driver
            )
        zeros = np.zeros((rows, cols), np.dtype(dtype))
        self.nonuvas[slot] = {"obj": obj, "host": zeros.copy(), "device": zeros, "np_ok": True}
        return f"nonuva {rows}x{cols} {dtype}"

    def nonuva_rebind(self, slot, how, seed):
        """Rebind ``np`` (a fresh array of the same shape and dtype, or a smaller, larger,
        differently typed, strided or non-array one), or write into it in place."""
        state = self.nonuvas.get(slot)
        if state is None:
            return "no buffer"
        obj, host = state["obj"], state["host"]
        rng = np.random.default_rng(seed)
        values = rng.integers(-100, 100, size=host.shape).astype(host.dtype)
        if how == "in_place" and state["np_ok"]:
            obj.np[...] = values
            state["host"] = values
            return "written in place"
        other = np.float32 if host.dtype != np.float32 else np.int32
        rebound = {
            "same": lambda: values.copy(),
            "smaller": lambda: values[:-1].copy() if len(values) > 1 else values[:, :0].copy(),
            "larger": lambda: np.concatenate([values, values]),
            "dtype": lambda: values.astype(other),
            "itemsize": lambda: values.astype(np.int8),
            "strided": lambda: np.repeat(values, 2, axis=1)[:, ::2],
            "list": values.tolist,
        }.get(how, values.copy)()
        obj.np = rebound
        # What uva() may copy from: a C-contiguous array of the buffer's shape and dtype.
        state["np_ok"] = (
            isinstance(rebound, np.ndarray)
            and rebound.shape == host.shape
            and rebound.dtype == host.dtype
            and rebound.flags.c_contiguous
        )
        if state["np_ok"]:
            state["host"] = values
        return f"rebound ({how}{'' if state['np_ok'] else ', invalid'})"

    def nonuva_uva(self, slot, n, fault=None):
        """uva(n) copies the first n rows of a valid np; a rebound np of another shape, dtype
        or layout is a clear error (ValueError / TypeError) that copies nothing."""
        state = self.nonuvas.get(slot)
        if state is None:
            return "no buffer"
        obj = state["obj"]
        rows = state["host"].shape[0]
        try:
            with self._fault(fault):
                view = obj.uva(n)
        except FAILURES as error:
            if _is_driver_error(error):
                state["device"] = None  # what was copied is unknown: the model forgets it
                raise
            if isinstance(error, IndexError) and not 0 <= n <= rows:
                raise
            if not state["np_ok"] and isinstance(error, (ValueError, TypeError)) and n:
                _names_argument(error, ("np",))
                raise
            raise Violation(f"uva({n}) raised {error!r}") from None
        if not 0 <= n <= rows:
            raise Violation(f"uva({n}) of {rows} rows did not raise")
        if not state["np_ok"] and n:
            raise Violation(f"uva({n}) copied from a rebound np of {type(obj.np).__name__}")
        if state["device"] is not None:
            state["device"][:n] = state["host"][:n]
        elif n == rows:
            state["device"] = state["host"].copy()
        if self.device == "cpu":
            actual = np.array(view.to_numpy())
        else:
            actual = np.from_dlpack(view, device="cpu", copy=True)
        if not np.array_equal(actual, state["host"][:n]):
            raise Violation(f"uva({n}) reads {actual.tolist()}, np holds {state['host'][:n]}")
        return f"copied {n} rows"

    def nonuva_drop(self, slot, fault=None):
        return self._drop(self.nonuvas, slot, fault)

    def _check_nonuvas(self):
        for slot, state in self.nonuvas.items():
            expected = state["device"]
            if expected is None:
                continue
            actual = self._read_view(state["obj"].view).view(expected.dtype)
            if not np.array_equal(actual.reshape(expected.shape), expected):
                raise Violation(f"nonuva {slot}: device {actual.tolist()} != {expected.tolist()}")

    # -- the CPU driver's quarantine -----------------------------------------------------------
    def quarantine_cycle(self, size_mib, count, headroom_mib, fault=None):
        """Reserve and free ``count`` tensors of ``size_mib`` under an address-space limit of
        what is mapped now plus ``headroom_mib``: freed reservations wait in the quarantine,
        which never makes a reservation fail (ENOMEM drains it) nor outgrows a quarter of the
        limit."""
        import resource

        if self.device != "cpu":
            return "cpu only"
        host = self.driver.inner
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _address_space() + (size_mib + headroom_mib) * MIB
        if soft != resource.RLIM_INFINITY and soft <= limit:
            return "already limited"
        made = 0
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        try:
            with self._fault(fault):
                for _ in range(count):
                    buf = self.jaxbuf.ExtensibleTensor(
                        size_mib * MIB, device="cpu", driver=self.driver
                    )
                    try:
                        buf.resize_per_segment_(4096, zero_new=True)
                    finally:
                        try:
                            buf.free()
                        except DOCUMENTED:
                            buf.free()  # a second call finishes the release
                            raise
                    made += 1
                    parked = host.quarantined[1]
                    if parked > limit // 4:
                        raise Violation(f"{parked} bytes quarantined under a limit of {limit}")
        except DOCUMENTED as error:
            if getattr(error, "error_name", None) == "ENOMEM":
                raise Violation(f"reservation {made + 1} of {count} failed: {error!r}") from None
            raise
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        return f"{made} reserved and freed, {host.quarantined[0]} quarantined"

    # -- StagedWriteTensor ---------------------------------------------------------------------
    def swt_create(self, slot, rows, cols, dtype, uva, fault=None):
        if slot in self.swts:
            return "slot taken"
        backend = "numpy" if self.device == "cpu" else "triton"
        with self._fault(fault):
            obj = self.jaxbuf.StagedWriteTensor(
                (rows, cols),
                dtype,
                device=self.device,
                uva_instead_of_gpu=uva,
                backend=backend,
                driver=self.driver,
            )
        self.swts[slot] = {
            "obj": obj,
            "target": np.zeros((rows, cols), np.dtype(dtype)),
            "staged": [],
            "freed": False,
        }
        return f"swt {rows}x{cols} {dtype}"

    def swt_stage(self, slot, row, start, values, elem, as_kind):
        state = self.swts.get(slot)
        if state is None:
            return "no tensor"
        target = state["target"]
        rows, cols = target.shape
        values = np.asarray(values, target.dtype)
        length = 1 if elem else values.size
        in_bounds = 0 <= row < rows and (elem and cols >= 1 or 0 <= start <= cols - length)
        source = values if as_kind == "numpy" else values.tolist()
        obj = state["obj"]
        try:
            if elem:
                obj.stage_write_elem(row, source[0] if values.size else 0)
            else:
                obj.stage_write(row, start, source)
        except DOCUMENTED as error:
            if state["freed"] and isinstance(error, RuntimeError):
                raise
            if in_bounds and (values.size or elem):
                raise Violation(f"in-bounds write ({row}, {start}) raised {error!r}") from None
            _names_argument(error, (str(row), str(start), "row", "start"))
            raise
        if state["freed"]:
            raise Violation("stage on a freed tensor did not raise")
        if not in_bounds and length:
            raise Violation(f"out-of-bounds write ({row}, {start}, {length}) was accepted")
        if elem:
            state["staged"].append(
                (row, 0, values[:1] if values.size else np.zeros(1, target.dtype))
            )
        elif values.size:
            state["staged"].append((row, start, values))
        return f"staged ({row}, {start})"

    def swt_apply(self, slot, fault=None):
        state = self.swts.get(slot)
        if state is None:
            return "no tensor"
        try:
            with self._fault(fault):
                state["obj"].apply_write()
        except KeyboardInterrupt:
            self._resync_swt(state)
            raise
        if state["freed"]:
            raise Violation("apply_write on a freed tensor did not raise")
        for row, start, values in state["staged"]:
            state["target"][row, start : start + values.size] = values
        state["staged"] = []
        return "applied"

    def swt_clear(self, slot):
        state = self.swts.get(slot)
        if state is None or state["freed"]:
            return "no tensor"
        state["obj"].clear_staged_writes()
        state["staged"] = []
        return "cleared"

    def swt_free(self, slot, fault=None):
        state = self.swts.get(slot)
        if state is None:
            return "no tensor"
        try:
            with self._fault(fault):
                state["obj"].free()
        except KeyboardInterrupt:
            _finishes(state["obj"].free, "StagedWriteTensor.free()")
            raise
        finally:
            state["freed"] = True
            state["staged"] = []
        return "freed"

    def _resync_swt(self, state) -> None:
        """After an interrupted apply the writes are applied or still staged, or (an apply
        cut short part way) partly applied: the model reads the target back, and keeps the
        staged writes only while the tensor does."""
        if state["freed"]:
            return
        obj = state["obj"]
        if obj.num_staged_writes == 0:
            state["staged"] = []
        elif obj.num_staged_writes != len(state["staged"]):
            raise Violation(
                f"an interrupted apply left {obj.num_staged_writes} staged writes of "
                f"{len(state['staged'])}"
            )
        if self.device == "cpu":
            actual = np.array(obj.to_numpy())
        else:
            actual = np.from_dlpack(obj.gpu, device="cpu", copy=True)
        state["target"] = actual.reshape(state["target"].shape)

    def swt_drop(self, slot, fault=None):
        return self._drop(self.swts, slot, fault)

    def _check_swts(self):
        for slot, state in self.swts.items():
            if state["freed"]:
                continue
            obj = state["obj"]
            if obj.num_staged_writes != len(state["staged"]):
                raise Violation(
                    f"swt {slot}: {obj.num_staged_writes} staged writes, model has "
                    f"{len(state['staged'])}"
                )
            if self.device == "cpu":
                actual = np.array(obj.to_numpy())
            else:
                actual = np.from_dlpack(obj.gpu, device="cpu", copy=True)
            actual = actual.reshape(state["target"].shape)
            if not np.array_equal(actual, state["target"]):
                raise Violation(
                    f"swt {slot}: target {actual.tolist()} != {state['target'].tolist()}"
                )

    # -- JAX StagedWrites ---------------------------------------------------------------------
    def sw_create(self, slot, rows, cols, dtype):
        import jax.numpy as jnp

        from jaxbuf.jax_ops import StagedWrites

        if slot in self.staged:
            return "slot taken"
        self.staged[slot] = {
            "obj": StagedWrites(rows, cols, dtype),
            "array": jnp.zeros((rows, cols), dtype),
            "target": np.zeros((rows, cols), np.dtype(dtype)),
            "staged": [],
        }
        return f"staged writes {rows}x{cols} {dtype}"

    def sw_stage(self, slot, writes, batch):
        state = self.staged.get(slot)
        if state is None:
            return "no staged writes"
        target = state["target"]
        rows, cols = target.shape
        writes = [(r, s, np.asarray(v, target.dtype)) for r, s, v in writes]
        in_bounds = all(0 <= r < rows and s >= 0 and s + v.size <= cols for r, s, v in writes)
        obj = state["obj"]
        try:
            if batch:
                obj.stage_writes(
                    [w[0] for w in writes], [w[1] for w in writes], [w[2] for w in writes]
                )
            else:
                for r, s, v in writes:
                    obj.stage_write(r, s, v)
        except DOCUMENTED as error:
            if in_bounds:
                raise Violation(f"in-bounds writes {writes} raised {error!r}") from None
            _names_argument(error, ("row", "start", "values", "out of range", "fit"))
            if not batch:
                # One write at a time: the ones before the bad one are staged.
                for r, s, v in writes:
                    if not (0 <= r < rows and s >= 0 and s + v.size <= cols):
                        break
                    if v.size:
                        state["staged"].append((r, s, v))
            raise
        if not in_bounds:
            raise Violation(f"out-of-bounds writes {writes} were accepted")
        state["staged"].extend(w for w in writes if w[2].size)
        return f"{len(writes)} write(s)"

    def sw_apply(self, slot, how, bad_table, fault=None):
        import jax.numpy as jnp

        from jaxbuf.jax_ops import PackRing, apply_staged_writes

        state = self.staged.get(slot)
        if state is None:
            return "no staged writes"
        array = state["array"]
        if bad_table:
            # Tables of another rank or another dtype must be refused before anything is
            # consumed. Only a packed table goes to a bad table: ring.apply(bad, staged)
            # packs first (the invariant "a refused apply keeps the staged writes" is
            # being fixed), and tables smaller than the staged shape are not refused yet.
            table = jnp.zeros((1,) + array.shape, array.dtype)
        else:
            table = array
        packed = None
        with self._fault(fault):
            try:
                if how == "ring":
                    if self.ring is None:
                        self.ring = PackRing(2, device=self.device, driver=self.driver)
                    packed = state["obj"].pack(ring=self.ring)
                else:
                    packed = state["obj"].pack()
                # pack() consumed the staged writes: they live in `packed` now.
                applied, state["staged"] = list(state["staged"]), []
                if how == "ring":
                    result = self.ring.apply(table, packed)
                else:
                    result = apply_staged_writes(table, packed)
            except FAILURES as error:
                if packed is not None and not bad_table and not _is_driver_error(error):
                    raise Violation(
                        f"apply of a pack onto its own table raised {error!r}"
                    ) from None
                if table is array and array.is_deleted():
                    raise Violation(f"a failed apply ({error!r}) lost the donated array") from None
                raise
        if bad_table:
            raise Violation(f"apply onto a table of shape {table.shape} did not raise")
        for r, s, v in applied:
            state["target"][r, s : s + v.size] = v
        state["array"] = result
        return f"applied {len(applied)}"

    def _check_staged(self):
        for slot, state in self.staged.items():
            if state["obj"].num_staged_writes != len(state["staged"]):
                raise Violation(
                    f"staged {slot}: {state['obj'].num_staged_writes} staged, model has "
                    f"{len(state['staged'])}"
                )
            actual = np.asarray(state["array"])
            if not np.array_equal(actual, state["target"]):
                raise Violation(f"staged {slot}: {actual.tolist()} != {state['target'].tolist()}")

    def ring_close(self):
        if self.ring is None:
            return "no ring"
        self.ring.close()
        self.ring = None
        return "closed"

    # -- sharing with a second process ------------------------------------------------------
    def share_send(self, slot, since):
        """send_buffer to the importer process, which recv_buffer()s (a new import) or
        refresh()es (the same tensor again). CPU only: the importer reads through numpy."""
        from jaxbuf.sharing import send_buffer

        if self.device != "cpu":
            return "cpu only"
        model = self._et(slot)
        if model is None:
            return "no tensor"
        share = self.share
        same = share.get("model") is model and share.get("sizes") is not None
        previous = share.get("layout") if since and same else None
        layout = send_buffer(_importer_socket(), model.obj, since=previous, timeout=30)
        if model.freed:
            raise Violation("send_buffer of a freed tensor did not raise")
        reply = _importer().call("refresh" if same else "recv")
        if reply[0] != "ok":
            raise Violation(f"the importer refused a valid layout: {reply}")
        share.update(model=model, layout=layout, sizes=reply[1], valid=True)
        return f"importer sizes {reply[1]}"

    def share_hostile(self, mutation):
        """A malformed layout, well framed: the importer refuses it by name, unchanged."""
        from jaxbuf.sharing import export_layout, send_layout

        model = self.share.get("model")
        if model is None or model.freed or model.dropped:
            return "nothing shared"
        layout, fds = export_layout(model.obj)
        try:
            layout = _hostile(layout, mutation, len(fds))
            if mutation == "extra_fd" and fds:
                fds.append(os.dup(fds[0]))
            send_layout(_importer_socket(), layout, fds, timeout=30)
        finally:
            for fd in fds:
                os.close(fd)
        same = self.share.get("sizes") is not None
        reply = _importer().call("refresh" if same else "recv", expect_error=True)
        if reply[0] == "violation":
            raise Violation(f"hostile layout ({mutation}): {reply[1]}")
        if not same:
            self.share["sizes"] = None  # a failed recv leaves no import
        return f"refused: {reply[2][:80]}"

    def share_read(self):
        share = self.share
        if not share.get("valid") or share.get("sizes") is None:
            return "nothing to compare"
        reply = _importer().call("read")
        if reply[0] != "ok":
            raise Violation(f"the importer could not read: {reply}")
        model = share["model"]
        for i, data in enumerate(reply[1]):
            actual = np.frombuffer(data, np.uint8)
            expected, known = model.data[i][: actual.size], model.known[i][: actual.size]
            if expected.size < actual.size:
                raise Violation(f"the import's segment {i} outgrew the owner's")
            bad = np.flatnonzero((actual != expected) & known)
            if bad.size:
                raise Violation(f"the import's segment {i} differs from the owner at {bad[0]}")
        return "same bytes"

    def share_write(self, segment, offset, data):
        share = self.share
        sizes = share.get("sizes")
        if not share.get("valid") or not sizes:
            return "nothing shared"
        segment %= len(sizes)
        if not sizes[segment]:
            return "empty segment"
        offset %= sizes[segment]
        data = data[: sizes[segment] - offset]
        reply = _importer().call("write", segment=segment, offset=offset, data=data)
        if reply[0] != "ok":
            raise Violation(f"the importer could not write: {reply}")
        model = share["model"]
        model.data[segment][offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        model.known[segment][offset : offset + len(data)] = True
        return f"{len(data)} bytes at {offset}"

    def share_close(self):
        if self.share.get("sizes") is None:
            return "nothing imported"
        _importer().call("close")
        self.share["sizes"] = None
        return "closed"

    # -- faults and invariants ----------------------------------------------------------------
    def _fault(self, fault):
        return _Armed(self.driver, fault)

    def check(self) -> None:
        problems = self.driver.problems()
        if problems:
            raise Violation("driver invariants: " + "; ".join(problems))
        for model in self.ets.values():
            if model.freed:
                if model.obj.num_bytes != 0:
                    raise Violation(f"freed tensor reports {model.obj.num_bytes} bytes")
                continue
            for i, data in enumerate(model.data):
                view = model.obj.segment_view(i)
                if view.nbytes != data.size:
                    raise Violation(f"segment {i} has {view.nbytes} bytes, model {data.size}")
                if data.size:
                    actual = self._read_view(view)
                    if np.array_equal(actual, data):
                        continue
                    bad = np.flatnonzero((actual != data) & model.known[i])
                    if bad.size:
                        raise Violation(
                            f"segment {i} differs from the model at {bad.size} byte(s), "
                            f"first at {bad[0]}"
                        )
        for export in self.exports:
            self._check_export(export)
        self._check_pools()
        self._check_nonuvas()
        self._check_swts()
        self._check_staged()

    def teardown(self) -> str:
        """Drop every reference; the driver must then hold nothing."""
        self.driver.disarm()
        self.exports.clear()
        self.ets.clear()
        self.pools.clear()
        self.swts.clear()
        self.staged.clear()
        self.ring = None
        self.share = {}
        self.nonuvas.clear()
        gc.collect()
        if self.deferred:
            # A release queued by a finalizer is retried at the next use of its driver.
            self.jaxbuf.ExtensibleTensor(1, device=self.device, driver=self.driver).free()
            gc.collect()
        found = []
        if _IMPORTER is not None and _IMPORTER.alive:
            reply = _IMPORTER.call("reset")
            if reply[0] != "ok":
                found.append(reply[1])
        leaked = _memfds() - self.memfds
        if leaked:
            found.append(f"{len(leaked)} more chunk descriptor(s) open than at the start")
        driver = self.driver
        if driver.live_handles:
            found.append(f"{len(driver.live_handles)} live handle(s)")
        if driver.mapped:
            found.append(f"{len(driver.mapped)} mapped chunk(s)")
        if driver.reservations:
            found.append(f"{len(driver.reservations)} reservation(s)")
        if driver.pinned:
            found.append(f"{len(driver.pinned)} pinned allocation(s)")
        found.extend(driver.problems())
        if self.device == "cpu":
            # The CPU driver is one per process: an example starts with an empty quarantine
            # (hypothesis replays an example and must see the same outcome).
            driver.inner.flush_quarantine()
        if found:
            raise Violation(
                "after every reference was dropped the driver holds " + ", ".join(found)
            )
        return "clean"


_IMPORTER = None
_SOCKET = None


def _importer():
    """The importer process (tests/_share_importer.py), at the other end of a socket pair;
    started on first use, again after it died (then the socket pair is new too)."""
    global _IMPORTER, _SOCKET
    from _child import Worker

    if _IMPORTER is None or not _IMPORTER.alive:
        if _SOCKET is not None:
            _SOCKET.close()
        ours, theirs = socket.socketpair()
        _IMPORTER = Worker(
            Path(__file__).with_name("_share_importer.py"),
            120.0,
            pass_fds=(theirs.fileno(),),
            fd=theirs.fileno(),
            device="cpu",
        )
        try:
            _IMPORTER.ensure()
        finally:
            theirs.close()
        _SOCKET = ours
    return _IMPORTER


def _importer_socket():
    _importer()
    return _SOCKET


def _address_space() -> int:
    """This process's mapped address space (what RLIMIT_AS limits), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _memfds() -> set[str]:
    """The chunk descriptors (memfds) this process holds."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed while listing (the listing's own descriptor)
        if target.startswith("/memfd:"):
            found.add(f"{name}:{target}")
    return found


def _hostile(layout: dict, mutation: str, num_fds: int) -> dict:
    """``layout`` broken as ``mutation`` says (a mutation that needs a chunk, on a layout
    without one, breaks the version instead)."""
    layout = dict(layout)
    chunks = [list(c) for c in layout.get("chunks", [])]
    if mutation == "misaligned" and chunks:
        chunks[0][0] += 1
        layout["chunks"] = layout["all_chunks"] = chunks
    elif mutation == "overlap" and chunks:
        layout["chunks"] = layout["all_chunks"] = chunks + [list(chunks[0])]
    elif mutation == "outside" and chunks:
        chunks[0][0] = layout["reserved_size"]
        layout["chunks"] = layout["all_chunks"] = chunks
    elif mutation == "huge":
        layout["reserved_size"] = 2**62
    elif mutation == "missing":
        layout.pop("committed_sizes", None)
    elif mutation == "wrong_type":
        layout["committed_sizes"] = "all of it"
    elif mutation == "committed_unbacked":
        layout["committed_sizes"] = [c + layout["granularity"] for c in layout["committed_sizes"]]
    elif mutation != "extra_fd" or not num_fds:
        layout["version"] = "not a version"
    return layout


class _Armed:
    """Arms ``fault`` (``(kind, nth)``, ``(kind, nth, "interrupt")``, ``(kind, nth,
    "after")`` or None) on the driver for one step, disarms after. An interrupt fault raises
    ``KeyboardInterrupt`` at that call (a Ctrl-C, or an exception from a signal handler,
    landing there: the call fails); an "after" fault raises SIGINT as the call returns (the
    call done, the Ctrl-C delivered where the library lets it land)."""

    def __init__(self, driver, fault):
        self.driver, self.fault = driver, fault

    def __enter__(self):
        if self.fault is not None:
            kind, nth, *interrupt = self.fault
            if interrupt:
                _TIMER.step_interruptible = True
            if interrupt == ["after"]:
                self.driver.signal_after = [kind, nth]
            else:
                self.driver.fail_on(kind, nth, KeyboardInterrupt() if interrupt else None)

    def __exit__(self, *exc_info):
        self.driver.disarm()
        self.driver.signal_after = None


def _is_driver_error(error: BaseException) -> bool:
    """A DriverError, or an interrupt: the failure of the one driver call it landed in."""
    from jaxbuf.drivers import DriverError

    return isinstance(error, (DriverError, KeyboardInterrupt))


def _finishes(close, what: str) -> None:
    """After an interrupt the object closes cleanly on the next call: ``close()`` (no fault
    armed) must succeed."""
    try:
        close()
    except BaseException as error:  # noqa: BLE001 - reported as the violation
        raise Violation(f"after an interrupt, {what} again raised {error!r}") from None


def _names_argument(error: BaseException, tokens) -> None:
    """A bad-input error's message must name the argument or repeat the value."""
    message = str(error)
    if _is_driver_error(error) or isinstance(error, RuntimeError):
        return
    if not any(token in message for token in tokens):
        raise Violation(f"{type(error).__name__}({message!r}) names none of {tokens}")


class _Reentrant:
    """A mapping listener that calls ``call`` on its own buffer each time it is told."""

    CALLS = {
        "release_physical": lambda buf, _: buf.release_physical(),
        "grow": lambda buf, capacities: buf.resize_segments_(capacities),
        "defragment": lambda buf, _: buf.defragment(),
        "free": lambda buf, _: buf.free(),
        "attach": lambda buf, c: buf.add_mapping_listener(_Reentrant(buf, "free", c)),
    }

    def __init__(self, buf, call, capacities) -> None:
        self.buf, self.call, self.capacities = buf, call, capacities
        self.refused = 0
        self.errors: list[BaseException] = []

    def _told(self) -> None:
        before = (list(self.buf.committed_sizes), self.buf.mapped_chunks())
        try:
            self.CALLS[self.call](self.buf, self.capacities)
        except RuntimeError as error:
            if "from its mapping listener" in str(error):
                self.refused += 1
                return
            self.errors.append(error)
        except ValueError as error:
            if self.call != "defragment":  # segments sharing a granule: refused first
                self.errors.append(error)
        except BaseException as error:  # noqa: BLE001 - reported by et_listener
            self.errors.append(error)
        else:
            # A call with nothing to do (a grow to the sizes it has, a defragment of one chunk
            # per segment) changes nothing: it may go through.
            if self.call == "attach" or before != (
                list(self.buf.committed_sizes),
                self.buf.mapped_chunks(),
            ):
                self.errors.append(f"{self.call} went through")

    def mapped(self, chunks) -> None:
        self._told()

    def unmapping(self, chunks) -> None:
        self._told()


def _kind(how: str) -> str:
    """The Export kind of arrays exported ``how`` (see World._race)."""
    return {"np_copy": "copy", "dlpack_copy": "torch"}.get(how, how)


def _torch_copy(view):
    """A copy through the DLPack protocol itself: ``__dlpack__(copy=True)``, imported."""
    import torch

    return torch.from_dlpack(view.__dlpack__(copy=True))


class _Timer:
    """A ``SIGALRM`` handler that raises ``KeyboardInterrupt`` once, at a random instant of
    the one library call :meth:`run` times (what a Ctrl-C, or any signal handler that
    raises, does).

    Where it lands: anywhere in the library's Python code up to its first driver call, then
    at the entry of a later driver call (before the call has any effect, as an injected
    fault does). A signal that arrives during a driver call or after one returned waits for
    the next call's entry. CPython cannot do better for any code: an exception from a signal
    handler that lands between a call's return and the caller's record of it (a release
    done, not yet forgotten) is indistinguishable from one the call raised, and no Python
    code can make the two atomic (see the signal module's note on handlers that raise);
    that window is left out, so the verdict does not depend on timing. The handler raises
    only while the timed call runs: the model's own code is never interrupted.
    """

    def __init__(self) -> None:
        self.live = False  # the timed call is running
        self.books = 0  # the main thread is inside a driver call
        self.called = False  # a driver call of the timed call has returned
        self.pending = False  # a signal arrived since: raised at the next call's entry
        self.fired = False
        self.step_interruptible = False  # this step armed an interrupt (timer or fault)
        signal.signal(signal.SIGALRM, self._handler)

    def _handler(self, signum, frame) -> None:
        if not self.live:
            return
        if self.books or self.called:
            self.pending = True
            return
        self.fire()

    def fire(self) -> None:
        self.live = self.pending = False
        self.fired = True
        raise KeyboardInterrupt("the timer signal")

    def run(self, delay_us: int, call, *args):
        """``call(*args)`` with the signal due ``delay_us`` microseconds from now; what it
        returns, or the KeyboardInterrupt (``fired`` tells) or error it raised."""
        self.fired = self.pending = self.called = False
        self.step_interruptible = True
        self.live = True
        try:
            signal.setitimer(signal.ITIMER_REAL, delay_us / 1e6)
            return call(*args)
        finally:
            self.live = self.pending = False
            signal.setitimer(signal.ITIMER_REAL, 0)


_TIMER = _Timer()
_MAIN_THREAD = threading.get_ident()
signal.signal(signal.SIGINT, signal.default_int_handler)  # a Ctrl-C raises, as in a shell


def _signal_after(driver, kind: str) -> None:
    """An "after" fault: SIGINT raised just as the armed call returned, so the Ctrl-C lands
    where one during a slow driver call does (held back by the library's deferred blocks,
    where it records what the call made or released)."""
    armed = driver.signal_after
    if armed is not None and armed[0] == kind and threading.get_ident() == _MAIN_THREAD:
        armed[1] -= 1
        if not armed[1]:
            driver.signal_after = None
            signal.raise_signal(signal.SIGINT)


@functools.cache
def _interruptible_driver():
    """The fault-injecting driver whose calls the timer interrupts at their entry only (see
    :class:`_Timer`); its books always match the memory."""
    from jaxbuf.testing import FAULT_KINDS, FaultInjectingDriver

    def deferring(method, kind):
        def call(self, *args, **kwargs):
            timer = _TIMER
            if threading.get_ident() != _MAIN_THREAD or not timer.live:
                result = method(self, *args, **kwargs)
                _signal_after(self, kind)
                return result
            if timer.pending and not timer.books:
                timer.fire()  # before the call: it has no effect
            timer.books += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                timer.books -= 1
                timer.called = True

        return call

    methods = {
        kind: deferring(getattr(FaultInjectingDriver, kind), kind)
        for kind in FAULT_KINDS
        if kind in FaultInjectingDriver.__dict__
    }
    methods["signal_after"] = None  # [kind, calls left]: armed by an "after" fault
    return type("InterruptibleDriver", (FaultInjectingDriver,), methods)


# -- the protocol ---------------------------------------------------------------------------
_world: World | None = None


def handle(op: str, kwargs: dict):
    """One request of the runner: ``start``, ``reset`` or a step (a World method)."""
    global _world
    try:
        if op == "start":
            _world = World(**kwargs)
            if kwargs["framework"] == "torch":
                import torch  # noqa: F401
            else:
                import jax  # noqa: F401
            # What the imports made lives as long as the process: freezing it keeps each
            # gc.collect() of a step to the objects the steps made.
            gc.collect()
            gc.freeze()
            return ("ok", "started")
        if op == "reset":
            old, _world = _world, World(device=_world.device, framework=_world.framework)
            return ("ok", old.teardown())
        _TIMER.step_interruptible = False
        try:
            reply = ("ok", getattr(_world, op)(**kwargs))
        except DOCUMENTED as error:
            reply = ("raised", type(error).__name__, str(error))
            if not str(error):
                reply = ("violation", f"{type(error).__name__} with an empty message")
        except KeyboardInterrupt as error:
            if not _TIMER.step_interruptible:
                raise
            reply = ("raised", "KeyboardInterrupt", str(error) or "an injected interrupt")
        _world.check()
        return reply
    except Violation as violation:
        return ("violation", str(violation))
    except BaseException as error:  # noqa: BLE001 - reported to the runner as a failure
        return ("violation", "undocumented " + "".join(traceback.format_exception(error)))


if __name__ == "__main__":
    from _child import serve

    serve(handle)
