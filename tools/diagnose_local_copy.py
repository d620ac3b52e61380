"""Wall time of one block-list copy + wait on CUDA, by memory (torch's, jaxbuf's, an import)
and by path (torch copy_, BlockCopier kernel, copy_batch): which of them costs what.
A development aid: ``python tools/diagnose_local_copy.py``."""

import statistics
import time

import numpy as np
import torch

import jaxbuf
from jaxbuf.transfer import KVEndpoint, KVLayout
from jaxbuf.transfer._device_copy import BlockCopier

MiB, BLOCK = 1 << 20, 64 * 1024


def median_us(fn, n=200):
    for _ in range(20):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


rng = np.random.default_rng(0)
slots = 128 * MiB // BLOCK
ours = rng.permutation(slots)[:1024].astype(np.uint64) * np.uint64(BLOCK)
theirs = rng.permutation(slots)[:1024].astype(np.uint64) * np.uint64(BLOCK)
sizes = np.full(1024, BLOCK, np.uint64)
tx = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
ty = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
a = jaxbuf.ExtensibleTensor(256 * MiB, "cuda:0")
a.resize_per_segment_(128 * MiB)
b = jaxbuf.ExtensibleTensor(256 * MiB, "cuda:0")
b.resize_per_segment_(128 * MiB)
driver = a.driver
copier = BlockCopier(driver, a.device)


def copy_and_wait(dst_base, src_base, n=1024, size=None):
    dsts = np.uint64(dst_base) + theirs[:n]
    srcs = np.uint64(src_base) + ours[:n]
    z = sizes[:n] if size is None else np.array([size], np.uint64)

    def run():
        event = copier.copy(dsts, srcs, z)
        driver.event_synchronize(event)
        driver.destroy_event(event)

    return run


def torch_copy(x, y, n):
    def run():
        x[:n].copy_(y[:n])
        torch.cuda.synchronize()

    return run


def report(label, fn, n=200):
    print(f"{label:<48} {median_us(fn, n):8.1f} us")


A, B = a.base_ptr, b.base_ptr
ja, jb = a.segment_view(0).to_torch(), b.segment_view(0).to_torch()
report("torch copy_ 64 MiB, torch memory", torch_copy(tx, ty, 64 * MiB))
report("torch copy_ 64 MiB, jaxbuf memory", torch_copy(ja, jb, 64 * MiB))
report("kernel 1024x64K + wait, torch memory", copy_and_wait(tx.data_ptr(), ty.data_ptr()))
report("kernel 1024x64K + wait, jaxbuf memory", copy_and_wait(A, B))
report("kernel 16x64K + wait", copy_and_wait(A, B, 16))
report("copy_batch 1x4K + wait", copy_and_wait(A, B, 1, 4096))
# 32 MiB from the source's 64 MiB mark to the first destination block (inside both buffers).
report("kernel 1x32M + wait", copy_and_wait(A, B + 64 * MiB - int(ours[0]), 1, 32 * MiB))
dsts, srcs, events = np.uint64(A) + theirs, np.uint64(B) + ours, []
report("kernel 1024x64K, post only", lambda: events.append(copier.copy(dsts, srcs, sizes)))
torch.cuda.synchronize()
for event in events:
    driver.destroy_event(event)
report("torch.cuda.synchronize alone", torch.cuda.synchronize)
ea = KVEndpoint("a", a, KVLayout(BLOCK), transport="local")
eb = KVEndpoint("b", b, KVLayout(BLOCK), transport="local")
peer = ea.connect(eb.metadata())
lb = (ours // np.uint64(BLOCK)).astype(np.int64)
rb = (theirs // np.uint64(BLOCK)).astype(np.int64)
one = np.zeros(1, np.int64)
report("kernel 1024x64K + wait, into the import", copy_and_wait(peer.link.imported.base_ptr, A))
report("endpoint write 1024x64K + wait", lambda: ea.write(peer, lb, rb).wait())
report("endpoint write 1x64K + wait", lambda: ea.write(peer, one, one).wait())
report("endpoint write 1x64K, post only", lambda: ea.write(peer, one, one), 2000)
torch.cuda.synchronize()
ea.close()
eb.close()
copier.close()
a.free()
b.free()
