"""Benchmark of staged row writes applied inside ``jit``, baselines in-run.

Suite ``jax.staged``: writes of 16 int32 elements each into a donated 4096 x 4096 int32 JAX
array, at 256 and 4,096 writes, from the same Python inputs (lists of rows and starts, a list
of numpy arrays), against what a plain JAX user writes: the indices built in numpy and
``a.at[rows, cols].set(values)`` in a jitted, donated function. Rows:

* end to end, the library's fast path (sampled alternately with plain JAX's end to end, so
  host drift falls on both): :func:`jaxbuf.jax_ops.pack_writes` into a
  :class:`jaxbuf.jax_ops.PackRing` (pinned slots the apply reads in place, imported into JAX
  once) + :meth:`~jaxbuf.jax_ops.PackRing.apply` (a cached jitted, donated apply) +
  ``block_until_ready``, against the numpy index build + the jitted scatter +
  ``block_until_ready``; the targets: at most 1.0x plain JAX's time at 256 writes, at
  most 0.5x at 4,096;
* end to end with a fresh numpy buffer per pack instead (one host-to-device transfer per
  call): :func:`~jaxbuf.jax_ops.pack_writes` + the jitted apply
  (:func:`jaxbuf.jax_ops.apply_staged_writes`, donated), for each method;
* the host part alone: packing against the numpy index build;
* the jitted call alone, its inputs already on the device: the device's work plus one dispatch
  (JAX runs on its own stream, so CUDA events on another stream would not time it);
* the device time per apply, for each ``method`` (on a GPU ``"triton"``, ``"scatter"`` (the
  default) and the deprecated ``"pallas"``; on the CPU ``"scatter"``), and for the scatter on
  an unexpanded pack (what a GPU ring packs: indices computed in the apply), against plain JAX's
  ``a.at[r, c].set(v)``: 50 applies chained in one jitted function (unrolled: a ``fori_loop``
  adds a host round trip per iteration, about 15 µs on an H200, which hid the applies' own
  cost), inputs prebuilt on the device, so one dispatch is spread over 50 launches; the
  target on a GPU: the default apply of the ring's packs no slower than plain JAX.

The writes are disjoint, so the plain scatter's unspecified order among duplicates does not
matter (``pack_writes`` resolves overlaps, later writes winning). On a GPU the apply runs with
the library's default method (the XLA scatter) and with ``method="triton"``; on the CPU only
the scatter runs (the GPU kernel would run under an interpreter there). Both results are
checked against a numpy model before the rows are reported. Only the public
``jaxbuf.jax_ops`` API is used.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, ratio_spread, suite
from jaxbuf.bench._timing import measure, round_by_round, round_by_round_samples

SHAPE = (4096, 4096)
WRITE_LEN = 16
#: Number of writes -> jaxbuf's end-to-end time at most this many times plain JAX's.
_TARGETS = {256: 1.0, 4096: 0.5}
_PLAIN = "plain JAX: numpy indices + jitted a.at[r, c].set(v)"
#: Why the CPU does not judge the targets, which are set for a GPU.
_RING_ON_CPU = (
    "a GPU target: the ring saves each pack's host-to-device transfer (110-180 µs fixed on "
    "an H200); the CPU makes no such transfer, so the ring has nothing to save there"
)
_APPLY_ON_CPU = (
    "a GPU target: the apply's scatter drops padding (mode='drop', after mapping it out of "
    "range), which costs XLA's CPU scatter extra work per value (4,096 writes, 10 chained, "
    "JAX's own pool, a 2-core CPU: plain 158 µs, plain with mode='drop' 170 µs, the apply "
    "181 µs); on an H200 the apply is below plain JAX's time"
)
_UNEXPANDED_ON_CPU = (
    "what a GPU ring packs; on the CPU a ring packs expanded, the default there (4,096 "
    "writes, 10 chained, JAX's own pool, a 2-core CPU: 181 µs expanded, 329 µs unexpanded)"
)


def disjoint_writes(
    num_writes: int, seed: int = 0
) -> tuple[list[int], list[int], list[np.ndarray]]:
    """``(rows, starts, values)``: ``num_writes`` disjoint writes of :data:`WRITE_LEN` int32 at
    distinct aligned cells of a :data:`SHAPE` array (public: ``tools/experiments`` reuse it)."""
    rng = np.random.default_rng(seed)
    cells_per_row = SHAPE[1] // WRITE_LEN
    cells = rng.choice(SHAPE[0] * cells_per_row, num_writes, replace=False)
    rows = (cells // cells_per_row).tolist()
    starts = ((cells % cells_per_row) * WRITE_LEN).tolist()
    values = [
        rng.integers(0, 2**31, WRITE_LEN, dtype=np.int64).astype(np.int32)
        for _ in range(num_writes)
    ]
    return rows, starts, values


def _plain_indices(
    rows: list[int], starts: list[int], values: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a JAX user writes to scatter row writes of any length: flat row, column and
    value arrays, vectorised with numpy."""
    lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
    flat = np.concatenate(values)
    offsets = np.cumsum(lengths) - lengths
    row_index = np.repeat(np.asarray(rows, np.int32), lengths)
    column_index = np.repeat(np.asarray(starts, np.int64) - offsets, lengths)
    column_index += np.arange(flat.shape[0])
    return row_index, column_index.astype(np.int32), flat


