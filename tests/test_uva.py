"""UVA buffers and pools: the seed's length sequence, aliasing, copies, guards, fallback."""

from __future__ import annotations

import sys
import textwrap

import _forkserver
import numpy as np
import pytest
from conftest import JAX_REASON, TORCH_REASON  # rootdir conftest, on sys.path under pytest

import jaxbuf
from jaxbuf import uva
from jaxbuf.drivers import DriverError, HostVmmDriver
from jaxbuf.uva import NonUvaBuffer, UvaBackedTensor, UvaBuffer, UvaBufferPool

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
    if isinstance(array, jaxbuf.BufferView):
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
        if kind == "list" and row_shape and n == 0:
            # An empty list has no row shape: refused as the seed's numpy assignment is.
            before = pool.current_slot
            with pytest.raises(ValueError, match="could not broadcast"):
                pool.copy_to_uva([])
            assert pool.current_slot == before
            continue
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
    uva_pool = UvaBufferPool(
        (4, 2), "float32", device=device, framework="torch", buffer_cls=UvaBuffer
    )
    pool = UvaBufferPool((4, 2), "float32", device=device, framework="torch", buffer_cls=buffer_cls)
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
    pool = UvaBufferPool(8, "int32", device=device, framework=framework, buffer_cls=NonUvaBuffer)
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
    result = _forkserver.run([sys.executable, "-c", code])
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
        # complex64 is supported since DLPack complex; a byte-swapped dtype still is not.
        ({"size": 4, "dtype": ">i4"}, TypeError, ">i4"),
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
    pool = UvaBufferPool(
        4, "int32", device="cpu", driver=driver, buffer_cls=UvaBuffer, guarded="raise"
    )
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
    pool = UvaBufferPool(
        4, "int32", 1, device="cpu", driver=driver, buffer_cls=UvaBuffer, guarded=True
    )
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
    pool = UvaBufferPool((64, 4), torch.int32, 2, cuda_device, framework="torch", guarded=guarded)
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


# -- ownership: arrays keep their memory; free() means "done" ----------------------------------
def _run_child(code: str, **names) -> None:
    """Run ``code`` (with ``names`` bound as constants) in a fresh interpreter: it must exit
    normally (a negative return code is the signal that killed it) and print "ok"."""
    prelude = "".join(f"{key} = {value!r}\n" for key, value in names.items())
    command = [sys.executable, "-c", prelude + textwrap.dedent(code)]
    result = _forkserver.run(command, timeout=600)
    assert result.returncode == 0, (
        f"exit status {result.returncode} (negative: killed by that signal)\n{result.stderr}"
    )
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr


_CHILD_HELPERS = """
import gc
import numpy as np
import jaxbuf
from jaxbuf.uva import NonUvaBuffer, UvaBackedTensor, UvaBuffer, UvaBufferPool

def values(array):
    if isinstance(array, np.ndarray):
        return array.tolist()
    if hasattr(array, "detach"):
        return array.detach().cpu().tolist()
    return np.asarray(array).tolist()

def fill(array, value):
    if isinstance(array, np.ndarray):
        array.fill(value)
    else:
        array.fill_(value)
        if DEVICE != "cpu":
            import torch
            torch.cuda.synchronize()
"""

# A stale pool tensor: a tensor from a pool outlives the pool (dropped, closed, its slot
# replaced by growth, or the UvaBackedTensor around it dropped or closed); a new UvaBuffer
# must not reuse that memory (the stale tensor read 1001 instead of 5, and fill_(-7) wrote
# into the new buffer), and nothing may crash.
_STALE = (
    _CHILD_HELPERS
    + """
framework = "view" if CONSUMER == "numpy" else CONSUMER
if HOW.startswith("backed"):
    owner = UvaBackedTensor(4, "int32", 1, DEVICE, framework=framework)
    owner.np[:] = 5
    out = owner.copy_to_uva()
    pool = owner.pool
else:
    owner = pool = UvaBufferPool(4, "int32", 1, DEVICE, framework=framework)
    out = pool.copy_to_uva(np.full(4, 5, np.int32))
stale = out.to_numpy() if CONSUMER == "numpy" else out
slot = pool.slots[0]
address = slot.host_ptr
del out
if HOW == "grow":
    pool.copy_to_uva(np.zeros(5, np.int32))  # one slot: replaced by an 8-row one
    assert pool.slots[0] is not slot
elif HOW.endswith("close"):
    owner.close()
else:
    del owner, pool  # dropped without close()
gc.collect()
assert slot.live_exports == 1 and not slot.released, (slot.live_exports, slot.released)
try:
    slot.view
    raise AssertionError("a freed slot handed out a view")
except ValueError:
    pass
fresh = [UvaBuffer(4, "int32", DEVICE) for _ in range(16)]
for buffer in fresh:
    buffer.np[:] = 1001
assert address not in {buffer.host_ptr for buffer in fresh}
assert values(stale) == [5] * 4, values(stale)
if CONSUMER != "jax":  # JAX arrays are immutable
    fill(stale, -7)
    assert values(stale) == [-7] * 4
assert all(buffer.np.tolist() == [1001] * 4 for buffer in fresh)
del stale
owner = pool = None  # a UvaBackedTensor keeps its last array as .gpu
gc.collect()
assert slot.released and slot.live_exports == 0
print("ok")
"""
)


