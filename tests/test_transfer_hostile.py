"""The same-host transfer plane attacked as a peer, a thread or Ctrl-C would attack it.

Two real processes where the fault takes two (a :class:`~transfer_peer.PeerProcess`), a fake
owner speaking the control protocol where the peer must lie (:class:`FakeOwner`), and
interrupts raised at seeded random instants. Every attack ends in an error naming the peer
(never wrong bytes), in a server that goes on serving, and with threads, descriptors and
mappings back where they were."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest
from transfer_peer import CachePeerProcess, PeerProcess

import jaxbuf
from jaxbuf._errors import ClosedError
from jaxbuf.sharing import export_layout
from jaxbuf.sharing._wire import message_pieces
from jaxbuf.transfer import KVCacheEndpoint, KVEndpoint, KVLayout, _wire
from jaxbuf.transfer._control import ANSWER_HEADER, FRAME_HEADER, Frame, Limits, frame

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB
CAPACITY = 16 * MiB
SEGMENTS = 2
FAST = Limits(io_timeout=1.0, hello_deadline=0.3, output_deadline=0.3)
# An interrupt of the tests' own timer may land in a weakref callback, where Python prints
# and drops it: that is Python's doing, not the code under test's.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# -- helpers ------------------------------------------------------------------------------
def _threads_fds_maps() -> tuple[int, int, int]:
    """Threads, open descriptors, and mappings of memfd chunks or of a reservation's size,
    once garbage in reference cycles is collected and the CPU driver's quarantine of
    freed ranges is flushed."""
    from jaxbuf.drivers import get_vmm_driver

    gc.collect()
    get_vmm_driver("cpu").flush_quarantine()
    with open("/proc/self/maps") as maps:
        mappings = 0
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            anonymous = len(fields) < 6  # a reservation, not the heap or a file
            mappings += "memfd:" in line or (anonymous and end - start == CAPACITY)
    return threading.active_count(), len(os.listdir("/proc/self/fd")), mappings


def _settled(before: tuple[int, int, int], what: str) -> None:
    """Threads, descriptors and mappings back to ``before`` (a thread being joined or a
    fake owner's connection being closed may take a moment)."""
    deadline = time.monotonic() + 2.0
    while True:
        now = _threads_fds_maps()
        if now == before or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert now == before, f"{what}: {before} -> {now}"


def _tensor(size: int = MiB) -> jaxbuf.ExtensibleTensor:
    tensor = jaxbuf.ExtensibleTensor(CAPACITY, "cpu", num_segments=SEGMENTS)
    tensor.resize_per_segment_(size, zero_new=True)
    return tensor


def _pattern(seed: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class Interrupter:
    """SIGALRM at a chosen instant raising ``KeyboardInterrupt``, as Ctrl-C would, but only
    while jaxbuf code runs (one landing in the test's own lines after the call returned is
    dropped and counted as missed): ``with interrupter.armed(seconds): call()``."""

    def __init__(self) -> None:
        self.pending = False
        self.raised = self.missed = 0

    def _handler(self, signum: int, frame_: object) -> None:
        if not self.pending:
            return
        self.pending = False
        inside = frame_
        while inside is not None:
            if f"{os.sep}jaxbuf{os.sep}" in inside.f_code.co_filename:  # type: ignore[attr-defined]
                self.raised += 1
                raise KeyboardInterrupt
            inside = inside.f_back  # type: ignore[attr-defined]
        self.missed += 1

    @contextlib.contextmanager
    def installed(self):
        previous = signal.signal(signal.SIGALRM, self._handler)
        try:
            yield self
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    @contextlib.contextmanager
    def armed(self, seconds: float):
        """Yields a one-item list set to True when the block was interrupted."""
        hit = [False]
        self.pending = True
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-6))
        try:
            yield hit
        except KeyboardInterrupt:
            hit[0] = True
        finally:
            self.pending = False
            signal.setitimer(signal.ITIMER_REAL, 0)


@pytest.fixture
def peer():
    process = PeerProcess("peer", CAPACITY, SEGMENTS, BLOCK, "cpu", transport="local")
    process("recommit", MiB)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def here():
    tensor = _tensor()
    endpoint = KVEndpoint("here", tensor, KVLayout(BLOCK), transport="local", limits=FAST)
    try:
        yield tensor, endpoint
    finally:
        endpoint.close()
        if not tensor.released:
            tensor.free()


