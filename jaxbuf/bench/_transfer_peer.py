"""The two processes of the transfer benchmarks (:mod:`jaxbuf.bench.transfer`): prefill and
decode, one process each, as an inference deployment runs them.

Each side runs :func:`serve` in a fresh interpreter of its own (``python -m
jaxbuf.bench._transfer_peer``: nothing is forked, which CUDA and UCX would not survive, and
nothing of the caller's ``__main__`` runs again) and answers commands from the bench process
over a socket pair. The bench process only relays: it hands each side the other's metadata,
then asks the prefill side to time its transfers; the decode side holds its memory and its
endpoints and stays passive (WRITE and READ are one-sided). All figures are timed in one
process, the prefill one, the subjects interleaved round by round in the same pair of processes.

A side holds, for one block size at a time (:meth:`_Side.setup`):

* a jaxbuf buffer grown one granule per grow, with a NIXL :class:`~jaxbuf.transfer.KVEndpoint`
  (``transport="nixl"``) and a same-host endpoint (``transport="local"``, a plain name for an
  agent) over it; the latter is absent, with the reason, where this jaxbuf has no same-host
  transport;
* a plain allocation (``torch.empty`` on CUDA, numpy on the CPU) registered whole with the same
  NIXL agent, and prepared descriptor lists of its blocks on both sides;
* on the prefill side, a second plain allocation: the destination of the floor, the device's
  own copy of the same bytes in one process.

The ``transfer.kv_cache`` suite's sides extend :class:`_Side` with a KV cache shaped like a
model's, in :mod:`jaxbuf.bench._kv_cache_peer`, and run as that module.

Which transport moved the bytes: the same-host endpoint's peer says it (``peer.transport``);
for NIXL, UCX says it when asked (``UCX_PROTO_INFO=y``, written to ``UCX_LOG_FILE``): the
prefill process reads the protocols UCX selected for remote writes and reads from its log.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from jaxbuf._errors import Cleanup
from jaxbuf.bench._ucx_log import UcxLog, describe_nixl

__all__ = ["TwoProcesses", "serve"]

#: Seconds the bench process waits for a side's answer to a command not in the side's
#: :attr:`_Side.timeouts`.
_DEFAULT_TIMEOUT = 120.0
#: Seconds a transfer may take before the bench calls it stuck.
_TRANSFER_TIMEOUT = 60.0


class _Side:
    """One process's buffers, endpoints and descriptor lists for one block size."""

    #: Seconds the bench process waits for this side's answer to a command, by command
    #: (default :data:`_DEFAULT_TIMEOUT`): a NIXL agent and a grown buffer take seconds on a
    #: slow host.
    timeouts = {"setup": 300.0, "bandwidth": 600.0, "host_cost": 300.0}

    def __init__(self, role: str, device: str, ucx_log: str | None) -> None:
        import numpy as np

        from jaxbuf.devices import as_device

        self.np = np
        self.role = role
        self.device = as_device(device)
        self.log = UcxLog(ucx_log)
        self.torch: Any = None
        if self.device.is_cuda:
            import torch

            self.torch = torch
            torch.cuda.set_device(self.device.index)
        self._cleanup: list[Callable[[], None]] = []
        self.group = 0

    def commands(self) -> dict[str, Callable[..., Any]]:
        """What :func:`serve` answers: command name -> method."""
        return {
            "setup": self.setup,
            "connect": self.connect,
            "bandwidth": self.bandwidth,
            "host_cost": self.host_cost,
            "teardown": self.teardown,
        }

    # -- memory -----------------------------------------------------------------------
    def _plain(self, nbytes: int) -> tuple[Any, int]:
        """A plain allocation of ``nbytes``, touched, and its address."""
        if self.device.is_cuda:
            array = self.torch.full((nbytes,), 1, dtype=self.torch.uint8, device=str(self.device))
            return array, array.data_ptr()
        array = self.np.empty(nbytes, dtype=self.np.uint8)
        array[:] = 1
        return array, array.ctypes.data

    def _grown(self, nbytes: int) -> Any:
        """A jaxbuf buffer of ``nbytes`` committed one granule per grow, touched."""
        from jaxbuf.extensible import ExtensibleTensor, granule_size

        chunk = granule_size(self.device)
        tensor = ExtensibleTensor(nbytes, device=self.device)
        self._cleanup.append(tensor.free)
        for size in range(chunk, nbytes + 1, chunk):
            tensor.resize_per_segment_(size)
        if self.device.is_cuda:
            tensor.segment_view(0).to_torch().fill_(1)
        else:
            tensor.segment_view(0).to_numpy()[:] = 1
        return tensor

    def _rows(self, address: int, count: int, device_id: int) -> Any:
        np = self.np
        rows = np.empty((count, 3), dtype=np.uint64)
        rows[:, 0] = address + np.arange(count, dtype=np.uint64) * self.block_bytes
        rows[:, 1], rows[:, 2] = self.block_bytes, device_id
        return rows

    # -- commands ---------------------------------------------------------------------
    def setup(self, block_bytes: int, capacity: int) -> dict[str, Any]:
        """Build this side for blocks of ``block_bytes`` in ``capacity`` bytes; what the
        other side needs to connect (plain values and bytes)."""
        from jaxbuf.extensible import granule_size
        from jaxbuf.transfer import Agent, KVEndpoint, KVLayout

        self.teardown()
        self.group += 1
        chunk = granule_size(self.device)
        capacity = -(-capacity // chunk) * chunk
        self.block_bytes, self.capacity = block_bytes, capacity
        layout = KVLayout(block_bytes)
        name = f"bench-{self.role}-{os.getpid()}-{self.group}"
        self.agent = Agent(name)
        self._cleanup.append(self.agent.close)
        self.tensor = self._grown(capacity)
        self.nixl_endpoint = _nixl_endpoint(KVEndpoint, self.agent, self.tensor, layout)
        self._cleanup.append(self.nixl_endpoint.close)
        self.local_endpoint: Any = None
        self.local_error: str | None = None
        try:
            self.local_endpoint = KVEndpoint(
                f"{name}-local", self.tensor, layout, transport="local"
            )
        except Exception as error:  # noqa: BLE001 - the reason goes into the skipped rows
            self.local_error = (
                "the same-host transport is not available: KVEndpoint(name, tensor, layout, "
                f"transport='local') raised {type(error).__name__}: {error}"
            )
        else:
            self._cleanup.append(self.local_endpoint.close)
        registration = self.nixl_endpoint.registration
        self.mem_type, self.device_id = registration.mem_type, registration.device_id
        self.plain, self.plain_address = self._plain(capacity)
        handle = self.agent.register(
            [(self.plain_address, capacity)], self.mem_type, self.device_id
        )
        self._cleanup.append(lambda: self.agent.deregister(handle))
        if self.role == "prefill":
            self.floor_target, _ = self._plain(capacity)
        return {
            "nixl": self.nixl_endpoint.metadata(),  # after every registration: it lists them
            "local": None if self.local_endpoint is None else self.local_endpoint.metadata(),
            "local_error": self.local_error,
            "plain_address": self.plain_address,
            "agent": self.agent.name,
            "capacity": capacity,
        }

    def connect(self, other: dict[str, Any]) -> dict[str, Any]:
        """Connect both endpoints to the other side's and prepare the plain memory's lists."""
        from jaxbuf.transfer._nixl import LOCAL_AGENT

        self.nixl_peer = self.nixl_endpoint.connect(other["nixl"])
        self.local_peer: Any = None
        if self.local_endpoint is not None and other["local"] is None:
            self.local_error = f"the other side has no same-host endpoint: {other['local_error']}"
        elif self.local_endpoint is not None:
            try:
                self.local_peer = self.local_endpoint.connect(other["local"])
            except Exception as error:  # noqa: BLE001 - the reason goes into the skipped rows
                self.local_error = (
                    f"the same-host endpoint failed to connect: {type(error).__name__}: {error}"
                )
        count = self.capacity // self.block_bytes
        agent = self.agent
        local = agent.prep_dlist(
            LOCAL_AGENT, self._rows(self.plain_address, count, self.device_id), self.mem_type
        )
        self._cleanup.append(lambda: agent.release_dlist(local))
        remote = agent.prep_dlist(
            other["agent"], self._rows(other["plain_address"], count, self.device_id), self.mem_type
        )
        self._cleanup.append(lambda: agent.release_dlist(remote))
        self.plain_lists = (local, remote)
        return {
            "nixl_transport": getattr(self.nixl_peer, "transport", "nixl"),
            "local_transport": None if self.local_peer is None else self.local_peer.transport,
            "local_error": self.local_error,
        }

    def _calls(self, operation: str, count: int) -> dict[str, Callable[[], None]]:
        """The subjects of one bandwidth row set: the floor, the same-host endpoint (where
        it works), NIXL over jaxbuf memory, NIXL over plain memory."""
        np = self.np
        # Scattered block ids on both sides, as a KV cache's are: no two blocks adjacent on
        # both sides, so no transport (nor the floor) can merge them into one copy.
        rng = np.random.default_rng(count)
        slots = self.capacity // self.block_bytes
        local = rng.permutation(slots)[:count].astype(np.int64)
        remote = rng.permutation(slots)[:count].astype(np.int64)
        calls = {"floor": self._floor(count * self.block_bytes)}
        method = operation.lower()
        if self.local_peer is not None:
            local_post = getattr(self.local_endpoint, method)
            local_peer = self.local_peer
            calls["local"] = lambda: local_post(local_peer, local, remote).wait(_TRANSFER_TIMEOUT)
        nixl_post, nixl_peer = getattr(self.nixl_endpoint, method), self.nixl_peer
        calls["nixl jaxbuf"] = lambda: nixl_post(nixl_peer, local, remote).wait(_TRANSFER_TIMEOUT)
        post, finish = self._plain_nixl(operation, local, remote)
        calls["nixl plain"] = lambda: finish(post())
        return calls

    def _plain_nixl(
        self, operation: str, blocks: Any, remote_blocks: Any = None, lists: Any = None
    ) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """Post / finish a transfer of ``blocks`` (indices into the prepared lists, the
        plain allocations' by default) through NIXL's own calls, as a NIXL user writes it."""
        nixl = self.agent.nixl
        local, remote = self.plain_lists if lists is None else lists
        theirs = blocks if remote_blocks is None else remote_blocks

        def post() -> Any:
            handle = nixl.make_prepped_xfer(operation, local, blocks, remote, theirs, b"")
            return handle, nixl.transfer(handle, b"")

        def finish(posted: Any) -> None:
            handle, state = posted
            deadline = time.monotonic() + _TRANSFER_TIMEOUT
            try:
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"a plain NIXL {operation} did not finish")
                    state = nixl.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"a plain NIXL {operation} reported {state}")
            finally:
                nixl.release_xfer_handle(handle)

        return post, finish

    def _floor(self, nbytes: int) -> Callable[[], None]:
        """The physical floor: the device's own copy of ``nbytes`` between two plain buffers
        of this process, in one copy (``np.copyto`` on the CPU, torch's ``copy_`` plus a
        synchronize on CUDA)."""
        target, source = self.floor_target[:nbytes], self.plain[:nbytes]
        if self.device.is_cuda:
            synchronize, index = self.torch.cuda.synchronize, self.device.index

            def device_copy() -> None:
                target.copy_(source, non_blocking=True)
                synchronize(index)

            return device_copy
        copyto = self.np.copyto
        return lambda: copyto(target, source)

    def floor_description(self) -> str:
        if self.device.is_cuda:
            return f"one torch copy_ of the same bytes on {self.device} + synchronize"
        return "one np.copyto (memcpy) of the same bytes"

    def _nixl_description(self, label: str, operation: str) -> str:
        memory = "plain memory" if label == "nixl plain" else "jaxbuf memory"
        ucx_memory = "cuda" if self.mem_type == "VRAM" else "host"
        return describe_nixl(self.log.transports(operation, ucx_memory), memory)

    def _local_description(self, peer: Any = None) -> str:
        peer = self.local_peer if peer is None else peer
        return f"same-host transport (peer.transport={peer.transport!r})"

    def bandwidth(self, operation: str, count: int, quick: bool) -> dict[str, Any]:
        """Median seconds of each subject moving ``count`` blocks, round by round, and the
        transport each took."""
        from jaxbuf.bench._timing import round_by_round

        calls = self._calls(operation, count)
        transports = {"floor": self.floor_description()}
        warm, single = 0.0, {}
        for label, call in calls.items():
            self.log.mark()
            call()
            start = time.perf_counter()
            call()
            single[label] = time.perf_counter() - start
            warm += 0.0 if single[label] > 0.02 else single[label]
            if label.startswith("nixl"):
                transports[label] = self._nixl_description(label, operation)
            elif label == "local":
                transports[label] = self._local_description()
        # About two seconds of rounds at full sizes (more rounds where a round is short,
        # where host jitter moves a median most), a smoke run's worth with quick.
        rounds = 5 if quick else max(15, min(301, int(2.0 / max(warm, 1e-6))))
        # A subject a thousand times slower than the floor (NIXL through TCP) is sampled on
        # its own: interleaved, it leaves the device idle for long stretches, and the fast
        # subjects would be timed on a cold device.
        slow = {label for label, seconds in single.items() if seconds > 0.02}
        fast_calls = {label: call for label, call in calls.items() if label not in slow}
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            medians = round_by_round(fast_calls, rounds)
            if slow:
                slow_rounds = 3 if quick else 7
                medians.update(
                    round_by_round({k: calls[k] for k in calls if k in slow}, slow_rounds)
                )
        finally:
            if gc_was_enabled:
                gc.enable()
        return {"medians": medians, "transports": transports, "rounds": rounds}

    def host_cost(self, rounds: int) -> dict[str, Any]:
        """Median host seconds of posting a one-block WRITE (``post``) and of posting and
        waiting for it (``total``), per subject, round by round."""
        np = self.np
        blocks = np.zeros(1, dtype=np.int64)
        posts: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        if self.local_peer is not None:
            write, peer = self.local_endpoint.write, self.local_peer
            posts["local"] = (
                lambda: write(peer, blocks, blocks),
                lambda t: t.wait(_TRANSFER_TIMEOUT),
            )
        nixl_write, nixl_peer = self.nixl_endpoint.write, self.nixl_peer
        posts["nixl jaxbuf"] = (
            lambda: nixl_write(nixl_peer, blocks, blocks),
            lambda t: t.wait(_TRANSFER_TIMEOUT),
        )
        posts["nixl plain"] = self._plain_nixl("WRITE", blocks)
        transports = {}
        for label, (post, finish) in posts.items():
            self.log.mark()
            for _ in range(5):
                finish(post())
            if label.startswith("nixl"):
                transports[label] = self._nixl_description(label, "WRITE")
            else:
                transports[label] = self._local_description()
        post_samples: dict[str, list[float]] = {label: [] for label in posts}
        total_samples: dict[str, list[float]] = {label: [] for label in posts}
        labels = list(posts)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for i in range(rounds):
                for label in labels if i % 2 == 0 else reversed(labels):
                    post, finish = posts[label]
                    start = time.perf_counter_ns()
                    posted = post()
                    posted_at = time.perf_counter_ns()
                    finish(posted)
                    stop = time.perf_counter_ns()
                    post_samples[label].append((posted_at - start) * 1e-9)
                    total_samples[label].append((stop - start) * 1e-9)
        finally:
            if gc_was_enabled:
                gc.enable()
        return {
            "post": {label: statistics.median(s) for label, s in post_samples.items()},
            "total": {label: statistics.median(s) for label, s in total_samples.items()},
            "transports": transports,
            "rounds": rounds,
        }

    def teardown(self) -> None:
        """Release what :meth:`setup` and :meth:`connect` (or a subclass's commands) made,
        newest first; raise the first failure after trying every step."""
        cleanup = Cleanup("the transfer bench's teardown")
        while self._cleanup:
            cleanup.run(self._cleanup.pop())
        self.plain = self.floor_target = None
        cleanup.raise_first()


