"""One vocabulary across the public API: error types, type aliases, names, reprs, context
managers."""

from __future__ import annotations

import pickle
import typing

import numpy as np
import pytest

import jaxbuf
from jaxbuf import ByteOrderError, ClosedError


# -- one error type per kind of misuse ---------------------------------------------------------
def _freed_extensible():
    buf = jaxbuf.ExtensibleTensor(1 << 20, device="cpu")
    buf.free()
    return buf, lambda: buf.segment_view(0), "ExtensibleTensor", "freed"


def _freed_uva():
    buf = jaxbuf.UvaBuffer(4, "int32", device="cpu")
    buf.free()
    return buf, buf.uva, "UvaBuffer", "freed"


def _freed_nonuva():
    buf = jaxbuf.NonUvaBuffer(4, "int32", device="cpu")
    buf.free()
    return buf, buf.uva, "NonUvaBuffer", "freed"


def _closed_pool():
    pool = jaxbuf.UvaBufferPool(4, "int32", device="cpu")
    pool.close()
    return pool, lambda: pool.copy_to_uva(np.zeros(2, np.int32)), "UvaBufferPool", "closed"


@pytest.mark.parametrize("make", [_freed_extensible, _freed_uva, _freed_nonuva, _closed_pool])
def test_a_closed_owner_raises_closed_error_naming_it(make):
    _, use, owner, state = make()
    with pytest.raises(ClosedError, match=f"the {owner} has been {state}") as info:
        use()
    assert isinstance(info.value, RuntimeError)  # the owner contract's type
    assert isinstance(info.value, ValueError)  # what UVA owners raised before
    assert (info.value.owner, info.value.state) == (owner, state)


def test_a_view_of_a_freed_owner_raises_closed_error_at_export():
    buf = jaxbuf.ExtensibleTensor(1 << 20, device="cpu")
    buf.resize_per_segment_(64)
    view = buf.segment_view(0)
    buf.free()
    with pytest.raises(ClosedError, match="ExtensibleTensor"):
        view.__dlpack__()


def test_closed_error_pickles_with_its_fields():
    error = pickle.loads(pickle.dumps(ClosedError("UvaBuffer", "closed", "no views")))
    assert (error.owner, error.state, error.detail) == ("UvaBuffer", "closed", "no views")
    assert str(error) == "the UvaBuffer has been closed: no views"


def test_byte_order_refusal_is_a_public_type_error():
    with pytest.raises(ByteOrderError, match="non-native byte order") as info:
        jaxbuf.canonical_dtype(np.dtype(">i4" if np.little_endian else "<i4"))
    assert isinstance(info.value, TypeError)


# -- what device= and dtype= accept ------------------------------------------------------------
@pytest.mark.parametrize(
    "alias, members",
    [
        (jaxbuf.DeviceLike, {str, int, jaxbuf.Device}),
        (jaxbuf.DTypeLike, {str, np.dtype, type, jaxbuf.DType}),
    ],
)
def test_type_aliases_name_what_is_accepted(alias, members):
    assert members <= set(typing.get_args(alias))


@pytest.mark.parametrize("spec", ["cpu", jaxbuf.Device("cpu"), "CPU"])
def test_every_device_like_spelling_is_parsed(spec):
    assert jaxbuf.as_device(spec) == jaxbuf.Device("cpu", 0)


@pytest.mark.parametrize("spec", ["int32", np.int32, np.dtype("int32"), "dtype('int32')"])
def test_every_dtype_like_spelling_is_parsed(spec):
    assert jaxbuf.canonical_dtype(spec).name == "int32"


# -- one name per concept ----------------------------------------------------------------------
def test_nbytes_everywhere_and_num_bytes_kept_as_an_alias():
    buf = jaxbuf.ExtensibleTensor(8 << 20, device="cpu", num_segments=2)
    buf.resize_segments_([4096, 1024])
    assert buf.nbytes == buf.num_bytes == 5120
    assert buf.segment_view(0).nbytes == 4096
    uva = jaxbuf.UvaBuffer((4, 2), "int32", device="cpu")
    backed = jaxbuf.UvaBackedTensor((4, 2), "int32", device="cpu")
    assert uva.nbytes == backed.nbytes == 32
    for owner in (buf, uva, backed):
        owner.close()


def test_to_numpy_takes_dtype_and_shape_like_its_siblings():
    buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
    buf.resize_per_segment_(64, zero_new=True)
    array = buf.segment_view(0).to_numpy("int32", (4, 4))
    assert array.dtype == np.int32 and array.shape == (4, 4)
    array[:] = 7
    assert (buf.segment_view(0).to_numpy(dtype=np.int32) == 7).all()
    del array
    buf.free()


def _owners():
    yield jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
    yield jaxbuf.UvaBuffer(4, "float32", device="cpu")
    yield jaxbuf.NonUvaBuffer(4, "float32", device="cpu")
    yield jaxbuf.UvaBackedTensor(4, "float32", device="cpu")


@pytest.mark.parametrize("index", range(4))
def test_every_owner_is_a_context_manager_and_its_repr_says_its_state(index):
    owner = list(_owners())[index]
    with owner as entered:
        assert entered is owner
        text = repr(owner)
        for word in ("device=cpu", "dtype=", "shape=", "nbytes=", "open"):
            assert word in text, text
    text = repr(owner)
    assert "freed" in text or "closed" in text, text
    assert "open" not in text, text


def test_a_view_repr_names_its_owner_state():
    buf = jaxbuf.ExtensibleTensor(2 << 20, device="cpu")
    buf.resize_per_segment_(64)
    view = buf.segment_view(0)
    assert "nbytes=64" in repr(view) and "open" in repr(view)
    buf.free()
    assert "freed" in repr(view)


def test_a_missing_gpu_names_the_cpu_as_what_works():
    from jaxbuf.drivers import cuda_unavailable_reason

    if cuda_unavailable_reason() is None:
        pytest.skip("CUDA works here")
    with pytest.raises(RuntimeError, match='device="cpu"'):
        jaxbuf.ExtensibleTensor(2 << 20, device="cuda")
