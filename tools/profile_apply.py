"""Where one staged apply spends its host time: each step timed in place, the rest is glue.

    python3 tools/profile_apply.py [--device cuda] [--writes 256] [--applies 300]

Four int32 tables of 1024 x 4096, ``--writes`` 16-element writes, each to its own row. Wraps
the writer's packer, launcher and the driver calls an apply makes with timers, applies
``--applies`` times (after a synchronize, writes staged outside the timing) and prints the
median host time per apply and the mean per wrapped step (each wrapper adds about 0.2 µs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _timers import time_calls  # tools/, beside this script

import jaxbuf
from jaxbuf import interop
from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor, _launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--writes", type=int, default=256)
    parser.add_argument("--applies", type=int, default=300)
    args = parser.parse_args()
    device = jaxbuf.as_device(args.device)
    tables = [StagedWriteTensor((1024, 4096), "int32", device) for _ in range(4)]
    writer = FusedStagedWriter(device, args.writes)
    driver = writer._driver
    rng = np.random.default_rng(0)
    per = args.writes // 4
    work = [
        (rng.permutation(1024)[:per].tolist(), rng.integers(0, 4080, per).tolist()) for _ in tables
    ]
    values = np.arange(16, dtype=np.int32)
    spent: dict[str, float] = {}

    time_calls(writer, "_pack", spent, "pack (C)")
    time_calls(writer, "_launch", spent, "launch")
    time_calls(writer, "_clear", spent, "clear")
    for name in ("ensure_context", "record_event", "stream_wait_event", "event_query"):
        time_calls(driver, name, spent, f"driver.{name}")
    time_calls(interop, "current_stream", spent, "interop.current_stream")
    time_calls(_launch.AppliedEvent, "wait", spent, "slot event wait")
    sync = (lambda: driver.synchronize(device.index)) if device.is_cuda else (lambda: None)

    def stage():
        for swt, (rows, starts) in zip(tables, work):
            for row, start in zip(rows, starts):
                swt.stage_write(row, start, values)

    times = []
    for i in range(args.applies + 10):
        sync()
        stage()
        if i == 10:
            spent.clear()
        start = time.perf_counter()
        writer.apply(tables)
        times.append(time.perf_counter() - start)
    sync()
    times = times[10:]
    mean = sum(times) / len(times)
    print(f"device {device}, {args.writes} writes own-row, {args.applies} applies")
    print(f"apply host median {statistics.median(times) * 1e6:.1f} µs, mean {mean * 1e6:.1f} µs")
    # record_event calls ensure_context: print both, subtract only outer calls.
    for name, seconds in sorted(spent.items()):
        print(f"  {name:26s} {seconds / args.applies * 1e6:8.2f} µs")
    outer = sum(v for k, v in spent.items() if k != "driver.event_query") / args.applies
    print(f"  rest (glue, approx)        {(mean - outer) * 1e6:8.2f} µs")
    writer.close()


if __name__ == "__main__":
    main()
