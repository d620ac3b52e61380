"""vLLM's own tests of the seeds, run through ``jaxbuf.torch``: the spec of the torch face.

Every scenario of vLLM's ``tests/utils_/test_extensible_tensor.py``,
``tests/v1/worker/test_buffer_utils.py``, ``tests/v1/worker/test_cpu_staged_write.py`` and
``tests/kernels/core/test_uva.py``, written here (not copied), making the calls as they make
them (the same arguments) and the same assertions on the torch tensors that come back. They
run on the CPU driver and, marked ``gpu``, on CUDA. Where vLLM reaches a private attribute,
the same behaviour is checked through the public API, and the test says so. Where vLLM calls
a helper that is not a seed name (``get_accelerator_view_from_cpu_tensor``), the test makes
the same calls on the seed name that does the job (:class:`UvaBuffer`, a pool).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import TORCH_REASON, TRITON_REASON

if TORCH_REASON:
    pytest.skip(TORCH_REASON, allow_module_level=True)

import torch

import jaxbuf
from jaxbuf import _platforms
from jaxbuf.drivers import cuda_unavailable_reason, get_vmm_driver
from jaxbuf.testing import FaultInjectingDriver
from jaxbuf.torch import (
    DeviceParamTable,
    ExtensibleKVCacheBuilder,
    ExtensibleTensor,
    FusedStagedWriter,
    NonUvaBuffer,
    StagedWriteTensor,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    granule_size,
    is_uva_available,
    uint8_tensor_from_ptr,
)

needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=str(TRITON_REASON))


@pytest.fixture
def current_platform(device, monkeypatch):
    """``device``'s platform as jaxbuf's default, as vLLM's ``current_platform`` is: the
    seed's calls that name no device then run there unchanged."""
    monkeypatch.setattr(_platforms, "_probe", lambda: jaxbuf.as_device(device).platform)
    return device


def _synchronize(device: str) -> None:
    """vLLM's ``torch.accelerator.synchronize()``; the CPU has nothing in flight."""
    if device.startswith("cuda"):
        torch.accelerator.synchronize()


def _vmm_unavailable_reason(device: str) -> str | None:
    """vLLM's ``vmm_unavailable_reason``: jaxbuf's driver probe for the device."""
    return cuda_unavailable_reason() if device.startswith("cuda") else None


# -- tests/utils_/test_extensible_tensor.py ----------------------------------------------------
def test_extensible_tensor_grows_without_moving(device):
    buffer = ExtensibleTensor(4096, device=device)
    try:
        base_ptr = buffer.base_ptr
        buffer.resize_per_segment_(1024)
        first_view = buffer.segment_view(0)
        assert isinstance(first_view, torch.Tensor) and first_view.dtype == torch.uint8
        assert first_view.device.type == torch.device(device).type
        assert first_view.data_ptr() == base_ptr
        assert first_view.untyped_storage().nbytes() == 1024
        first_view.fill_(7)

        buffer.resize_per_segment_(2048)
        second_view = buffer.segment_view(0)
        assert second_view.data_ptr() == base_ptr
        assert second_view.untyped_storage().nbytes() == 2048
        assert torch.equal(second_view[:1024], torch.full_like(second_view[:1024], 7))

        full_view = buffer.full_view()
        assert full_view.data_ptr() == base_ptr
        assert full_view.numel() == 4096
    finally:
        buffer.free()


def test_extensible_tensor_rejects_shrink_and_overflow(device):
    buffer = ExtensibleTensor(1024, device=device)
    try:
        buffer.resize_per_segment_(512)
        with pytest.raises(ValueError, match="grow-only"):
            buffer.resize_per_segment_(256)
        with pytest.raises(ValueError, match="exceeds the segment capacity"):
            buffer.resize_per_segment_(1025)
    finally:
        buffer.free()


