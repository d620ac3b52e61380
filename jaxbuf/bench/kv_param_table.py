"""Benchmark of :meth:`jaxbuf.DeviceParamTable.sync`, the per-step upload of per-request
sampling parameters, against the seed's per-step copies and ``jax.device_put``, in-run.

Suite ``kv.param_table``: a table of ``num_rows`` requests by eight fields (temperature,
top-p, top-k, min-p, three penalties, a seed) is made current on the device once per decode
step, two kinds of step apart:

* **unchanged**: no request admitted or changed since the last step. ``sync`` compares the
  host table with the last upload and copies nothing.
* **changed**: one value changed (a request admitted). ``sync`` uploads the whole table with
  one copy on the driver's stream.

Baselines, every one in the same rounds: **seed-style**, the seed's algorithm re-implemented
on the same driver: one pinned host array per field (a ``UvaBackedTensor`` each) copied to
its device array every step, changed or not, one copy per field; and **jax.device_put** of
every field's host array every step, as a plain JAX user writes. A sample is ``_CALLS``
steps' uploads then one wait for the device (every copy done), divided by ``_CALLS``: the
host's enqueueing and the device's copies both count. Samples are taken round by round
(:func:`~jaxbuf.bench._timing.round_by_round_samples`); ratios are medians with their
paired spread.

**JAX rows**: a changed sync plus the next access to ``arrays("jax")`` (every field's array,
as a jitted step's argument flattening takes them: the new values uploaded) against a plain
``jnp.asarray`` of the same bytes (the whole table as one array), for a table of one field
and of all eight (which the eight-field table also compares, without a target, with one
``jnp.asarray`` per field: the same arrays a step gets), under two loads that a sync used to
wait for:

* **10,000 live JAX arrays** in the process (a sync used to ``block_until_ready`` each).
  A sample is ``_CALLS`` calls then one wait for the last arrays, as above.
* **a long matmul in flight** (4096 x 4096 float32; 2048 at ``--quick``), dispatched just
  before each round. A sample is ``_MATMUL_CALLS`` calls, host time only (a wait would wait
  for the matmul, whatever the calls did): few, because JAX's CPU client holds a bounded
  number of operations in flight and blocks the next one (a ``jnp.asarray`` as well) until
  the matmul is done; ``params["in_flight"]`` is the share of rounds whose matmul was still
  running when both samples were done (1.0: every sample ran beside it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from jaxbuf.bench import Row, Sizes, format_bytes, ratio_spread, suite
from jaxbuf.bench._timing import device_synchronizer, round_by_round_samples

__all__ = ["param_table_suite"]

FIELDS = {
    "temperature": "float32",
    "top_p": "float32",
    "top_k": "int32",
    "min_p": "float32",
    "frequency_penalty": "float32",
    "presence_penalty": "float32",
    "repetition_penalty": "float32",
    "seed": "int64",
}
_CALLS = 20  # uploads per sample, then one wait for the device
_MATMUL_CALLS = 5  # per sample beside a long matmul: well inside JAX's in-flight bound
# An unchanged step copies nothing: at most a quarter of what the seed's copies cost, on any
# device (judged on the CPU too).
_UNCHANGED_TARGET = 0.25
# A changed step is one copy of the table against one per field: no dearer than the seed's.
_CHANGED_TARGET = 1.0
_SEED = "seed-style per-step copy (a pinned UvaBackedTensor per field)"
_DEVICE_PUT = "jax.device_put of every field per step"
# A changed sync and the JAX arrays of its values, against one plain upload of the same bytes.
_JAX_TARGET = 2.0
_ASARRAY = "plain JAX jnp.asarray of the whole table's bytes (one array)"
_LIVE_ARRAYS = 10_000
# JAX without jax_enable_x64 holds no 64-bit values (arrays("jax") refuses an int64 field
# rather than narrow it): the seed is 32 bits there, as JAX's own PRNG seeds are.
_JAX_FIELDS = {**FIELDS, "seed": "uint32"}


class _SeedStyle:
    """The seed's per-request fields: for each, a pinned host array (``np``, the source of
    truth) and a device array, the host array copied to the device every step."""

    def __init__(self, num_rows: int, device: Any) -> None:
        from jaxbuf import ExtensibleTensor, UvaBuffer

        self.hosts: list[Any] = []
        self.devices: list[Any] = []
        try:
            for dtype in FIELDS.values():
                host = UvaBuffer(num_rows, dtype, device=device)
                self.hosts.append(host)
                column = ExtensibleTensor(host.nbytes, device)
                self.devices.append(column)
                column.resize_per_segment_(host.nbytes, zero_new=True)
        except BaseException:
            self.close()
            raise
        self.driver, self.index = self.devices[0].driver, device.index
        self.np = {name: host.np for name, host in zip(FIELDS, self.hosts)}
        self._copies = [
            (column.base_ptr, host.np.ctypes.data, host.nbytes)
            for host, column in zip(self.hosts, self.devices)
        ]

    def copy_to_gpu(self) -> None:
        """Every field's host array to its device array, one stream-ordered copy each."""
        copy, index = self.driver.copy, self.index
        for destination, source, nbytes in self._copies:
            copy(destination, source, nbytes, index)

    def close(self) -> None:
        for host in self.hosts:
            host.free()
        for column in self.devices:
            column.free()