class FakeOwner:
    """A liar on this host: a thread that speaks the owner's side of the control protocol
    at its own address and answers layout requests with ``answer(sock, request_id)``.
    :meth:`message` is a genuine endpoint's metadata pointing at it."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.tensor = _tensor()
        self.genuine = KVEndpoint("liar", self.tensor, KVLayout(BLOCK), transport="local")
        self.layout = self.genuine.remote_layout()
        self.address = f"jaxbuf-fake-{os.getpid()}-{random.getrandbits(48):x}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.address)
        self.listener.listen(8)
        self.listener.settimeout(0.1)
        self.stopping = False
        self.open: set[socket.socket] = set()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def message(self, **changes) -> bytes:
        import dataclasses

        local = dataclasses.replace(self.layout.local, address=self.address)
        return _wire.encode(dataclasses.replace(self.layout, local=local, **changes))

    def _serve(self) -> None:
        while not self.stopping:
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(5)
            self.open.add(sock)
            with sock, contextlib.suppress(OSError):  # closed once the initiator hangs up
                while not self.stopping:
                    kind, request_id, size = FRAME_HEADER.unpack(_recv(sock, FRAME_HEADER.size))
                    _recv(sock, size)
                    if kind == Frame.LAYOUT.value:
                        self.answer(self, sock, request_id)
            self.open.discard(sock)

    def header(self, request_id: int, count: int = 1, epoch: int | None = None) -> bytes:
        epoch = self.layout.epoch if epoch is None else epoch
        return frame(Frame.LAYOUT, request_id, ANSWER_HEADER.pack(epoch, count) + b"liar")

    def exported(self) -> tuple[dict, list[int]]:
        """The genuine tensor's layout and descriptors (the caller closes them)."""
        return export_layout(self.tensor)

    def close(self) -> None:
        self.stopping = True
        for sock in list(self.open):  # wakes the thread out of a read
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(10)
        self.listener.close()
        self.genuine.close()
        self.tensor.free()


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError
        data += part
    return data


def _send_message(sock: socket.socket, layout: dict, fds: list[int]) -> None:
    for data, batch in message_pieces(layout, fds):
        if batch:
            socket.send_fds(sock, [data], batch)
        else:
            sock.sendall(data)


@contextlib.contextmanager
def _fake(answer):
    owner = FakeOwner(answer)
    try:
        yield owner
    finally:
        owner.close()


# -- silent wrong bytes ---------------------------------------------------------------------
def test_an_answer_left_by_an_interrupted_connect_is_never_mapped(peer, here, monkeypatch):
    """Ctrl-C while connect waits for the peer's answer, then the peer releases and regrows:
    the next connect maps the regrown chunks (never the stale answer's), and a write lands
    where the peer reads it."""
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    peer("recommit", 3 * MiB)  # a new chunk: the next answer carries a descriptor
    grown = peer("metadata")

    import jaxbuf.transfer._control as control

    real = control._recv_exact
    calls = []

    def interrupted(*args):
        calls.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(control, "_recv_exact", interrupted)
    with pytest.raises(KeyboardInterrupt):
        endpoint.connect(grown)
    monkeypatch.setattr(control, "_recv_exact", real)
    assert calls, "the interrupt never reached the wait for the answer"
    peer("release")
    peer("recommit", 3 * MiB)
    endpoint.connect(peer("metadata"))
    data = _pattern(1)
    tensor.segment_view(0).to_numpy()[:BLOCK] = data
    endpoint.write("peer", [0], [40], segments=[0]).wait(30)  # block 40: in the new chunk
    assert peer("read", 0, 40 * BLOCK, BLOCK) == data.tobytes()


CACHE_TENSORS = [(2, 32 * KiB), (2, 32 * KiB)]


@pytest.mark.parametrize("short", ["here", "there"])
def test_a_cache_request_refused_by_one_tensor_moves_no_byte(short):
    """Tensor 0 holds block 20 on both sides, tensor 1 does not on one side (a commit that
    failed on tensor 1): the write is refused before any byte of tensor 0 moves."""
    peer = CachePeerProcess("peer-cache", 64, CACHE_TENSORS)
    builder = jaxbuf.ExtensibleKVCacheBuilder(64, "cpu")
    for num_segments, block_bytes in CACHE_TENSORS:
        builder.reserve(64 * num_segments * block_bytes, num_segments)
    cache = builder.finish()
    endpoint = KVCacheEndpoint("here-cache", cache, transport="local")
    try:
        cache.commit(4)
        peer("commit", 4)
        if short == "here":
            cache.tensors[0].resize_per_segment_(40 * 32 * KiB, zero_new=True)
            peer("commit", 40)
        else:
            cache.commit(40)
            peer("grow_tensor", 0, 40)
        endpoint.connect(peer("metadata"))
        cache.segment_views(0)[0].to_numpy()[20] = 7
        with pytest.raises(IndexError, match="block 20"):
            endpoint.write("peer-cache", [20], [20])
        assert peer("get", 0, 0, 20) == bytes(32 * KiB)  # tensor 0's block untouched there
    finally:
        endpoint.close()
        cache.free()
        peer.stop()


# -- denial of service ----------------------------------------------------------------------
def test_a_client_that_never_reads_does_not_delay_a_genuine_connect(peer, here):
    """A same-uid client floods layout requests and never reads the answers: a genuine
    connect is served at once, not after the flooder's timeout."""
    tensor, endpoint = here
    message = peer("metadata")
    address = _wire.decode(message).local.address
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as flooder:
        flooder.connect("\0" + address)
        flooder.sendall(frame(Frame.HELLO, 0, b"flooder"))
        flooder.setblocking(False)
        request = frame(Frame.LAYOUT, 1) * 256
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                flooder.send(request)
            except BlockingIOError:
                time.sleep(0.01)
        start = time.monotonic()
        endpoint.connect(message)
        elapsed = time.monotonic() - start
    assert elapsed < 1.0, f"a genuine connect waited {elapsed:.1f} s behind the flooder"
    endpoint.write("peer", [1], [2]).wait(30)


