"""``staged.patterns``: the staged apply per write pattern, against baselines
measured in the same run.

One apply of 256 and 4,096 writes of 16 int32 over 4 tables of 1024 x 4096, per write pattern
(every write its own row; rows repeat, no two writes overlapping; uniformly random rows; heavy
overlap), host time and end to end, each against the seed-style apply
(:class:`jaxbuf.bench.staged._SeedStyleWriter`) and torch ``index_put_``, with the
targets on the GPU: the own-row apply of 256 writes <= 12 µs host and <= 25 µs end to end,
of 4,096 <= 80 µs end to end; "rows repeat" and "random" <= 1.3x "own row" end to end
(jaxbuf's host and end-to-end samples are taken round by round over the patterns, so that
host drift falls on all alike; the device column comes from a separate pass). Then the
launch alone: direct ``cuLaunchKernel`` against Triton's launcher (host time).

Every pattern is first checked: jaxbuf's apply against a numpy model in which later writes
win; the baselines too where no two writes overlap (they define no order among overlapping
writes). On the CPU jaxbuf's Triton path runs under the interpreter (256 writes only with
``--quick``) and the seed-style apply on the numpy kernel: the numbers mean nothing there,
but every row and check runs.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, suite
from jaxbuf.bench._timing import Timing, device_event_timer, device_synchronizer, measure
from jaxbuf.bench.staged import _NUM_TABLES, _SeedStyleTensor, _SeedStyleWriter

_PATTERN_ROWS = 1024
_PATTERN_ROW_LEN = 4096
_PATTERN_WRITE_LEN = 16
#: Writes per row in "rows repeat"; rows of "heavy overlap" per table and their start range.
_REPEATS_PER_ROW = 4
_HEAVY_ROWS = 4
_HEAVY_STARTS = 2 * _PATTERN_WRITE_LEN
PATTERNS = ("own row", "rows repeat", "random", "heavy overlap")
#: Targets on the GPU: the own-row apply (host, end to end), and the patterns whose rows
#: repeat against it (end to end, same run): resolving overlaps must not cost a pattern more.
_OWN_ROW_HOST_TARGET_S = {256: 12e-6}
_OWN_ROW_E2E_TARGET_S = {256: 25e-6, 4096: 80e-6}
_FLAT_PATTERNS = ("rows repeat", "random")
_FLATNESS_TARGET = 1.3


def pattern_writes(
    pattern: str, num_writes: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``num_writes`` writes of 16 int32 spread evenly over the tables, in ``pattern``:
    per table ``(rows, starts, values)``, ``values`` of shape ``(k, 16)``, in staging order.

    * ``own row``: every write to a different row;
    * ``rows repeat``: 4 writes per row, at disjoint columns (no two overlap), interleaved;
    * ``random``: rows and starts uniformly random (a few overlap at 4,096 writes);
    * ``heavy overlap``: 4 rows per table, starts in 0..32: nearly every write overlaps
      others, so only later-wins decides the result.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; expected one of {PATTERNS}")
    rng = np.random.default_rng([seed, PATTERNS.index(pattern), num_writes])
    per_table = num_writes // _NUM_TABLES
    if not 1 <= per_table <= _PATTERN_ROWS:
        raise ValueError(f"num_writes must be in [{_NUM_TABLES}, {_NUM_TABLES * _PATTERN_ROWS}]")
    width, last_start = _PATTERN_WRITE_LEN, _PATTERN_ROW_LEN - _PATTERN_WRITE_LEN
    tables = []
    for _ in range(_NUM_TABLES):
        if pattern == "own row":
            rows = rng.permutation(_PATTERN_ROWS)[:per_table]
            starts = rng.integers(0, last_start + 1, per_table)
        elif pattern == "rows repeat":
            distinct = -(-per_table // _REPEATS_PER_ROW)
            rows = np.repeat(rng.permutation(_PATTERN_ROWS)[:distinct], _REPEATS_PER_ROW)
            # Distinct slots of one row, shifted alike: the row's writes are disjoint.
            slots = np.concatenate(
                [
                    rng.choice(_PATTERN_ROW_LEN // width - 1, _REPEATS_PER_ROW, replace=False)
                    for _ in range(distinct)
                ]
            )
            shifts = np.repeat(rng.integers(0, width, distinct), _REPEATS_PER_ROW)
            order = rng.permutation(per_table)
            rows, starts = rows[:per_table][order], (slots * width + shifts)[:per_table][order]
        elif pattern == "random":
            rows = rng.integers(0, _PATTERN_ROWS, per_table)
            starts = rng.integers(0, last_start + 1, per_table)
        else:
            rows = rng.integers(0, _HEAVY_ROWS, per_table)
            starts = rng.integers(0, _HEAVY_STARTS + 1, per_table)
        values = rng.integers(0, 2**31, (per_table, width), dtype=np.int64).astype(np.int32)
        tables.append((rows.astype(np.int64), starts.astype(np.int64), values))
    return tables


def _model_after(before: list[np.ndarray], work: list[tuple]) -> list[np.ndarray]:
    """``before`` with ``work`` applied in staging order: later writes win."""
    after = [b.copy() for b in before]
    for model, (rows, starts, values) in zip(after, work):
        for row, start, value in zip(rows.tolist(), starts.tolist(), values):
            model[row, start : start + _PATTERN_WRITE_LEN] = value
    return after


def _overlaps(rows: np.ndarray, starts: np.ndarray) -> bool:
    """Whether two of one table's writes (all 16 long) touch the same element."""
    order = np.lexsort((starts, rows))
    rows, starts = rows[order], starts[order]
    return bool(np.any((rows[1:] == rows[:-1]) & (starts[1:] - starts[:-1] < _PATTERN_WRITE_LEN)))