def test_segments_grow_in_lockstep_and_zero_new(device):
    et = ExtensibleTensor(max_num_bytes=8192, device=device, num_segments=2)
    try:
        assert et.num_segments == 2
        assert et.segment_capacity_bytes == 4096

        et.resize_per_segment_(256, zero_new=True)
        assert et.bytes_per_segment == 256
        assert et.num_bytes == 512
        fv = et.full_view()
        assert fv.shape == (8192,)
        assert torch.count_nonzero(fv[:256]) == 0
        assert torch.count_nonzero(fv[4096 : 4096 + 256]) == 0

        pattern_a = torch.arange(256, device=device, dtype=torch.uint8)
        pattern_b = 255 - pattern_a
        fv[:256].copy_(pattern_a)
        fv[4096 : 4096 + 256].copy_(pattern_b)

        et.resize_per_segment_(1024, zero_new=True)
        fv2 = et.full_view()
        assert fv2.data_ptr() == fv.data_ptr()
        assert torch.equal(fv2[:256], pattern_a)
        assert torch.equal(fv2[4096 : 4096 + 256], pattern_b)
        assert torch.count_nonzero(fv2[256:1024]) == 0
        assert torch.count_nonzero(fv2[4096 + 256 : 4096 + 1024]) == 0

        seg1 = et.segment_view(1)
        assert seg1.data_ptr() == fv.data_ptr() + 4096
        assert seg1.untyped_storage().nbytes() == 1024
        assert torch.equal(seg1[:256], pattern_b)
    finally:
        et.free()


def test_segments_at_granularity_scale(device):
    """A granule straddling the segment boundary is mapped once, by whichever segment's
    commit reaches it first."""
    probe = ExtensibleTensor(max_num_bytes=1, device=device)
    granularity = probe.granularity
    assert probe.capacity_bytes == granularity
    probe.free()
    max_num_bytes = 3 * granularity
    et = ExtensibleTensor(max_num_bytes=max_num_bytes, device=device, num_segments=2)
    try:
        seg = et.segment_capacity_bytes
        assert seg == max_num_bytes // 2

        step = granularity // 2
        et.resize_per_segment_(step, zero_new=True)
        fv = et.full_view()
        fv[:step].fill_(1)
        fv[seg : seg + step].fill_(2)

        et.resize_per_segment_(seg, zero_new=True)
        assert et.physical_bytes == max_num_bytes
        fv2 = et.full_view()
        assert torch.all(fv2[:step] == 1)
        assert torch.all(fv2[seg : seg + step] == 2)
        assert torch.count_nonzero(fv2[step:seg]) == 0
        assert torch.count_nonzero(fv2[seg + step :]) == 0
    finally:
        et.free()


def test_unequal_segments_grow_independently(device):
    et = ExtensibleTensor(max_num_bytes=12288, device=device, segment_capacities=[4096, 8192])
    try:
        assert et.num_segments == 2
        assert et.segment_offsets == [0, 4096]
        with pytest.raises(ValueError, match="differ"):
            _ = et.segment_capacity_bytes
        et.resize_segments_([1024, 2048], zero_new=True)
        assert et.num_bytes == 3072
        assert et.segment_view(0).untyped_storage().nbytes() == 1024
        assert et.segment_view(1).untyped_storage().nbytes() == 2048
        assert et.segment_view(1).data_ptr() == et.base_ptr + 4096
        with pytest.raises(ValueError, match="grow-only"):
            et.resize_segments_([512, 2048])
        with pytest.raises(ValueError, match="exceeds"):
            et.resize_segments_([4097, 2048])
        with pytest.raises(ValueError, match="Expected 2 sizes"):
            et.resize_segments_([4096])
    finally:
        et.free()

    with pytest.raises(ValueError, match="sum to"):
        ExtensibleTensor(max_num_bytes=100, device=device, segment_capacities=[50])