def _nixl_endpoint(endpoint_type: Any, agent: Any, tensor: Any, layout: Any) -> Any:
    """A NIXL endpoint: ``transport="nixl"`` where the endpoint takes a transport, the only
    kind of endpoint there is where it does not."""
    try:
        return endpoint_type(agent, tensor, layout, transport="nixl")
    except TypeError as error:
        if "transport" not in str(error):
            raise
        return endpoint_type(agent, tensor, layout)


def serve(
    connection: Any, role: str, device: str, ucx_log: str | None, side_type: type[_Side] = _Side
) -> None:
    """A side's command loop, a ``side_type`` answering ``(command, *args)`` with ``("ok",
    result)`` or ``("error", traceback)`` until ``("stop",)`` (or until the bench process is
    gone)."""
    side = None
    try:
        side = side_type(role, device, ucx_log)
        commands = side.commands()
        connection.send(("ok", os.getpid()))
    except Exception:  # noqa: BLE001 - sent to the bench process, which raises it
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            command, *args = connection.recv()
        except EOFError:  # the bench process is gone: release everything and end
            command, args = "stop", []
        if command == "stop":
            try:
                side.teardown()
                reply: tuple[str, Any] = ("ok", None)
            except Exception:  # noqa: BLE001 - sent to the bench process, which reports it
                reply = ("error", traceback.format_exc())
            with contextlib.suppress(OSError):  # the bench process may be gone
                connection.send(reply)
            return
        try:
            connection.send(("ok", commands[command](*args)))
        except Exception:  # noqa: BLE001 - sent to the bench process, which raises it
            connection.send(("error", traceback.format_exc()))


