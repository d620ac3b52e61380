"""The seed's API is the contract: every call the vLLM seeds make runs unchanged, with no warning.

Each test calls a seed signature exactly as the seeds (``vllm.utils.extensible_tensor``,
``vllm.v1.worker.gpu.buffer_utils``) and vLLM's own tests do, positionally and by keyword,
under ``warnings.simplefilter("error")``, and checks what comes back. Where the seed takes no
device (it uses the platform's current one), the ``current_platform`` fixture makes the
parametrized device jaxbuf's default, so the call stays the seed's. Fresh pinned memory
reads zero, as the seed's ``torch.zeros(..., pin_memory=True)`` does: checked on the CPU
through a driver that hands freed pinned blocks back as they are, as a pinned allocator may.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings

import numpy as np
import pytest
from conftest import JAX_REASON, TORCH_REASON, TRITON_REASON

import jaxbuf
from jaxbuf import _platforms
from jaxbuf.drivers import HostVmmDriver
from jaxbuf.uva._probe import _probe_aliasing

MiB = 1 << 20
FRAMEWORKS = ["numpy", "torch", "jax"]


@contextlib.contextmanager
def no_warning():
    """Any warning raised inside is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _need(framework: str, device: str = "cpu") -> None:
    reason = {"torch": TORCH_REASON, "jax": JAX_REASON}.get(framework)
    if reason:
        pytest.skip(reason)
    if framework == "jax" and device.startswith("cuda"):
        import jax

        try:
            jax.devices("gpu")
        except RuntimeError as error:
            pytest.skip(f"JAX has no GPU backend here: {error}")
    if framework == "numpy" and device.startswith("cuda"):
        pytest.skip("numpy imports host memory only")


def _host(array) -> np.ndarray:
    """The values of a BufferView, torch tensor or JAX array, read on the host."""
    if isinstance(array, jaxbuf.BufferView):
        if array.device.is_cuda:
            return array.to_torch().cpu().numpy()
        return array.to_numpy().copy()
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _index_of(device: str):
    """The seed's ``device_index``: an int for CUDA, jaxbuf's CPU device otherwise."""
    parsed = jaxbuf.as_device(device)
    return parsed.index if parsed.is_cuda else parsed


@pytest.fixture
def current_platform(device, monkeypatch):
    """``device``'s platform as the default (the seed's ``current_platform``)."""
    monkeypatch.setattr(_platforms, "_probe", lambda: jaxbuf.as_device(device).platform)
    return device


# -- vllm.utils.extensible_tensor ----------------------------------------------------------
def test_extensible_tensor_positional_and_keyword(device):
    with no_warning():
        equal = jaxbuf.ExtensibleTensor(4 * MiB, device, 2)
        explicit = jaxbuf.ExtensibleTensor(4 * MiB, device, 2, [MiB, 3 * MiB])
        keyword = jaxbuf.ExtensibleTensor(
            max_num_bytes=4 * MiB, device=device, num_segments=1, segment_capacities=None
        )
    try:
        assert equal.segment_capacities == [2 * MiB, 2 * MiB]
        assert explicit.segment_capacities == [MiB, 3 * MiB]
        assert keyword.num_segments == 1 and keyword.segment_capacity_bytes == 4 * MiB
        with no_warning():
            explicit.resize_segments_([64, 128], zero_new=True)
            explicit.resize_per_segment_(256, zero_new=True)
        assert [explicit.segment_view(i).nbytes for i in range(2)] == [256, 256]
        assert not _host(explicit.segment_view(1)).any()
    finally:
        for tensor in (equal, explicit, keyword):
            tensor.free()


def test_granule_size_positional_and_keyword(device):
    index = _index_of(device)
    with no_warning():
        positional = jaxbuf.granule_size(index)
        keyword = jaxbuf.granule_size(device_index=index)
    assert positional == keyword and positional % (2 * MiB) == 0


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_uint8_tensor_from_ptr_is_imported_by_every_framework(device, framework):
    _need(framework, device)
    pattern = np.arange(64, dtype=np.uint8)
    tensor = jaxbuf.ExtensibleTensor(2 * MiB, device)
    try:
        tensor.resize_per_segment_(64)
        _write(tensor.segment_view(0), pattern)
        with no_warning():
            positional = jaxbuf.uint8_tensor_from_ptr(tensor.base_ptr, 64, _index_of(device))
            keyword = jaxbuf.uint8_tensor_from_ptr(
                ptr=tensor.base_ptr + 16, num_bytes=8, device_index=_index_of(device)
            )
        assert positional.dtype == jaxbuf.canonical_dtype("uint8") and positional.shape == (64,)
        np.testing.assert_array_equal(_host(_import(positional, framework)), pattern)
        np.testing.assert_array_equal(_host(_import(keyword, framework)), pattern[16:24])
    finally:
        tensor.free()