def test_invalid_usage_raises(device):
    with pytest.raises(ValueError):
        ExtensibleTensor(max_num_bytes=100, device=device, num_segments=3)

    et = ExtensibleTensor(max_num_bytes=8192, device=device, num_segments=2)
    try:
        with pytest.raises(IndexError):
            et.segment_view(2)
        et.resize_per_segment_(256)
        with pytest.raises(ValueError):
            et.resize_per_segment_(128)
        with pytest.raises(ValueError):
            et.resize_per_segment_(et.segment_capacity_bytes + 1)
    finally:
        et.free()


def test_release_physical_keeps_addresses(device):
    et = ExtensibleTensor(max_num_bytes=8192, device=device, num_segments=2)
    try:
        et.resize_per_segment_(1024, zero_new=True)
        fv = et.full_view()
        fv[:1024].fill_(9)
        base = et.base_ptr
        del fv  # release_physical invalidates live arrays: none is touched after it

        et.release_physical()
        assert et.num_bytes == 0
        assert et.physical_bytes == 0
        assert et.base_ptr == base

        et.resize_per_segment_(1024, zero_new=True)
        assert et.full_view().data_ptr() == base
        assert torch.count_nonzero(et.full_view()[:1024]) == 0
    finally:
        et.free()


def test_failed_commit_leaves_no_inaccessible_granules(device):
    """vLLM fails the second physical allocation of a commit that maps two runs, through the
    private ``_buffer._driver``, and reads ``_mapped_granules``. Here a fault-injecting driver
    fails the same allocation, and the behaviour is checked publicly: the commit raises and
    changes nothing (jaxbuf rolls the first run back; vLLM keeps it, granted), what was
    committed before stays readable and writable, and a retry maps the whole range."""
    driver = FaultInjectingDriver(get_vmm_driver(device))
    g = granule_size(device, driver=driver)
    # Three segments, one granule, one granule, two granules: committing segment 1 maps the
    # middle run [g, 2g); growing segments 0 and 2 then needs runs [0, g) and [2g, 3g).
    et = ExtensibleTensor(4 * g, device=device, segment_capacities=[g, g, 2 * g], driver=driver)
    try:
        et.resize_segments_([0, g, 0])
        et.segment_view(1).fill_(5)
        driver.fail_on("create", nth=2)
        with pytest.raises(jaxbuf.drivers.DriverError):
            et.resize_segments_([g, g, g])
        assert et.committed_sizes == [0, g, 0]
        assert et.physical_bytes == g and et.num_physical_chunks == 1
        et.segment_view(1).fill_(6)  # the mapped run stays accessible
        _synchronize(device)
        et.resize_segments_([g, g, g])
        et.full_view()[: 3 * g].fill_(2)
        _synchronize(device)
        assert torch.all(et.full_view()[: 3 * g] == 2)
        driver.check_invariants()
    finally:
        et.free()


