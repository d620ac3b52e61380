"""Registrations that follow a growing buffer, and KV-cache block transfers, over NIXL.

NIXL is optional (``pip install 'jaxbuf[nixl]'``): this package imports without it, and the
first :class:`Agent` names the extra to install when NIXL is missing.

* :class:`Registration` registers an :class:`~jaxbuf.ExtensibleTensor`'s chunks with an
  agent and follows the buffer: a grow registers only what it mapped, ``release_physical``,
  ``defragment`` and ``free`` deregister before they unmap, a recommit registers again.
* :class:`KVEndpoint` moves lists of block ids of a :class:`KVLayout` between two endpoints
  (``read`` / ``write``), with prepared descriptor lists refreshed when either side grows,
  descriptors split at registration boundaries, notifications and waits with a timeout.
* :meth:`KVEndpoint.metadata` / :meth:`KVEndpoint.connect` exchange a versioned, validated
  layout message, again after growth.

Examples
--------
Two endpoints in one process (two processes exchange ``metadata()`` the same way):

>>> import jaxbuf, numpy as np
>>> from jaxbuf.transfer import Agent, KVEndpoint, KVLayout
>>> a, b = jaxbuf.ExtensibleTensor(8 << 20, "cpu"), jaxbuf.ExtensibleTensor(8 << 20, "cpu")
>>> a.resize_per_segment_(2 << 20); b.resize_per_segment_(2 << 20)
>>> ea = KVEndpoint(Agent("doc-a"), a, KVLayout(4096))  # doctest: +SKIP
"""

from jaxbuf.transfer._endpoint import KVEndpoint, KVLayout, Peer, Transfer, TransferError
from jaxbuf.transfer._nixl import Agent, NixlUnavailable, load_nixl
from jaxbuf.transfer._registration import Registration, TransferInFlight
from jaxbuf.transfer._wire import RemoteLayout

__all__ = [
    "Agent",
    "KVEndpoint",
    "KVLayout",
    "NixlUnavailable",
    "Peer",
    "Registration",
    "RemoteLayout",
    "Transfer",
    "TransferError",
    "TransferInFlight",
    "load_nixl",
]
