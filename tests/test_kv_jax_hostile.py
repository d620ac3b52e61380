"""Hostile use of the JAX wings of the KV cache: ``KVCacheStep`` and ``DeviceParamTable``'s
JAX mapping under interrupts at every line, a ``fn`` that releases or frees the cache under
the step, failing in-place steps, jit options of odd types, mappings read inside traces or
carried through loops; and the flagship decode's agreement check, which must not pass
without comparing."""

from __future__ import annotations

import functools
import sys
import textwrap
import warnings

import numpy as np
import pytest

from jaxbuf import DeviceParamTable, ExtensibleKVCacheBuilder
from jaxbuf._errors import ClosedError

jax = pytest.importorskip("jax")
jnp = jax.numpy

import _forkserver  # noqa: E402

from jaxbuf.bench import _paged_model  # noqa: E402
from jaxbuf.kv import KVCacheStep, _jax_step, _jax_table, _param_table  # noqa: E402


@pytest.fixture(autouse=True)
def _no_debug_from_the_environment(monkeypatch):
    monkeypatch.delenv("JAXBUF_DEBUG", raising=False)


CAPACITY = 16
BLOCK = 16  # float32 elements of one block of one segment
SEGMENTS = 2


def _cache(committed=1):
    builder = ExtensibleKVCacheBuilder(CAPACITY, "cpu")
    builder.reserve(CAPACITY * BLOCK * 4 * SEGMENTS, SEGMENTS)
    kv = builder.finish()
    kv.commit(committed)
    return kv


def _held(kv):
    """The committed blocks of every segment, (SEGMENTS, committed, BLOCK), through fresh
    numpy views."""
    n = kv.num_blocks_committed
    return np.stack([view.to_numpy()[:n] for view in kv.committed_views(0, "float32")])


def _interrupted_at(line, codes, call):
    """Run ``call`` raising KeyboardInterrupt at the ``line``-th line event in any frame of
    ``codes``; whether it was raised (False: ``call`` has fewer lines and finished)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count == line:
                raise KeyboardInterrupt
        return local

    def calls(frame, event, arg):
        return local if frame.f_code in codes else None

    sys.settrace(calls)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


# -- DeviceParamTable's JAX mapping -----------------------------------------------------------
def test_an_interrupt_at_any_line_of_sync_leaves_jax_and_the_device_agreeing():
    """Every line of sync: after the interrupt a sync brings the device table and the JAX
    values to the host's (an interrupt between the upload and its record used to leave JAX's
    values old with nothing left to sync)."""
    codes = {
        _param_table.DeviceParamTable.sync.__code__,
        _param_table.DeviceParamTable._upload.__code__,
    }
    line, rng = 1, np.random.default_rng(0)
    with DeviceParamTable(4, {"a": "float32", "table": ("int32", 3)}, "cpu") as table:
        mapping = table.arrays("jax")
        while True:
            for name in table:
                table[name].np = rng.integers(0, 1000, table[name].shape)
            interrupted = _interrupted_at(line, codes, table.sync)
            table.sync()
            for name in table:
                assert np.array_equal(np.asarray(mapping[name]), table[name].np), (line, name)
                assert np.array_equal(table[name].gpu.to_numpy(), table[name].np), (line, name)
            if not interrupted:
                break
            line += 1
    assert line > 10  # the interrupts reached the lines of sync


def test_a_jitted_closure_reading_the_mapping_leaves_arrays_not_tracers():
    """The first access after a sync inside a trace uploads eagerly: the snapshot the later
    accesses share holds arrays, not that trace's tracers."""
    with DeviceParamTable(4, {"a": "float32"}, "cpu") as table:
        mapping = table.arrays("jax")
        table["a"].np[:] = 3.0
        table.sync()
        step = jax.jit(lambda x: x + mapping["a"])
        assert np.array_equal(step(jnp.zeros(4)), np.full(4, 3.0))
        assert isinstance(mapping["a"], jax.Array) and not isinstance(mapping["a"], jax.core.Tracer)
        assert np.array_equal(jax.jit(lambda m: m["a"] * 2)(mapping), np.full(4, 6.0))
        table["a"].np[:] = 5.0
        table.sync()
        assert np.array_equal(
            jax.vmap(lambda x: x + mapping["a"])(jnp.zeros((2, 4))), [[5.0] * 4] * 2
        )
        assert not isinstance(mapping["a"], jax.core.Tracer)


