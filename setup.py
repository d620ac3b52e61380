"""Builds the one C function jaxbuf needs: the DLPack capsule destructor.

Everything else is configured in pyproject.toml. The destructor must be C because it runs
when an unconsumed capsule dies, possibly during interpreter shutdown, where calling back into
Python is unsafe (see jaxbuf/_capsule.c).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "jaxbuf._capsule",
            sources=["jaxbuf/_capsule.c"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        )
    ]
)
