"""Fresh interpreters for tests, forked from a parent that has already imported the frameworks.

Many tests run a snippet in a new interpreter so that a signal fails one case, not the runner,
and so that interpreter exit is part of the case. Importing torch and JAX costs each such child
2 to 4 s of CPU; on the 2-core CI machine that was half of the test command's time. Here a
*fork server* per (interpreter flags, environment) imports numpy, torch, JAX and jaxbuf once,
initialising no device, and forks a child per request. The child:

- runs the ``-c`` code or the script as ``__main__`` (``sys.argv``, ``sys.path[0]``, cwd and
  stdio as a fresh ``python`` would have them: stdout and stderr to files, stdin empty);
- exits through the interpreter's normal shutdown (atexit handlers, module teardown, flushes),
  so exit-time behaviour is tested as before; an uncaught exception exits 1 with its traceback;
- dies by its own signal, which the caller sees as a negative ``returncode``.

What a child shares with its fork server and a fresh interpreter would not: the modules above
are already imported, and numpy's global random state is the server's (Python's ``random`` is
reseeded at fork). Environment variables read at import (``JAX_*``) are the server's, so the
environment is part of the server's key; code that sets them in ``os.environ`` before its own
``import jax`` needs :func:`subprocess.run`. ``JAXBUF_TEST_CHILDREN=spawn`` makes every call a
real fresh interpreter.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from _child import read_frame, write_frame

SPAWN_ONLY = os.environ.get("JAXBUF_TEST_CHILDREN") == "spawn"
PRELOAD = ("numpy", "torch", "jax", "jax.numpy", "jaxbuf", "jaxbuf.interop")
# Set per test by pytest, read at no import: not part of a server's key (the child gets it).
VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
MAX_SERVERS = 3  # per test process; each holds about 400 MB until it is closed


def run(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    text: bool = True,
    spawn: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=text, ...)`` for ``args`` of the form
    ``[sys.executable, *flags, "-c", code | script, *argv]``, answered by a fork server when it
    can be. ``spawn=True`` (for a case about what gets imported) and other forms run as a plain
    subprocess."""
    parsed = _parse(args)
    if spawn or SPAWN_ONLY or parsed is None:
        return subprocess.run(
            args, capture_output=True, text=text, env=env, cwd=cwd, timeout=timeout
        )
    flags, main, argv = parsed
    env = dict(os.environ if env is None else env)
    request = {"main": main, "argv": argv, "cwd": os.fspath(cwd or os.getcwd()), "env": env}
    return _server(tuple(flags), env).run(args, request, timeout=timeout, text=text)


def _parse(args: list[str]) -> tuple[list[str], tuple[str, str], list[str]] | None:
    """(interpreter flags, ("code" | "script", text or path), sys.argv) or None."""
    if not args or args[0] != sys.executable:
        return None
    flags, rest = [], list(args[1:])
    while rest and rest[0] == "-X" and len(rest) > 1:
        flags += rest[:2]
        rest = rest[2:]
    if len(rest) >= 2 and rest[0] == "-c":
        return flags, ("code", rest[1]), ["-c", *rest[2:]]
    if rest and not rest[0].startswith("-"):
        return flags, ("script", os.path.abspath(rest[0])), rest
    return None


class _Server:
    """One fork server process; requests are length-prefixed pickles over its stdin/stdout."""

    def __init__(self, flags: tuple[str, ...], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, *flags, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    def run(self, args, request: dict, *, timeout, text) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="jaxbuf_child_") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {**request, "stdout": str(out), "stderr": str(err)}
            write_frame(self.process.stdin.fileno(), request)
            replies = self.process.stdout.fileno()
            pid = read_frame(replies, None)
            timed_out = False
            try:
                status = read_frame(replies, timeout)
            except TimeoutError:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                status = read_frame(replies, None)
            stdout, stderr = out.read_bytes(), err.read_bytes()
        if text:
            stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), stdout, stderr)

    def close(self) -> None:
        self.process.stdin.close()  # the server reads EOF and exits
        self.process.wait()
        self.process.stdout.close()  # else it is reported unclosed when the runner exits


_servers: dict[tuple, _Server] = {}


def _server(flags: tuple[str, ...], env: dict[str, str]) -> _Server:
    key = (flags, tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE)))
    server = _servers.pop(key, None)
    if server is None or server.process.poll() is not None:
        while len(_servers) >= MAX_SERVERS:
            _servers.pop(next(iter(_servers))).close()
        server = _Server(flags, env)
    _servers[key] = server  # the most recently used last
    return server


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


# -- the server side ------------------------------------------------------------------------------


def _serve() -> dict:
    """Import PRELOAD, then fork a child per request; returns the request in the child."""
    import contextlib
    import gc
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # What the server imported stays shared with its children: their collections skip it
    # instead of touching (and so copying) every page of it.
    gc.freeze()
    while True:
        try:
            request = read_frame(0, None)
        except EOFError:
            os._exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        write_frame(1, pid)
        _, status = os.waitpid(pid, 0)
        write_frame(1, status)


def _become(request: dict) -> tuple[str, str]:
    """Turn this forked child into the requested interpreter: stdio, cwd, argv, path."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    stderr = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    kind, main = request["main"]
    sys.argv = list(request["argv"])
    sys.path[0] = "" if kind == "code" else os.path.dirname(main)
    return kind, main


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _request = _serve()
    _kind, _main = _become(_request)
    import types

    _module = types.ModuleType("__main__")
    _module.__builtins__ = __builtins__
    if _kind == "code":
        _source, _filename = _main, "<string>"
    else:
        _source, _filename = Path(_main).read_text(), _main
        _module.__file__ = _main
    sys.modules["__main__"] = _module
    # Uncaught, an exception ends the interpreter as it would end a fresh one: traceback, 1.
    exec(compile(_source, _filename, "exec"), _module.__dict__)