def test_views_survive_interpreter_teardown(device):
    """Views held by modules torn down after jaxbuf's must not call freed memory at exit."""
    script = f"""
import sys, torch
from jaxbuf.torch import ExtensibleTensor
et = ExtensibleTensor(4096, device={device!r})
et.resize_per_segment_(1024)
torch._extkv_test_view = et.full_view()
sys._extkv_test_view = et.segment_view(0)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.gpu
def test_vmm_probe_reports_usable_driver():
    assert _vmm_unavailable_reason("cuda") is None


# -- tests/v1/worker/test_buffer_utils.py --------------------------------------------------------
# vLLM builds a bare StagedWriteTensor with __new__ and reads its private staging lists
# (_materialize_staged_write_contents, _staged_write_cu_lens, _staged_write_numel). Here a real
# tensor is staged the same way, and what the staging holds is checked publicly: the count
# of staged writes, and the bytes an apply lands, in order and in the target dtype.
@needs_triton
def test_staged_write_contents_preserve_order_and_dtype(device):
    tensor = StagedWriteTensor((3, 8), torch.int32, device)
    try:
        tensor.stage_write(0, 0, np.asarray([1, 2], dtype=np.int64))
        tensor.stage_write(1, 3, (value for value in [3, 4]))
        tensor.stage_write_elem(2, 5)
        assert tensor.num_staged_writes == 3

        tensor.apply_write()
        _synchronize(device)
        contents = tensor.gpu
        assert contents.dtype == torch.int32
        assert contents[0, :2].tolist() == [1, 2]
        assert contents[1, 3:5].tolist() == [3, 4]
        assert contents[2, 0].item() == 5
        assert torch.count_nonzero(contents).item() == 5
    finally:
        tensor.free()


@needs_triton
def test_clear_staged_writes_resets_chunk_bookkeeping(device):
    tensor = StagedWriteTensor((2, 4), torch.float32, device)
    try:
        tensor.stage_write(0, 0, [1.5, 2.5])

        tensor.clear_staged_writes()

        assert tensor.num_staged_writes == 0
        tensor.apply_write()  # nothing staged: nothing lands
        _synchronize(device)
        assert torch.count_nonzero(tensor.gpu).item() == 0
    finally:
        tensor.free()


# -- tests/v1/worker/test_cpu_staged_write.py --------------------------------------------------
# vLLM's CPU module; the same calls on jaxbuf.torch, on every device. The private staging
# lists it reads (_staged_write_indices, ...) are the public num_staged_writes here.
@needs_triton
def test_cpu_staged_write_tensor_applies_ragged_writes(device):
    tensor = StagedWriteTensor((4, 8), dtype=torch.int32, device=torch.device(device))

    tensor.stage_write(2, 3, [3, 1, 2])
    tensor.stage_write(0, 1, [-1, -2, -5])
    tensor.stage_write_elem(1, 7)
    tensor.apply_write()

    assert tensor.gpu.tolist() == [
        [0, -1, -2, -5, 0, 0, 0, 0],
        [7, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 3, 1, 2, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert tensor.num_staged_writes == 0
    tensor.free()


@needs_triton
def test_cpu_staged_write_tensor_applies_float_writes(device):
    tensor = StagedWriteTensor((2, 4), dtype=torch.float32, device=torch.device(device))

    tensor.stage_write(1, 1, [0.5, -1.25])
    tensor.apply_write()

    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.5, -1.25, 0.0]], dtype=torch.float32)
    torch.testing.assert_close(tensor.gpu.cpu(), expected)
    tensor.free()


@needs_triton
def test_cpu_fused_staged_writer_applies_each_tensor(device):
    """vLLM's CPU writer ignores ``output_ptrs`` / ``output_strides`` (it passes
    ``torch.empty`` ones); jaxbuf honours them on every device, as the GPU seed does, so they
    hold the targets' real pointers and row strides, built as vLLM's GPU model runner does."""
    first = StagedWriteTensor((2, 4), dtype=torch.int32, device=torch.device(device))
    second = StagedWriteTensor((2, 4), dtype=torch.int32, device=torch.device(device))
    first.stage_write(0, 0, [10, 11])
    second.stage_write(1, 2, [20, 21])

    writer = FusedStagedWriter(torch.device(device), max_writes=4)
    targets = [first.gpu, second.gpu]
    writer.apply(
        [first, second],
        output_ptrs=torch.tensor([t.data_ptr() for t in targets], dtype=torch.uint64),
        output_strides=torch.tensor([t.stride(0) for t in targets], dtype=torch.int64),
    )

    assert first.gpu.tolist() == [[10, 11, 0, 0], [0, 0, 0, 0]]
    assert second.gpu.tolist() == [[0, 0, 0, 0], [0, 0, 20, 21]]
    assert first.num_staged_writes == 0
    assert second.num_staged_writes == 0
    writer.close()
    del targets
    first.free()
    second.free()


# -- tests/kernels/core/test_uva.py --------------------------------------------------------------
# vLLM's get_accelerator_view_from_cpu_tensor(pinned) is a UvaBuffer here: ``cpu`` is the
# pinned host tensor, ``uva()`` the device view of the same memory.
def test_cpu_write(current_platform):
    device = current_platform
    buffer = UvaBuffer((10, 10), torch.int32)
    cpu_tensor = buffer.cpu
    gpu_view = buffer.uva()
    assert gpu_view.device.type == torch.device(device).type

    assert gpu_view[0, 0] == 0
    assert gpu_view[2, 3] == 0
    assert gpu_view[4, 5] == 0

    cpu_tensor[0, 0] = 1
    cpu_tensor[2, 3] = 2
    cpu_tensor[4, 5] = -1

    gpu_view.mul_(2)
    _synchronize(device)
    assert gpu_view[0, 0] == 2
    assert gpu_view[2, 3] == 4
    assert gpu_view[4, 5] == -2
    buffer.free()


def test_gpu_write(current_platform):
    device = current_platform
    buffer = UvaBuffer((10, 10), torch.int32)
    cpu_tensor = buffer.cpu
    gpu_view = buffer.uva()
    assert gpu_view.device.type == torch.device(device).type

    assert gpu_view[0, 0] == 0
    assert gpu_view[2, 3] == 0
    assert gpu_view[4, 5] == 0

    gpu_view[0, 0] = 1
    gpu_view[2, 3] = 2
    gpu_view[4, 5] = -1
    gpu_view.mul_(2)
    _synchronize(device)

    assert cpu_tensor[0, 0] == 2
    assert cpu_tensor[2, 3] == 4
    assert cpu_tensor[4, 5] == -2
    buffer.free()


@needs_triton
def test_staged_write_uses_uva_contents_for_uva_target(device):
    """vLLM also patches its private ``async_tensor_h2d`` to prove the contents are not
    copied to the device; that is an implementation detail with no jaxbuf analogue. The
    three applies to a pinned target, and what they land, are the same."""
    staged = StagedWriteTensor(
        (3, 4096),
        dtype=torch.int32,
        device=torch.device(device),
        max_concurrency=2,
        uva_instead_of_gpu=True,
    )

    staged.stage_write(2, 3, [11, 12, 13])
    staged.apply_write()
    _synchronize(device)
    staged.stage_write(1, 7, [21, 22])
    staged.apply_write()
    _synchronize(device)
    staged.stage_write(0, 1020, range(1500))
    staged.apply_write()
    _synchronize(device)

    assert staged.gpu[2, 3:6].tolist() == [11, 12, 13]
    assert staged.gpu[1, 7:9].tolist() == [21, 22]
    assert staged.gpu[0, 1020:2520].tolist() == list(range(1500))
    staged.free()


@pytest.mark.parametrize("input_type", ["list", "numpy", "tensor"])
@pytest.mark.parametrize("size", [(4,), (4, 3)])
def test_uva_pool_overwrites_exposed_prefix(current_platform, input_type, size):
    """vLLM reads the private ``_uva_bufs`` and ``_curr``; here the public ``slots`` and
    ``current_slot`` (the same buffers and index). A slot replaced by growth is freed here
    (its memory goes with the last tensor over it), so its row count is read before the
    call rather than from the replaced buffer after it."""
    pool = UvaBufferPool(size, torch.int32, max_concurrency=2)
    for buf in pool.slots:
        assert tuple(buf.cpu.shape) == size
        # Page-locked where a GPU is: the CPU driver's "pinned" memory is ordinary memory.
        assert buf.cpu.is_pinned() == jaxbuf.as_device(current_platform).is_cuda
        assert torch.count_nonzero(buf.cpu).item() == 0
    lengths = [0, 0, 3, 3, 4, 4, 5, 3, 3, 5, 1024, 1024, 1025, 1025, 2, 2]
    for step, length in enumerate(lengths):
        if input_type == "list" and len(size) > 1 and length == 0:
            with pytest.raises(ValueError, match="could not broadcast"):
                pool.copy_to_uva([])
            continue
        shape = (length, *size[1:])
        expected = (
            torch.arange(int(np.prod(shape)), dtype=torch.int32, device="cpu").reshape(shape) - step
        )
        values = expected.tolist()
        if input_type == "numpy":
            values = expected.numpy()
        elif input_type == "tensor":
            values = expected
        before = list(pool.slots)
        rows_before = [buf.cpu.shape[0] for buf in before]
        slot = (pool.current_slot + 1) % pool.max_concurrency
        result = pool.copy_to_uva(values)
        assert isinstance(result, torch.Tensor)
        assert tuple(result.shape) == shape
        assert pool.current_slot == slot
        assert pool.slots[1 - slot] is before[1 - slot]
        if length <= rows_before[slot]:
            assert pool.slots[slot] is before[slot]
        else:
            assert tuple(pool.slots[slot].cpu.shape) == (1 << (length - 1).bit_length(), *size[1:])
        assert pool.size == size
        torch.testing.assert_close(result.cpu(), expected, rtol=0, atol=0)
    pool.close()


@pytest.mark.parametrize("use_out", [False, True])
@pytest.mark.parametrize("input_type", ["numpy", "tensor"])
def test_uva_pool_copy_to_gpu_preserves_shape_and_out(current_platform, use_out, input_type):
    device_type = torch.device(current_platform).type
    pool = UvaBufferPool((2, 3), torch.int32, max_concurrency=2)
    for length in (2, 5, 3, 6):
        expected = torch.arange(length * 3, dtype=torch.int32, device="cpu").reshape(length, 3)
        values = expected.numpy() if input_type == "numpy" else expected
        out = (
            torch.empty(expected.shape, dtype=torch.int32, device=device_type) if use_out else None
        )
        result = pool.copy_to_gpu(values, out=out)
        assert isinstance(result, torch.Tensor) and result.device.type == device_type
        if use_out:
            assert result is out
        torch.testing.assert_close(result.cpu(), expected, rtol=0, atol=0)
    pool.close()


@needs_triton
@pytest.mark.parametrize("uva_target", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_staged_write_inflight(device, uva_target, dtype):
    """Every generation is preserved until its consumer is done. vLLM's check of its
    private ``write_contents`` pool has no analogue. On CUDA the applies and the consumers'
    clones run on a side stream, as in vLLM; the CPU has no streams."""
    on_cuda = device.startswith("cuda")
    state = StagedWriteTensor(
        (4, 4096), dtype, torch.device(device), max_concurrency=2, uva_instead_of_gpu=uva_target
    )
    stream = torch.cuda.Stream() if on_cuda else None
    if on_cuda:
        stream.wait_stream(torch.cuda.current_stream())
    pending: list[tuple[object, torch.Tensor, torch.Tensor]] = []
    expected = torch.zeros((4, 4096), dtype=dtype, device="cpu")
    for step in range(24):
        if len(pending) == 2:
            event, snapshot, reference = pending.pop(0)
            if event is not None:
                event.synchronize()
            torch.testing.assert_close(snapshot.cpu(), reference, rtol=0, atol=0)
        # Growing and shrinking lengths exercise reallocation and reuse.
        length = [3, 17, 1500, 4090][step % 4]
        row = step % 3
        values = torch.arange(length, dtype=dtype, device="cpu") + step * 8192
        if dtype == torch.float32:
            values += 0.25
        expected[row, 2 : 2 + length] = values
        expected[3, 1:4] = step
        event = None
        if on_cuda:
            with torch.cuda.stream(stream):
                state.stage_write(row, 2, values.tolist())
                state.stage_write(3, 1, [step] * 3)
                state.apply_write()
                snapshot = state.gpu.clone()  # a GPU consumer of this generation
                event = torch.cuda.Event()
                event.record(stream)
        else:
            state.stage_write(row, 2, values.tolist())
            state.stage_write(3, 1, [step] * 3)
            state.apply_write()
            snapshot = state.gpu.clone()
        pending.append((event, snapshot, expected.clone()))
    for event, snapshot, reference in pending:
        if event is not None:
            event.synchronize()
        torch.testing.assert_close(snapshot.cpu(), reference, rtol=0, atol=0)
    state.free()


def test_non_pinned_cpu_tensor(current_platform):
    """vLLM's helper copies a non-pinned tensor into private pinned memory; the seed's
    ``UvaBufferPool.copy_to_uva`` does that here: the device view holds the values of the
    moment, decoupled from later writes to the original, and stays writable."""
    cpu_tensor = torch.arange(100, dtype=torch.int32, device="cpu").view(10, 10)
    assert not cpu_tensor.is_pinned()
    pool = UvaBufferPool((10, 10), torch.int32, max_concurrency=1)
    gpu_view = pool.copy_to_uva(cpu_tensor)
    assert gpu_view.device.type == torch.device(current_platform).type

    assert gpu_view[0, 0] == 0
    assert gpu_view[2, 3] == 23
    assert gpu_view[9, 9] == 99

    cpu_tensor[0, 0] = -1
    assert gpu_view[0, 0] == 0

    gpu_view.mul_(2)
    assert gpu_view[2, 3] == 46
    assert gpu_view[9, 9] == 198
    pool.close()


@pytest.mark.parametrize("pinned", [False, True])
def test_non_contiguous_strided_view(current_platform, pinned):
    """vLLM's XPU-only test of a transposed input. A pool slot is row-major, so the device
    tensor of a non-contiguous input is a contiguous copy of its values (vLLM's XPU path keeps
    the strides); the values are what is checked, as vLLM's last assertion does."""
    if pinned and not jaxbuf.as_device(current_platform).is_cuda:
        pytest.skip("pin_memory needs a CUDA build of torch with a GPU")
    scale_kn = torch.arange(512, dtype=torch.float32, device="cpu", pin_memory=pinned).view(32, 16)
    cpu_view = scale_kn.t()
    assert cpu_view.shape == (16, 32)
    assert cpu_view.stride() == (1, 16)
    assert not cpu_view.is_contiguous()

    pool = UvaBufferPool((16, 32), torch.float32, max_concurrency=1)
    gpu_view = pool.copy_to_uva(cpu_view)
    assert gpu_view.device.type == torch.device(current_platform).type
    assert gpu_view.shape == (16, 32)
    assert torch.equal(gpu_view.cpu(), cpu_view)
    pool.close()


