"""Does JAX alias pinned host memory imported through a kDLCUDA pointer? (GPU probe)"""
import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
from jaxbuf import UvaBuffer
buf = UvaBuffer(1024, "int32", device="cuda:0")
buf.np[:] = np.arange(1024)
device_array = buf.jax_device_array
print("device view aliases:", device_array.unsafe_buffer_pointer() == buf.device_ptr)
pinned = buf.jax_pinned_host_array
print("pinned_host aliases:", pinned.unsafe_buffer_pointer() == buf.host_ptr, pinned.sharding.memory_kind)
buf.np[0] = 99
print("device view sees later host write:", int(device_array[0]) == 99, "pinned sees it:", int(pinned[0]) == 99)
