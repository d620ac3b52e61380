"""A jitted JAX decode step over an :class:`~jaxbuf.kv.ExtensibleKVCacheBuffers`, at a cost
that follows the committed blocks (:class:`KVCacheStep`, :func:`donation_in_place`).

The JAX wing of the KV cache: with ``jaxbuf/staged/_jax_*`` the only modules outside the
adapters that import JAX (inside functions).
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._checks import as_shape
from .._debug import debug_enabled
from .._errors import ClosedError
from ..devices import Device, DeviceLike, as_device
from ..dtypes import DTypeLike, canonical_dtype
from ..extensible import ExtensibleTensor, granule_size
from ..views import BufferView
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


class _CacheArray(NamedTuple):
    """One array ``fn`` gets: ``planes`` segments of one tensor (1 per segment in the default
    layout, all of them with a ``segment_shape``), imported once over the full capacity."""

    view: BufferView  # shape (*segment_shape, capacity, *block_shape)
    segment_shape: tuple[int, ...]  # () in the default layout
    block_shape: tuple[int, ...]
    block_bytes: int  # one block of one segment
    planes: int  # segments in the array: prod(segment_shape)

    def shape(self, blocks: int) -> tuple[int, ...]:
        return (*self.segment_shape, blocks, *self.block_shape)


class KVCacheStep:
    """``fn`` jitted over the cache's memory, imported into JAX once, at a cost that follows
    the committed blocks, never the capacity.

    ``fn(caches, *args, **kwargs) -> (caches, out)``: ``caches`` is a list of JAX arrays of
    ``dtype`` over the cache; ``fn`` returns them updated (``.at[...].set``), in the same
    shapes and dtype, with its output. Calling the step runs ``fn`` and returns ``out``; the
    cache's committed blocks then hold the updated values, and the next step (or torch, or
    a transfer) reads them there.

    The arrays, with ``blocks`` = :attr:`blocks`:

    * by default one per segment of each tensor (the :meth:`ExtensibleKVCacheBuffers.layer_views`
      entries), of shape ``(blocks, *block_shape)``;
    * with ``segment_shape``, one per tensor (per entry of ``kv.buffers``) over all its
      segments, of shape ``(*segment_shape, blocks, *block_shape)``: the engine's layout, e.g.
      ``segment_shape=(layers, 2)``, ``block_shape=(block_tokens, heads, head_dim)`` for
      ``cache[layer, k_or_v, block, token]``. The segments must be back-to-back planes of
      ``num_blocks_capacity`` blocks (as :class:`ExtensibleKVCacheBuilder` reserves them),
      ``prod(segment_shape)`` of them, in row-major order.

    ``block_shape`` is one block of one segment (default: one dimension of its elements).

    What ``fn`` must keep to: it reads and writes blocks only through block ids below
    ``kv.num_blocks_committed``, and it does not rely on the block dimension being the
    capacity (where the step copies, it is a bucket). Outside that, on the CPU, a read of an
    uncommitted block returns what the memory holds (zeros unless something else wrote
    there) or, past the bucket, JAX's clamped index (another block); a write there is
    dropped. On a GPU such a read faults. Debug mode turns both into an ``IndexError``.

    Where the writes go, and the cost of a step:

    * where JAX writes a donated import in place (its GPU client, :func:`donation_in_place`;
      :attr:`in_place` is True), the full-capacity arrays are donated and the outputs, which
      alias the buffers, are the next step's inputs: ``blocks`` is the capacity, nothing is
      copied, and one executable serves every commit. A GPU whose JAX copies a donated import
      is refused (outside debug mode).
    * where JAX copies a donated import (its CPU client), nothing is donated. Inside the jit
      each array is sliced to ``blocks`` = the smallest power of two at or above
      ``num_blocks_committed`` (at least 1, at most the capacity), which XLA copies into the
      outputs, and after the step each segment's committed blocks are copied back (one
      batched copy through the driver): about twice the committed bytes per step, whatever
      the capacity. One executable per bucket (and argument signature): at most
      ``ceil(log2(capacity)) + 1`` buckets.

    Debug mode (``debug=True``, or ``JAXBUF_DEBUG`` set when ``debug`` is None) is as strict
    on the CPU as a GPU, at a cost: ``blocks`` is exactly ``num_blocks_committed`` on every
    device (a GPU then copies back too), one executable per committed count, and ``fn`` runs
    under ``checkify`` with ``index_checks``: an out-of-bounds gather or scatter, such as a
    read or write of an uncommitted block, raises ``IndexError`` naming the step and the
    committed count, and nothing is copied back, so the cache keeps its values.

    ``jit_options`` go to ``jax.jit`` (``static_argnums``, ``static_argnames``,
    ``donate_argnums``, ``donate_argnames``, ``in_shardings``, ``out_shardings``,
    ``compiler_options``, ...), counting ``fn``'s own parameters (``caches`` is 0); keyword
    arguments of a call reach ``fn``. The caches can be neither static nor donated by the
    caller (``ValueError``): the step decides. Pass other arrays imported once (a
    :meth:`DeviceParamTable.arrays` dict) as ``args``. Free the cache only after the last step
    (donated outputs alias it and hold no reference to it); :meth:`close` drops them. A step
    copies back only the blocks still committed when it ends, so ``fn`` (or a callback in it)
    releasing or freeing the cache drops its writes. Not thread-safe: the thread that steps
    is the one that commits, releases and frees the cache (as :class:`ExtensibleKVCacheBuffers`
    requires); concurrent steps race for the blocks they write, the last copy winning.
    """

    def __init__(
        self,
        kv: ExtensibleKVCacheBuffers,
        fn: Callable[..., Any],
        dtype: DTypeLike,
        block_shape: Any = None,
        *,
        segment_shape: Any = None,
        debug: bool | None = None,
        **jit_options: Any,
    ) -> None:
        if not isinstance(kv, ExtensibleKVCacheBuffers):
            raise TypeError(f"kv must be an ExtensibleKVCacheBuffers, got {kv!r}")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self.debug = debug_enabled(debug)
        if segment_shape is None:
            arrays = _segment_arrays(kv, dtype, block_shape)
        else:
            arrays = _tensor_arrays(kv, dtype, block_shape, segment_shape)
        if not arrays:
            raise ValueError("the cache has no tensors")
        device = kv.device
        donates_in_place = donation_in_place(device)
        if not donates_in_place and device.is_cuda and not self.debug:
            raise RuntimeError(
                f"JAX copies a donated import on {device}: a step over the cache there would "
                "read its uncommitted memory; upgrade JAX or write the cache from torch"
            )
        self.kv = kv
        #: Whether the step donates the caches and JAX writes them in place (no copy back).
        self.in_place = donates_in_place and not self.debug
        # A CPU driver in debug mode maps uncommitted memory with no access, so a bucket's
        # slice past the committed blocks would fault there: exactly the committed blocks.
        driver = arrays[0].view.owner.driver
        self._exact_blocks = self.debug or getattr(driver, "debug", False) is True
        self._fn = fn
        self._arrays = arrays
        self._jit_options = _checked_jit_options(fn, jit_options, self.in_place)
        self._jitted: dict[int, Any] = {}
        # Each segment plane, in the order of the outputs: the array holding it, its start
        # in the buffer, its index in the array and its block's bytes (the write-back's copies).
        planes = [(i, p, array) for i, array in enumerate(arrays) for p in range(array.planes)]
        capacity = kv.num_blocks_capacity
        self._plane_array = np.array([i for i, _, _ in planes], np.intp)
        self._destinations = np.array(
            [array.view.ptr + p * capacity * array.block_bytes for _, p, array in planes],
            np.uint64,
        )
        self._plane_index = np.array([p for _, p, _ in planes], np.uint64)
        self._plane_bytes = np.array([array.block_bytes for _, _, array in planes], np.uint64)
        # Per (bucket, blocks copied): each plane's offset in its output, its bytes to copy.
        self._copy_plans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._shapes: dict[int, list[tuple[int, ...]]] = {}
        self._numpy_dtype = arrays[0].view.dtype.numpy  # one dtype for every array
        self._jitted_for(self.blocks)  # a bad jit option raises here, not at the first step
        self._caches: list[Any] | None = [array.view.to_jax() for array in arrays]
        self._checked = False
        self._layouts_checked: int | None = -1  # compiled() when output layouts were checked

    @property
    def blocks(self) -> int:
        """The block dimension ``fn`` sees now: the capacity where the step writes in place,
        ``num_blocks_committed`` in debug mode (the step's or its CPU driver's), else the
        smallest power of two at or above it (at least 1), at most the capacity."""
        return self._blocks_for(self.kv.num_blocks_committed)

    def _blocks_for(self, committed: int) -> int:
        capacity = self.kv.num_blocks_capacity
        if self.in_place:
            return capacity
        if self._exact_blocks:
            return committed
        return min(capacity, 1 << max(committed - 1, 0).bit_length())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` and return its output. ``ClosedError`` for a closed step or a freed
        cache (nothing runs); ``ValueError`` / ``TypeError`` naming the output when ``fn``
        returns caches the buffers cannot take (a count, shape, dtype or layout other than the
        inputs'), and in debug mode ``IndexError`` for an out-of-bounds index, raised before
        any byte is copied back, so the cache keeps its values."""
        caches = self._caches
        if caches is None:
            raise ClosedError("KVCacheStep", "closed")
        if self.kv.freed:
            raise ClosedError("ExtensibleKVCacheBuffers", "freed", "a KVCacheStep needs its cache")
        committed = self.kv.num_blocks_committed
        blocks = self._blocks_for(committed)
        if self.in_place:
            try:
                return self._step_in_place(caches, blocks, committed, args, kwargs)
            except BaseException:
                self._reimport_deleted()
                raise
        updated, out = self._run(caches, blocks, committed, args, kwargs)
        self._write_back(updated, blocks, committed)
        return out

    def _run(
        self, caches: list[Any], blocks: int, committed: int, args: Any, kwargs: Any
    ) -> tuple[list[Any], Any]:
        """Run the step over ``blocks`` blocks: its checked output caches and ``out``."""
        result = self._jitted_for(blocks)(caches, *args, **kwargs)
        if self.debug:
            error, result = result
            self._raise_index_error(error.get(), committed)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(
                f"fn must return (caches, out), got {type(result).__name__}"
                + (f" of {len(result)} items" if isinstance(result, (tuple, list)) else "")
            )
        updated, out = result
        if not isinstance(updated, (tuple, list)):
            raise TypeError(
                f"fn must return (caches, out) with caches a list of arrays, got caches of "
                f"type {type(updated).__name__}"
            )
        updated = list(updated)
        # An executable's outputs keep one layout: check it on each new one's first run
        # (reading an array's layout costs about 10 us a step).
        compiled = self.compiled()
        self._check_outputs(
            updated, blocks, layout=compiled is None or compiled != self._layouts_checked
        )
        self._layouts_checked = compiled
        return updated, out

    def _step_in_place(
        self, caches: list[Any], blocks: int, committed: int, args: Any, kwargs: Any
    ) -> Any:
        updated, out = self._run(caches, blocks, committed, args, kwargs)
        if not self._checked:
            self._check_aliasing(updated)
        if self._caches is not None:  # not closed meanwhile (by fn, or a callback in it)
            self._caches = updated
        return out

    def _reimport_deleted(self) -> None:
        """After a failed in-place step: arrays over the buffers again for the caches JAX
        deleted as donated (the memory holds what the step wrote), so the next step runs."""
        caches = self._caches
        if caches is None or self.kv.freed or not any(c.is_deleted() for c in caches):
            return  # (a freed cache: the next step raises ClosedError for it)
        self._caches = [
            array.view.to_jax() if cache.is_deleted() else cache
            for cache, array in zip(caches, self._arrays)
        ]

    def _jitted_for(self, blocks: int) -> Any:
        """The jitted step over ``blocks`` blocks, made on first use (each traces and
        compiles on its first call, as ``jax.jit`` does)."""
        jitted = self._jitted.get(blocks)
        if jitted is None:
            jitted = self._jitted[blocks] = self._jit(blocks)
        return jitted

    def _jit(self, blocks: int) -> Any:
        import jax

        fn = self._fn
        axes = [len(array.segment_shape) for array in self._arrays]
        sliced = blocks != self.kv.num_blocks_capacity

        def step(caches: list[Any], *args: Any, **kwargs: Any) -> Any:
            if sliced:  # fn reads, and XLA copies, only the first ``blocks`` blocks
                caches = [
                    jax.lax.slice_in_dim(cache, 0, blocks, axis=axis)
                    for cache, axis in zip(caches, axes)
                ]
            return fn(caches, *args, **kwargs)

        if self.debug:
            from jax.experimental import checkify

            def checked_step(caches: list[Any], *args: Any, **kwargs: Any) -> Any:
                # The closure keeps static arguments static (checkify traces its arguments).
                checked = checkify.checkify(
                    lambda: step(caches, *args, **kwargs), errors=checkify.index_checks
                )
                return checked()

            traced = checked_step
        else:
            traced = step
        options = self._jit_options
        if self.debug and "out_shardings" in options:  # fn's outputs come after checkify's error
            options = {**options, "out_shardings": (None, options["out_shardings"])}
        # fn's signature, for static_argnames / donate_argnames and jit's error messages.
        functools.update_wrapper(traced, fn, updated=())
        return jax.jit(traced, **options)

    def _raise_index_error(self, message: str | None, committed: int) -> None:
        if message is not None:
            raise IndexError(
                f"KVCacheStep({_name(self._fn)}) indexed out of bounds with {committed} "
                f"blocks committed (debug mode: the caches hold only the committed blocks); "
                f"nothing was written to the cache: {message.strip()}"
            )

    def _check_outputs(self, updated: list[Any], blocks: int, layout: bool = True) -> None:
        """Each output is what the step copies back or keeps: the input's shape and dtype,
        row-major (the write-back copies raw bytes, so anything else would over-read or
        scramble)."""
        if len(updated) != len(self._arrays):
            raise ValueError(f"fn returned {len(updated)} caches, expected {len(self._arrays)}")
        shapes = self._shapes.get(blocks)
        if shapes is None:
            shapes = self._shapes[blocks] = [array.shape(blocks) for array in self._arrays]
        for i, (array, expected) in enumerate(zip(updated, shapes)):
            shape, dtype = getattr(array, "shape", None), getattr(array, "dtype", None)
            if shape is None or dtype is None or not hasattr(array, "unsafe_buffer_pointer"):
                raise TypeError(f"fn returned caches[{i}] = {array!r}, not a JAX array")
            if shape != expected:
                raise ValueError(
                    f"fn returned caches[{i}] of shape {tuple(shape)}; it was passed {expected}"
                )
            if dtype != self._numpy_dtype:
                raise TypeError(
                    f"fn returned caches[{i}] of dtype {dtype}; the buffer holds "
                    f"{self._arrays[i].view.dtype}"
                )
            if not layout:
                continue
            order = getattr(
                getattr(getattr(array, "format", None), "layout", None), "major_to_minor", None
            )
            if order is not None and tuple(order) != tuple(range(len(shape))):
                raise ValueError(
                    f"fn returned caches[{i}] in layout {tuple(order)} (major to minor); the "
                    "buffer holds it row-major"
                )

    def _check_aliasing(self, updated: list[Any]) -> None:
        for array, output in zip(self._arrays, updated):
            if output.unsafe_buffer_pointer() != array.view.ptr:
                self._caches = None
                raise RuntimeError(
                    "the donated cache was not updated in place (JAX returned a new array); "
                    "the step is closed"
                )
        self._checked = True

    def _write_back(self, updated: list[Any], blocks: int, committed: int) -> None:
        """Copy each segment's committed blocks from the outputs (new arrays of ``blocks``
        blocks) into the buffers, in one batched copy: the blocks committed both when the
        step began and once it ran (fn, or a callback in it, may release or free the cache;
        its writes to blocks released meanwhile are dropped, as any write there is)."""
        import jax

        jax.block_until_ready(updated)
        committed = min(committed, self.kv.num_blocks_committed)  # 0 once freed
        if not committed:
            return
        plan = self._copy_plans.get((blocks, committed))
        if plan is None:
            offsets = self._plane_index * np.uint64(blocks) * self._plane_bytes
            sizes = self._plane_bytes * np.uint64(committed)
            plan = self._copy_plans[blocks, committed] = (offsets, sizes)
        offsets, sizes = plan
        pointers = np.array([output.unsafe_buffer_pointer() for output in updated], np.uint64)
        sources = pointers[self._plane_array] + offsets
        view = self._arrays[0].view
        driver, index = view.owner.driver, view.device.index
        event = driver.copy_batch(self._destinations, sources, sizes, index)
        if event is not None:  # a device's copy: done before the next step reads the cache
            try:
                driver.event_synchronize(event)
            finally:
                driver.destroy_event(event)

    @property
    def caches(self) -> list[Any]:
        """Full-capacity arrays over the buffers' memory (the memory the next step reads),
        imported afresh: the step's own arrays stay its own, so a caller donating one of
        these (which deletes it) cannot break the next step."""
        if self._caches is None:
            raise ClosedError("KVCacheStep", "closed")
        if self.kv.freed:
            raise ClosedError("ExtensibleKVCacheBuffers", "freed", "a KVCacheStep needs its cache")
        return [array.view.to_jax() for array in self._arrays]

    def compiled(self) -> int | None:
        """Executables compiled so far, over every bucket (None where JAX does not say)."""
        sizes = [getattr(jitted, "_cache_size", None) for jitted in self._jitted.values()]
        if not all(callable(size) for size in sizes):
            return None
        return sum(size() for size in sizes)

    def close(self) -> None:
        """Drop the arrays over the cache (before freeing it). Safe to call twice."""
        self._caches = None


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _segment_arrays(kv: ExtensibleKVCacheBuffers, dtype: Any, block_shape: Any) -> list[Any]:
    """One array per segment of each tensor (``layer_views``, as BufferViews also of a face's
    cache, whose views are arrays); a ``block_shape`` that fills a whole block of several
    segments points at ``segment_shape``."""
    arrays = []
    for index, (tensor, block_bytes) in enumerate(kv.buffers):
        try:
            views = ExtensibleKVCacheBuffers.segment_views(kv, index, None, dtype, block_shape)
        except ValueError as error:
            hint = _segment_shape_hint(tensor.num_segments, block_bytes, dtype, block_shape)
            if hint is None:
                raise
            raise ValueError(f"{error}: {hint}") from None
        shape = views[0].shape[1:]
        arrays += [_CacheArray(view, (), shape, block_bytes, 1) for view in views]
    return arrays


