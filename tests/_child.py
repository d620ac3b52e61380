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
        self._close_pipes()  # a worker that died: its replacement gets new pipes
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
        try:
            write_frame(self.process.stdin.fileno(), (op, kwargs))
            return read_frame(self.process.stdout.fileno(), self.timeout_s)
        except TimeoutError:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"{op}({kwargs}) hung for {self.timeout_s} s") from None
        except (BrokenPipeError, EOFError):
            code = self.process.wait()
            try:
                name = signal.Signals(-code).name if code < 0 else f"exit status {code}"
            except ValueError:
                name = f"status {code}"
            raise WorkerDied(f"the worker died ({name}) during {op}({kwargs})") from None

    def close(self) -> None:
        if self.alive:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        """Close the pipes of the last process (ended): left open, each is reported as an
        unclosed file when the runner exits."""
        if self.process is not None:
            self.process.stdin.close()
            self.process.stdout.close()


def write_frame(fd: int, value: object) -> None:
    """Write ``value`` to ``fd`` as one frame: its pickle's length (8 bytes, little-endian),
    then the pickle."""
    data = pickle.dumps(value)
    data = struct.pack("<Q", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def read_frame(fd: int, timeout: float | None) -> object:
    """The next frame's value from ``fd``: TimeoutError when the whole frame has not arrived
    within ``timeout`` seconds (None: wait), EOFError when the other side closed first."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def read(size: int) -> bytes:
        chunks, remaining = [], size
        while remaining:
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(fd, remaining)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    (size,) = struct.unpack("<Q", read(8))
    return pickle.loads(read(size))


def serve(handle: Callable[[str, dict], object]) -> None:
    """The worker's loop: ``handle(op, kwargs)`` answers each request, until stdin closes.

    The protocol owns the original stdout; anything else printed (by C code too) goes to
    stderr, so it cannot corrupt a frame."""
    out = os.dup(1)
    os.dup2(2, 1)
    while True:
        try:
            op, kwargs = read_frame(0, None)
        except EOFError:
            return
        write_frame(out, handle(op, kwargs))
