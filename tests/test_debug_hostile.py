"""Debug mode (``JAXBUF_DEBUG=1``) under attack: every jaxbuf operation that could read
reserved or released memory itself, run in a child process over a strict CPU driver (an
uncommitted read faults there). Where the operation is legal the child exits normally; where
jaxbuf can check (a transfer of blocks past the peer's committed size) it raises a Python
error, never a signal. And the SIGSEGV hint's line: it names the right cause for a write to a
buffer imported read-only, and says nothing for a mapping at addresses jaxbuf has handed
back to the kernel."""

from __future__ import annotations

import mmap
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time

import _forkserver
import numpy as np
import pytest

from jaxbuf._debug import DEBUG_ENV
from jaxbuf.drivers import HostVmmDriver

A_WRITE_TO = "a write to " if platform.machine() == "x86_64" else "a read or write of "

SETUP = """
import ctypes, sys
import numpy as np
import jaxbuf
from jaxbuf import ExtensibleTensor, ExtensibleKVCacheBuilder
from jaxbuf.drivers import get_vmm_driver
MiB = 1 << 20
buf = ExtensibleTensor(4 * MiB, device="cpu")
buf.resize_per_segment_(MiB)
print("debug", get_vmm_driver("cpu").debug, flush=True)
"""


def _run(code: str, debug: str = "1"):
    environment = {
        k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "PYTHONFAULTHANDLER")
    }
    environment[DEBUG_ENV] = debug
    return _forkserver.run(
        [sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)],
        env=environment,
        timeout=240,
    )


def _jaxbuf_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxbuf: segmentation")]


# -- what jaxbuf does itself: committed bytes only, or a Python error ----------------------
LEGAL = {
    "transfers past the committed blocks raise IndexError": """
        from jaxbuf.transfer import KVEndpoint, KVLayout
        a = ExtensibleTensor(8 * MiB, "cpu"); a.resize_per_segment_(2 * MiB)
        b = ExtensibleTensor(8 * MiB, "cpu"); b.resize_per_segment_(4 * MiB)
        tag = str(os.getpid())
        ea = KVEndpoint("dbg-a" + tag, a, KVLayout(4096))
        eb = KVEndpoint("dbg-b" + tag, b, KVLayout(4096))
        peer = ea.connect(eb.metadata())
        for post in (
            lambda: ea.read(peer, [0], [1024]),  # the peer's block past its committed size
            lambda: ea.write(peer, [0], [1024]),
            lambda: ea.read(peer, [600], [0]),  # this side's block past its own
            lambda: ea.write(peer, [600], [0]),
        ):
            try:
                post().wait(timeout=60)
            except IndexError:
                pass
            else:
                raise AssertionError("no IndexError")
        b.release_physical(); b.resize_per_segment_(2 * MiB)  # the peer shrank
        peer = ea.connect(eb.metadata())
        try:
            ea.read(peer, [0], [600]).wait(timeout=60)
        except IndexError:
            pass
        else:
            raise AssertionError("no IndexError after the peer shrank")
        ea.read(peer, [0, 1], [511, 0]).wait(timeout=60)  # its last committed block: legal
        ea.close(); eb.close()
        """,
    "sharing, copies and defragment": """
        from jaxbuf.sharing import ImportedBuffer, export_layout
        t = ExtensibleTensor(12 * MiB, device="cpu", num_segments=3)
        t.resize_segments_([4096, 3 * MiB, 100])
        t.resize_segments_([4096, 4 * MiB - 5, 100])
        for read_only in (False, True):
            layout, fds = export_layout(t, read_only=read_only)
            imported = ImportedBuffer(layout, list(fds))
            for i in range(3):
                view = imported.segment_view(i)
                np.from_dlpack(view, copy=True); repr(view.to_numpy())
            np.from_dlpack(imported.full_view(), copy=True)
            imported.close()
        for i in range(3):
            t.segment_view(i).to_numpy()[:] = i + 1
        t.defragment()
        for i in range(3):
            assert (t.segment_view(i).to_numpy() == i + 1).all()
        t.release_physical()
        t.resize_segments_([MiB, 5, 0])
        layout, fds = export_layout(t)
        imported = ImportedBuffer(layout, list(fds))
        np.from_dlpack(imported.full_view(), copy=True)
        imported.close()
        """,
    "KV views, staged writes, UVA pools and the faces": """
        import torch, jax
        import jaxbuf.torch as jt
        from jaxbuf.staged import StagedWriteTensor
        from jaxbuf.uva import UvaBufferPool
        builder = ExtensibleKVCacheBuilder(4, "cpu")
        builder.reserve(4 * 2 * MiB * 2, 2)
        kv = builder.finish()
        for commit in (lambda: kv.commit(3), kv.recommit, lambda: kv.commit(4, defragment=True)):
            commit()
            for view in kv.committed_views(0, "float32"):
                a = view.to_numpy(); a += 1; repr(a); np.from_dlpack(view, copy=True)
                torch.from_dlpack(view).clone(); float(jax.dlpack.from_dlpack(view).sum())
            kv.release_physical()
        for uva in (False, True):
            s = StagedWriteTensor((10, 7), dtype="float32", device="cpu", uva_instead_of_gpu=uva)
            s.stage_write(3, 2, [1.0, 2.0]); s.apply_write()
            assert s.gpu.to_numpy().sum() == 3.0; np.from_dlpack(s.gpu, copy=True); s.free()
        pool = UvaBufferPool((64, 4), "float32", max_concurrency=2, device="cpu")
        for n in (1, 3, 9, 20, 2):
            v = pool.copy_to_uva(np.ones((n, 4), np.float32)); repr(np.from_dlpack(v, copy=True))
        face = jt.ExtensibleTensor(8 * MiB, device="cpu", num_segments=2)
        face.resize_segments_([MiB + 3, 10])
        x = face.segment_view(0); x.fill_(1); str(x); x.clone()
        """,
    "a KVCacheStep with segment_shape over the strict driver": """
        from jaxbuf.kv import KVCacheStep
        builder = ExtensibleKVCacheBuilder(8, "cpu")
        builder.reserve(8 * MiB * 4, 4)  # 1 MiB blocks: each block past the third is unmapped
        kv = builder.finish()
        kv.commit(3)
        fn = lambda caches: ([c + 1 for c in caches], sum(c.sum() for c in caches))
        for debug in (None, False, True):
            step = KVCacheStep(kv, fn, "float32", (256, 1024), segment_shape=(2, 2), debug=debug)
            assert step.blocks == kv.num_blocks_committed
            step(); kv.commit(5); step()
            kv.release_physical(); kv.recommit(); step()
            kv.release_physical(); kv.commit(1); step()
            kv.release_physical(); kv.commit(3)
        """,
}


