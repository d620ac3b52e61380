"""The JAX adapter: ``jax.Array`` inputs and imports, JAX devices and dtypes, sharded arrays.

JAX treats arrays as immutable values and caches an array's host value, so
``mutable_arrays`` is False: an array imported over jaxbuf memory is not handed out again
once the memory changed, and a write into a JAX array goes through the driver (see
``UvaBufferPool.copy_to_gpu``). JAX reports no current stream: its DLPack import orders
itself (JAX passes its stream to ``__dlpack__``).

JAX is imported on first use of a method that needs it; :meth:`JaxAdapter.is_array` and
:meth:`JaxAdapter.dtype_name` only look at a JAX the process has already imported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxbuf.interop import Adapter, loaded_module


class JaxAdapter(Adapter):
    name = "jax"
    device_arrays = True
    mutable_arrays = False

    def __init__(self) -> None:
        self._from_dlpack: Any = None  # jax.dlpack.from_dlpack, bound on first import

    @staticmethod
    def _jax() -> Any:
        import jax

        return jax

    # -- recognising and converting inputs ------------------------------------------------
    def is_array(self, x: Any) -> bool:
        jax = loaded_module("jax")
        return jax is not None and isinstance(x, jax.Array)

    def to_numpy(self, x: Any, *, device_copy: bool = True) -> np.ndarray:
        """The array's values on the host (a device-to-host copy for a GPU array).

        ``device_copy`` is not refused: JAX places even host-born data (``jnp.asarray`` of a
        numpy array) on its default device, so a JAX array on the GPU is how JAX code holds
        host data; its values are fetched."""
        return np.asarray(x)

    # -- importing jaxbuf memory ----------------------------------------------------------
    def from_dlpack(self, exporter: Any) -> Any:
        """``jax.dlpack.from_dlpack(exporter)``: a JAX array over any DLPack exporter."""
        from_dlpack = self._from_dlpack
        if from_dlpack is None:
            import jax.dlpack

            from_dlpack = self._from_dlpack = jax.dlpack.from_dlpack
        return from_dlpack(exporter)

    def from_view(self, view: Any) -> Any:
        """A JAX array over ``view``'s bytes, zero-copy (JAX passes its stream, so pending
        producer work is ordered before it). It cannot keep the owner alive beyond what its
        capsule does; keep the owner unfreed while it is in use."""
        return self.from_dlpack(view)

    # -- dtypes and devices ---------------------------------------------------------------
    def dtype(self, dtype: Any) -> Any:
        import jax.numpy as jnp

        return jnp.dtype(dtype.name)

    def dtype_name(self, obj: Any) -> str | None:
        """JAX's scalar types (``jnp.bfloat16``, ``jnp.int32``) by their dtype's name; JAX's
        dtypes themselves are numpy dtypes, which numpy names."""
        jnp = loaded_module("jax.numpy")
        if jnp is not None and isinstance(obj, type(jnp.float32)):
            return np.dtype(obj.dtype).name
        return None

    def device(self, device: Any) -> Any:
        """The JAX device with ``device``'s local index on its backend (``cpu`` / ``gpu``);
        ValueError when JAX has no such device."""
        backend = "cpu" if device.platform == "cpu" else "gpu"
        devices = self._jax().local_devices(backend=backend)
        if device.index >= len(devices):
            raise ValueError(f"JAX has no {backend} device {device.index} ({len(devices)} found)")
        return devices[device.index]

    def array_device(self, x: Any) -> Any:
        return next(iter(x.devices()))

    # -- copies -------------------------------------------------------------------------
    def clone(self, array: Any) -> Any:
        """A JAX copy of ``array`` in device memory (the copy runs on JAX's stream)."""
        import jax.numpy as jnp

        return jnp.array(array, copy=True)

    def buffer_pointer(self, array: Any) -> int:
        """The device address of a single-device array, after the work producing it."""
        array.block_until_ready()
        return array.unsafe_buffer_pointer()

    def to_device(self, x: Any, device: Any, dtype: Any) -> Any:
        """``jax.device_put``, asynchronous by contract."""
        array = np.asarray(x, dtype=None if dtype is None else dtype.numpy)
        return self._jax().device_put(array, self.device(device))

    # -- sharded arrays (jaxbuf.sharding) -------------------------------------------------
    def named_sharding(self, mesh: Any, spec: Any) -> tuple[Any, Any]:
        """``(spec, NamedSharding(mesh, spec))`` with ``spec`` a ``PartitionSpec`` (None: fully
        replicated; a tuple: its entries); TypeError naming a bad mesh or spec."""
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
        if spec is None:
            spec = PartitionSpec()
        elif not isinstance(spec, PartitionSpec):
            if not isinstance(spec, (tuple, list)):
                raise TypeError(
                    f"spec must be a PartitionSpec or a tuple of its entries, got {spec!r}"
                )
            spec = PartitionSpec(*spec)
        return spec, NamedSharding(mesh, spec)

    def canonical_numpy_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype JAX would store ``dtype`` as (64-bit types become 32-bit without
        ``jax_enable_x64``)."""
        return self._jax().dtypes.canonicalize_dtype(dtype)

    def assemble(self, global_shape: tuple[int, ...], sharding: Any, arrays: list[Any]) -> Any:
        """``jax.make_array_from_single_device_arrays``: one global array, zero-copy."""
        return self._jax().make_array_from_single_device_arrays(global_shape, sharding, arrays)


ADAPTER = JaxAdapter()
