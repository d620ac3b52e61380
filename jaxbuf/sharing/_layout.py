"""The layout of a shared buffer: what the owner exports (:func:`export_layout`) and what an
importer checks before mapping anything (:func:`_check_layout`).

A layout is a JSON-able dict: the owner's reservation (``reserved_size``, ``granularity``),
its segments (``segment_capacities``, ``segment_offsets``, ``committed_sizes``), where it
lives (``platform``, ``device``, ``device_index``), a random ``owner`` token naming the
reservation, ``read_only``, every mapped chunk as ``[offset, size, chunk_id]``
(``all_chunks``) and the ones this message carries descriptors for (``chunks``, in descriptor
order). A layout from a peer is untrusted input: :func:`_check_layout` validates all of it.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from jaxbuf._intervals import IntervalSet
from jaxbuf.devices import as_device
from jaxbuf.sharing._wire import _close_all

LAYOUT_VERSION = 1
_MAX_BYTES = 1 << 62  # sizes and offsets of a layout (ctypes passes them as size_t)


def _owner_token(buffer: Any) -> str:
    """A random name for one reservation of the owner: layouts of different buffers (or of
    a buffer freed and another created at the same address) never mix."""
    token = getattr(buffer, "_sharing_token", None)
    if token is None:
        token = buffer._sharing_token = f"{os.getpid()}-{secrets.token_hex(8)}"
    return token


def export_layout(
    tensor: Any, since: dict | None = None, *, read_only: bool = False
) -> tuple[dict, list[int]]:
    """The layout of ``tensor`` and new descriptors for its chunks.

    Returns ``(layout, fds)``: ``layout`` is a JSON-able dict (``reserved_size``,
    ``granularity``, ``segment_capacities``, ``segment_offsets``, ``committed_sizes``,
    ``device``, ``all_chunks`` as ``[offset, size, chunk_id]`` of every mapped chunk, and
    ``chunks``, the ones whose descriptors ``fds`` carries, in the same order). The caller
    owns ``fds`` and closes them (:func:`~jaxbuf.sharing.send_buffer` does).

    With ``since`` (a layout this function returned earlier for the same tensor), only
    chunks that are not in ``since`` get a descriptor. The importer must have received
    ``since`` (or a later layout) for that to be complete.

    ``read_only``: the descriptors are read-only (CPU only; see the module docstring) and
    the layout says so (``"read_only": true``); ``since`` must have been exported the same way.

    Raises ``ValueError`` when ``since`` belongs to another buffer or was exported with
    another ``read_only``, or when the driver cannot export read-only (CUDA), and
    ``DriverError`` when a chunk cannot be exported (no descriptor is left open then).
    """
    if not isinstance(read_only, bool):
        raise TypeError(f"read_only must be a bool, got {read_only!r}")
    buffer = tensor._live_buffer()
    token = _owner_token(buffer)
    driver = tensor.driver
    device = as_device(tensor.device)  # a face's tensor gives its framework's
    export = driver.export_handle
    if read_only:
        export = getattr(driver, "export_read_only_handle", None)
        if export is None:
            raise ValueError(
                f"read_only=True is not supported on {device}: the {device.platform} driver "
                "cannot make a read-only descriptor (CUDA's cuMemExportToShareableHandle "
                "always grants the importer read/write access)"
            )
    known: set[int] = set()
    if since is not None:
        if not isinstance(since, dict) or since.get("owner") != token:
            raise ValueError(
                "since must be a layout exported from this same buffer, got one of "
                f"owner {since.get('owner') if isinstance(since, dict) else since!r}"
            )
        if since.get("read_only", False) != read_only:
            raise ValueError(
                f"since was exported with read_only={since.get('read_only', False)}, this "
                f"export asks for read_only={read_only}: an importer keeps one access mode"
            )
        try:
            known = {int(chunk[2]) for chunk in since["all_chunks"]}
        except (KeyError, TypeError, IndexError, ValueError):
            raise ValueError(
                "since must be a whole layout exported from this buffer (its 'all_chunks' as "
                f"[offset, size, chunk id] rows), got {since!r:.200}"
            ) from None
    records = buffer.chunk_records()
    layout = {
        "version": LAYOUT_VERSION,
        "owner": token,
        "platform": device.platform,
        "device": str(device),
        "device_index": device.index,
        "reserved_size": buffer.reserved_size,
        "granularity": buffer.granularity,
        "segment_capacities": tensor.segment_capacities,
        "segment_offsets": tensor.segment_offsets,
        "committed_sizes": tensor.committed_sizes,
        "all_chunks": [[offset, size, chunk_id] for offset, size, _, chunk_id in records],
        "chunks": [],
        "read_only": read_only,
    }
    fds: list[int] = []
    try:
        driver.ensure_context(device.index)
        for offset, size, handle, chunk_id in records:
            if chunk_id in known:
                continue
            fds.append(export(handle))
            layout["chunks"].append([offset, size, chunk_id])
    except BaseException:
        _close_all(fds)
        raise
    return layout, fds


# -- validating a received layout ------------------------------------------------------
_LAYOUT_KEYS = (
    "owner",
    "platform",
    "device",
    "reserved_size",
    "granularity",
    "segment_capacities",
    "segment_offsets",
    "committed_sizes",
    "all_chunks",
    "chunks",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layout_int(value: Any, name: str, minimum: int = 0) -> int:
    if not _is_int(value) or not minimum <= value < _MAX_BYTES:
        raise ValueError(f"layout: {name} must be an int in [{minimum}, 2**62), got {value!r:.100}")
    return value


def _layout_list(layout: dict, key: str) -> list:
    value = layout[key]
    if not isinstance(value, list):
        raise ValueError(f"layout: {key} must be a list, got {value!r:.100}")
    return value


def _chunk_entry(entry: Any, name: str) -> tuple[int, int, int]:
    if not (isinstance(entry, list) and len(entry) == 3 and all(map(_is_int, entry))):
        raise ValueError(
            f"layout: {name} must be [offset, size, chunk_id] ints, got {entry!r:.100}"
        )
    return entry[0], entry[1], entry[2]


def _check_layout(layout: Any, num_fds: int) -> None:
    """Validate a layout whole, before anything is mapped; ``ValueError`` naming the first bad
    entry. Afterwards: every documented key is present with its type (ints are ints, not
    bools), segments are ordered, disjoint and inside the reservation with committed sizes
    within their capacities; every ``all_chunks`` entry is aligned to ``granularity``,
    inside the reservation, overlaps no other and has a unique id; every ``chunks`` entry is
    one of ``all_chunks`` (once) with one descriptor each; and every committed prefix is
    backed by ``all_chunks``. Whether they fit *this* import is checked by
    :meth:`~jaxbuf.sharing.ImportedBuffer.update`."""
    version = layout.get("version") if isinstance(layout, dict) else None
    if not (_is_int(version) and version == LAYOUT_VERSION):
        raise ValueError(f"not a jaxbuf layout of version {LAYOUT_VERSION}: {layout!r:.200}")
    missing = [key for key in _LAYOUT_KEYS if key not in layout]
    if missing:
        raise ValueError(f"layout: missing key(s) {', '.join(missing)}")
    for key in ("owner", "platform", "device"):
        if not isinstance(layout[key], str):
            raise ValueError(f"layout: {key} must be a string, got {layout[key]!r:.100}")
    if not isinstance(layout.get("read_only", False), bool):
        raise ValueError(f"layout: read_only must be a bool, got {layout['read_only']!r:.100}")
    reserved = _layout_int(layout["reserved_size"], "reserved_size", 1)
    granularity = _layout_int(layout["granularity"], "granularity", 1)
    if reserved % granularity:
        raise ValueError(
            f"layout: reserved_size {reserved} is not a multiple of the granularity {granularity}"
        )
    columns = {
        key: [_layout_int(v, f"{key}[{i}]") for i, v in enumerate(_layout_list(layout, key))]
        for key in ("segment_capacities", "segment_offsets", "committed_sizes")
    }
    capacities, offsets, committed = columns.values()
    if not len(capacities) == len(offsets) == len(committed):
        raise ValueError(
            "layout: segment_capacities, segment_offsets and committed_sizes differ in length "
            f"({len(capacities)}, {len(offsets)}, {len(committed)})"
        )
    previous_end = 0
    for i, (offset, capacity, size) in enumerate(zip(offsets, capacities, committed)):
        if offset < previous_end or offset + capacity > reserved:
            raise ValueError(
                f"layout: segment {i} [{offset}, +{capacity}) overlaps segment {i - 1} or "
                f"leaves the reservation of {reserved} bytes"
            )
        if size > capacity:
            raise ValueError(
                f"layout: committed_sizes[{i}] = {size} exceeds the segment's capacity {capacity}"
            )
        previous_end = offset + capacity

    places: dict[int, tuple[int, int]] = {}  # chunk_id -> (offset, size)
    spans: list[tuple[int, int, str]] = []
    for i, entry in enumerate(_layout_list(layout, "all_chunks")):
        name = f"all_chunks[{i}] = {entry!r:.100}"
        offset, size, chunk_id = _chunk_entry(entry, name)
        if offset % granularity or size % granularity:
            raise ValueError(f"layout: {name} is not aligned to the granularity {granularity}")
        if offset < 0 or size <= 0 or offset + size > reserved or chunk_id < 0:
            raise ValueError(f"layout: {name} is outside the reservation of {reserved} bytes")
        if chunk_id in places:
            raise ValueError(f"layout: {name} repeats chunk id {chunk_id}")
        places[chunk_id] = (offset, size)
        spans.append((offset, offset + size, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"layout: {second} overlaps {first}")
    sent: set[int] = set()
    chunks = _layout_list(layout, "chunks")
    for i, entry in enumerate(chunks):
        name = f"chunks[{i}] = {entry!r:.100}"
        offset, size, chunk_id = _chunk_entry(entry, name)
        if places.get(chunk_id) != (offset, size):
            raise ValueError(f"layout: {name} is not listed in all_chunks")
        if chunk_id in sent:
            raise ValueError(f"layout: {name} is sent twice")
        sent.add(chunk_id)
    if len(chunks) != num_fds:
        raise ValueError(f"layout names {len(chunks)} chunks but {num_fds} descriptors came")
    backed = IntervalSet()
    for start, end, _ in spans:
        backed.add(start, end)
    for i, (offset, size) in enumerate(zip(offsets, committed)):
        if size and not backed.covers(offset, offset + size):
            raise ValueError(
                f"layout: committed_sizes[{i}] = {size} reaches bytes of segment {i} that no "
                "chunk of all_chunks backs"
            )
