"""The copies of one block transfer on the same-host transport, in as few calls as possible.

``driver.copy_batch`` is one call for a whole list, but on CUDA ``cuMemcpyBatchAsync`` submits
each copy on its own (about 5 us apiece on an H200): right for a few small copies, slow for
hundreds of blocks. A list of more than :data:`FEW_COPIES` copies is therefore moved by one
launch of :mod:`jaxbuf.kernels.block_copy`, after an upload of its three columns from pinned
host memory on the same stream. A few copies, however large, stay with the driver (one
64 MiB block between two processes of an H200: 87 us through the driver, 127 us through the
kernel, whose table upload and launch cost more than they save there). On the CPU every
list goes to ``copy_batch`` (a ``memmove`` loop in C).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np

__all__ = ["BlockCopier"]

_log = logging.getLogger(__name__)
FEW_COPIES = 8
"""Lists of at most this many copies go to ``driver.copy_batch`` on CUDA too."""
_SLOTS = 4  # piece tables in flight at once; a fifth launch waits for the first's kernel
_STREAM = 2  # the DLPack number of the per-thread default stream, copy_batch's stream too


class BlockCopier:
    """Copies ``(dsts, srcs, sizes)`` lists for one device; :meth:`copy` returns what
    ``driver.copy_batch`` returns (None on the CPU, an event on CUDA).

    Invariants: a piece table slot is rewritten only once the kernel that read it has
    finished (its guard event); :meth:`close` waits for every slot and frees them. The kernel
    path is dropped for good (with the reason in :attr:`kernel_unavailable`) the first time it
    cannot be compiled or launched: copies then go to ``copy_batch``.
    """

    def __init__(self, driver: Any, device: Any) -> None:
        self.driver, self.device_index = driver, device.index
        self.kernel_unavailable: str | None = None if device.is_cuda else "not a CUDA device"
        self._launch: Any = None
        # [pinned host address, device table (DeviceMemory), rows, guard event or None].
        self._slots: list[list[Any]] = []
        self._next = 0

    def copy(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, *, aligned: bool = False
    ) -> Any:
        """Copy the list; ``aligned``: the caller knows every address and size is a multiple
        of the kernel's alignment (else it is checked here)."""
        if self.kernel_unavailable is None and len(sizes) > FEW_COPIES:
            from jaxbuf.kernels.block_copy import ALIGNMENT

            if aligned or not ((dsts | srcs | sizes) & np.uint64(ALIGNMENT - 1)).any():
                try:
                    return self._launch_kernel(dsts, srcs, sizes, int(sizes.max()))
                except Exception as error:  # noqa: BLE001 - falls back, reason kept, logged
                    self.kernel_unavailable = f"{type(error).__name__}: {error}"
                    _log.warning("jaxbuf: block copy kernel unavailable (%s)", error)
        return self.driver.copy_batch(dsts, srcs, sizes, self.device_index)

    def _launch_kernel(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, largest: int
    ) -> Any:
        from jaxbuf.kernels.block_copy import launcher

        if self._launch is None:
            self._launch = launcher(self.driver, self.device_index)
        count = len(sizes)
        slot = self._slot(count)
        column = count * 8
        for i, array in enumerate((dsts, srcs, sizes)):  # the three columns, one after another
            ctypes.memmove(slot[0] + i * column, array.ctypes.data, column)
        driver, index, device_table = self.driver, self.device_index, slot[1].ptr
        # Raw handle 2 is CU_STREAM_PER_THREAD, the stream the events are recorded on.
        self._launch(
            count, largest, _STREAM, device_table, copy=(device_table, slot[0], 3 * column)
        )
        slot[3] = driver.record_event(_STREAM, index)  # the slot's guard
        return driver.record_event(_STREAM, index)  # the transfer's, destroyed when it ends

    def _slot(self, rows: int) -> list[Any]:
        """The next table slot, for at least ``rows`` copies, once no kernel reads it."""
        driver = self.driver
        if len(self._slots) < _SLOTS:
            self._slots.append([0, None, 0, None])
        slot = self._slots[self._next % _SLOTS]
        self._next += 1
        guard, slot[3] = slot[3], None
        if guard is not None:
            driver.event_synchronize(guard)
            driver.destroy_event(guard)
        if slot[2] < rows:
            self._free(slot)
            capacity = max(rows, 1024)
            slot[0], _ = driver.host_alloc(capacity * 24, self.device_index)
            slot[1] = driver.device_alloc(capacity * 24, self.device_index)
            slot[2] = capacity
        return slot

    def _free(self, slot: list[Any]) -> None:
        """Free the slot's tables, each forgotten once freed."""
        if slot[1] is not None:
            slot[1].release()
            slot[1] = None
        if slot[0]:
            self.driver.host_free(slot[0])
            slot[0] = 0
        slot[2] = 0

    def close(self) -> None:
        """Wait for the kernels still reading a table, free the tables. Safe to call twice."""
        while self._slots:  # a slot is forgotten only once freed: an interrupted close resumes
            slot = self._slots[-1]
            if slot[3] is not None:
                self.driver.event_synchronize(slot[3])
                self.driver.destroy_event(slot[3])
                slot[3] = None
            self._free(slot)
            self._slots.pop()
