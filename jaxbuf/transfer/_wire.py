"""The metadata message peers exchange: a KV cache's layout, its registrations and growth.

Protocol 3, every integer of the header in network order, every array little-endian::

    b"JXKV"  protocol (u32)  layout bytes (u32)  segment count (u32)  registration count (u32)
    layout: UTF-8 JSON object of scalar fields, at most 16 KiB
    segments: count x [offset, capacity, committed] as uint64
    registrations: count x [offset, nbytes] as uint64
    NIXL agent metadata: the rest (opaque to jaxbuf; empty for an endpoint without NIXL)

The layout names the owner's ``agent``, its ``instance`` (32 hex digits drawn when the
endpoint was made: a peer restarted under the same name has another), an ``epoch`` (the
layout's version: a later layout of the owner has a greater one, and one whose
registrations or committed sizes changed always does, growth inside a mapped chunk
included), the
``mem_type`` and ``device_id``, the reservation (``base`` address, ``capacity`` bytes), the
``block_bytes``, and optionally ``local``: how a process on the same host reaches the owner
(:class:`LocalAddress`). Segment and registration offsets are from ``base``.

:func:`decode` validates everything before the caller touches NIXL, as the sharing wire
format is validated: exact integer types (a bool is not one), bounds (the reservation ends
below 2**63, as NIXL and numpy address with int64; every segment and registration inside it,
committed sizes inside their segment), alignment, no overlaps, sorted lists, exact lengths,
bounded counts, no unknown field; and against the previous message of the same peer a newer
epoch and an unchanged reservation and layout (a buffer never moves). A hostile or stale
message raises ``ValueError`` naming the field; nothing it says can make a transfer leave the
memory its owner registered. Decoding costs about the message (at most twice it while
validating) plus ~150 bytes a segment: the JSON part is bounded, the arrays are read with
``numpy.frombuffer`` and the registrations kept packed (:class:`Ranges`). Protocol 1
(segments as JSON lists, whose decoding cost ~16 times the message) and protocol 2 (no
``instance``) are refused.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PROTOCOL", "LocalAddress", "Ranges", "RemoteLayout", "check_update", "decode", "encode"]

_MAGIC = b"JXKV"
_PREFIX = struct.Struct("!4sI")  # magic, protocol version: what every protocol shares
_HEADER = struct.Struct("!4sIIII")  # magic, protocol, layout bytes, segments, registrations
PROTOCOL = 3
#: Every segment starts at a multiple of this (jaxbuf.extensible.SEGMENT_ALIGNMENT).
_SEGMENT_ALIGNMENT = 256
_MAX_MESSAGE = 1 << 30
_MAX_LAYOUT = 1 << 14  # scalar fields only: a bounded JSON costs a bounded parse
_MAX_SEGMENTS = 1 << 12  # a KV cache has a few segments per layer; a tuple each is kept
_MAX_REGISTRATIONS = 1 << 20
_MAX_DEVICE_ID = 1 << 16
_MAX_NAME = 256
_MAX_ADDRESS = 100  # an abstract AF_UNIX name: "\0" + address fits sun_path (108)
_INT64_MAX = (1 << 63) - 1
_UID_MAX = (1 << 32) - 2  # (uid_t)-1 means "no uid"
_MEM_TYPES = ("DRAM", "VRAM")
_SCALARS = (
    "agent",
    "instance",
    "epoch",
    "mem_type",
    "device_id",
    "base",
    "capacity",
    "block_bytes",
)
_FIELDS = frozenset((*_SCALARS, "local"))
_BOOT_ID = re.compile(r"[0-9a-f-]{36}")
_INSTANCE = re.compile(r"[0-9a-f]{32}")  # a UUID as the kernel prints it: hex and dashes
_LOCAL_FIELDS = ("boot_id", "uid", "address")


@dataclass(frozen=True)
class LocalAddress:
    """How a process on the same host reaches an endpoint: the host's ``boot_id``
    (``/proc/sys/kernel/random/boot_id``: equal only on the same host since its last boot),
    the endpoint's ``uid``, and ``address``, the name of an abstract ``AF_UNIX`` socket
    (bound as ``"\\0" + address``): at most 100 printable ASCII characters."""

    boot_id: str
    uid: int
    address: str

    def __post_init__(self) -> None:
        if type(self.boot_id) is not str or not _BOOT_ID.fullmatch(self.boot_id):
            raise ValueError(
                "metadata field 'local.boot_id' must be a boot id (36 characters of lowercase "
                f"hex digits and dashes), got {self.boot_id!r:.80}"
            )
        if type(self.uid) is not int or not 0 <= self.uid <= _UID_MAX:
            raise ValueError(
                f"metadata field 'local.uid' must be an integer in [0, {_UID_MAX}], got "
                f"{self.uid!r:.80}"
            )
        address = self.address
        if (
            type(address) is not str
            or not 0 < len(address) <= _MAX_ADDRESS
            or not (address.isascii() and address.isprintable())
        ):
            raise ValueError(
                f"metadata field 'local.address' must be 1 to {_MAX_ADDRESS} printable ASCII "
                f"characters, got {address!r:.120}"
            )


class Ranges(Sequence):
    """Sorted, disjoint ``(offset, nbytes)`` pairs held packed, as one read-only ``(N, 2)``
    int64 :attr:`array` (16 bytes a pair, where a tuple of tuples costs ~120). A sequence of
    ``(offset, nbytes)`` tuples otherwise: it iterates, indexes and compares as one."""

    __slots__ = ("array",)

    def __init__(self, pairs: Any = ()) -> None:
        array = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        array.flags.writeable = False
        self.array = array

    @classmethod
    def _adopt(cls, array: np.ndarray) -> Ranges:
        """Wrap ``array`` (an ``(N, 2)`` int64 array nobody else holds) without a copy."""
        ranges = cls.__new__(cls)
        array.flags.writeable = False
        ranges.array = array
        return ranges

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return Ranges._adopt(self.array[index])
        offset, nbytes = self.array[index].tolist()
        return offset, nbytes

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return map(tuple, self.array.tolist())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if (dtype is None or np.dtype(dtype) == self.array.dtype) and not copy:
            return self.array
        return np.array(self.array, dtype=dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranges):
            return np.array_equal(self.array, other.array)
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(tuple(pair) for pair in other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.array.tobytes())

    def __repr__(self) -> str:
        shown = ", ".join(str(pair) for pair in self[:4])
        return f"Ranges([{shown}{', ...' if len(self) > 4 else ''}], {len(self)} pairs)"

    def missing_from(self, other: Ranges) -> bool:
        """Whether a pair of this list is not in ``other`` (both sorted by offset)."""
        if not len(self):
            return False
        if not len(other):
            return True
        mine, theirs = self.array, other.array
        where = np.minimum(np.searchsorted(theirs[:, 0], mine[:, 0]), len(theirs) - 1)
        return not np.array_equal(theirs[where], mine)


@dataclass(frozen=True)
class RemoteLayout:
    """A validated peer layout (see the module docstring); offsets are from ``base``.
    ``registrations`` may be given as any sequence of pairs; it is held as :class:`Ranges`."""

    agent: str
    instance: str
    epoch: int
    mem_type: str
    device_id: int
    base: int
    capacity: int
    block_bytes: int
    segment_offsets: tuple[int, ...]
    segment_capacities: tuple[int, ...]
    committed: tuple[int, ...]
    registrations: Ranges
    nixl_metadata: bytes
    local: LocalAddress | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.registrations, Ranges):
            object.__setattr__(self, "registrations", Ranges(self.registrations))

    @property
    def committed_blocks(self) -> tuple[int, ...]:
        """Whole blocks committed in each segment."""
        return tuple(size // self.block_bytes for size in self.committed)


def encode(layout: RemoteLayout) -> bytes:
    """The message for ``layout`` (written as given: :func:`decode` is the validation)."""
    body: dict[str, Any] = {key: getattr(layout, key) for key in _SCALARS}
    if layout.local is not None:
        body["local"] = {key: getattr(layout.local, key) for key in _LOCAL_FIELDS}
    text = json.dumps(body, separators=(",", ":")).encode()
    segments = np.array(
        [layout.segment_offsets, layout.segment_capacities, layout.committed], dtype="<u8"
    ).T
    registrations = np.asarray(layout.registrations.array, dtype="<u8")
    header = _HEADER.pack(_MAGIC, PROTOCOL, len(text), len(segments), len(registrations))
    return b"".join(
        (header, text, segments.tobytes(), registrations.tobytes(), layout.nixl_metadata)
    )


def _int(body: dict, key: str, low: int, high: int, why: str = "") -> int:
    value = body.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(
            f"metadata field {key!r} must be an integer in [{low}, {high}]{why}, got {value!r:.80}"
        )
    return value


def _first(bad: np.ndarray) -> int | None:
    """The index of the first True of ``bad``, or None."""
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def _rows(message: bytes, offset: int, count: int, width: int, key: str) -> np.ndarray:
    """``count`` rows of ``width`` uint64 at ``offset`` (a view: no copy), each value a
    non-negative int64."""
    rows = np.frombuffer(message, dtype="<u8", count=count * width, offset=offset)
    rows = rows.reshape(count, width)
    row = _first((rows > _INT64_MAX).any(axis=1))
    if row is not None:
        raise ValueError(
            f"metadata field {key!r}: entry {row} {rows[row].tolist()} holds a value beyond 2**63-1"
        )
    return rows


def decode(message: Any, previous: RemoteLayout | None = None) -> RemoteLayout:
    """Validate ``message``; with ``previous`` (the last layout of the same peer) also that
    it is newer and describes the same reservation (:func:`check_update`). ValueError names
    what is wrong."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise TypeError(f"a metadata message is bytes, got {type(message).__name__}")
    message = bytes(message)
    if not _PREFIX.size <= len(message) <= _MAX_MESSAGE:
        raise ValueError(f"a metadata message of {len(message)} bytes is not one")
    magic, protocol = _PREFIX.unpack_from(message)
    if magic != _MAGIC:
        raise ValueError(f"not a jaxbuf KV metadata message (magic {magic!r})")
    if protocol != PROTOCOL:
        raise ValueError(
            f"metadata protocol {protocol} is not supported (this is {PROTOCOL}): both peers "
            "must run a jaxbuf of the same metadata protocol"
        )
    if len(message) < _HEADER.size:
        raise ValueError(f"a metadata message of {len(message)} bytes is short of its header")
    _, _, text_bytes, num_segments, num_registrations = _HEADER.unpack_from(message)
    if text_bytes > _MAX_LAYOUT:
        raise ValueError(f"the metadata layout of {text_bytes} bytes exceeds {_MAX_LAYOUT}")
    if not 0 < num_segments <= _MAX_SEGMENTS:
        raise ValueError(
            f"metadata field 'segments' must list 1 to {_MAX_SEGMENTS} segments, got {num_segments}"
        )
    if num_registrations > _MAX_REGISTRATIONS:
        raise ValueError(
            f"metadata field 'registrations' lists {num_registrations} registrations, more "
            f"than {_MAX_REGISTRATIONS}"
        )
    segments_at = _HEADER.size + text_bytes
    registrations_at = segments_at + 24 * num_segments
    end = registrations_at + 16 * num_registrations
    if end > len(message):
        raise ValueError(
            f"the metadata header claims {end} bytes of layout, segments and registrations; "
            f"the message has {len(message)}"
        )
    try:
        # Decoded as UTF-8 here: json.loads guesses a bytes object's encoding (UTF-16 or -32
        # by its first bytes), so the same bytes could parse on one Python and not another.
        body = json.loads(message[_HEADER.size : segments_at].decode("utf-8"))
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"the metadata layout is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ValueError("the metadata layout must be a JSON object")
    unknown = set(body) - _FIELDS
    if unknown:
        raise ValueError(f"metadata fields {sorted(unknown)!r:.200} are not of protocol {PROTOCOL}")

    agent = body.get("agent")
    if type(agent) is not str or not 0 < len(agent) <= _MAX_NAME:
        raise ValueError(f"metadata field 'agent' must be a non-empty name, got {agent!r:.300}")
    instance = body.get("instance")
    if type(instance) is not str or not _INSTANCE.fullmatch(instance):
        raise ValueError(
            f"metadata field 'instance' must be 32 lowercase hex digits, got {instance!r:.80}"
        )
    mem_type = body.get("mem_type")
    if mem_type not in _MEM_TYPES or type(mem_type) is not str:
        raise ValueError(
            f"metadata field 'mem_type' must be one of {_MEM_TYPES}, got {mem_type!r:.80}"
        )
    epoch = _int(body, "epoch", 0, _INT64_MAX)
    device_id = _int(body, "device_id", 0, _MAX_DEVICE_ID)
    capacity = _int(body, "capacity", 1, _INT64_MAX - 1)
    base = _int(body, "base", 1, _INT64_MAX - capacity, " (the reservation must end below 2**63)")
    if base % _SEGMENT_ALIGNMENT:
        raise ValueError(
            f"metadata field 'base' {base:#x} is not {_SEGMENT_ALIGNMENT}-byte aligned"
        )
    block_bytes = _int(body, "block_bytes", 1, capacity)
    local = _local(body.get("local"))

    segments = _rows(message, segments_at, num_segments, 3, "segments")
    _check_segments(segments, capacity)
    registrations = _rows(message, registrations_at, num_registrations, 2, "registrations")
    _check_registrations(registrations, capacity)

    offsets, capacities, committed = segments.T.tolist()
    layout = RemoteLayout(
        agent=agent,
        instance=instance,
        epoch=epoch,
        mem_type=mem_type,
        device_id=device_id,
        base=base,
        capacity=capacity,
        block_bytes=block_bytes,
        segment_offsets=tuple(offsets),
        segment_capacities=tuple(capacities),
        committed=tuple(committed),
        registrations=Ranges._adopt(registrations.astype(np.int64)),
        nixl_metadata=message[end:],
        local=local,
    )
    if previous is not None:
        check_update(previous, layout)
    return layout


