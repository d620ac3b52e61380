"""The staged apply against the floor under it, with CUPTI kernel times (torch's profiler).

    python3 tools/experiments/floor.py        # on a CUDA machine

Prints: a trivial torch kernel launch + synchronize (the floor of any launch end to end);
then, for 256 and 4,096 own-row writes of 16 int32 over four 1024 x 4096 tables, the host and
end-to-end time of one apply and each kernel's device time, with the slot read in place, with
every apply copied to device memory first, and with the writer's default; then
``pack_writes(..., ring=)`` with a fresh against a reused ``StagedWrites``. The numbers behind
DEVICE_COPY_MIN_BYTES and the ring's staging reuse (BENCHMARKS.md, third session).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import jaxbuf  # noqa: E402
from jaxbuf.bench._timing import measure  # noqa: E402
from jaxbuf.bench.jax_staged import _SHAPE, _workload  # noqa: E402
from jaxbuf.jax_ops import PackRing, StagedWrites  # noqa: E402
from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor  # noqa: E402

IN_PLACE = 1 << 62  # a device-copy threshold no apply reaches


def median_us(fn, n=300, setup=None) -> float:
    """Median µs of ``fn()`` over ``n`` calls after 20 untimed ones (``setup()`` untimed
    before each): :func:`jaxbuf.bench._timing.measure`, the benches' timer."""
    call = (lambda _: fn()) if setup is not None else fn
    return round(measure(call, repeat=n, warmup=20, setup=setup).median_s * 1e6, 1)


def main() -> None:
    device = jaxbuf.as_device("cuda")
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    print("torch x.add_(1) + synchronize", median_us(lambda: (x.add_(1), torch.cuda.synchronize())))
    print("torch.cuda.synchronize alone", median_us(torch.cuda.synchronize))
    print("torch x.add_(1), host", median_us(lambda: x.add_(1)))
    tables = [StagedWriteTensor((1024, 4096), "int32", device) for _ in range(4)]
    rng = np.random.default_rng(0)
    values = np.arange(16, dtype=np.int32)
    for n in (256, 4096):
        per = n // 4
        work = [
            (rng.permutation(1024)[:per].tolist(), rng.integers(0, 4080, per).tolist())
            for _ in tables
        ]

        def stage(work=work) -> None:
            for table, (rows, starts) in zip(tables, work):
                for row, start in zip(rows, starts):
                    table.stage_write(row, start, values)

        for label, threshold in (("default", None), ("always copy", 0), ("in place", IN_PLACE)):
            writer = FusedStagedWriter(device, n)
            if threshold is not None:
                writer._device_copy_min = threshold

            def apply(writer=writer) -> None:
                writer.apply(tables)

            e2e = median_us(lambda: (apply(), torch.cuda.synchronize()), setup=stage)
            host = median_us(apply, setup=lambda: (torch.cuda.synchronize(), stage()))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    stage()
                    apply()
                    torch.cuda.synchronize()
            kernels = "; ".join(
                f"{e.key[:30]} {e.device_time_total / max(e.count, 1):.1f} us x{e.count}"
                for e in prof.key_averages()
                if e.device_type.name == "CUDA"
            )
            print(f"{n} writes, {label}: host {host} e2e {e2e} | {kernels}", flush=True)
            writer.close()
    for n in (256, 4096):
        fresh, again = ring_staging(device, n)
        print(f"pack_writes(ring=) {n} writes: fresh StagedWrites {fresh}, reused {again}")


def ring_staging(device, n: int) -> tuple[float, float]:
    """``pack_writes(..., ring=)`` of ``n`` writes with a fresh StagedWrites each call (what
    it did before the ring kept one) against one reused ``StagedWrites``."""
    rows, starts, values = _workload(n)
    staged = StagedWrites(*_SHAPE, "int32")
    with PackRing(device=device) as ring:

        def fresh() -> None:
            staging = StagedWrites(*_SHAPE, "int32")
            staging.stage_writes(rows, starts, values)
            staging.pack(ring=ring)

        def reused() -> None:
            staged.stage_writes(rows, starts, values)
            staged.pack(ring=ring)

        return median_us(fresh), median_us(reused)


if __name__ == "__main__":
    main()
