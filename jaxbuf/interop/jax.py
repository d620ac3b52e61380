"""The JAX adapter: ``jax.Array`` inputs and imports, JAX devices and dtypes, sharded arrays.

JAX treats arrays as immutable values and caches an array's host value, so
``mutable_arrays`` is False: an array imported over jaxbuf memory is not handed out again
once the memory changed, and a write into a JAX array goes through the driver (see
``UvaBufferPool.copy_to_gpu``). JAX reports no current stream: its DLPack import orders
itself (JAX passes its stream to ``__dlpack__``).

When a JAX array over jaxbuf memory sees writes made outside JAX (staged applies, torch, the
host):

* At import: the owner's ``ready_event`` (recorded after its pending jaxbuf work: a zeroing
  memset, an applied staged write) is ordered before the stream JAX passes to
  ``__dlpack__(stream=...)``, so computations on the new array see that work. Work jaxbuf
  does not record (a torch kernel) must be complete first (``torch.cuda.synchronize()``).
  Pinned-host imports (``kDLCUDAHost``) get no stream from JAX: the producer must have
  finished (synchronize) before the import.
* After import: the array aliases the memory, and a JAX computation reads it when it runs.
  It sees a write made outside JAX only when dispatched after the writer's work completed:
  synchronize the writer (``torch.cuda.synchronize()``, the driver's ``synchronize``), or,
  after a staged apply, import a fresh array (``to_jax()``), whose import waits on the ready
  event. A write still running when JAX reads is a race. On the CPU, host writes are
  visible to computations dispatched after them; none may overlap a computation still
  running on that memory (``block_until_ready`` first).
* ``np.asarray(array)`` caches the host value: import again to read new bytes on the host.

JAX version floors: :func:`require_jax` raises ImportError naming the feature and the JAX
release it needs; the floors (``JAX_FLOORS``) are the first releases with the APIs used.

JAX is imported on first use of a method that needs it; :meth:`JaxAdapter.is_array` and
:meth:`JaxAdapter.dtype_name` only look at a JAX the process has already imported.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import numpy as np

from jaxbuf.drivers.base import K_DL_CPU, K_DL_CUDA_HOST, K_DL_ROCM_HOST
from jaxbuf.interop import Adapter, loaded_module

# -- JAX version floors ---------------------------------------------------------------------
#: The first JAX release with the APIs each feature uses, from JAX's changelog and its release
#: tags (docs/ARCHITECTURE.md, "JAX versions", says which API sets each). :func:`require_jax`
#: checks them where each feature starts; the ``jax`` extra in pyproject.toml declares the
#: floor of the features every platform uses (``to_jax`` and ``sharded_jax_array``).
JAX_FLOORS: dict[str, str] = {
    # jax.dlpack.from_dlpack(obj) calling obj.__dlpack__(stream=<JAX's stream>): 0.4.15;
    # 0.4.30 is the oldest release the import and sharding tests have passed on.
    "to_jax": "0.4.30",
    # NamedSharding and make_array_from_single_device_arrays over non-addressable devices.
    "sharded_jax_array": "0.4.30",
    # from_dlpack of kDLCUDAHost as memory kind "pinned_host": jax and jaxlib 0.10.2.
    "pinned_host": "0.10.2",
    # jax.experimental.pallas.triton.load / store / CompilerParams (the Pallas kernel).
    "pallas_triton": "0.7.1",
    # jax_triton 0.3.1, the last release for JAX < 0.11, needs jax>=0.8.2 and triton>=3.6.
    "jax_triton": "0.8.2",
}

_PINNED_HOST_TYPES = (K_DL_CUDA_HOST, K_DL_ROCM_HOST)
#: JAX (XLA's CPU client) imports host memory in place only at this alignment; it copies a
#: pointer that is not a multiple of it.
HOST_IMPORT_ALIGNMENT = 64
_X64_NAMES = frozenset({"int64", "uint64", "float64", "complex128"})
_VERSION_PREFIX = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")
_satisfied: set[tuple[str, str, str]] = set()  # (minimum, jax version, jaxlib version) seen OK


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.10.2"`` -> ``(0, 10, 2)``. Suffixes (``.dev2026...``, ``rc1``, ``+local``) are
    dropped: a pre-release of X counts as X, since it carries X's APIs. ValueError naming
    ``version`` when it does not start with ``major.minor``."""
    match = _VERSION_PREFIX.match(str(version))
    if match is None:
        raise ValueError(f"cannot read a JAX version from {version!r}")
    return (int(match[1]), int(match[2]), int(match[3] or 0))