@pytest.mark.parametrize("case", LEGAL)
def test_jaxbuf_reads_only_committed_memory_in_debug_mode(case):
    result = _run("import os\n" + textwrap.dedent(LEGAL[case]) + "\nprint('done', flush=True)\n")
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "debug True" in result.stdout and "done" in result.stdout
    assert _jaxbuf_lines(result.stderr) == []


# -- the hint's line -----------------------------------------------------------------------
_host_calls = pytest.importorskip(
    "jaxbuf.drivers._host_calls", reason="the optional CPU-driver extension is not built"
)

READ_ONLY_WRITE = """
from jaxbuf.sharing import ImportedBuffer, export_layout
layout, fds = export_layout(buf, read_only=True)
imported = ImportedBuffer(layout, list(fds))
assert imported.read_only
ctypes.memset(imported.segment_view(0).ptr, 1, 16)  # committed, but mapped read-only
"""


@pytest.mark.parametrize("debug", ["0", "1"], ids=["normal", "debug"])
def test_a_write_to_a_read_only_import_is_named_as_such(debug):
    """The write lands on committed pages: the line must not blame uncommitted memory alone."""
    result = _run(READ_ONLY_WRITE, debug)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-3000:])
    (line,) = _jaxbuf_lines(result.stderr)
    mode = "(CPU driver, debug mode): " if debug == "1" else "(CPU driver): "
    assert f"{mode}{A_WRITE_TO}read-only or uncommitted memory" in line, line
    assert "imported read-only" in line, line