def _write(view: jaxbuf.BufferView, values: np.ndarray) -> None:
    """Write ``values`` into ``view``'s memory, on any device."""
    if view.device.is_cuda:
        import torch

        view.to_torch().copy_(torch.from_numpy(values).to(str(view.device)))
        torch.cuda.synchronize()
    else:
        view.to_numpy()[:] = values


def _import(view: jaxbuf.BufferView, framework: str):
    """What the framework's own DLPack import makes of ``view``."""
    if framework == "numpy":
        return np.from_dlpack(view)
    if framework == "torch":
        import torch

        return torch.from_dlpack(view)
    import jax

    return jax.dlpack.from_dlpack(view)


def test_uint8_tensor_from_ptr_refuses_bad_input():
    with pytest.raises(ValueError, match="num_bytes"):
        jaxbuf.uint8_tensor_from_ptr(4096, -1, "cpu")
    with pytest.raises(TypeError, match="device"):
        jaxbuf.uint8_tensor_from_ptr(4096, 16, None)
    with pytest.raises(ValueError, match="no device cpu:3"):
        jaxbuf.uint8_tensor_from_ptr(4096, 16, "cpu:3")


# -- vllm.v1.worker.gpu.buffer_utils: UvaBufferPool, NonUvaBuffer ---------------------------
def _dtypes() -> list:
    dtypes = [np.int32, "int32"]
    if TORCH_REASON is None:
        import torch

        dtypes.append(torch.int32)
    return dtypes


@pytest.mark.parametrize("dtype", _dtypes(), ids=["numpy", "str", "torch"][: len(_dtypes())])
def test_uva_buffer_pool_positional_and_keyword(current_platform, dtype):
    with no_warning():
        positional = jaxbuf.UvaBufferPool((4, 3), dtype, 2)
        keyword = jaxbuf.UvaBufferPool(size=4, dtype=dtype, max_concurrency=None)
    try:
        assert positional.device == jaxbuf.as_device(current_platform)
        assert (positional.size, positional.max_concurrency) == ((4, 3), 2)
        assert keyword.max_concurrency == 2  # the seed's default
        for slot in (*positional.slots, *keyword.slots):
            assert not slot.np.any(), "a fresh slot must read zero"
        with no_warning():
            rows = positional.copy_to_uva(np.arange(15, dtype=np.int32).reshape(5, 3))
            flat = keyword.copy_to_uva(x=[1, 2, 3])
        np.testing.assert_array_equal(_host(rows), np.arange(15).reshape(5, 3))
        np.testing.assert_array_equal(_host(flat), [1, 2, 3])
        # A grown slot reads zero past the rows written.
        assert not positional.slots[positional.current_slot].np[5:].any()
    finally:
        positional.close()
        keyword.close()


@pytest.mark.parametrize("use_out", [False, True])
@pytest.mark.parametrize("input_type", FRAMEWORKS)
def test_uva_pool_copy_to_gpu_keeps_shape_and_out(current_platform, use_out, input_type):
    """vLLM's copy_to_gpu test: shapes across growth, and ``out`` returned as given."""
    _need("torch")
    _need(input_type)
    import torch

    pool = jaxbuf.UvaBufferPool((2, 3), torch.int32, max_concurrency=2)
    try:
        for length in (2, 5, 3, 6):
            expected = np.arange(length * 3, dtype=np.int32).reshape(length, 3)
            values = _as_input(expected, input_type)
            out = torch.empty(expected.shape, dtype=torch.int32, device=current_platform)
            with no_warning():
                result = pool.copy_to_gpu(values, out=out) if use_out else pool.copy_to_gpu(values)
            if use_out:
                assert result is out
            np.testing.assert_array_equal(_host(result), expected)
    finally:
        pool.close()


def _as_input(array: np.ndarray, kind: str):
    if kind == "list":
        return array.tolist()
    if kind == "numpy":
        return array
    if kind == "torch":
        import torch

        return torch.from_numpy(array.copy())
    import jax.numpy as jnp

    return jnp.asarray(array)


