"""Framework adapters: everything jaxbuf knows about numpy, torch and JAX, one module each.

A framework is one object implementing :class:`FrameworkAdapter`, found by name in a small
registry: :func:`get` (``get("torch")``), :func:`adapter_for` (the adapter that recognises an
array) and :func:`register` (a new framework). The rest of jaxbuf asks the registry and never
branches on framework names: ``Device.torch()``, ``DType.jax()``, ``BufferView.to_torch()``,
the UVA pools (``framework="torch"`` is the registry name), staged writes and the launchers.
Outside this package (and the kernel launchers) nothing imports torch or JAX.

Adding a framework (CuPy, MLX) is one new file: a class implementing :class:`FrameworkAdapter`
(subclass :class:`Adapter` for the optional members), registered with :func:`register`. From
then on ``UvaBufferPool(..., framework="cupy")`` hands out its arrays and every input
conversion recognises them. ``tests/test_architecture.py`` does exactly this with a fake
framework.

Built-in adapters (``numpy``, ``torch``, ``jax``) are loaded on first use; loading one never
imports its framework. Recognising an input (:func:`adapter_for`) only asks adapters whose
framework the process has already imported (and finished importing: see
:func:`loaded_module`), so jaxbuf never imports torch or JAX to look at an argument.

Layering: this package sits just above the drivers. It imports nothing of jaxbuf but
``jaxbuf.drivers.base`` (DLPack device constants, the out-of-memory hooks): devices, dtypes
and views reach it (lazily), it receives their values and reads only their public attributes.
On import it registers :func:`release_framework_caches` as a driver out-of-memory hook.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxbuf.drivers import base as _driver_base

__all__ = [
    "DLPACK_LEGACY_STREAM",
    "Adapter",
    "FrameworkAdapter",
    "adapter_for",
    "as_dlpack_stream",
    "current_stream",
    "dtype_name",
    "get",
    "loaded_module",
    "names",
    "quiesce",
    "register",
    "release_framework_caches",
    "unregister",
]

#: DLPack's number for the legacy default stream (0 is ambiguous for CUDA in DLPack); the
#: stream jaxbuf's own producer work runs on, and the consumer stream when no framework says.
DLPACK_LEGACY_STREAM = 1


def loaded_module(name: str) -> Any:
    """Module ``name`` if it is already imported and done initialising, else None.

    Never imports. A module another thread is still importing is in ``sys.modules`` half
    built (``torch.cuda`` missing, say); importlib marks it with ``__spec__._initializing``.
    """
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


@runtime_checkable
class FrameworkAdapter(Protocol):
    """What jaxbuf needs from a framework. Implementations: :mod:`jaxbuf.interop.numpy`,
    :mod:`jaxbuf.interop.torch`, :mod:`jaxbuf.interop.jax`.

    Methods receive jaxbuf values (a :class:`~jaxbuf.devices.Device`, a
    :class:`~jaxbuf.dtypes.DType`, a :class:`~jaxbuf.views.BufferView`) and read only their
    public attributes. None of them may import a framework the caller has not asked for:
    :meth:`is_array` in particular must only look at a framework already loaded.
    """

    #: Registry key, and the ``framework=`` value of the UVA pools.
    name: str
    #: True when :meth:`from_view` imports device memory (a framework of device arrays):
    #: only those can be a pool's ``framework``. numpy: False.
    device_arrays: bool
    #: True when arrays may be written in place and an imported array stays a live window
    #: on memory that changes (torch, numpy). False for frameworks that treat arrays as
    #: immutable values (JAX caches an array's host value): their imports are never reused
    #: once the memory changed, and writes go through the driver into their buffer.
    mutable_arrays: bool

    def is_array(self, x: Any) -> bool:
        """Whether ``x`` is this framework's array. Never imports the framework."""

    def to_numpy(self, x: Any, *, device_copy: bool = True) -> np.ndarray:
        """The values of ``x`` on the host as numpy, zero-copy where ``x`` is in host memory
        (bfloat16 through ml_dtypes). ``device_copy=False``: an array that an explicit
        device-to-host copy would be needed for raises ``TypeError`` naming its device."""

    def host_array(self, array: np.ndarray) -> Any:
        """This framework's host array sharing ``array``'s memory (zero-copy)."""

    def from_view(self, view: Any) -> Any:
        """This framework's array over ``view``'s memory, zero-copy, through DLPack: pending
        producer work of the view's owner is ordered before the framework's current stream,
        and the array keeps the owner's memory alive (the capsule's anchor)."""

    def current_stream(self, device: Any) -> int | None:
        """The DLPack stream number of this framework's current stream on ``device``; None
        when the framework has none to report (not loaded, no streams, not initialised)."""

    def dtype(self, dtype: Any) -> Any:
        """This framework's dtype object for a :class:`~jaxbuf.dtypes.DType`."""

    def dtype_name(self, obj: Any) -> str | None:
        """numpy's name of ``obj`` when it is one of this framework's dtype objects that numpy
        does not understand itself, else None (``canonical_dtype`` then asks numpy)."""

    def device(self, device: Any) -> Any:
        """This framework's device object for a :class:`~jaxbuf.devices.Device`."""

    def array_device(self, x: Any) -> Any:
        """The device ``x`` lives on, as a spec :func:`jaxbuf.as_device` accepts."""

    def host_pointer(self, x: Any, dtype: Any) -> int | None:
        """The address of ``x``'s elements when ``x`` is a C-contiguous host array of
        ``dtype`` that may be read in place (the pools' one-memmove fast path), else None."""

    def copy_into(self, out: Any, source: Any) -> Any:
        """Copy ``source`` into ``out`` (same shape) on the framework's current stream, without
        blocking the host; return ``out``. TypeError for immutable arrays."""

    def clone(self, array: Any) -> Any:
        """A new array with ``array``'s values, in the same memory space (on the framework's
        stream)."""

    def buffer_pointer(self, array: Any) -> int:
        """The address of ``array``'s device buffer, after the work producing it."""

    def to_device(self, x: Any, device: Any, dtype: Any) -> Any:
        """Host data (``dtype``: a DType or None) to a new array on ``device`` through the
        framework's own staging, without blocking the host."""

    def on_out_of_memory(self) -> bool:
        """A driver ran out of memory: return the framework's cached device memory. True when
        something was released (so a retry may succeed). Never imports the framework."""

    # Optional (not required by register; :class:`Adapter` has a no-op default):
    #
    # def quiesce(self, device) -> None:
    #     Block until work this framework has queued that may touch memory on ``device``
    #     (a :class:`~jaxbuf.devices.Device`) is done; called by :func:`quiesce` before an
    #     owner releases memory. Never imports the framework, never initialises a platform.