def test_a_connection_flood_to_emfile_does_not_kill_the_server(peer, here):
    """The owner runs out of descriptors under a flood of connections that fills its
    backlog too: accept backs off, a genuine connect waits for room (rather than fail at
    once on the full backlog), and once the flood is gone it connects and moves bytes."""
    tensor, endpoint = here
    message = peer("metadata")
    address = _wire.decode(message).local.address
    peer("limit_fds", 24)
    flood = []
    outcome: list[BaseException | None] = []

    def genuine() -> None:
        try:
            endpoint.connect(message)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - checked below
            outcome.append(error)

    def fill_backlog() -> None:
        while len(flood) < 1000:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            if sock.connect_ex("\0" + address) != 0:  # EAGAIN: the backlog is full
                sock.close()
                return
            flood.append(sock)

    try:
        fill_backlog()
        time.sleep(0.3)  # the owner accepts until it is out of descriptors
        fill_backlog()
        thread = threading.Thread(target=genuine)
        thread.start()
        time.sleep(0.3)
    finally:
        for sock in flood:
            sock.close()
    thread.join(10)
    assert outcome == [None], outcome
    data = _pattern(2)
    tensor.segment_view(1).to_numpy()[3 * BLOCK : 4 * BLOCK] = data
    endpoint.write("peer", [3], [5], segments=[1]).wait(30)
    assert peer("read", 1, 5 * BLOCK, BLOCK) == data.tobytes()


# -- threads --------------------------------------------------------------------------------
def test_three_threads_writing_with_notifications_lose_and_garble_nothing(peer, here):
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    errors: list[BaseException] = []
    # Tens of KiB each: a send that the socket takes in several pieces, where frames of
    # two threads could interleave.
    sent = {f"thread {t} write {k} ".encode() * (3000 + k) for t in range(3) for k in range(60)}

    def writer(t: int) -> None:
        try:
            for k in range(60):
                note = f"thread {t} write {k} ".encode() * (3000 + k)
                if k % 2:  # with a transfer, or alone
                    endpoint.write("peer", [t], [t + 3], notification=note).wait(30)
                else:
                    endpoint.notify("peer", note)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    received: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(received) < len(sent) and time.monotonic() < deadline:
        received += peer("notifications").get("here", [])
    assert len(received) == len(sent) == 180
    assert set(received) == sent


# -- Ctrl-C ---------------------------------------------------------------------------------
def test_interrupted_metadata_leaks_no_thread_or_descriptor():
    """Ctrl-C at random instants of an endpoint's first metadata() (which starts its
    control thread), 60 times: threads and descriptors come back to where they were."""
    rng = random.Random(int(os.environ.get("JAXBUF_INTERRUPT_SEED", "37")))
    tensor = _tensor()
    try:
        for name in ("warm", "warm again"):  # modules and caches loaded on first use
            with KVEndpoint(name, tensor, KVLayout(BLOCK), transport="local") as warm:
                warm.metadata()
        before = _threads_fds_maps()
        interrupter = Interrupter()
        with interrupter.installed():
            for round_ in range(300):
                endpoint = KVEndpoint(f"e{round_}", tensor, KVLayout(BLOCK), transport="local")
                with interrupter.armed(rng.uniform(0, 3e-4)):
                    endpoint.metadata()
                endpoint.close()
        assert interrupter.raised > 40, interrupter.__dict__
        _settled(before, "after interrupted metadata()")
    finally:
        tensor.free()


def test_interrupted_close_leaves_no_thread_running():
    """Ctrl-C at random instants of close() (which stops the control thread), then close()
    again: the thread is gone every time, 300 times."""
    rng = random.Random(int(os.environ.get("JAXBUF_INTERRUPT_SEED", "37")))
    tensor = _tensor()
    try:
        with KVEndpoint("warm", tensor, KVLayout(BLOCK), transport="local") as warm:
            warm.metadata()
        before = _threads_fds_maps()
        interrupter = Interrupter()
        with interrupter.installed():
            for round_ in range(300):
                endpoint = KVEndpoint(f"c{round_}", tensor, KVLayout(BLOCK), transport="local")
                endpoint.metadata()
                with interrupter.armed(rng.uniform(0, 3e-4)):
                    endpoint.close()
                endpoint.close()
                assert threading.active_count() == before[0], f"round {round_}"
        assert interrupter.raised > 40, interrupter.__dict__
        _settled(before, "after interrupted close()")
    finally:
        tensor.free()