@pytest.mark.parametrize("input_type", ["list", "numpy", "torch"])
@pytest.mark.parametrize("size", [(4,), (4, 3)])
def test_uva_pool_exposes_only_current_contents(current_platform, input_type, size):
    """vLLM's prefix test: both slots start zeroed, grow to powers of two, and a shorter
    reuse exposes only the current rows; an empty list has no row shape (numpy's refusal)."""
    _need(input_type)
    pool = jaxbuf.UvaBufferPool(size, np.int32, max_concurrency=2)
    try:
        for buffer in pool.slots:
            assert buffer.shape == size and np.count_nonzero(buffer.np) == 0
        lengths = [0, 0, 3, 3, 4, 4, 5, 3, 3, 5, 1024, 1024, 1025, 1025, 2, 2]
        for step, length in enumerate(lengths):
            if input_type == "list" and len(size) > 1 and length == 0:
                with pytest.raises(ValueError, match="could not broadcast"):
                    pool.copy_to_uva([])
                continue
            shape = (length, *size[1:])
            expected = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) - step
            before = pool.slots
            slot = (pool.current_slot + 1) % pool.max_concurrency
            with no_warning():
                result = pool.copy_to_uva(_as_input(expected, input_type))
            assert tuple(result.shape) == shape and pool.current_slot == slot
            assert pool.slots[1 - slot] is before[1 - slot]
            if length <= before[slot].shape[0]:
                assert pool.slots[slot] is before[slot]
            else:
                assert pool.slots[slot].shape == (1 << (length - 1).bit_length(), *size[1:])
            assert pool.size == size
            np.testing.assert_array_equal(_host(result), expected)
    finally:
        pool.close()


def test_non_uva_buffer_positional_and_keyword(current_platform):
    with no_warning():
        positional = jaxbuf.NonUvaBuffer(8, np.int32)
        keyword = jaxbuf.NonUvaBuffer(size=(2, 4), dtype="float32")
    try:
        assert not _host(positional.uva()).any() and not positional.np.any()
        positional.np[:3] = [7, 8, 9]
        with no_warning():
            rows = positional.uva(3)
        np.testing.assert_array_equal(_host(rows), [7, 8, 9])
        keyword.np[1] = 0.5
        np.testing.assert_array_equal(_host(keyword.uva(n=2))[1], [0.5] * 4)
    finally:
        positional.free()
        keyword.free()


# -- vllm.v1.worker.gpu.buffer_utils: FusedStagedWriter -------------------------------------
def _pointers(values: list[int], framework: str, dtype: str, device: str):
    if framework == "list":
        return values
    if framework == "numpy":
        return np.array(values, dtype=dtype)
    import torch

    return torch.tensor(values, dtype=getattr(torch, dtype), device=device)


@pytest.mark.parametrize("framework", ["list", "numpy", "torch"])
@pytest.mark.parametrize("call", ["positional", "keyword"])
def test_fused_staged_writer_as_vllm_calls_it(device, call, framework):
    """vLLM's fused-writer test: ``FusedStagedWriter(device, max_writes=2)`` applied with
    ``output_ptrs`` / ``output_strides`` of the targets (as vLLM's model runner builds
    them: ``FusedStagedWriter(self.device, groups * max_num_reqs)``)."""
    if TRITON_REASON:
        pytest.skip(TRITON_REASON)  # the seed's apply launches the Triton kernel
    _need(framework)
    states = [
        jaxbuf.StagedWriteTensor((1, 64), np.int32, device, max_concurrency=2) for _ in range(2)
    ]
    states[0].stage_write(0, 0, [7])
    states[0].stage_write(0, 1, np.array([8, 9], dtype=np.int64))
    states[1].stage_write(0, 0, [10, 11])
    with no_warning():
        if call == "positional":
            writer = jaxbuf.FusedStagedWriter(device, 2, 2)
        else:
            writer = jaxbuf.FusedStagedWriter(device=device, max_writes=2, max_concurrency=None)
    try:
        ptrs = _pointers([s.gpu.ptr for s in states], framework, "uint64", device)
        strides = _pointers([s.row_len for s in states], framework, "int64", device)
        with no_warning():
            writer.apply(states, ptrs, strides)
        assert writer.device == jaxbuf.as_device(device) and writer.max_writes == 2
        np.testing.assert_array_equal(_host(states[0].gpu)[0, :4], [7, 8, 9, 0])
        np.testing.assert_array_equal(_host(states[1].gpu)[0, :3], [10, 11, 0])
        assert all(s.num_staged_writes == 0 for s in states)
        states[1].stage_write(0, 2, [12])
        with no_warning():
            writer.apply(tensors=states, output_ptrs=ptrs, output_strides=strides)
        np.testing.assert_array_equal(_host(states[1].gpu)[0, :3], [10, 11, 12])
    finally:
        writer.close()
        for state in states:
            state.free()