def _local(value: Any) -> LocalAddress | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(_LOCAL_FIELDS):
        raise ValueError(
            f"metadata field 'local' must be null or an object of exactly {_LOCAL_FIELDS}, "
            f"got {value!r:.200}"
        )
    return LocalAddress(**value)


def _check_segments(segments: np.ndarray, capacity: int) -> None:
    offsets, capacities, committed = segments.T
    i = _first(offsets % _SEGMENT_ALIGNMENT != 0)
    if i is not None:
        raise ValueError(
            f"metadata field 'segments': segment {i} offset {int(offsets[i])} is not "
            f"{_SEGMENT_ALIGNMENT}-byte aligned"
        )
    ends = offsets + capacities  # no overflow: both are below 2**63
    i = _first((capacities == 0) | (ends > capacity))
    if i is not None:
        raise ValueError(
            f"metadata field 'segments': segment {i} [{int(offsets[i])}, {int(ends[i])}) is "
            f"empty or outside the reservation of {capacity} bytes"
        )
    i = _first(committed > capacities)
    if i is not None:
        raise ValueError(
            f"metadata field 'segments': segment {i} commits {int(committed[i])} bytes beyond "
            f"its capacity {int(capacities[i])}"
        )
    i = _first(offsets[1:] < ends[:-1])
    if i is not None:
        raise ValueError(
            f"metadata field 'segments': segment {i + 1} at {int(offsets[i + 1])} overlaps "
            "or precedes the one before it"
        )