def _sampled(step: Callable[[], Any], wait: Callable[[Any], None]) -> Callable[[], None]:
    """One sample: ``_CALLS`` steps, then ``wait`` for what the last returned."""

    def sample() -> None:
        last = None
        for _ in range(_CALLS):
            last = step()
        wait(last)

    return sample


@suite("kv.param_table", requires=("jax",))
def param_table_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """DeviceParamTable.sync on unchanged and changed decode steps, against the seed's
    per-field copies and jax.device_put per step."""
    import jax
    import numpy as np

    from jaxbuf import DeviceParamTable

    num_rows = (256 if quick else 1024) if device.is_cuda else (64 if quick else 256)
    repeat = 15 if quick else 60
    table = DeviceParamTable(num_rows, FIELDS, device)
    seed = _SeedStyle(num_rows, device)
    try:
        yield Sizes(
            f"{num_rows} requests x {len(FIELDS)} fields ({format_bytes(table.nbytes)} a "
            f"table); {_CALLS} steps a sample, {repeat} rounds"
        )
        plain = {name: np.zeros(num_rows, dtype) for name, dtype in FIELDS.items()}
        jax_device = device.jax()
        synchronize = device_synchronizer(device)
        temperature = table["temperature"].np

        def wait_driver(_: Any) -> None:
            synchronize()

        def wait_jax(arrays: Any) -> None:
            jax.block_until_ready(arrays)

        def changed_sync() -> None:
            temperature[0] = 1.0 - temperature[0]  # a request admitted: a value changes
            table.sync()

        def changed_seed() -> None:
            seed.np["temperature"][0] = 1.0 - seed.np["temperature"][0]
            seed.copy_to_gpu()

        def changed_put() -> Any:
            plain["temperature"][0] = 1.0 - plain["temperature"][0]
            return jax.device_put(plain, jax_device)

        calls = {
            "unchanged sync": _sampled(table.sync, wait_driver),
            "changed sync": _sampled(changed_sync, wait_driver),
            "unchanged seed": _sampled(seed.copy_to_gpu, wait_driver),
            "changed seed": _sampled(changed_seed, wait_driver),
            "unchanged put": _sampled(lambda: jax.device_put(plain, jax_device), wait_jax),
            "changed put": _sampled(changed_put, wait_jax),
        }
        for call in calls.values():  # warm: the slots, JAX's transfer path
            call()
        table.sync()
        if table.sync():
            raise AssertionError("kv.param_table: a sync with nothing changed copied")
        samples = {
            label: [s / _CALLS for s in times]
            for label, times in round_by_round_samples(calls, repeat).items()
        }
        yield from _rows(samples, device)
    finally:
        seed.close()
        table.close()
    yield from _jax_rows(device, quick, num_rows, repeat)


