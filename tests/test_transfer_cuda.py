"""RDMA-capable CUDA chunks (the handle-type chain fabric -> POSIX descriptor -> none, and
``gpuDirectRDMACapable``) on a stand-in binding, and NIXL transfers over VRAM on a GPU (one
process and two, marked ``gpu``)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxbuf.drivers import cuda as cuda_driver
from jaxbuf.drivers.base import DriverError
from jaxbuf.drivers.cuda import CudaVmmDriver

MiB = 1 << 20


def _stand_in(monkeypatch, attributes: dict[str, int], refuse):
    """A binding whose cuDeviceGetAttribute answers from ``attributes`` (by name, 1 when
    absent) and whose cuMemCreate returns ``refuse(prop)`` (a CUresult) or a handle."""
    cu = pytest.importorskip("cuda.bindings.driver")
    fake = types.SimpleNamespace(**{name: getattr(cu, name) for name in dir(cu)})
    fake.cuGetErrorName = lambda error: (cu.CUresult.CUDA_SUCCESS, error.name.encode())
    names = {
        value: name for name, value in vars(cu.CUdevice_attribute).items() if "ATTRIBUTE" in name
    }
    fake.cuDeviceGetAttribute = lambda attribute, device: (
        cu.CUresult.CUDA_SUCCESS,
        attributes.get(names.get(attribute, ""), 1),
    )
    created = []

    def cu_mem_create(size, prop, flags):
        # requestedHandleTypes may hold a mask (fabric | POSIX) that reads back as no enum.
        created.append((_handle_types(prop), prop.allocFlags.gpuDirectRDMACapable))
        error = refuse(created[-1])
        if error is not None:
            return (error, None)
        return (cu.CUresult.CUDA_SUCCESS, cu.CUmemGenericAllocationHandle(7))

    fake.cuMemCreate = cu_mem_create
    fake.cuMemRelease = lambda handle: (cu.CUresult.CUDA_SUCCESS,)
    fake.cuCtxGetCurrent = lambda: (cu.CUresult.CUDA_SUCCESS, cu.CUcontext(0x1234))
    fake.cuMemGetAllocationGranularity = lambda prop, flag: (cu.CUresult.CUDA_SUCCESS, 2 * MiB)
    monkeypatch.setattr(cuda_driver, "_cu", fake)
    return cu, created


def _handle_types(prop) -> int:
    """The requested handle-type mask, read from the struct's memory: a combined mask has
    no enum member to read back as. CUmemAllocationProp starts with two 4-byte enums,
    ``type`` then ``requestedHandleTypes``."""
    import ctypes

    return ctypes.c_int.from_address(prop.getPtr() + 4).value


def _driver(**options) -> CudaVmmDriver:
    driver = CudaVmmDriver(**options)
    driver._unavailable_reason = None
    driver._device_count = 1
    driver._primary_contexts[0] = (None, 0x1234)
    driver.ensure_context = lambda index: None
    return driver


def test_fabric_refused_steps_down_to_posix_for_good(monkeypatch):
    cu, created = _stand_in(
        monkeypatch, {}, lambda call: cu.CUresult.CUDA_ERROR_NOT_PERMITTED if call[0] & 8 else None
    )
    driver = _driver(shareable="fabric", rdma="auto")
    driver.create(2 * MiB, 0)
    driver.create(2 * MiB, 0)
    assert [mask for mask, _ in created] == [8 | 1, 1, 1]  # fabric | POSIX, then POSIX
    assert all(rdma == 1 for _, rdma in created)
    options = driver.allocation_options(0)
    assert options["handle_type"] == "posix" and options["rdma"] is True
    assert (
        "fabric handles: cuMemCreate refused them (CUDA_ERROR_NOT_PERMITTED)" in options["notes"][0]
    )


def test_what_the_device_does_not_report_is_skipped_and_named(monkeypatch):
    cu, created = _stand_in(
        monkeypatch,
        {
            "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED": 0,
            "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED": 0,
        },
        lambda call: None,
    )
    driver = _driver(shareable="fabric", rdma="auto")
    driver.create(2 * MiB, 0)
    assert created == [(1, 0)]
    options = driver.allocation_options(0)
    assert options == {
        "handle_type": "posix",
        "rdma": False,
        "notes": [
            "fabric handles: the device reports no fabric handle support",
            "GPUDirect RDMA: the device reports no RDMA support for VMM allocations",
        ],
    }
    with pytest.raises(DriverError, match="rdma=True needs it"):
        _driver(rdma=True).create(2 * MiB, 0)


def test_rdma_refused_is_dropped_after_the_handle_types(monkeypatch):
    cu, created = _stand_in(
        monkeypatch, {}, lambda call: cu.CUresult.CUDA_ERROR_NOT_SUPPORTED if call[1] else None
    )
    driver = _driver(rdma="auto")  # POSIX (the default), RDMA where reported
    driver.create(2 * MiB, 0)
    assert created == [(1, 1), (0, 1), (0, 0)]  # POSIX, none, then no RDMA flag
    assert driver.allocation_options(0)["rdma"] is False
    no_rdma = _driver()  # the default: no RDMA flag (opt-in)
    no_rdma.create(2 * MiB, 0)
    assert created[-1] == (1, 0)


def test_out_of_memory_never_steps_down(monkeypatch):
    cu, created = _stand_in(monkeypatch, {}, lambda call: cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    monkeypatch.setattr(cuda_driver, "release_cached_memory", lambda error: False)
    driver = _driver(shareable="fabric", rdma="auto")
    with pytest.raises(DriverError, match="OUT_OF_MEMORY"):
        driver.create(2 * MiB, 0)
    assert created == [(9, 1)]
    assert driver.allocation_options(0)["handle_type"] == "fabric"


@pytest.mark.parametrize("options", [{"shareable": "auto"}, {"shareable": 1}, {"rdma": "yes"}])
def test_bad_allocation_options_are_refused(options):
    with pytest.raises(ValueError, match="must be"):
        CudaVmmDriver(**options)


# -- on the GPU --------------------------------------------------------------------------
_REASON = CudaVmmDriver().unavailable_reason()
needs_cuda = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _nixl_or_skip():
    transfer = pytest.importorskip("jaxbuf.transfer")
    try:
        transfer.load_nixl()
    except transfer.NixlUnavailable as error:
        pytest.skip(f"NIXL is not installed: {error}")
    return transfer


@pytest.mark.gpu
@needs_cuda
def test_vram_blocks_move_in_one_process_across_growth_and_defragment():
    torch = pytest.importorskip("torch")
    import jaxbuf

    transfer = _nixl_or_skip()
    block = 768 * 1024
    a = jaxbuf.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=2)
    b = jaxbuf.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=2)
    ea = transfer.KVEndpoint(
        transfer.Agent("vram-a"), a, transfer.KVLayout(block), transport="nixl"
    )
    eb = transfer.KVEndpoint(
        transfer.Agent("vram-b"), b, transfer.KVLayout(block), transport="nixl"
    )
    try:
        assert ea.registration.mem_type == "VRAM"
        for size in (2 * MiB, 6 * MiB):
            a.resize_per_segment_(size)
            b.resize_per_segment_(size)
            peer = ea.connect(eb.metadata())
            source = a.segment_view(0).to_torch()
            source.copy_(torch.randint(0, 255, source.shape, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            blocks = list(range(size // block))
            ea.write(peer, blocks, blocks[::-1], segments=[0]).wait(30)
            target = b.segment_view(0).to_torch()
            for lb, rb in zip(blocks, blocks[::-1]):
                assert torch.equal(
                    target[rb * block : (rb + 1) * block], source[lb * block : (lb + 1) * block]
                )
        assert a.defragment() == [0, 1] and ea.registration.num_registrations == 2
        ea.write(peer, [0, 1], [1, 0]).wait(30)
        view = eb.block_view(0, 0, 2).view("float16", (2, block // 2))
        assert view.to_torch().data_ptr() == b.segment_view(0).ptr
    finally:
        ea.close()
        eb.close()
        a.free()
        b.free()
    assert ea.agent.live_registrations == eb.agent.live_registrations == 0


@pytest.mark.gpu
@needs_cuda
def test_vram_blocks_move_between_two_processes():
    pytest.importorskip("torch")
    from transfer_peer import PeerProcess

    import jaxbuf

    transfer = _nixl_or_skip()
    block = 1 * MiB
    peer = PeerProcess("vram-peer", 64 * MiB, 2, block, device="cuda:0")
    tensor = jaxbuf.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=2)
    endpoint = transfer.KVEndpoint(
        transfer.Agent("vram-local"), tensor, transfer.KVLayout(block), transport="nixl"
    )
    try:
        tensor.resize_per_segment_(4 * MiB)
        peer("grow", 2 * MiB)
        remote = endpoint.connect(peer("metadata"))
        peer("connect", endpoint.metadata())
        peer("fill", 1, 3)
        endpoint.read(remote, [3, 2], [0, 1], segments=[1]).wait(30)
        got = tensor.segment_view(1).to_torch()[2 * block : 4 * block].cpu().numpy()
        expected = np.frombuffer(peer("read", 1, 0, 2 * block), np.uint8)
        np.testing.assert_array_equal(got[block:], expected[:block])
        np.testing.assert_array_equal(got[:block], expected[block:])
        peer("grow", 8 * MiB)  # grows between transfers: new metadata, new registrations
        remote = endpoint.connect(peer("metadata"))
        endpoint.write(remote, [0, 1, 2, 3], [7, 6, 5, 4]).wait(30)
        mine = tensor.segment_view(0).to_torch()[:block].cpu().numpy().tobytes()
        assert peer("read", 0, 7 * block, block) == mine
    finally:
        endpoint.close()
        tensor.free()
        assert peer.stop() == (0, 0)