# Hands the freed reservation's addresses back to the kernel, maps an unrelated read-only
# page there and writes it: a fault that is not jaxbuf's.
UNRELATED = """
ptr = buf.full_view().ptr
driver = get_vmm_driver("cpu")
{give_back}
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
MAP_PRIVATE_ANONYMOUS_FIXED_NOREPLACE = 0x22 | 0x100000
page = libc.mmap(ptr, 4096, 1, MAP_PRIVATE_ANONYMOUS_FIXED_NOREPLACE, -1, 0)
assert page == ptr, (page, ptr)
print("mapped", flush=True)
ctypes.memset(page, 1, 1)
"""
GIVE_BACK = {
    "flush_quarantine": "buf.free(); driver.flush_quarantine()",
    "no quarantine": "driver.quarantine_bytes = 0; buf.free()",
    "evicted": (
        "driver.quarantine_ranges = 1; buf.free()\n"
        "other = ExtensibleTensor(4 * MiB, device='cpu'); other.free()"
    ),
}


@pytest.mark.parametrize("give_back", GIVE_BACK)
@pytest.mark.parametrize("debug", ["0", "1"], ids=["normal", "debug"])
def test_a_fault_at_addresses_handed_back_is_not_named_as_jaxbufs(give_back, debug):
    result = _run(UNRELATED.format(give_back=GIVE_BACK[give_back]), debug)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-3000:])
    assert "mapped" in result.stdout
    assert _jaxbuf_lines(result.stderr) == [], result.stderr[-3000:]


def test_the_forget_call_refuses_a_bad_range():
    with pytest.raises(ValueError):
        _host_calls.forget_reservation(1 << 20, 0)
    with pytest.raises(TypeError):
        _host_calls.forget_reservation(1 << 20)


# -- an interrupt inside unmap / move_mapping: every page's protection stays consistent -----
PAGES = 8


def _page_modes(base: int) -> list[str]:
    """The /proc/self/maps permissions of each of the reservation's PAGES pages."""
    modes = [None] * PAGES
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, mode = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            for page in range(PAGES):
                if low <= base + page * mmap.PAGESIZE < high:
                    modes[page] = mode
    return modes


def _interrupted(nth_line: int, call, *args):
    """``call(*args)`` with SIGINT raised at its ``nth_line``-th line event in the CPU driver's
    modules (delivered as KeyboardInterrupt where no block holds it back): True when the
    interrupt reached the caller."""
    seen = 0

    def trace(frame, event, arg):
        nonlocal seen
        if event == "line" and frame.f_code.co_filename.endswith(("host.py", "_posix.py")):
            seen += 1
            if seen == nth_line:
                signal.raise_signal(signal.SIGINT)
        return trace

    def start(frame, event, arg):
        return trace if frame.f_code.co_filename.endswith(("host.py", "_posix.py")) else None

    try:
        sys.settrace(start)
        try:
            call(*args)
        finally:
            sys.settrace(None)
    except KeyboardInterrupt:  # also one delivered as the tracing stops
        return True
    return False


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("debug", [False, True], ids=["normal", "debug"])
def test_an_interrupted_unmap_or_move_leaves_each_page_as_before_or_after(seed, debug):
    """Random maps, unmaps and moves of one-to-three-page chunks in one reservation, each
    unmap or move interrupted at a random line, against a model of every page's protection:
    after each call the pages and the chunk's ``ptr`` are those from before the call or those
    from after it, never a mix (a chunk mapped twice, a source left mapped)."""
    rng = np.random.default_rng(seed)
    driver = HostVmmDriver(debug=debug)
    reserved = "---p" if debug else "r--p"
    page = mmap.PAGESIZE
    base = driver.reserve(PAGES * page)
    model = [reserved] * PAGES
    chunks: dict[int, tuple[object, int]] = {}  # first page -> (chunk, pages)

    def free_runs(length: int) -> list[int]:
        return [
            p
            for p in range(PAGES - length + 1)
            if all(m == reserved for m in model[p : p + length])
        ]

    try:
        for _ in range(60):
            op = rng.choice(["map", "unmap", "move"])
            if op == "map" or not chunks:
                length = int(rng.integers(1, 4))
                runs = free_runs(length)
                if not runs:
                    continue
                first = int(rng.choice(runs))
                chunk = driver.create(length * page, 0)
                driver.map(base + first * page, length * page, chunk)
                chunks[first] = (chunk, length)
                model[first : first + length] = ["rw-s"] * length
            elif op == "unmap":
                first = int(rng.choice(list(chunks)))
                chunk, length = chunks[first]
                after = list(model)
                after[first : first + length] = [reserved] * length
                _interrupted(
                    int(rng.integers(1, 12)), driver.unmap, base + first * page, length * page
                )
                got = _page_modes(base)
                assert got in (model, after), (got, model, after)
                if got == model:  # interrupted before: unmap again, uninterrupted
                    driver.unmap(base + first * page, length * page)
                driver.release(chunk)
                del chunks[first]
                model = after
            else:
                first = int(rng.choice(list(chunks)))
                chunk, length = chunks[first]
                model[first : first + length] = [reserved] * length  # free while choosing
                runs = [r for r in free_runs(length) if r + length <= first or r >= first + length]
                model[first : first + length] = ["rw-s"] * length
                if not runs:
                    continue
                to = int(rng.choice(runs))
                after = list(model)
                after[first : first + length] = [reserved] * length
                after[to : to + length] = ["rw-s"] * length
                source, destination = base + first * page, base + to * page
                _interrupted(
                    int(rng.integers(1, 30)),
                    driver.move_mapping,
                    chunk,
                    source,
                    destination,
                    length * page,
                )
                got = _page_modes(base)
                assert got in (model, after), (got, model, after)
                moved = got == after
                assert chunk.ptr == base + (to if moved else first) * page
                if moved:
                    del chunks[first]
                    chunks[to] = (chunk, length)
                    model = after
    finally:
        for first, (chunk, length) in chunks.items():
            driver.unmap(base + first * page, length * page)
            driver.release(chunk)
        driver.free_reserved(base, PAGES * page)


