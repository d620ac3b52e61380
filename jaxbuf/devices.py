"""Parse the many spellings of a device into one :class:`Device` value.

Accepted: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an ``int`` (a CUDA index), a ``torch.device``, a
``jax.Device`` and a :class:`Device`. Parsing needs no framework: torch and JAX objects are
recognised by their attributes. Whether the device exists is the driver's question, asked by
:func:`jaxbuf.drivers.get_vmm_driver` and the buffers.

Devices are plain values at the bottom of the import graph: this module imports no driver
(:func:`default_device` asks the probe the drivers register in :mod:`jaxbuf._platforms`) and
no framework (:meth:`Device.torch` / :meth:`Device.jax` ask the framework adapters of
:mod:`jaxbuf.interop`, imported when called).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from . import _platforms

__all__ = ["PLATFORMS", "Device", "DeviceLike", "as_device", "default_device"]

PLATFORMS = ("cpu", "cuda")
_ALIASES = {"gpu": "cuda"}  # JAX calls CUDA devices "gpu"


@dataclass(frozen=True)
class Device:
    """A platform and an index: ``Device("cuda", 0)``, ``Device("cpu", 0)``."""

    platform: str
    index: int = 0

    def __str__(self) -> str:
        return self.platform if self.platform == "cpu" else f"{self.platform}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.platform == "cuda"

    def torch(self) -> Any:
        """This device as a ``torch.device`` (through the torch adapter)."""
        from . import interop

        return interop.get("torch").device(self)

    def jax(self) -> Any:
        """This device as a ``jax.Device``, the JAX device with this local index (through the
        JAX adapter; ValueError when JAX has no such device)."""
        from . import interop

        return interop.get("jax").device(self)


if TYPE_CHECKING:  # the framework types, for type checkers only: no framework is imported
    import jax
    import torch

    DeviceLike: TypeAlias = str | int | Device | torch.device | jax.Device
else:
    DeviceLike: TypeAlias = str | int | Device | Any
#: What a ``device=`` argument accepts: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (``"gpu"`` too), an
#: ``int`` (a CUDA index), a :class:`Device`, a ``torch.device`` or a ``jax.Device``
#: (recognised by their attributes, so no framework is imported). ``device=None`` means
#: :func:`default_device`. Parsed by :func:`as_device`.


def _parse_string(spec: str) -> Device:
    platform, _, index_text = spec.strip().lower().partition(":")
    platform = _ALIASES.get(platform, platform)
    if platform not in PLATFORMS:
        raise ValueError(f"unknown device {spec!r}; expected 'cpu', 'cuda' or 'cuda:N'")
    if not index_text:
        return Device(platform, 0)
    # isdigit() accepts digits int() refuses ('²'): ASCII digits only.
    if not (index_text.isascii() and index_text.isdigit()):
        raise ValueError(f"bad device index in {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    return Device(platform, int(index_text))


def as_device(spec: Any) -> Device:
    """Return the :class:`Device` named by ``spec`` or raise ``ValueError``/``TypeError``.

    Examples
    --------
    >>> as_device("cuda:1")
    Device(platform='cuda', index=1)
    >>> as_device("cpu")
    Device(platform='cpu', index=0)
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, str):
        return _parse_string(spec)
    if isinstance(spec, bool) or spec is None:
        raise TypeError(f"device must be a str, int, torch.device or jax.Device, got {spec!r}")
    if hasattr(spec, "__index__"):
        index = operator.index(spec)
        if index < 0:
            raise ValueError(f"device index must be non-negative, got {index}")
        return Device("cuda", index)
    # torch.device: .type and .index (None for "current").
    kind = getattr(spec, "type", None)
    if isinstance(kind, str) and hasattr(spec, "index"):
        device = _parse_string(kind)
        return device if spec.index is None else Device(device.platform, spec.index)
    # jax.Device: .platform ("cpu"/"gpu") and .id (global) / .local_hardware_id.
    platform = getattr(spec, "platform", None)
    if isinstance(platform, str):
        device = _parse_string(platform)
        local_id = getattr(spec, "local_hardware_id", None)
        index = local_id if isinstance(local_id, int) else getattr(spec, "id", 0)
        return Device(device.platform, 0 if device.platform == "cpu" else index)
    raise TypeError(f"device must be a str, int, torch.device or jax.Device, got {spec!r}")


def default_device() -> Device:
    """CUDA device 0 when the CUDA driver works here, else the CPU (the drivers' probe, see
    :mod:`jaxbuf._platforms`)."""
    return Device(_platforms.default_platform(), 0)