@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
def test_the_mapping_as_a_loop_carry_keeps_each_field_in_its_slot(loop):
    """A loop whose carry starts as the mapping and continues as the dict it unflattens to:
    the leaves line up by name (in field order they swapped fields every iteration)."""
    fields = {"z": "float32", "b": "float32", "a": "float32"}  # not in sorted order
    with DeviceParamTable(4, fields, "cpu") as table:
        for value, name in enumerate(fields):
            table[name].np[:] = 10.0**value
        table.sync()
        mapping = table.arrays("jax")

        def body(carry):
            return {**carry, "z": carry["z"] + 1}

        if loop == "scan":
            result = jax.lax.scan(lambda c, _: (body(c), None), mapping, jnp.arange(3))[0]
        elif loop == "fori_loop":
            result = jax.lax.fori_loop(0, 3, lambda _, c: body(c), mapping)
        else:
            result = jax.lax.while_loop(lambda c: c["z"][0] < 4, body, mapping)
        expected = {"z": 4.0, "b": 10.0, "a": 100.0}
        assert {k: float(v[0]) for k, v in result.items()} == expected
        leaves, treedef = jax.tree.flatten(mapping)
        assert jax.tree.unflatten(treedef, leaves).keys() == set(fields)
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(mapping)[0]]
        assert [p[0].key for p in paths] == sorted(fields)
        assert leaves == jax.tree.leaves(dict(mapping))