def _check_registrations(registrations: np.ndarray, capacity: int) -> None:
    offsets, nbytes = registrations.T
    ends = offsets + nbytes
    i = _first((nbytes == 0) | (ends > capacity))
    if i is not None:
        raise ValueError(
            f"metadata field 'registrations': registration {i} [{int(offsets[i])}, "
            f"{int(ends[i])}) is empty or outside the reservation of {capacity} bytes"
        )
    i = _first(offsets[1:] < ends[:-1])
    if i is not None:
        raise ValueError(
            f"metadata field 'registrations': registration {i + 1} at {int(offsets[i + 1])} "
            "overlaps or precedes the one before it"
        )


def check_update(previous: RemoteLayout, layout: RemoteLayout) -> None:
    """ValueError unless ``layout`` may follow ``previous``, the last accepted layout of the
    same peer instance: the same agent, a newer epoch, the same reservation and segments.
    (A layout of another instance is a restarted peer: the endpoint decides, not this.)"""
    if layout.agent != previous.agent:
        raise ValueError(
            f"metadata from agent {layout.agent!r} cannot update peer {previous.agent!r}"
        )
    if layout.instance != previous.instance:
        raise ValueError(
            f"metadata from {layout.agent!r} is of another instance (restarted): it replaces "
            "the peer, it does not update it"
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
                f"{getattr(previous, field)!r:.200} to {getattr(layout, field)!r:.200}: a "
                "buffer never moves or changes its layout"
            )