def require_jax(feature: str, minimum: str, *, jaxlib: bool = False) -> None:
    """Return when the installed JAX is ``minimum`` or newer; otherwise raise ImportError
    naming ``feature``, the version it needs and the one installed.

    ``jaxlib=True`` also checks jaxlib's version, for a feature that needs jaxlib's C++ side
    too (JAX accepts a jaxlib one release older than itself). A passed check is remembered
    per installed version, so calling this at every entry costs a set lookup."""
    import jax

    installed = str(getattr(jax, "__version__", "0.0.0"))
    installed_lib = ""
    if jaxlib:
        import jaxlib.version

        installed_lib = str(jaxlib.version.__version__)
    key = (minimum, installed, installed_lib)
    if key in _satisfied:
        return
    needed = version_tuple(minimum)
    for name, version in (("JAX", installed), ("jaxlib", installed_lib)):
        if version and version_tuple(version) < needed:
            raise ImportError(
                f"{feature} needs {name} >= {minimum}, but {name} {version} is installed; "
                f"upgrade with: pip install -U 'jax>={minimum}' 'jaxlib>={minimum}'"
            )
    _satisfied.add(key)


class JaxAdapter(Adapter):
    name = "jax"
    device_arrays = True
    mutable_arrays = False

    def __init__(self) -> None:
        self._from_dlpack: Any = None  # jax.dlpack.from_dlpack, bound on first import
        self._import_in_place: Any = None  # the same with copy=False where JAX has it
        self._pinned_host_ok = False  # require_jax("pinned_host") passed once

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
            require_jax("Importing jaxbuf memory into JAX (to_jax)", JAX_FLOORS["to_jax"])
            import jax.dlpack

            from_dlpack = self._from_dlpack = jax.dlpack.from_dlpack
        return from_dlpack(exporter)

    def from_view(self, view: Any) -> Any:
        """A JAX array over ``view``'s bytes, zero-copy, or ``BufferError`` where JAX would
        copy: a host pointer not aligned to :data:`HOST_IMPORT_ALIGNMENT` bytes, a 64-bit
        dtype without ``jax_enable_x64`` (JAX narrows it into a new array), or whatever JAX's
        own ``copy=False`` refuses. JAX passes its stream, so pending producer work is
        ordered before it; the array holds the view's export, so the owner's memory stays
        alive while JAX holds the array (JAX lets go early of an array it donates)."""
        if not self._pinned_host_ok and view.dlpack_device_type in _PINNED_HOST_TYPES:
            # JAX before 0.10.2 rejects kDLCUDAHost with an unhelpful "unsupported device".
            require_jax(
                "Importing pinned host memory into JAX (memory kind pinned_host)",
                JAX_FLOORS["pinned_host"],
                jaxlib=True,
            )
            self._pinned_host_ok = True
        misaligned = view.ptr % HOST_IMPORT_ALIGNMENT
        if misaligned and view.dlpack_device_type == K_DL_CPU and 0 not in view.shape:
            raise BufferError(
                f"JAX would copy this view instead of importing it: its address {view.ptr:#x} "
                f"is {misaligned} bytes past a {HOST_IMPORT_ALIGNMENT}-byte boundary, and JAX "
                f"imports host memory in place only at {HOST_IMPORT_ALIGNMENT}-byte alignment "
                "(ExtensibleTensor segments are aligned; copy explicitly with "
                "jnp.array(view.to_numpy()) if a copy is what you want)"
            )
        if view.dtype.name in _X64_NAMES and self._narrows(view.dtype.numpy):
            raise BufferError(
                f"JAX would copy this {view.dtype} view into a 32-bit array (jax_enable_x64 "
                "is off); enable it (jax.config.update('jax_enable_x64', True)) or view the "
                "bytes as a 32-bit dtype"
            )
        importer = self._import_in_place or self._bind_import_in_place()
        try:
            return importer(view)
        except ValueError as error:
            if "requires a copy" not in str(error):
                raise
            raise BufferError(
                f"JAX would copy this view instead of importing it in place: {error}"
            ) from error

    def _narrows(self, dtype: np.dtype) -> bool:
        """Whether JAX stores ``dtype`` narrower here (64-bit types without
        ``jax_enable_x64``, read where the import happens: ``jax.enable_x64`` is a context)."""
        return self._jax().dtypes.canonicalize_dtype(dtype) != dtype

    def _bind_import_in_place(self) -> Any:
        """``jax.dlpack.from_dlpack`` with ``copy=False`` (JAX then raises instead of copying),
        or without it on a JAX that has no such parameter."""
        require_jax("Importing jaxbuf memory into JAX (to_jax)", JAX_FLOORS["to_jax"])
        import jax.dlpack

        importer = jax.dlpack.from_dlpack
        if "copy" in inspect.signature(importer).parameters:
            importer = functools.partial(importer, copy=False)
        self._import_in_place = importer
        return importer

    # -- waiting for JAX's pending work ---------------------------------------------------
    def quiesce(self, device: Any) -> None:
        """Block until JAX's pending computations on ``device``'s platform are done, by waiting
        for every live JAX array there (``block_until_ready``: JAX has no call that waits for
        a whole backend). Nothing when JAX is not imported or has started no backend (it has
        run nothing then, and starting one here could claim GPU memory)."""
        jax = loaded_module("jax")
        if jax is None:
            return
        xla_bridge = getattr(getattr(jax, "_src", None), "xla_bridge", None)
        started = getattr(xla_bridge, "backends_are_initialized", None)  # private: a fallback
        if started is not None and not started():
            return
        try:
            arrays = jax.live_arrays("cpu" if device.platform == "cpu" else "gpu")
        except RuntimeError:  # JAX has no backend for that platform: none of its work is there
            return
        for array in arrays:
            try:
                array.block_until_ready()
            except RuntimeError:
                # Deleted or donated meanwhile, or its computation failed: in every case
                # nothing runs on it any more, which is all this waits for.
                continue

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
        require_jax("Sharded JAX arrays (jaxbuf.sharding)", JAX_FLOORS["sharded_jax_array"])
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

    def addressable_mesh_devices(self, mesh: Any) -> tuple[list[Any], int]:
        """``(devices, total)``: the mesh's devices this process addresses, in the mesh's
        order (``mesh.devices.flat``), and the mesh's device count. Under ``jax.distributed``
        the others belong to other processes; in one process all are addressable."""
        devices = list(mesh.devices.flat)
        # The process index on the mesh's own backend (a CPU mesh in a GPU process).
        process = self._jax().process_index(devices[0].platform) if devices else 0
        return [d for d in devices if d.process_index == process], len(devices)

    def canonical_numpy_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype JAX would store ``dtype`` as (64-bit types become 32-bit without
        ``jax_enable_x64``)."""
        return self._jax().dtypes.canonicalize_dtype(dtype)

    def assemble(self, global_shape: tuple[int, ...], sharding: Any, arrays: list[Any]) -> Any:
        """``jax.make_array_from_single_device_arrays``: one global array, zero-copy, from the
        single-device arrays of this process's addressable devices."""
        return self._jax().make_array_from_single_device_arrays(global_shape, sharding, arrays)


ADAPTER = JaxAdapter()
