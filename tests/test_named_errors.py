"""Errors that named nothing, or were the wrong ones, found by a pass over the public API:
each bad argument now raises the documented type with a message naming it, changes nothing,
and a spelling torch and JAX users type is understood."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jaxbuf
from jaxbuf.dtypes import canonical_dtype
from jaxbuf.sharing import ImportedBuffer, export_layout
from jaxbuf.transfer import KVEndpoint, KVLayout, Registration
from jaxbuf.views import BufferView

MiB = 1 << 20


@pytest.fixture
def tensor():
    buffer = jaxbuf.ExtensibleTensor(8 * MiB, "cpu")
    buffer.resize_per_segment_(MiB)
    yield buffer
    buffer.free()


def test_a_zero_size_view_whose_strides_overflow_is_refused_by_name():
    with pytest.raises(ValueError, match=r"shape \(2, 9223372036854775807, 3, 0\).*int64"):
        BufferView(4096, 0, "uint8", (2, 2**63 - 1, 3, 0))
    assert BufferView(4096, 0, "uint8", (2, 5, 3, 0)).shape == (2, 5, 3, 0)


def test_transfer_arguments_are_named(tensor):
    with pytest.raises(TypeError, match="agent must be a jaxbuf.transfer.Agent"):
        KVEndpoint(object(), tensor, KVLayout(4096))
    with pytest.raises(TypeError, match="segments must be a sequence of segment indices, got 0"):
        KVLayout(4096, 0)
    with pytest.raises(TypeError, match="release_timeout must be a number of seconds"):
        Registration(None, tensor, release_timeout="10")
    with pytest.raises(ValueError, match="release_timeout must be a non-negative"):
        Registration(None, tensor, release_timeout=float("nan"))
    other = jaxbuf.ExtensibleTensor(8 * MiB, "cpu")
    other.resize_per_segment_(MiB)
    here = KVEndpoint("named-a", tensor, KVLayout(4096))
    there = KVEndpoint("named-b", other, KVLayout(4096))
    try:
        transfer = here.write(here.connect(there.metadata()), [0], [1])
        with pytest.raises(TypeError, match="timeout must be a number of seconds, got '1'"):
            transfer.wait("1")
        transfer.wait(1)
    finally:
        here.close()
        there.close()
        other.free()


@pytest.mark.parametrize("bad", [object(), 5, None, np.zeros(4)])
def test_kv_endpoint_names_a_tensor_that_is_not_one(bad):
    """A non-tensor used to fail with ``AttributeError: ... 'num_segments'``."""
    with pytest.raises(TypeError, match="tensor must be an ExtensibleTensor"):
        KVEndpoint("named-bad", bad, KVLayout(4096))


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (None, TypeError, "fds must be a sequence of file descriptors"),
        (5, TypeError, "fds must be a sequence of file descriptors"),
        (["3"], TypeError, r"fds\[0\] must be an integer"),
        ([2.5], TypeError, r"fds\[0\] must be an integer"),
        ([True], TypeError, r"fds\[0\] must be an integer, got the bool"),
        ([-1], ValueError, r"fds\[0\] must be a file descriptor \(>= 0\), got -1"),
        ([2**20], ValueError, r"fds\[0\] = 1048576 is not an open file descriptor"),
    ],
)
def test_imported_buffer_names_a_bad_descriptor(tensor, bad, error, message):
    """A descriptor list that is not one, or an entry that is no open descriptor: the error
    names ``fds`` or ``fds[i]`` (it was ``OSError: Bad file descriptor`` or ``'int' object is
    not iterable``); nothing is mapped, and a bool is never taken for stdout and closed."""
    layout, fds = export_layout(tensor)
    try:
        with pytest.raises(error, match=message):
            ImportedBuffer(layout, bad)
        os.fstat(1)  # stdout is still open
    finally:
        for fd in fds:
            os.close(fd)


def test_imported_buffer_closes_the_good_descriptors_of_a_refused_list(tensor):
    layout, fds = export_layout(tensor)
    with pytest.raises(ValueError, match=r"fds\[1\] must be a file descriptor"):
        ImportedBuffer(layout, [fds[0], -1])
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fds[0])  # closed: the import owned it


def test_export_layout_since_a_partial_layout_is_a_value_error(tensor):
    layout, fds = export_layout(tensor)
    for fd in fds:
        os.close(fd)
    with pytest.raises(ValueError, match="since must be a whole layout"):
        export_layout(tensor, since={"owner": layout["owner"]})


def test_an_import_error_is_not_hidden_by_a_bad_descriptor(tensor):
    layout, fds = export_layout(tensor)
    for fd in fds:
        os.close(fd)
    bad = {**layout, "reserved_size": -1}
    with pytest.raises(ValueError, match="reserved_size") as caught:
        ImportedBuffer(bad, [fds[0]])  # closed already: closing it again fails
    assert any("Bad file descriptor" in note for note in caught.value.__notes__)


@pytest.mark.parametrize("spec", ["cpu:²", "cuda:١", "cpu:-1", "cpu:x"])
def test_a_device_index_that_is_not_ascii_digits_is_named(spec):
    with pytest.raises(ValueError, match=f"bad device index in {spec!r}"):
        jaxbuf.ExtensibleTensor(MiB, spec)


def test_zero_new_must_be_a_bool_and_a_refusal_changes_nothing(tensor):
    before = (tensor.committed_sizes, tensor.physical_bytes)
    with pytest.raises(TypeError, match="zero_new must be a bool, got 'no'"):
        tensor.resize_per_segment_(2 * MiB, zero_new="no")
    assert (tensor.committed_sizes, tensor.physical_bytes) == before
    tensor.resize_per_segment_(2 * MiB, zero_new=True)
    assert not tensor.segment_view(0).to_numpy()[MiB:].any()


@pytest.mark.parametrize(
    "spelling, name",
    [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("fp64", "float64"),
        ("double", "float64"),
        ("torch.half", "float16"),
    ],
)
def test_the_short_spellings_of_frameworks_are_understood(spelling, name):
    assert canonical_dtype(spelling).name == name
    with pytest.raises(TypeError, match="bf17"):
        canonical_dtype("bf17")


def test_a_view_of_an_alias_dtype_reads_as_the_full_name(tensor):
    view = tensor.segment_view(0).view("fp16", (MiB // 2,))
    assert view.dtype.name == "float16" and view.to_numpy().dtype == np.float16


def test_complex_targets_take_the_float_rule_on_each_component():
    """complex64 refused NaN and complex128 rounding ("do not fit exactly") where float32
    accepts both, and a complex64 pool refused complex128 input (TypeError) although it
    documents same-kind casting: rounding and NaN are accepted, overflow refused by value."""
    from jaxbuf._convert import convert_any
    from jaxbuf.jax_ops import StagedWrites

    wide = np.array([1 / 3 + 2j, complex(np.nan, 1), 3], np.complex128)
    narrowed = convert_any(wide, np.dtype(np.complex64), "complex64")
    assert narrowed.dtype == np.complex64 and np.isnan(narrowed[1].real)
    np.testing.assert_allclose(narrowed[[0, 2]], wide[[0, 2]], rtol=1e-7)
    assert convert_any(np.array([1, 2]), np.dtype(np.complex64), "c").tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"1e\+300.*at index 1 overflows complex64"):
        convert_any(np.array([0, 1e300 + 0j]), np.dtype(np.complex64), "complex64")
    with pytest.raises(TypeError, match="cannot be written to a complex64"):
        convert_any(np.array(["a"]), np.dtype(np.complex64), "complex64")
    StagedWrites(4, 8, "complex64").stage_write(0, 0, wide)  # accepted, as float32 would
    pool = jaxbuf.UvaBufferPool(16, "complex64", device="cpu")
    try:
        view = pool.copy_to_uva(wide)
        np.testing.assert_allclose(view.to_numpy()[[0, 2]], wide[[0, 2]], rtol=1e-7)
        with pytest.raises(ValueError, match="overflows complex64"):
            pool.copy_to_uva(np.array([1e300 + 0j]))
    finally:
        pool.close()
