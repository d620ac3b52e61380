"""What UCX says it used: the protocol tables ``UCX_PROTO_INFO=y`` prints (to ``UCX_LOG_FILE``)
when a protocol is first selected, read back to name the transport a NIXL transfer took
(``cma/memory``, ``tcp/lo``, ``cuda_ipc/cuda``, ``rc_mlx5/...``)."""

from __future__ import annotations

import ctypes
import os
import re

__all__ = ["UcxLog", "describe_nixl", "ucx_protocols"]

_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")


def ucx_protocols(log: str, operation: str, memory: str = "") -> list[str]:
    """The UCX transports (``"cma/memory"``, ``"tcp/lo"``, ``"cuda_ipc/cuda"``) that
    ``UCX_PROTO_INFO`` tables in ``log`` show for remote ``operation`` (``"WRITE"`` or
    ``"READ"``) to another process (the tables of an endpoint to itself are left out), from
    ``memory`` (UCX's word: ``"host"``, ``"cuda"``; any when empty), sorted, each once."""
    wanted = "remote memory write" if operation == "WRITE" else "remote memory read"
    found: set[str] = set()
    header: str | None = None
    description: str | None = None
    for raw in log.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 1:  # a table's title: "<worker> <endpoint> cfg#N", then what
            if header is None or description is not None:
                header, description = cells[0], None
            else:
                description = cells[0]
            continue
        if len(cells) < 3 or cells[0] == "Range" or header is None or description is None:
            continue
        if " self " in f" {header} " or not description.startswith(wanted):
            continue
        if memory and f"{memory} memory" not in description:
            continue
        found.add(cells[2])
    return sorted(found)


class UcxLog:
    """The prefill side's UCX log (``UCX_LOG_FILE``): what UCX printed since a mark."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._mark = 0

    def _text(self) -> str:
        if self.path is None:
            return ""
        # UCX writes its log through a buffered stdio stream: flush every stream of this
        # process (fflush(NULL)) so that the tables of the transfer just made are there.
        ctypes.CDLL(None).fflush(None)
        if not os.path.exists(self.path):
            return ""
        with open(self.path, errors="replace") as log:
            return log.read()

    def mark(self) -> None:
        self._mark = len(self._text())

    def transports(self, operation: str, memory: str) -> list[str]:
        """The transports of the tables printed since :meth:`mark` (by the transfers made
        since), or, when none was, of every table of ``operation`` from ``memory`` so far:
        UCX prints a table once, when a configuration is first selected, and a later
        subject over the same kind of memory reuses it."""
        text = self._text()
        return ucx_protocols(text[self._mark :], operation, memory) or ucx_protocols(
            text, operation, memory
        )


def describe_nixl(protocols: list[str], memory: str) -> str:
    if not protocols:
        return (
            "NIXL, UCX backend (UCX printed no protocol table: UCX_PROTO_INFO needs UCX's "
            "protocols v2)"
        )
    text = f"NIXL, UCX {' + '.join(protocols)}"
    if any(p.startswith("tcp/") for p in protocols):
        text += f": UCX fell back to TCP loopback for {memory}, which is what this row measures"
    return text
