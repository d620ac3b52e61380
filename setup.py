"""Builds jaxbuf's C: the DLPack capsule destructor, and the staging fast path.

Everything else is configured in pyproject.toml. The destructor must be C because it runs
when an unconsumed capsule dies, possibly during interpreter shutdown, where calling back into
Python is unsafe (see jaxbuf/_capsule.c). ``jaxbuf._staging`` is optional (staged.py falls back
to Python without it); it needs the buffer protocol, outside the 3.10 limited API.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "jaxbuf._capsule",
            sources=["jaxbuf/_capsule.c"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        ),
        Extension("jaxbuf._staging", sources=["jaxbuf/_staging.c"], optional=True),
    ]
)
