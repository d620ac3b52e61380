"""A persistent child process for tests whose steps may kill the interpreter (a signal).

The runner (pytest, hypothesis) sends requests to a worker script over its stdin and reads
replies from its stdout: length-prefixed pickles, ``(op, kwargs)`` out and any picklable reply
back. A worker that dies fails the request with the signal's name (:class:`WorkerDied`) and
the next :meth:`Worker.ensure` starts a fresh one; a request that takes longer than the
timeout kills it. The worker side is :func:`serve`.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


class WorkerDied(AssertionError):
    """The child process died (a signal): the request that killed it fails."""


class Worker:
    """A child process running ``script`` (a :func:`serve` loop), started with ``start``'s
    keyword arguments as its first request."""

    def __init__(
        self, script: Path, timeout_s: float, *, pass_fds: tuple[int, ...] = (), **start: object
    ) -> None:
        self.script, self.timeout_s, self.start = script, timeout_s, start
        self.pass_fds = pass_fds
        self.process: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ensure(self) -> None:
        if self.alive:
            return
        env = dict(os.environ, PYTHONFAULTHANDLER="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        self.process = subprocess.Popen(
            [sys.executable, str(self.script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            pass_fds=self.pass_fds,
        )
        reply = self.call("start", **self.start)
        if reply[0] != "ok":
            raise AssertionError(f"the worker {self.script.name} did not start: {reply}")

    def call(self, op: str, **kwargs):
        data = pickle.dumps((op, kwargs))
        try:
            self.process.stdin.write(struct.pack("<Q", len(data)) + data)
            self.process.stdin.flush()
            (size,) = struct.unpack("<Q", self._read(8, op, kwargs))
            return pickle.loads(self._read(size, op, kwargs))
        except (BrokenPipeError, EOFError):
            code = self.process.wait()
            try:
                name = signal.Signals(-code).name if code < 0 else f"exit status {code}"
            except ValueError:
                name = f"status {code}"
            raise WorkerDied(f"the worker died ({name}) during {op}({kwargs})") from None

    def _read(self, size: int, op: str, kwargs: dict) -> bytes:
        stream = self.process.stdout
        chunks, remaining = [], size
        deadline = time.monotonic() + self.timeout_s
        while remaining:
            if not select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"{op}({kwargs}) hung for {self.timeout_s} s")
            chunk = os.read(stream.fileno(), remaining)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.alive:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve(handle: Callable[[str, dict], object]) -> None:
    """The worker's loop: ``handle(op, kwargs)`` answers each request, until stdin closes.

    The protocol owns the original stdout; anything else printed (by C code too) goes to
    stderr, so it cannot corrupt a frame."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = os.fdopen(0, "rb")
    while True:
        header = inp.read(8)
        if len(header) < 8:
            return
        (size,) = struct.unpack("<Q", header)
        op, kwargs = pickle.loads(inp.read(size))
        data = pickle.dumps(handle(op, kwargs))
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()
