"""UVA buffers and pools: the seed's length sequence, aliasing, copies, guards, fallback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxbuf import uva
from jaxbuf.drivers import DriverError, HostVmmDriver
from jaxbuf.uva import NonUvaBuffer, UvaBackedTensor, UvaBuffer, UvaBufferPool

from conftest import JAX_REASON, TORCH_REASON  # rootdir conftest, on sys.path under pytest

# The seed pool's sequence: repeats, growth past a power of two, shrinking back.
SEED_LENGTHS = (0, 0, 3, 3, 4, 4, 5, 3, 3, 5, 1024, 1024, 1025, 1025, 2, 2)
ROW_SHAPES = [(), (3,)]
INPUT_KINDS = ["list", "numpy", "torch", "jax"]


def _need(kind: str) -> None:
    reason = {"torch": TORCH_REASON, "jax": JAX_REASON}.get(kind)
    if reason:
        pytest.skip(reason)


def _jax_on(device: str) -> None:
    _need("jax")
    if device.startswith("cuda"):
        import jax

        try:
            jax.devices("gpu")
        except RuntimeError as error:
            pytest.skip(f"JAX has no GPU backend here: {error}")


def _values(step: int, n: int, row_shape: tuple[int, ...]) -> np.ndarray:
    size = n * int(np.prod(row_shape, dtype=int))
    return (np.arange(size, dtype=np.int32) + 1000 * step).reshape((n, *row_shape))


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


def _to_numpy(array) -> np.ndarray:
    """Values of a torch tensor, JAX array or BufferView (any device), via the host."""
    if isinstance(array, uva.BufferView):
        if array.dlpack_device_type == 1:
            return array.to_numpy().copy()
        return array.to_torch().cpu().numpy()
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _sync(device: str) -> None:
    if device.startswith("cuda") and TORCH_REASON is None:
        import torch

        torch.cuda.synchronize()


# -- the seed sequence ----------------------------------------------------------------------
@pytest.mark.parametrize("row_shape", ROW_SHAPES, ids=["1d", "2d"])
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("framework", ["view", "torch", "jax"])
def test_seed_sequence(device, framework, kind, row_shape):
    _need(kind)
    if framework == "jax" or kind == "jax":
        _jax_on(device)
    _need(framework)
    pool = UvaBufferPool((4, *row_shape), "int32", device=device, framework=framework)
    assert pool.max_concurrency == uva.DEFAULT_MAX_CONCURRENCY == 2
    last: dict[int, np.ndarray] = {}
    capacities = [4, 4]
    for step, n in enumerate(SEED_LENGTHS):
        expected = _values(step, n, row_shape)
        out = pool.copy_to_uva(_as_input(expected, kind))
        slot = pool.current_slot
        if n > capacities[slot]:
            capacities[slot] = 1 << (n - 1).bit_length()
        assert tuple(out.shape) == (n, *row_shape)
        np.testing.assert_array_equal(_to_numpy(out), expected)
        assert [len(s) for s in pool.slots] == capacities
        last[slot] = expected
        other = 1 - slot
        if other in last:  # the other slot still holds its own step
            np.testing.assert_array_equal(pool.slots[other].np[: len(last[other])], last[other])
    assert capacities == [2048, 2048]
    pool.close()


@pytest.mark.parametrize("buffer_cls", [UvaBuffer, NonUvaBuffer])
def test_fallback_matches_uva(device, buffer_cls):
    _need("torch")
    uva_pool = UvaBufferPool((4, 2), "float32", device=device, framework="torch",
                             buffer_cls=UvaBuffer)  # fmt: skip
    pool = UvaBufferPool((4, 2), "float32", device=device, framework="torch",
                         buffer_cls=buffer_cls)  # fmt: skip
    assert pool.buffer_cls is buffer_cls
    for step, n in enumerate(SEED_LENGTHS):
        x = _values(step, n, (2,)).astype(np.float32) / 7
        a = _to_numpy(uva_pool.copy_to_uva(x))
        b = _to_numpy(pool.copy_to_uva(x))
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, x)
    uva_pool.close()
    pool.close()


@pytest.mark.parametrize("framework", ["view", "torch", "jax"])
def test_non_uva_buffer_copies_explicitly(device, framework):
    _need("torch") if framework != "jax" else _jax_on(device)
    pool = UvaBufferPool(8, "int32", device=device, framework=framework,
                         buffer_cls=NonUvaBuffer)  # fmt: skip
    out = pool.copy_to_uva([1, 2, 3])
    np.testing.assert_array_equal(_to_numpy(out), [1, 2, 3])
    slot = pool.slots[pool.current_slot]
    slot.np[:3] = 9  # not copied until the next uva()/copy_to_uva
    np.testing.assert_array_equal(_to_numpy(slot.view)[:3], [1, 2, 3])
    np.testing.assert_array_equal(_to_numpy(slot.uva(3)), [9, 9, 9])
    with pytest.raises(BufferError):
        slot.jax_pinned_host_array
    pool.close()


# -- aliasing -------------------------------------------------------------------------------
def test_torch_host_and_device_alias(device):
    _need("torch")
    import torch

    with UvaBuffer((4, 3), torch.float32, device=device) as buf:
        buf.np[:] = np.arange(12, dtype=np.float32).reshape(4, 3)
        tensor = buf.torch_device_tensor
        assert tensor.device.type == ("cuda" if device == "cuda" else "cpu")
        assert tensor.data_ptr() == buf.device_ptr
        np.testing.assert_array_equal(tensor.cpu().numpy(), buf.np)  # host write seen
        tensor.mul_(2)  # device write
        _sync(device)
        np.testing.assert_array_equal(buf.np, np.arange(12).reshape(4, 3) * 2)
        assert buf.cpu.data_ptr() == buf.host_ptr
        assert buf.uva(2).shape == (2, 3) and buf.uva(2).ptr == buf.device_ptr


def test_jax_host_and_device_alias(device):
    _jax_on(device)
    import jax
    import jax.numpy as jnp

    buf = UvaBuffer(16, jnp.int32, device=device)
    buf.np[:] = np.arange(16)
    device_array = buf.jax_device_array
    assert device_array.unsafe_buffer_pointer() == buf.device_ptr
    assert int(jax.jit(jnp.sum)(device_array)) == sum(range(16))  # host writes, read in jit
    host_array = buf.jax_pinned_host_array
    if device.startswith("cuda"):
        assert host_array.sharding.memory_kind == "pinned_host"
    # A device write (through the driver's device pointer) is seen by the host and JAX.
    buf._driver.memset(buf.device_ptr, 0, 16 * 4, buf.device.index)
    buf._driver.synchronize(buf.device.index)
    assert not buf.np.any()
    assert int(jax.jit(jnp.sum)(device_array)) == 0
    buf.np[:] = 5  # host write after the import: the same JAX array sees it
    assert int(jax.jit(jnp.sum)(device_array)) == 80
    buf.free()


def test_free_is_idempotent_and_views_go(device):
    buf = UvaBuffer(8, "int32", device=device)
    buf.free()
    buf.close()
    with pytest.raises(ValueError, match="freed"):
        buf.view
    with pytest.raises(ValueError, match="freed"):
        buf.uva(1)
    pool = UvaBufferPool(8, "int32", device=device)
    pool.close()
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.copy_to_uva([1])


def test_buffers_freed_at_interpreter_exit():
    code = textwrap.dedent(
        """
        import jaxbuf.uva as uva
        pool = uva.UvaBufferPool((4, 2), "int32", device="cpu")
        pool.copy_to_uva([[1, 2]])
        buf = uva.UvaBuffer(8, "float32", device="cpu")
        fallback = uva.NonUvaBuffer(8, "float32", device="cpu")
        keep = buf.np  # an array outliving the buffer object at exit
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "Exception ignored" not in result.stderr


