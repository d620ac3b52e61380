"""The torch adapter: CPU and CUDA tensors, torch's current stream, its caching allocator.

torch is imported on first use of a method that needs it (the caller asked for torch); the
methods that only look (:meth:`TorchAdapter.is_array`, :meth:`~TorchAdapter.current_stream`,
:meth:`~TorchAdapter.dtype_name`, :meth:`~TorchAdapter.on_out_of_memory`) use torch only when
the process has already imported it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxbuf._dlpack import exchange_api_of, exchange_to
from jaxbuf.drivers.base import K_DL_CPU, K_DL_CUDA, K_DL_ROCM
from jaxbuf.interop import DLPACK_LEGACY_STREAM, Adapter, loaded_module

# DLPack device types torch imports (it rejects kDLCUDAHost: use a pinned buffer's device view).
_TORCH_DEVICE_TYPES = (K_DL_CPU, K_DL_CUDA, K_DL_ROCM)


def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as error:  # pragma: no cover - ml_dtypes comes with jax
        raise TypeError("bfloat16 in numpy needs ml_dtypes (pip install jaxbuf[jax])") from error
    return np.dtype(ml_dtypes.bfloat16)


class TorchAdapter(Adapter):
    name = "torch"
    device_arrays = True
    mutable_arrays = True

    def __init__(self) -> None:
        # Bound on first use (importing torch then): the capsule importer and the raw
        # current-stream getter, each a private torch call with a public fallback.
        self._from_capsule: Any = None
        # torch's DLPack C exchange API (torch.Tensor.__dlpack_c_exchange_api__), bound with
        # the importer; None where torch predates it (then capsules, as before).
        self._exchange_api: Any = None
        self._raw_stream: Any = None
        self._dtypes: dict[str, Any] = {}
        # A forked child cannot use the parent's CUDA (torch then reports it uninitialised):
        # forget the getter, so the child asks torch again.
        os.register_at_fork(after_in_child=self._forget_stream_getter)

    def _forget_stream_getter(self) -> None:
        self._raw_stream = None

    @staticmethod
    def _torch() -> Any:
        import torch

        return torch

    def _bind_importer(self) -> Any:
        torch = self._torch()
        # torch._C._from_dlpack takes the capsule straight to torch's C importer, skipping
        # torch.from_dlpack's Python protocol handling (about 1 µs); the public
        # torch.utils.dlpack.from_dlpack accepts a capsule too, should the private one go.
        importer = getattr(torch._C, "_from_dlpack", None)
        if importer is None:
            from torch.utils.dlpack import from_dlpack as importer
        self._exchange_api = exchange_api_of(torch.Tensor)
        self._from_capsule = importer
        return importer

    # -- recognising and converting inputs ------------------------------------------------
    def is_array(self, x: Any) -> bool:
        torch = loaded_module("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def to_numpy(self, x: Any, *, device_copy: bool = True) -> np.ndarray:
        """A numpy array of the tensor's values: a view of a CPU tensor (bfloat16 through
        ml_dtypes), a host copy of a CUDA one unless ``device_copy=False`` (TypeError)."""
        torch = self._torch()
        if x.device.type != "cpu":
            if not device_copy:
                raise TypeError(
                    f"expected host data, got a torch tensor on {x.device}; it is already on "
                    "the device"
                )
            x = x.cpu()
        if x.requires_grad:
            x = x.detach()
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        if x.dtype is torch.bfloat16:
            return x.view(torch.int16).numpy().view(_bfloat16())
        return x.numpy()

    def host_array(self, array: np.ndarray) -> Any:
        """A torch CPU tensor sharing ``array``'s memory (bfloat16 included)."""
        torch = self._torch()
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def host_pointer(self, x: Any, dtype: Any) -> int | None:
        if (
            x.is_cpu
            and x.dtype is self.dtype(dtype)
            and not x.requires_grad
            and x.is_contiguous()
            and not x.is_conj()
            and not x.is_neg()
        ):
            return x.data_ptr()
        return None

    # -- importing jaxbuf memory ----------------------------------------------------------
    def from_view(self, view: Any) -> Any:
        """A tensor over ``view``'s bytes, zero-copy, on its device. When the owner has
        pending producer work, torch's current stream is made to wait for it.

        Through torch's DLPack C exchange API where torch has one (a versioned managed tensor
        handed to ``managed_tensor_to_py_object_no_sync`` in one C call), else through a
        capsule and torch's importer; the tensor and its lifetime are the same either way."""
        importer = self._from_capsule or self._bind_importer()
        api = self._exchange_api
        device_type = view.dlpack_device_type
        if device_type == K_DL_CPU:  # no streams on the host
            return exchange_to(api, view, None) if api else importer(view.__dlpack__())
        if device_type not in _TORCH_DEVICE_TYPES:
            raise BufferError(
                f"torch cannot import DLPack device type {device_type}; "
                "use the device view of a pinned buffer"
            )
        owner = view.owner
        stream = None
        if owner is not None and getattr(owner, "ready_event", None) is not None:
            stream = self.current_stream(view.device) or DLPACK_LEGACY_STREAM
        if api is not None:
            return exchange_to(api, view, stream)
        return importer(view.__dlpack__() if stream is None else view.__dlpack__(stream=stream))

    def current_stream(self, device: Any) -> int | None:
        """torch's current stream on a CUDA ``device``, once torch has initialised CUDA."""
        raw_stream = self._raw_stream
        if raw_stream is not None and device.is_cuda:
            # Set once torch had initialised CUDA, which it never undoes: the apply path.
            return raw_stream(device.index) or DLPACK_LEGACY_STREAM
        torch = loaded_module("torch")
        if torch is None or not device.is_cuda or not torch.cuda.is_initialized():
            return None
        if raw_stream is None:
            # The raw getter skips building a torch.cuda.Stream (microseconds on the apply
            # path); current_stream().cuda_stream is the public way.
            raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw_stream is None:

                def raw_stream(index: int, torch: Any = torch) -> int:
                    return torch.cuda.current_stream(index).cuda_stream

            self._raw_stream = raw_stream
        # torch names the legacy default stream 0; DLPack reserves 0 and calls it 1.
        return raw_stream(device.index) or DLPACK_LEGACY_STREAM

    # -- dtypes and devices ---------------------------------------------------------------
    def dtype(self, dtype: Any) -> Any:
        result = self._dtypes.get(dtype.name)
        if result is None:
            result = self._dtypes[dtype.name] = getattr(self._torch(), dtype.name)
        return result

    def dtype_name(self, obj: Any) -> str | None:
        torch = loaded_module("torch")
        if torch is not None and isinstance(obj, torch.dtype):
            return str(obj).removeprefix("torch.")
        return None

    def device(self, device: Any) -> Any:
        torch = self._torch()
        return torch.device("cpu") if device.platform == "cpu" else torch.device(str(device))

    def array_device(self, x: Any) -> Any:
        return x.device

    # -- copies -------------------------------------------------------------------------
    def copy_into(self, out: Any, source: Any) -> Any:
        """``out.copy_(source)`` on torch's current stream, non-blocking; shapes must match."""
        if tuple(out.shape) != tuple(source.shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(source.shape)}")
        return out.copy_(source, non_blocking=True)

    def clone(self, array: Any) -> Any:
        return array.clone()

    def buffer_pointer(self, array: Any) -> int:
        return array.data_ptr()

    def to_device(self, x: Any, device: Any, dtype: Any) -> Any:
        """``pin_memory()`` + ``to(device, non_blocking=True)``: torch's host allocator keeps
        the staging block until the copy is done."""
        torch = self._torch()
        if self.is_array(x):
            tensor = x if dtype is None else x.to(self.dtype(dtype))
        else:
            array = np.asarray(x, dtype=None if dtype is None else dtype.numpy)
            tensor = self.host_array(np.ascontiguousarray(array))
        target = self.device(device)
        if target.type == "cpu":
            return tensor.clone()
        if tensor.device.type == "cpu" and torch.cuda.is_available():
            tensor = tensor.pin_memory()
        return tensor.to(target, non_blocking=True)

    # -- memory pressure ----------------------------------------------------------------
    def on_out_of_memory(self) -> bool:
        """``torch.cuda.empty_cache()``: torch's caching allocator keeps freed blocks a driver
        allocation cannot reuse. Only where torch has initialised CUDA (so a process where it
        never touched CUDA makes no contexts here)."""
        torch = loaded_module("torch")
        if torch is None or not torch.cuda.is_initialized():
            return False
        torch.cuda.empty_cache()
        return True

    def quiesce(self, device: Any) -> None:
        """``torch.cuda.synchronize(device)``: torch's queued kernels on a CUDA ``device`` may
        still touch memory about to be released. Only where torch has initialised CUDA (else
        it has queued nothing); on the host torch runs nothing asynchronously."""
        torch = loaded_module("torch")
        if torch is None or not device.is_cuda or not torch.cuda.is_initialized():
            return
        torch.cuda.synchronize(device.index)


ADAPTER = TorchAdapter()