class _Process:
    """The bench process's handle on one side: ``python -m <the module of side_type>``
    (a fresh interpreter, which imports nothing of the caller's ``__main__``), a
    :class:`multiprocessing.connection.Connection` over a socket pair, a timeout on every
    answer, and :meth:`close`, which always ends the process."""

    def __init__(self, role: str, device: str, ucx_log: str | None, side_type: type[_Side]) -> None:
        import jaxbuf

        self.role, self.timeouts = role, side_type.timeouts
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The interpreter finds this jaxbuf, whatever the working directory.
        root = os.path.dirname(os.path.dirname(os.path.abspath(jaxbuf.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        if ucx_log is not None:  # read by UCX when it loads, at the first NIXL agent
            env["UCX_PROTO_INFO"] = "y"
            env["UCX_LOG_FILE"] = ucx_log
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    side_type.__module__,
                    str(theirs.fileno()),
                    role,
                    device,
                ],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stderr stays: a crash's traceback is seen
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.connection = Connection(ours.detach())

    def send(self, command: str, *args: Any) -> None:
        self.connection.send((command, *args))

    def receive(self, command: str) -> Any:
        timeout = self.timeouts.get(command, _DEFAULT_TIMEOUT)
        if not self.connection.poll(timeout):
            raise TimeoutError(f"the {self.role} process did not answer {command!r} in {timeout} s")
        try:
            status, result = self.connection.recv()
        except EOFError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            raise RuntimeError(
                f"the {self.role} process died during {command!r} "
                f"(exit code {self.process.returncode})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"the {self.role} process failed {command!r}:\n{result}")
        return result

    def __call__(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive(command)

    def close(self) -> None:
        """Ask the process to stop (it releases its memory and agents), then make sure it
        has ended: terminated, then killed, if it does not in time."""
        try:
            if self.process.poll() is None:
                self.send("stop")
                if self.connection.poll(30):
                    self.connection.recv()
        except (OSError, EOFError):
            pass  # the process is gone already; it is waited for below
        finally:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                try:
                    self.process.wait(5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.connection.close()


class TwoProcesses:
    """A prefill and a decode process, each serving one side (:func:`serve`); a context
    manager that ends both, whatever happens.

    ``prefill_device`` / ``decode_device``: the device each side's memory lives on (one GPU
    each where there are two). ``ucx_log``: where the prefill process has UCX write its
    protocol tables (None: not asked for). Each process serves a :attr:`side_type`, run as
    its module (a subclass's sides extend :class:`_Side`).
    """

    side_type: type[_Side] = _Side

    def __init__(self, prefill_device: str, decode_device: str, ucx_log: str | None) -> None:
        self.sides: list[_Process] = []
        try:
            self.prefill = _Process("prefill", prefill_device, ucx_log, self.side_type)
            self.sides.append(self.prefill)
            self.decode = _Process("decode", decode_device, None, self.side_type)
            self.sides.append(self.decode)
            for side in self.sides:
                side.receive("start")
        except BaseException:
            self.close()
            raise

    def _build_and_connect(self, build: str, connect: str, *args: Any) -> dict[str, Any]:
        """Both sides run ``build(*args)`` at once, then ``connect`` with the other side's
        answer; the prefill side's answer to ``connect``."""
        for side in self.sides:
            side.send(build, *args)
        prefill_info, decode_info = (side.receive(build) for side in self.sides)
        for side, other in ((self.prefill, decode_info), (self.decode, prefill_info)):
            side.send(connect, other)
        connected, _ = (side.receive(connect) for side in self.sides)
        return connected

    def setup(self, block_bytes: int, capacity: int) -> dict[str, Any]:
        """Both sides built for blocks of ``block_bytes``, connected both ways; what the
        prefill side's connection reports (transports, the same-host transport's absence)."""
        return self._build_and_connect("setup", "connect", block_bytes, capacity)

    def teardown(self) -> None:
        for side in self.sides:
            side.send("teardown")
        for side in self.sides:
            side.receive("teardown")

    def close(self) -> None:
        """End both processes (each is ended even when ending the other fails)."""
        sides, self.sides = self.sides, []
        try:
            if sides:
                sides[0].close()
        finally:
            for side in sides[1:]:
                side.close()

    def __enter__(self) -> TwoProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _main(argv: list[str], side_type: type[_Side] = _Side) -> None:
    """``python -m <module> FD ROLE DEVICE``: serve one ``side_type`` over the socket ``FD``
    (UCX's log, where asked for, is in the environment: ``UCX_LOG_FILE``)."""
    fd, role, device = argv
    serve(Connection(int(fd)), role, device, os.environ.get("UCX_LOG_FILE"), side_type)


if __name__ == "__main__":
    _main(sys.argv[1:])
