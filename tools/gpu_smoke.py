"""Early smoke check of the CUDA driver and views on a GPU machine (not part of the suite)."""
import os, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.views import BufferView
from jaxbuf.devices import Device
d = get_vmm_driver("cuda:0")
d.ensure_context(0)
g = d.granularity(0); print("granularity", g)
size = 4 * (2 << 20)
base = d.reserve(64 << 20)
h = d.create(size, 0); d.map(base, size, h); d.set_access(base, size, 0)
d.memset(base, 7, size, 0); d.synchronize(0)
v = BufferView(base, size, "uint8", None, Device("cuda", 0), None, d.dlpack_device_type)
import torch, jax, jax.numpy as jnp
t = v.to_torch(); print("torch", t.device, t[:4].tolist(), t.data_ptr() == base)
t2 = torch.from_dlpack(v); print("torch.from_dlpack ok", t2.data_ptr() == base)
a = v.to_jax(dtype="int32"); print("jax", a.devices(), a[:2], a.unsafe_buffer_pointer() == base)
t.view(torch.int32)[:2] = 5; torch.cuda.synchronize(); print("jax sees torch write", jax.dlpack.from_dlpack(v.view("int32"))[:2])
import timeit
n = 20000
print("capsule us", timeit.timeit(lambda: v.__dlpack__(), number=n) / n * 1e6)
print("to_torch us", timeit.timeit(lambda: v.to_torch(), number=n) / n * 1e6)
print("to_jax us", timeit.timeit(lambda: v.to_jax(), number=2000) / 2000 * 1e6)
x = torch.zeros(16, device="cuda"); print("native from_dlpack us", timeit.timeit(lambda: torch.from_dlpack(x), number=n) / n * 1e6)
# append cost
t0 = time.perf_counter(); h2 = d.create(2 << 20, 0); t1 = time.perf_counter(); d.map(base + size, 2 << 20, h2); t2_ = time.perf_counter(); d.set_access(base, size + (2 << 20), 0); t3 = time.perf_counter()
print(f"append create {1e6*(t1-t0):.1f} map {1e6*(t2_-t1):.1f} access {1e6*(t3-t2_):.1f} us")
del t, t2, a
d.synchronize(0)
d.unmap(base, size + (2 << 20)); d.release(h); d.release(h2); d.free_reserved(base, 64 << 20)
hp, dp = d.host_alloc(4096, 0); print("host_alloc", hex(hp), hex(dp)); d.host_free(hp)
print("cc", getattr(d, "confidential_computing_reason", lambda: "n/a")())
print("SMOKE OK")
