"""``python -m jaxbuf``: the command line of :mod:`jaxbuf.cli` (``info``, ``bench``, ``demo``)."""

import sys

from jaxbuf.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
