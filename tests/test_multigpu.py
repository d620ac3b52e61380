"""Beyond one device: peer access, sharded JAX arrays, NCCL over jaxbuf memory.

CPU tests (run everywhere): peer-device validation and grant bookkeeping through a CPU driver
that pretends to have two devices, and the sharded-JAX assembly over two forced JAX CPU
devices (in a subprocess, since ``XLA_FLAGS`` must be set before JAX starts).

GPU tests (``-m multigpu``, two CUDA devices): each scenario runs in its own subprocess, so a
fault on one GPU cannot poison the CUDA contexts of the others, and its environment keeps
NVLink multicast off (``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxbuf import ExtensibleTensor
from jaxbuf.devices import Device
from jaxbuf.drivers import DriverError, HostVmmDriver, cuda_unavailable_reason, get_vmm_driver

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _cuda_device_count() -> int:
    if cuda_unavailable_reason() is not None:
        return 0
    return get_vmm_driver("cuda").device_count()


def _two_gpu_reason() -> str | None:
    count = _cuda_device_count()
    if count < 2:
        return f"needs 2 CUDA devices, found {count} ({cuda_unavailable_reason() or 'one GPU'})"
    if not HAS_TORCH:
        return "torch is not installed"
    return None


TWO_GPU_REASON = _two_gpu_reason()
needs_two_gpus = pytest.mark.skipif(TWO_GPU_REASON is not None, reason=str(TWO_GPU_REASON))


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off, whatever the caller set
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def _run_script(script: str, timeout: float = 300, **extra_env: str):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(**extra_env),
    )
    if result.returncode == 3 and "SKIP:" in result.stdout:
        pytest.skip(result.stdout.split("SKIP:", 1)[1].strip())
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "ALL OK" in result.stdout, result.stdout + result.stderr
    return result


# -- CPU: a host driver that pretends to have two devices -------------------------------------
class TwoDeviceHostDriver(HostVmmDriver):
    """The CPU driver with a fake second device: memory stays on device 0, set_access for
    device 1 is recorded (and can be made to fail), and peer capability is a switch."""

    def __init__(self, can_peer: bool = True) -> None:
        super().__init__()
        self.can_peer = can_peer
        self.grants: list[tuple[int, int, int]] = []  # (offset-free ptr, size, device)
        self.fail_device: int | None = None
        self.reserves = 0

    def device_count(self) -> int:
        return 2

    def reserve(self, size, alignment=0):
        self.reserves += 1
        return super().reserve(size, alignment)

    def can_access_peer(self, device_index, peer_index):
        return device_index == peer_index or self.can_peer

    def set_access(self, ptr, size, device_index):
        if device_index == self.fail_device:
            raise DriverError("set_access", "INJECTED_FAULT", device=device_index)
        self.grants.append((ptr, size, device_index))
        if device_index == 0:
            super().set_access(ptr, size, device_index)

    def synchronize(self, device_index):
        if device_index == 0:
            super().synchronize(device_index)


def _granted(driver: TwoDeviceHostDriver, buf: ExtensibleTensor, device_index: int):
    """Byte ranges (relative to the base) granted to ``device_index``, merged."""
    ranges = sorted(
        (p - buf.base_ptr, p - buf.base_ptr + s) for p, s, d in driver.grants if d == device_index
    )
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(r) for r in merged]


def test_peer_devices_are_validated_before_any_reservation():
    driver = TwoDeviceHostDriver()
    cases = [
        (["cpu"], ValueError, "owner device itself"),
        (["cuda:1"], ValueError, "platform"),
        (["cpu:1", "cpu:1"], ValueError, "twice"),
        (["cpu:2"], ValueError, "out of range"),
        (["tpu"], ValueError, "tpu"),
        ([None], TypeError, "None"),
    ]
    for peers, error, match in cases:
        with pytest.raises(error, match=match):
            ExtensibleTensor(4 * MiB, device="cpu", driver=driver, peer_devices=peers)
    driver.can_peer = False
    with pytest.raises(ValueError, match="cannot access"):
        ExtensibleTensor(4 * MiB, device="cpu", driver=driver, peer_devices="cpu:1")
    assert driver.reserves == 0 and driver.grants == []


def test_the_real_cpu_driver_has_no_peers():
    with pytest.raises(ValueError, match="out of range"):
        ExtensibleTensor(4 * MiB, device="cpu", peer_devices=["cpu:1"])
    with ExtensibleTensor(4 * MiB, device="cpu") as buf:
        assert buf.peer_devices == ()
        buf.grant_access([])  # nothing to grant
        with pytest.raises(ValueError, match="owner device itself"):
            buf.grant_access("cpu")


def test_every_commit_is_granted_to_the_owner_and_its_peers():
    driver = TwoDeviceHostDriver()
    buf = ExtensibleTensor(
        16 * MiB, device="cpu", driver=driver, num_segments=2, peer_devices=["cpu:1"]
    )
    try:
        assert buf.peer_devices == (Device("cpu", 1),)
        buf.resize_per_segment_(3 * MiB)
        buf.resize_per_segment_(5 * MiB)
        granule = buf.granularity
        committed = [(0, 6 * MiB), (8 * MiB, 14 * MiB)]
        committed = [(s, (e + granule - 1) // granule * granule) for s, e in committed]
        assert _granted(driver, buf, 0) == committed
        assert _granted(driver, buf, 1) == committed
        # Grants come in pairs: owner first, then the peer, over the same range.
        pairs = list(zip(driver.grants[::2], driver.grants[1::2]))
        assert all(a[:2] == b[:2] and (a[2], b[2]) == (0, 1) for a, b in pairs)
        # After release_physical the peers stay: a new commit is granted to both again.
        buf.release_physical()
        driver.grants.clear()
        buf.resize_per_segment_(1)
        assert {d for _, _, d in driver.grants} == {0, 1}
    finally:
        buf.free()


def test_grant_access_later_covers_committed_runs_then_new_ones():
    driver = TwoDeviceHostDriver()
    buf = ExtensibleTensor(16 * MiB, device="cpu", driver=driver, num_segments=2)
    try:
        buf.resize_per_segment_(2 * MiB)
        assert _granted(driver, buf, 1) == []
        driver.grants.clear()
        buf.grant_access(Device("cpu", 1))
        assert buf.peer_devices == (Device("cpu", 1),)
        # One grant per committed run, only for the new device.
        assert sorted(driver.grants) == sorted(
            [(buf.base_ptr, 2 * MiB, 1), (buf.base_ptr + 8 * MiB, 2 * MiB, 1)]
        )
        granted_by_grant_access = list(driver.grants)
        driver.grants.clear()
        buf.grant_access(["cpu:1"])  # already a peer: nothing to do
        assert driver.grants == []
        buf.resize_per_segment_(4 * MiB)
        assert {d for _, _, d in driver.grants} == {0, 1}
        # A grow grants only the chunks it maps, never the whole run; with what grant_access
        # granted, the peer covers every committed byte.
        assert _granted(driver, buf, 1) == [(2 * MiB, 4 * MiB), (10 * MiB, 12 * MiB)]
        driver.grants[:0] = granted_by_grant_access
        assert _granted(driver, buf, 1) == [(0, 4 * MiB), (8 * MiB, 12 * MiB)]
        with pytest.raises(ValueError, match="owner device itself"):
            buf.grant_access(["cpu:1", "cpu"])
        with pytest.raises(ValueError, match="platform"):
            buf.grant_access("cuda:1")
        assert buf.peer_devices == (Device("cpu", 1),)
    finally:
        buf.free()


def test_a_failed_grant_changes_no_peer_list():
    driver = TwoDeviceHostDriver()
    buf = ExtensibleTensor(8 * MiB, device="cpu", driver=driver)
    try:
        buf.resize_per_segment_(2 * MiB)
        driver.fail_device = 1
        with pytest.raises(DriverError, match="INJECTED_FAULT"):
            buf.grant_access("cpu:1")
        assert buf.peer_devices == ()
        driver.fail_device = None
        driver.grants.clear()
        buf.resize_per_segment_(4 * MiB)
        assert {d for _, _, d in driver.grants} == {0}
    finally:
        buf.free()


def test_a_failed_peer_grant_rolls_the_commit_back():
    driver = TwoDeviceHostDriver()
    buf = ExtensibleTensor(8 * MiB, device="cpu", driver=driver, peer_devices=[Device("cpu", 1)])
    try:
        buf.resize_per_segment_(2 * MiB)
        driver.fail_device = 1
        with pytest.raises(DriverError, match="INJECTED_FAULT"):
            buf.resize_per_segment_(6 * MiB)
        assert buf.committed_sizes == [2 * MiB]
        assert buf.physical_bytes == 2 * MiB and buf.num_physical_chunks == 1
        driver.fail_device = None
        buf.resize_per_segment_(6 * MiB)  # usable afterwards
        assert buf.physical_bytes == 6 * MiB
    finally:
        buf.free()
        gc.collect()


# -- CPU: sharded JAX arrays over two forced host devices ----------------------------------------
SHARDING_CPU_SCRIPT = """
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jaxbuf
from jaxbuf.sharding import global_shape_of, sharded_jax_array

