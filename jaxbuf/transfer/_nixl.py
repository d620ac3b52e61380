"""The NIXL adapter: the only module that imports NIXL, and one small agent every other module
of :mod:`jaxbuf.transfer` calls.

NIXL ships as ``nixl`` (a meta package that picks a CUDA variant, module ``nixl._api``) or as
one variant directly (``nixl-cu13`` -> ``nixl_cu13._api``, ``nixl-cu12`` -> ``nixl_cu12._api``);
the first that imports is used. :class:`Agent` wraps one ``nixl_agent`` with the UCX backend
and counts what it holds (registrations, prepared descriptor lists, transfer handles), so a
test can check that nothing leaks; its methods are the seam a fault-injecting agent in the
tests wraps to fail any NIXL call.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from jaxbuf.drivers.base import K_DL_CPU, K_DL_CUDA, K_DL_CUDA_HOST

__all__ = ["Agent", "NixlUnavailable", "load_nixl", "memory_type_of", "metadata_agent_name"]

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
_INSTALL = "install the NIXL extra: pip install 'jaxbuf[nixl]' (or nixl-cu12 / nixl)"
#: The descriptor-list spelling NIXL uses for "the local agent" in prep_xfer_dlist.
LOCAL_AGENT = "NIXL_INIT_AGENT"
# NIXL's agent metadata is a nixlSerDes string: b"nixlSerDes|", then fields, each a tag, a
# size_t length (native: little-endian wherever NIXL runs), the value and b"|"; the first
# field is the agent name, tag b"Agent" (getLocalMD writes it first, loadRemoteMD reads it
# first and loads the agent under that name).
_SERDES_AGENT = b"nixlSerDes|Agent"
_MAX_AGENT_NAME = 1 << 12


class NixlUnavailable(ImportError):
    """NIXL is not installed (the message says which modules were tried and what to
    install)."""


_api: Any = None


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``), imported once."""
    global _api  # noqa: PLW0603 - the one cache of an immutable import, not a setting
    if _api is not None:
        return _api
    failures = []
    for name in _MODULES:
        try:
            _api = importlib.import_module(name)
        except ImportError as error:
            failures.append(f"{name}: {error}")
            continue
        _quiet_info_logs(name)
        return _api
    raise NixlUnavailable(f"NIXL is not importable ({'; '.join(failures)}); {_INSTALL}")


def _quiet_info_logs(module_name: str) -> None:
    """NIXL's Python logger writes an INFO line to *stdout* for every agent and backend,
    which corrupts what a program prints (a notebook's output, a JSON reply). Unless the
    user chose a level (``NIXL_LOG_LEVEL``), keep its warnings and errors only."""
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    logger = logging.getLogger("nixl")
    if logger.level in (logging.NOTSET, logging.INFO, logging.DEBUG):
        logger.setLevel(logging.WARNING)


def memory_type_of(dlpack_device_type: int) -> str:
    """NIXL's memory type for memory a driver reports with ``dlpack_device_type``: VRAM
    for device memory (CUDA, ROCm), DRAM for host memory (plain or pinned)."""
    if dlpack_device_type == K_DL_CUDA:
        return "VRAM"
    if dlpack_device_type in (K_DL_CPU, K_DL_CUDA_HOST):
        return "DRAM"
    raise ValueError(f"NIXL has no memory type for DLPack device type {dlpack_device_type}")


def metadata_agent_name(metadata: bytes) -> str:
    """The agent name NIXL agent metadata carries, read without loading it (what
    ``add_remote_agent`` would return); ValueError when the bytes do not start as NIXL
    agent metadata does."""
    head = len(_SERDES_AGENT)
    if not isinstance(metadata, bytes) or metadata[:head] != _SERDES_AGENT:
        raise ValueError(
            f"the NIXL metadata does not start with an agent name (got {bytes(metadata[:24])!r})"
        )
    size = int.from_bytes(metadata[head : head + 8], "little")
    name = metadata[head + 8 : head + 8 + size]
    if not 0 < size <= _MAX_AGENT_NAME or metadata[head + 8 + size : head + 9 + size] != b"|":
        raise ValueError(f"the NIXL metadata's agent name field is malformed (length {size})")
    try:
        return name.decode()
    except UnicodeDecodeError:
        raise ValueError(f"the NIXL metadata's agent name {name!r:.80} is not UTF-8") from None


