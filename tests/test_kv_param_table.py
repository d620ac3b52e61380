"""``DeviceParamTable``: per-request scalars and rows at a fixed device address, uploaded with
one copy and only when a host value changed; fields seen from torch (imported once, aliasing
the device table) and JAX (values of the last sync, never waiting for JAX's work)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import jaxbuf
from jaxbuf import ClosedError, DeviceParamTable
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import DriverError
from jaxbuf.kv import FIELD_ALIGNMENT
from jaxbuf.testing import FaultInjectingDriver

FIELDS = {"temperature": "float32", "top_k": "int32", "seed": "int64", "greedy": "bool"}


def _device_values(table, name):
    """What the device holds of field ``name`` (a copy, through DLPack)."""
    return np.from_dlpack(table[name].gpu, device="cpu", copy=True)


def _device_column(table, name):
    """What the device holds of field ``name``, for any dtype (numpy's DLPack import takes
    no bool): the table's bytes copied to the host, then the field's."""
    field = table[name]
    raw = np.from_dlpack(table._tensor.full_view(), device="cpu", copy=True)
    return (
        raw[field.offset : field.offset + field.np.nbytes]
        .view(field.np.dtype)
        .reshape(field.np.shape)
    )


def test_layout_fields_aligned_at_a_fixed_address(device):
    with DeviceParamTable(5, FIELDS, device) as table:
        assert list(table) == list(FIELDS) and len(table) == 4 and "seed" in table
        offsets = [table[name].offset for name in table]
        assert all(offset % FIELD_ALIGNMENT == 0 for offset in offsets)  # 8-byte aligned too
        assert offsets == sorted(offsets) and table.nbytes % FIELD_ALIGNMENT == 0
        for name, dtype in FIELDS.items():
            field = table[name]
            assert field.np.shape == (5,) and field.np.dtype == np.dtype(dtype)
            assert field.gpu.shape == (5,) and field.gpu.dtype.name == dtype
            assert field.gpu.ptr == table.device_ptr + field.offset
        ptr = table.device_ptr
        table["top_k"].np[:] = 3
        table.sync()
        assert table.device_ptr == ptr


def test_sync_uploads_only_what_changed(device):
    driver = FaultInjectingDriver(get_vmm_driver(device), simulate_events=True)
    with DeviceParamTable(4, FIELDS, device, driver=driver) as table:
        copies = driver.calls["copy"]
        assert table.sync() is False and not table.changed()  # zeros, as the device holds
        assert driver.calls["copy"] == copies
        table["temperature"].np[:] = [0.5, 0.7, 1.0, 1.2]
        table["seed"].np[2] = 2**40 + 3
        assert table.changed()
        assert table.sync() is True
        assert driver.calls["copy"] == copies + 1  # the whole table in one copy
        for _ in range(3):  # steps that admit no request copy nothing
            assert table.sync() is False
        assert driver.calls["copy"] == copies + 1
        np.testing.assert_array_equal(
            _device_values(table, "temperature"), np.float32([0.5, 0.7, 1.0, 1.2])
        )
        assert _device_values(table, "seed")[2] == 2**40 + 3
        table["temperature"].np[1] = 0.7  # the same value: nothing changed
        assert table.sync() is False
        table["greedy"].np[3] = True
        assert table.sync() is True
        assert _device_values(table, "greedy").tolist() == [False, False, False, True]


def test_assigning_a_column_writes_through_and_uploads(device):
    """``table[name].np = values`` writes into the table's column (a numpy model of the host
    table), so ``sync`` uploads it; it used to rebind the name, ``sync`` returned False and
    the device kept its zeros. Values of another length raise naming the field and change
    nothing; ``gpu`` cannot be rebound."""
    with DeviceParamTable(4, FIELDS, device) as table:
        column = table["temperature"].np
        table["temperature"].np = np.full(4, 0.5)
        assert table["temperature"].np is column
        assert table.sync() is True
        np.testing.assert_array_equal(_device_values(table, "temperature"), np.full(4, 0.5))
        table["top_k"].np = 7  # a scalar fills the column, as np[:] = 7 does
        table["top_k"].np += 1  # augmented assignment rebinds the column to itself
        assert table.sync() is True
        assert _device_values(table, "top_k").tolist() == [8] * 4
        for bad in (np.zeros(3), np.zeros((4, 1)), [1, 2, 3, 4, 5]):
            with pytest.raises(ValueError, match="field 'seed' holds 4 values"):
                table["seed"].np = bad
        assert not table.changed()
        with pytest.raises(AttributeError):
            table["seed"].gpu = table["top_k"].gpu


def test_the_staging_slots_rotate_and_wait_for_their_copy():
    driver = FaultInjectingDriver(get_vmm_driver("cpu"), simulate_events=True)
    with DeviceParamTable(4, FIELDS, "cpu", max_concurrency=2, driver=driver) as table:
        for step in range(5):
            table["top_k"].np[0] = step + 1
            assert table.sync()
        # Five uploads through two slots: each reuse waited for that slot's copy's event.
        assert driver.calls["host_alloc"] == 2
        assert driver.calls["copy"] >= 5
        assert _device_values(table, "top_k")[0] == 5


def test_a_failed_upload_is_retried_by_the_next_sync():
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    with DeviceParamTable(4, FIELDS, "cpu", max_concurrency=1, driver=driver) as table:
        table["top_k"].np[:] = 9
        driver.fail_on("copy")
        with pytest.raises(DriverError):
            table.sync()
        assert table.changed()
        assert table.sync() is True  # the host did not change since, but the device did not get it
        assert _device_values(table, "top_k").tolist() == [9] * 4


def test_fields_imported_once_see_every_upload(device, framework):
    with DeviceParamTable(3, {"temperature": "float32", "top_k": "int32"}, device) as table:
        arrays = table.arrays(framework)
        assert table.arrays(framework) is arrays  # no import per step
        table["temperature"].np[:] = [1.0, 2.0, 3.0]
        table["top_k"].np[:] = [4, 5, 6]
        table.sync()
        if framework == "jax":
            import jax

            scale = jax.jit(lambda p: p["temperature"] * p["top_k"])
            np.testing.assert_allclose(np.asarray(scale(arrays)), [4.0, 10.0, 18.0])
            table["top_k"].np[0] = 10
            table.sync()
            np.testing.assert_allclose(np.asarray(scale(arrays)), [10.0, 10.0, 18.0])
        else:
            out = arrays["temperature"] * arrays["top_k"]
            np.testing.assert_allclose(out.cpu().numpy(), [4.0, 10.0, 18.0])
            table["top_k"].np[0] = 10
            table.sync()
            out = arrays["temperature"] * arrays["top_k"]
            np.testing.assert_allclose(out.cpu().numpy(), [10.0, 10.0, 18.0])


def test_close_frees_and_arrays_keep_the_memory():
    table = DeviceParamTable(2, {"temperature": "float32"}, "cpu")
    table["temperature"].np[:] = 1.5
    table.sync()
    kept = table["temperature"].gpu.to_numpy()
    table.close()
    table.close()  # twice is fine
    assert kept.tolist() == [1.5, 1.5]
    with pytest.raises(ClosedError, match="DeviceParamTable has been closed"):
        table.sync()
    with pytest.raises(ClosedError):
        table["temperature"].gpu.to_numpy()
    with pytest.raises(ClosedError):
        table.arrays("jax")
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(table)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((4, {"temperature": "float128"}), {}, ValueError, "field 'temperature'"),
        ((4, {"temperature": "qint4"}), {}, ValueError, "field 'temperature'"),
        ((4, {"temperature": None}), {}, ValueError, "field 'temperature'"),
        ((4, [("a", "int32"), ("a", "int32")]), {}, ValueError, "field 'a' is named twice"),
        ((4, {"": "int32"}), {}, ValueError, "non-empty strings"),
        ((4, {}), {}, ValueError, "at least one field"),
        ((4, "temperature"), {}, TypeError, "fields"),
        ((0, FIELDS), {}, ValueError, "num_rows"),
        ((-1, FIELDS), {}, ValueError, "num_rows"),
        ((2**60, FIELDS), {}, ValueError, "bytes of host memory"),
        ((4.0, FIELDS), {}, TypeError, "num_rows"),
        ((4, FIELDS), {"max_concurrency": 0}, ValueError, "max_concurrency"),
        ((4, FIELDS), {"max_concurrency": 2**40}, ValueError, "max_concurrency"),
        ((4, {"blocks": ("int32", 0)}), {}, ValueError, "field 'blocks': its width"),
        ((4, {"blocks": ("int32", -2)}), {}, ValueError, "field 'blocks': its width"),
        ((4, {"blocks": ("int32", 1.5)}), {}, ValueError, "field 'blocks': its width"),
        ((4, {"blocks": ("int32", "8")}), {}, ValueError, "field 'blocks': its width"),
        ((4, {"blocks": ("int32", True)}), {}, ValueError, "field 'blocks': its width"),
        ((4, {"blocks": ("int32", None)}), {}, ValueError, "field 'blocks': its width"),
        ((4, {"blocks": ("int32", 8, 2)}), {}, ValueError, "field 'blocks': expected a dtype"),
        ((4, {"blocks": ("qint4", 8)}), {}, ValueError, "field 'blocks'"),
        ((4, [("blocks", ("int32",))]), {}, ValueError, "field 'blocks': expected a dtype"),
        ((4, {"blocks": ("int32", 2**62)}), {}, ValueError, "bytes of host memory"),
    ],
)
def test_bad_input_allocates_nothing(args, kwargs, error, match):
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    with pytest.raises(error, match=match):
        DeviceParamTable(*args, device="cpu", driver=driver, **kwargs)
    assert driver.call_count == 0


def test_a_failed_construction_releases_what_it_made():
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    driver.fail_on("host_alloc", nth=2)  # the second staging slot
    with pytest.raises(DriverError):
        DeviceParamTable(4, FIELDS, "cpu", max_concurrency=3, driver=driver)
    assert driver.calls["host_free"] == 1
    assert driver.calls["unmap"] == driver.calls["map"]


def test_unknown_field_raises_key_error_naming_the_fields():
    with DeviceParamTable(2, FIELDS, "cpu") as table:
        with pytest.raises(KeyError, match="temperature"):
            table["temp"]
        assert "DeviceParamTable(2 rows" in repr(table)
        assert jaxbuf.DeviceParamTable is DeviceParamTable


# -- 2-D fields --------------------------------------------------------------------------
def test_a_field_with_a_width_is_a_row_major_column_of_rows(device):
    """``name: (dtype, width)`` (also as a pair) is a ``(num_rows, width)`` column: host,
    device view and JAX snapshot of that shape, one copy of the whole table per sync."""
    driver = FaultInjectingDriver(get_vmm_driver(device), simulate_events=True)
    fields = [("temperature", "float32"), ("blocks", ("int32", 5)), ("mask", ["bool", 3])]
    with DeviceParamTable(4, fields, device, driver=driver) as table:
        blocks = table["blocks"]
        assert blocks.shape == blocks.np.shape == blocks.gpu.shape == (4, 5)
        assert table["temperature"].shape == (4,) and table["mask"].shape == (4, 3)
        assert "shape=(4, 5)" in repr(blocks) and "blocks: (int32, 5)" in repr(table)
        assert blocks.np.flags.c_contiguous and blocks.offset % FIELD_ALIGNMENT == 0
        rows = np.arange(20, dtype=np.int32).reshape(4, 5)
        blocks.np = rows  # write-through of the whole column
        table["mask"].np = True  # a scalar fills it
        copies = driver.calls["copy"]
        assert table.sync() is True
        assert driver.calls["copy"] == copies + 1  # one copy of the whole table
        np.testing.assert_array_equal(_device_values(table, "blocks"), rows)
        assert _device_values(table, "mask").all()
        blocks.np[2, 4] = 99
        assert table.sync() is True
        assert _device_values(table, "blocks")[2, 4] == 99
        for bad in (np.zeros(4), np.zeros((4, 4)), np.zeros((5, 5)), np.zeros(5)):
            with pytest.raises(ValueError, match="field 'blocks' holds 4 rows of 5 values"):
                blocks.np = bad
        assert not table.changed()


# -- JAX: values of the last sync -----------------------------------------------------------
_MODEL_DTYPES = ["float32", "int32", "bool", "int8", "uint16", "float16", "bfloat16"]


def _random_fields(rng):
    names = [f"f{i}" for i in range(rng.integers(1, 6))]
    fields = {}
    for name in names:
        dtype = _MODEL_DTYPES[rng.integers(len(_MODEL_DTYPES))]
        fields[name] = dtype if rng.random() < 0.5 else (dtype, int(rng.integers(1, 6)))
    return fields


def _random_values(rng, field):
    values = rng.integers(-50, 50, size=field.shape)
    if field.np.dtype == np.bool_:
        return values > 0
    if field.np.dtype.kind == "u":
        return np.abs(values)
    return values.astype(field.np.dtype)


def test_jax_snapshots_and_device_columns_follow_a_numpy_model(device):
    """Random tables (1-D and 2-D fields, several dtypes), random host writes, syncs and
    snapshots taken in between: ``arrays("jax")`` always holds the last sync's values (the
    model), every snapshot taken keeps the values of its time, ``gpu`` holds the last
    upload, and the compiled step passing the mapping is traced once per table."""
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(7)
    for _ in range(6):
        fields = _random_fields(rng)
        num_rows = int(rng.integers(1, 9))
        with DeviceParamTable(num_rows, fields, device) as table:
            host = {name: np.zeros(table[name].shape, table[name].np.dtype) for name in table}
            synced = {name: values.copy() for name, values in host.items()}
            params = table.arrays("jax")
            assert table.arrays("jax") is params and list(params) == list(fields)
            step = jax.jit(lambda p: {name: array for name, array in p.items()})
            taken = []  # (arrays of a snapshot, the model's values then)
            for _ in range(25):
                action = rng.random()
                if action < 0.5:
                    name = list(fields)[rng.integers(len(fields))]
                    values = _random_values(rng, table[name])
                    table[name].np = values
                    host[name][...] = values
                elif action < 0.8:
                    changed = any(not np.array_equal(host[n], synced[n]) for n in host)
                    assert table.changed() is changed
                    assert table.sync() is changed
                    synced = {name: values.copy() for name, values in host.items()}
                else:
                    taken.append((dict(params), synced))
                out = step(params)  # the mapping as a jit argument: the current values
                for name in fields:
                    np.testing.assert_array_equal(np.asarray(params[name]), synced[name])
                    np.testing.assert_array_equal(np.asarray(out[name]), synced[name])
                    np.testing.assert_array_equal(_device_column(table, name), synced[name])
                    assert params[name].shape == table[name].shape
                    assert params[name].dtype == table[name].np.dtype
            for arrays, values in taken:  # immutable: every later write and sync left them
                for name in fields:
                    np.testing.assert_array_equal(np.asarray(arrays[name]), values[name])
            assert step._cache_size() == 1


def test_a_snapshot_keeps_its_values_after_host_writes_and_syncs(device):
    """The arrays of a snapshot are JAX's own: on the CPU ``device_put`` of an aligned numpy
    array may alias it, so a snapshot uploaded from the host table (or a staging slot)
    would change with the next write or sync."""
    pytest.importorskip("jax")
    with DeviceParamTable(64, {"temperature": "float32", "blocks": ("int32", 16)}, device) as t:
        t["temperature"].np = 0.5
        t["blocks"].np = 3
        t.sync()
        old = dict(t.arrays("jax"))
        assert t.arrays("jax")["temperature"] is old["temperature"]  # no change: same arrays
        t["temperature"].np = 2.0
        t["blocks"].np = 7
        np.testing.assert_array_equal(np.asarray(old["temperature"]), 0.5)  # written only
        assert t.arrays("jax")["temperature"] is old["temperature"]  # not synced yet
        for _ in range(2 * t.max_concurrency):  # every staging slot rewritten
            t["temperature"].np += 1
            t.sync()
        np.testing.assert_array_equal(np.asarray(old["temperature"]), 0.5)
        np.testing.assert_array_equal(np.asarray(old["blocks"]), 3)
        new = t.arrays("jax")
        np.testing.assert_array_equal(np.asarray(new["temperature"]), 2.0 + 2 * t.max_concurrency)
        np.testing.assert_array_equal(np.asarray(new["blocks"]), 7)


def test_a_changed_sync_never_waits_for_jax(device, monkeypatch):
    """A changed sync used to wait for every live JAX array (``interop.quiesce``: a
    ``block_until_ready`` over ``jax.live_arrays()``), so its cost grew with the arrays the
    process held and it waited for any unrelated computation in flight. Now neither is
    called, with the table's JAX arrays taken and a step dispatched."""
    jax = pytest.importorskip("jax")
    import jaxbuf.interop

    def refuse(*args, **kwargs):
        raise AssertionError("DeviceParamTable.sync waited for JAX's work")

    table = DeviceParamTable(8, {"scale": "float32", "blocks": ("int32", 4)}, device)
    try:
        params = table.arrays("jax")
        step = jax.jit(lambda p: p["scale"] * p["blocks"].sum(axis=1))
        monkeypatch.setattr(jaxbuf.interop, "quiesce", refuse)
        monkeypatch.setattr(jax, "live_arrays", refuse)
        for value in range(1, 4):
            out = step(params)  # dispatched, maybe still running
            table["scale"].np = value
            table["blocks"].np = 1
            assert table.sync() is True
            assert float(step(params)[0]) == value * 4
            del out
    finally:
        monkeypatch.undo()  # close() frees memory: that waits for JAX, as every free does
        table.close()


