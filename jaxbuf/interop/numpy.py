"""The numpy adapter: host arrays, jaxbuf's own vocabulary (dtypes are numpy's names).

numpy has no device arrays and no streams, so it cannot be a pool's ``framework`` (pools
hand out device-visible memory); it recognises and converts inputs, and imports host views.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxbuf.interop import Adapter


class NumpyAdapter(Adapter):
    name = "numpy"
    device_arrays = False
    mutable_arrays = True

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def to_numpy(self, x: Any, *, device_copy: bool = True) -> np.ndarray:
        return x

    def host_array(self, array: np.ndarray) -> np.ndarray:
        return array

    def from_view(self, view: Any) -> np.ndarray:
        """``view.to_numpy()``: host memory only (``BufferError`` for a device view)."""
        return view.to_numpy()

    def dtype(self, dtype: Any) -> np.dtype:
        return dtype.numpy

    def device(self, device: Any) -> str:
        if device.is_cuda:
            raise TypeError(f"numpy arrays live on the host, not on {device}")
        return "cpu"

    def array_device(self, x: Any) -> str:
        return "cpu"

    def host_pointer(self, x: Any, dtype: Any) -> int | None:
        if x.dtype == dtype.numpy and x.flags.c_contiguous:
            return x.ctypes.data
        return None

    def copy_into(self, out: Any, source: Any) -> Any:
        np.copyto(out, source)
        return out

    def clone(self, array: Any) -> np.ndarray:
        return array.copy()

    def buffer_pointer(self, array: Any) -> int:
        return array.ctypes.data

    def to_device(self, x: Any, device: Any, dtype: Any) -> np.ndarray:
        self.device(device)  # the host only
        return np.array(x, dtype=None if dtype is None else dtype.numpy)


ADAPTER = NumpyAdapter()