devices = jax.devices("cpu")
assert len(devices) == 2, devices
mesh = Mesh(np.array(devices), ("x",))
rows, cols = 64, 32
bufs = [jaxbuf.ExtensibleTensor(8 << 20, device="cpu") for _ in devices]
for i, buf in enumerate(bufs):
    buf.resize_per_segment_(rows * cols * 4)
    buf.segment_view(0).view("float32").to_numpy()[:] = np.arange(rows * cols) + 1000 * i
expected = np.concatenate(
    [(np.arange(rows * cols) + 1000 * i).reshape(rows, cols) for i in range(2)]
).astype(np.float32)

a = sharded_jax_array(bufs, mesh, P("x"), "float32", (rows, cols))
assert a.shape == (2 * rows, cols) and a.dtype == jnp.float32
shards = sorted(a.addressable_shards, key=lambda s: s.device.id)
assert [s.device for s in shards] == devices
assert [s.data.unsafe_buffer_pointer() for s in shards] == [b.base_ptr for b in bufs]
np.testing.assert_array_equal(np.asarray(a), expected)
y = jax.jit(lambda x: x * 2.0 + 1.0)(a)
assert y.sharding.is_equivalent_to(a.sharding, a.ndim)
np.testing.assert_array_equal(np.asarray(y), expected * 2 + 1)
np.testing.assert_allclose(float(jax.jit(jnp.sum)(a)), expected.sum(dtype=np.float64), rtol=1e-6)

