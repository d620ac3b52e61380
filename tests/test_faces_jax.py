"""``jaxbuf.jax``: vLLM's scenarios where they mean something for JAX, and the aliasing
contract the module docstring states, including a torch writer with a JAX reader.

A JAX array cannot be written in place, so the writes vLLM makes through a tensor are made
here through the host (``np``), through jaxbuf (staged writes, pools, ``sync``) or through a
``jaxbuf.torch`` tensor over the same memory; what a JAX array shows is read with
``np.asarray`` of an array taken after the write, as the contract prescribes. What the
contract leaves open (the host value of an array taken before a write) is not asserted.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import JAX_REASON, TORCH_REASON, TRITON_REASON

if JAX_REASON:
    pytest.skip(JAX_REASON, allow_module_level=True)

import jax
import jax.numpy as jnp

import jaxbuf
from jaxbuf import _platforms
from jaxbuf.jax import (
    DeviceParamTable,
    ExtensibleKVCacheBuilder,
    ExtensibleTensor,
    FusedStagedWriter,
    NonUvaBuffer,
    StagedWriteTensor,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    uint8_tensor_from_ptr,
)

needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=str(TRITON_REASON))
needs_torch = pytest.mark.skipif(TORCH_REASON is not None, reason=str(TORCH_REASON))


@pytest.fixture
def jax_device(device):
    """The JAX device of ``device`` (a GPU test skips where JAX has no GPU backend)."""
    if device == "cpu":
        return jaxbuf.as_device(device).jax()  # JAX always has its CPU: a failure fails
    try:
        return jaxbuf.as_device(device).jax()
    except (RuntimeError, ValueError) as error:
        pytest.skip(f"JAX has no device for {device}: {error}")


@pytest.fixture
def current_platform(jax_device, device, monkeypatch):
    monkeypatch.setattr(_platforms, "_probe", lambda: jaxbuf.as_device(device).platform)
    return jax_device


def _pointer(array: jax.Array) -> int:
    return array.unsafe_buffer_pointer()


def _is_array_on(array: object, jax_device) -> bool:
    return isinstance(array, jax.Array) and array.devices() == {jax_device}


# -- vLLM's extensible-tensor scenarios -----------------------------------------------------------
def _write(et: ExtensibleTensor, index: int, values: np.ndarray) -> None:
    """Write segment ``index`` (``values``: its committed size) through jaxbuf: a pool copy
    into the segment's JAX array (``copy_to_gpu(out=...)`` writes an immutable array's buffer
    in place and waits), so any array taken afterwards shows it."""
    out = et.segment_view(index)
    pool = jaxbuf.UvaBufferPool(out.shape, "uint8", 1, jaxbuf.as_device(et.device))
    try:
        pool.copy_to_gpu(values, out=out)
    finally:
        pool.close()


def test_extensible_tensor_grows_without_moving(jax_device):
    buffer = ExtensibleTensor(4096, device=jax_device)
    try:
        base_ptr = buffer.base_ptr
        buffer.resize_per_segment_(1024, zero_new=True)
        first_view = buffer.segment_view(0)
        assert _is_array_on(first_view, jax_device) and first_view.dtype == jnp.uint8
        assert _pointer(first_view) == base_ptr and first_view.shape == (1024,)
        _write(buffer, 0, np.full(1024, 7, np.uint8))

        buffer.resize_per_segment_(2048)
        second_view = buffer.segment_view(0)
        assert _pointer(second_view) == base_ptr and second_view.shape == (2048,)
        assert np.all(np.asarray(second_view[:1024]) == 7)

        full_view = buffer.full_view()
        assert _pointer(full_view) == base_ptr and full_view.size == 4096
        del first_view, second_view, full_view
    finally:
        buffer.free()


def test_unequal_segments_and_bad_input_raise_as_with_torch(jax_device):
    et = ExtensibleTensor(max_num_bytes=12288, device=jax_device, segment_capacities=[4096, 8192])
    try:
        et.resize_segments_([1024, 2048], zero_new=True)
        assert et.segment_view(0).shape == (1024,) and et.segment_view(1).shape == (2048,)
        assert _pointer(et.segment_view(1)) == et.base_ptr + 4096
        with pytest.raises(ValueError, match="grow-only"):
            et.resize_segments_([512, 2048])
        with pytest.raises(ValueError, match="exceeds"):
            et.resize_segments_([4097, 2048])
        with pytest.raises(ValueError, match="Expected 2 sizes"):
            et.resize_segments_([4096])
        with pytest.raises(IndexError):
            et.segment_view(2)
    finally:
        et.free()


@needs_triton
def test_staged_write_tensor_applies_ragged_writes(jax_device):
    tensor = StagedWriteTensor((4, 8), dtype=jnp.int32, device=jax_device)
    tensor.stage_write(2, 3, [3, 1, 2])
    tensor.stage_write(0, 1, jnp.array([-1, -2, -5]))
    tensor.stage_write_elem(1, 7)
    tensor.apply_write()
    gpu = tensor.gpu
    assert _is_array_on(gpu, jax_device) and gpu.dtype == jnp.int32
    assert np.asarray(gpu).tolist() == [
        [0, -1, -2, -5, 0, 0, 0, 0],
        [7, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 3, 1, 2, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert tensor.num_staged_writes == 0
    del gpu
    tensor.free()


@needs_triton
def test_fused_staged_writer_applies_each_tensor(jax_device):
    first = StagedWriteTensor((2, 4), dtype=jnp.int32, device=jax_device)
    second = StagedWriteTensor((2, 4), dtype=jnp.int32, device=jax_device)
    first.stage_write(0, 0, [10, 11])
    second.stage_write(1, 2, [20, 21])
    writer = FusedStagedWriter(jax_device, max_writes=4)
    targets = [first.gpu, second.gpu]
    writer.apply(
        [first, second],
        output_ptrs=[_pointer(t) for t in targets],
        output_strides=[t.shape[1] for t in targets],
    )
    del targets  # taken before the apply: their host values are left open
    assert np.asarray(first.gpu).tolist() == [[10, 11, 0, 0], [0, 0, 0, 0]]
    assert np.asarray(second.gpu).tolist() == [[0, 0, 0, 0], [0, 0, 20, 21]]
    writer.close()
    first.free()
    second.free()


@pytest.mark.parametrize("input_type", ["list", "numpy", "jax"])
@pytest.mark.parametrize("size", [(4,), (4, 3)])
def test_uva_pool_overwrites_exposed_prefix(current_platform, input_type, size):
    pool = UvaBufferPool(size, jnp.int32, max_concurrency=2)
    for buf in pool.slots:
        assert buf.np.shape == size and np.count_nonzero(buf.np) == 0
    lengths = [0, 0, 3, 3, 4, 4, 5, 3, 3, 5, 1024, 1024, 1025, 1025, 2, 2]
    for step, length in enumerate(lengths):
        if input_type == "list" and len(size) > 1 and length == 0:
            with pytest.raises(ValueError, match="could not broadcast"):
                pool.copy_to_uva([])
            continue
        shape = (length, *size[1:])
        expected = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) - step
        values = {"list": expected.tolist(), "numpy": expected, "jax": jnp.asarray(expected)}
        before = list(pool.slots)
        rows_before = [buf.shape[0] for buf in before]
        slot = (pool.current_slot + 1) % pool.max_concurrency
        result = pool.copy_to_uva(values[input_type])
        assert _is_array_on(result, current_platform) and result.shape == shape
        assert pool.current_slot == slot and pool.slots[1 - slot] is before[1 - slot]
        if length <= rows_before[slot]:
            assert pool.slots[slot] is before[slot]
        else:
            assert pool.slots[slot].shape == (1 << (length - 1).bit_length(), *size[1:])
        np.testing.assert_array_equal(np.asarray(result), expected)
    pool.close()


@pytest.mark.parametrize("use_out", [False, True])
def test_uva_pool_copy_to_gpu_preserves_shape_and_out(current_platform, use_out):
    pool = UvaBufferPool((2, 3), jnp.int32, max_concurrency=2)
    for length in (2, 5, 3, 6):
        expected = np.arange(length * 3, dtype=np.int32).reshape(length, 3)
        out = jax.device_put(jnp.zeros(expected.shape, jnp.int32), current_platform)
        out.block_until_ready()
        result = pool.copy_to_gpu(expected, out=out if use_out else None)
        assert _is_array_on(result, current_platform)
        if use_out:
            assert result is out
        np.testing.assert_array_equal(np.asarray(result), expected)
    pool.close()


@needs_triton
@pytest.mark.parametrize("uva_target", [False, True])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_staged_write_generations(jax_device, uva_target, dtype):
    """vLLM's in-flight test in JAX's terms: a copy made from the array taken after each
    apply holds that generation, whatever later applies write."""
    state = StagedWriteTensor(
        (4, 4096), dtype, jax_device, max_concurrency=2, uva_instead_of_gpu=uva_target
    )
    expected = np.zeros((4, 4096), dtype=np.dtype(dtype))
    snapshots = []
    for step in range(12):
        length = [3, 17, 1500, 4090][step % 4]
        row = step % 3
        values = np.arange(length, dtype=expected.dtype) + step * 8192
        if expected.dtype == np.float32:
            values += 0.25
        expected[row, 2 : 2 + length] = values
        expected[3, 1:4] = step
        state.stage_write(row, 2, values.tolist())
        state.stage_write(3, 1, [step] * 3)
        state.apply_write()
        snapshots.append((jnp.array(state.gpu, copy=True), expected.copy()))
    for snapshot, reference in snapshots:
        np.testing.assert_array_equal(np.asarray(snapshot), reference)
    del snapshots
    state.free()


# -- the aliasing contract ---------------------------------------------------------------------
@needs_torch
def test_a_torch_writer_and_a_jax_reader_of_the_same_memory(jax_device, device):
    """torch writes through jaxbuf.torch; a JAX array taken after the write shows it; one
    taken before keeps its shape and dtype (its host value is left open, and not asserted)."""
    import torch

    import jaxbuf.torch as jt

    et = ExtensibleTensor(8192, device=jax_device, num_segments=2)
    try:
        et.resize_per_segment_(1024, zero_new=True)
        before = et.segment_view(1)
        index = jaxbuf.as_device(device).index if jaxbuf.as_device(device).is_cuda else "cpu"
        writer = jt.uint8_tensor_from_ptr(et.base_ptr + et.segment_offsets[1], 1024, index)
        pattern = torch.arange(1024, device=writer.device).to(torch.uint8)
        writer.copy_(pattern)
        if writer.is_cuda:
            torch.cuda.synchronize()  # the contract: torch's writes finish before JAX takes
        after = et.segment_view(1)
        assert before.shape == after.shape == (1024,) and before.dtype == after.dtype
        np.testing.assert_array_equal(np.asarray(after), pattern.cpu().numpy())
        assert not np.asarray(et.segment_view(0)).any()  # the other segment is untouched
        del before, after, writer
    finally:
        et.free()


@needs_torch
@needs_triton
def test_a_torch_writer_after_an_apply_and_a_jax_reader(jax_device):
    import torch

    staged = StagedWriteTensor((2, 8), jnp.int32, jax_device)
    staged.stage_write(0, 0, [1, 2, 3])
    staged.apply_write()
    tensor = staged.to_torch()  # the same target memory, as torch
    tensor[1, 4:6] = torch.tensor([8, 9], dtype=torch.int32)
    if tensor.is_cuda:
        torch.cuda.synchronize()
    assert np.asarray(staged.gpu).tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [0, 0, 0, 0, 8, 9, 0, 0]]
    del tensor
    staged.free()


def test_an_array_taken_before_a_write_serves_steps_dispatched_after_it(current_platform):
    """A jitted step reads the memory when it runs: the array imported once sees each host
    write made before the step is dispatched (its host value is read from a fresh one)."""
    buffer = UvaBuffer(4, jnp.int32)
    taken = buffer.uva()
    double = jax.jit(lambda x: x * 2)
    for value in (1, 5, 9):
        buffer.np[:] = value
        np.testing.assert_array_equal(np.asarray(double(taken)), [2 * value] * 4)
        np.testing.assert_array_equal(np.asarray(buffer.uva()), [value] * 4)
    del taken
    buffer.free()


def test_a_grow_changes_no_array_taken_before(jax_device):
    et = ExtensibleTensor(8192, device=jax_device, num_segments=2)
    try:
        et.resize_per_segment_(256, zero_new=True)
        source = np.arange(256, dtype=np.uint8)
        _write(et, 0, source)
        taken = et.segment_view(0)
        et.resize_per_segment_(1024, zero_new=True)
        assert taken.shape == (256,)  # its shape is the prefix it was taken over
        np.testing.assert_array_equal(np.asarray(taken), source)  # and its bytes are kept
        grown = et.segment_view(0)
        assert grown.shape == (1024,) and _pointer(grown) == _pointer(taken)
        np.testing.assert_array_equal(np.asarray(grown[:256]), source)
        assert not np.asarray(grown[256:]).any()
        del taken, grown
    finally:
        et.free()


def test_a_release_then_recommit_reads_zero_through_a_fresh_array(jax_device):
    et = ExtensibleTensor(4096, device=jax_device)
    try:
        et.resize_per_segment_(512, zero_new=True)
        _write(et, 0, np.full(512, 9, np.uint8))
        assert np.all(np.asarray(et.segment_view(0)) == 9)
        et.release_physical()  # invalidates every array taken before it: none is kept
        et.resize_per_segment_(512, zero_new=True)
        assert not np.asarray(et.segment_view(0)).any()
    finally:
        et.free()


def test_pool_arrays_hold_their_call_until_the_slot_is_reused(current_platform):
    pool = UvaBufferPool(4, jnp.int32, max_concurrency=2)
    first = pool.copy_to_uva([1, 2, 3, 4])
    second = pool.copy_to_uva([5, 6, 7, 8])  # the other slot: first is untouched
    assert first is not second and _pointer(first) != _pointer(second)
    np.testing.assert_array_equal(np.asarray(first), [1, 2, 3, 4])
    np.testing.assert_array_equal(np.asarray(second), [5, 6, 7, 8])
    third = pool.copy_to_uva([9, 9, 9, 9])  # reuses first's slot: take the new array
    assert _pointer(third) == _pointer(first)
    np.testing.assert_array_equal(np.asarray(third), [9, 9, 9, 9])
    pool.close()


def test_host_writes_reach_a_fresh_array_and_cpu_names_np(current_platform):
    buffer = UvaBuffer((3, 2), jnp.int32)
    buffer.np[1] = 5
    fresh = buffer.uva(2)
    assert _is_array_on(fresh, current_platform)
    np.testing.assert_array_equal(np.asarray(fresh), [[0, 0], [5, 5]])
    for owner in (buffer, NonUvaBuffer(2, jnp.int32), UvaBackedTensor(2, jnp.int32)):
        with pytest.raises(AttributeError, match=r"\.np"):
            owner.cpu
    backed = UvaBackedTensor(4, jnp.int32, max_concurrency=2)
    backed.np[:] = [5, 6, 7, 8]
    np.testing.assert_array_equal(np.asarray(backed.copy_to_uva(3)), [5, 6, 7])
    backed.close()
    buffer.free()


def test_kv_names_and_param_table_hand_out_fresh_arrays(jax_device):
    builder = ExtensibleKVCacheBuilder(num_blocks_capacity=8, device=jax_device)
    flat = builder.reserve(8 * 2048, num_segments=2)
    assert _is_array_on(flat, jax_device) and flat.dtype == jnp.uint8
    kv = builder.finish()
    kv.commit(4)
    k, v = kv.committed_views(0, jnp.float32)
    assert _is_array_on(k, jax_device) and k.shape == (4, 256) and k.dtype == jnp.float32
    assert _pointer(k) == _pointer(flat) == _pointer(kv.full_view(0))
    assert not np.asarray(k).any()
    del flat, k, v
    kv.free()

    table = DeviceParamTable(4, {"temperature": jnp.float32}, jax_device)
    table["temperature"].np[:] = 0.7
    table.sync()
    first = table["temperature"].gpu  # the last sync's values, JAX's own array
    assert _is_array_on(first, jax_device) and first is table["temperature"].gpu
    np.testing.assert_allclose(np.asarray(first), np.full(4, 0.7, np.float32))
    table["temperature"].np[:] = 0.5
    table.sync()
    np.testing.assert_allclose(np.asarray(table.fields["temperature"].gpu), 0.5)
    np.testing.assert_allclose(np.asarray(first), 0.7)  # a value: the sync left it
    del first
    table.close()


def test_uint8_tensor_from_ptr_is_an_array_over_the_memory(jax_device, device):
    et = ExtensibleTensor(4096, device=jax_device)
    et.resize_per_segment_(64, zero_new=True)
    index = jaxbuf.as_device(device).index if jaxbuf.as_device(device).is_cuda else "cpu"
    wrapped = uint8_tensor_from_ptr(et.base_ptr, 64, index)
    assert _is_array_on(wrapped, jax_device) and _pointer(wrapped) == et.base_ptr
    assert wrapped.shape == (64,) and wrapped.dtype == jnp.uint8
    del wrapped
    et.free()