# -- copy_to_gpu ----------------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_copy_to_gpu(device, framework):
    _need("torch") if framework == "torch" else _jax_on(device)
    pool = UvaBufferPool((8, 2), "int32", device=device, framework=framework)
    x = _values(1, 3, (2,))
    copy = pool.copy_to_gpu(x)
    _sync(device)
    if framework == "jax":
        copy.block_until_ready()
    pool.slots[pool.current_slot].np[:] = -1  # the copy is not a view of the slot
    np.testing.assert_array_equal(_to_numpy(copy), x)


def test_copy_to_gpu_into_torch_out(device):
    _need("torch")
    import torch

    pool = UvaBufferPool((8, 2), "int32", device=device, framework="view")
    out = torch.zeros((3, 2), dtype=torch.int32, device=device)
    x = _values(2, 3, (2,))
    assert pool.copy_to_gpu(x, out=out) is out
    np.testing.assert_array_equal(out.cpu().numpy(), x)
    with pytest.raises(ValueError, match="shape"):
        pool.copy_to_gpu(x, out=torch.zeros((4, 2), dtype=torch.int32, device=device))


def test_copy_to_gpu_into_jax_out(device):
    _jax_on(device)
    import jax
    import jax.numpy as jnp

    target = jax.devices("gpu" if device.startswith("cuda") else "cpu")[0]
    pool = UvaBufferPool((8, 2), "int32", device=device, framework="jax")
    out = jax.device_put(jnp.zeros((3, 2), jnp.int32), target)
    x = _values(3, 3, (2,))
    assert pool.copy_to_gpu(x, out=out) is out
    np.testing.assert_array_equal(np.asarray(out), x)
    with pytest.raises(ValueError, match="rows"):
        pool.copy_to_gpu(x[:2], out=out)
    with pytest.raises(TypeError, match="out must be"):
        pool.copy_to_gpu(x, out=np.zeros((3, 2), np.int32))


