"""Sharded JAX arrays over jaxbuf memory: one :class:`~jaxbuf.ExtensibleTensor` per device.

:func:`sharded_jax_array` assembles one ``jax.Array`` with a ``NamedSharding`` from one buffer
per *addressable* mesh device, zero-copy: every shard is the committed prefix of one segment
of one buffer, imported through DLPack, and ``jax.make_array_from_single_device_arrays``
stitches them together. After growing the buffers (their base pointers never move), call it
again for a larger view; the bytes already written are still there.

Beyond one host (``jax.distributed``): each process passes the buffers of its own devices
only, and every process calls :func:`sharded_jax_array` with the same mesh, spec, dtype and
shard shape (as with any multi-process JAX computation); the result is one global array whose
jitted computations run XLA's collectives across processes (NCCL on GPUs; gloo on the CPU,
JAX's default since 0.5.1). ``tests/test_sharding_distributed.py`` runs it with two processes.

JAX arrays cannot keep the buffers alive: keep every buffer alive and unfreed while the array
(or anything computed lazily from it) is in use. As with any JAX array over mutable memory,
make a new array after writing to the buffers through another framework (its import is
ordered after the buffers' ready events; see :mod:`jaxbuf.interop.jax`).

The JAX calls go through the JAX adapter (:class:`jaxbuf.interop.jax.JaxAdapter`); this module
imports no framework.

Examples
--------
>>> import jax, numpy as np
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> import jaxbuf
>>> from jaxbuf.sharding import sharded_jax_array
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
>>> buf = jaxbuf.ExtensibleTensor(2 << 20, device=jaxbuf.devices.as_device(jax.devices()[0]))
>>> buf.resize_per_segment_(16, zero_new=True)
>>> sharded_jax_array([buf], mesh, P("x"), "float32", (4,)).shape
(4,)
>>> buf.free()
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from jaxbuf import _dlpack, interop
from jaxbuf._checks import as_shape
from jaxbuf.devices import as_device
from jaxbuf.drivers.base import K_DL_CPU
from jaxbuf.dtypes import canonical_dtype
from jaxbuf.views import BufferView

__all__ = ["global_shape_of", "sharded_jax_array"]


def _as_shape(shape: Any) -> tuple[int, ...]:
    """A shard shape as a tuple of non-negative ints; TypeError / ValueError naming it."""
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shard_shape must be a sequence of ints, got {shape!r}")
    return as_shape(shape, "shard_shape")


def _axis_names(entry: Any) -> tuple[Any, ...]:
    """The mesh axis names of one ``PartitionSpec`` entry (None: none)."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def global_shape_of(mesh: Any, spec: Any, shard_shape: Sequence[int]) -> tuple[int, ...]:
    """The global shape whose shards under ``NamedSharding(mesh, spec)`` are ``shard_shape``:
    each dimension times the product of the sizes of the mesh axes it is split over."""
    shard_shape = _as_shape(shard_shape)
    entries = tuple(spec)
    if len(entries) > len(shard_shape):
        raise ValueError(
            f"partition spec {spec} has {len(entries)} entries but the shard shape "
            f"{shard_shape} has only {len(shard_shape)} dimensions"
        )
    axis_sizes = dict(mesh.shape)
    global_shape = []
    for dim, size in enumerate(shard_shape):
        factor = 1
        for name in _axis_names(entries[dim]) if dim < len(entries) else ():
            if name not in axis_sizes:
                raise ValueError(
                    f"partition spec {spec} names the axis {name!r}, which the mesh "
                    f"(axes {tuple(axis_sizes)}) lacks"
                )
            factor *= axis_sizes[name]
        global_shape.append(size * factor)
    return tuple(global_shape)


class _HostShardExport:
    """A CPU view exported with another DLPack device id, so JAX places it on the CPU
    device with that local hardware id (jaxbuf's CPU views all say device 0). Same bytes."""

    def __init__(self, view: BufferView, device_id: int) -> None:
        self._view = view
        self._device_id = device_id
        self._payload = view._pack(versioned=False, device_type=K_DL_CPU, device_id=device_id)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (K_DL_CPU, self._device_id)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        if copy:
            raise BufferError("jaxbuf views are zero-copy: copy=True is not supported")
        if stream is not None and stream != -1:
            raise BufferError(f"stream must be None for a CPU view, got {stream!r}")
        # The capsule holds the view's owner's anchor, as the view's own exports do.
        return _dlpack.new_capsule(self._payload, _dlpack.anchor_for(self._view.owner))


def _shard_to_jax(jax: Any, view: BufferView, jax_device: Any) -> Any:
    """``view`` as a single-device JAX array on ``jax_device``, zero-copy (``jax``: the JAX
    adapter)."""
    if view.device.is_cuda:
        array = jax.from_view(view)
    else:
        hardware_id = getattr(jax_device, "local_hardware_id", None)
        hardware_id = 0 if hardware_id is None else int(hardware_id)
        exporter = view if hardware_id == 0 else _HostShardExport(view, hardware_id)
        array = jax.from_dlpack(exporter)
    if array.devices() != {jax_device}:
        raise ValueError(
            f"the shard over {view} landed on {array.devices()}, not on the mesh device "
            f"{jax_device}"
        )
    return array