# Replicated over the mesh: both buffers must hold the same values (spec P()).
r = sharded_jax_array([bufs[0], bufs[0]], mesh, P(), "float32", (rows, cols))
assert r.shape == (rows, cols)
assert global_shape_of(mesh, P(None, "x"), (4, 3)) == (4, 6)

# Grow every shard: same pointers, old values kept, new rows visible in a new array.
del a, y, r, shards
for i, buf in enumerate(bufs):
    base = buf.base_ptr
    buf.resize_per_segment_(2 * rows * cols * 4)
    assert buf.base_ptr == base
    buf.segment_view(0).view("float32").to_numpy()[rows * cols:] = -1.0 - i
b = sharded_jax_array(bufs, mesh, P("x"), "float32", (2 * rows, cols))
got = np.asarray(b)
for i in range(2):
    part = got[2 * rows * i: 2 * rows * (i + 1)]
    np.testing.assert_array_equal(part[:rows], expected[rows * i: rows * (i + 1)])
    assert (part[rows:] == -1.0 - i).all()

# Validation, before any array is made.
def raises(error, fn, match):
    try:
        fn()
    except error as e:
        assert match in str(e), (match, str(e))
    else:
        raise AssertionError(f"no {error.__name__} for {match}")

raises(ValueError, lambda: sharded_jax_array(bufs[:1], mesh, P("x"), "float32", (rows, cols)),
       "one buffer per mesh device")
raises(ValueError, lambda: sharded_jax_array(bufs, mesh, P("x"), "float32", (4 * rows, cols)),
       "bytes committed")
raises(ValueError, lambda: sharded_jax_array(bufs, mesh, P("y"), "float32", (rows, cols)),
       "'y'")