def _rows(samples: dict[str, list[float]], device: Any) -> Iterator[Row]:
    import statistics

    median = {label: statistics.median(times) for label, times in samples.items()}
    for step, target in (("unchanged", _UNCHANGED_TARGET), ("changed", _CHANGED_TARGET)):
        mine = samples[f"{step} sync"]
        not_here = ""
        if step == "changed" and not device.is_cuda:
            not_here = (
                "a GPU target: on the CPU a host-to-device copy is a memcpy of a few KiB "
                "that costs what the comparison does"
            )
        what = (
            "compares the host table with the last upload and copies nothing"
            if step == "unchanged"
            else "one copy of the whole table, against one per field"
        )
        common = {"step": step, "fields": len(FIELDS), "calls_per_sample": _CALLS}
        yield Row(
            f"param table sync, {step} step (jaxbuf)",
            median[f"{step} sync"],
            _SEED,
            median[f"{step} seed"],
            notes=f"DeviceParamTable.sync {what}",
            target=f"<= {target:g}x seed-style",
            met=median[f"{step} sync"] <= target * median[f"{step} seed"],
            limit=target,
            spread=ratio_spread(mine, samples[f"{step} seed"], paired=True),
            not_judged_here=not_here,
            params={**common, "kind": "param-table-seed"},
        )
        yield Row(
            f"param table sync, {step} step (jaxbuf)",
            median[f"{step} sync"],
            _DEVICE_PUT,
            median[f"{step} put"],
            notes="JAX's transfers, new device arrays every step",
            spread=ratio_spread(mine, samples[f"{step} put"], paired=True),
            params={**common, "kind": "param-table-device-put"},
        )


def _jax_rows(device: Any, quick: bool, num_rows: int, repeat: int) -> Iterator[Row]:
    """A changed sync plus the next ``arrays("jax")`` access against ``jnp.asarray`` of the
    same bytes, with 10,000 live JAX arrays, then with a long matmul in flight."""
    import jax
    import jax.numpy as jnp

    from jaxbuf import DeviceParamTable

    tables = {
        count: DeviceParamTable(num_rows, dict(list(_JAX_FIELDS.items())[:count]), device)
        for count in (1, len(_JAX_FIELDS))
    }
    try:
        cases = {count: _JaxCase(table) for count, table in tables.items()}
        for case in cases.values():
            case.warm()
        live = [jnp.zeros(1) + i for i in range(_LIVE_ARRAYS)]
        jax.block_until_ready(live)
        for case in cases.values():
            calls = {"sync": case.changed_sync, "asarray": case.asarray}
            if len(case.table) > 1:  # the same arrays a step gets, one upload each
                calls["fields"] = case.asarray_fields
            sampled = {
                label: _sampled(call, jax.block_until_ready) for label, call in calls.items()
            }
            samples = {
                label: [s / _CALLS for s in times]
                for label, times in round_by_round_samples(sampled, repeat).items()
            }
            yield case.row(samples, f"{_LIVE_ARRAYS:,} live JAX arrays", "live-arrays")
            if "fields" in samples:
                yield case.fields_row(samples, f"{_LIVE_ARRAYS:,} live JAX arrays")
        del live
        size = 2048 if quick else 4096
        matrix = jnp.full((size, size), 1e-3, jnp.float32)
        matmul = jax.jit(lambda a: a @ a)
        matmul(matrix).block_until_ready()
        rounds = 10 if quick else 20
        for case in cases.values():
            samples, in_flight = case.with_matmul(matmul, matrix, rounds)
            load = f"a {size}x{size} float32 matmul in flight"
            yield case.row(
                samples, load, "matmul-in-flight", in_flight=in_flight, calls=_MATMUL_CALLS
            )
    finally:
        for table in tables.values():
            table.close()


