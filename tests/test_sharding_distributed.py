"""``sharded_jax_array`` under ``jax.distributed``: two processes, one global array.

Each test starts two processes (``sys.executable``) that call ``jax.distributed.initialize`` on
localhost. Every process owns the shards of its own devices in jaxbuf memory (one
``ExtensibleTensor`` per local device, filled with its block of a known global array), passes
only those buffers to ``sharded_jax_array``, and runs jitted reductions over the global array
whose data crosses processes: a total sum and per-row sums of a column-sharded array (every
row spans all shards), per-column sums of a row-sharded one. Each process checks the results
against numpy, then writes to its shards and checks that a computation dispatched after the
write sees it. Both processes must exit 0.

On the CPU (run everywhere) the cross-process collectives are gloo's: JAX's CPU client uses
them when ``jax_cpu_collectives_implementation`` is "gloo" (the default since JAX 0.5.1; the
worker sets it explicitly, which works from 0.4.27). The GPU variant (``-m multigpu``) gives
each process one of two CUDA devices (``CUDA_VISIBLE_DEVICES``) and uses NCCL, NVLink
multicast off.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import pytest

from jaxbuf.drivers import cuda_unavailable_reason, get_vmm_driver

HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
SKIP_EXIT = 3  # a worker's exit status for "this machine cannot run the scenario"
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")

WORKER = r"""
import os, sys
process_id, port, platform = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import jax
if platform == "cpu":
    # Cross-process collectives on the CPU client: gloo (the default since JAX 0.5.1).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
    initialization_timeout=120,
)
import numpy as np
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxbuf
from jaxbuf.devices import as_device
from jaxbuf.sharding import global_shape_of, sharded_jax_array

jax_platform = "cpu" if platform == "cpu" else "gpu"
devices = [d for d in jax.devices() if d.platform == jax_platform]
local = [d for d in devices if d.process_index == jax.process_index()]
if platform == "cuda" and len(local) != 1:
    print(f"SKIP: process {process_id} sees {len(local)} local GPU(s): {jax.local_devices()}")
    raise SystemExit(3)
assert jax.process_count() == 2, jax.process_count()
assert len(devices) == 2 * len(local), (devices, local)
mesh = Mesh(np.array(devices), ("x",))
replicated = NamedSharding(mesh, P())
rows, cols = 16, 8
n = len(devices)

if platform == "cuda":
    import torch

    def fill(buf, values):
        buf.segment_view(0).view("float32", values.shape).to_torch().copy_(torch.from_numpy(values))
        torch.cuda.synchronize()  # the write is complete before JAX imports or reads it
else:
    def fill(buf, values):
        buf.segment_view(0).view("float32", values.shape).to_numpy()[:] = values

def check(spec, shard_shape):
    global_shape = global_shape_of(mesh, spec, shard_shape)
    expected = (np.arange(np.prod(global_shape)) % 251).astype(np.float32).reshape(global_shape)
    index_of = NamedSharding(mesh, spec).devices_indices_map(global_shape)
    bufs = [jaxbuf.ExtensibleTensor(4 << 20, device=as_device(d)) for d in local]
    for buf, d in zip(bufs, local):
        buf.resize_per_segment_(rows * cols * 4)
        fill(buf, np.ascontiguousarray(expected[index_of[d]]))

    a = sharded_jax_array(bufs, mesh, spec, "float32", shard_shape)
    assert a.shape == global_shape and not a.is_fully_addressable, (a.shape, a.sharding)
    shards = {s.device: s for s in a.addressable_shards}
    assert set(shards) == set(local), (shards, local)
    for buf, d in zip(bufs, local):  # zero-copy: every local shard is its buffer's memory
        assert shards[d].data.unsafe_buffer_pointer() == buf.base_ptr, d
        np.testing.assert_array_equal(np.asarray(shards[d].data), expected[index_of[d]])

    # Results replicated to every device, so each process reads the whole answer locally.
    total = jax.jit(jnp.sum, out_shardings=replicated)(a)
    row_sums = jax.jit(lambda x: x.sum(axis=1), out_shardings=replicated)(a)
    col_sums = jax.jit(lambda x: x.sum(axis=0), out_shardings=replicated)(a)
    np.testing.assert_allclose(float(total.addressable_data(0)), expected.sum(dtype=np.float64))
    np.testing.assert_allclose(np.asarray(row_sums.addressable_data(0)), expected.sum(axis=1))
    np.testing.assert_allclose(np.asarray(col_sums.addressable_data(0)), expected.sum(axis=0))
    jax.block_until_ready((total, row_sums, col_sums))

    # A write outside JAX, complete before the next dispatch, is seen by that computation
    # (each process writes its own shards: +1 everywhere).
    for buf, d in zip(bufs, local):
        fill(buf, np.ascontiguousarray(expected[index_of[d]]) + 1)
    total = jax.jit(jnp.sum, out_shardings=replicated)(a)
    np.testing.assert_allclose(
        float(total.addressable_data(0)), expected.sum(dtype=np.float64) + expected.size
    )
    jax.block_until_ready(total)
    del a, shards, total, row_sums, col_sums
    for buf in bufs:
        buf.free()

