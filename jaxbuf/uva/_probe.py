"""Whether a device gets UVA buffers (:class:`~jaxbuf.uva.UvaBuffer`): the aliasing probe,
cached per device. A pool without an explicit ``buffer_cls`` asks it, and falls back to
:class:`~jaxbuf.uva.NonUvaBuffer` (explicit copies) with the reason logged.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from ..devices import Device, as_device, default_device
from ..drivers import DriverError, get_vmm_driver
from ..drivers.base import VmmDriver


# -- the probe ----------------------------------------------------------------------------
def uva_unavailable_reason(device: Any = None) -> str | None:
    """None when :class:`UvaBuffer` works on ``device``, else one sentence saying why not.

    Cached per device. UVA is unavailable when the device's driver is, when the GPU runs in
    confidential-computing mode (the device then reads garbage from pinned host memory, as
    vLLM found), when pinned allocation fails, or when the device view does not alias the
    host memory (a byte pattern written through one is not read back through the other).
    """
    return _uva_unavailable_reason(default_device() if device is None else as_device(device))


def is_uva_available(device: Any = None) -> bool:
    """True when :func:`uva_unavailable_reason` is None for ``device``."""
    return uva_unavailable_reason(device) is None


@functools.cache
def _uva_unavailable_reason(device: Device) -> str | None:
    try:
        driver = get_vmm_driver(device)
    except (RuntimeError, ValueError) as error:
        return str(error)
    probe = getattr(driver, "confidential_computing_reason", None)
    reason = probe() if probe is not None else None
    if reason is not None:
        return reason
    return _probe_aliasing(driver, device.index)


def _probe_aliasing(driver: VmmDriver, device_index: int, size: int = 4096) -> str | None:
    """Write through the host pointer, read through the device pointer (and back).

    Both blocks are zeroed before they are freed: the pinned allocator may hand them out
    again as they are, and the probe's patterns must not show through there."""
    try:
        host_ptr, device_ptr = driver.host_alloc(size, device_index)
    except DriverError as error:
        return f"pinned host allocation failed: {error}"
    try:
        check_ptr, _ = driver.host_alloc(size, device_index)
    except DriverError as error:
        driver.host_free(host_ptr)
        return f"pinned host allocation failed: {error}"
    try:
        host = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(host_ptr))
        check = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(check_ptr))
        pattern = (np.arange(size, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)
        host[:] = pattern
        check[:] = ~pattern
        driver.copy(check_ptr, device_ptr, size, device_index)  # read through the device
        driver.synchronize(device_index)
        if not np.array_equal(check, pattern):
            return "the device view of pinned host memory does not alias it (read mismatch)"
        driver.memset(device_ptr, 0x5A, size, device_index)  # write through the device
        driver.synchronize(device_index)
        if not (host == 0x5A).all():
            return "the device view of pinned host memory does not alias it (write mismatch)"
    except DriverError as error:
        return f"access to pinned host memory through its device pointer failed: {error}"
    finally:
        ctypes.memset(check_ptr, 0, size)
        ctypes.memset(host_ptr, 0, size)
        driver.host_free(check_ptr)
        driver.host_free(host_ptr)
    return None
