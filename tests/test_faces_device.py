"""The faces' ``device``: the framework's type where the seed has one, and the layers below
still work when handed a face's objects.

vLLM reads ``ExtensibleTensor.device`` and ``FusedStagedWriter.device`` as ``torch.device``
(``torch.device("cuda", i)``) and passes them on to torch. Through ``jaxbuf.torch`` they are
that; through ``jaxbuf.jax`` they are the ``jax.Device``; the neutral classes keep jaxbuf's
:class:`~jaxbuf.Device`. Sharing, transfers, sharding and the KV cache read
``as_device(x.device)`` and the neutral class's views (a face's ``segment_view`` is an
array), so a face's tensor goes through them as the neutral one does: each scenario checks
the bytes against a numpy model.
"""

from __future__ import annotations

import importlib
import socket
import threading

import numpy as np
import pytest
from conftest import JAX_REASON, TRITON_REASON

import jaxbuf
from jaxbuf import sharing
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.transfer import KVCacheEndpoint, KVEndpoint, KVLayout

BLOCK = 4096
BLOCKS = 16


def _face(framework: str):
    return importlib.import_module(f"jaxbuf.{framework}")


def _seed_device(framework: str, device: str):
    """What vLLM's code and tests expect ``device`` to be, built here from the framework."""
    neutral = jaxbuf.as_device(device)
    if framework == "torch":
        import torch

        return torch.device("cuda", neutral.index) if neutral.is_cuda else torch.device("cpu")
    import jax

    return jax.local_devices(backend="gpu" if neutral.is_cuda else "cpu")[neutral.index]


def _host(framework: str, array) -> np.ndarray:
    """A face's array as numpy bytes on the host (a copy)."""
    return array.cpu().numpy() if framework == "torch" else np.asarray(array)


def _write(view: jaxbuf.BufferView, offset: int, data: np.ndarray) -> None:
    """Write ``data`` into a neutral view through the driver (any device)."""
    driver = get_vmm_driver(view.device)
    data = np.ascontiguousarray(data)
    driver.copy(view.ptr + offset, data.ctypes.data, data.nbytes, view.device.index)
    driver.synchronize(view.device.index)


def _tensor(framework: str, device: str):
    et = _face(framework).ExtensibleTensor(2 * BLOCK * BLOCKS, device=device, num_segments=2)
    et.resize_per_segment_(BLOCK * BLOCKS)
    return et


def test_a_face_device_is_the_frameworks_where_the_seed_has_one(framework, device):
    face, expected = _face(framework), _seed_device(framework, device)
    et = face.ExtensibleTensor(BLOCK, device=device)
    try:
        assert type(et.device) is type(expected) and et.device == expected
        assert jaxbuf.as_device(et.device) == jaxbuf.as_device(device)
        if framework == "torch":
            import torch

            assert torch.zeros(4, device=et.device).device == expected  # vLLM hands it on
            assert et.segment_view(0).device == expected
        else:
            import jax

            assert jax.device_put(np.zeros(4), et.device).devices() == {expected}
    finally:
        et.free()
    if TRITON_REASON is None:
        writer = face.FusedStagedWriter(expected, max_writes=4)
        try:
            assert type(writer.device) is type(expected) and writer.device == expected
        finally:
            writer.close()


def test_the_neutral_classes_keep_jaxbufs_device(device):
    et = jaxbuf.ExtensibleTensor(BLOCK, device=device)
    try:
        assert et.device == jaxbuf.as_device(device) and type(et.device) is jaxbuf.Device
    finally:
        et.free()
    if TRITON_REASON is None:
        writer = jaxbuf.FusedStagedWriter(device, max_writes=4)
        try:
            assert writer.device == jaxbuf.as_device(device)
            assert type(writer.device) is jaxbuf.Device
        finally:
            writer.close()


def test_a_face_tensor_is_shared_across_a_socket(framework, device):
    """send_buffer exports a face's tensor; the importer and the face see the same bytes,
    also after a grow."""
    et = _tensor(framework, device)
    a, b = socket.socketpair()
    received: dict = {}
    try:

        def receive():
            received["buffer"] = sharing.recv_buffer(b)

        thread = threading.Thread(target=receive)
        thread.start()
        layout = sharing.send_buffer(a, et)
        thread.join()
        imported = received["buffer"]
        assert imported.device == jaxbuf.as_device(device)
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
        _write(imported.segment_view(1), 0, data)
        np.testing.assert_array_equal(_host(framework, et.segment_view(1)), data)
        np.testing.assert_array_equal(_host(framework, et.segment_view(0)), 0)
        imported.close()
        del layout
    finally:
        a.close()
        b.close()
        et.free()