def _methods(device: Any) -> list[tuple[str, dict[str, Any]]]:
    """(label, apply_staged_writes keyword arguments) to time: the library's default (the XLA
    scatter), and on a GPU also the Triton kernel through jax_triton."""
    if device.is_cuda:
        return [("default method", {}), ("triton", {"method": "triton"})]
    return [("default method", {})]


def _device_methods(device: Any) -> list[str]:
    """The ``method`` values whose device time per apply is measured: on a GPU the Triton
    kernel through jax_triton, the XLA scatter (the default) and the deprecated Pallas kernel,
    the numbers the default was chosen by; on the CPU the scatter, its only compiled path."""
    if device.is_cuda:
        return ["triton", "scatter", "pallas"]
    return ["scatter"]


def _rows_for(device: Any, num_writes: int, quick: bool) -> Iterator[Row]:
    import jax

    from jaxbuf.jax_ops import PackRing, apply_staged_writes, pack_writes

    cuda = device.is_cuda
    # The CPU's run stays short: fewer samples, and fewer chained applies to compile.
    repeat = 5 if quick else (10 if not cuda else 30 if num_writes <= 256 else 15)
    loop = 5 if quick else (50 if cuda else 10)  # applies per call in the device-time rows
    jax_device = device.jax()
    rows, starts, values = disjoint_writes(num_writes)
    expected = np.zeros(SHAPE, np.int32)
    for row, start, value in zip(rows, starts, values):
        expected[row, start : start + len(value)] = value

    def pack() -> Any:
        return pack_writes(rows, starts, values, "int32", shape=SHAPE)

    def indices() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _plain_indices(rows, starts, values)

    def timed(fn: Callable[[], Any]) -> float:
        return measure(fn, repeat=repeat, warmup=2).median_s

    def end_to_end(step: Callable[..., Any], make_inputs: Callable[[], Any]) -> tuple[float, Any]:
        """Median of building the inputs, the donated step and waiting for it; the array."""
        holder = [jax.device_put(np.zeros(SHAPE, np.int32), jax_device)]

        def call() -> None:
            holder[0] = step(holder[0], *make_inputs())
            holder[0].block_until_ready()

        return timed(call), holder

    def interleaved_end_to_end(candidates: dict[str, tuple[Callable[..., Any], Any]]) -> dict:
        """:func:`end_to_end` samples of each ``label: (step, make_inputs)``, taken round by
        round (the order reversed every other round) so that the host's drift, which on a
        shared GPU host moves one run's times by up to 2x, falls on every candidate alike.
        Each result is checked against the model."""
        calls, holders = {}, {}
        for label, (step, make_inputs) in candidates.items():
            holder = [jax.device_put(np.zeros(SHAPE, np.int32), jax_device)]

            def call(step: Any = step, make_inputs: Any = make_inputs, holder=holder) -> None:
                holder[0] = step(holder[0], *make_inputs())
                holder[0].block_until_ready()

            for _ in range(2):  # compile, warm up (a ring's slots are made on first use)
                call()
            calls[label], holders[label] = call, holder
        samples = round_by_round_samples(calls, repeat)
        for holder in holders.values():
            _check(holder[0], expected)
        return samples

    def inputs_on_device(step: Callable[..., Any], inputs: Any) -> float:
        prebuilt = jax.device_put(inputs, jax_device)
        holder = [jax.device_put(np.zeros(SHAPE, np.int32), jax_device)]

        def call() -> None:
            holder[0] = step(holder[0], *prebuilt)
            holder[0].block_until_ready()

        median = timed(call)
        _check(holder[0], expected)
        return median

    def device_times_per_apply(candidates: dict[str, tuple[Callable[..., Any], Any]]) -> dict:
        """Device time of one apply for each ``label: (apply, inputs)``: ``loop`` applies
        chained in one jitted, donated function (unrolled) over inputs prebuilt on the device
        (one dispatch spread over ``loop`` launches), the median call divided by ``loop``.
        Each apply depends on the previous array, so XLA can neither hoist nor drop one. The
        candidates are timed round by round, in an order reversed every other round, so
        drift falls on all alike. A candidate that cannot run maps to its ImportError."""
        calls: dict[str, Callable[[], None]] = {}
        errors: dict[str, ImportError] = {}
        for label, (apply, inputs) in candidates.items():
            try:
                prebuilt = jax.device_put(inputs, jax_device)

                def chained(a: Any, *xs: Any, apply: Any = apply) -> Any:
                    for _ in range(loop):
                        a = apply(a, *xs)
                    return a

                looped = jax.jit(chained, donate_argnums=0)
                holder = [jax.device_put(np.zeros(SHAPE, np.int32), jax_device)]

                def call(looped: Any = looped, prebuilt: Any = prebuilt, holder=holder) -> None:
                    holder[0] = looped(holder[0], *prebuilt)
                    holder[0].block_until_ready()

                for _ in range(2):  # compile, warm up
                    call()
                _check(holder[0], expected)  # the same writes again leave the same array
            except ImportError as error:  # method="triton" where jax_triton cannot run
                errors[label] = error
                continue
            calls[label] = call
        medians = round_by_round(calls, repeat)
        return {
            label: errors[label] if label in errors else medians[label] / loop
            for label in candidates
        }

    plain_step = jax.jit(lambda a, r, c, v: a.at[r, c].set(v), donate_argnums=0)
    plain_device_s = inputs_on_device(plain_step, indices())
    pack_s = timed(pack)
    index_s = timed(indices)

    name = f"{num_writes:,} writes"
    factor = _TARGETS.get(num_writes)
    label, kwargs = _methods(device)[0]  # the library's default method
    with PackRing(device=device) as ring:

        def ring_step(array: Any, packed: Any) -> Any:
            return ring.apply(array, packed, **kwargs)

        def ring_pack() -> tuple[Any]:
            return (pack_writes(rows, starts, values, "int32", shape=SHAPE, ring=ring),)

        # The fast path and plain JAX, sampled alternately: the target is their ratio.
        samples = interleaved_end_to_end(
            {"ring": (ring_step, ring_pack), "plain": (plain_step, indices)}
        )
        ring_s, plain_s = (statistics.median(samples[key]) for key in ("ring", "plain"))
    row = Row(
        f"pack into the pinned ring + apply {name}, end to end ({label})",
        ring_s,
        f"{_PLAIN}, end to end",
        plain_s,
        notes="PackRing: the apply reads the packed writes in place; both wait for the array "
        "(block_until_ready); donated; the two sampled alternately; JAX allocator: "
        + os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default (pool)"),
        params={
            "num_writes": num_writes,
            "kind": "jax-staged-end-to-end",
            "method": label,
            "path": "pinned ring",
        },
    )
    if factor is not None:  # the target, for the library's fast path
        row.target = f"<= {factor:g}x plain JAX"
        row.met = ring_s <= factor * plain_s
        row.limit = factor
        row.spread = ratio_spread(samples["ring"], samples["plain"], paired=True)
        row.not_judged_here = "" if cuda else _RING_ON_CPU
    yield row
    for label, kwargs in _methods(device):
        step = jax.jit(
            lambda a, p, kwargs=kwargs: apply_staged_writes(a, p, **kwargs), donate_argnums=0
        )
        jaxbuf_s, jaxbuf_array = end_to_end(step, lambda: (pack(),))
        _check(jaxbuf_array[0], expected)
        del jaxbuf_array
        device_s = inputs_on_device(step, (pack(),))
        yield Row(
            f"pack_writes + apply {name}, end to end ({label})",
            jaxbuf_s,
            f"{_PLAIN}, end to end",
            plain_s,
            notes="a fresh numpy buffer per pack, transferred by each call; both wait for the "
            "array (block_until_ready); donated",
            params={
                "num_writes": num_writes,
                "kind": "jax-staged-end-to-end",
                "method": label,
                "path": "numpy buffer",
            },
        )
        yield Row(
            f"jitted apply {name}, inputs on the device ({label})",
            device_s,
            "plain JAX: jitted a.at[r, c].set(v), inputs on the device",
            plain_device_s,
            notes="the call and block_until_ready: device time plus one dispatch",
            params={"num_writes": num_writes, "kind": "jax-staged-apply", "method": label},
        )
    # The target for the apply on the GPU: device time no slower than plain JAX's
    # scatter, for the default method (the XLA scatter from the packed writes) on what the
    # fast path packs: a GPU ring's packs are unexpanded (indices computed in the apply).
    candidates = {"plain": (lambda a, r, c, v: a.at[r, c].set(v), indices())}
    for method in _device_methods(device):
        candidates[method] = (lambda a, p, m=method: apply_staged_writes(a, p, method=m), (pack(),))
    unexpanded = pack_writes(rows, starts, values, "int32", shape=SHAPE, expand=False)
    candidates["scatter, unexpanded"] = (
        lambda a, p: apply_staged_writes(a, p, method="scatter"),
        (unexpanded,),
    )
    ring_packs = "scatter, unexpanded" if device.is_cuda else "scatter"
    device_times = device_times_per_apply(candidates)
    plain_apply_s = device_times.pop("plain")
    for method, apply_s in device_times.items():
        params = {"num_writes": num_writes, "kind": "jax-staged-device", "method": method}
        if isinstance(apply_s, BaseException):
            apply_s, params["skipped"] = None, str(apply_s)
        what = (
            "method='scatter' on an unexpanded pack (indices computed on the device)"
            if method == "scatter, unexpanded"
            else f"method={method!r}"
        )
        row = Row(
            f"jitted apply {name}, device time per apply ({what})",
            apply_s,
            "plain JAX: a.at[r, c].set(v), device time per apply",
            plain_apply_s,
            notes=f"{loop} applies chained in one jitted function, inputs prebuilt on the device"
            + ("; " + _UNEXPANDED_ON_CPU if method == "scatter, unexpanded" and not cuda else "")
            if apply_s is not None
            else f"skipped: {params['skipped']}",
            params=params,
        )
        if method == ring_packs and apply_s is not None:
            row.target = "<= 1x plain JAX"
            row.met = apply_s <= plain_apply_s
            row.not_judged_here = "" if cuda else _APPLY_ON_CPU
        yield row
    yield Row(
        f"pack_writes {name} (host)",
        pack_s,
        "plain JAX: numpy index build (host)",
        index_s,
        notes="the host part of the end-to-end rows",
        params={"num_writes": num_writes, "kind": "jax-staged-pack"},
    )


def _check(array: Any, expected: np.ndarray) -> None:
    """A guard for the numbers: the applied writes match the numpy model."""
    if not np.array_equal(np.asarray(array), expected):
        raise AssertionError("jax.staged: the array after the writes differs from the model")


@suite("jax.staged", requires=("jax",))
def staged_suite(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Row writes packed and applied inside jit on a donated JAX array, against plain JAX's
    numpy indices and scatter from the same Python inputs."""
    sizes = (256, 4096)
    yield Sizes(
        " and ".join(f"{n:,}" for n in sizes)
        + f" writes of {WRITE_LEN} int32 into a {SHAPE[0]} x {SHAPE[1]} int32 array"
    )
    for num_writes in sizes:
        yield from _rows_for(device, num_writes, quick)