def sharded_jax_array(
    buffers: Iterable[Any],
    mesh: Any,
    spec: Any,
    dtype: Any,
    shard_shape: Sequence[int],
    *,
    segment: int = 0,
) -> Any:
    """One ``jax.Array`` sharded as ``NamedSharding(mesh, spec)`` over one buffer per device
    this process addresses.

    Parameters
    ----------
    buffers : sequence of ExtensibleTensor
        One per mesh device of this process, in the mesh's order: ``buffers[i]`` backs the
        shard on the i-th device of ``mesh.devices.flat`` whose ``process_index`` is this
        process's, and must live on that device (CPU buffers: any JAX CPU device). In one
        process that is every mesh device; under ``jax.distributed``, only the local ones.
    mesh : jax.sharding.Mesh
    spec : jax.sharding.PartitionSpec (or a tuple of its entries)
    dtype : any dtype jaxbuf accepts
        Must be a dtype JAX keeps as is (64-bit types need ``jax_enable_x64``).
    shard_shape : sequence of int
        Shape of every shard; the global shape is :func:`global_shape_of` of it.
    segment : int
        The segment of each buffer whose committed prefix holds the shard (default 0); it
        must hold at least ``prod(shard_shape) * itemsize`` bytes.

    Replicated mesh axes (not named in ``spec``) give several devices the same shard:
    their buffers must then hold the same values, in every process. All validation happens
    before any framework array is made; errors name the offending buffer.
    """
    from jaxbuf.extensible import ExtensibleTensor

    jax = interop.get("jax")
    spec, sharding = jax.named_sharding(mesh, spec)
    dt = canonical_dtype(dtype)
    stored = jax.canonical_numpy_dtype(dt.numpy)
    if stored != dt.numpy:
        raise ValueError(
            f"JAX would convert {dt} to {stored} (a copy); enable jax_enable_x64 or use a "
            "32-bit dtype"
        )
    shard_shape = _as_shape(shard_shape)
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Iterable):
        raise TypeError(f"buffers must be a sequence of ExtensibleTensor, got {buffers!r}")
    buffers = list(buffers)
    devices, total = jax.addressable_mesh_devices(mesh)
    if not devices:
        raise ValueError(
            f"this process addresses none of the mesh's {total} devices ({mesh.devices}): "
            "its buffers cannot back any shard"
        )
    if len(buffers) != len(devices):
        raise ValueError(
            f"expected one buffer per mesh device this process addresses ({len(devices)} of "
            f"{total}), got {len(buffers)}"
        )
    global_shape = global_shape_of(mesh, spec, shard_shape)
    if tuple(sharding.shard_shape(global_shape)) != shard_shape:
        raise ValueError(
            f"shard shape {shard_shape} does not divide into {spec} over the mesh "
            f"{dict(mesh.shape)}"
        )
    nbytes = math.prod(shard_shape) * dt.itemsize
    for i, (buffer, jax_device) in enumerate(zip(buffers, devices)):
        if not isinstance(buffer, ExtensibleTensor):
            raise TypeError(f"buffers[{i}] must be an ExtensibleTensor, got {buffer!r}")
        if buffer.base_ptr == 0:
            raise ValueError(f"buffers[{i}] has been freed")
        expected = as_device(jax_device)
        actual = as_device(buffer.device)
        if actual.platform != expected.platform or (
            expected.is_cuda and actual.index != expected.index
        ):
            raise ValueError(
                f"buffers[{i}] lives on {actual} but this process's mesh device {i} is "
                f"{jax_device} ({expected})"
            )
        if (
            isinstance(segment, bool)
            or not isinstance(segment, int)
            or not (0 <= segment < buffer.num_segments)
        ):
            raise IndexError(
                f"segment {segment!r} out of range for buffers[{i}] with "
                f"{buffer.num_segments} segment(s)"
            )
        committed = buffer.committed_sizes[segment]
        if committed < nbytes:
            raise ValueError(
                f"buffers[{i}] has {committed} bytes committed in segment {segment}; a "
                f"{shard_shape} shard of {dt} needs {nbytes}"
            )
    # The neutral method: a face's buffer (jaxbuf.torch, jaxbuf.jax) returns framework arrays.
    arrays = [
        # The neutral view, also of a face's tensor (whose segment_view is an array).
        _shard_to_jax(
            jax, ExtensibleTensor.segment_view(buffer, segment).view(dt, shard_shape), jax_device
        )
        for buffer, jax_device in zip(buffers, devices)
    ]
    return jax.assemble(global_shape, sharding, arrays)
