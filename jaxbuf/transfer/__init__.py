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

>>> import jaxbuf
>>> from jaxbuf.transfer import Agent, KVEndpoint, KVLayout
>>> a = jaxbuf.ExtensibleTensor(8 << 20, "cpu"); a.resize_per_segment_(2 << 20)
>>> b = jaxbuf.ExtensibleTensor(8 << 20, "cpu"); b.resize_per_segment_(2 << 20)
>>> ea = KVEndpoint(Agent("doc-a"), a, KVLayout(4096))
>>> eb = KVEndpoint(Agent("doc-b"), b, KVLayout(4096))
>>> a.segment_view(0).to_numpy()[:4096] = 7
>>> ea.write(ea.connect(eb.metadata()), [0], [3]).wait(timeout=30)
>>> int(eb.block_view(0, 3).to_numpy()[0])
7
>>> ea.close(); eb.close(); a.free(); b.free()
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