@pytest.mark.parametrize("how", ["drop", "close", "grow", "backed-drop", "backed-close"])
@pytest.mark.parametrize("consumer", ["numpy", "torch", "jax"])
def test_stale_pool_array_keeps_its_memory(device, consumer, how):
    if consumer == "numpy" and device != "cpu":
        pytest.skip("numpy reads host memory; a CUDA pool hands out device views")
    if consumer == "jax":
        _jax_on(device)
    _need(consumer)
    _run_child(_STALE, DEVICE=device, CONSUMER=consumer, HOW=how)


# Every sequence of public calls around free() either works or raises; none crashes.
_MISUSE = {
    "uva-free-with-exports": """
        buffer = UvaBuffer(4, "int32", DEVICE)
        buffer.np[:] = 5
        kept, view = buffer.np, buffer.uva(2)
        buffer.free()
        assert not buffer.released and buffer.live_exports == 1
        host_only = (view.to_numpy, lambda: np.from_dlpack(view)) if DEVICE == "cpu" else ()
        for export in (view.__dlpack__, *host_only):
            try:
                export()
                raise AssertionError("a view of a freed buffer was exported")
            except RuntimeError as error:
                assert "freed" in str(error), error
        kept[:] = 6
        assert kept.tolist() == [6] * 4
        del kept
        assert buffer.released and buffer.live_exports == 0
        buffer.free()  # idempotent
    """,
    "uva-dropped-with-exports": """
        buffer = UvaBuffer(4, "int32", DEVICE)
        buffer.np[:] = 5
        kept = buffer.np
        del buffer
        gc.collect()
        others = [UvaBuffer(4, "int32", DEVICE) for _ in range(8)]
        for other in others:
            other.np[:] = 1001
        assert kept.tolist() == [5] * 4
    """,
    "uva-free-with-torch": """
        import torch
        buffer = UvaBuffer(4, "int32", DEVICE)
        buffer.np[:] = 5
        device_tensor, host_tensor = buffer.torch_device_tensor, buffer.cpu
        buffer.free()
        assert not buffer.released
        device_tensor.add_(1)
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        assert values(host_tensor) == [6] * 4 and values(device_tensor) == [6] * 4
        del device_tensor
        assert not buffer.released
        del host_tensor
        assert buffer.released
        try:
            buffer.view.to_torch()
            raise AssertionError("a freed buffer handed out a view")
        except ValueError:
            pass
    """,
    "uva-free-with-jax": """
        import jax, jax.numpy as jnp
        buffer = UvaBuffer(4, "int32", DEVICE)
        buffer.np[:] = 5
        array = buffer.jax_device_array
        view = buffer.view
        buffer.free()
        assert not buffer.released
        assert int(jax.jit(jnp.sum)(array)) == 20 and np.asarray(array).tolist() == [5] * 4
        try:
            view.to_jax()
            raise AssertionError("a view of a freed buffer was exported to JAX")
        except RuntimeError:
            pass
        del array
        gc.collect()
        assert buffer.released
    """,
    "non-uva-free-with-torch": """
        buffer = NonUvaBuffer(4, "int32", DEVICE)
        buffer.np[:] = 5
        tensor = buffer.uva().to_torch()
        view = buffer.uva(2)
        buffer.free()
        assert not buffer.released and buffer.live_exports == 1
        assert values(tensor) == [5] * 4
        try:
            view.to_torch()
            raise AssertionError("a view of a freed buffer was exported")
        except RuntimeError:
            pass
        del tensor
        assert buffer.released
    """,
    "non-uva-dropped-with-torch": """
        buffer = NonUvaBuffer(4, "int32", DEVICE)
        buffer.np[:] = 5
        tensor = buffer.uva().to_torch()
        del buffer
        gc.collect()
        assert values(tensor) == [5] * 4
    """,
    "pool-view-after-close": """
        pool = UvaBufferPool(4, "int32", device=DEVICE)
        view = pool.copy_to_uva([1, 2])
        pool.close()
        try:
            view.__dlpack__()
            raise AssertionError("a view of a closed pool was exported")
        except RuntimeError:
            pass
        try:
            pool.copy_to_uva([1])
            raise AssertionError("a closed pool copied")
        except ValueError:
            pass
    """,
}