# -- what the face adds: cost and lifetime -----------------------------------------------------
def test_a_view_is_reused_until_its_bytes_change(device):
    """The face keeps the neutral view behind each tensor while its bytes stay the same (one
    import per call, no view built and packed again); a grow or a release gives a tensor
    sized to the new prefix; a freed tensor makes none."""
    buf = ExtensibleTensor(8 << 20, device, num_segments=2)
    buf.resize_per_segment_(1024)
    neutral = jaxbuf.ExtensibleTensor.segment_view

    def packed(view):  # what is kept: the payloads, packed once (the handle's views copy them)
        return view._versioned_payload

    first = neutral(buf, 0)
    assert first.owner is buf and packed(first) is not None
    assert packed(neutral(buf, 0)) is packed(first) and packed(neutral(buf, 1)) is not packed(first)
    for size in range(2048, 64 * 1024, 1024):  # many sizes: what is kept stays bounded
        buf.resize_per_segment_(size)
        assert packed(neutral(buf, 0)) is packed(neutral(buf, 0))
        assert buf.segment_view(0).numel() == size
    assert first.nbytes == 1024 and buf.segment_view(0).data_ptr() == first.ptr
    buf.release_physical()
    assert buf.segment_view(0).numel() == 0
    buf.free()
    with pytest.raises(RuntimeError, match="freed"):
        buf.segment_view(0)
    with pytest.raises(RuntimeError, match="freed"):
        buf.full_view()