def test_a_changed_sync_returns_while_a_long_computation_runs():
    """Timed, with a wide margin: a computation of about a second is in flight while the
    table changes, syncs and is passed to the next step; the sync and the access take a
    small part of it (they used to wait for it to finish)."""
    jax = pytest.importorskip("jax")
    import time

    import jax.numpy as jnp

    @jax.jit
    def long(x):
        return jax.lax.fori_loop(0, 40, lambda _, y: jnp.tanh(y @ y), x)

    x = jnp.full((512, 512), 1e-3, jnp.float32)
    long(x).block_until_ready()
    start = time.perf_counter()
    long(x).block_until_ready()
    alone = time.perf_counter() - start
    with DeviceParamTable(8, {"scale": "float32"}, "cpu") as table:
        params = table.arrays("jax")
        dict(params)  # compiled
        running = long(x)
        start = time.perf_counter()
        table["scale"].np = 2.0
        table.sync()
        fresh = params["scale"]
        took = time.perf_counter() - start
        running.block_until_ready()
        assert float(fresh[0]) == 2.0
    assert took < alone / 2, f"sync and access {took:.3f} s, the computation {alone:.3f} s"


def test_the_mapping_as_a_jit_argument_picks_up_syncs_without_retracing(device):
    jax = pytest.importorskip("jax")
    with DeviceParamTable(3, {"temperature": "float32", "top_k": ("int32", 2)}, device) as t:
        traces = []

        @jax.jit
        def scale(p):
            traces.append(type(p))
            return p["temperature"] * p["top_k"].sum(axis=1)

        params = t.arrays("jax")
        assert jax.tree_util.tree_structure(params).num_leaves == 2
        for step in range(1, 5):
            t["temperature"].np = [1.0, 2.0, 3.0]
            t["top_k"].np = step
            t.sync()
            np.testing.assert_allclose(
                np.asarray(scale(params)), [2.0 * step, 4.0 * step, 6.0 * step]
            )
        assert scale._cache_size() == 1 and traces == [dict]  # traced once, as a dict
        leaves = jax.tree_util.tree_leaves(params)
        assert leaves[0] is params["temperature"] and leaves[1] is params["top_k"]
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        assert [path[0].key for path in paths] == ["temperature", "top_k"]