raises(ValueError, lambda: sharded_jax_array(bufs, mesh, P("x", None, None), "float32",
       (rows, cols)), "entries")
raises(TypeError, lambda: sharded_jax_array([bufs[0], "x"], mesh, P("x"), "float32",
       (rows, cols)), "buffers[1]")
raises(IndexError, lambda: sharded_jax_array(bufs, mesh, P("x"), "float32", (rows, cols),
       segment=1), "segment")
if not jax.config.jax_enable_x64:
    raises(ValueError, lambda: sharded_jax_array(bufs, mesh, P("x"), "float64", (rows, cols)),
           "x64")
del b
for buf in bufs:
    buf.free()
print("ALL OK")
"""


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
def test_sharded_jax_array_over_two_cpu_devices():
    flags = os.environ.get("XLA_FLAGS", "")
    _run_script(
        SHARDING_CPU_SCRIPT,
        timeout=180,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2".strip(),
    )


# -- GPU: peer access ------------------------------------------------------------------------
PEER_SCRIPT = """
import torch
import jaxbuf
from jaxbuf.devices import Device
from jaxbuf.drivers.base import K_DL_CUDA
from jaxbuf.views import BufferView

MiB = 1 << 20
driver = jaxbuf.drivers.get_vmm_driver("cuda:0")
if not driver.can_access_peer(1, 0):
    print("SKIP: CUDA device 1 cannot access device 0 (cuDeviceCanAccessPeer)")
    raise SystemExit(3)

def on_device(buf, nbytes, index):
    # A float32 torch tensor on cuda:<index> over the buffer's first nbytes.
    view = BufferView(buf.base_ptr, nbytes, "float32", (nbytes // 4,), Device("cuda", index),
                      buf, K_DL_CUDA)
    tensor = view.to_torch()
    assert tensor.device == torch.device("cuda", index), tensor.device
    assert tensor.data_ptr() == buf.base_ptr
    return tensor

def sync():
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)

def exercise(buf, label):
    # GPU 0 writes, GPU 1 reads and writes, GPU 0 checks; then a grow and the same on the
    # new run.
    n = 4 * MiB // 4
    buf.resize_per_segment_(4 * MiB, zero_new=True)
    buf.driver.synchronize(0)
    t0 = buf.segment_view(0).to_torch(dtype=torch.float32)
    assert t0.device == torch.device("cuda", 0)
    ramp0 = torch.arange(n, dtype=torch.float32, device="cuda:0")
    t0.copy_(ramp0)
    sync()
    t1 = on_device(buf, 4 * MiB, 1)
    ramp1 = torch.arange(n, dtype=torch.float32, device="cuda:1")
    local1 = t1 * 1.0  # a kernel on GPU 1 reads GPU 0's memory into GPU 1's
    assert torch.equal(local1, ramp1), label + ": GPU 1 read wrong values"
    t1.mul_(2.0).add_(1.0)  # a kernel on GPU 1 writes in place
    sync()
    assert torch.equal(t0, ramp0 * 2 + 1), label + ": GPU 0 does not see GPU 1's writes"
    chunks = buf.num_physical_chunks
    base = buf.base_ptr
    buf.resize_per_segment_(32 * MiB, zero_new=True)
    buf.driver.synchronize(0)
    assert buf.base_ptr == base and buf.num_physical_chunks > chunks
    big1 = on_device(buf, 32 * MiB, 1)
    assert torch.equal(big1[:n], ramp1 * 2 + 1), label + ": old values lost after the grow"
    assert bool((big1[n:] == 0).all()), label + ": new run not zeroed as seen from GPU 1"
    big1[n:].fill_(7.0)  # GPU 1 writes into the newly committed run
    sync()
    big0 = buf.segment_view(0).to_torch(dtype=torch.float32)
    assert bool((big0[n:] == 7.0).all()), label + ": GPU 0 does not see the new run's writes"
    assert torch.equal(big0[:n], ramp0 * 2 + 1)
    del t0, t1, local1, big0, big1
    sync()
    print(label, "ok")