check(P("x"), (rows, cols))        # row-sharded: column sums cross every shard
check(P(None, "x"), (rows, cols))  # column-sharded: every row sum crosses every shard

# Validation still names the problem: this process owns len(local) of the mesh's devices.
try:
    sharded_jax_array([], mesh, P("x"), "float32", (rows, cols))
except ValueError as e:
    assert f"({len(local)} of {n})" in str(e), str(e)
else:
    raise AssertionError("no ValueError for a missing buffer")

jax.distributed.shutdown()
print(f"process {process_id}: OK")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two_processes(platform: str, env_for: dict[int, dict[str, str]]) -> None:
    """Start the worker as processes 0 and 1; fail unless both exit 0, skip if both say the
    machine cannot run it."""
    port = _free_port()
    procs = []
    for i in (0, 1):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_for[i]}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(i), str(port), platform],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate()[0] for proc in procs]
        pytest.fail(f"timed out after {TIMEOUT_S} s:\n" + "\n---\n".join(outputs))
    codes = [proc.returncode for proc in procs]
    report = "\n".join(
        f"--- process {i} (exit {c}):\n{o[-6000:]}" for i, (c, o) in enumerate(zip(codes, outputs))
    )
    if codes == [SKIP_EXIT, SKIP_EXIT]:
        pytest.skip(outputs[0].strip().splitlines()[-1])
    # A negative code is a signal: a crash (SIGSEGV, SIGABRT) fails the test, not only exit 1.
    assert codes == [0, 0], report
    for i, out in enumerate(outputs):
        assert f"process {i}: OK" in out, report


@pytest.mark.slow
@pytest.mark.parametrize("local_devices", [1, 2])
def test_two_processes_assemble_and_reduce_on_cpu(local_devices):
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={local_devices}".strip(),
    }
    _run_two_processes("cpu", {0: env, 1: env})


def _two_gpu_reason() -> str | None:
    if cuda_unavailable_reason() is not None:
        return f"needs 2 CUDA devices: {cuda_unavailable_reason()}"
    count = get_vmm_driver("cuda").device_count()
    if count < 2:
        return f"needs 2 CUDA devices, found {count}"
    if not HAS_TORCH:
        return "torch is not installed (the GPU worker writes its shards with torch)"
    return None


TWO_GPU_REASON = _two_gpu_reason()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(TWO_GPU_REASON is not None, reason=str(TWO_GPU_REASON))
def test_two_processes_assemble_and_reduce_on_two_gpus():
    def env(i: int) -> dict[str, str]:
        return {
            "CUDA_VISIBLE_DEVICES": str(i),  # one GPU per process, as under a launcher
            "JAX_PLATFORMS": "cuda",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off
        }

    _run_two_processes("cuda", {0: env(0), 1: env(1)})