def _segment_shape_hint(segments: int, block_bytes: int, dtype: Any, block_shape: Any) -> Any:
    """What to pass when ``block_shape`` is a block of all ``segments`` segments (the
    engine's layout, with the segment dimensions first): None when it is not."""
    if segments < 2 or block_shape is None:
        return None
    try:
        shape = as_shape(block_shape, "block_shape")
        itemsize = canonical_dtype("uint8" if dtype is None else dtype).itemsize
    except (TypeError, ValueError):
        return None
    if math.prod(shape) * itemsize != segments * block_bytes:
        return None
    split = next((k for k in range(1, len(shape)) if math.prod(shape[:k]) == segments), None)
    example = (
        f"segment_shape={shape[:split]}, block_shape={shape[split:]}"
        if split is not None
        else "segment_shape (the segments' dimensions) and block_shape (one segment's block)"
    )
    return (
        f"that is a block of all {segments} segments of a tensor ({block_bytes} bytes each); "
        f"for one array per tensor over its segments pass {example}"
    )


def _tensor_arrays(
    kv: ExtensibleKVCacheBuffers, dtype: Any, block_shape: Any, segment_shape: Any
) -> list[Any]:
    """One array per tensor, ``(*segment_shape, capacity, *block_shape)`` over its segments:
    ValueError when the segments' count differs or they are not back-to-back planes of the
    capacity (one import would take the bytes between them)."""
    segment_shape = as_shape(segment_shape, "segment_shape")
    if not segment_shape:
        raise ValueError("segment_shape must have at least one dimension, got ()")
    capacity = kv.num_blocks_capacity
    arrays = []
    for index, (tensor, block_bytes) in enumerate(kv.buffers):
        segments = tensor.num_segments
        if math.prod(segment_shape) != segments:
            raise ValueError(
                f"segment_shape {segment_shape} holds {math.prod(segment_shape)} segments; "
                f"buffers[{index}] has {segments}"
            )
        # The first segment's view checks block_shape and gives the element and the start.
        first = ExtensibleKVCacheBuffers.segment_views(kv, index, 1, dtype, block_shape)[0]
        shape = first.shape[1:]
        plane = capacity * block_bytes
        offsets = tensor.segment_offsets
        if any(offset != offsets[0] + s * plane for s, offset in enumerate(offsets)):
            raise ValueError(
                f"buffers[{index}]'s segments (at byte offsets {offsets}) are not back-to-back "
                f"planes of {capacity} blocks of {block_bytes} bytes: one array over them "
                "would hold the bytes between them; leave segment_shape out (an array per "
                "segment)"
            )
        view = BufferView(
            first.ptr,
            segments * plane,
            first.dtype,
            (*segment_shape, capacity, *shape),
            first.device,
            first.owner,
            first.dlpack_device_type,
        )
        arrays.append(_CacheArray(view, segment_shape, shape, block_bytes, segments))
    return arrays


