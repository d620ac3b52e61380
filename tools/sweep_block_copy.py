"""Device time of the block-copy kernel for piece sizes, tiles and warps: 1,024 scattered
64 KiB blocks (and 1 x 64 MiB) between two torch buffers, against torch's one copy_ of the
same bytes. A development aid for jaxbuf.kernels.block_copy's constants."""

import numpy as np
import torch

from jaxbuf.kernels.block_copy import _copy_pieces_kernel
from jaxbuf.transfer._device_copy import _pieces

MiB = 1 << 20
src = torch.randint(0, 255, (256 * MiB,), dtype=torch.uint8, device="cuda")
dst = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
rng = np.random.default_rng(0)
block = 64 * 1024
slots = 256 * MiB // block
ours = rng.permutation(slots)[:1024].astype(np.uint64)
theirs = rng.permutation(slots)[:1024].astype(np.uint64)
dsts = np.uint64(dst.data_ptr()) + theirs * np.uint64(block)
srcs = np.uint64(src.data_ptr()) + ours * np.uint64(block)
sizes = np.full(1024, block, np.uint64)


def device_ms(fn, n=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


print(f"torch copy_ 64 MiB: {device_ms(lambda: dst[: 64 * MiB].copy_(src[: 64 * MiB])):.1f} us")
for piece in (16 * 1024, 32 * 1024, 64 * 1024, 256 * 1024):
    for tile in (512, 1024, 2048):
        for warps in (4, 8):
            for name, d, s, z in (
                ("1024x64K", dsts, srcs, sizes),
                ("1x64M", dsts[:1], srcs[:1], np.array([64 * MiB], np.uint64)),
            ):
                table = torch.from_numpy(_pieces(d, s, z, piece).view(np.int64)).cuda()
                n = table.shape[0]
                us = device_ms(
                    lambda: _copy_pieces_kernel[(n,)](
                        table.data_ptr(), n, TILE=tile, num_warps=warps
                    )
                )
                print(
                    f"piece {piece // 1024:4d} KiB tile {tile:5d} warps {warps}: {name} "
                    f"{us:7.1f} us ({64 * MiB / us / 1e3:6.0f} GB/s)"
                )
ok = torch.equal(dst[theirs[0].item() * block :][:block], src[ours[0].item() * block :][:block])
print("bytes ok:", ok)
