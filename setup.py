"""Builds jaxbuf's C: the DLPack capsules (deleter, destructor, ExportAnchor) and DLPack's C
exchange API, and the staging fast path.

Everything else is configured in pyproject.toml. The capsule deleter must be C because it runs
on any thread (JAX calls it from its own) and possibly during interpreter shutdown, where it
must not touch Python; telling whether the interpreter is finalizing needs ``_Py_IsFinalizing``
before 3.13, outside the limited API, so ``jaxbuf._capsule`` is built per Python version (see
jaxbuf/_capsule.c). ``jaxbuf._staging`` is optional (jaxbuf.staged falls back to Python without
it); it needs the buffer protocol, outside the 3.10 limited API, and numpy's C API (built
against numpy 2, which runs with every numpy jaxbuf supports). ``jaxbuf.drivers._cuda_calls``
(optional) makes the CUDA driver's hot calls through pointers the driver hands it; it links
no CUDA library, so it builds on any machine. ``jaxbuf.drivers._host_calls`` (optional) is the
CPU driver's batched copy, a loop of memmove with the GIL released; it links nothing.
"""

import numpy
from setuptools import Extension, setup

# The batched copy's array checks, included by both driver C modules (next to them, so the
# include resolves from the source's own directory).
_BATCH_ARRAYS = "jaxbuf/drivers/_batch_arrays.h"

setup(
    ext_modules=[
        # The capsules and, in _exchange.c, DLPack's C exchange API over the same tensors.
        Extension(
            "jaxbuf._capsule",
            sources=["jaxbuf/_capsule.c", "jaxbuf/_exchange.c"],
            depends=["jaxbuf/_capsule.h"],
        ),
        Extension(
            "jaxbuf._staging",
            sources=["jaxbuf/_staging.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
        ),
        # Optional too: without it the CUDA driver calls everything through cuda.bindings.
        Extension(
            "jaxbuf.drivers._cuda_calls",
            sources=["jaxbuf/drivers/_cuda_calls.c"],
            depends=[_BATCH_ARRAYS],
            optional=True,
        ),
        # Optional: without it the CPU driver's copy_batch is a ctypes.memmove loop.
        Extension(
            "jaxbuf.drivers._host_calls",
            sources=["jaxbuf/drivers/_host_calls.c"],
            depends=[_BATCH_ARRAYS],
            optional=True,
        ),
    ]
)
