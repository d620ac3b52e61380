"""KV-cache block transfers between processes, over two transports, and registrations that
follow a growing buffer.

* :class:`KVEndpoint` moves lists of block ids of a :class:`KVLayout` between two endpoints
  (``read`` / ``write``, notifications, waits with a timeout). Each peer gets a transport
  when it connects (``transport=`` :data:`TRANSPORTS`): the **same-host transport** for a peer
  on this host under this uid (it serves its chunks as POSIX descriptors on an abstract Unix
  socket, this side maps them through :mod:`jaxbuf.sharing`, and a transfer is one driver
  copy of the whole list: :mod:`jaxbuf.transfer._local`, :mod:`jaxbuf.transfer._device_copy`),
  or **NIXL** between hosts (prepared descriptor lists refreshed when either side grows,
  descriptors split at registration boundaries). ``jaxbuf info`` says which a transfer would
  take here.
* :class:`KVCacheEndpoint` does the same for a whole :class:`~jaxbuf.ExtensibleKVCacheBuffers`:
  one request of block ids moves those blocks in every KV-cache tensor (one
  :class:`KVEndpoint` per tensor, each with its ``bytes_per_block_per_segment``), following
  the cache's ``commit``, ``release_physical``, ``recommit`` and ``defragment=True``.
* :class:`Registration` registers an :class:`~jaxbuf.ExtensibleTensor`'s chunks with a NIXL
  agent and follows the buffer: a grow registers only what it mapped, ``release_physical``,
  ``defragment`` and ``free`` deregister before they unmap, a recommit registers again; with
  no agent it only tracks the transfers in flight over the memory.
* :meth:`KVEndpoint.metadata` / :meth:`KVEndpoint.connect` exchange a versioned, validated
  layout message (:mod:`jaxbuf.transfer._wire`), again after growth, release or defragment.

NIXL is optional (``pip install 'jaxbuf[nixl]'``): this package imports without it, an
endpoint made with a name rather than an :class:`Agent` uses the same-host transport only,
and the first :class:`Agent` names the extra to install when NIXL is missing.

Examples
--------
Two endpoints in one process (two processes exchange ``metadata()`` the same way):

>>> import jaxbuf
>>> from jaxbuf.transfer import Agent, KVEndpoint, KVLayout
>>> a = jaxbuf.ExtensibleTensor(8 << 20, "cpu"); a.resize_per_segment_(2 << 20)
>>> b = jaxbuf.ExtensibleTensor(8 << 20, "cpu"); b.resize_per_segment_(2 << 20)
>>> ea = KVEndpoint("doc-a", a, KVLayout(4096))  # a name: the same-host transport only
>>> eb = KVEndpoint("doc-b", b, KVLayout(4096))  # (an Agent("doc-b") would add NIXL)
>>> a.segment_view(0).to_numpy()[:4096] = 7
>>> peer = ea.connect(eb.metadata())
>>> peer.transport
'local'
>>> ea.write(peer, [0], [3]).wait(timeout=30)
>>> int(eb.block_view(0, 3).to_numpy()[0])
7
>>> ea.close(); eb.close(); a.free(); b.free()
"""

from jaxbuf.transfer._cache_endpoint import KVCacheEndpoint, KVCachePeer, KVCacheTransfer
from jaxbuf.transfer._control import Limits
from jaxbuf.transfer._endpoint import (
    TRANSPORTS,
    KVEndpoint,
    KVLayout,
    Peer,
    Transfer,
    TransferError,
)
from jaxbuf.transfer._nixl import Agent, NixlUnavailable, load_nixl
from jaxbuf.transfer._registration import Registration, TransferInFlight
from jaxbuf.transfer._wire import LocalAddress, RemoteLayout

__all__ = [
    "TRANSPORTS",
    "Agent",
    "KVCacheEndpoint",
    "KVCachePeer",
    "KVCacheTransfer",
    "KVEndpoint",
    "KVLayout",
    "Limits",
    "LocalAddress",
    "NixlUnavailable",
    "Peer",
    "Registration",
    "RemoteLayout",
    "Transfer",
    "TransferError",
    "TransferInFlight",
    "load_nixl",
]