def test_an_interrupted_upload_leaves_the_table_usable(monkeypatch):
    """A Ctrl-C inside the upload of a snapshot reaches the caller; the mapping keeps the
    previous snapshot's state and the next access uploads again."""
    pytest.importorskip("jax")
    from jaxbuf.kv import _jax_table

    with DeviceParamTable(4, {"temperature": "float32", "blocks": ("int32", 2)}, "cpu") as t:
        params = t.arrays("jax")
        before = params["temperature"]
        real = _jax_table._unpacker

        def interrupted_once(*args):
            def call(table):
                monkeypatch.setattr(_jax_table, "_unpacker", real)
                raise KeyboardInterrupt

            return call

        monkeypatch.setattr(_jax_table, "_unpacker", interrupted_once)
        t["temperature"].np = 1.5
        t.sync()
        with pytest.raises(KeyboardInterrupt):
            params["temperature"]
        np.testing.assert_array_equal(np.asarray(before), 0.0)
        np.testing.assert_array_equal(np.asarray(params["temperature"]), 1.5)  # retried
        assert params["temperature"] is params["temperature"]
        t["blocks"].np = 4
        assert t.sync() is True
        np.testing.assert_array_equal(np.asarray(params["blocks"]), 4)


def test_jax_refuses_a_64_bit_field_it_would_narrow():
    """Without ``jax_enable_x64`` a 64-bit field would reach JAX as 32 bits (a seed of 2**40
    silently changed): TypeError naming the field; the table stays usable."""
    jax = pytest.importorskip("jax")
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on in this process")
    with DeviceParamTable(2, {"top_k": "int32", "seed": "int64"}, "cpu") as table:
        params = table.arrays("jax")
        with pytest.raises(TypeError, match="field 'seed' is int64"):
            params["top_k"]
        table["seed"].np = 2**40
        assert table.sync() is True
        assert _device_values(table, "seed").tolist() == [2**40] * 2
        with jax.enable_x64(True):
            assert params["seed"].tolist() == [2**40] * 2