class Adapter:
    """Defaults for the optional members of :class:`FrameworkAdapter`; subclass it and
    implement ``name``, :meth:`is_array`, :meth:`to_numpy` and :meth:`from_view` at least."""

    name = ""
    device_arrays = False
    mutable_arrays = True

    def __repr__(self) -> str:
        return f"<jaxbuf {self.name} adapter>"

    def _unsupported(self, what: str) -> TypeError:
        return TypeError(f"the {self.name} adapter does not support {what}")

    def is_array(self, x: Any) -> bool:
        raise NotImplementedError

    def to_numpy(self, x: Any, *, device_copy: bool = True) -> np.ndarray:
        raise NotImplementedError

    def from_view(self, view: Any) -> Any:
        raise NotImplementedError

    def host_array(self, array: np.ndarray) -> Any:
        raise self._unsupported("host arrays over numpy memory")

    def current_stream(self, device: Any) -> int | None:
        return None

    def dtype(self, dtype: Any) -> Any:
        raise self._unsupported("dtype objects")

    def dtype_name(self, obj: Any) -> str | None:
        return None

    def device(self, device: Any) -> Any:
        raise self._unsupported("device objects")

    def array_device(self, x: Any) -> Any:
        raise self._unsupported("device queries")

    def host_pointer(self, x: Any, dtype: Any) -> int | None:
        return None

    def copy_into(self, out: Any, source: Any) -> Any:
        raise self._unsupported("copies into an existing array")

    def clone(self, array: Any) -> Any:
        raise self._unsupported("copies")

    def buffer_pointer(self, array: Any) -> int:
        raise self._unsupported("buffer pointers")

    def to_device(self, x: Any, device: Any, dtype: Any) -> Any:
        raise self._unsupported("host-to-device copies")

    def on_out_of_memory(self) -> bool:
        return False

    def quiesce(self, device: Any) -> None:
        """Nothing to wait for (a framework without asynchronous work)."""


