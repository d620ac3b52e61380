"""A jitted JAX decode step over an :class:`~jaxbuf.kv.ExtensibleKVCacheBuffers`, writing the
cache in place where JAX allows (:class:`KVCacheStep`, :func:`donation_in_place`).

The JAX wing of the KV cache: with ``jaxbuf/staged/_jax_*`` the only modules outside the
adapters that import JAX (inside functions).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from .._errors import ClosedError
from ..devices import Device, DeviceLike, as_device
from ..dtypes import DTypeLike
from ..extensible import ExtensibleTensor, granule_size
from ._buffers import ExtensibleKVCacheBuffers

__all__ = ["KVCacheStep", "donation_in_place"]


def donation_in_place(device: DeviceLike | None = None) -> bool:
    """Whether a jitted step that donates an array imported from jaxbuf memory on ``device``
    writes that memory in place: JAX's GPU client does; its CPU client copies the import and
    returns a new array. Measured once per device (a one-granule buffer, one tiny step)."""
    return _donation_in_place(as_device(device) if device is not None else as_device("cpu"))


@functools.cache
def _donation_in_place(device: Device) -> bool:
    import jax

    probe = ExtensibleTensor(granule_size(device), device=device)
    try:
        probe.resize_per_segment_(4096, zero_new=True)
        array = probe.segment_view(0).to_jax(dtype="float32", shape=(1024,))
        step = jax.jit(lambda x: x.at[0].set(1.0), donate_argnums=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable"
            result = step(array)
        result.block_until_ready()
        in_place = result.unsafe_buffer_pointer() == probe.base_ptr
        del array, result
    finally:
        probe.free()
    return in_place


class KVCacheStep:
    """``fn`` jitted over the cache's layers, imported into JAX once, over the full capacity.

    ``fn(caches, *args) -> (caches, out)``: ``caches`` is a list of JAX arrays, one per
    :meth:`ExtensibleKVCacheBuffers.layer_views` entry (``dtype``, shape
    ``(num_blocks_capacity, *block_shape)``); ``fn`` returns them updated (``.at[...].set``)
    with its output. Calling the step runs ``fn`` and returns ``out``; the cache's memory then
    holds the updated values. The shapes never change, so growing the cache (a commit, a
    release and recommit) keeps the one compiled step.

    How the writes reach the memory (:attr:`in_place`): where JAX writes a donated import in
    place (its GPU client, :func:`donation_in_place`) the caches are donated and the step's
    outputs, which alias the buffers, are the next step's inputs: nothing is copied. Where it
    copies a donated import (its CPU client) nothing is donated and the committed blocks of
    each output are copied back into the buffer after the step (a cost in committed bytes).
    A GPU on which donation is not in place is refused (the copy would read uncommitted
    memory).

    ``fn`` may touch only committed blocks (``num_blocks_committed``): reading the others
    faults on CUDA. Pass other arrays imported once (a :meth:`DeviceParamTable.arrays`
    dict) as ``args``; they are not donated. Free the cache only after the last step (the
    donated outputs alias it and hold no reference to it); :meth:`close` drops them.
    """

    def __init__(
        self,
        kv: ExtensibleKVCacheBuffers,
        fn: Callable[..., Any],
        dtype: DTypeLike,
        block_shape: Any = None,
    ) -> None:
        import jax

        if not isinstance(kv, ExtensibleKVCacheBuffers):
            raise TypeError(f"kv must be an ExtensibleKVCacheBuffers, got {kv!r}")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        # layer_views, as BufferViews also of a face's cache (whose views are arrays).
        views = [
            view
            for index in range(len(kv.buffers))
            for view in ExtensibleKVCacheBuffers.segment_views(kv, index, None, dtype, block_shape)
        ]
        if not views:
            raise ValueError("the cache has no tensors")
        device = kv.device
        self.in_place = donation_in_place(device)
        if not self.in_place and device.is_cuda:
            raise RuntimeError(
                f"JAX copies a donated import on {device}: a step over the cache there would "
                "read its uncommitted memory; upgrade JAX or write the cache from torch"
            )
        self.kv = kv
        self._views = views
        # Per layer view: the bytes of one block (a view per segment of each tensor).
        self._layer_block_bytes = [
            block_bytes for tensor, block_bytes in kv.buffers for _ in range(tensor.num_segments)
        ]
        self._jitted = jax.jit(fn, donate_argnums=(0,) if self.in_place else ())
        self._caches: list[Any] | None = [view.to_jax() for view in views]
        self._checked = False

    def __call__(self, *args: Any) -> Any:
        """Run ``fn`` and return its output. ``ClosedError`` for a closed step or a freed
        cache (nothing runs); ``ValueError`` / ``TypeError`` naming the output when ``fn``
        returns caches the buffers cannot take (a count, shape, dtype or layout other than the
        inputs'), raised before any byte is copied back, so the cache keeps its values."""
        caches = self._caches
        if caches is None:
            raise ClosedError("KVCacheStep", "closed")
        if self.kv.freed:
            raise ClosedError("ExtensibleKVCacheBuffers", "freed", "a KVCacheStep needs its cache")
        updated, out = self._jitted(caches, *args)
        updated = list(updated)
        self._check_outputs(updated)
        if self.in_place:
            if not self._checked:
                self._check_aliasing(updated)
            self._caches = updated
        else:
            self._write_back(updated)
        return out

    def _check_outputs(self, updated: list[Any]) -> None:
        """Each output is what its buffer holds: the input's shape and dtype, row-major (the
        write-back copies raw bytes, so anything else would over-read or scramble)."""
        if len(updated) != len(self._views):
            raise ValueError(f"fn returned {len(updated)} caches, expected {len(self._views)}")
        for i, (array, cache) in enumerate(zip(updated, self._caches)):
            shape, dtype = getattr(array, "shape", None), getattr(array, "dtype", None)
            if shape is None or dtype is None or not hasattr(array, "unsafe_buffer_pointer"):
                raise TypeError(f"fn returned caches[{i}] = {array!r}, not a JAX array")
            if tuple(shape) != tuple(cache.shape):
                raise ValueError(
                    f"fn returned caches[{i}] of shape {tuple(shape)}; the buffer holds "
                    f"{tuple(cache.shape)}"
                )
            if dtype != cache.dtype:
                raise TypeError(
                    f"fn returned caches[{i}] of dtype {dtype}; the buffer holds {cache.dtype}"
                )
            layout = getattr(getattr(array, "format", None), "layout", None)
            order = getattr(layout, "major_to_minor", None)
            if order is not None and tuple(order) != tuple(range(len(shape))):
                raise ValueError(
                    f"fn returned caches[{i}] in layout {tuple(order)} (major to minor); the "
                    "buffer holds it row-major"
                )

    def _check_aliasing(self, updated: list[Any]) -> None:
        for view, array in zip(self._views, updated):
            if array.unsafe_buffer_pointer() != view.ptr:
                self._caches = None
                raise RuntimeError(
                    "the donated cache was not updated in place (JAX returned a new array); "
                    "the step is closed"
                )
        self._checked = True

    def _write_back(self, updated: list[Any]) -> None:
        """Copy each output's committed blocks into the buffer (JAX made a new array)."""
        committed = self.kv.num_blocks_committed
        for view, array, block_bytes in zip(self._views, updated, self._layer_block_bytes):
            array.block_until_ready()
            nbytes = committed * block_bytes
            if nbytes:
                source = array.unsafe_buffer_pointer()
                view.owner.driver.copy(view.ptr, source, nbytes, view.device.index)

    @property
    def caches(self) -> list[Any]:
        """The arrays the next step reads (over the buffers' memory)."""
        if self._caches is None:
            raise ClosedError("KVCacheStep", "closed")
        return list(self._caches)

    def compiled(self) -> int | None:
        """Executables compiled so far (None where JAX does not say)."""
        size = getattr(self._jitted, "_cache_size", None)
        return size() if callable(size) else None

    def close(self) -> None:
        """Drop the arrays over the cache (before freeing it). Safe to call twice."""
        self._caches = None
