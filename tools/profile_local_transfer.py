"""Host cost of the same-host transport's pieces on CUDA (one process, two buffers): what a
1-block post spends where. A development aid: ``python tools/profile_local_transfer.py``."""

import cProfile
import pstats
import time

import numpy as np
import torch

import jaxbuf
from jaxbuf.transfer import KVEndpoint, KVLayout

MiB = 1 << 20


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


a = jaxbuf.ExtensibleTensor(256 * MiB, "cuda:0")
a.resize_per_segment_(128 * MiB)
b = jaxbuf.ExtensibleTensor(256 * MiB, "cuda:0")
b.resize_per_segment_(128 * MiB)
ea = KVEndpoint("a", a, KVLayout(64 * 1024), transport="local")
eb = KVEndpoint("b", b, KVLayout(64 * 1024), transport="local")
peer = ea.connect(eb.metadata())
driver = a.driver
print("copy_batch method:", driver.copy_batch_method)
one = np.array([0], np.int64)
d = np.array([a.base_ptr], np.uint64)
s = np.array([b.base_ptr], np.uint64)
n4k = np.array([4096], np.uint64)


def batch_only():
    driver.destroy_event(driver.copy_batch(d, s, n4k, 0))


def batch_sync():
    event = driver.copy_batch(d, s, n4k, 0)
    driver.event_synchronize(event)
    driver.destroy_event(event)


x = torch.empty(4096, dtype=torch.uint8, device="cuda")
y = torch.empty(4096, dtype=torch.uint8, device="cuda")


def torch_copy_sync():
    x.copy_(y)
    torch.cuda.synchronize()


print(f"copy_batch 4 KiB, post only:   {per_call(batch_only):7.1f} us")
print(f"copy_batch 4 KiB + event sync: {per_call(batch_sync):7.1f} us")
print(f"torch copy_ 4 KiB + sync:      {per_call(torch_copy_sync):7.1f} us")
print(f"endpoint write post:           {per_call(lambda: ea.write(peer, one, one)):7.1f} us")
print(f"endpoint write post + wait:    {per_call(lambda: ea.write(peer, one, one).wait()):7.1f} us")
torch.cuda.synchronize()
big_x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
big_y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")


def torch_big():
    big_x.copy_(big_y)
    torch.cuda.synchronize()


blocks = np.arange(1024, dtype=np.int64)
shuffled = np.random.default_rng(0).permutation(1024).astype(np.int64)
print(f"torch copy_ 64 MiB + sync:     {per_call(torch_big, 200):7.1f} us")
print(
    f"write 1 x 64 MiB + wait (1024 contiguous blocks): "
    f"{per_call(lambda: ea.write(peer, blocks, blocks).wait(), 200):7.1f} us"
)
print(f"kernel path: {ea.copier.kernel_unavailable or 'yes'}")
sixty_four = shuffled[:64].copy()
print(
    f"write 64 x 64 KiB shuffled + wait: "
    f"{per_call(lambda: ea.write(peer, blocks[:64], sixty_four).wait(), 500):7.1f} us"
)
print(
    f"write 1024 x 64 KiB shuffled + wait: "
    f"{per_call(lambda: ea.write(peer, blocks, shuffled).wait(), 200):7.1f} us"
)
cProfile.run("for _ in range(3000): ea.write(peer, one, one)", "/tmp/post.prof")
pstats.Stats("/tmp/post.prof").sort_stats("tottime").print_stats(18)
ea.close()
eb.close()
a.free()
b.free()