def _argnums(options: dict[str, Any], name: str) -> tuple[int, ...]:
    value = options.get(name)
    if value is None:
        return ()
    try:
        return (operator.index(value),)  # one int, a numpy one included
    except TypeError:
        pass
    try:
        return tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {value!r}") from None


def _argnames(options: dict[str, Any], name: str) -> tuple[str, ...]:
    value = options.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)
    except TypeError:
        names = (value,)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{name} must be a str or a sequence of strs, got {value!r}")
    return names


def _caches_parameter(fn: Any) -> str | None:
    """The name of ``fn``'s first parameter (the caches), None where it has none by name."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.POSITIONAL_ONLY,
    ):
        return parameters[0].name
    return None


def _checked_jit_options(fn: Any, options: dict[str, Any], donate_caches: bool) -> dict[str, Any]:
    """``options`` for ``jax.jit``, with the caches (argument 0) donated where the step writes
    in place; ValueError when the caller makes the caches static or donates them."""
    options = dict(options)
    caches_name = _caches_parameter(fn)
    for kind in ("static", "donate"):
        numbers = _argnums(options, f"{kind}_argnums")
        if any(n < 0 for n in numbers):
            raise ValueError(
                f"{kind}_argnums {numbers}: count fn's parameters from 0 (the caches), not from "
                "the end"
            )
        names = _argnames(options, f"{kind}_argnames")
        if 0 in numbers or (caches_name is not None and caches_name in names):
            what = "static" if kind == "static" else "donated"
            raise ValueError(
                f"{kind}_argnums / {kind}_argnames name the caches (fn's argument 0"
                f"{'' if caches_name is None else f', {caches_name!r}'}): they cannot be "
                f"{what} by the caller; the step donates them where JAX writes a donated "
                "import in place and copies the committed blocks back elsewhere"
            )
        if kind == "donate" and donate_caches:
            options["donate_argnums"] = (0, *numbers)
    return options