class Agent:
    """One NIXL agent (UCX backend by default) and the counts of what it holds.

    ``name`` must be unique among the agents that talk to each other. ``backends`` lists
    NIXL backends to create (``["UCX"]``). ``nixl_agent`` wraps an existing
    ``nixl_agent`` instead of creating one (its name is taken from it).

    Invariants: :attr:`live_registrations`, :attr:`live_dlists` and :attr:`live_transfers`
    count what was created through this object and not yet released; :meth:`close`
    releases nothing the caller still owns, and is safe to call twice.
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        *,
        nixl_agent: Any = None,
        progress_thread: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an agent name must be a non-empty string, got {name!r}")
        api = load_nixl()
        if nixl_agent is None:
            config = api.nixl_agent_config(
                enable_prog_thread=progress_thread, backends=list(backends)
            )
            nixl_agent = api.nixl_agent(name, config)
            if not nixl_agent.backends:
                raise RuntimeError(
                    f"NIXL created none of the backends {list(backends)} for agent {name!r} "
                    f"(plugins available: {nixl_agent.plugin_list})"
                )
        self.name = nixl_agent.name
        self.nixl = nixl_agent
        self.live_registrations = 0
        self.live_dlists = 0
        self.live_transfers = 0
        self.remote_agents: set[str] = set()

    def __repr__(self) -> str:
        return f"Agent({self.name!r})"

    # -- registrations --------------------------------------------------------------
    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, device_id: int) -> Any:
        """Register ``(address, nbytes)`` regions as one NIXL registration; its handle."""
        descs = [(address, nbytes, device_id, "") for address, nbytes in regions]
        handle = self.nixl.register_memory(descs, mem_type)
        self.live_registrations += 1
        return handle

    def deregister(self, handle: Any) -> None:
        self.nixl.deregister_memory(handle)
        self.live_registrations -= 1

    # -- metadata -------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and every registration)."""
        return self.nixl.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's NIXL metadata (additive: registrations it no longer lists stay
        known until :meth:`remove_remote`); the peer's agent name."""
        name = self.nixl.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.remote_agents.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer and every registration of it this agent knew."""
        self.nixl.remove_remote_agent(name)
        self.remote_agents.discard(name)

    def load_remote(self, name: str, metadata: bytes, *, previous: bytes | None = None) -> None:
        """Load agent ``name``'s metadata (``name`` read from it: :func:`metadata_agent_name`).

        With ``previous``, the metadata of ``name`` loaded last, ``name`` is forgotten first:
        the load is additive and would keep registrations the new metadata no longer lists.
        A load that fails leaves what was known: ``previous`` is loaded again, and a remote
        NIXL loaded under another name than ``name`` (ValueError) is forgotten unless it was
        known before."""
        known_before = set(self.remote_agents)
        if previous is not None:
            self.remove_remote(name)
        try:
            loaded = self.add_remote(metadata)
            if loaded != name:
                if loaded not in known_before:
                    self.remove_remote(loaded)
                raise ValueError(f"NIXL loaded the metadata as agent {loaded!r}, not {name!r}")
        except BaseException:
            if previous is not None:
                self.add_remote(previous)
            raise

    # -- descriptors and transfers --------------------------------------------------
    def prep_dlist(self, agent_name: str, descs: Any, mem_type: str) -> Any:
        """A prepared descriptor list of ``descs`` (an Nx3 array of address, nbytes, device
        id) on ``agent_name`` (:data:`LOCAL_AGENT` for this agent's memory)."""
        handle = self.nixl.prep_xfer_dlist(agent_name, descs, mem_type)
        self.live_dlists += 1
        return handle

    def release_dlist(self, handle: Any) -> None:
        self.nixl.release_dlist_handle(handle)
        self.live_dlists -= 1

    def make_prepped(
        self,
        operation: str,
        local: Any,
        local_indices: Any,
        remote: Any,
        remote_indices: Any,
        notification: bytes,
    ) -> Any:
        handle = self.nixl.make_prepped_xfer(
            operation, local, local_indices, remote, remote_indices, notification
        )
        self.live_transfers += 1
        return handle

    def make_transfer(
        self, operation: str, local: Any, remote: Any, remote_agent: str, mem_types: tuple
    ) -> Any:
        """A transfer from hand-built descriptors (Nx3 arrays of both sides)."""
        local_descs = self.nixl.get_xfer_descs(local, mem_types[0])
        remote_descs = self.nixl.get_xfer_descs(remote, mem_types[1])
        handle = self.nixl.initialize_xfer(operation, local_descs, remote_descs, remote_agent)
        self.live_transfers += 1
        return handle

    def post(self, handle: Any, notification: bytes) -> str:
        """Start a transfer: ``"DONE"``, ``"PROC"`` or ``"ERR"``."""
        return self.nixl.transfer(handle, notification)

    def state(self, handle: Any) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"``."""
        return self.nixl.check_xfer_state(handle)

    def release_transfer(self, handle: Any) -> None:
        self.nixl.release_xfer_handle(handle)
        self.live_transfers -= 1

    # -- notifications --------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sending agent."""
        return self.nixl.get_new_notifs()

    def notify(self, remote_agent: str, message: bytes) -> None:
        self.nixl.send_notif(remote_agent, message)

    def close(self) -> None:
        """Forget every remote agent this object added (the caller releases the rest)."""
        for name in sorted(self.remote_agents):
            self.remove_remote(name)
