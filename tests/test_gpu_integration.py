"""What the GPU buys: CUDA graphs over a growing buffer, JAX donation and imports on VMM memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import jaxbuf

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_cuda_graph_over_full_view_survives_growth():
    """The reason the seed exists: a graph captured over the reservation keeps working, and
    sees bytes committed after capture, because the base pointer never moves."""
    torch = pytest.importorskip("torch")
    buf = jaxbuf.ExtensibleTensor(64 * MiB, device="cuda:0")
    try:
        buf.resize_per_segment_(2 * MiB, zero_new=True)
        base = buf.base_ptr
        full = buf.full_view().to_torch()
        late = 40 * MiB  # not committed when the graph is captured
        early_out = torch.zeros(16, dtype=torch.uint8, device="cuda")
        late_out = torch.zeros(16, dtype=torch.uint8, device="cuda")
        full[:16].fill_(3)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.add(full[:16], 0, out=early_out)  # warm up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Kernels, not copies: a captured memcpy node is checked against the memory mapped at
        # capture time (INVALID_VALUE for uncommitted addresses); a kernel node is not.
        with torch.cuda.graph(graph):
            torch.add(full[:16], 0, out=early_out)
            torch.add(full[late : late + 16], 0, out=late_out)
        buf.resize_per_segment_(late + 2 * MiB, zero_new=True)
        assert buf.base_ptr == base
        full[late : late + 16].fill_(7)
        full[:16].fill_(5)
        graph.replay()
        torch.cuda.synchronize()
        assert early_out.tolist() == [5] * 16
        assert late_out.tolist() == [7] * 16
        del graph, full
    finally:
        torch.cuda.synchronize()
        buf.free()


def _run(code: str) -> subprocess.CompletedProcess:
    env_code = "import os; os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'\n"
    return subprocess.run(
        [sys.executable, "-c", env_code + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_thousands_of_jax_imports_and_a_donated_view_on_vmm_memory():
    pytest.importorskip("jax")
    result = _run(
        """
        import jax, jax.numpy as jnp, jaxbuf
        buf = jaxbuf.ExtensibleTensor(8 << 20, device="cuda:0")
        buf.resize_per_segment_(4 << 20, zero_new=True)
        view = buf.segment_view(0).view("float32")
        for _ in range(3000):
            jax.dlpack.from_dlpack(view)   # each import ends in the capsule's deleter
        array = view.to_jax()
        ptr = array.unsafe_buffer_pointer()
        step = jax.jit(lambda x: x + 1, donate_argnums=0)
        out = step(array)                  # JAX may call the deleter early here
        out.block_until_ready()
        print(float(out.sum()) == out.size, ptr == buf.base_ptr)
        buf.free()
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"]


def test_views_alive_at_exit_on_the_gpu():
    result = _run(
        """
        import torch, jax, jaxbuf
        buf = jaxbuf.ExtensibleTensor(8 << 20, device="cuda:0")
        buf.resize_per_segment_(2 << 20, zero_new=True)
        keep = [buf.segment_view(0).to_torch(), buf.segment_view(0).to_jax(),
                buf.full_view().__dlpack__()]
        keep[0].fill_(1)
        torch.cuda.synchronize()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
