"""The books a :class:`~jaxbuf.testing.FaultInjectingDriver` keeps of a driver's live state,
and the invariants they must hold (:func:`problems`, :func:`leftovers`). Pure functions over
one consistent copy (:class:`Books`), so a check never mixes state from before and after a
release that a finalizer makes while the check runs."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Books", "leftovers", "problems", "within"]


def within(reservations: dict[int, int], ptr: int, size: int) -> bool:
    """Whether ``[ptr, ptr + size)`` lies inside one of ``reservations`` (base -> size)."""
    return any(base <= ptr and ptr + size <= base + n for base, n in reservations.items())


class Books(NamedTuple):
    """A copy of a fault-injecting driver's books, for its checks."""

    violations: list[str]
    created: int
    released: int
    live_handles: dict[int, Any]
    reservations: dict[int, int]
    mapped: dict[int, list]  # ptr -> (size, handle, accessible)
    pinned: dict[int, int]


def problems(books: Books) -> list[str]:
    """Every broken invariant, as sentences: handles counted, every mapped chunk accessible,
    of a live handle, inside a reservation and overlapping no other."""
    found = list(books.violations)
    if books.created - books.released != len(books.live_handles):
        found.append(
            f"created ({books.created}) - released ({books.released}) != "
            f"{len(books.live_handles)} live handles"
        )
    chunks = sorted(books.mapped.items())
    for (ptr, (size, handle, accessible)), nxt in zip(chunks, chunks[1:] + [None]):
        if not accessible:
            found.append(f"chunk at {ptr:#x} ({size} bytes) is mapped without access")
        if id(handle) not in books.live_handles:
            found.append(f"chunk at {ptr:#x} is mapped but its handle was released")
        if not within(books.reservations, ptr, size):
            found.append(f"chunk at {ptr:#x} ({size} bytes) lies outside every reservation")
        if nxt is not None and nxt[0] < ptr + size:
            found.append(f"chunks at {ptr:#x} and {nxt[0]:#x} overlap")
    return found


def leftovers(books: Books) -> list[str]:
    """:func:`problems`, and anything still alive: handles, mapped chunks, reservations and
    pinned host allocations."""
    found = problems(books)
    if books.live_handles:
        found.append(f"{len(books.live_handles)} live physical handle(s)")
    if books.mapped:
        found.append(f"{len(books.mapped)} mapped chunk(s)")
    if books.reservations:
        found.append(
            f"{len(books.reservations)} live reservation(s): {[hex(p) for p in books.reservations]}"
        )
    if books.pinned:
        found.append(f"{len(books.pinned)} live pinned host allocation(s)")
    return found
