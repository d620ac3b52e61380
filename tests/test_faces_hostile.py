"""The framework faces (``jaxbuf.torch``, ``jaxbuf.jax``) and the neutral ``BufferView`` used
as a careless or hostile user would: face objects handed to jaxbuf's own layers, views
handed to numpy/JAX converters or used as tensors, handles dropped without ``free()`` with
the cycle collector off, Ctrl-C at the first call and at random instants.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import JAX_REASON, TORCH_REASON

import jaxbuf

MiB = 1 << 20


@pytest.fixture(params=["torch", "jax"])
def face(request):
    """The face module (``jaxbuf.torch`` or ``jaxbuf.jax``), skipped when its framework is
    missing."""
    reason = TORCH_REASON if request.param == "torch" else JAX_REASON
    if reason:
        pytest.skip(reason)
    return importlib.import_module(f"jaxbuf.{request.param}")


def _address(array) -> int:
    """Where a face's array starts (torch ``data_ptr``, JAX ``unsafe_buffer_pointer``)."""
    if hasattr(array, "data_ptr"):
        return array.data_ptr()
    return array.unsafe_buffer_pointer()


# -- a face's ExtensibleTensor handed to jaxbuf's own layers ----------------------------
# A face overrides segment_view / full_view to return framework arrays; jaxbuf's layers that
# take an ExtensibleTensor must still get the neutral views from it.


@pytest.mark.parametrize("buffers_face", [False, True])
def test_kv_buffers_over_face_tensors_hand_out_their_views(device, face, buffers_face):
    tensor = face.ExtensibleTensor(8 * MiB, device, num_segments=2)
    cls = face.ExtensibleKVCacheBuffers if buffers_face else jaxbuf.ExtensibleKVCacheBuffers
    buffers = cls([(tensor, 1024)], 100)
    try:
        buffers.commit(3)
        views = buffers.segment_views(0) + buffers.committed_views(0) + buffers.layer_views()
        full = buffers.full_view(0)
        starts = [tensor.base_ptr + offset for offset in tensor.segment_offsets]
        got = [v.ptr if isinstance(v, jaxbuf.BufferView) else _address(v) for v in views]
        assert got == starts * 3
        assert (full.ptr if isinstance(full, jaxbuf.BufferView) else _address(full)) == starts[0]
        if not buffers_face:  # the neutral class hands out neutral views, whatever the tensor
            assert all(isinstance(v, jaxbuf.BufferView) for v in [*views, full])
    finally:
        buffers.free()


def test_transfer_block_view_of_a_face_tensor(face):
    from jaxbuf.transfer import KVEndpoint, KVLayout

    a = face.ExtensibleTensor(8 * MiB, "cpu")
    b = face.ExtensibleTensor(8 * MiB, "cpu")
    for tensor in (a, b):
        tensor.resize_per_segment_(2 * MiB)
    ea = KVEndpoint(f"hostile-a-{face.__name__}", a, KVLayout(4096))
    eb = KVEndpoint(f"hostile-b-{face.__name__}", b, KVLayout(4096))
    try:
        jaxbuf.ExtensibleTensor.segment_view(a, 0).to_numpy()[4096 * 3 : 4096 * 4] = 7
        ea.write(ea.connect(eb.metadata()), [3], [5]).wait(timeout=30)
        view = eb.block_view(0, 5)
        assert isinstance(view, jaxbuf.BufferView)
        assert view.ptr == b.base_ptr + 5 * 4096
        assert (view.to_numpy() == 7).all()
    finally:
        ea.close()
        eb.close()
        a.free()
        b.free()


def test_sharded_jax_array_over_a_face_tensor(face):
    if JAX_REASON:
        pytest.skip(JAX_REASON)
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from jaxbuf.sharding import sharded_jax_array

    tensor = face.ExtensibleTensor(8 * MiB, "cpu")
    tensor.resize_per_segment_(4096)
    try:
        jaxbuf.ExtensibleTensor.segment_view(tensor, 0).to_numpy(dtype="float32")[:16] = 3.0
        mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
        array = sharded_jax_array([tensor], mesh, PartitionSpec("x"), "float32", (16,))
        np.testing.assert_array_equal(np.asarray(array), np.full(16, 3.0, np.float32))
        del array
    finally:
        tensor.free()


# -- a BufferView handed to numpy / JAX converters --------------------------------------


def _converters():
    converters = [("np.asarray", np.asarray), ("np.array", np.array)]
    converters.append(("np.asarray object", lambda v: np.asarray([v, v], dtype=object)))
    if not JAX_REASON:
        import jax.numpy as jnp

        converters.append(("jnp.asarray", jnp.asarray))
    return converters


