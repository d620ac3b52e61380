"""Compatibility shim: the fused writer moved to :mod:`jaxbuf.staged`.

``from jaxbuf.fused import FusedStagedWriter`` keeps working; new code imports
:class:`jaxbuf.FusedStagedWriter` (or ``jaxbuf.staged.FusedStagedWriter``). Nothing but
re-exports lives here.
"""

from jaxbuf.staged._fused import DEVICE_COPY_MIN_BYTES, FusedStagedWriter

__all__ = ["DEVICE_COPY_MIN_BYTES", "FusedStagedWriter"]