def test_a_donated_mapping_is_uploaded_again_not_handed_on_deleted():
    """Donating the mapping (forbidden, but one ``donate_argnums`` away) deletes its arrays:
    the next access uploads the same values again rather than returning deleted arrays
    until the next changed sync."""
    with DeviceParamTable(4, {"a": "float32", "b": ("int32", 3)}, "cpu") as table:
        mapping = table.arrays("jax")
        table["a"].np[:] = 1.5
        table.sync()
        step = jax.jit(lambda m: m["a"] + m["b"].sum(), donate_argnums=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable"
            for _ in range(3):
                assert np.array_equal(step(mapping), np.full(4, 1.5))
        assert np.array_equal(np.asarray(mapping["a"]), table["a"].np)
        kept = mapping["b"]
        assert mapping["b"] is kept  # no upload without a change or a deletion


def test_an_interrupt_at_any_line_of_the_first_access_leaves_the_mapping_usable():
    codes = {
        _jax_table.JaxParamArrays.current.__code__,
        _jax_table.JaxParamArrays._current.__code__,
        _jax_table.JaxParamArrays._upload.__code__,
        _jax_table.JaxParamArrays._check_x64.__code__,
    }
    line = 1
    with DeviceParamTable(3, {"a": "int32", "table": ("int16", 5)}, "cpu") as table:
        mapping = table.arrays("jax")
        while True:
            table["table"].np = line
            table.sync()
            interrupted = _interrupted_at(line, codes, lambda: mapping["table"])
            assert np.array_equal(np.asarray(mapping["table"]), table["table"].np)
            if not interrupted:
                break
            line += 1
    assert line > 5


@pytest.mark.parametrize(
    "name, values, error, message",
    [
        ("a", ["1", "2", "x", "4"], ValueError, "invalid literal"),
        ("a", [1, 2, None, 4], TypeError, "NoneType"),
        ("a", [7, 2**40, 0, 0], ValueError, "field 'a' holds int32; got values outside"),
        ("a", 2**31, ValueError, "field 'a' holds int32; got values outside"),
        ("small", [0, 1, -1, 0], ValueError, "field 'small' holds uint8; got values outside"),
        ("table", [[1, 2**33]] * 4, ValueError, "field 'table' holds int32; got values"),
    ],
)
def test_a_field_given_values_it_cannot_hold_changes_nothing(name, values, error, message):
    """A value that fails to convert used to leave the ones before it written; an integer
    out of range was wrapped silently (a block id of 2**32 became block 0)."""
    fields = {"a": "int32", "small": "uint8", "table": ("int32", 2)}
    with DeviceParamTable(4, fields, "cpu") as table:
        table[name].np = 3
        with pytest.raises(error, match=message):
            table[name].np = values
        assert (table[name].np == 3).all()
        table[name].np = np.full(table[name].shape, 255, np.int64)  # in range: written
        assert (table[name].np == 255).all()


# -- KVCacheStep ---------------------------------------------------------------------------
_RELEASED_UNDER_THE_STEP = """
import jax, numpy as np
from jaxbuf import ExtensibleKVCacheBuilder
from jaxbuf.kv import KVCacheStep

builder = ExtensibleKVCacheBuilder(64, "cpu")
builder.reserve(64 * 4096, 1)
kv = builder.finish()
kv.commit(40)
how = {how!r}

def fn(caches):
    if how == "trace":
        kv.release_physical()
    elif how == "callback":
        jax.debug.callback(lambda: kv.release_physical())
    elif how == "recommit":
        jax.debug.callback(lambda: (kv.release_physical(), kv.commit(8)))
    else:
        jax.debug.callback(lambda: kv.free())
    return [cache.at[:40].set(7.0) for cache in caches], None

KVCacheStep(kv, fn, "float32")()
if how == "recommit":  # the blocks committed throughout the step hold its writes
    assert kv.num_blocks_committed == 8
    assert (kv.committed_views(0, "float32")[0].to_numpy() == 7.0).all()
else:
    assert kv.num_blocks_committed == 0
print("ok")
"""


@pytest.mark.parametrize("how", ["trace", "callback", "recommit", "free"])
def test_a_step_whose_fn_releases_the_cache_writes_back_only_what_stays_committed(how):
    """The write-back copies the blocks committed both when the step began and when it
    ended: a release under the step used to make it write the released (read-only) range,
    a segmentation fault."""
    code = textwrap.dedent(_RELEASED_UNDER_THE_STEP.format(how=how))
    result = _forkserver.run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize("debug", [False, True])
def test_a_step_after_release_physical_drops_its_writes_or_raises_in_debug(debug):
    """Nothing committed: the step reads zeros (a bucket of one block, reserved memory) and
    its writes are dropped; debug mode gives ``fn`` no block and raises on any index. After
    a recommit the blocks are zeros and the step writes them again."""
    kv = _cache(5)
    kv.committed_views(0, "float32")[0].to_numpy()[:] = 9.0
    step = KVCacheStep(
        kv, lambda caches: ([c.at[0].add(1.0) for c in caches], caches[0][0]), "f4", debug=debug
    )
    kv.release_physical()
    if debug:
        with pytest.raises(IndexError):  # JAX at trace time (a static index) or checkify
            step()
    else:
        assert np.array_equal(step(), np.zeros(BLOCK))
    assert kv.num_blocks_committed == 0
    kv.recommit()
    assert np.array_equal(_held(kv), np.zeros((SEGMENTS, 5, BLOCK)))
    assert np.array_equal(step(), np.zeros(BLOCK))
    assert np.array_equal(_held(kv)[:, 0], np.ones((SEGMENTS, BLOCK)))
    step.close()
    kv.free()


def test_an_interrupt_at_any_line_of_a_step_keeps_the_cache_whole():
    """Against a numpy model, across bucket changes: an interrupted step either wrote all of
    its blocks or none, and the next step runs."""
    codes = {
        f.__code__
        for f in (
            KVCacheStep.__call__,
            KVCacheStep._run,
            KVCacheStep._write_back,
            KVCacheStep._jitted_for,
            KVCacheStep._check_outputs,
        )
    }
    kv = _cache()
    step = KVCacheStep(kv, lambda caches, b, v: ([c.at[b].add(v) for c in caches], None), "float32")
    rng = np.random.default_rng(1)
    line, lines_reached = 1, 0
    for _ in range(60):
        if rng.random() < 0.3 and kv.num_blocks_committed < CAPACITY:
            kv.commit(int(rng.integers(kv.num_blocks_committed + 1, CAPACITY + 1)))
        n = kv.num_blocks_committed
        block, value = int(rng.integers(0, n)), float(rng.integers(1, 5))
        before = _held(kv)
        after_step = before.copy()
        after_step[:, block] += value
        interrupted = _interrupted_at(line, codes, functools.partial(step, block, value))
        held = _held(kv)
        if interrupted:
            assert np.array_equal(held, before) or np.array_equal(held, after_step), line
            line += 1
        else:
            assert np.array_equal(held, after_step)
            lines_reached, line = max(lines_reached, line), 1
    assert lines_reached > 10
    step.close()
    kv.free()


def test_a_failed_in_place_step_leaves_arrays_the_next_step_can_read(monkeypatch):
    """Where the step donates the caches (a GPU's in-place path, forced here, its aliasing
    taken as checked), an output refused after the run used to leave the donated, deleted
    arrays as the next step's inputs ("Array has been deleted" from then on)."""
    monkeypatch.setattr(_jax_step, "donation_in_place", lambda device=None: True)
    monkeypatch.setattr(KVCacheStep, "_check_aliasing", lambda self, updated: None)
    kv = _cache(4)
    kv.committed_views(0, "float32")[0].to_numpy()[:] = 2.0

    def fn(caches, wrong):
        return [c.astype(jnp.int32) if wrong else c + 1 for c in caches], caches[0][0, 0]

    step = KVCacheStep(kv, fn, "float32", static_argnums=1)
    assert step.in_place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU cannot use the donation
        with pytest.raises(TypeError, match="dtype int32"):
            step(True)
        assert float(step(False)) == 2.0  # the memory, imported again
    step.close()
    kv.free()


def test_the_caches_a_caller_donates_are_not_the_steps():
    """``caches`` are fresh imports: donating one (JAX deletes it) used to delete the step's
    own input and break every later step."""
    kv = _cache(2)
    step = KVCacheStep(kv, lambda caches: ([c + 1 for c in caches], None), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU cannot use the donation
        jax.jit(lambda x: x * 2, donate_argnums=0)(step.caches[0])
    step()
    assert np.array_equal(_held(kv), np.ones((SEGMENTS, 2, BLOCK)))
    assert step.caches[0].unsafe_buffer_pointer() == kv.segment_views(0)[0].ptr
    step.close()
    kv.free()
    with pytest.raises(ClosedError):
        step.caches  # noqa: B018


def test_a_failed_in_place_step_that_freed_its_cache_raises_its_own_error(monkeypatch):
    """The recovery of a failed in-place step leaves a cache freed under it alone: its
    ClosedError used to hide the step's own error."""
    monkeypatch.setattr(_jax_step, "donation_in_place", lambda device=None: True)
    kv = _cache(2)

    def fn(caches):
        jax.debug.callback(kv.free)
        return [c.astype(jnp.int32) for c in caches], None

    step = KVCacheStep(kv, fn, "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU cannot use the donation
        with pytest.raises(TypeError, match="dtype int32"):
            step()
    with pytest.raises(ClosedError, match="freed"):
        step()


def test_an_in_place_step_closed_by_its_fn_stays_closed(monkeypatch):
    """The in-place path (forced, its aliasing taken as checked) keeps the outputs as the
    next inputs only while the step is open: a step closed by a callback of its own ``fn``
    used to come back open."""
    monkeypatch.setattr(_jax_step, "donation_in_place", lambda device=None: True)
    monkeypatch.setattr(KVCacheStep, "_check_aliasing", lambda self, updated: None)
    kv = _cache(2)

    def fn(caches):
        jax.debug.callback(step.close)
        return [c + 1 for c in caches], None

    step = KVCacheStep(kv, fn, "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU cannot use the donation
        step()
    with pytest.raises(ClosedError):
        step()
    kv.free()


def test_debug_mode_takes_out_shardings_of_fns_outputs():
    """``out_shardings`` describe ``fn``'s outputs also in debug mode, where checkify's error
    comes first (it used to be a pytree mismatch there only)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    kv = _cache(3)

    def fn(caches, x):
        return [c.at[0].add(x) for c in caches], x * 2

    for debug in (False, True):
        options = {"out_shardings": ([sharding] * SEGMENTS, sharding)}
        step = KVCacheStep(kv, fn, "float32", debug=debug, **options)
        assert float(step(jnp.float32(1.5))) == 3.0
        step.close()
    assert np.array_equal(_held(kv)[:, 0], np.full((SEGMENTS, BLOCK), 3.0))
    kv.free()


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"static_argnums": np.int64(0)}, ValueError, "name the caches"),
        ({"donate_argnums": np.int8(0)}, ValueError, "name the caches"),
        ({"static_argnums": 1.0}, TypeError, "static_argnums must be an int"),
        ({"donate_argnames": 3}, TypeError, "donate_argnames must be a str"),
        ({"static_argnames": ["x", 2]}, TypeError, "static_argnames must be a str"),
    ],
)
def test_jit_options_of_the_wrong_type_are_named(options, error, message):
    kv = _cache()
    with pytest.raises(error, match=message):
        KVCacheStep(kv, lambda caches, x=1: (caches, None), "float32", **options)
    kv.free()


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda caches: (caches, None, None), "fn must return \\(caches, out\\), got tuple of 3"),
        (lambda caches: jnp.stack(caches), "fn must return \\(caches, out\\), got ArrayImpl"),
        (lambda caches: (caches[0], None), "caches of type ArrayImpl"),
    ],
)
def test_fn_returning_other_than_caches_and_out_is_named(fn, message):
    kv = _cache(2)
    kv.committed_views(0, "float32")[0].to_numpy()[:] = 1.0
    step = KVCacheStep(kv, fn, "float32")
    with pytest.raises(TypeError, match=message):
        step()
    assert np.array_equal(_held(kv)[0], np.ones((2, BLOCK)))
    step.close()
    kv.free()


# -- the flagship decode's agreement check ------------------------------------------------
class _Held:
    def __init__(self, blocks):
        self.blocks = np.asarray(blocks)

    def committed(self, n):
        return self.blocks[:n]


def _trace(logits, blocks):
    return _paged_model.Trace(logits=[np.asarray(x) for x in logits], blocks=list(blocks))


def test_check_agreement_compares_bit_for_bit_and_never_passes_without_comparing():
    logits, blocks, cache = [np.ones(4, np.float32)] * 3, [1, 2, 2], np.zeros((2, 3), np.float32)
    same = {"ref": _Held(cache), "other": _Held(cache.copy())}
    traces = {"ref": _trace(logits, blocks), "other": _trace(logits, blocks)}
    _paged_model.check_agreement(same, traces, "ref")  # agreeing caches pass

    def refused(caches, traces, match):
        with pytest.raises(AssertionError, match=match):
            _paged_model.check_agreement(caches, traces, "ref")

    signed = np.ones(4, np.float32)
    signed[0] = 0.0
    negated = signed.copy()
    negated[0] = -0.0
    refused(
        same,
        {"ref": _trace([signed] * 3, blocks), "other": _trace([negated] * 3, blocks)},
        "step 0's logits differ: 1 bytes",
    )
    refused(
        same,
        {"ref": _trace(logits, blocks), "other": _trace(logits[:2], blocks[:2])},
        "other: 2 steps of logits, ref 3",
    )
    wide = [x.astype(np.float64) for x in logits]
    refused(same, {"ref": _trace(logits, blocks), "other": _trace(wide, blocks)}, "float64\\[4\\]")
    negative_zero = cache.copy()
    negative_zero[0, 0] = -0.0
    refused(
        {"ref": _Held(cache), "other": _Held(negative_zero)},
        traces,
        "the committed cache differs: 1 bytes",
    )
    refused({"ref": same["ref"]}, {"ref": traces["ref"]}, "nothing to compare it with")
    refused(same, {"ref": _trace([], []), "other": _trace([], [])}, "nothing to compare")