def test_a_face_handle_dropped_without_free_releases_its_memory(device):
    """A dropped handle is freed (its kept views refer to no handle), and its memory goes
    with the last tensor over it."""
    import gc
    import weakref

    driver = FaultInjectingDriver(get_vmm_driver(device))
    buf = ExtensibleTensor(4 << 20, device, driver=driver)
    buf.resize_per_segment_(4096, zero_new=True)
    tensor = buf.segment_view(0)
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is None
    tensor.fill_(3)  # the tensor keeps the memory
    _synchronize(device)
    del tensor
    gc.collect()
    driver.assert_clean()


# -- the rest of the seeds' names through the face -------------------------------------------------
def test_uint8_tensor_from_ptr_is_a_tensor_over_the_memory(device):
    et = ExtensibleTensor(4096, device=device)
    et.resize_per_segment_(64, zero_new=True)
    index = jaxbuf.as_device(device).index if device.startswith("cuda") else device
    wrapped = uint8_tensor_from_ptr(et.base_ptr, 64, index)
    assert isinstance(wrapped, torch.Tensor) and wrapped.dtype == torch.uint8
    assert wrapped.data_ptr() == et.base_ptr and wrapped.shape == (64,)
    wrapped.fill_(3)
    assert torch.all(et.segment_view(0) == 3)
    del wrapped
    et.free()