@pytest.mark.parametrize("case", list(_MISUSE))
def test_misuse_works_or_raises(device, case):
    if "torch" in case:
        _need("torch")
    if "jax" in case:
        _jax_on(device)
    _run_child(_CHILD_HELPERS + textwrap.dedent(_MISUSE[case]) + "print('ok')\n", DEVICE=device)


def _counting_driver():
    from jaxbuf.testing import FaultInjectingDriver

    return FaultInjectingDriver(HostVmmDriver())


def test_no_reference_cycle_keeps_memory():
    # slot -> cached tensor -> capsule -> anchor -> block leads back to no slot or pool: with
    # the cycle collector off, reference counting alone frees everything.
    import gc
    import weakref

    _need("torch")
    # Warm up first: torch's first import (inside the adapter) leaves frames alive for a while.
    UvaBuffer(4, "int32", "cpu").torch_device_tensor
    driver = _counting_driver()
    gc.collect()
    gc.disable()
    try:
        pool = UvaBufferPool((4, 2), "int32", 2, "cpu", framework="torch", driver=driver)
        kept = pool.copy_to_uva(np.ones((3, 2), np.int32))
        pool.copy_to_uva(np.ones((2, 2), np.int32))
        pool.slots[0].uva(1), pool.slots[0].cpu, pool.slots[0].torch_device_tensor
        dead = weakref.ref(pool)
        del pool
        assert dead() is None
        assert len(driver.pinned) == 1  # the slot behind `kept`
        del kept
        assert not driver.pinned
        buffer = UvaBuffer(4, "int32", "cpu", driver=driver)
        buffer.uva(2), buffer.torch_device_tensor, buffer.cpu, buffer.view
        del buffer
        assert not driver.pinned
        fallback = NonUvaBuffer(4, "int32", "cpu", driver=driver)
        fallback.uva(2), fallback.torch_device_tensor
        del fallback
        assert not driver.reservations and not driver.mapped
    finally:
        gc.enable()
    driver.assert_clean()


def test_free_quiesces_frameworks_before_releasing(monkeypatch):
    from jaxbuf import interop

    calls = []
    monkeypatch.setattr(interop, "quiesce", calls.append, raising=False)
    buffer = UvaBuffer(4, "int32", "cpu")
    kept = buffer.np
    buffer.free()
    assert calls == []  # nothing released yet: the numpy array holds the memory
    del kept
    assert buffer.released
    buffer = UvaBuffer(4, "int32", "cpu")
    buffer.free()
    assert [device.platform for device in calls] == ["cpu"]
    pool = UvaBufferPool(4, "int32", 3, "cpu")
    pool.close()
    assert len(calls) == 2  # once for the pool, not once per slot
    pool = UvaBufferPool(4, "int32", 3, "cpu")
    del pool  # dropped: released for the collector, which calls no framework
    assert len(calls) == 2


@pytest.mark.parametrize("cls", [UvaBuffer, NonUvaBuffer])
def test_failed_release_is_retried(cls):
    driver = _counting_driver()
    buffer = cls(4, "int32", "cpu", driver=driver)
    driver.fail_on("host_free" if cls is UvaBuffer else "free_reserved")
    with pytest.raises(DriverError):
        buffer.free()
    buffer.free()
    assert buffer.released
    driver.assert_clean()


# -- pickling and copying owners ----------------------------------------------------------------
def _owner(kind):
    if kind == "UvaBuffer":
        return UvaBuffer(4, "int32", "cpu")
    if kind == "NonUvaBuffer":
        return NonUvaBuffer(4, "int32", "cpu")
    if kind == "UvaBufferPool":
        return UvaBufferPool(4, "int32", device="cpu")
    return UvaBackedTensor(4, "int32", device="cpu")


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
@pytest.mark.parametrize("kind", ["UvaBuffer", "NonUvaBuffer", "UvaBufferPool", "UvaBackedTensor"])
def test_owners_refuse_pickle_and_copy(kind, how):
    import copy
    import pickle

    owner = _owner(kind)
    operation = {"pickle": pickle.dumps, "copy": copy.copy, "deepcopy": copy.deepcopy}[how]
    with pytest.raises(TypeError, match=f"a {kind} cannot be pickled or copied: it owns memory"):
        operation(owner)
    owner.close()


