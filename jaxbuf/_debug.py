"""Debug mode: the CPU made as strict as a GPU where it would otherwise stay silent.

``JAXBUF_DEBUG=1`` in the environment turns it on; an argument named ``debug`` overrides it
for one object. Each object reads it when it is made: a ``KVCacheStep`` at construction, the
CPU driver once, when the process first uses it (its first CPU buffer, or before that a call
such as ``granule_size("cpu")``, ``is_uva_available()`` or ``get_vmm_driver("cpu")``), so a
reservation never mixes protections. Off by default: each check costs
time or memory that a serving loop should not pay. What it changes is listed in
``docs/JAX_SEMANTICS.md``.
"""

from __future__ import annotations

import os

__all__ = ["DEBUG_ENV", "debug_enabled"]

DEBUG_ENV = "JAXBUF_DEBUG"

_OFF = frozenset({"", "0", "false", "no", "off"})


def debug_enabled(override: bool | None = None) -> bool:
    """``override`` when given, else whether ``JAXBUF_DEBUG`` is set to something other than
    ``""``, ``0``, ``false``, ``no`` or ``off`` (any case)."""
    if override is not None:
        if not isinstance(override, bool):
            raise TypeError(f"debug must be True, False or None, got {override!r}")
        return override
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in _OFF
