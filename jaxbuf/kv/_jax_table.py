"""JAX values of a :class:`~jaxbuf.DeviceParamTable` (:class:`JaxParamArrays`).

The table's JAX wing: imported on the first ``table.arrays("jax")`` (JAX is loaded by then),
so a torch-only user never imports JAX. JAX treats arrays as values, so a JAX step gets the
values of the last sync as arrays of its own, never an alias of the mutable device table: a
step in flight keeps the arrays it was dispatched with, and a sync waits for nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .. import interop
from .._errors import ClosedError
from ..devices import Device

if TYPE_CHECKING:  # the table imports this wing: types only, no cycle
    from ._param_table import ParamField, SyncedValues

__all__ = ["JaxParamArrays"]

_X64_NAMES = frozenset({"int64", "uint64", "float64", "complex128"})
# (dtype name, byte offset, shape) per field: hashable, the key of the compiled unpacking.
_Layout = tuple[tuple[str, int, tuple[int, ...]], ...]


class JaxParamArrays(Mapping):
    """The fields of a :class:`~jaxbuf.DeviceParamTable` as JAX arrays holding the values of
    its last changed :meth:`~jaxbuf.DeviceParamTable.sync` (zeros before the first).

    Live: the first access after a changed sync uploads the table's values afresh (one
    transfer of the whole table and one dispatch that slices it into the fields, on the
    table's device) and returns the new arrays; without a change every access returns the
    same array objects. The arrays are JAX's own, made from an immutable copy of the table's
    bytes: later host writes and syncs never change them.

    A JAX pytree: its leaves are the current arrays, in sorted name order (a dict's, which
    it unflattens to), so the mapping itself is a jit argument (``step(caches,
    table.arrays("jax"))``) that passes each call the current values without retracing;
    inside the traced function it is a plain dict. Read inside a trace (a closure), it
    uploads eagerly and the traced function keeps the values it read. Never donate its
    arrays: they serve every step until the next change (one donated, which JAX deletes, is
    uploaded again at the next access). ``ClosedError`` once the table is closed.
    """

    __slots__ = ("_synced", "_names", "_sorted", "_layout", "_nbytes", "_device", "_snapshot")

    def __init__(self, synced: SyncedValues, fields: Iterable[ParamField], device: Device):
        fields = list(fields)
        self._synced = synced
        self._names = tuple(field.name for field in fields)
        self._sorted = tuple(sorted(self._names))  # the pytree's leaf order
        self._layout: _Layout = tuple((f.dtype.name, f.offset, f.shape) for f in fields)
        self._nbytes = len(synced.state[1])
        self._device = interop.get("jax").device(device)
        # (changed syncs uploaded, {name: array}, the arrays in pytree leaf order): replaced
        # as one attribute, after the upload, so an upload that fails or is interrupted
        # leaves the old one and the next access uploads again. -1: nothing uploaded yet.
        self._snapshot: tuple[int, dict[str, Any], tuple[Any, ...]] = (-1, {}, ())

    # -- the mapping ----------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        arrays = self.current()
        try:
            return arrays[name]
        except KeyError:
            fields = ", ".join(self._names)
            raise KeyError(f"no field {name!r}; fields: {fields}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def current(self) -> dict[str, Any]:
        """``{name: array}`` of the last changed sync's values, uploaded now if that sync
        came after the last upload; ``ClosedError`` once the table is closed."""
        return self._current()[1]

    def _current(self) -> tuple[int, dict[str, Any], tuple[Any, ...]]:
        """The snapshot of the last changed sync's values, uploaded now where it is stale."""
        if self._synced.closed:
            raise ClosedError("DeviceParamTable", "closed")
        changed_syncs, values = self._synced.state
        snapshot = self._snapshot
        if snapshot[0] == changed_syncs:
            # A donated array (which the docs forbid, and JAX deletes) is uploaded again
            # rather than handed to every later step deleted: about 30 ns a field to check.
            for array in snapshot[2]:
                if array.is_deleted():
                    break
            else:
                return snapshot
        # Eagerly even inside a trace (a jitted function reading the mapping it closes
        # over): the snapshot serves every later access, so it must hold arrays, never that
        # trace's tracers.
        with jax.ensure_compile_time_eval():
            arrays = dict(zip(self._names, self._upload(values)))
        snapshot = (changed_syncs, arrays, tuple(arrays[name] for name in self._sorted))
        self._snapshot = snapshot
        return snapshot

    def _upload(self, values: bytes) -> list[Any]:
        """The fields of ``values`` as new JAX arrays on the table's device."""
        self._check_x64()
        unpack = _unpacker(self._layout, self._nbytes, self._device)
        # Over immutable bytes: nothing rewrites the memory JAX reads, whether it copies it
        # or (a host client at the right alignment) keeps it; the array holds a reference.
        return unpack(np.frombuffer(values, np.uint8))

    def _check_x64(self) -> None:
        """TypeError naming a 64-bit field JAX would narrow (``jax_enable_x64`` off, read at
        each upload: it can be switched, also as a context)."""
        if jax.config.jax_enable_x64:
            return
        for name, (dtype_name, _, _) in zip(self._names, self._layout):
            if dtype_name in _X64_NAMES:
                raise TypeError(
                    f"field {name!r} is {dtype_name}, which JAX would narrow to 32 bits "
                    "(jax_enable_x64 is off): enable it (jax.config.update('jax_enable_x64', "
                    "True)) or give the field a 32-bit dtype"
                )

    def __repr__(self) -> str:
        state = "closed" if self._synced.closed else f"sync {self._synced.state[0]}"
        fields = ", ".join(
            f"{name}: {dtype} {shape}" for name, (dtype, _, shape) in zip(self._names, self._layout)
        )
        return f"JaxParamArrays({{{fields}}}, {state})"