# -- bad input, bounded ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pool_dtype", "bad", "match"),
    [
        ("int32", np.array([[1, 2**31, 3]]), r"2147483648\)? at index 1 is out of range for int32"),
        ("int32", [[1, 2, -(2**31) - 1]], r"-2147483649\)? at index 2 is out of range for int32"),
        ("int8", np.array([[1, 2, 200]], np.int16), r"200\)? at index 2 is out of range for int8"),
        ("int64", np.array([[2**63, 0, 0]], np.uint64), r"9223372036854775808\)? .* for int64"),
        (
            "uint8",
            np.array([[1, 2, 256]], np.uint16),
            r"256\)? at index 2 is out of range for uint8",
        ),
        ("float32", np.array([[1.0, 1e300, 0.0]]), r"1e\+300\)? at index 1 overflows float32"),
        (
            "float16",
            np.array([[7e4, 0, 0]], np.float32),
            r"70000.0\)? at index 0 overflows float16",
        ),
    ],
)
def test_copy_to_uva_refuses_values_that_do_not_fit(pool_dtype, bad, match):
    pool = UvaBufferPool((4, 3), pool_dtype, device="cpu")
    pool.copy_to_uva(np.ones((2, 3), pool_dtype))
    before = [slot.np.copy() for slot in pool.slots]
    current = pool.current_slot
    with pytest.raises(ValueError, match=match):
        pool.copy_to_uva(bad)
    assert pool.current_slot == current
    for slot, saved in zip(pool.slots, before):
        np.testing.assert_array_equal(slot.np, saved)
    pool.close()


@pytest.mark.parametrize(
    ("pool_dtype", "good"),
    [
        ("int32", np.array([[1, 2**31 - 1, -(2**31)]])),  # int64 within int32's range
        ("int32", [[1, 2, 3]]),
        ("int32", np.array([[True, False, True]])),
        ("float32", np.array([[1.5, -3e38, np.nan]])),
        ("float32", np.array([[np.inf, -np.inf, 3.4028235e38]])),  # infinities stay infinite
        ("float32", np.array([[1, 2**40, 3]])),  # ints round into a float pool
        ("uint8", np.array([[0, 255, 7]], np.uint16)),
    ],
)
def test_copy_to_uva_narrows_values_that_fit(pool_dtype, good):
    pool = UvaBufferPool((4, 3), pool_dtype, device="cpu")
    out = pool.copy_to_uva(good)
    np.testing.assert_array_equal(out.to_numpy(), np.asarray(good).astype(pool_dtype))
    pool.close()


def test_copy_to_uva_refuses_torch_values_that_do_not_fit():
    _need("torch")
    import torch

    pool = UvaBufferPool(4, "int32", device="cpu", framework="torch")
    with pytest.raises(ValueError, match=r"4294967296\)? at index 0 is out of range for int32"):
        pool.copy_to_uva(torch.tensor([2**32, 1], dtype=torch.int64))
    assert pool.copy_to_uva(torch.tensor([7, 1], dtype=torch.int64)).tolist() == [7, 1]


def test_pool_counts_are_bounded_before_allocating():
    import time

    from jaxbuf.uva import MAX_CONCURRENCY
    from jaxbuf.uva._memory import _physical_memory_bytes

    driver = _counting_driver()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"at most 1024 .* got 1099511627776"):
        UvaBufferPool(4, "int32", 2**40, "cpu", driver=driver)
    with pytest.raises(ValueError, match=f"at most {MAX_CONCURRENCY}"):
        UvaBufferPool(4, "int32", MAX_CONCURRENCY + 1, "cpu", driver=driver)
    physical = _physical_memory_bytes()
    # Each slot would fit the host's RAM; all of them together would not.
    half = physical // 2 + 1
    with pytest.raises(ValueError, match="physical memory: pinned memory stays resident"):
        UvaBufferPool(half, "uint8", 2, "cpu", driver=driver)
    for make in (UvaBuffer, NonUvaBuffer):
        with pytest.raises(ValueError, match=f"{physical + 1} bytes of host memory"):
            make(physical + 1, "uint8", "cpu", driver=driver)
    with pytest.raises(ValueError, match="physical memory"):
        UvaBackedTensor((physical // 8 + 1, 8), "uint8", 1, "cpu", driver=driver)
    assert time.perf_counter() - start < 5
    assert driver.call_count == 0  # refused before any allocation
    with UvaBufferPool(1, "int32", MAX_CONCURRENCY, "cpu", driver=driver) as pool:
        assert len(pool.slots) == MAX_CONCURRENCY
    driver.assert_clean()
