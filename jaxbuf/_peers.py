"""Peer devices of a buffer: the specs a caller names, checked before any grant (one platform,
not the owner, existing, able to reach the owner's memory). No driver state changes here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxbuf.devices import Device, as_device
from jaxbuf.drivers.base import VmmDriver

__all__ = ["check_peers", "parse_peer_specs"]


def parse_peer_specs(peers: Any, owner_platform: str | None) -> list[Device]:
    """Device specs -> Devices, without touching a driver: a single spec or an iterable of
    them; TypeError / ValueError naming a bad spec, a platform other than the owner's
    (when known) or a duplicate."""
    if isinstance(peers, (str, bytes)) or not isinstance(peers, Iterable):
        peers = [peers]
    parsed: list[Device] = []
    for spec in peers:
        peer = as_device(spec)
        if owner_platform is not None and peer.platform != owner_platform:
            raise ValueError(
                f"peer device {peer} is not on the owner's platform {owner_platform!r}"
            )
        if peer in parsed:
            raise ValueError(f"peer device {peer} is given twice")
        parsed.append(peer)
    return parsed


def check_peers(peers: list[Device], device: Device, driver: VmmDriver) -> None:
    """Each peer is distinct from ``device``, exists, and can access its memory."""
    count = driver.device_count()
    for peer in peers:
        if peer.platform != device.platform:
            raise ValueError(
                f"peer device {peer} is not on the owner's platform {device.platform!r}"
            )
        if peer == device:
            raise ValueError(f"peer device {peer} is the owner device itself")
        if not 0 <= peer.index < count:
            raise ValueError(
                f"peer device {peer} is out of range: {count} {device.platform} device(s) available"
            )
    for peer in peers:
        if not driver.can_access_peer(peer.index, device.index):
            raise ValueError(
                f"peer device {peer} cannot access memory on {device} (no peer-to-peer "
                "support between them: cuDeviceCanAccessPeer says no)"
            )
