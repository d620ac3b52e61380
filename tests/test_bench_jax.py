"""The JAX benchmark suites (``jax.views``, ``jax.staged``, ``jax.decode``, ``jax.paged_decode``):
run quickly through
``python -m jaxbuf bench --only jax`` on the CPU, rows well-formed with their baselines, the
decode plot written; the decode loop's bookkeeping checked on small plans, in JAX and torch
(``torch.decode``) over the public KV cache API; the ``kv.param_table`` rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CUDA_REASON, JAX_REASON, TORCH_REASON

from jaxbuf.bench import Row, load_suites
from jaxbuf.devices import as_device

needs_jax = pytest.mark.skipif(JAX_REASON is not None, reason=JAX_REASON or "")
needs_torch = pytest.mark.skipif(TORCH_REASON is not None, reason=TORCH_REASON or "")
PNG = b"\x89PNG\r\n\x1a\n"
# One worker runs this module under `-n auto --dist loadgroup` (ONE_WORKER in conftest.py):
# its bench run (a module fixture, minutes on a loaded CPU) is made once, not once per worker.
SUITES = ("jax.decode", "jax.paged_decode", "jax.staged", "jax.views")


def run_bench(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "jaxbuf", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=environment,
    )


def check_row(row: dict) -> None:
    """A measured row with its baseline from the same run; a target is judged."""
    assert row["name"] and row["baseline_name"], row
    assert row["median_s"] is not None and math.isfinite(row["median_s"]) and row["median_s"] > 0
    assert row["baseline_median_s"] is not None and row["baseline_median_s"] > 0, row
    assert row["ratio"] == pytest.approx(row["median_s"] / row["baseline_median_s"])
    if row["target"]:
        assert ">=" not in row["target"], row  # targets point the ratio's way
        assert isinstance(row["target_reached"], bool), row
        # A --quick run reports its figures against the targets but judges only the targets
        # that hold at any size (the decode loop's memory bound).
        assert row["met"] == (row["target_reached"] if row["size_independent"] else None), row
    else:
        assert row["met"] is None, row


@pytest.fixture(scope="module")
def jax_bench(tmp_path_factory):
    """One ``bench --only jax --quick --device cpu --plot`` run: (result, JSON, directory)."""
    if JAX_REASON is not None:
        pytest.skip(JAX_REASON)
    pytest.importorskip("matplotlib")
    cwd = tmp_path_factory.mktemp("jax-bench")
    result = run_bench("--only", "jax", "--quick", "--device", "cpu", "--plot", cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    # A run of --only suites writes its own file, never the full run's bench-cpu.json.
    assert not (cwd / "results" / "bench-cpu.json").exists()
    document = json.loads((cwd / "results" / "bench-cpu-jax.json").read_text())
    return result, document, cwd


def suite_rows(document: dict, name: str) -> list[dict]:
    by_name = {s["name"]: s for s in document["suites"]}
    assert by_name[name]["error"] is None and by_name[name]["skipped"] is None, by_name[name]
    assert by_name[name]["sizes"], name
    return by_name[name]["rows"]


def test_suites_are_registered_and_need_jax():
    suites = load_suites()
    for name in SUITES:
        assert name in suites, sorted(suites)
        assert suites[name].requires == (
            ("jax", "torch") if name == "jax.paged_decode" else ("jax",)
        )
        assert suites[name].description and "\n" not in suites[name].description


def test_only_jax_runs_the_three_suites_and_writes_the_decode_plot(jax_bench):
    result, document, cwd = jax_bench
    assert [s["name"] for s in document["suites"]] == list(SUITES)
    assert "Traceback" not in result.stderr and "FAILED" not in result.stdout
    for name in SUITES:
        assert name in result.stdout
        if name == "jax.paged_decode" and TORCH_REASON is not None:
            continue  # skipped, saying it needs torch
        for row in suite_rows(document, name):
            if row["baseline_name"]:
                assert row["median_s"] > 0
    # No growth rows in this run: the decode plot alone, at its default path.
    assert (cwd / "results" / "decode-cpu.png").read_bytes()[:8] == PNG
    assert not (cwd / "results" / "growth-cpu.png").exists()
    assert f"plot: {Path('results') / 'decode-cpu.png'}" in result.stdout
    # jax.decode puts this process on JAX's platform allocator: the hot-path suites run in a
    # process of their own, on JAX's pool, and the command says so instead of warning.
    assert "warning" not in result.stderr, result.stderr
    words = " ".join(result.stdout.split())
    hot = (
        "jax.paged_decode, jax.staged, jax.views"
        if TORCH_REASON is None
        else "jax.staged, jax.views"
    )
    assert f"{hot} run in a process of their own, on JAX's own memory pool" in words
    apart = {s["name"]: s["own_process"] for s in document["suites"]}
    assert apart == {
        "jax.decode": False,
        "jax.paged_decode": TORCH_REASON is None,
        "jax.staged": True,
        "jax.views": True,
    }
    # Row names are printed as text, not rich markup ("[r, c]" would vanish).
    assert "a.at[r, c].set(v)" in " ".join(result.stdout.split())


def test_views_rows(jax_bench):
    rows = suite_rows(jax_bench[1], "jax.views")
    for row in rows:
        if TORCH_REASON is None or row["params"].get("baseline_kind") != "torch":
            check_row(row)
    names = {(row["name"], row["baseline_name"]) for row in rows}
    assert ("view.to_jax()", "jax.dlpack.from_dlpack(torch tensor)") in names
    assert ("view.to_jax()", "jax.dlpack.from_dlpack(JAX array)") in names
    assert (
        "UvaBufferPool(framework='jax').copy_to_uva(metadata)",
        "jax.device_put(metadata)",
    ) in names


def test_staged_rows(jax_bench):
    rows = suite_rows(jax_bench[1], "jax.staged")
    for row in rows:
        check_row(row)
    for num_writes, factor in ((256, 1.0), (4096, 0.5)):
        mine = [row for row in rows if row["params"]["num_writes"] == num_writes]
        kinds = {row["params"]["kind"] for row in mine}
        assert kinds == {
            "jax-staged-end-to-end",
            "jax-staged-apply",
            "jax-staged-device",
            "jax-staged-pack",
        }
        device_rows = [r for r in mine if r["params"]["kind"] == "jax-staged-device"]
        # Device time per apply: on the CPU the scatter only, on expanded and unexpanded
        # packs; the target (on what the ring packs here: expanded) is the GPU's, shown and
        # not judged on the CPU, with the reason.
        assert [r["params"]["method"] for r in device_rows] == ["scatter", "scatter, unexpanded"]
        assert device_rows[0]["target"] == "<= 1x plain JAX" and device_rows[1]["target"] == ""
        assert device_rows[0]["met"] is None
        assert device_rows[0]["not_judged_here"].startswith("a GPU target: ")
        assert device_rows[0]["not_judged_reason"] == device_rows[0]["not_judged_here"]
        assert "chained in one jitted function" in device_rows[0]["notes"]
        assert "a ring packs expanded" in device_rows[1]["notes"]
        end_to_end = [r for r in mine if r["params"]["kind"] == "jax-staged-end-to-end"]
        assert [r["params"]["method"] for r in end_to_end] == ["default method"] * 2  # the scatter
        # The library's fast path (the pinned PackRing) carries the target; the fresh numpy
        # buffer per pack is kept for comparison.
        assert [r["params"]["path"] for r in end_to_end] == ["pinned ring", "numpy buffer"]
        row = end_to_end[0]
        assert row["target"] == f"<= {factor:g}x plain JAX"
        reached = row["median_s"] <= factor * row["baseline_median_s"]
        assert row["target_reached"] == reached and row["met"] is None
        assert "no such transfer" in row["not_judged_reason"]  # a GPU target, said why
        low, high = row["spread"]  # the paired ratios' quartiles
        assert 0 < low <= high
        assert end_to_end[1]["target"] == "" and end_to_end[1]["met"] is None


def test_decode_rows_series_and_memory(jax_bench):
    from jaxbuf.bench._decode_plan import _plan

    rows = suite_rows(jax_bench[1], "jax.decode")
    for row in rows:
        if row["baseline_name"]:
            check_row(row)
    plan = _plan(as_device("cpu"), True)
    profiles = [row["params"]["profile"] for row in rows if row["params"]["kind"] == "decode-step"]
    assert profiles == ["short", "long", "mixed"]
    for profile in profiles:
        mine = {row["params"]["kind"]: row for row in rows if row["params"]["profile"] == profile}
        assert set(mine) == {
            "decode-step",
            "decode-step-realloc",
            "decode-memory",
            "decode-spike",
            "decode-spike-realloc",
        }
        step = mine["decode-step"]
        assert step["target"] == "<= 1.1x preallocated"
        # The CPU's write path is not the GPU's: the time targets say so, unjudged.
        for kind in ("decode-step", "decode-spike"):
            assert mine[kind]["not_judged_here"].startswith("a GPU target: "), kind
        # A time row judges time, the memory row bytes: no row pairs the two.
        assert not mine["decode-step-realloc"]["target"]
        assert mine["decode-memory"]["median_s"] is None and mine["decode-memory"]["value"]
        assert not mine["decode-memory"]["baseline_name"]
        # The CPU copies a donated import: KVCacheStep writes the committed blocks back.
        assert step["params"]["write_path"] == "write-back"
        assert step["params"]["framework"] == "jax"
        assert "KVCacheStep copies the committed blocks back" in step["notes"]
        # One compiled step for every grow and profile: nothing compiled while timed.
        assert "compiled inside the timed run" not in step["notes"]
        steps = step["params"]["steps"]
        series = step["params"]["series"]
        assert set(series) == {"jaxbuf", "preallocated", "realloc"}
        for variant, values in series.items():
            assert len(values["step_s"]) == len(values["held_bytes"]) == steps, variant
            assert min(values["step_s"]) > 0
            assert step["params"]["max_s"][variant] == pytest.approx(max(values["step_s"]))
        needed = step["params"]["needed_bytes"]
        assert len(needed) == steps and needed == sorted(needed)  # pages only accumulate
        # The preallocated cache holds the maximum throughout; realloc+copy holds its array
        # (old + new on a copy), never less than the tokens need; jaxbuf holds what the
        # driver committed, within one growth step of the tokens' pages.
        total = plan.total_blocks * plan.block_bytes
        assert set(series["preallocated"]["held_bytes"]) == {total}
        assert all(h >= n for h, n in zip(series["realloc"]["held_bytes"], needed))
        memory = mine["decode-memory"]
        bound = [n + step["params"]["growth_step_bytes"] for n in needed[1:] + needed[-1:]]
        assert memory["met"] == all(h <= b for h, b in zip(series["jaxbuf"]["held_bytes"], bound))
        assert memory["met"] is True  # a memory bound: judged at quick sizes too
        assert mine["decode-spike"]["median_s"] == pytest.approx(max(series["jaxbuf"]["step_s"]))
    long_realloc = next(
        r for r in rows if r["params"]["kind"] == "decode-step" and r["params"]["profile"] == "long"
    )["params"]["series"]["realloc"]
    # A copy holds old and new at once: the peak exceeds the final array.
    assert max(long_realloc["held_bytes"]) > long_realloc["held_bytes"][-1]


@needs_torch
def test_paged_decode_rows(jax_bench):
    """jax.paged_decode: per capacity, the median step against the preallocated donated
    cache (target 1.2x, reported and not judged at quick sizes) and the bytes held, judged:
    the committed blocks in whole granules, under the capacity from 1,024 blocks on. The
    suite checked the two caches' logits and committed blocks equal before reporting."""
    from jaxbuf import granule_size
    from jaxbuf.bench._paged_model import PagedConfig

    rows = suite_rows(jax_bench[1], "jax.paged_decode")
    config = PagedConfig()
    kinds = [(row["params"]["capacity_blocks"], row["params"]["kind"]) for row in rows]
    assert kinds == [
        (capacity, kind)
        for capacity in (64, 1024, 4096)
        for kind in ("paged-decode-step", "paged-decode-memory")
    ]
    for step, memory in zip(rows[::2], rows[1::2]):
        check_row(step)
        capacity = step["params"]["capacity_blocks"]
        assert step["baseline_name"] == "preallocated JAX cache, donated, median step"
        assert step["target"] == "<= 1.2x preallocated" and step["not_judged_reason"] == (
            "quick sizes"
        )
        assert "equal, bit for bit" in step["notes"]
        # The CPU copies a donated import: the step runs over a bucket of the committed
        # blocks, the smallest power of two at or above them, never the capacity.
        assert step["params"]["write_path"] == "bucket, copied back"
        last = step["params"]["blocks_committed"][-1]
        assert step["params"]["step_blocks"] == min(capacity, 1 << (last - 1).bit_length())
        held = step["params"]["bytes_held"]
        assert set(held["preallocated"]) == {capacity * config.block_bytes}
        blocks = step["params"]["blocks_committed"]
        assert blocks == sorted(blocks) and 8 <= blocks[-1] <= 16, blocks
        assert memory["median_s"] is None and memory["met"] is True  # judged at any size
        assert max(held["jaxbuf"]) <= 4 * granule_size("cpu")
        if capacity >= 1024:
            assert max(held["jaxbuf"]) < capacity * config.block_bytes