# -- the registry -----------------------------------------------------------------------------
# Built-ins: name -> (adapter module, the framework's top-level module, the pip extra). Loaded
# on first use; an adapter module defines ADAPTER and imports no framework at import time.
_BUILTIN = {
    "numpy": ("jaxbuf.interop.numpy", "numpy", None),
    "torch": ("jaxbuf.interop.torch", "torch", "torch"),
    "jax": ("jaxbuf.interop.jax", "jax", "jax"),
}
_RESERVED = frozenset({"view"})  # the pools' own value: a BufferView, no framework
_adapters: dict[str, FrameworkAdapter] = {}  # loaded or registered, in that order
_builtin_names = frozenset(_BUILTIN)
# What the hot lookups read, rebuilt under the lock on every change: the adapters to ask, and
# the built-ins not loaded yet (with their framework module), loaded once that is imported.
_snapshot: tuple[FrameworkAdapter, ...] = ()
_with_streams: tuple[FrameworkAdapter, ...] = ()  # those that may report a current stream
_pending: tuple[tuple[str, str], ...] = tuple((n, entry[1]) for n, entry in _BUILTIN.items())
_lock = threading.RLock()


def _rebuild() -> None:
    global _snapshot, _with_streams, _pending
    _snapshot = tuple(_adapters.values())
    # An Adapter subclass keeping the default current_stream (None) has no streams: the
    # consumer-stream lookup, on the apply path, skips it.
    _with_streams = tuple(
        adapter
        for adapter in _snapshot
        if getattr(type(adapter), "current_stream", None) is not Adapter.current_stream
    )
    _pending = tuple((n, entry[1]) for n, entry in _BUILTIN.items() if n not in _adapters)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (never imports it; ``sys.modules[name] = None``
    blocks a module, as importlib does)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _load_builtin(name: str) -> FrameworkAdapter:
    module_name, framework, extra = _BUILTIN[name]
    if not _installed(framework):
        raise ImportError(
            f"the {name} adapter needs {framework}, which is not installed "
            f"(pip install jaxbuf[{extra}])",
            name=framework,
        )
    with _lock:
        adapter = _adapters.get(name)
        if adapter is None:
            adapter = _adapters[name] = importlib.import_module(module_name).ADAPTER
            _rebuild()
    return adapter


def get(name: str) -> FrameworkAdapter:
    """The adapter registered as ``name`` (``"numpy"``, ``"torch"``, ``"jax"``, or one added
    with :func:`register`).

    ``ValueError`` for an unknown name (the message lists the known ones), ``ImportError``
    naming the extra to install when the framework is missing, ``TypeError`` for a non-str.
    """
    adapter = _adapters.get(name) if isinstance(name, str) else None
    if adapter is not None:
        return adapter
    if not isinstance(name, str):
        raise TypeError(f"framework name must be a str, got {name!r}")
    if name in _BUILTIN:
        return _load_builtin(name)
    raise ValueError(f"no framework adapter named {name!r}; known: {', '.join(names())}")


def names() -> tuple[str, ...]:
    """The names :func:`get` accepts: the built-ins, then registered adapters."""
    return (*_BUILTIN, *(n for n in _adapters if n not in _builtin_names))


def register(adapter: FrameworkAdapter) -> FrameworkAdapter:
    """Add ``adapter`` to the registry under ``adapter.name``; return it.

    ``TypeError`` when it does not implement :class:`FrameworkAdapter`; ``ValueError`` when
    the name is empty, reserved (``"view"``), a built-in's or already registered. Names are
    never replaced, so a reference to an adapter stays the registry's answer while the
    adapter stays registered (views and pools keep such references on their hot paths).
    """
    if not isinstance(adapter, FrameworkAdapter):
        missing = [
            member
            for member in ("name", "device_arrays", "mutable_arrays", *_METHODS)
            if not hasattr(adapter, member)
        ]
        raise TypeError(f"{adapter!r} is not a FrameworkAdapter: it lacks {', '.join(missing)}")
    name = adapter.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"an adapter's name must be a non-empty str, got {name!r}")
    with _lock:
        if name in _RESERVED or name in _builtin_names or name in _adapters:
            raise ValueError(f"the framework name {name!r} is taken")
        _adapters[name] = adapter
        _rebuild()
    return adapter