def _launch_path(writer: Any, device: Any) -> str:
    """How ``writer`` launches, for the notes."""
    if not device.is_cuda:
        return "CPU: Triton interpreter, seed-style on the numpy kernel (times mean nothing)"
    reason = getattr(getattr(writer, "_launch", None), "fallback_reason", None)
    return "direct cuLaunchKernel" if reason is None else f"Triton's launcher: {reason}"


def _pattern_rows(device: Any, num_writes: int, quick: bool) -> Iterator[Row]:
    import torch

    from jaxbuf.staged import FusedStagedWriter, StagedWriteTensor

    if device.is_cuda:
        repeat, warmup = (5, 2) if quick else ((50, 3) if num_writes <= 256 else (25, 3))
        torch.cuda.init()
        sync = lambda: torch.cuda.synchronize(device.index)  # noqa: E731
    else:  # the interpreter: seconds per apply at 4,096 writes
        repeat, warmup = (1, 0) if quick else (2, 1)
        sync = device_synchronizer(device)
    timer = device_event_timer(device)
    torch_device = device.torch()
    shape = (_PATTERN_ROWS, _PATTERN_ROW_LEN)
    tables = [StagedWriteTensor(shape, "int32", device) for _ in range(_NUM_TABLES)]
    writer = FusedStagedWriter(device, num_writes)
    seed_targets = [
        torch.zeros(shape, dtype=torch.int32, device=torch_device) for _ in range(_NUM_TABLES)
    ]
    group_table = np.array([[t.data_ptr(), _PATTERN_ROW_LEN, 4] for t in seed_targets], np.int64)
    seed_tensors = [_SeedStyleTensor(t) for t in seed_targets]
    seed_writer = _SeedStyleWriter(device, num_writes, group_table)
    columns = np.arange(_PATTERN_WRITE_LEN, dtype=np.int64)

    def snapshot(arrays: list[Any]) -> list[np.ndarray]:
        sync()
        return [a.cpu().numpy().copy() for a in arrays]

    def timed(fn: Any, setup: Any, end_to_end: bool) -> Any:
        """Host time of ``fn()`` (or with the wait for the device: end to end); staging in
        ``setup`` is not timed. The CPU's apply completes in the call: one pass serves both."""
        return measure(
            lambda _: fn(),
            setup=lambda: (sync(), setup()),
            repeat=repeat,
            warmup=warmup,
            synchronize=sync if end_to_end else None,
        )

    def device_time(fn: Any, setup: Any) -> float | None:
        """Median device time of ``fn()`` (CUDA events around it), or None off CUDA."""
        if timer is None:
            return None
        timing = measure(lambda _: fn(), setup=setup, repeat=repeat, warmup=1, device_timer=timer)
        return timing.device_median_s

    measured = []  # per pattern: (pattern, overlapping, device time, the baselines' timings)
    stagers = {}
    try:
        for pattern in PATTERNS:
            work = pattern_writes(pattern, num_writes)
            overlapping = any(_overlaps(rows, starts) for rows, starts, _ in work)

            def stage_jaxbuf(work=work) -> None:
                for swt, (rows, starts, values) in zip(tables, work):
                    stage = swt.stage_write
                    for row, start, value in zip(rows.tolist(), starts.tolist(), values):
                        stage(row, start, value)

            def stage_seed(work=work) -> None:
                for t, (rows, starts, values) in zip(seed_tensors, work):
                    for row, start, value in zip(rows.tolist(), starts.tolist(), values):
                        t.stage_write(row, start, value.tolist())

            def index_put(work=work) -> None:
                for target, (rows, starts, values) in zip(seed_targets, work):
                    row_index = np.repeat(rows, _PATTERN_WRITE_LEN)
                    col_index = (starts[:, None] + columns).reshape(-1)
                    index = (
                        torch.from_numpy(row_index).to(torch_device, non_blocking=True),
                        torch.from_numpy(col_index).to(torch_device, non_blocking=True),
                    )
                    flat = torch.from_numpy(values.reshape(-1))
                    target.index_put_(index, flat.to(torch_device, non_blocking=True))

            # Correctness first: later wins in jaxbuf's apply for every pattern; the
            # baselines (no defined order among overlapping writes) where none overlap.
            before = snapshot([t.to_torch() for t in tables])
            stage_jaxbuf()
            writer.apply(tables)
            if not all(
                map(
                    np.array_equal,
                    snapshot([t.to_torch() for t in tables]),
                    _model_after(before, work),
                )
            ):
                raise AssertionError(
                    f"staged.patterns: jaxbuf's {pattern!r} apply differs "
                    "from the numpy model (later writes win)"
                )
            for name, run in (
                ("seed-style", lambda: (stage_seed(), seed_writer.apply(seed_tensors))),
                ("index_put_", index_put),
            ):
                before = snapshot(seed_targets)
                run()
                if not overlapping and not all(
                    map(np.array_equal, snapshot(seed_targets), _model_after(before, work))
                ):
                    raise AssertionError(
                        f"staged.patterns: the {name} {pattern!r} apply "
                        "differs from the numpy model"
                    )

            apply = lambda: writer.apply(tables)  # noqa: E731
            seed_apply = lambda: seed_writer.apply(seed_tensors)  # noqa: E731
            apply_device_s = device_time(apply, stage_jaxbuf)
            seed_host = timed(seed_apply, stage_seed, False)
            put_host = timed(index_put, lambda: None, False)
            if device.is_cuda:
                seed_e2e = timed(seed_apply, stage_seed, True)
                put_e2e = timed(index_put, lambda: None, True)
            else:
                seed_e2e, put_e2e = seed_host, put_host
            measured.append(
                (pattern, overlapping, apply_device_s, seed_host, put_host, seed_e2e, put_e2e)
            )
            stagers[pattern] = stage_jaxbuf
        # jaxbuf's host and end-to-end times, the targets' numbers: every pattern sampled
        # round by round, so that the host's drift falls on all of them alike.
        interleaved = _interleaved_end_to_end(stagers, writer, tables, sync, repeat, warmup)
        own_row_e2e = interleaved["own row"][1]
        for (
            pattern,
            overlapping,
            apply_device_s,
            seed_host,
            put_host,
            seed_e2e,
            put_e2e,
        ) in measured:
            host_s, e2e_s = interleaved[pattern]
            host, e2e = Timing(host_s, [], apply_device_s), Timing(e2e_s, [])
            notes = _launch_path(writer, device)
            if overlapping:
                notes += "; overlapping writes: baselines' order undefined"
            name = f"apply {num_writes:,} writes, {pattern}"
            params = {"kind": "pattern-apply", "pattern": pattern, "num_writes": num_writes}
            for timing, mine, seed_t, put_t in (
                ("host", host, seed_host, put_host),
                ("end to end", e2e, seed_e2e, put_e2e),
            ):
                row = Row(
                    f"{name} ({timing})",
                    mine.median_s,
                    f"seed-style apply, {timing}",
                    seed_t.median_s,
                    notes=notes,
                    device_median_s=mine.device_median_s,
                    params={**params, "timing": timing, "baseline_kind": "seed"},
                )
                target_s = (
                    _OWN_ROW_HOST_TARGET_S if timing == "host" else _OWN_ROW_E2E_TARGET_S
                ).get(num_writes)
                if device.is_cuda and pattern == "own row" and target_s is not None:
                    row.target = f"<= {target_s * 1e6:g} µs"
                    row.met = mine.median_s <= target_s
                if device.is_cuda and pattern in _FLAT_PATTERNS and timing == "end to end":
                    row.target = f"<= {_FLATNESS_TARGET:g}x own row"
                    row.met = mine.median_s <= _FLATNESS_TARGET * own_row_e2e
                    row.notes += f"; {mine.median_s / own_row_e2e:.2f}x own row"
                yield row
                yield Row(
                    f"{name} ({timing})",
                    mine.median_s,
                    f"torch index_put_ per table, indices built, {timing}",
                    put_t.median_s,
                    params={**params, "timing": timing, "baseline_kind": "index_put"},
                )
    finally:
        seed_writer.close()
        writer.close()
        for swt in tables:
            swt.close()