def test_uva_backed_tensor(device):
    _need("torch")
    backed = UvaBackedTensor((6, 2), "float32", device=device, framework="torch")
    backed.np[:] = np.arange(12, dtype=np.float32).reshape(6, 2)
    gpu = backed.copy_to_uva(4)
    assert backed.gpu is gpu and tuple(gpu.shape) == (4, 2)
    np.testing.assert_array_equal(_to_numpy(gpu), backed.np[:4])
    backed.cpu[0, 0] = 42  # cpu shares np
    np.testing.assert_array_equal(_to_numpy(backed.copy_to_uva())[0, 0], 42)
    backed.close()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_async_copy_to_device(device, framework):
    _need("torch") if framework == "torch" else _jax_on(device)
    out = uva.async_copy_to_device([[1, 2], [3, 4]], device, dtype="int32", framework=framework)
    np.testing.assert_array_equal(_to_numpy(out), [[1, 2], [3, 4]])
    assert str(out.dtype).endswith("int32")


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"size": 4, "dtype": "complex64"}, TypeError, "complex64"),
        ({"size": 4, "dtype": object}, TypeError, "unsupported dtype"),
        ({"size": 4.0, "dtype": "int32"}, TypeError, "size"),
        ({"size": True, "dtype": "int32"}, TypeError, "size"),
        ({"size": (4, "3"), "dtype": "int32"}, TypeError, "size"),
        ({"size": -1, "dtype": "int32"}, ValueError, "non-negative"),
        ({"size": (), "dtype": "int32"}, ValueError, "dimension"),
        ({"size": 4, "dtype": "int32", "max_concurrency": 0}, ValueError, "at least 1"),
        ({"size": 4, "dtype": "int32", "max_concurrency": 1.5}, TypeError, "max_concurrency"),
        ({"size": 4, "dtype": "int32", "framework": "numpy"}, ValueError, "framework"),
        ({"size": 4, "dtype": "int32", "guarded": "yes"}, ValueError, "guarded"),
        ({"size": 4, "dtype": "int32", "buffer_cls": dict}, TypeError, "buffer_cls"),
    ],
)
def test_bad_pool_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        UvaBufferPool(device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (np.zeros((2, 4), np.int32), ValueError, "shape"),  # wrong trailing dims
        (np.zeros((2,), np.int32), ValueError, "shape"),
        (np.array(3, np.int32), ValueError, "shape"),  # a 0-d array has no rows
        (np.int32(3), TypeError, "int32"),
        (np.zeros((2, 3), np.float32), TypeError, "float32"),  # float into int
        (np.zeros((2, 3), np.complex64), TypeError, "complex64"),
        ([[1.5, 2, 3]], TypeError, "float64"),
        ([[1, 2], [3]], ValueError, "shape|convert"),  # ragged
        ("abc", TypeError, "str"),
        ({"a": 1}, TypeError, "dict"),
    ],
)
def test_bad_input_writes_nothing(bad, error, match):
    pool = UvaBufferPool((4, 3), "int32", device="cpu", framework="view")
    pool.copy_to_uva(np.ones((2, 3), np.int32))
    before = [slot.np.copy() for slot in pool.slots]
    current = pool.current_slot
    with pytest.raises(error, match=match):
        pool.copy_to_uva(bad)
    assert pool.current_slot == current
    for slot, saved in zip(pool.slots, before):
        np.testing.assert_array_equal(slot.np, saved)