def unregister(name: str) -> None:
    """Remove an adapter added with :func:`register` (tests do, afterwards); ``ValueError``
    for a built-in or an unknown name."""
    with _lock:
        if name in _builtin_names or name not in _adapters:
            raise ValueError(f"{name!r} is not a registered adapter that can be removed")
        del _adapters[name]
        _rebuild()


_METHODS = tuple(
    member
    for member in vars(FrameworkAdapter)
    if not member.startswith("_") and callable(getattr(FrameworkAdapter, member))
)


def _active() -> tuple[FrameworkAdapter, ...]:
    """The adapters to ask about an object: those loaded or registered, after loading the
    built-ins whose framework has been imported meanwhile (never importing one)."""
    for name, framework in _pending:
        if loaded_module(framework) is not None:
            _load_builtin(name)
    return _snapshot


def adapter_for(x: Any) -> FrameworkAdapter | None:
    """The adapter whose :meth:`~FrameworkAdapter.is_array` recognises ``x``, or None."""
    for adapter in _active():
        if adapter.is_array(x):
            return adapter
    return None


def dtype_name(obj: Any) -> str | None:
    """numpy's name for a framework's dtype object (``torch.bfloat16`` -> ``"bfloat16"``),
    asking the loaded adapters; None when none recognises ``obj``."""
    for adapter in _active():
        name = adapter.dtype_name(obj)
        if name is not None:
            return name
    return None


def current_stream(device: Any, prefer: FrameworkAdapter | None = None) -> int:
    """The DLPack number of the consumer stream a caller means when it names none.

    ``prefer``'s current stream when it reports one, else the first loaded adapter's that
    does (torch's current stream once torch has initialised CUDA), else the legacy default
    stream. Hosts have no streams: :data:`DLPACK_LEGACY_STREAM` off CUDA.
    """
    if not device.is_cuda:
        return DLPACK_LEGACY_STREAM
    if prefer is not None:
        stream = prefer.current_stream(device)
        if stream is not None:
            return stream
    if _pending:
        _active()
    for adapter in _with_streams:
        stream = adapter.current_stream(device)
        if stream is not None:
            return stream
    return DLPACK_LEGACY_STREAM


def as_dlpack_stream(stream: Any) -> int:
    """A DLPack stream number from an int or a stream object with a ``cuda_stream`` handle
    (``torch.cuda.Stream``); 0 (CUDA's legacy handle) becomes 1. TypeError otherwise."""
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(
            f"stream must be a torch.cuda.Stream or a DLPack stream int, got {stream!r}"
        )
    return handle or DLPACK_LEGACY_STREAM


def release_framework_caches() -> bool:
    """The driver out-of-memory hook: ask every loaded adapter to return cached device memory
    (torch empties its caching allocator). True when one released something. Never imports a
    framework."""
    released = False
    for adapter in _active():
        released = bool(adapter.on_out_of_memory()) or released
    return released


def quiesce(device: Any) -> None:
    """Wait until no framework has work queued that may still touch memory on ``device``.

    Owners call this before they release memory (``ExtensibleTensor.free()``): JAX dispatches
    asynchronously, so a step over an imported (or donated) array may still run when the
    Python call returning its result is done, on the CPU as on a GPU. Asks every adapter whose
    framework the process has imported (:meth:`Adapter.quiesce`: JAX waits for its pending
    computations on the device's platform, torch synchronizes the CUDA device once it has
    initialised CUDA). Never imports a framework; errors propagate.
    """
    for adapter in _active():
        wait = getattr(adapter, "quiesce", None)  # optional for registered adapters
        if wait is not None:
            wait(device)


_load_builtin("numpy")
_driver_base.out_of_memory_hooks.append(release_framework_caches)