def _interleaved_end_to_end(
    stagers: dict[str, Any], writer: Any, tables: list, sync: Any, repeat: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Median ``(host, end to end)`` times of ``writer.apply(tables)`` after each
    ``stagers[pattern]()`` (untimed, after a synchronize): host until the apply returns, end
    to end until the device is done too. The patterns are sampled round by round (order
    reversed every other round), the garbage collector paused while timing."""
    hosts: dict[str, list[float]] = {pattern: [] for pattern in stagers}
    samples: dict[str, list[float]] = {pattern: [] for pattern in stagers}
    order = list(stagers)
    gc_was_enabled = gc.isenabled()
    try:
        for i in range(warmup + repeat):
            for pattern in order if i % 2 == 0 else reversed(order):
                sync()
                stagers[pattern]()
                gc.disable()
                start = time.perf_counter()
                writer.apply(tables)
                returned = time.perf_counter()
                sync()
                done = time.perf_counter()
                if gc_was_enabled:
                    gc.enable()
                if i >= warmup:
                    hosts[pattern].append(returned - start)
                    samples[pattern].append(done - start)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        pattern: (statistics.median(hosts[pattern]), statistics.median(samples[pattern]))
        for pattern in stagers
    }


def _launch_row(device: Any, quick: bool) -> Row:
    """The launch alone (host time): direct ``cuLaunchKernel`` against Triton's launcher, the
    same compiled kernel and 256 own-row writes."""
    import torch

    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.kernels import StagedLaunch, make_group_table, make_write_table
    from jaxbuf.kernels.staged_write import CompiledLauncher

    num_writes = 256
    work = pattern_writes("own row", num_writes)
    torch_device = device.torch()
    targets = [
        torch.zeros((_PATTERN_ROWS, _PATTERN_ROW_LEN), dtype=torch.int32, device=torch_device)
        for _ in range(_NUM_TABLES)
    ]
    per_table = num_writes // _NUM_TABLES
    write_table = make_write_table(
        np.repeat(np.arange(_NUM_TABLES), per_table),
        np.concatenate([rows for rows, _, _ in work]),
        np.concatenate([starts for _, starts, _ in work]),
        np.arange(num_writes) * _PATTERN_WRITE_LEN * 4,
        np.full(num_writes, _PATTERN_WRITE_LEN),
    )
    group_table = make_group_table(
        [t.data_ptr() for t in targets], [_PATTERN_ROW_LEN] * _NUM_TABLES, [4] * _NUM_TABLES
    )
    on_device = [
        torch.from_numpy(a).to(torch_device)
        for a in (write_table, group_table, np.concatenate([v for _, _, v in work]))
    ]
    driver = get_vmm_driver(device)
    stream = torch.cuda.current_stream(device.index).cuda_stream
    args = (StagedLaunch(*(a.data_ptr() for a in on_device), num_writes), stream)
    sync = lambda: torch.cuda.synchronize(device.index)  # noqa: E731
    medians = {}
    reason = None
    for direct in (True, False):
        launcher = CompiledLauncher(device.index, driver=driver, direct=direct)
        driver.ensure_context(device.index)
        medians[direct] = measure(
            lambda _, launch=launcher: launch(*args),
            setup=sync,
            repeat=50 if quick else 500,
            warmup=3,
        ).median_s
        if direct:
            reason = launcher.fallback_reason
    sync()
    return Row(
        f"launch {num_writes} writes: direct cuLaunchKernel (host)",
        medians[True],
        "Triton's launcher (CompiledKernel.run), host",
        medians[False],
        notes="prepacked arguments, one driver call"
        if reason is None
        else (f"direct path unavailable, both rows are Triton's launcher: {reason}"),
        params={"kind": "launch", "num_writes": num_writes},
    )


@suite("staged.patterns", requires=("torch", "triton"), interpreted=True)
def pattern_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """One apply of small writes over 4 tables per write pattern (own row, rows repeat,
    random, heavy overlap), host and end to end, against the seed-style apply and torch
    index_put_; and the direct launch against Triton's launcher."""
    sizes = (256,) if quick and not device.is_cuda else (256, 4096)
    counts = " and ".join(f"{n:,}" for n in sizes)
    yield Sizes(
        f"{counts} writes of {_PATTERN_WRITE_LEN} int32 over {_NUM_TABLES} tables of "
        f"{_PATTERN_ROWS} x {_PATTERN_ROW_LEN}; rows repeat: {_REPEATS_PER_ROW} disjoint "
        f"writes per row; heavy overlap: {_HEAVY_ROWS} rows per table, starts 0-{_HEAVY_STARTS}"
    )
    for num_writes in sizes:
        yield from _pattern_rows(device, num_writes, quick)
    if device.is_cuda:
        yield _launch_row(device, quick)