# -- the pytree ---------------------------------------------------------------------------
# The leaves go in sorted name order, a dict's: the mapping unflattens to a dict, and JAX
# matches a loop's carry (scan, fori_loop) leaf by leaf, so in field order a body returning
# the dict would feed each field's value into another field's slot.
def _flatten(arrays: JaxParamArrays) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    return arrays._current()[2], arrays._sorted


def _flatten_with_keys(arrays: JaxParamArrays) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    names, leaves = arrays._sorted, arrays._current()[2]
    return tuple((jax.tree_util.DictKey(n), leaf) for n, leaf in zip(names, leaves)), names


def _unflatten(names: tuple[str, ...], leaves: Iterable[Any]) -> dict[str, Any]:
    return dict(zip(names, leaves))


jax.tree_util.register_pytree_with_keys(
    JaxParamArrays, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


# -- the upload ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _unpacker(layout: _Layout, nbytes: int, device: Any) -> Any:
    """A jitted function from a table's bytes (numpy ``uint8``, ``nbytes``) to its fields
    on ``device``: the transfer and the slicing in one dispatch, compiled once per layout."""
    from jax.sharding import SingleDeviceSharding

    def unpack(table: Any) -> list[Any]:
        return [_field(table, dtype_name, offset, shape) for dtype_name, offset, shape in layout]

    return jax.jit(unpack, in_shardings=SingleDeviceSharding(device))


def _field(table: Any, dtype_name: str, offset: int, shape: tuple[int, ...]) -> Any:
    """The field at ``offset`` of ``table`` (traced ``uint8``) as ``dtype_name`` values."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype_name)
    count = math.prod(shape)
    raw = table[offset : offset + count * dtype.itemsize]
    if dtype == jnp.bool_:
        values = raw != 0
    elif dtype.itemsize == 1:
        values = jax.lax.bitcast_convert_type(raw, dtype)
    elif jnp.issubdtype(dtype, jnp.complexfloating):  # XLA bitcasts no complex: two parts
        part = jnp.float32 if dtype == jnp.complex64 else jnp.float64
        pairs = jax.lax.bitcast_convert_type(raw.reshape(count, 2, dtype.itemsize // 2), part)
        values = jax.lax.complex(pairs[:, 0], pairs[:, 1])
    else:
        values = jax.lax.bitcast_convert_type(raw.reshape(count, dtype.itemsize), dtype)
    return values.reshape(shape)
