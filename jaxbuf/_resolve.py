"""One ``resolve(device, driver)`` for every public entry point that takes both.

Devices and drivers do not import each other (drivers are the bottom layer and parse no device
specs); this module sits above both and joins them: any device spec
(:func:`jaxbuf.as_device`) plus an optional driver become a checked ``(Device, VmmDriver)``.
"""

from __future__ import annotations

from typing import Any

from jaxbuf.devices import Device, as_device, default_device
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import VmmDriver

__all__ = ["resolve"]


def resolve(device: Any, driver: VmmDriver | None) -> tuple[Device, VmmDriver]:
    """``(Device, VmmDriver)`` for a device spec and an optional driver, checked.

    ``device`` None means the driver's platform (device 0) when a driver is given, else
    :func:`jaxbuf.default_device`. ``driver`` None means the device's shared driver
    (:func:`jaxbuf.drivers.get_vmm_driver`: ``RuntimeError`` when it cannot run here).
    Raises ``TypeError`` for a driver that is not a :class:`VmmDriver` and ``ValueError`` when
    the device's platform is not the driver's or its index is out of the driver's range.
    """
    if device is None:
        device = default_device() if driver is None else Device(driver.platform, 0)
    else:
        device = as_device(device)
    if driver is None:
        return device, get_vmm_driver(device)
    if not isinstance(driver, VmmDriver):
        raise TypeError(f"driver must be a VmmDriver, got {driver!r}")
    if driver.platform != device.platform:
        raise ValueError(
            f"device {device} does not match the driver's platform {driver.platform!r}"
        )
    count = driver.device_count()
    if not 0 <= device.index < count:
        reason = driver.unavailable_reason()
        detail = f" ({reason})" if reason else ""
        raise ValueError(
            f"device {device} is out of range: {count} {device.platform} device(s)"
            f" available{detail}"
        )
    return device, driver
