"""Framework adapter for the UVA path: the torch and JAX calls ``uva.py`` needs.

Besides ``views.py`` this is the only module of the UVA path that imports torch or JAX, and
it does so lazily: recognising an input (``is_torch_tensor``, ``is_jax_array``) never imports
a framework, it only looks at frameworks the caller already imported.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .devices import Device
from .dtypes import DType

# torch's own name for its "legacy default stream" is the null stream handle 0; DLPack
# numbers that stream 1 (0 is ambiguous for CUDA in DLPack).
_DLPACK_LEGACY_STREAM = 1


def loaded_module(name: str) -> Any:
    """Module ``name`` if it is already imported and done initialising, else None.

    Never imports. A module another thread is still importing is in ``sys.modules`` half
    built (``torch.cuda`` missing, say); importlib marks it with ``__spec__._initializing``.
    """
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def is_torch_tensor(x: Any) -> bool:
    torch = loaded_module("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_jax_array(x: Any) -> bool:
    jax = loaded_module("jax")
    return jax is not None and isinstance(x, jax.Array)


def torch_to_numpy(x: Any) -> np.ndarray:
    """A numpy view of a CPU torch tensor (bfloat16 through ml_dtypes); TypeError for a
    tensor on another device."""
    import torch

    if not x.is_cpu:
        raise TypeError(
            f"copy_to_uva takes host data, got a torch tensor on {x.device}; "
            "it is already on the device"
        )
    if x.requires_grad:
        x = x.detach()
    if x.dtype is torch.bfloat16:
        from .dtypes import canonical_dtype

        return x.view(torch.int16).numpy().view(canonical_dtype("bfloat16").numpy)
    return x.numpy()


def jax_to_numpy(x: Any) -> np.ndarray:
    """The values of a JAX array on the host (a device-to-host copy for a GPU array)."""
    return np.asarray(x)


def numpy_to_torch(array: np.ndarray) -> Any:
    """A torch CPU tensor sharing ``array``'s memory (bfloat16 included)."""
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def torch_current_stream(device: Device) -> int:
    """The DLPack number of torch's current stream on ``device``, or the legacy default
    stream when torch is not imported or has not initialised CUDA."""
    torch = loaded_module("torch")
    if torch is None or not device.is_cuda or not torch.cuda.is_initialized():
        return _DLPACK_LEGACY_STREAM
    handle = torch.cuda.current_stream(device.index).cuda_stream
    return handle or _DLPACK_LEGACY_STREAM


def as_dlpack_stream(stream: Any) -> int:
    """A DLPack stream number from an int or a ``torch.cuda.Stream``."""
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
        raise TypeError(
            f"stream must be a torch.cuda.Stream or a DLPack stream int, got {stream!r}"
        )
    return handle or _DLPACK_LEGACY_STREAM


def torch_copy(out: Any, source: Any) -> Any:
    """``out.copy_(source)`` on torch's current stream, non-blocking; shapes must match."""
    if tuple(out.shape) != tuple(source.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(source.shape)}")
    return out.copy_(source, non_blocking=True)


def torch_clone(source: Any) -> Any:
    return source.clone()


def jax_copy(source: Any) -> Any:
    """A JAX copy of ``source`` in device memory (the copy runs on JAX's stream)."""
    import jax.numpy as jnp

    return jnp.array(source, copy=True)


def jax_buffer_pointer(out: Any) -> int:
    """The device address of a single-device JAX array, after the work producing it."""
    out.block_until_ready()
    return out.unsafe_buffer_pointer()


def async_copy_to_device(x: Any, device: Device, dtype: DType | None, framework: str) -> Any:
    """Host data to a new device array, asynchronously, through the framework's own staging.

    torch: ``pin_memory()`` + ``to(device, non_blocking=True)`` (torch's host allocator keeps
    the staging block until the copy is done). JAX: ``jax.device_put``, asynchronous by
    contract.
    """
    if framework == "torch":
        import torch

        if is_torch_tensor(x):
            tensor = x if dtype is None else x.to(dtype.torch())
        else:
            array = np.asarray(x, dtype=None if dtype is None else dtype.numpy)
            tensor = numpy_to_torch(np.ascontiguousarray(array))
        target = device.torch()
        if target.type == "cpu":
            return tensor.clone()
        if tensor.device.type == "cpu" and torch.cuda.is_available():
            tensor = tensor.pin_memory()
        return tensor.to(target, non_blocking=True)
    if framework == "jax":
        import jax

        array = np.asarray(x, dtype=None if dtype is None else dtype.numpy)
        return jax.device_put(array, device.jax())
    raise ValueError(f"framework must be 'torch' or 'jax', got {framework!r}")
