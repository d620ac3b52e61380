"""``DeviceParamTable``: per-request scalars at a fixed device address, uploaded with one copy
and only when a host value changed; fields seen from torch and JAX, imported once."""

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
