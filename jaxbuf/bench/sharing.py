"""Benchmarks of cross-process sharing (:mod:`jaxbuf.sharing`), baselines in the same run.

Suite ``sharing.import``: the latency, measured in a second process, from asking the owner
for its buffer to holding a usable view of it (:func:`jaxbuf.sharing.recv_buffer` +
``segment_view``), for a buffer of 1 chunk and of 64 chunks (one granule each). Baseline:
the same bytes re-sent through the same Unix socket (the copy a process without shared
memory makes): on the CPU received straight into preallocated memory, on CUDA received into
host memory and copied to a preallocated device buffer.

The second process is started once per run (its start-up is not timed); it reports its own
``perf_counter`` samples over a control socket.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxbuf.bench import Row, Sizes, format_bytes, suite
from jaxbuf.extensible import ExtensibleTensor, granule_size
from jaxbuf.sharing import send_buffer

_CHUNK_COUNTS = (1, 64)
_QUICK_CHUNK_COUNTS = (1, 8)  # --quick: a smoke run, 16 MiB instead of 128 MiB

_IMPORTER = textwrap.dedent(
    r"""
    import ctypes, json, socket, sys, time
    import numpy as np
    from jaxbuf.extensible import ExtensibleTensor
    from jaxbuf.sharing import recv_buffer

    data = socket.socket(fileno=int(sys.argv[1]))
    control = socket.socket(fileno=int(sys.argv[2])).makefile("rw")
    device = sys.argv[3]

    def say(**message):
        control.write(json.dumps(message) + "\n")
        control.flush()

    def recv_into(view, nbytes):
        done = 0
        while done < nbytes:
            got = data.recv_into(view[done:], nbytes - done)
            if not got:
                raise ConnectionError("owner closed the socket")
            done += got

    target = None
    while True:
        command = json.loads(control.readline())
        kind = command["do"]
        if kind == "quit":
            break
        nbytes = command["nbytes"]
        if kind == "import":
            start = time.perf_counter()
            say(ready=True)
            buffer = recv_buffer(data, device=device)
            view = buffer.segment_view(0)
            if view.device.platform == "cpu":
                view.to_numpy()[:1].copy()  # usable: the first byte reads
            seconds = time.perf_counter() - start
            buffer.close()
            say(seconds=seconds)
        elif kind == "copy":
            if target is None or target.num_bytes != nbytes:
                if target is not None:
                    target.free()
                target = ExtensibleTensor(nbytes, device=device)
                target.resize_per_segment_(nbytes)
                host = None if target.device.platform == "cpu" else np.empty(nbytes, np.uint8)
            start = time.perf_counter()
            say(ready=True)
            if host is None:  # CPU: straight into the buffer's memory
                memory = (ctypes.c_char * nbytes).from_address(target.base_ptr)
                recv_into(memoryview(memory).cast("B"), nbytes)
            else:
                recv_into(memoryview(host), nbytes)
                index = target.device.index
                target.driver.copy(target.base_ptr, host.ctypes.data, nbytes, index)
                target.driver.synchronize(index)
            seconds = time.perf_counter() - start
            say(seconds=seconds)
    if target is not None:
        target.free()
    """
)


class _Importer:
    def __init__(self, device: Any) -> None:
        self.data, child_data = socket.socketpair()
        control, child_control = socket.socketpair()
        control.settimeout(300)
        self._control_socket = control
        self.control = control.makefile("rw")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _IMPORTER,
                str(child_data.fileno()),
                str(child_control.fileno()),
                str(device),
            ],
            pass_fds=(child_data.fileno(), child_control.fileno()),
            stderr=subprocess.PIPE,
            text=True,
        )
        child_data.close()
        child_control.close()

    def ask(self, **command: Any) -> None:
        self.control.write(json.dumps(command) + "\n")
        self.control.flush()

    def hear(self) -> dict:
        line = self.control.readline()
        if not line:
            _, err = self.process.communicate(timeout=60)
            raise RuntimeError(f"the importer process died (rc={self.process.returncode}): {err}")
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.ask(do="quit")
                self.process.communicate(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.control.close()
            self._control_socket.close()
            self.data.close()


def _median_import(importer: _Importer, tensor: ExtensibleTensor, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        importer.ask(do="import", nbytes=tensor.num_bytes)
        if not importer.hear().get("ready"):
            raise RuntimeError("the importer process did not get ready")
        send_buffer(importer.data, tensor)
        samples.append(importer.hear()["seconds"])
    return statistics.median(samples[1:] if len(samples) > 1 else samples)


def _median_copy(importer: _Importer, payload: memoryview, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        importer.ask(do="copy", nbytes=payload.nbytes)
        if not importer.hear().get("ready"):
            raise RuntimeError("the importer process did not get ready")
        importer.data.sendall(payload)
        samples.append(importer.hear()["seconds"])
    return statistics.median(samples[1:] if len(samples) > 1 else samples)


@suite("sharing.import")
def import_latency(device: Any, quick: bool) -> Iterator[Row | Sizes]:
    """Import latency in a second process (recv -> usable view) against re-sending the bytes
    through the socket."""
    # The first round of each is a warm-up; the CPU's run stays short.
    rounds = 4 if quick else (21 if device.is_cuda else 11)
    chunk = granule_size(device)
    chunk_counts = _QUICK_CHUNK_COUNTS if quick else _CHUNK_COUNTS
    counts = " and ".join(map(str, chunk_counts))
    yield Sizes(f"{counts} chunks of {format_bytes(chunk)}, {rounds - 1} rounds")
    importer = _Importer(device)
    try:
        for chunks in chunk_counts:
            tensor = ExtensibleTensor(chunks * chunk, device=device)
            try:
                for n in range(1, chunks + 1):  # one chunk per grow
                    tensor.resize_per_segment_(n * chunk)
                nbytes = tensor.num_bytes
                host = np.empty(nbytes, dtype=np.uint8)
                # A pattern that no chunk boundary repeats (251 is prime), built in uint8.
                host[:] = np.resize(np.arange(251, dtype=np.uint8), nbytes)
                index = tensor.device.index
                tensor.driver.copy(tensor.base_ptr, host.ctypes.data, nbytes, index)
                tensor.driver.synchronize(index)
                imported = _median_import(importer, tensor, rounds)
                copied = _median_copy(importer, memoryview(host), rounds)
                yield Row(
                    f"import {chunks} chunk{'s' if chunks > 1 else ''} ({format_bytes(nbytes)})",
                    imported,
                    "re-send the bytes through the socket (copy)",
                    copied,
                    notes="second process; recv -> usable view"
                    + (
                        ""
                        if device.is_cuda
                        else "; CPU descriptors reopened through /proc/self/map_files"
                    ),
                    params={
                        "chunks": chunks,
                        "chunk_bytes": chunk,
                        "size_bytes": nbytes,
                        "rounds": rounds - 1,
                    },
                )
            finally:
                tensor.free()
    finally:
        importer.close()