@pytest.mark.parametrize(
    "name, convert", _converters(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_implicit_array_conversion_of_a_view_names_the_way(name, convert):
    tensor = jaxbuf.ExtensibleTensor(4 * MiB, "cpu")
    tensor.resize_per_segment_(4096)
    view = tensor.segment_view(0)
    try:
        with pytest.raises(TypeError, match=r"\.to_numpy\(\).*jaxbuf\.torch"):
            convert(view)
        # The explicit, zero-copy ways stay open.
        assert np.from_dlpack(view).ctypes.data == view.ptr == view.to_numpy().ctypes.data
        if not TORCH_REASON:
            import torch

            assert torch.as_tensor(view).data_ptr() == view.ptr  # through DLPack
    finally:
        del view
        tensor.free()


# -- a face handle dropped without free() ------------------------------------------------


@pytest.fixture
def no_cycle_collector():
    """The cycle collector off, as under ``gc.freeze()`` (vLLM freezes its startup heap):
    only reference counting frees anything."""
    import gc

    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("neutral", [False, True])
def test_a_dropped_handle_releases_its_memory_at_once(device, face, neutral, no_cycle_collector):
    """The views a face keeps for speed must not hold the handle in a cycle: dropped without
    ``free()``, its memory goes at once, as the neutral handle's (and the seed's) does."""
    import weakref

    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.testing import FaultInjectingDriver

    driver = FaultInjectingDriver(get_vmm_driver(device))
    cls = jaxbuf.ExtensibleTensor if neutral else face.ExtensibleTensor
    buf = cls(4 * MiB, device, num_segments=2, driver=driver)
    buf.resize_per_segment_(4096, zero_new=True)
    for _ in range(2):  # a kept view, then its reuse
        arrays = [buf.segment_view(0), buf.segment_view(1), buf.full_view()]
    buf.resize_per_segment_(8192)
    arrays.append(buf.segment_view(1))
    del arrays
    ref = weakref.ref(buf)
    del buf
    assert ref() is None
    driver.assert_clean()


# -- a Ctrl-C at the first call ----------------------------------------------------------

_FIRST_CALL = """
import sys

import jaxbuf.{face} as face

class ImportWatch:
    # Consulted only for a module not imported yet: the framework imported inside a call.
    def find_spec(self, name, path=None, target=None):
        if name == "{framework}":
            raise KeyboardInterrupt(f"{{name}} imported inside the first call")
        return None

sys.meta_path.insert(0, ImportWatch())
buf = face.ExtensibleTensor(4 << 20, "cpu")
buf.resize_per_segment_(4096)
array = buf.segment_view(0)
print(type(array).__module__, array.shape)
del array
buf.free()
"""


@pytest.mark.parametrize("face_name", ["torch", "jax"])
def test_the_first_call_of_a_face_imports_no_framework(face_name):
    """The face imports its framework when it is imported, never inside a call: a Ctrl-C in
    the middle of torch's or JAX's import (seconds, at the first tensor) left the framework
    half-initialized for the process (``SystemError``, ``partially initialized module``,
    ``SIGSEGV`` at later calls), from an API call that looked harmless."""
    import os
    import subprocess
    import sys

    if TORCH_REASON if face_name == "torch" else JAX_REASON:
        pytest.skip(TORCH_REASON or JAX_REASON)
    script = _FIRST_CALL.format(face=face_name, framework=face_name)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(4096,)" in done.stdout or "[4096]" in done.stdout, done.stdout


@pytest.mark.parametrize("neutral", [False, True])
def test_a_dropped_staged_write_tensor_releases_its_memory_at_once(
    device, face, neutral, no_cycle_collector
):
    """The view a StagedWriteTensor keeps of its target must not hold it in a cycle: dropped
    without ``free()`` (its target taken and dropped, or never taken), its memory goes at
    once."""
    import weakref

    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.testing import FaultInjectingDriver

    cls = jaxbuf.StagedWriteTensor if neutral else face.StagedWriteTensor
    for take in (False, True):
        driver = FaultInjectingDriver(get_vmm_driver(device))
        staged = cls((8, 4), "int32", device=device, driver=driver)
        if take:
            array = staged.gpu  # a view (neutral) or a framework array over the target
            del array
        ref = weakref.ref(staged)
        del staged
        assert ref() is None
        driver.assert_clean()


# -- a BufferView used as a tensor ---------------------------------------------------------


@pytest.mark.parametrize(
    "misuse",
    [
        lambda v: v[0],
        lambda v: v.__setitem__(0, 1),
        lambda v: list(v),
        lambda v: 3 in v,
        lambda v: v.tolist(),
        lambda v: v.data_ptr(),
    ],
    ids=["index", "assign", "iterate", "contains", "tolist", "data_ptr"],
)
def test_a_view_used_as_a_tensor_names_the_faces(misuse):
    tensor = jaxbuf.ExtensibleTensor(4 * MiB, "cpu")
    tensor.resize_per_segment_(4096)
    try:
        with pytest.raises((TypeError, AttributeError), match=r"\.to_torch\(\).*jaxbuf\.torch"):
            misuse(tensor.segment_view(0))
    finally:
        tensor.free()


# -- Ctrl-C at random instants ---------------------------------------------------------------


def test_a_face_interrupted_at_random_instants_stays_usable_and_leaks_nothing(face):
    """A timer signal (its handler raising KeyboardInterrupt) at seeded random instants of a
    face's calls (grows, segment and full views, dropping arrays): every call completes or
    raises, the handle then gives views sized to what is committed, and once it is freed and
    its arrays are gone, nothing is left."""
    import gc
    import random
    import signal

    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.testing import FaultInjectingDriver

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    rng = random.Random(20261205)
    outcomes = {"done": 0, "interrupted": 0}
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for _ in range(12):
            driver = FaultInjectingDriver(get_vmm_driver("cpu"))
            buf = face.ExtensibleTensor(8 * MiB, "cpu", num_segments=2, driver=driver)
            held, size = [], 0
            for _ in range(25):
                try:
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 300e-6))
                    step = rng.random()
                    if step < 0.3:
                        size += 4096
                        buf.resize_per_segment_(size, zero_new=rng.random() < 0.5)
                    elif step < 0.7:
                        held.append(buf.segment_view(rng.randrange(2)))
                    elif step < 0.8:
                        held.append(buf.full_view())
                    elif held:
                        held.pop(rng.randrange(len(held)))
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    outcomes["done"] += 1
                except KeyboardInterrupt:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    outcomes["interrupted"] += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert [buf.segment_view(i).shape[0] for i in (0, 1)] == buf.committed_sizes
            buf.free()
            held.clear()
            gc.collect()
            assert buf.live_exports == 0 and buf.released
            driver.assert_clean()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outcomes["done"] and outcomes["interrupted"], outcomes