def test_torch_gpu_tensor_input_is_refused(cuda_device):
    _need("torch")
    import torch

    pool = UvaBufferPool(4, "int32", device=cuda_device)
    with pytest.raises(TypeError, match="already on the device"):
        pool.copy_to_uva(torch.zeros(2, dtype=torch.int32, device=cuda_device))


def test_bad_uva_rows():
    buf = UvaBuffer(4, "int32", device="cpu")
    with pytest.raises(IndexError, match="n=5"):
        buf.uva(5)
    with pytest.raises(TypeError, match="n must be"):
        buf.uva(1.0)


# -- the probe ------------------------------------------------------------------------------
def test_uva_probe_on_cpu():
    assert uva.is_uva_available("cpu")
    assert uva.uva_unavailable_reason("cpu") is None
    assert uva._uva_unavailable_reason.cache_info().currsize >= 1


class _NoPinnedDriver(HostVmmDriver):
    def host_alloc(self, size, device_index):
        raise DriverError("cuMemHostAlloc", "CUDA_ERROR_NOT_SUPPORTED", size=size)


class _NonAliasingDriver(HostVmmDriver):
    """The "device pointer" is other memory: a UVA that returns garbage."""

    def host_alloc(self, size, device_index):
        host_ptr, _ = super().host_alloc(size, device_index)
        decoy, _ = super().host_alloc(size, device_index)
        self._decoys = getattr(self, "_decoys", {})
        self._decoys[host_ptr] = decoy
        return host_ptr, decoy

    def host_free(self, host_ptr):
        super().host_free(self._decoys.pop(host_ptr))
        super().host_free(host_ptr)


def test_uva_probe_reasons():
    assert "allocation failed" in uva._probe_aliasing(_NoPinnedDriver(), 0)
    assert "does not alias" in uva._probe_aliasing(_NonAliasingDriver(), 0)
    assert uva._probe_aliasing(HostVmmDriver(), 0) is None


# -- guarded reuse (CPU, with a driver whose events complete on demand) -------------------------
class _EventDriver(HostVmmDriver):
    """Records fake events that stay pending until ``finish()``; counts the waits."""

    def __init__(self):
        super().__init__()
        self.pending: set[int] = set()
        self.waited: list[int] = []
        self.recorded: list[int] = []
        self._next = 0

    def record_event(self, stream, device_index):
        self._next += 1
        self.pending.add(self._next)
        self.recorded.append(stream)
        return self._next

    def event_query(self, event):
        return event not in self.pending

    def event_synchronize(self, event):
        self.waited.append(event)
        self.pending.discard(event)

    def destroy_event(self, event):
        self.pending.discard(event)

    def finish(self):
        self.pending.clear()


def test_guarded_raise_refuses_early_reuse():
    driver = _EventDriver()
    pool = UvaBufferPool(4, "int32", device="cpu", driver=driver, buffer_cls=UvaBuffer,
                         guarded="raise")  # fmt: skip
    pool.copy_to_uva([1, 1])  # slot 1
    pool.copy_to_uva([2, 2], stream=7)  # slot 0; records slot 1's readers on stream 7
    assert driver.recorded == [7]
    with pytest.raises(RuntimeError, match="slot 1 is reused"):
        pool.copy_to_uva([3, 3])
    np.testing.assert_array_equal(pool.slots[1].np[:2], [1, 1])  # nothing written
    assert pool.current_slot == 0
    driver.finish()
    pool.copy_to_uva([3, 3])
    np.testing.assert_array_equal(pool.slots[1].np[:2], [3, 3])


