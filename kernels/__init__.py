"""Staged-write kernels (installed as ``jaxbuf.kernels``): functions over pointers and arrays.

The Triton kernel of the staged writes and its launchers (:mod:`jaxbuf.kernels.staged_write`,
the direct CUDA launch in :mod:`jaxbuf.kernels.cuda_launch`), the kernel that applies a JAX pack
(:mod:`jaxbuf.kernels.packed_write`, launched through ``jax_triton`` by :mod:`jaxbuf.staged`),
and the numpy reference (:mod:`jaxbuf.kernels.reference`). They import no jaxbuf owner (no
buffers, views, staged writes or framework adapters): the staged-write wing,
:mod:`jaxbuf.staged`, builds on them.

Importing this package needs only numpy; the Triton modules are imported on first use, so a
machine without Triton can still use the numpy reference, selected explicitly. Triton is
imported nowhere else in jaxbuf.
"""

from .reference import (
    CONTENT_ALIGNMENT,
    GROUP_FIELDS,
    WRITE_FIELDS,
    IntsAt,
    StagedLaunch,
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
    "StagedLaunch",
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
