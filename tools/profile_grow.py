"""Where a +2 MiB grow spends its time: each driver call timed in place, the rest is jaxbuf.

    python3 tools/profile_grow.py [--device cuda] [--committed-gib 1] [--grows 200]

Wraps the driver's methods of one ExtensibleTensor with timers, grows it ``--grows`` times by
one granule and prints the mean time per grow, per driver call, and what remains (jaxbuf's own
bookkeeping plus the wrappers' cost, about 0.2 µs per wrapped call).
"""

from __future__ import annotations

import argparse
import time

from _timers import time_calls  # tools/, beside this script

import jaxbuf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--committed-gib", type=float, default=1.0)
    parser.add_argument("--grows", type=int, default=200)
    args = parser.parse_args()
    step = jaxbuf.granule_size(args.device)
    committed = int(args.committed_gib * (1 << 30)) // step * step
    capacity = committed + (args.grows + 2) * step
    tensor = jaxbuf.ExtensibleTensor(capacity, device=args.device)
    tensor.resize_per_segment_(committed)
    driver = tensor.driver
    spent: dict[str, float] = {}
    for name in ("ensure_context", "create", "map", "set_access_many", "set_access"):
        time_calls(driver, name, spent)
    size = committed
    tensor.resize_per_segment_(size + step)  # warm up
    size += step
    spent.clear()
    start = time.perf_counter()
    for _ in range(args.grows):
        size += step
        tensor.resize_per_segment_(size)
    total = (time.perf_counter() - start) / args.grows
    calls = {name: seconds / args.grows for name, seconds in spent.items()}
    # set_access_many calls set_access: count the outer call only.
    outer = sum(v for k, v in calls.items() if k != "set_access")
    print(f"device {tensor.device}, {committed / (1 << 30):g} GiB committed, +{step >> 20} MiB")
    print(f"per grow: {total * 1e6:.1f} µs")
    for name, seconds in sorted(calls.items()):
        print(f"  {name:16s} {seconds * 1e6:8.1f} µs")
    print(f"  jaxbuf (rest)    {(total - outer) * 1e6:8.1f} µs")
    tensor.free()


if __name__ == "__main__":
    main()