def test_the_order_jaxbuf_once_had_is_refused_naming_the_seeds():
    with pytest.raises(TypeError, match=r"\(device, max_writes, max_concurrency\)"):
        jaxbuf.FusedStagedWriter(8, "cpu")


# -- fresh pinned memory reads zero ----------------------------------------------------------
class RecyclingHostDriver(HostVmmDriver):
    """The CPU driver, but :meth:`host_alloc` hands a freed block of the same size back as
    it is, bytes and all, as a pinned allocator may (CUDA's did: a fresh pool slot read the
    UVA probe's 0x5A pattern)."""

    host_alloc_zeroed = False

    def __init__(self) -> None:
        super().__init__()
        self.recycled: dict[int, list[int]] = {}  # size -> freed blocks, still mapped
        self.sizes: dict[int, int] = {}
        self.reused: list[int] = []

    def host_alloc(self, size: int, device_index: int) -> tuple[int, int]:
        blocks = self.recycled.get(size)
        if blocks:
            ptr = blocks.pop()
            self.reused.append(ptr)
        else:
            ptr, _ = super().host_alloc(size, device_index)
        self.sizes[ptr] = size
        return ptr, ptr

    def host_free(self, host_ptr: int) -> None:
        self.recycled.setdefault(self.sizes.pop(host_ptr), []).append(host_ptr)

    def dirty(self, size: int, byte: int = 0x5A) -> int:
        """A freed block of ``size`` bytes full of ``byte``, next in line for reuse."""
        ptr, _ = self.host_alloc(size, 0)
        ctypes.memset(ptr, byte, size)
        self.host_free(ptr)
        return ptr

    def close(self) -> None:
        for blocks in self.recycled.values():
            for ptr in blocks:
                super().host_free(ptr)
        self.recycled.clear()


@pytest.fixture
def recycling_driver():
    driver = RecyclingHostDriver()
    yield driver
    driver.close()


def test_a_fresh_uva_buffer_reads_zero_over_a_reused_block(recycling_driver):
    dirty = recycling_driver.dirty(64)
    buffer = jaxbuf.UvaBuffer(16, "int32", "cpu", driver=recycling_driver)
    assert recycling_driver.reused == [dirty]  # the test saw the dirty block come back
    assert not buffer.np.any()
    buffer.free()


def test_the_uva_probe_leaves_no_pattern_and_pool_slots_read_zero(recycling_driver):
    assert _probe_aliasing(recycling_driver, 0) is None
    probed = recycling_driver.recycled[4096]
    probed_before = list(probed)
    assert len(probed) == 2
    for ptr in probed:
        assert not np.ctypeslib.as_array((ctypes.c_uint8 * 4096).from_address(ptr)).any()
    recycling_driver.dirty(4096)  # one of them left dirty again by someone else
    pool = jaxbuf.UvaBufferPool(1024, "int32", 2, "cpu", driver=recycling_driver)
    assert sorted(recycling_driver.reused[1:]) == sorted(probed_before)  # every slot reused
    assert all(not slot.np.any() for slot in pool.slots)
    pool.close()


def test_a_grown_pool_slot_reads_zero_past_the_rows_written(recycling_driver):
    pool = jaxbuf.UvaBufferPool((4, 2), "int32", 1, "cpu", driver=recycling_driver)
    dirty = recycling_driver.dirty(8 * 2 * 4)  # the grown slot's size: 8 rows of 2 int32
    pool.copy_to_uva(np.ones((5, 2), np.int32))
    assert dirty in recycling_driver.reused
    slot = pool.slots[0]
    assert slot.shape == (8, 2) and (slot.np[:5] == 1).all() and not slot.np[5:].any()
    pool.close()


def test_a_fresh_pinned_staged_target_reads_zero(recycling_driver):
    dirty = recycling_driver.dirty(4 * 8 * 4)
    swt = jaxbuf.StagedWriteTensor(
        (4, 8), "int32", "cpu", uva_instead_of_gpu=True, backend="numpy", driver=recycling_driver
    )
    assert dirty in recycling_driver.reused
    assert not swt.to_numpy().any()
    swt.free()