def test_guarded_wait_waits_then_writes():
    driver = _EventDriver()
    pool = UvaBufferPool(4, "int32", 1, device="cpu", driver=driver, buffer_cls=UvaBuffer,
                         guarded=True)  # fmt: skip
    pool.copy_to_uva([1])
    pool.copy_to_uva([2])  # one slot: records its readers, then waits for them
    assert driver.waited == [1]
    pool.record_readers(stream=3)
    assert driver.recorded[-1] == 3
    pool.close()  # waits for the last readers before freeing
    assert driver.waited == [1, 2]


# -- GPU: concurrency on a side stream --------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [False, "wait"])
def test_side_stream_two_in_flight(cuda_device, guarded):
    _need("torch")
    import torch

    steps = 24
    pool = UvaBufferPool((64, 4), torch.int32, 2, cuda_device, framework="torch",
                         guarded=guarded)  # fmt: skip
    tables = [_values(step, 1 + (step * 7) % 64, (4,)) for step in range(steps)]
    side = torch.cuda.Stream(cuda_device)
    done: list[torch.cuda.Event] = []
    snapshots = []
    with torch.cuda.stream(side):
        for step, table in enumerate(tables):
            if not guarded and step >= 2:
                done[step - 2].synchronize()  # the caller retires the slot's readers
            uva_rows = pool.copy_to_uva(table)
            torch.cuda._sleep(2_000_000)  # keep the device behind the host
            snapshots.append(uva_rows.clone())
            event = torch.cuda.Event()
            event.record(side)
            done.append(event)
    side.synchronize()
    for step, (snapshot, table) in enumerate(zip(snapshots, tables)):
        np.testing.assert_array_equal(snapshot.cpu().numpy(), table, err_msg=f"step {step}")
    pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raise", "wait"])
def test_guard_catches_early_reuse_on_gpu(cuda_device, mode):
    _need("torch")
    import torch

    pool = UvaBufferPool(4, torch.int32, 2, cuda_device, framework="torch", guarded=mode)
    side = torch.cuda.Stream(cuda_device)
    first = np.array([1, 2, 3, 4], np.int32)
    # Load both kernels first: a first launch's module loading is host time spent inside the
    # window below (under a loaded `pytest -n 8` it used up a 0.25 s sleep on the H200).
    torch.cuda._sleep(1)
    (torch.ones(4, dtype=torch.int32, device=cuda_device) * 2).cpu()
    with torch.cuda.stream(side):
        rows = pool.copy_to_uva(first)
        torch.cuda._sleep(2_000_000_000)  # about 1 s of device time before the read
        doubled = rows * 2
        pool.copy_to_uva([9, 9, 9, 9])  # the other slot; records the first slot's readers
        if mode == "raise":
            with pytest.raises(RuntimeError, match="still reads"):
                pool.copy_to_uva([7, 7, 7, 7])
        else:
            pool.copy_to_uva([7, 7, 7, 7])  # waits for the read, then overwrites
    side.synchronize()
    np.testing.assert_array_equal(doubled.cpu().numpy(), first * 2)
    pool.close()


@pytest.mark.gpu
def test_uva_probe_on_cuda(cuda_device):
    reason = uva.uva_unavailable_reason(cuda_device)
    assert reason is None or isinstance(reason, str)
    if reason is None:
        pool = UvaBufferPool(4, "int32", device=cuda_device)
        assert pool.buffer_cls is UvaBuffer
        pool.close()


def test_torch_inputs_fast_and_slow_paths(device):
    _need("torch")
    import torch

    pool = UvaBufferPool((4, 2), "float32", device=device, framework="torch")
    base = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    inputs = [
        base[:, :2].contiguous(),  # memmove path
        base[:, ::2],  # not contiguous: through numpy
        base[:3, :2].double(),  # another float dtype
        base[:2, :2].clone().requires_grad_(),  # needs detach
    ]
    for x in inputs:
        out = pool.copy_to_uva(x)
        np.testing.assert_array_equal(_to_numpy(out), x.detach().float().numpy())
    with pytest.raises(TypeError, match="complex64"):
        pool.copy_to_uva(torch.zeros((2, 2), dtype=torch.complex64))