# -- a handler before the hint's that deals with its own faults -----------------------------
RECOVERING_RUNTIME = """
import mmap, signal
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
region = libc.mmap(None, 3 * PAGE, 0, 0x22, -1, 0)  # PROT_NONE, private anonymous
recovered = []
HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)

@HANDLER
def recover(signum):  # a runtime mapping its own pages in on first touch (a GC, a JIT)
    if len(recovered) == 3:  # not its fault: the default, when the access faults again
        libc.signal(signal.SIGSEGV, ctypes.cast(None, HANDLER))
        return
    libc.mprotect(region + len(recovered) * PAGE, PAGE, 3)
    recovered.append(signum)

libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = [ctypes.c_int, HANDLER]
libc.signal(signal.SIGSEGV, recover)
late = ExtensibleTensor(4 * MiB, device="cpu")  # the hint's handler, chained to the runtime's
for page in range(3):  # ctypes releases the GIL around memset: the callback can take it
    ctypes.memset(region + page * PAGE, page + 1, 1)
print("recovered", len(recovered), flush=True)
late.resize_per_segment_(4096)
np.from_dlpack(late.full_view())[-1] = 1  # past the committed bytes: the line, then death
"""


def test_a_runtime_handler_before_the_hint_recovers_every_fault():
    """A SIGSEGV handler installed before jaxbuf's that maps the page and returns (a GC's
    write barrier, a JIT) must see every one of its faults, not only the first: the hint is
    ready again once a handler it chained to returns."""
    result = _run(RECOVERING_RUNTIME, "0")
    assert "recovered 3" in result.stdout, (result.returncode, result.stderr[-3000:])
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-3000:])
    (line,) = _jaxbuf_lines(result.stderr)
    assert "past the committed bytes" in line, line


def test_a_handler_that_returns_without_mapping_gets_one_line_not_a_flood():
    """Python's own SIGSEGV handler returns without mapping the page, so the access faults
    again and again (as without jaxbuf); the hint writes its line once, not once a round."""
    code = textwrap.dedent(SETUP) + (
        "import signal\n"
        "signal.signal(signal.SIGSEGV, lambda *args: None)\n"
        "other = ExtensibleTensor(MiB, device='cpu')  # the hint in front again, chained\n"
        "print('faulting', flush=True)\n"
        "ctypes.memset(buf.full_view().ptr + 3 * MiB, 1, 1)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**environment, DEBUG_ENV: "0"},
    )
    try:
        assert child.stdout.readline().startswith("debug")
        assert child.stdout.readline() == "faulting\n"
        time.sleep(1.5)  # the fault loops meanwhile
    finally:
        child.kill()
        _, stderr = child.communicate()
    assert len(_jaxbuf_lines(stderr)) == 1, stderr[-2000:]