# (1) peers at construction.
buf = jaxbuf.ExtensibleTensor(64 * MiB, device="cuda:0", peer_devices=["cuda:1"])
assert buf.peer_devices == (Device("cuda", 1),)
exercise(buf, "peer_devices at construction")
buf.free()

# (2) granted later, after memory was committed.
buf = jaxbuf.ExtensibleTensor(64 * MiB, device="cuda:0")
buf.resize_per_segment_(2 * MiB, zero_new=True)
buf.grant_access("cuda:1")
assert buf.peer_devices == (Device("cuda", 1),)
exercise(buf, "grant_access later")
buf.free()

# (3) several segments (several runs), granted later: every run is reachable from GPU 1.
buf = jaxbuf.ExtensibleTensor(64 * MiB, device="cuda:0", num_segments=4)
buf.resize_per_segment_(2 * MiB, zero_new=True)
buf.driver.synchronize(0)
buf.grant_access([1])
for i in range(4):
    offset = buf.segment_offsets[i]
    view = BufferView(buf.base_ptr + offset, 2 * MiB, "uint8", (2 * MiB,), Device("cuda", 1),
                      buf, K_DL_CUDA)
    seg = view.to_torch()
    seg.fill_(i + 1)
sync()
for i in range(4):
    assert bool((buf.segment_view(i).to_torch() == i + 1).all()), f"segment {i}"
sync()
buf.free()

# (4) validation on real devices.
for peers, word in ((["cuda:0"], "owner device itself"), (["cuda:99"], "out of range"),
                    (["cpu"], "platform")):
    try:
        jaxbuf.ExtensibleTensor(4 * MiB, device="cuda:0", peer_devices=peers)
    except ValueError as error:
        assert word in str(error), (peers, str(error))
    else:
        raise AssertionError(f"peer_devices={peers} accepted")
print("ALL OK")
"""


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_two_gpus
def test_gpu1_reads_and_writes_a_buffer_on_gpu0():
    _run_script(PEER_SCRIPT)


# -- GPU: sharded JAX arrays -----------------------------------------------------------------
SHARDING_GPU_SCRIPT = """
import numpy as np
import torch
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jaxbuf
from jaxbuf.devices import as_device
from jaxbuf.sharding import sharded_jax_array

gpus = [d for d in jax.devices() if d.platform == "gpu"]
if len(gpus) < 2:
    print(f"SKIP: JAX sees {len(gpus)} GPU(s): {jax.devices()}")
    raise SystemExit(3)
gpus = gpus[:2]
mesh = Mesh(np.array(gpus), ("x",))
rows, cols = 512, 1024  # 2 MiB of float32 per shard
bufs = [jaxbuf.ExtensibleTensor(64 << 20, device=as_device(d)) for d in gpus]
assert [b.device.index for b in bufs] == [d.local_hardware_id for d in gpus]

def host_values(i, start, count):
    return ((np.arange(start, start + count) % 97) + 100 * i).astype(np.float32)

def write(buf, i, start, count):
    t = buf.segment_view(0).to_torch(dtype=torch.float32)
    t[start:start + count].copy_(torch.from_numpy(host_values(i, start, count)))
    torch.cuda.synchronize(buf.device.index)

for i, buf in enumerate(bufs):
    buf.resize_per_segment_(rows * cols * 4)
    write(buf, i, 0, rows * cols)
expected = np.concatenate([host_values(i, 0, rows * cols).reshape(rows, cols) for i in range(2)])

a = sharded_jax_array(bufs, mesh, P("x"), jnp.float32, (rows, cols))
assert a.shape == (2 * rows, cols), a.shape
shards = sorted(a.addressable_shards, key=lambda s: gpus.index(s.device))
assert [s.device for s in shards] == gpus
assert [s.data.unsafe_buffer_pointer() for s in shards] == [b.base_ptr for b in bufs], "copied"
np.testing.assert_array_equal(np.asarray(a), expected)