def _memfds() -> int:
    """Descriptors of memfds open in this process (received chunks not yet mapped)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    return count


def test_interrupted_connects_leak_no_received_descriptor(peer, here):
    """The peer releases and recommits before every connect (so every answer carries new
    descriptors), and Ctrl-C lands at random instants of the connect, 150 times: no
    received descriptor stays open (each would pin 2 MiB of the peer), and a last connect
    moves bytes."""
    rng = random.Random(int(os.environ.get("JAXBUF_INTERRUPT_SEED", "37")))
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    before = _memfds()
    interrupter = Interrupter()
    with interrupter.installed():
        for _ in range(150):
            peer("release")
            peer("recommit", MiB)
            message = peer("metadata")
            with interrupter.armed(rng.uniform(0, 1.5e-3)):
                endpoint.connect(message)
    assert interrupter.raised > 30, interrupter.__dict__
    assert _memfds() == before
    endpoint.connect(peer("metadata"))
    data = _pattern(4)
    tensor.segment_view(0).to_numpy()[:BLOCK] = data
    endpoint.write("peer", [0], [2], segments=[0]).wait(30)
    assert peer("read", 0, 2 * BLOCK, BLOCK) == data.tobytes()


def test_an_interrupted_wait_loses_no_notification_that_arrived(peer, here):
    """The peer's notification is here before the wait; Ctrl-C at random instants of
    wait_notification: a second wait still finds it (until 40 interrupts landed)."""
    rng = random.Random(int(os.environ.get("JAXBUF_INTERRUPT_SEED", "37")))
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    peer("connect", endpoint.metadata())
    interrupter = Interrupter()
    with interrupter.installed():
        for round_ in range(400):
            message = b"note %d" % round_
            peer("notify", "here", message)
            with interrupter.armed(rng.uniform(0, 2e-4)) as hit:
                endpoint.wait_notification("peer", message, 10)
            if hit[0]:
                endpoint.wait_notification("peer", message, 2)  # still there
            if interrupter.raised >= 40:
                break
    assert interrupter.raised >= 20, interrupter.__dict__
    assert endpoint.notifications() == {}


# -- errors ---------------------------------------------------------------------------------
def _memfd(size: int, seals: int = 0, data: bool = True) -> int:
    import fcntl

    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _hostile_fd(kind: str, size: int, tmp_path) -> int:
    import fcntl

    shrink_grow = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r
    if kind == "/dev/zero":
        return os.open("/dev/zero", os.O_RDWR | os.O_CLOEXEC)
    if kind == "regular file":
        path = tmp_path / "chunk"
        path.write_bytes(bytes(size))
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    if kind == "unsealed memfd":
        return _memfd(size)
    if kind == "short memfd":
        return _memfd(size // 2, shrink_grow)
    if kind == "write-sealed memfd":
        return _memfd(size, shrink_grow | fcntl.F_SEAL_WRITE)
    raise AssertionError(kind)


HOSTILE = [
    "pipe",
    "/dev/zero",
    "regular file",
    "unsealed memfd",
    "short memfd",
    "write-sealed memfd",
]


def _lying_with(kind: str, tmp_path):
    """An answer whose layout is genuine and whose descriptors are ``kind``."""

    def answer(owner: FakeOwner, sock: socket.socket, request_id: int) -> None:
        layout, fds = owner.exported()
        hostile = [_hostile_fd(kind, size, tmp_path) for _, size, _ in layout["chunks"]]
        try:
            sock.sendall(owner.header(request_id))
            _send_message(sock, layout, hostile)
        finally:
            for fd in fds + hostile:
                os.close(fd)

    return answer


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_descriptors_are_a_value_error_naming_the_peer(kind, here, tmp_path):
    tensor, endpoint = here
    with _fake(_lying_with(kind, tmp_path)) as owner:
        before = _threads_fds_maps()
        with pytest.raises(ValueError, match="'liar'"):
            endpoint.connect(owner.message())
        assert endpoint.peers == {}
        _settled(before, f"after a peer sent a {kind}")


@pytest.mark.parametrize("kind", ["pipe", "unsealed memfd"])
def test_hostile_descriptors_fall_back_to_nixl_with_auto(kind, tmp_path):
    transfer = pytest.importorskip("jaxbuf.transfer")
    try:
        transfer.load_nixl()
    except transfer.NixlUnavailable as error:
        pytest.skip(f"NIXL is not installed: {error}")
    tensor = _tensor()
    endpoint = KVEndpoint(transfer.Agent("here-nixl"), tensor, KVLayout(BLOCK), limits=FAST)
    owner = FakeOwner(_lying_with(kind, tmp_path))
    liar_agent = transfer.Agent("liar")
    try:
        message = owner.message(nixl_metadata=liar_agent.metadata())
        assert endpoint.connect(message).transport == "nixl"
    finally:
        endpoint.close()
        owner.close()
        liar_agent.close()
        tensor.free()


def test_a_peer_restarted_under_its_name_is_connected_again(here):
    tensor, endpoint = here
    for generation in range(2):
        peer = PeerProcess("peer", CAPACITY, SEGMENTS, BLOCK, "cpu", transport="local")
        try:
            peer("recommit", MiB)
            endpoint.connect(peer("metadata"))
            data = _pattern(generation)
            tensor.segment_view(0).to_numpy()[:BLOCK] = data
            endpoint.write("peer", [0], [1], segments=[0]).wait(30)
            assert peer("read", 0, BLOCK, BLOCK) == data.tobytes()
        finally:
            peer.stop()


def test_a_dead_peer_is_named_in_its_errors(here):
    tensor, endpoint = here
    peer = PeerProcess("peer", CAPACITY, SEGMENTS, BLOCK, "cpu", transport="local")
    peer("recommit", MiB)
    message = peer("metadata")
    endpoint.connect(message)
    peer.process.kill()
    peer.process.join(10)
    with pytest.raises(ConnectionError, match="'peer'"):
        endpoint.notify("peer", b"anyone?")
    with pytest.raises(ConnectionError, match="'peer'"):
        endpoint.write("peer", [0], [0], notification=b"anyone?")
    endpoint.forget("peer")
    with pytest.raises(ValueError, match="'peer'"):
        endpoint.connect(message)


@pytest.mark.parametrize("block", [2**63, 2**64 + 5, -(2**63) - 1])
def test_an_out_of_range_block_id_is_named_as_given(peer, here, block):
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    as_given = rf"(?<![-\d]){re.escape(str(block))}(?!\d)"  # not wrapped to another int64
    for local, remote in (([block], [0]), ([0], [block])):
        with pytest.raises((IndexError, ValueError, OverflowError), match=as_given):
            endpoint.write("peer", local, remote)


def test_an_endpoint_whose_tensor_was_freed_is_closed(peer, here):
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    tensor.free()
    for call in (
        lambda: endpoint.write("peer", [0], [0]),
        lambda: endpoint.read("peer", [0], [0]),
        endpoint.metadata,
        lambda: endpoint.notify("peer", b"x"),
    ):
        with pytest.raises(ClosedError, match="freed"):
            call()


def test_closing_the_endpoint_ends_a_wait_in_another_thread(here):
    tensor, endpoint = here
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            endpoint.wait_notification("peer", b"never", 30)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - checked below
            outcome.append(error)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    endpoint.close()
    thread.join(5)
    assert time.monotonic() - start < 1.0
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError), outcome


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, -math.inf])
def test_wait_notification_checks_its_timeout(here, timeout):
    tensor, endpoint = here
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            endpoint.wait_notification("peer", b"x", timeout)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - checked below
            outcome.append(error)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(2)
    assert outcome, f"wait_notification(timeout={timeout}) did not return"
    assert isinstance(outcome[0], ValueError) and "timeout" in str(outcome[0])


def test_a_process_with_descriptors_past_1024_connects():
    """select() refuses a descriptor numbered 1024 or more: an engine holding many
    descriptors must still receive a peer's chunks."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit {hard} is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    owner_tensor, tensor = _tensor(), _tensor()
    owner = KVEndpoint("owner", owner_tensor, KVLayout(BLOCK), transport="local")
    endpoint = KVEndpoint("here", tensor, KVLayout(BLOCK), transport="local")
    null = os.open("/dev/null", os.O_RDONLY)
    padding = [os.dup(null) for _ in range(max(0, 1100 - null))]
    try:
        endpoint.connect(owner.metadata())
        tensor.segment_view(0).to_numpy()[:BLOCK] = _pattern(3)
        endpoint.write("owner", [0], [1], segments=[0]).wait(30)
        np.testing.assert_array_equal(
            owner_tensor.segment_view(0).to_numpy()[BLOCK : 2 * BLOCK], _pattern(3)
        )
    finally:
        for fd in [*padding, null]:
            os.close(fd)
        endpoint.close()
        owner.close()
        tensor.free()
        owner_tensor.free()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- a lying owner ------------------------------------------------------------------------
