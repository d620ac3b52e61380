"""Which platform a device spec of None means, without an import circle.

:func:`jaxbuf.devices.default_device` needs to know whether CUDA works here, which only the
drivers can say; but devices may not import drivers (drivers sit at the bottom and parse no
device specs, devices are plain values above nothing). So the question lives here, below
both: the drivers package registers its probe when it is imported
(:func:`jaxbuf.drivers.default_platform`), and ``default_device`` asks it. Importing
``jaxbuf`` imports the drivers package, so the probe is always registered before a caller can
reach ``default_device``.

A leaf module: it imports nothing of jaxbuf.
"""

from __future__ import annotations

from collections.abc import Callable

_probe: Callable[[], str] | None = None


def set_default_platform_probe(probe: Callable[[], str]) -> None:
    """Install ``probe``: a function returning the platform of the default device."""
    global _probe
    _probe = probe


def default_platform() -> str:
    """The platform of the default device (``"cuda"`` when CUDA works here, else ``"cpu"``)."""
    probe = _probe
    if probe is None:  # only when jaxbuf.drivers was never imported, which `import jaxbuf` does
        raise RuntimeError(
            "no platform probe is registered: import jaxbuf (or jaxbuf.drivers) first"
        )
    return probe()