# -- the decode loop's pieces, on small plans ------------------------------------------------
def small_plan():
    from jaxbuf import granule_size
    from jaxbuf.bench._decode_plan import _Plan

    return _Plan(3, 1, 8, 4, 16, 2, granule_size("cpu"))


@pytest.mark.parametrize("profile", ["short", "long", "mixed"])
def test_decode_schedule_pages_and_slots(profile):
    from jaxbuf.bench._decode_plan import _final_lengths, _schedule

    plan = small_plan()
    schedule = _schedule(plan, profile)
    finals = _final_lengths(plan, profile)
    assert schedule.steps == max(finals)
    assert schedule.meta[-1, :, 0].tolist() == finals
    table = np.zeros((plan.num_seqs, plan.blocks_per_seq), np.int64)
    for n in range(schedule.steps):
        rows, columns, pages = schedule.writes[n]
        table[rows, columns] = pages
        lengths, slots = schedule.meta[n, :, 0], schedule.meta[n, :, 1]
        for s in range(plan.num_seqs):
            active = n < finals[s]
            if active:  # the token at position n sits on the page the table names
                assert lengths[s] == n + 1
                assert slots[s] == table[s, n // plan.block] * plan.block + n % plan.block
            else:
                assert lengths[s] == finals[s] and slots[s] < plan.block  # the scratch page
        active_slots = [slots[s] for s in range(plan.num_seqs) if n < finals[s]]
        assert len(set(active_slots)) == len(active_slots)
        assert schedule.pages[n] == 1 + np.count_nonzero(table)
    expected_pages = sum(-(-f // plan.block) for f in finals)
    assert schedule.pages[-1] == 1 + expected_pages


def test_decode_plan_growth_step_is_whole_blocks_and_granules():
    from jaxbuf.bench._decode_plan import _Plan

    granule = 2 << 20
    gpu_like = _Plan(32, 8, 128, 16, 2048, 8, granule)
    assert gpu_like.block_bytes == 128 << 10
    assert gpu_like.growth_blocks * gpu_like.block_bytes % granule == 0
    assert gpu_like.growth_step_bytes == gpu_like.growth_blocks * gpu_like.block_bytes
    assert gpu_like.capacity(1) == gpu_like.growth_blocks
    assert gpu_like.capacity(gpu_like.total_blocks) == gpu_like.total_blocks  # capped
    assert gpu_like.capacity(gpu_like.growth_blocks + 1) == 2 * gpu_like.growth_blocks
    tiny = small_plan()  # a growth step smaller than a granule: whole blocks, plus rounding
    step = tiny.growth_blocks * tiny.block_bytes
    assert step < granule and tiny.growth_step_bytes == step + granule


def _jax_runs(plan, profiles):
    """Every variant of jax.decode over ``profiles``, one jaxbuf state (one KVCacheStep)."""
    from jaxbuf.bench._decode_plan import VARIANTS, _schedule
    from jaxbuf.bench.jax_decode import _Jaxbuf, _Model, _run

    model = _Model(plan, as_device("cpu"))
    state = _Jaxbuf(model)
    try:
        return (
            model,
            state.step.in_place,
            [{v: _run(model, state, v, _schedule(plan, p)) for v in VARIANTS} for p in profiles],
        )
    finally:
        state.close()


@needs_jax
def test_jax_decode_over_the_kv_cache_agrees_with_the_preallocated_cache():
    """jaxbuf's cache (ExtensibleKVCacheBuffers under a KVCacheStep, metadata from a
    DeviceParamTable) computes what the plain JAX caches do, commits blocks as the schedule
    needs them, and keeps one compiled step across grows and profiles."""
    plan = small_plan()
    _, in_place, runs = _jax_runs(plan, ["long", "mixed", "short"])
    assert in_place is False  # the CPU client copies a donated import: the write-back path
    for profile_runs in runs:
        preallocated = profile_runs["preallocated"]
        for variant in ("jaxbuf", "realloc"):
            run = profile_runs[variant]
            np.testing.assert_array_equal(run.block_table, preallocated.block_table)
            np.testing.assert_allclose(run.out, preallocated.out, rtol=1e-5, atol=1e-5)
        assert set(profile_runs["jaxbuf"].held_bytes) == {plan.granule}  # one granule holds it
    # The first profile compiled the step (once); the later ones, and every grow, reuse it.
    assert [r["jaxbuf"].compiles for r in runs][1:] == [0, 0]


@needs_torch
def test_torch_decode_over_the_kv_cache_agrees_with_jax_and_its_baselines():
    """torch.decode: the same loop through the cache's torch view and the table's torch
    fields; its variants agree with each other and with jax.decode's output."""
    from jaxbuf.bench._decode_plan import VARIANTS, _schedule
    from jaxbuf.bench.torch_decode import _Model, _run

    plan = small_plan()
    model = _Model(plan, as_device("cpu"))
    for profile in ("mixed", "long"):
        schedule = _schedule(plan, profile)
        runs = {v: _run(model, v, schedule) for v in VARIANTS}
        for variant in ("jaxbuf", "realloc"):
            np.testing.assert_array_equal(
                runs[variant].block_table, runs["preallocated"].block_table
            )
            np.testing.assert_allclose(
                runs[variant].out, runs["preallocated"].out, rtol=1e-5, atol=1e-5
            )
        assert len(runs["jaxbuf"].held_bytes) == schedule.steps
    if JAX_REASON is None:  # the same math in both frameworks
        _, _, jax_runs = _jax_runs(plan, ["long"])
        np.testing.assert_allclose(
            runs["jaxbuf"].out, jax_runs[0]["jaxbuf"].out, rtol=1e-4, atol=1e-4
        )


@needs_torch
def test_torch_decode_suite_rows(monkeypatch):
    from jaxbuf.bench import torch_decode

    suite = load_suites()["torch.decode"]
    assert suite.requires == ("torch",)
    monkeypatch.setattr(torch_decode, "_plan", lambda device, quick: small_plan())
    rows = [row for row in suite.run(as_device("cpu"), True) if isinstance(row, Row)]
    kinds = [row.params["kind"] for row in rows]
    assert (
        kinds
        == [
            "decode-step",
            "decode-step-realloc",
            "decode-memory",
            "decode-spike",
            "decode-spike-realloc",
        ]
        * 3
    )
    step = rows[0]
    assert step.params["framework"] == "torch" and step.name.startswith("torch decode short")
    assert step.baseline_name == "preallocated torch cache, median step"
    assert step.not_judged_here.startswith("a GPU target: ")
    assert rows[1].baseline_name == "torch realloc+copy cache, median step"
    assert all(row.met for row in rows if row.params["kind"] == "decode-memory")


@needs_jax
def test_param_table_rows():
    """kv.param_table: unchanged and changed steps, each against the seed's per-field copies
    (the target) and jax.device_put (for comparison), from the same rounds; then a changed
    sync plus the JAX arrays of its values against jnp.asarray of the same bytes, beside
    10,000 live arrays and beside a long matmul in flight."""
    suite = load_suites()["kv.param_table"]
    rows = [row for row in suite.run(as_device("cpu"), True) if isinstance(row, Row)]
    rows, jax_rows = rows[:4], rows[4:]
    assert [(row.params["step"], row.params["kind"]) for row in rows] == [
        ("unchanged", "param-table-seed"),
        ("unchanged", "param-table-device-put"),
        ("changed", "param-table-seed"),
        ("changed", "param-table-device-put"),
    ]
    assert [(row.params["kind"], row.params["fields"]) for row in jax_rows] == [
        ("param-table-jax-live-arrays", 1),
        ("param-table-jax-live-arrays", 8),
        ("param-table-jax-per-field", 8),
        ("param-table-jax-matmul-in-flight", 1),
        ("param-table-jax-matmul-in-flight", 8),
    ]
    per_field = jax_rows.pop(2)  # the same 8 arrays uploaded one by one: a comparison
    assert per_field.target == "" and per_field.baseline_name.endswith("(8 arrays)")
    assert per_field.median_s > 0 and per_field.baseline_median_s > 0
    for row in jax_rows:
        assert row.target == "<= 2x plain JAX jnp.asarray" and row.limit == 2.0
        assert row.baseline_name.startswith("plain JAX jnp.asarray")
        assert row.median_s > 0 and row.baseline_median_s > 0
    assert all(0 <= row.params["in_flight"] <= 1 for row in jax_rows[2:])
    for row in rows:
        assert row.median_s > 0 and row.baseline_median_s > 0
        low, high = row.spread
        assert 0 < low <= high
    unchanged, _, changed, _ = rows
    assert (
        unchanged.baseline_name.startswith("seed-style")
        and unchanged.target == "<= 0.25x seed-style"
    )
    assert unchanged.not_judged_here == ""  # copying nothing is cheaper on any device
    assert changed.target == "<= 1x seed-style"
    assert changed.not_judged_here.startswith("a GPU target: ")
    assert rows[1].baseline_name.startswith("jax.device_put") and not rows[1].target
    # An unchanged step copies nothing: far below a step that copies.
    assert unchanged.median_s < changed.median_s


def test_param_table_seed_style_copies_every_field():
    """The seed-style baseline moves each field's host values to its device array."""
    from jaxbuf.bench.kv_param_table import FIELDS, _SeedStyle

    seed = _SeedStyle(16, as_device("cpu"))
    try:
        for i, name in enumerate(FIELDS):
            seed.np[name][:] = i + 1
        seed.copy_to_gpu()
        for i, (column, host) in enumerate(zip(seed.devices, seed.hosts)):
            got = column.segment_view(0).to_numpy()[: host.nbytes].view(host.np.dtype)
            assert (got == i + 1).all()
    finally:
        seed.close()


# -- the plot ----------------------------------------------------------------------------------
def decode_result(profiles=("short", "long")) -> list[dict]:
    rows = []
    for profile in profiles:
        series = {
            variant: {"step_s": [1e-3, 2e-3, 1e-3], "held_bytes": [1 << 20, 2 << 20, 2 << 20]}
            for variant in ("jaxbuf", "preallocated", "realloc")
        }
        params = {
            "kind": "decode-step",
            "profile": profile,
            "series": series,
            "needed_bytes": [1 << 20, 1 << 20, 2 << 20],
        }
        rows.append(Row(f"decode {profile}", 1e-3, "b", 1e-3, params=params).to_json())
        rows.append(Row("other", 1e-3, params={"kind": "decode-memory"}).to_json())
    return [{"name": "jax.decode", "rows": rows}]


def test_plot_decode_draws_each_profile(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxbuf.cli._plots import _plot_decode

    path = tmp_path / "sub" / "decode.png"
    assert _plot_decode(decode_result(), path, as_device("cpu")) is True
    assert path.read_bytes()[:8] == PNG
    assert _plot_decode([{"name": "x", "rows": []}], tmp_path / "none.png", "cpu") is False
    assert not (tmp_path / "none.png").exists()


def test_plot_paths():
    from jaxbuf.cli._plots import PLOT_DEFAULT, _plot_paths

    cpu = "cpu"
    assert _plot_paths(PLOT_DEFAULT, cpu, ["growth", "decode"]) == {
        "growth": Path("results/growth-cpu.png"),
        "decode": Path("results/decode-cpu.png"),
    }
    # An explicit path names the first plot drawn; the other goes beside it.
    assert _plot_paths("out/p.png", cpu, ["growth", "decode"]) == {
        "growth": Path("out/p.png"),
        "decode": Path("out/p-decode.png"),
    }
    assert _plot_paths("out/p.png", cpu, ["decode"]) == {"decode": Path("out/p.png")}
    assert _plot_paths("out/p.png", cpu, []) == {}


@needs_jax
def test_views_without_torch_keeps_its_rows_unjudged(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # ``import torch`` raises ImportError
    rows = list(load_suites()["jax.views"].run(as_device("cpu"), True))
    torch_rows = [row for row in rows if row.params.get("baseline_kind") == "torch"]
    assert len(torch_rows) == 2
    for row in torch_rows:
        assert row.baseline_skipped and "torch is not installed" in row.notes
        assert row.median_s > 0 and row.judged is None
    jax_row = next(row for row in rows if row.params.get("baseline_kind") == "jax")
    assert jax_row.baseline_median_s > 0


@pytest.mark.gpu
def test_jax_suites_on_the_gpu(tmp_path):
    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    if JAX_REASON is not None:
        pytest.skip(JAX_REASON)
    result = run_bench(
        "--only",
        "jax",
        "--quick",
        "--device",
        "cuda",
        "--json",
        "b.json",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    document = json.loads((tmp_path / "b.json").read_text())
    for name in SUITES:
        for row in suite_rows(document, name):
            if row["baseline_name"]:
                check_row(row)
    decode = suite_rows(document, "jax.decode")
    assert {row["params"]["write_path"] for row in decode} == {"donate"}


def test_round_by_round_alternates_the_order_and_takes_each_median():
    """The sampler the ratio targets use: every round calls each candidate once, the order
    reversed every other round, and each candidate's median comes from its own samples."""
    from jaxbuf.bench._timing import round_by_round

    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    medians = round_by_round(calls, repeat=4)
    assert order == list("abccbaabccba")
    assert set(medians) == {"a", "b", "c"} and all(m >= 0 for m in medians.values())