def _genuine(owner: FakeOwner, sock: socket.socket, request_id: int, **header) -> None:
    layout, fds = owner.exported()
    try:
        sock.sendall(owner.header(request_id, **header))
        _send_message(sock, layout, fds)
    finally:
        for fd in fds:
            os.close(fd)


def _silent(owner, sock, request_id):
    """Never answers."""


def _half_then_close(owner, sock, request_id):
    layout, fds = owner.exported()
    data = message_pieces(layout, fds)[0][0]
    try:
        sock.sendall(owner.header(request_id) + data[: len(data) // 2])
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        for fd in fds:
            os.close(fd)


def _stale_ids_forever(owner, sock, request_id):
    """An endless stream of refusals of other requests (until the owner is closed)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not owner.stopping:
        sock.sendall(frame(Frame.ERROR, request_id + 1000, b"not yours"))
        time.sleep(0.02)


def _future_id(owner, sock, request_id):
    _genuine(owner, sock, request_id + 1)


def _two_tensors_of_one(owner, sock, request_id):
    """Says two tensors, sends one, then waits."""
    _genuine(owner, sock, request_id, count=2)


def _another_epoch(owner, sock, request_id):
    _genuine(owner, sock, request_id, epoch=owner.layout.epoch + 1)


def _another_name(owner, sock, request_id):
    layout, fds = owner.exported()
    try:
        header = ANSWER_HEADER.pack(owner.layout.epoch, 1) + b"someone-else"
        sock.sendall(frame(Frame.LAYOUT, request_id, header))
        _send_message(sock, layout, fds)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize(
    "answer, match",
    [
        (_silent, "'liar'"),
        (_half_then_close, "'liar'"),
        (_stale_ids_forever, "'liar'"),
        (_future_id, "'liar'"),
        (_two_tensors_of_one, "'liar'.*2 tensor"),
        (_another_epoch, "'liar'.*changed since"),
        (_another_name, "serves endpoint 'someone-else'"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[1:] or None,
)
def test_a_lying_owner_gets_an_error_within_the_io_timeout(here, answer, match):
    """Whatever the owner answers (or not), connect fails naming it within the endpoint's
    io_timeout (1 s here), keeps no descriptor and records no peer; the endpoint goes on."""
    tensor, endpoint = here
    with _fake(answer) as owner:
        before = _threads_fds_maps()
        start = time.monotonic()
        with pytest.raises(ValueError, match=match):
            endpoint.connect(owner.message())
        elapsed = time.monotonic() - start
        assert endpoint.peers == {}
        _settled(before, f"after {answer.__name__}")
    assert elapsed < FAST.io_timeout + 1.0, f"connect took {elapsed:.1f} s"
    with _fake(_genuine) as owner:  # the endpoint still connects to an honest one
        assert endpoint.connect(owner.message()).transport == "local"


def test_a_silent_peer_connecting_does_not_hold_up_transfers_to_another(peer, here):
    """One thread connects to an owner that never answers (up to the io_timeout); another
    thread's writes to a connected peer go on meanwhile, not after it."""
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    with _fake(_silent) as owner:
        thread = threading.Thread(
            target=lambda: pytest.raises(ValueError, endpoint.connect, owner.message())
        )
        thread.start()
        time.sleep(0.1)  # the connect is waiting for the silent owner
        start = time.monotonic()
        endpoint.write("peer", [0], [1]).wait(30)
        elapsed = time.monotonic() - start
        thread.join(10)
    assert elapsed < 0.5, f"a write waited {elapsed:.2f} s behind a connect to a silent peer"


# -- hostile clients of a genuine owner ----------------------------------------------------
@pytest.fixture
def owner():
    tensor = _tensor()
    endpoint = KVEndpoint("owner", tensor, KVLayout(BLOCK), transport="local", limits=FAST)
    try:
        yield tensor, endpoint, _wire.decode(endpoint.metadata()).local.address
    finally:
        endpoint.close()
        tensor.free()


def _client(address: str, hello: bytes | None = b"client") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + address)
    if hello is not None:
        sock.sendall(frame(Frame.HELLO, 0, hello))
    return sock


def _genuine_connect_time(owner_endpoint) -> float:
    tensor = _tensor()
    with KVEndpoint("genuine", tensor, KVLayout(BLOCK), transport="local") as endpoint:
        start = time.monotonic()
        endpoint.connect(owner_endpoint.metadata())
        elapsed = time.monotonic() - start
        endpoint.write("owner", [0], [1]).wait(30)
    tensor.free()
    return elapsed


def test_a_connection_without_hello_is_dropped_at_its_deadline(owner):
    tensor, endpoint, address = owner
    with _client(address, hello=None) as silent:
        start = time.monotonic()
        assert silent.recv(16) == b""
        assert time.monotonic() - start < FAST.hello_deadline + 1.0


def test_half_frames_then_silence_cost_only_their_connections(owner):
    tensor, endpoint, address = owner
    stalled = [_client(address) for _ in range(50)]
    try:
        for sock in stalled:
            sock.sendall(frame(Frame.NOTIFY, 0, b"never finished")[:7])
        assert _genuine_connect_time(endpoint) < 1.0
    finally:
        for sock in stalled:
            sock.close()
    assert endpoint.notifications() == {}


def test_a_peer_flooding_layout_requests_does_not_slow_a_genuine_one(owner):
    """A client asks for the layout as fast as it can read the answers, for the whole
    test: a genuine peer still connects at once and moves bytes."""
    tensor, endpoint, address = owner
    stop = threading.Event()
    answers = [0]

    def flood() -> None:
        with contextlib.suppress(OSError), _client(address) as sock:
            request_id = 0
            while not stop.is_set():
                request_id += 1
                sock.sendall(frame(Frame.LAYOUT, request_id))
                kind, answered, size = FRAME_HEADER.unpack(_recv(sock, FRAME_HEADER.size))
                assert (kind, answered) == (Frame.LAYOUT.value, request_id)
                _recv(sock, size)
                from jaxbuf.sharing._wire import recv_layout

                _, fds = recv_layout(sock)
                for fd in fds:
                    os.close(fd)
                answers[0] += 1

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        assert _genuine_connect_time(endpoint) < 1.0
    finally:
        stop.set()
        thread.join(10)
    assert answers[0] > 10


def test_requests_answered_with_their_own_ids_in_order(owner):
    tensor, endpoint, address = owner
    from jaxbuf.sharing._wire import recv_layout

    with _client(address) as sock:
        ids = [5, 3, 2**64 - 1, 0, 7]
        sock.sendall(b"".join(frame(Frame.LAYOUT, i) for i in ids))
        for expected in ids:
            kind, answered, size = FRAME_HEADER.unpack(_recv(sock, FRAME_HEADER.size))
            assert (kind, answered) == (Frame.LAYOUT.value, expected)
            epoch, count = ANSWER_HEADER.unpack(_recv(sock, size)[: ANSWER_HEADER.size])
            for _ in range(count):
                for fd in recv_layout(sock)[1]:
                    os.close(fd)


@pytest.mark.parametrize(
    "hello",
    [b"\xff\xfe not utf-8", b"x" * 257, b""],
    ids=["not utf-8", "over 256 bytes", "empty"],
)
def test_a_bad_hello_costs_the_sender_its_connection(owner, hello):
    tensor, endpoint, address = owner
    with _client(address, hello=None) as sock:
        sock.sendall(frame(Frame.HELLO, 0, hello) + frame(Frame.NOTIFY, 0, b"sneaked in"))
        assert sock.recv(16) == b""
    assert endpoint.notifications() == {}
    assert _genuine_connect_time(endpoint) < 1.0


def test_notifications_from_threads_racing_a_reconnect_arrive_whole(peer, here):
    """Four threads notify while the main thread connects again and again (each connect
    an exchange on the same link): every notification arrives once, whole."""
    tensor, endpoint = here
    endpoint.connect(peer("metadata"))
    errors: list[BaseException] = []

    def notifier(t: int) -> None:
        try:
            for k in range(40):
                endpoint.notify("peer", f"{t}/{k}|".encode() * 50)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=notifier, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        endpoint.connect(peer("metadata"))
    for thread in threads:
        thread.join()
    assert not errors
    expected = sorted(f"{t}/{k}|".encode() * 50 for t in range(4) for k in range(40))
    received: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(received) < len(expected) and time.monotonic() < deadline:
        received += peer("notifications").get("here", [])
    assert sorted(received) == expected


# -- Ctrl-C anywhere ------------------------------------------------------------------------
class _Run:
    """The random-interrupt run's state: this side's endpoint and both buffers' models."""

    def __init__(self, peer: PeerProcess, tensor, rng: random.Random) -> None:
        self.peer, self.tensor, self.rng = peer, tensor, rng
        self.here = np.zeros((SEGMENTS, MiB), np.uint8)
        self.there = np.zeros((SEGMENTS, MiB), np.uint8)
        self.generation = 0
        self.endpoint = self._open()
        self.peer_knows = False  # whether the peer connected to this endpoint
        self.sent: set[bytes] = set()  # notifications sent, interrupted or not
        self.owed: set[bytes] = set()  # those whose send returned: they must arrive

    def _open(self) -> KVEndpoint:
        self.generation += 1
        name = f"here-{self.generation}"
        return KVEndpoint(name, self.tensor, KVLayout(BLOCK), transport="local", limits=FAST)

    def connected(self) -> bool:
        return "peer" in self.endpoint.peers

    def blocks(self) -> tuple[list[int], list[int]]:
        count = self.rng.randint(1, 4)
        return self.rng.sample(range(16), count), self.rng.sample(range(16), count)

    def there_blocks(self, blocks: list[int]) -> np.ndarray:
        return np.stack(
            [
                np.frombuffer(self.peer("read", s, b * BLOCK, BLOCK), np.uint8)
                for s in range(SEGMENTS)
                for b in blocks
            ]
        )

    def here_blocks(self, blocks: list[int]) -> np.ndarray:
        return np.stack(
            [
                self.tensor.segment_view(s).to_numpy()[b * BLOCK : (b + 1) * BLOCK]
                for s in range(SEGMENTS)
                for b in blocks
            ]
        )


def _model_blocks(model: np.ndarray, blocks: list[int]) -> np.ndarray:
    return np.stack(
        [model[s, b * BLOCK : (b + 1) * BLOCK] for s in range(SEGMENTS) for b in blocks]
    )


def _moved_whole_or_not(got: np.ndarray, old: np.ndarray, new: np.ndarray, hit: bool) -> bool:
    """Whether a copy moved (every block of it: one copy moves all or nothing); one not
    interrupted always did."""
    if np.array_equal(got, new):
        return True
    assert hit, "a transfer that returned did not move its bytes"
    assert np.array_equal(got, old), "an interrupted transfer moved part of its blocks"
    return False


def _step(run: _Run, operation: str, delay: float, interrupter: Interrupter, step: int) -> None:
    endpoint = run.endpoint
    if operation == "connect":
        message = run.peer("metadata")
        with interrupter.armed(delay):
            endpoint.connect(message)
    elif operation in ("write", "read"):
        if not run.connected():
            with pytest.raises(ValueError, match="not a connected peer"):
                endpoint.write("peer", [0], [0])
            return
        mine, theirs = run.blocks()
        if operation == "write":
            for s in range(SEGMENTS):
                for b in mine:
                    data = _pattern(step * 64 + s * 16 + b)
                    run.tensor.segment_view(s).to_numpy()[b * BLOCK : (b + 1) * BLOCK] = data
                    run.here[s, b * BLOCK : (b + 1) * BLOCK] = data
            old = _model_blocks(run.there, theirs)
            new = _model_blocks(run.here, mine)
            note = b"write %d" % step if run.rng.random() < 0.5 else b""
            run.sent.add(note)
            with interrupter.armed(delay) as hit:
                endpoint.write("peer", mine, theirs, notification=note)
            if not hit[0]:
                run.owed.add(note)
            got = run.there_blocks(theirs)
            model, blocks, source = run.there, theirs, new
        else:
            old = _model_blocks(run.here, mine)
            new = _model_blocks(run.there, theirs)
            with interrupter.armed(delay) as hit:
                endpoint.read("peer", mine, theirs)
            got = run.here_blocks(mine)
            model, blocks, source = run.here, mine, new
        if _moved_whole_or_not(got, old, new, hit[0]):
            for i, (s, b) in enumerate((s, b) for s in range(SEGMENTS) for b in blocks):
                model[s, b * BLOCK : (b + 1) * BLOCK] = source[i]
    elif operation == "notify":
        if not run.connected():
            return
        note = b"notify %d" % step
        run.sent.add(note)
        with interrupter.armed(delay) as hit:
            endpoint.notify("peer", note)
        if not hit[0]:
            run.owed.add(note)
    elif operation == "wait":
        if not run.peer_knows:
            run.peer("connect", endpoint.metadata())
            run.peer_knows = True
        note = b"to you %d" % step
        run.peer("notify", endpoint.name, note)
        with interrupter.armed(delay) as hit:
            endpoint.wait_notification("peer", note, 10)
        if hit[0]:
            endpoint.wait_notification("peer", note, 2)  # it was not lost
    elif operation == "metadata":
        with interrupter.armed(delay):
            endpoint.metadata()
    elif operation == "grow there":
        size = min(run.there.shape[1] + MiB, 4 * MiB)
        run.peer("recommit", size)
        grown = np.zeros((SEGMENTS, size), np.uint8)
        grown[:, : run.there.shape[1]] = run.there
        run.there = grown
    else:  # close, then a new endpoint
        with interrupter.armed(delay):
            endpoint.close()
        endpoint.close()  # finishes an interrupted close
        assert endpoint.closed
        run.endpoint = run._open()
        run.peer_knows = False


OPERATIONS = ["connect", "write", "read", "notify", "wait", "metadata", "close", "grow there"]
WEIGHTS = [4, 5, 4, 2, 2, 1, 1, 1]


def test_random_interrupts_leave_everything_usable_and_nothing_leaked():
    """Ctrl-C at seeded random instants of connect, write, read, notify, wait_notification,
    metadata and close (JAXBUF_INTERRUPT_SEED, JAXBUF_INTERRUPT_ROUNDS): after each, the
    endpoint is usable or closable; a copy moved all its blocks or none, as the numpy model
    of both buffers says; every notification that was sent whole arrives, none garbled;
    and threads, descriptors and mappings end where they started."""
    seed = int(os.environ.get("JAXBUF_INTERRUPT_SEED", "37"))
    rounds = int(os.environ.get("JAXBUF_INTERRUPT_ROUNDS", "600"))
    rng = random.Random(seed)
    peer = PeerProcess("peer", CAPACITY, SEGMENTS, BLOCK, "cpu", transport="local")
    tensor = _tensor()
    run = None
    try:
        peer("recommit", MiB)
        with KVEndpoint("warm", tensor, KVLayout(BLOCK), transport="local") as warm:
            warm.connect(peer("metadata"))  # modules and caches loaded on first use
            peer("connect", warm.metadata())
            warm.write("peer", [0], [0]).wait(30)
            warm.notify("peer", b"warm")
        before = _threads_fds_maps()
        run = _Run(peer, tensor, rng)
        interrupter = Interrupter()
        with interrupter.installed():
            for step in range(rounds):
                operation = rng.choices(OPERATIONS, WEIGHTS)[0]
                delay = rng.uniform(0, 2e-4) if rng.random() < 0.5 else rng.uniform(0, 3e-3)
                try:
                    _step(run, operation, delay, interrupter, step)
                except BaseException as error:
                    raise AssertionError(
                        f"seed {seed}, step {step}, {operation} interrupted after "
                        f"{delay * 1e6:.0f} us: {error!r}"
                    ) from error
        assert interrupter.raised > rounds // 5, interrupter.__dict__
        run.endpoint.close()
        _settled(before, f"seed {seed}: after {rounds} interrupted steps")
        for s in range(SEGMENTS):
            size = run.there.shape[1]
            np.testing.assert_array_equal(
                np.frombuffer(peer("read", s, 0, size), np.uint8), run.there[s], f"seed {seed}"
            )
            np.testing.assert_array_equal(
                tensor.segment_view(s).to_numpy(), run.here[s], f"seed {seed}"
            )
        received = [note for notes in peer("notifications").values() for note in notes]
        assert set(received) - {b"warm"} <= run.sent, f"seed {seed}: garbled notifications"
        assert run.owed - {b""} <= set(received), f"seed {seed}: notifications lost"
    finally:
        if run is not None:
            run.endpoint.close()
        tensor.free()
        peer.stop()
