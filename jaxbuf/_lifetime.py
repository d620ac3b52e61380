"""Releasing platform resources from ``__del__``, the same way everywhere.

An object that owns driver resources frees them when it is collected, but a collector has no
caller to raise to, and at interpreter exit the platform runtime may already be gone (a driver
call there can abort the process; the process returns its memory anyway). So: never while the
interpreter is finalizing, and a failure becomes a ``ResourceWarning`` naming what leaked,
instead of an "Exception ignored" line or silence.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable


def release_when_collected(
    release: Callable[[], object],
    what: str,
    _is_finalizing: Callable[[], bool] = sys.is_finalizing,
    _warn: Callable[..., None] = warnings.warn,
) -> None:
    """Call ``release()`` on behalf of a ``__del__``; see the module docstring.

    Callers bind this function as a default argument of ``__del__``, so it is reachable even
    after module globals are cleared at exit; its own helpers are bound the same way.
    """
    if _is_finalizing():
        return
    try:
        release()
    except Exception as error:  # noqa: BLE001 - no caller to raise to: reported, not hidden
        _warn(
            f"jaxbuf: releasing {what} during garbage collection failed (it leaks): {error!r}",
            ResourceWarning,
            stacklevel=3,
        )
