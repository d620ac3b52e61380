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
# An unchanged step copies nothing: at most a quarter of what the seed's copies cost, on any
# device (judged on the CPU too).
_UNCHANGED_TARGET = 0.25
# A changed step is one copy of the table against one per field: no dearer than the seed's.
_CHANGED_TARGET = 1.0
_SEED = "seed-style per-step copy (a pinned UvaBackedTensor per field)"
_DEVICE_PUT = "jax.device_put of every field per step"


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


def _rows(samples: dict[str, list[float]], device: Any) -> Iterator[Row]:
    import statistics

    median = {label: statistics.median(times) for label, times in samples.items()}
    for step, target in (("unchanged", _UNCHANGED_TARGET), ("changed", _CHANGED_TARGET)):
        mine = samples[f"{step} sync"]
        not_here = ""
        if step == "changed" and not device.is_cuda:
            not_here = (
                "a GPU target: on the CPU a host-to-device copy is a memcpy of a few KiB "
                "that costs what the comparison does, and a changed step's upload first "
                "waits for JAX's pending work, which a GPU's stream order replaces"
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