def test_non_uva_buffer_and_backed_tensor_hand_out_tensors(current_platform):
    non_uva = NonUvaBuffer(4, torch.int32)
    non_uva.np[:] = [1, 2, 3, 4]
    assert non_uva.uva(2).tolist() == [1, 2]
    assert isinstance(non_uva.cpu, torch.Tensor)
    non_uva.free()
    backed = UvaBackedTensor(4, torch.int32, max_concurrency=2)
    assert isinstance(backed.gpu, torch.Tensor) and backed.gpu.tolist() == [0, 0, 0, 0]
    backed.cpu[:] = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    assert backed.copy_to_uva(3).tolist() == [5, 6, 7] and backed.gpu.tolist() == [5, 6, 7]
    backed.close()
    assert isinstance(is_uva_available(), bool)


def test_kv_cache_names_hand_out_tensors(device):
    builder = ExtensibleKVCacheBuilder(num_blocks_capacity=8, device=torch.device(device))
    flat = builder.reserve(8 * 2048, num_segments=2)
    assert isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8
    kv = builder.finish()
    kv.commit(4)
    k, v = kv.committed_views(0, torch.float32)
    assert isinstance(k, torch.Tensor) and k.shape == (4, 256) and k.dtype == torch.float32
    assert k.data_ptr() == flat.data_ptr() and kv.full_view(0).data_ptr() == flat.data_ptr()
    k.fill_(1.5)
    assert torch.all(kv.segment_views(0, 4, torch.float32)[0] == 1.5)
    assert len(kv.layer_views(torch.float32, num_blocks=4)) == 2
    del flat, k, v
    kv.free()

    table = DeviceParamTable(4, {"temperature": torch.float32, "top_k": torch.int32}, device)
    table["temperature"].np[:] = 0.7
    table.sync()
    gpu = table["temperature"].gpu
    assert isinstance(gpu, torch.Tensor) and gpu is table.fields["temperature"].gpu
    _synchronize(device)
    torch.testing.assert_close(gpu.cpu(), torch.full((4,), 0.7))
    del gpu
    table.close()


def test_a_buffer_view_used_as_a_tensor_names_the_faces():
    """The neutral API's BufferView is not a tensor: the errors say where the tensors are."""
    et = jaxbuf.ExtensibleTensor(4096, device="cpu")
    et.resize_per_segment_(64)
    view = et.segment_view(0)
    for use, error in [
        (lambda: view.view(np.int32)[:4], TypeError),
        (lambda: view.__setitem__(slice(0, 4), 7), TypeError),
        (lambda: view.data_ptr(), AttributeError),
        (lambda: view.tolist(), AttributeError),
        (lambda: view.numel(), AttributeError),
        (lambda: list(view), TypeError),
    ]:
        with pytest.raises(error, match=r"\.to_torch\(\).*jaxbuf\.torch.*jaxbuf\.jax"):
            use()
    assert not hasattr(view, "data_ptr") and not hasattr(view, "__cuda_array_interface__")
    et.free()
