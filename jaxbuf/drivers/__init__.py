"""Platform drivers behind one seam: :class:`VmmDriver`.

:func:`get_vmm_driver` returns the shared driver of a device's platform: the CPU driver
(:class:`HostVmmDriver`, ``mmap``/``memfd``) or the CUDA driver (``CudaVmmDriver``, imported
only when asked for, since it needs ``cuda-bindings``).

Examples
--------
>>> from jaxbuf.drivers import get_vmm_driver
>>> driver = get_vmm_driver("cpu")
>>> ptr = driver.reserve(1 << 20)
>>> driver.free_reserved(ptr, 1 << 20)
"""

from __future__ import annotations

import functools
from typing import Any

from jaxbuf.drivers.base import (
    K_DL_CPU,
    K_DL_CUDA,
    K_DL_CUDA_HOST,
    K_DL_ROCM,
    K_DL_ROCM_HOST,
    DriverError,
    VmmDriver,
)
from jaxbuf.drivers.host import HostVmmDriver

__all__ = [
    "K_DL_CPU",
    "K_DL_CUDA",
    "K_DL_CUDA_HOST",
    "K_DL_ROCM",
    "K_DL_ROCM_HOST",
    "DriverError",
    "HostVmmDriver",
    "VmmDriver",
    "cuda_unavailable_reason",
    "get_vmm_driver",
]

_CUDA_BINDINGS_MISSING = "cuda-bindings is not installed (pip install jaxbuf[cuda])"


@functools.lru_cache(maxsize=None)
def _driver_for_platform(platform: str) -> VmmDriver:
    """The one driver instance per platform (a cache: drivers hold no settings)."""
    if platform == "cpu":
        return HostVmmDriver()
    if platform == "cuda":
        from jaxbuf.drivers.cuda import CudaVmmDriver

        return CudaVmmDriver()
    raise ValueError(f"no driver for platform {platform!r}; expected 'cpu' or 'cuda'")


def get_vmm_driver(device: Any = None) -> VmmDriver:
    """Return the driver for ``device`` (any spec :func:`jaxbuf.devices.as_device` accepts;
    None means :func:`jaxbuf.devices.default_device`).

    Raises ``RuntimeError`` (with the driver's reason) when the platform's driver cannot run
    here, and ``ValueError`` for an unknown platform or a device index the driver lacks.
    """
    from jaxbuf.devices import as_device, default_device

    device = default_device() if device is None else as_device(device)
    driver = _driver_for_platform(device.platform)
    reason = driver.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"device {device} is unavailable: {reason}")
    count = driver.device_count()
    if not 0 <= device.index < count:
        raise ValueError(f"no device {device}: the {device.platform} driver sees {count} device(s)")
    return driver


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA driver works here, else one sentence saying why not."""
    try:
        import cuda.bindings  # noqa: F401  (probe only; the driver imports what it needs)
    except ImportError:
        return _CUDA_BINDINGS_MISSING
    return _driver_for_platform("cuda").unavailable_reason()
