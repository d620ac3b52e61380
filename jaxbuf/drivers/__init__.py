"""Platform drivers behind one seam: :class:`VmmDriver`.

:func:`get_vmm_driver` returns the shared driver of a device's platform: the CPU driver
(:class:`HostVmmDriver`, ``mmap``/``memfd``) or the CUDA driver (``CudaVmmDriver``, imported
only when asked for, since it needs ``cuda-bindings``).

The drivers are the bottom layer: this package imports nothing of jaxbuf above it (no
``jaxbuf.devices``, views or frameworks). So :func:`get_vmm_driver` takes a device as a
:class:`jaxbuf.devices.Device` (anything with ``platform`` and ``index``) or a
``"platform[:index]"`` string; other spellings (an int, a ``torch.device``, a ``jax.Device``)
go through :func:`jaxbuf.as_device` first, as :func:`jaxbuf._resolve.resolve` does for every
public entry point. The package registers :func:`default_platform` as the probe behind
:func:`jaxbuf.devices.default_device` (see :mod:`jaxbuf._platforms`).

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

from jaxbuf import _platforms
from jaxbuf.drivers.base import (
    K_DL_CPU,
    K_DL_CUDA,
    K_DL_CUDA_HOST,
    K_DL_ROCM,
    K_DL_ROCM_HOST,
    DriverError,
    VmmDriver,
    out_of_memory_hooks,
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
    "default_platform",
    "driver_for_platform",
    "get_vmm_driver",
    "out_of_memory_hooks",
]

_CUDA_BINDINGS_MISSING = "cuda-bindings is not installed (pip install jaxbuf[cuda])"
_PLATFORM_ALIASES = {"gpu": "cuda"}  # JAX calls CUDA devices "gpu"


@functools.cache
def driver_for_platform(platform: str) -> VmmDriver:
    """The one driver instance per platform (a cache: drivers hold no settings); ValueError
    for an unknown platform. Does not check that the driver works here."""
    if platform == "cpu":
        return HostVmmDriver()
    if platform == "cuda":
        from jaxbuf.drivers.cuda import CudaVmmDriver

        return CudaVmmDriver()
    raise ValueError(f"no driver for platform {platform!r}; expected 'cpu' or 'cuda'")


def _platform_and_index(device: Any) -> tuple[str, int]:
    """``(platform, index)`` of a Device-like object, a ``"platform[:index]"`` string or None
    (the default device); TypeError / ValueError naming anything else."""
    if device is None:
        return default_platform(), 0
    if isinstance(device, str):
        platform, _, index_text = device.strip().lower().partition(":")
        if index_text and not index_text.isdigit():
            raise ValueError(f"bad device index in {device!r}")
        return _PLATFORM_ALIASES.get(platform, platform), int(index_text or 0)
    platform, index = getattr(device, "platform", None), getattr(device, "index", None)
    if isinstance(platform, str) and isinstance(index, int) and not isinstance(index, bool):
        return platform, index
    raise TypeError(
        f"device must be a jaxbuf Device or a 'platform[:index]' string, got {device!r}; "
        "convert other device specs with jaxbuf.as_device first"
    )


def get_vmm_driver(device: Any = None) -> VmmDriver:
    """Return the driver for ``device``: a :class:`jaxbuf.devices.Device`, a ``"cpu"`` /
    ``"cuda"`` / ``"cuda:N"`` string, or None (the default device: CUDA device 0 when CUDA
    works here, else the CPU).

    Raises ``RuntimeError`` (with the driver's reason) when the platform's driver cannot run
    here, ``ValueError`` for an unknown platform or a device index the driver lacks, and
    ``TypeError`` for another kind of spec (pass it through :func:`jaxbuf.as_device`).
    """
    platform, index = _platform_and_index(device)
    driver = driver_for_platform(platform)
    name = platform if platform == "cpu" and index == 0 else f"{platform}:{index}"
    reason = driver.unavailable_reason()
    if reason is not None:
        hint = (
            ' Use device="cpu": the CPU driver runs the same API on any Linux machine.'
            if platform != "cpu"
            else ""
        )
        raise RuntimeError(f"device {name} is unavailable: {reason}{hint}")
    count = driver.device_count()
    if not 0 <= index < count:
        raise ValueError(f"no device {name}: the {platform} driver sees {count} device(s)")
    return driver


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA driver works here, else one sentence saying why not."""
    try:
        import cuda.bindings  # noqa: F401  (probe only; the driver imports what it needs)
    except ImportError:
        return _CUDA_BINDINGS_MISSING
    return driver_for_platform("cuda").unavailable_reason()


def default_platform() -> str:
    """``"cuda"`` when the CUDA driver works here, else ``"cpu"``: the platform of
    :func:`jaxbuf.devices.default_device`."""
    return "cpu" if cuda_unavailable_reason() else "cuda"


_platforms.set_default_platform_probe(default_platform)