# Elementwise: no communication, the result keeps the sharding.
y = jax.jit(lambda x: x * 2.0 + 1.0)(a)
assert y.sharding.is_equivalent_to(a.sharding, a.ndim), y.sharding
np.testing.assert_array_equal(np.asarray(y), expected * 2 + 1)
# Row sums stay on their shard; a full sum crosses devices (XLA's own collective).
row_sums = jax.jit(lambda x: x.sum(axis=1))(a)
np.testing.assert_allclose(np.asarray(row_sums), expected.sum(axis=1), rtol=1e-6)
total = jax.jit(jnp.sum)(a)
np.testing.assert_allclose(float(total), expected.sum(dtype=np.float64), rtol=1e-6)
print("jit ok")

# Grow every shard and build a new sharded view: values preserved, new rows visible.
jax.block_until_ready((a, y, row_sums, total))
del a, y, row_sums, total, shards
for i, buf in enumerate(bufs):
    base = buf.base_ptr
    buf.resize_per_segment_(2 * rows * cols * 4)
    assert buf.base_ptr == base
    write(buf, i, rows * cols, rows * cols)
b = sharded_jax_array(bufs, mesh, P("x"), jnp.float32, (2 * rows, cols))
grown = np.concatenate(
    [host_values(i, 0, 2 * rows * cols).reshape(2 * rows, cols) for i in range(2)]
)
np.testing.assert_array_equal(np.asarray(b), grown)
np.testing.assert_array_equal(np.asarray(b)[:rows], expected[:rows])  # shard 0's old rows
z = jax.jit(lambda x: jnp.sqrt(x) - x)(b)
np.testing.assert_allclose(np.asarray(z), np.sqrt(grown) - grown, rtol=1e-6)
jax.block_until_ready(z)
del b, z
for buf in bufs:
    torch.cuda.synchronize(buf.device.index)
    buf.free()
print("ALL OK")
"""


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_two_gpus
@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
def test_sharded_jax_array_over_two_gpus():
    _run_script(SHARDING_GPU_SCRIPT)


# -- GPU: NCCL all-reduce over jaxbuf views --------------------------------------------------
NCCL_RANK_SCRIPT = """
import os
import torch
import torch.distributed as dist
import jaxbuf

MiB = 1 << 20
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert os.environ.get("NCCL_NVLS_ENABLE") == "0"
torch.cuda.set_device(rank)
device = torch.device("cuda", rank)
buf = jaxbuf.ExtensibleTensor(64 * MiB, device=f"cuda:{rank}")
buf.resize_per_segment_(4 * MiB)
n = 4 * MiB // 4
t = buf.segment_view(0).to_torch(dtype=torch.float32)
assert t.device == device and t.data_ptr() == buf.base_ptr
ramp = torch.arange(n, dtype=torch.float32, device=device)
t.copy_(ramp + rank)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
dist.all_reduce(t, op=dist.ReduceOp.SUM)
torch.cuda.synchronize(device)
offset = sum(range(world))
assert torch.equal(t, ramp * world + offset), f"rank {rank}: wrong all-reduce result"
assert t.data_ptr() == buf.base_ptr

# Grow: the new view spans two runs (two chunks); all-reduce it again.
buf.resize_per_segment_(16 * MiB)
t2 = buf.segment_view(0).to_torch(dtype=torch.float32)
t2[n:].fill_(rank + 1.0)
dist.all_reduce(t2, op=dist.ReduceOp.SUM)
torch.cuda.synchronize(device)
assert torch.equal(t2[:n], (ramp * world + offset) * world), f"rank {rank}: old part"
assert bool((t2[n:] == sum(r + 1.0 for r in range(world))).all()), f"rank {rank}: new part"
dist.barrier()
dist.destroy_process_group()
del t, t2
torch.cuda.synchronize(device)
buf.free()
print(f"rank {rank} ALL OK")
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_two_gpus
def test_nccl_all_reduce_over_jaxbuf_views():
    world = 2
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = _env(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", NCCL_RANK_SCRIPT],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    report = "\n".join(
        f"rank {r}: exit {p.returncode}\n{out}\n{err}"
        for r, (p, (out, err)) in enumerate(zip(procs, outputs))
    )
    assert [p.returncode for p in procs] == [0] * world, report
    for rank, (out, _) in enumerate(outputs):
        assert f"rank {rank} ALL OK" in out, report