def test_blocks_move_between_two_face_tensors_in_one_process(framework, device):
    """KVEndpoint over face tensors, same host, one process: random reads and writes, both
    buffers checked against a numpy model after each."""
    left, right = _tensor(framework, device), _tensor(framework, device)
    rng = np.random.default_rng(1)
    model = {}
    for name, tensor in (("left", left), ("right", right)):
        model[name] = rng.integers(0, 256, (2, BLOCKS, BLOCK), dtype=np.uint8)
        for segment in range(2):
            neutral = jaxbuf.ExtensibleTensor.segment_view(tensor, segment)
            _write(neutral, 0, model[name][segment])
    layout = KVLayout(BLOCK)
    try:
        with (
            KVEndpoint("left", left, layout, transport="local") as here,
            KVEndpoint("right", right, layout, transport="local") as there,
        ):
            here.connect(there.metadata())
            there.connect(here.metadata())
            for _ in range(6):
                count = int(rng.integers(1, 4))
                local = rng.choice(BLOCKS, count, replace=False).tolist()
                remote = rng.choice(BLOCKS, count, replace=False).tolist()
                if rng.random() < 0.5:
                    here.read("right", local, remote).wait()
                    model["left"][:, local] = model["right"][:, remote]
                else:
                    here.write("right", local, remote).wait()
                    model["right"][:, remote] = model["left"][:, local]
                for name, tensor in (("left", left), ("right", right)):
                    for segment in range(2):
                        got = _host(framework, tensor.segment_view(segment))
                        np.testing.assert_array_equal(
                            got.reshape(BLOCKS, BLOCK), model[name][segment]
                        )
            assert here.block_view(0, 0).device == jaxbuf.as_device(device)
    finally:
        left.free()
        right.free()


def _cache(framework: str, device: str, fill: int):
    face = _face(framework)
    builder = face.ExtensibleKVCacheBuilder(BLOCKS, device=_seed_device(framework, device))
    builder.reserve(2 * BLOCKS * BLOCK, num_segments=2)  # BLOCK bytes a block
    kv = builder.finish()
    kv.commit(BLOCKS)
    for segment in range(2):
        view = jaxbuf.ExtensibleKVCacheBuffers.segment_views(kv, 0)[segment]
        _write(view, 0, np.full(BLOCKS * BLOCK, fill + segment, np.uint8))
    return kv


def test_a_face_kv_cache_moves_blocks_and_reports_a_jaxbuf_device(framework, device):
    here, there = _cache(framework, device, 1), _cache(framework, device, 7)
    try:
        assert here.device == jaxbuf.as_device(device)
        with (
            KVCacheEndpoint("here", here, transport="local") as a,
            KVCacheEndpoint("there", there, transport="local") as b,
        ):
            a.connect(b.metadata())
            b.connect(a.metadata())
            a.read("there", [2, 3], [5, 6]).wait()
            for segment, view in enumerate(here.segment_views(0, BLOCKS)):
                blocks = _host(framework, view).reshape(BLOCKS, BLOCK)
                np.testing.assert_array_equal(blocks[[2, 3]], 7 + segment)
                np.testing.assert_array_equal(np.delete(blocks, [2, 3], axis=0), 1 + segment)
    finally:
        here.free()
        there.free()


def test_a_kv_cache_of_face_tensors_has_a_jaxbuf_device(framework, device):
    """ExtensibleKVCacheBuffers over a face's tensors: its device is jaxbuf's, and tensors on
    another device are still refused by device."""
    tensors = [_tensor(framework, device) for _ in range(2)]
    try:
        kv = jaxbuf.ExtensibleKVCacheBuffers([(t, BLOCK) for t in tensors], BLOCKS)
        assert kv.device == jaxbuf.as_device(device) and type(kv.device) is jaxbuf.Device
        views = [kv.full_view(1), *kv.layer_views("float32", num_blocks=BLOCKS)]
        assert all(type(view) is jaxbuf.BufferView for view in views)  # the neutral cache's
        assert views[1].ptr == tensors[0].base_ptr and views[0].ptr == tensors[1].base_ptr
        if jaxbuf.as_device(device).is_cuda:
            other = _face(framework).ExtensibleTensor(BLOCK * BLOCKS, device="cpu")
            with pytest.raises(ValueError, match="one KV cache lives on one device"):
                jaxbuf.ExtensibleKVCacheBuffers([(tensors[0], BLOCK), (other, BLOCK)], BLOCKS)
            other.free()
    finally:
        for t in tensors:
            t.free()


@pytest.mark.skipif(JAX_REASON is not None, reason=str(JAX_REASON))
def test_a_kv_cache_step_and_param_table_of_a_face(framework, device):
    """KVCacheStep over a face's cache, with a face's DeviceParamTable as its argument."""
    from jaxbuf.kv import KVCacheStep

    face = _face(framework)
    kv = _cache(framework, device, 0)
    table = face.DeviceParamTable(1, {"add": "int32"}, _seed_device(framework, device))
    step = None
    try:
        assert jaxbuf.as_device(table.device) == jaxbuf.as_device(device)
        table["add"].np[:] = 3
        table.sync()
        params = table.arrays("jax")
        step = KVCacheStep(
            kv, lambda caches, p: ([c + p["add"][0].astype(c.dtype) for c in caches], 0), "uint8"
        )
        step(params)
        for segment, view in enumerate(kv.segment_views(0, BLOCKS)):
            np.testing.assert_array_equal(_host(framework, view), 3 + segment)
    finally:
        if step is not None:
            step.close()
        table.close()
        kv.free()


@pytest.mark.skipif(JAX_REASON is not None, reason=str(JAX_REASON))
def test_a_sharded_jax_array_over_a_face_tensor(framework):
    """sharded_jax_array takes a face's tensor (its device checked, its neutral view read)."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from jaxbuf.sharding import sharded_jax_array

    et = _tensor(framework, "cpu")
    try:
        values = np.arange(BLOCK, dtype=np.int32)
        _write(jaxbuf.ExtensibleTensor.segment_view(et, 0), 0, values)
        mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
        array = sharded_jax_array([et], mesh, PartitionSpec("x"), "int32", (BLOCK,))
        np.testing.assert_array_equal(np.asarray(array), values)
        del array
    finally:
        et.free()
