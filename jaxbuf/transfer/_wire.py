"""The metadata message peers exchange: a KV cache's layout, its registrations and growth.

A message is ``b"JXKV"``, a 4-byte protocol version and an 8-byte JSON length (network order),
the layout as UTF-8 JSON, then the owner's NIXL agent metadata (opaque to jaxbuf). The layout
names the owner's agent, an ``epoch`` that grows with every change of its registrations, the
memory type and device, the reservation (``base`` address, ``capacity`` bytes), the block
size, each segment's ``[offset, capacity, committed]`` and the registered
``[offset, nbytes]`` pieces, every offset from ``base``.

:func:`decode` validates everything before the caller touches NIXL, as the sharing wire
format is validated: exact integer types, bounds (every segment and registration inside the
reservation, committed sizes inside their segment), alignment, no overlaps, sorted lists,
and against the previous message of the same peer a newer epoch and an unchanged reservation
and layout (a buffer never moves). A hostile or stale message raises ``ValueError`` naming the
field; nothing it says can make a transfer leave the memory its owner registered.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["PROTOCOL", "RemoteLayout", "decode", "encode"]

_MAGIC = b"JXKV"
_HEADER = struct.Struct("!4sIQ")  # magic, protocol version, JSON bytes
PROTOCOL = 1
#: Every segment starts at a multiple of this (jaxbuf.extensible.SEGMENT_ALIGNMENT).
_SEGMENT_ALIGNMENT = 256
_MAX_MESSAGE = 1 << 30
_MAX_SEGMENTS = 1 << 16
_MAX_REGISTRATIONS = 1 << 20
_MAX_DEVICE_ID = 1 << 16
_MAX_NAME = 256
_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class RemoteLayout:
    """A validated peer layout (see the module docstring); offsets are from ``base``."""

    agent: str
    epoch: int
    mem_type: str
    device_id: int
    base: int
    capacity: int
    block_bytes: int
    segment_offsets: tuple[int, ...]
    segment_capacities: tuple[int, ...]
    committed: tuple[int, ...]
    registrations: tuple[tuple[int, int], ...]
    nixl_metadata: bytes

    @property
    def committed_blocks(self) -> tuple[int, ...]:
        """Whole blocks committed in each segment."""
        return tuple(size // self.block_bytes for size in self.committed)


def encode(layout: RemoteLayout) -> bytes:
    """The message for ``layout``."""
    body = {
        "agent": layout.agent,
        "epoch": layout.epoch,
        "mem_type": layout.mem_type,
        "device_id": layout.device_id,
        "base": layout.base,
        "capacity": layout.capacity,
        "block_bytes": layout.block_bytes,
        "segments": [
            [offset, capacity, committed]
            for offset, capacity, committed in zip(
                layout.segment_offsets, layout.segment_capacities, layout.committed
            )
        ],
        "registrations": [list(piece) for piece in layout.registrations],
    }
    text = json.dumps(body, separators=(",", ":")).encode()
    return _HEADER.pack(_MAGIC, PROTOCOL, len(text)) + text + layout.nixl_metadata


def _int(body: dict, key: str, low: int, high: int) -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(
            f"metadata field {key!r} must be an integer in [{low}, {high}], got {value!r}"
        )
    return value


def _int_rows(body: dict, key: str, width: int, limit: int) -> list[list[int]]:
    rows = body.get(key)
    if not isinstance(rows, list) or len(rows) > limit:
        raise ValueError(f"metadata field {key!r} must be a list of at most {limit} rows")
    for i, row in enumerate(rows):
        if (
            not isinstance(row, list)
            or len(row) != width
            or any(type(v) is not int or v < 0 for v in row)
        ):
            raise ValueError(
                f"metadata {key}[{i}] must be {width} non-negative integers, got {row!r}"
            )
    return rows


def decode(message: Any, previous: RemoteLayout | None = None) -> RemoteLayout:
    """Validate ``message``; with ``previous`` (the last layout of the same peer) also that
    it is newer and describes the same reservation. ValueError names what is wrong."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise TypeError(f"a metadata message is bytes, got {type(message).__name__}")
    message = bytes(message)
    if not _HEADER.size <= len(message) <= _MAX_MESSAGE:
        raise ValueError(f"a metadata message of {len(message)} bytes is not one")
    magic, protocol, text_bytes = _HEADER.unpack_from(message)
    if magic != _MAGIC:
        raise ValueError(f"not a jaxbuf KV metadata message (magic {magic!r})")
    if protocol != PROTOCOL:
        raise ValueError(f"metadata protocol {protocol} is not supported (this is {PROTOCOL})")
    end = _HEADER.size + text_bytes
    if end > len(message):
        raise ValueError(f"the metadata claims {text_bytes} bytes of layout; the message is short")
    try:
        body = json.loads(message[_HEADER.size : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the metadata layout is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ValueError("the metadata layout must be a JSON object")
    nixl_metadata = message[end:]
    if not nixl_metadata:
        raise ValueError("the metadata message carries no NIXL agent metadata")

    agent = body.get("agent")
    if not isinstance(agent, str) or not 0 < len(agent) <= _MAX_NAME:
        raise ValueError(f"metadata field 'agent' must be a non-empty name, got {agent!r}")
    mem_type = body.get("mem_type")
    if mem_type not in _MEM_TYPES:
        raise ValueError(f"metadata field 'mem_type' must be one of {_MEM_TYPES}, got {mem_type!r}")
    epoch = _int(body, "epoch", 0, (1 << 63) - 1)
    device_id = _int(body, "device_id", 0, _MAX_DEVICE_ID)
    capacity = _int(body, "capacity", 1, (1 << 63) - 1)
    base = _int(body, "base", 1, (1 << 64) - 1 - capacity)
    if base % _SEGMENT_ALIGNMENT:
        raise ValueError(f"metadata base {base:#x} is not {_SEGMENT_ALIGNMENT}-byte aligned")
    block_bytes = _int(body, "block_bytes", 1, capacity)

    segments = _int_rows(body, "segments", 3, _MAX_SEGMENTS)
    if not segments:
        raise ValueError("metadata lists no segments")
    cursor = 0
    for i, (offset, seg_capacity, committed) in enumerate(segments):
        if offset % _SEGMENT_ALIGNMENT:
            raise ValueError(f"metadata segment {i} offset {offset} is not 256-byte aligned")
        if offset < cursor:
            raise ValueError(f"metadata segment {i} at {offset} overlaps the one before it")
        if seg_capacity == 0 or offset + seg_capacity > capacity:
            raise ValueError(
                f"metadata segment {i} [{offset}, {offset + seg_capacity}) is empty or outside "
                f"the reservation of {capacity} bytes"
            )
        if committed > seg_capacity:
            raise ValueError(
                f"metadata segment {i} commits {committed} bytes beyond its capacity {seg_capacity}"
            )
        cursor = offset + seg_capacity

    registrations = _int_rows(body, "registrations", 2, _MAX_REGISTRATIONS)
    cursor = 0
    for i, (offset, nbytes) in enumerate(registrations):
        if nbytes == 0 or offset + nbytes > capacity:
            raise ValueError(
                f"metadata registration {i} [{offset}, {offset + nbytes}) is empty or outside "
                f"the reservation of {capacity} bytes"
            )
        if offset < cursor:
            raise ValueError(
                f"metadata registration {i} at {offset} overlaps or precedes the one before it"
            )
        cursor = offset + nbytes

    layout = RemoteLayout(
        agent=agent,
        epoch=epoch,
        mem_type=mem_type,
        device_id=device_id,
        base=base,
        capacity=capacity,
        block_bytes=block_bytes,
        segment_offsets=tuple(row[0] for row in segments),
        segment_capacities=tuple(row[1] for row in segments),
        committed=tuple(row[2] for row in segments),
        registrations=tuple((row[0], row[1]) for row in registrations),
        nixl_metadata=nixl_metadata,
    )
    if previous is not None:
        _check_update(previous, layout)
    return layout


def _check_update(previous: RemoteLayout, layout: RemoteLayout) -> None:
    if layout.agent != previous.agent:
        raise ValueError(
            f"metadata from agent {layout.agent!r} cannot update peer {previous.agent!r}"
        )
    if layout.epoch <= previous.epoch:
        raise ValueError(
            f"stale metadata from {layout.agent!r}: epoch {layout.epoch} is not newer than "
            f"{previous.epoch}"
        )
    for field in (
        "mem_type",
        "device_id",
        "base",
        "capacity",
        "block_bytes",
        "segment_offsets",
        "segment_capacities",
    ):
        if getattr(layout, field) != getattr(previous, field):
            raise ValueError(
                f"metadata from {layout.agent!r} changes {field} from "
                f"{getattr(previous, field)!r} to {getattr(layout, field)!r}: a buffer never "
                "moves or changes its layout"
            )