class _JaxCase:
    """One table's changed sync + JAX access, and the plain ``jnp.asarray`` of its bytes."""

    def __init__(self, table: Any) -> None:
        import numpy as np

        self.table = table
        self.params = table.arrays("jax")
        self.first = table[next(iter(table))].np
        self.plain = np.zeros(table.nbytes, np.uint8)  # the same bytes, for jnp.asarray

    def changed_sync(self) -> Any:
        import jax

        self.first[0] = 1 - self.first[0]  # a request admitted: a value changes
        self.table.sync()
        return jax.tree_util.tree_leaves(self.params)  # what a jitted step's argument takes

    def asarray(self) -> Any:
        import jax.numpy as jnp

        self.plain[0] ^= 1
        return jnp.asarray(self.plain)

    def asarray_fields(self) -> Any:
        import jax.numpy as jnp

        self.first[0] = 1 - self.first[0]
        return [jnp.asarray(field.np) for field in self.table.fields.values()]

    def fields_row(self, samples: dict[str, list[float]], load: str) -> Row:
        """The same sync against one ``jnp.asarray`` per field: the arrays a step gets."""
        import statistics

        fields = len(self.table)
        return Row(
            f"param table changed sync + arrays('jax'), {fields} field(s), {load} (jaxbuf)",
            statistics.median(samples["sync"]),
            f"plain JAX jnp.asarray of each field ({fields} arrays)",
            statistics.median(samples["fields"]),
            spread=ratio_spread(samples["sync"], samples["fields"], paired=True),
            params={"kind": "param-table-jax-per-field", "fields": fields},
        )

    def warm(self) -> None:
        import jax

        for _ in range(3):
            jax.block_until_ready(self.changed_sync())
            jax.block_until_ready(self.asarray())

    def with_matmul(
        self, matmul: Callable[[Any], Any], matrix: Any, rounds: int
    ) -> tuple[dict[str, list[float]], float]:
        """Per round: the matmul dispatched, then ``_MATMUL_CALLS`` calls of each (host time,
        in an order reversed every other round); then the share of rounds it was still
        running."""
        import time

        import jax

        calls = {"sync": self.changed_sync, "asarray": self.asarray}
        samples: dict[str, list[float]] = {label: [] for label in calls}
        running = 0
        for i in range(rounds):
            product = matmul(matrix)
            outputs = []
            for label in calls if i % 2 == 0 else reversed(list(calls)):
                call = calls[label]
                start = time.perf_counter()
                for _ in range(_MATMUL_CALLS):
                    outputs.append(call())
                samples[label].append((time.perf_counter() - start) / _MATMUL_CALLS)
            running += not product.is_ready()
            jax.block_until_ready((product, outputs))
        return samples, running / rounds

    def row(
        self,
        samples: dict[str, list[float]],
        load: str,
        kind: str,
        calls: int = _CALLS,
        **extra: Any,
    ) -> Row:
        import statistics

        mine, plain = statistics.median(samples["sync"]), statistics.median(samples["asarray"])
        fields = len(self.table)
        return Row(
            f"param table changed sync + arrays('jax'), {fields} field(s), {load} (jaxbuf)",
            mine,
            _ASARRAY,
            plain,
            notes=(
                "DeviceParamTable.sync (one copy into the device table, no wait for JAX), "
                "then every field's JAX array of the new values: one jitted transfer-and-slice "
                "dispatch from an immutable snapshot"
            ),
            target=f"<= {_JAX_TARGET:g}x plain JAX jnp.asarray",
            met=mine <= _JAX_TARGET * plain,
            limit=_JAX_TARGET,
            spread=ratio_spread(samples["sync"], samples["asarray"], paired=True),
            params={
                "kind": f"param-table-jax-{kind}",
                "fields": fields,
                "table_bytes": self.table.nbytes,
                "calls_per_sample": calls,
                **extra,
            },
        )
