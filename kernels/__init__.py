"""Staged-write kernels (installed as ``jaxbuf.kernels``).

Importing this package needs only numpy. The Triton launcher lives in
:mod:`jaxbuf.kernels.staged_write` and is imported on first use, so a machine without Triton can
still use the numpy reference, selected explicitly; the JAX launcher (writes applied inside
``jit``) in :mod:`jaxbuf.kernels.jax_staged`. Launchers are the one place outside
:mod:`jaxbuf.interop` that may import a framework.
"""

from .reference import (
    CONTENT_ALIGNMENT,
    GROUP_FIELDS,
    WRITE_FIELDS,
    IntsAt,
    address_of,
    apply_staged_writes_numpy,
    has_overlap,
    make_group_table,
    make_write_table,
    pack_contents,
    resolve_later_wins,
    row_segments,
)

__all__ = [
    "CONTENT_ALIGNMENT",
    "GROUP_FIELDS",
    "IntsAt",
    "WRITE_FIELDS",
    "address_of",
    "apply_staged_writes",
    "apply_staged_writes_numpy",
    "has_overlap",
    "make_group_table",
    "make_write_table",
    "pack_contents",
    "resolve_later_wins",
    "row_segments",
]


def apply_staged_writes(*args, **kwargs):
    """Triton launcher; see :func:`jaxbuf.kernels.staged_write.apply_staged_writes`.

    Raises ImportError naming the missing extra when Triton is not installed.
    """
    try:
        from .staged_write import apply_staged_writes as launch
    except ImportError as error:
        if getattr(error, "name", None) != "triton":
            raise
        raise ImportError(
            "jaxbuf.kernels.apply_staged_writes needs Triton; install it, or use "
            "apply_staged_writes_numpy explicitly"
        ) from error
    return launch(*args, **kwargs)
