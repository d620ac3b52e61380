"""``jaxbuf demo``: a buffer growing in place under torch and JAX views, then the decode
loop of :mod:`jaxbuf.demo` with a progress bar and a summary table."""

from __future__ import annotations

import argparse
from typing import Any

from ._shared import Printer, Progress, require, resolve_device


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    frameworks = args.framework or ["torch", "jax"]
    for framework in frameworks:
        require(framework, "the demo")
    from jaxbuf.bench import format_bytes
    from jaxbuf.extensible import ExtensibleTensor

    out = Printer()
    capacity = 64 << 20
    buf = ExtensibleTensor(capacity, device=device)
    base_ptr = buf.base_ptr
    out.line(
        f"Part 1: reserved {format_bytes(buf.capacity_bytes)} of address space on {device} at "
        f"{base_ptr:#x}; nothing is committed yet ({buf.physical_bytes} bytes)."
    )
    if len(frameworks) == 2:
        out.line(
            "Growing four times; each step writes its number into the new bytes through "
            "torch and sums the whole buffer through both torch and JAX."
        )
    else:
        out.line(
            f"Growing four times (zeroing the new bytes); {frameworks[0]} reads the "
            "buffer after each grow."
        )
    # Small enough that every float32 partial sum is an exact integer (< 2**24).
    sizes = [2 << 20, 4 << 20, 6 << 20, 8 << 20]
    rows, all_ok = [], True
    progress = Progress(len(sizes), "growing")
    try:
        for step, size in enumerate(sizes, start=1):
            old = buf.num_bytes
            # torch overwrites every new byte; without it, zero them on the device.
            buf.resize_per_segment_(size, zero_new="torch" not in frameworks)
            view = buf.segment_view(0).view("float32")
            same_base = buf.base_ptr == base_ptr
            row = [
                str(step),
                format_bytes(size),
                format_bytes(buf.physical_bytes),
                str(buf.num_physical_chunks),
                "yes" if same_base else "NO",
            ]
            # Step i fills its new bytes with the float i.
            grown = zip([0, *sizes], sizes[:step])
            expected = sum(i * (new - prev) // 4 for i, (prev, new) in enumerate(grown, start=1))
            sums = []
            if "torch" in frameworks:
                import torch

                tensor = view.to_torch()
                tensor[old // 4 :] = float(step)  # write the new bytes through torch
                if device.is_cuda:
                    torch.cuda.synchronize(device.index)
                sums.append(int(tensor.double().sum().item()))
                row += [f"{tensor.data_ptr():#x}", f"{sums[-1]:,}"]
                del tensor
            else:
                expected = 0  # zero_new zeroed the new bytes; nothing writes them
            if "jax" in frameworks:
                array = view.to_jax()  # reads what torch wrote: the same bytes
                sums.append(int(array.sum()))
                row += [f"{array.unsafe_buffer_pointer():#x}", f"{sums[-1]:,}"]
                del array
            ok = same_base and all(total == expected for total in sums)
            all_ok = all_ok and ok
            rows.append([*row, "ok" if ok else f"MISMATCH (expected {expected:,})"])
            progress.advance()
    finally:
        progress.close()
    columns = ["step", "committed", "physical", "chunks", "same base_ptr"]
    if "torch" in frameworks:
        columns += ["torch data_ptr", "torch sum"]
    if "jax" in frameworks:
        columns += ["JAX buffer ptr", "JAX sum"]
    columns.append("check")
    out.table(
        f"ExtensibleTensor on {device}: grown 4 times, one base pointer",
        columns,
        rows,
        right=(1, 2, 3, 6, 8),
    )
    out.line(
        "Every framework array points at the same address: the buffer grew in place, "
        "so views (and CUDA graphs) taken before a grow stay valid after it."
    )
    buf.free()
    if len(frameworks) == 2:
        all_ok = _decode_loop(out, device, args.steps) and all_ok
    else:
        out.line("(The decode-loop part needs both torch and JAX; run without --framework.)")
    return 0 if all_ok else 1


def _decode_loop(out: Printer, device: Any, steps: int) -> bool:
    """Part 2: the decode loop of notebook 4, with a progress bar and a summary table."""
    import statistics

    from jaxbuf.bench import format_bytes, format_seconds
    from jaxbuf.demo import run_decode_demo

    out.line()
    out.line(
        f"Part 2: the decode loop of notebooks/04_decode_loop.py on {device}: a paged KV "
        "cache (ExtensibleTensor) that commits a page as a sequence crosses a block, a "
        "block table updated by staged writes, per-step metadata from a UVA pool, and "
        "torch checking JAX's attention on the same memory every step."
    )
    progress = Progress(steps, "decoding")

    def on_step(record: dict[str, Any]) -> None:
        committed = format_bytes(record["committed_bytes"])
        progress.describe(f"step {record['step']}: {committed} committed")
        progress.advance()

    try:
        records = run_decode_demo(device, steps, progress=on_step)
    finally:
        progress.close()
    grew = [r["step"] for r in records if r["grew"]]
    failed = [r["step"] for r in records if not r["check_ok"]]
    worst = max(r["max_diff"] for r in records)
    first, last = records[0], records[-1]
    step_s = [r["step_s"] for r in records]
    steady = [r["step_s"] for r in records[1:] if not r["grew"]]
    if failed:
        check = f"MISMATCH at steps {failed} (max |diff| {worst:.1e})"
    else:
        check = f"ok: {len(records)}/{len(records)} steps, max |diff| {worst:.1e}"
    pages = sum(r["new_pages"] for r in records)
    growth = f"{pages} page(s) at steps {', '.join(map(str, grew)) or 'none'}"
    committed = (
        f"{format_bytes(first['committed_bytes'])} -> {format_bytes(last['committed_bytes'])} "
        f"(physical {format_bytes(last['physical_bytes'])})"
    )
    median = (
        f"{format_seconds(statistics.median(step_s))} (steps without growth "
        f"{format_seconds(statistics.median(steady) if steady else None)}; "
        "growth steps re-trace the JAX step for the new cache shape)"
    )
    lengths = f"{first['lengths']} -> {last['lengths']}"
    summary = [
        ["steps", f"{len(records)} (4 sequences, lengths {lengths})"],
        ["growth events", growth],
        ["committed (K + V)", committed],
        ["median step", median],
        ["torch check", check],
    ]
    out.table(f"decode loop on {device}: summary", ["", ""], summary)
    return not failed


def decode_steps(text: str) -> int:
    """``--steps``: the decode loop's cache holds 20 more tokens after its prefill."""
    if not text.isdigit() or not 1 <= int(text) <= 20:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 20, got {text!r}")
    return int(text)
