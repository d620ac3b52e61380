"""Launching a packed apply: the three kernel launchers, the stream, and the applied event.

A :class:`~jaxbuf.FusedStagedWriter` picks one launcher when it is made (:func:`make_launcher`);
every launcher has the one signature::

    launch(args: StagedLaunch, raw_stream: int, tables=None, copy=None)

``args`` is a :class:`jaxbuf.kernels.StagedLaunch` (the device-visible addresses of the write
table, the group table and the values, and the write count); ``tables`` the numpy views of the
two tables, which only the host launchers read.

* ``numpy``: :func:`jaxbuf.kernels.apply_staged_writes_numpy` on the host tables (CPU only,
  chosen explicitly with ``backend="numpy"``);
* interpreted: the Triton kernel under Triton's interpreter (the CPU with ``backend="triton"``);
* compiled: :class:`jaxbuf.kernels.staged_write.CompiledLauncher`, the cached compiled kernel
  launched on a raw CUDA stream: the context check, ``copy`` (the slot's device copy) and
  ``cuLaunchKernel`` with a prepacked argument buffer in one call through the driver seam
  (:meth:`~jaxbuf.drivers.base.VmmDriver.copy_and_launch`), or Triton's launcher where that
  is unavailable (its ``fallback_reason`` says why). ``copy`` is CUDA's only; the host
  launchers never get one.

Every launch is parallel, one program per write: the C stager resolves overlapping writes when
the tables are packed (later wins, the earlier writes trimmed to their visible pieces), so the
writes of one launch are pairwise disjoint and run in any order. The kernel's ``SERIAL`` mode
(:func:`jaxbuf.kernels.apply_staged_writes` with ``serial=True``) stays with the kernel, for
the baseline that measures the overlap handling before resolution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import interop
from ..devices import Device
from ..drivers.base import VmmDriver
from ..uva._slots import DeviceEvent

__all__ = ["AppliedEvent", "BLOCK_SIZE", "make_launcher", "raw_stream"]

BLOCK_SIZE = 1024  # elements one kernel program copies per step; longer writes loop

Launcher = Callable[..., None]


def make_launcher(backend: str, device: Device, driver: VmmDriver | None = None) -> Launcher:
    """The launcher for ``backend`` (checked by the caller) on ``device``; on CUDA it launches
    through ``driver`` (default: the device's shared driver)."""
    if backend == "numpy":
        from ..kernels import apply_staged_writes_numpy

        def launch_numpy(args, raw_stream, tables=None, copy=None):
            apply_staged_writes_numpy(tables[0], tables[1], args.contents, args.num_writes)

        return launch_numpy
    if not device.is_cuda:
        from ..kernels import apply_staged_writes

        def launch_interpreted(args, raw_stream, tables=None, copy=None):
            write_table, group_table, contents, num_writes = args
            apply_staged_writes(
                write_table,
                group_table,
                contents,
                num_writes,
                block_size=BLOCK_SIZE,
                interpret=True,
            )

        return launch_interpreted
    from ..kernels.staged_write import CompiledLauncher

    return CompiledLauncher(device.index, block_size=BLOCK_SIZE, driver=driver)


def raw_stream(stream: Any, device: Device) -> int:
    """The CUDA stream handle to launch on: ``stream``'s, or the current stream of the loaded
    framework that has one (torch's: :func:`jaxbuf.interop.current_stream`), 0 for the legacy
    default stream."""
    if stream is None:
        dlpack_stream = interop.current_stream(device)
        # DLPack numbers the legacy default stream 1; CUDA's handle for it is 0. Any other
        # number (2, the per-thread stream, or a handle) is the CUDA handle itself.
        return 0 if dlpack_stream == interop.DLPACK_LEGACY_STREAM else dlpack_stream
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(
            f"stream must be a torch.cuda.Stream or a CUDA stream handle, got {stream!r}"
        )
    return handle


#: The driver event recorded after one apply's launch, on its DLPack stream: shared by the
#: tensors the launch wrote (their ready event) and the staging slot it read (the slot's guard
#: in the writer's :class:`~jaxbuf.uva._slots.PinnedSlotRing`); destroyed when the last of
#: them lets go.
AppliedEvent = DeviceEvent
