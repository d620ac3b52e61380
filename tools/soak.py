"""Leak soak: many create/grow/view/release/free cycles, then check nothing stayed behind.

One cycle on a device:

* an :class:`~jaxbuf.ExtensibleTensor` with 2 segments (2 MiB reserved, both segments in
  one granule; 4 MiB, a granule each, on framework cycles) grown in three steps with
  ``zero_new`` (the new bytes are checked to read zero), a write and read-back of both
  segments (driver ``memset`` + ``copy`` into a pinned host block), ``release_physical``
  and a recommit (checked to read zero again), ``free``;
* every ``--every`` cycles also: torch views and a JAX view of the segments (checked
  against the written bytes), a :class:`~jaxbuf.UvaBufferPool` made, used for copies that
  grow a slot (``copy_to_uva`` read back, ``copy_to_gpu``) and closed, and a
  :class:`~jaxbuf.StagedWriteTensor` made, staged, applied twice, checked against a numpy
  model and freed.

Every driver call goes through :class:`jaxbuf.testing.FaultInjectingDriver` with no fault
armed (or, without that module, :class:`CountingDriver`), so live handles (chunks,
reservations, mapped chunks, pinned host blocks, events) are known exactly. After
``--warmup`` cycles (first uses fill caches: JAX, torch, the staging writer) the script
measures host RSS, open file descriptors, ``/proc/self/maps`` lines, live driver handles and
(CUDA) used device memory; runs ``--cycles`` cycles; measures again; and checks every metric
is back at its start within :data:`TOLERANCES`. Exit status 0 when all pass, 1 otherwise.

    python tools/soak.py --device cpu                  # 100,000 cycles
    python tools/soak.py --device cuda --json soak.json  # 10,000 cycles
    python tools/soak.py --cycles 2000 --every 50 --quiet  # a quick look
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from jaxbuf.drivers.base import VmmDriver

#: Default cycle counts (100,000 CPU cycles, 10,000 GPU cycles: the full soak).
DEFAULT_CYCLES = {"cpu": 100_000, "cuda": 10_000}

#: Allowed end-minus-start growth of each metric. Handles and descriptors must match
#: exactly; RSS and mappings get a constant slack (allocator arenas, interpreter caches)
#: far below what a per-cycle leak over thousands of cycles would add. Used device memory
#: may not grow by more than one granule (the CUDA driver's own bookkeeping pages).
MIB = 1 << 20
TOLERANCES = {
    "rss_bytes": 16 * MIB,
    "open_fds": 0,
    "mappings": 8,
    "live_handles": 0,
    "device_used_bytes": 2 * MIB,
}

# (reserved bytes, bytes per segment after each grow). Each chunk the CPU driver creates is
# a 2 MiB granule zero-filled by fallocate (about 0.7 ms here), so plain cycles keep both
# segments in one shared granule (one chunk per commit); framework cycles take one granule
# per segment and fill it (two chunks per commit).
_LAYOUT_PLAIN = (2 * MIB, (4096, 64 * 1024, 256 * 1024))
_LAYOUT_FULL = (4 * MIB, (4096, 64 * 1024, 2 * MIB))
_RECOMMIT = (8192, 4096)
_PROBE = 4096  # bytes read back per check


# -- the counting driver -----------------------------------------------------------------
class CountingDriver(VmmDriver):
    """Delegates every call to ``inner``; counts what is created minus what is freed.

    ``live`` maps a kind (``chunk``, ``reservation``, ``host``, ``event``) to the number
    alive; ``calls`` counts calls by name.
    """

    def __init__(self, inner: VmmDriver) -> None:
        self.inner = inner
        self.platform = inner.platform
        self.dlpack_device_type = inner.dlpack_device_type
        self.dlpack_host_device_type = inner.dlpack_host_device_type
        self.live: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"CountingDriver({self.inner!r})"

    @property
    def live_handles(self) -> int:
        return sum(self.live.values())

    def _call(self, name: str, *args: Any) -> Any:
        self.calls[name] += 1
        return getattr(self.inner, name)(*args)

    def unavailable_reason(self):
        return self.inner.unavailable_reason()

    def device_count(self):
        return self.inner.device_count()

    def ensure_context(self, device_index):
        return self._call("ensure_context", device_index)

    def granularity(self, device_index):
        return self._call("granularity", device_index)

    def reserve(self, size, alignment=0):
        ptr = self._call("reserve", size, alignment)
        self.live["reservation"] += 1
        return ptr

    def free_reserved(self, ptr, size):
        self._call("free_reserved", ptr, size)
        self.live["reservation"] -= 1

    def create(self, size, device_index):
        handle = self._call("create", size, device_index)
        self.live["chunk"] += 1
        return handle

    def release(self, handle):
        self._call("release", handle)
        self.live["chunk"] -= 1

    def map(self, ptr, size, handle):
        return self._call("map", ptr, size, handle)

    def unmap(self, ptr, size):
        return self._call("unmap", ptr, size)

    def set_access(self, ptr, size, device_index):
        return self._call("set_access", ptr, size, device_index)

    def memset(self, ptr, value, size, device_index):
        return self._call("memset", ptr, value, size, device_index)

    def copy(self, dst, src, size, device_index):
        return self._call("copy", dst, src, size, device_index)

    def synchronize(self, device_index):
        return self._call("synchronize", device_index)

    def record_ready_event(self, device_index):
        event = self._call("record_ready_event", device_index)
        if event is not None:
            self.live["event"] += 1
        return event

    def record_event(self, stream, device_index):
        event = self._call("record_event", stream, device_index)
        if event is not None:
            self.live["event"] += 1
        return event

    def destroy_event(self, event):
        self._call("destroy_event", event)
        if event is not None:
            self.live["event"] -= 1

    def stream_wait_event(self, stream, event, device_index):
        return self._call("stream_wait_event", stream, event, device_index)

    def event_query(self, event):
        return self._call("event_query", event)

    def event_synchronize(self, event):
        return self._call("event_synchronize", event)

    def host_alloc(self, size, device_index):
        ptrs = self._call("host_alloc", size, device_index)
        self.live["host"] += 1
        return ptrs

    def host_free(self, host_ptr):
        self._call("host_free", host_ptr)
        self.live["host"] -= 1

    def memory_info(self, device_index):
        return self._call("memory_info", device_index)


def counting_driver(inner: VmmDriver) -> VmmDriver:
    """``inner`` wrapped so that live driver handles are counted (``live_handles``).

    :class:`jaxbuf.testing.FaultInjectingDriver` (no faults armed) when that module exists
    and tracks live handles, else :class:`CountingDriver`.
    """
    try:
        from jaxbuf.testing import FaultInjectingDriver  # type: ignore[import-not-found]

        driver = FaultInjectingDriver(inner)
    except (ImportError, TypeError):
        return CountingDriver(inner)
    return driver if hasattr(driver, "live_handles") else CountingDriver(inner)


# -- metrics -----------------------------------------------------------------------------
def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # pragma: no cover - psutil is a test dependency
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # minus listdir's own descriptor


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return maps.read().count(b"\n")


def live_counts(driver: Any) -> dict[str, int]:
    """Live driver objects by kind: physical chunks, reservations, pinned host blocks and
    events (and, from a :class:`~jaxbuf.testing.FaultInjectingDriver`, mapped chunks)."""
    if isinstance(driver, CountingDriver):
        return {kind: driver.live[kind] for kind in ("chunk", "reservation", "host", "event")}
    return {
        "chunk": len(driver.live_handles),
        "reservation": len(driver.reservations),
        "mapped": len(driver.mapped),
        "host": len(driver.pinned),
        "event": len(driver.live_events),
    }


def measure(driver: Any, device_index: int, own_handles: int = 0) -> dict[str, int | None]:
    """The metrics now (after a full garbage collection); ``own_handles`` (the caller's
    own live handles) are not counted."""
    gc.collect()
    gc.collect()
    inner = getattr(driver, "inner", driver)
    info = inner.memory_info(device_index) if hasattr(inner, "memory_info") else None
    # The CPU driver parks freed reservations in a bounded quarantine (PROT_NONE ranges, so
    # that a stale view faults); empty it so that mappings compare like for like.
    quarantined = getattr(inner, "quarantined", None)
    if quarantined is not None:
        inner.flush_quarantine()
    return {
        "quarantined_ranges": None if quarantined is None else quarantined[0],
        "rss_bytes": _rss(),
        "open_fds": _open_fds(),
        "mappings": _mappings(),
        "live_handles": sum(live_counts(driver).values()) - own_handles,
        "device_used_bytes": None if info is None else info[1] - info[0],
    }


# -- one cycle ---------------------------------------------------------------------------
class Soak:
    """The objects and helpers a run of cycles shares."""

    def __init__(self, device: str, every: int) -> None:
        import jaxbuf
        from jaxbuf.devices import as_device
        from jaxbuf.drivers import get_vmm_driver

        self.jaxbuf = jaxbuf
        self.device = as_device(device)
        self.inner = get_vmm_driver(self.device)
        self.driver = counting_driver(self.inner)
        self.every = every
        self.cpu = self.device.platform == "cpu"
        self.backend = "numpy" if self.cpu else "triton"
        self.host = 0
        self.ops: collections.Counter[str] = collections.Counter()

    # The pinned host block for read-backs lives from open() to close(), outside the
    # measured window's start and end points.
    def open(self) -> None:
        self.host, _ = self.driver.host_alloc(_PROBE, self.device.index)
        self.host_np = np.ctypeslib.as_array((ctypes.c_uint8 * _PROBE).from_address(self.host))

    def close(self) -> None:
        if self.host:
            self.host_np = None
            self.driver.host_free(self.host)
            self.host = 0

    def _read(self, ptr: int, n: int = _PROBE) -> np.ndarray:
        driver, index = self.driver, self.device.index
        driver.copy(self.host, ptr, n, index)
        driver.synchronize(index)
        return self.host_np[:n].copy()

    def _to_numpy(self, view: Any) -> np.ndarray:
        if self.cpu:
            return np.array(view.to_numpy(), copy=True)
        return view.to_torch().cpu().numpy()

    def cycle(self, i: int) -> None:
        jaxbuf, driver, index = self.jaxbuf, self.driver, self.device.index
        frameworks = i % self.every == 0
        reserved, steps = _LAYOUT_FULL if frameworks else _LAYOUT_PLAIN
        buf = jaxbuf.ExtensibleTensor(reserved, device=self.device, num_segments=2, driver=driver)
        try:
            previous = 0
            for size in steps:
                buf.resize_per_segment_(size, zero_new=True)
                for offset in buf.segment_offsets:
                    probe = min(_PROBE, size - previous)
                    got = self._read(buf.base_ptr + offset + size - probe, probe)
                    if got.any():
                        raise AssertionError(f"cycle {i}: zero_new grow left nonzero bytes")
                previous = size
            values = [(i * 2 + s + 1) % 255 + 1 for s in range(2)]
            for offset, value in zip(buf.segment_offsets, values):
                driver.memset(buf.base_ptr + offset, value, _PROBE, index)
            for offset, value in zip(buf.segment_offsets, values):
                got = self._read(buf.base_ptr + offset)
                if not (got == value).all():
                    raise AssertionError(f"cycle {i}: read back {got[:4]} not {value}")
            if frameworks:
                self._framework_views(buf, values)
            buf.release_physical()
            if buf.physical_bytes or buf.num_bytes:
                raise AssertionError(f"cycle {i}: release_physical left {buf!r}")
            buf.resize_segments_(list(_RECOMMIT), zero_new=True)
            for offset in buf.segment_offsets:
                if self._read(buf.base_ptr + offset).any():
                    raise AssertionError(f"cycle {i}: recommitted memory is not zero")
        finally:
            buf.free()
        self.ops["extensible_cycles"] += 1
        if frameworks:
            self._pool(i)
            self._staged(i)

    def _framework_views(self, buf: Any, values: list[int]) -> None:
        import jax
        import torch

        t = torch.from_dlpack(buf.segment_view(0))
        if t.data_ptr() != buf.base_ptr or int(t[:_PROBE].min()) != values[0]:
            raise AssertionError("torch view does not alias segment 0")
        a = jax.dlpack.from_dlpack(buf.segment_view(1))
        head = np.asarray(a[:_PROBE])
        if not (head == values[1]).all():
            raise AssertionError("JAX view does not read segment 1")
        w = buf.segment_view(0).to_torch(dtype=torch.int32, shape=(_PROBE // 4,))
        if int(w[0]) != int(np.full(4, values[0], np.uint8).view(np.int32)[0]):
            raise AssertionError("typed torch view reads the wrong value")
        del t, a, w, head
        self.ops["torch_views"] += 2
        self.ops["jax_views"] += 1

    def _pool(self, i: int) -> None:
        pool = self.jaxbuf.UvaBufferPool(
            (4, 8), "int32", max_concurrency=2, device=self.device, driver=self.driver
        )
        try:
            for n in (1, 4, 9):  # 9 rows grow a slot to 16
                x = (np.arange(n * 8, dtype=np.int32).reshape(n, 8) + i) % 1000
                view = pool.copy_to_uva(x)
                if not np.array_equal(self._to_numpy(view), x):
                    raise AssertionError("copy_to_uva read back differs")
                self.ops["pool_copies"] += 1
            del view
            y = np.full((3, 8), i % 1000, np.int32)
            out = pool.copy_to_gpu(y)
            if not np.array_equal(out.cpu().numpy(), y):
                raise AssertionError("copy_to_gpu differs")
            del out
            self.ops["pool_copies"] += 1
        finally:
            pool.close()

    def _staged(self, i: int) -> None:
        swt = self.jaxbuf.StagedWriteTensor(
            (8, 16), "int32", device=self.device, backend=self.backend, driver=self.driver
        )
        try:
            model = np.zeros((8, 16), np.int32)
            rng = np.random.default_rng(i)
            for _ in range(2):  # two applies: the second reuses the writer's slot
                for _ in range(6):
                    row = int(rng.integers(8))
                    start = int(rng.integers(16))
                    length = int(rng.integers(1, 17 - start))
                    values = rng.integers(-1000, 1000, length, dtype=np.int32)
                    swt.stage_write(row, start, values)
                    model[row, start : start + length] = values
                    self.ops["staged_writes"] += 1
                swt.stage_write_elem(3, i % 1000)
                model[3, 0] = i % 1000
                swt.apply_write()
                self.ops["staged_applies"] += 1
            got = self._to_numpy(swt.gpu)
            if not np.array_equal(got, model):
                raise AssertionError("staged writes differ from the numpy model")
        finally:
            swt.free()


# -- running and reporting ---------------------------------------------------------------
def run(
    device: str = "cpu",
    cycles: int | None = None,
    every: int = 100,
    warmup: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the soak; return the summary (also what ``--json`` writes)."""
    platform_name = "cuda" if str(device).startswith("cuda") else "cpu"
    cycles = DEFAULT_CYCLES[platform_name] if cycles is None else cycles
    warmup = 3 * every if warmup is None else warmup
    soak = Soak(device, every)
    soak.open()
    try:
        for i in range(warmup):
            soak.cycle(i)
        soak.ops.clear()
        calls_before = collections.Counter(soak.driver.calls)
        start = measure(soak.driver, soak.device.index, own_handles=1)
        t0 = time.perf_counter()
        step = max(cycles // 10, 1)
        for i in range(cycles):
            soak.cycle(i)
            if progress and (i + 1) % step == 0:
                print(
                    f"  {i + 1}/{cycles} cycles, {time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
        seconds = time.perf_counter() - t0
        end = measure(soak.driver, soak.device.index, own_handles=1)
        live_at_end = live_counts(soak.driver)
        calls = collections.Counter(soak.driver.calls) - calls_before
        problems = soak.driver.problems() if hasattr(soak.driver, "problems") else []
    finally:
        soak.close()
    metrics = {}
    for name, tolerance in TOLERANCES.items():
        a, b = start[name], end[name]
        if a is None or b is None:
            continue
        delta = b - a
        metrics[name] = {
            "start": a,
            "end": b,
            "delta": delta,
            "tolerance": tolerance,
            "ok": delta <= tolerance,
        }
    return {
        "device": str(soak.device),
        "cycles": cycles,
        "warmup_cycles": warmup,
        "every": every,
        "seconds": round(seconds, 3),
        "cycles_per_second": round(cycles / seconds, 1) if seconds else None,
        "operations": dict(soak.ops),
        "driver_calls": dict(calls),
        "metrics": metrics,
        "driver": type(soak.driver).__name__,
        # Freed reservations parked by the CPU driver when measured (then flushed); bounded
        # by the driver's quarantine_ranges, so they are not a leak.
        "quarantined_ranges": {
            "start": start["quarantined_ranges"],
            "end": end["quarantined_ranges"],
            "limit": getattr(soak.inner, "quarantine_ranges", None),
        },
        "live_at_end": live_at_end,
        "invariant_problems": problems,
        "ok": all(m["ok"] for m in metrics.values()) and not problems,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def print_table(summary: dict[str, Any]) -> None:
    title = (
        f"soak: {summary['cycles']:,} cycles on {summary['device']} in "
        f"{summary['seconds']:.1f} s ({summary['cycles_per_second']:,} cycles/s)"
    )
    rows = []
    for name, m in summary["metrics"].items():
        mib = name.endswith("_bytes")
        f = (lambda v: f"{v / MIB:.1f} MiB") if mib else str
        d = (lambda v: f"{v / MIB:+.2f} MiB") if mib else (lambda v: f"{v:+d}")
        rows.append(
            (
                name,
                f(m["start"]),
                f(m["end"]),
                d(m["delta"]),
                f"<= {f(m['tolerance'])}",
                "ok" if m["ok"] else "LEAK",
            )
        )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in rows:
            print("  " + "  ".join(f"{cell:>16}" for cell in row))
    else:
        table = Table(title=title)
        for column in ("metric", "start", "end", "delta", "tolerance", "result"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    ops = ", ".join(f"{k}={v:,}" for k, v in summary["operations"].items())
    print(f"operations: {ops}")
    q = summary.get("quarantined_ranges") or {}
    if q.get("end") is not None:
        print(
            f"CPU driver quarantine of freed reservations before each measurement: "
            f"{q['start']} -> {q['end']} ranges (bounded by {q['limit']}; flushed to measure)"
        )
    print("PASS" if summary["ok"] else "FAIL: a metric did not return to its start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--cycles", type=int, default=None, help="default: 100,000 on cpu, 10,000 on cuda"
    )
    parser.add_argument(
        "--every",
        type=int,
        default=100,
        help="framework views, pool and staged writes every K cycles (100)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="default: 3 * --every")
    parser.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    summary = run(args.device, args.cycles, args.every, args.warmup, not args.quiet)
    print_table(summary)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)
            out.write("\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
