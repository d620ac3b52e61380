"""The staged apply against the floor under it, with CUPTI kernel times (torch's profiler).

    python3 tools/experiments/floor.py        # on a CUDA machine

Prints: a trivial torch kernel launch + synchronize (the floor of any launch end to end);
then, for 256 and 4,096 own-row writes of 16 int32 over four 1024 x 4096 tables, the host and
end-to-end time of one apply and each kernel's device time, with the slot read in place, with
every apply copied to device memory first, and with the writer's default; then
``pack_writes(..., ring=)`` with a fresh against a reused ``StagedWrites``. The numbers behind
``FusedStagedWriter``'s ``device_copy_min_bytes`` default and the ring's
staging reuse; rerun it after a driver or launch-path change.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from workload import SHAPE, disjoint_writes, median_us  # noqa: E402

import jaxbuf  # noqa: E402
from jaxbuf.jax_ops import PackRing, StagedWrites  # noqa: E402
from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor  # noqa: E402

IN_PLACE = 1 << 62  # a device-copy threshold no apply reaches


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
            options = {} if threshold is None else {"device_copy_min_bytes": threshold}
            writer = FusedStagedWriter(device, n, **options)

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
    rows, starts, values = disjoint_writes(n)
    staged = StagedWrites(*SHAPE, "int32")
    with PackRing(device=device) as ring:

        def fresh() -> None:
            staging = StagedWrites(*SHAPE, "int32")
            staging.stage_writes(rows, starts, values)
            staging.pack(ring=ring)

        def reused() -> None:
            staged.stage_writes(rows, starts, values)
            staged.pack(ring=ring)

        return median_us(fresh), median_us(reused)


if __name__ == "__main__":
    main()