def test_a_closed_tables_mapping_raises():
    pytest.importorskip("jax")
    table = DeviceParamTable(2, {"temperature": "float32"}, "cpu")
    params = table.arrays("jax")
    assert "temperature" in params and len(params) == 1
    with pytest.raises(KeyError, match="no field 'temp'; fields: temperature"):
        params["temp"]
    table.close()
    with pytest.raises(ClosedError, match="DeviceParamTable has been closed"):
        params["temperature"]
    assert "closed" in repr(params)


def test_a_field_with_a_width_reaches_each_framework_as_rows(device, framework):
    """A ``(dtype, width)`` field is a ``(num_rows, width)`` array in torch (over the device
    table) and in JAX (the last sync's values), row-major as the host column."""
    with DeviceParamTable(3, {"blocks": ("int32", 4), "length": "int32"}, device) as table:
        table["blocks"].np = np.arange(12).reshape(3, 4)
        table["length"].np = [1, 2, 3]
        table.sync()
        arrays = table.arrays(framework)
        blocks = arrays["blocks"]
        assert tuple(blocks.shape) == (3, 4)
        host = blocks.cpu().numpy() if framework == "torch" else np.asarray(blocks)
        np.testing.assert_array_equal(host, np.arange(12).reshape(3, 4))


def test_a_table_without_jax_never_imports_jax():
    """The JAX wing is imported on the first ``arrays("jax")`` only: a torch-only (or numpy)
    user syncing and reading fields never loads JAX."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, jaxbuf\n"
        "t = jaxbuf.DeviceParamTable(4, {'a': 'float32', 'b': ('int32', 3)}, 'cpu')\n"
        "t['b'].np = 2; t.sync(); t.arrays('numpy'); t['b'].gpu.to_numpy(); t.close()\n"
        "assert 'jax' not in sys.modules and 'jaxbuf.kv._jax_table' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
