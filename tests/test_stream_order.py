"""Every export orders its consumer after the producer's pending writes (CUDA).

The producer's last writes are a staged apply enqueued on a non-blocking torch stream behind
a long device sleep, so a consumer that is not ordered after them reads the old bytes. Each
export path of the DLPack standard is checked: the consumer's own stream, ``stream=1``,
``stream=None`` (the standard's legacy default stream), ``copy=True`` (jaxbuf's copy runs on
the default stream), ``dl_device=(kDLCPU, 0)`` (the host reads), and the adapters. The upstream
suites (array API's ``test_dlpack``, torch's ``test_dlpack``, CuPy's) check the same orderings
against their own producers; this runs them against jaxbuf's.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxbuf import StagedWriteTensor
from jaxbuf.drivers.base import K_DL_CPU

pytestmark = pytest.mark.gpu

ROWS, COLS = 4, 4096
SLEEP_CYCLES = 200_000_000  # about 0.1 s of device time: far longer than any export takes


class _Capsule:
    """Hands a prepared capsule to a consumer that takes only objects with ``__dlpack__``."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


@pytest.fixture
def pending():
    """A CUDA StagedWriteTensor whose write of row 1 is still pending on a side stream when
    the test exports it; yields ``(tensor, expected row)``."""
    torch = pytest.importorskip("torch")
    swt = StagedWriteTensor((ROWS, COLS), "float32", device="cuda")
    try:
        values = np.arange(1, COLS + 1, dtype=np.float32)
        swt.stage_write(1, 0, values)
        side = torch.cuda.Stream()  # torch's streams are non-blocking: no implicit order
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            swt.apply_write()
        yield swt, values
        torch.cuda.synchronize()
    finally:
        swt.close()


def _read_torch(capsule):
    import torch

    return torch.from_dlpack(capsule)[1].cpu().numpy()  # on torch's current (legacy) stream


def test_consumer_stream(pending):
    import torch

    swt, values = pending
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        got = _read_torch(swt.gpu.__dlpack__(stream=consumer.cuda_stream))
    np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize("stream", [1, None], ids=["stream=1", "stream=None"])
def test_default_stream(pending, stream):
    swt, values = pending
    np.testing.assert_array_equal(_read_torch(swt.gpu.__dlpack__(stream=stream)), values)


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_copy(pending, max_version):
    swt, values = pending
    capsule = swt.gpu.__dlpack__(stream=None, copy=True, max_version=max_version)
    np.testing.assert_array_equal(_read_torch(capsule), values)


def test_copy_to_host(pending):
    swt, values = pending
    capsule = swt.gpu.__dlpack__(dl_device=(K_DL_CPU, 0), max_version=(1, 0))
    got = np.from_dlpack(_Capsule(capsule, (K_DL_CPU, 0)))
    np.testing.assert_array_equal(got[1], values)


def test_numpy_from_dlpack_to_host(pending):
    swt, values = pending
    got = np.from_dlpack(swt.gpu, device="cpu")
    np.testing.assert_array_equal(got[1], values)


def test_to_torch(pending):
    swt, values = pending
    np.testing.assert_array_equal(swt.gpu.to_torch()[1].cpu().numpy(), values)


def test_to_jax(pending):
    pytest.importorskip("jax")
    swt, values = pending
    np.testing.assert_array_equal(np.asarray(swt.gpu.to_jax())[1], values)


def test_uva_target_read_on_the_host():
    """A pinned target (``uva_instead_of_gpu``) read in place by the host waits too."""
    torch = pytest.importorskip("torch")
    swt = StagedWriteTensor((ROWS, COLS), "float32", device="cuda", uva_instead_of_gpu=True)
    try:
        values = np.arange(COLS, dtype=np.float32) + 7
        swt.stage_write(2, 0, values)
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(SLEEP_CYCLES)
            swt.apply_write()
        capsule = swt.gpu.__dlpack__(dl_device=(K_DL_CPU, 0), max_version=(1, 0))
        host = np.from_dlpack(_Capsule(capsule, (K_DL_CPU, 0)))
        np.testing.assert_array_equal(host[2], values)
        del host
    finally:
        torch.cuda.synchronize()
        swt.close()
