"""The crash matrix: every misuse of an owner and its exports, and every sequence of public calls
the README's "Limits" warned about, run in a child process. Each case either works or raises
the documented error; none may end the process by a signal.

How a case runs: :func:`run_child` starts ``python -c PRELUDE + body DEVICE CONSUMER`` and
asserts that the child exited with status 0 (a negative status is a signal: the failure message
names it) and printed the marker line ``CRASH-MATRIX:<outcome>``; cases assert on the outcome
("works", or "raised <Type>"). The body itself asserts what must hold (values intact, memory
released) and exits with status 1 and a traceback when it does not. Each child is short (a few
seconds, most of it importing torch or JAX) and independent, so the matrix runs in parallel
under ``pytest -n``. ``device`` is the conftest fixture (cpu, and cuda on a GPU machine);
``consumer`` is numpy, torch or JAX where the case imports memory into a framework.

The hostile-peer sharing cases against a real second process are in test_sharing_hostile.py;
here are the in-process ones (a malformed layout, a truncating peer, a peer that never reads).
RELIABILITY.md ("Crash matrix") lists the cases and the results.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import _forkserver
import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "CRASH-MATRIX:"
MISSING = {m: importlib.util.find_spec(m) is None for m in ("torch", "jax")}

# Prepended to every child: the device and consumer from argv, and the helpers bodies use.
PRELUDE = r'''
import gc, os, sys, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
import jaxbuf

DEVICE, CONSUMER = sys.argv[1], sys.argv[2]
MiB = 1 << 20
N = 1 << 16  # elements of the float32 views most cases use
PATTERN = (np.arange(4 * N, dtype=np.float32) % 1000) * 0.5 + 1
KEEP = []  # objects a case keeps alive on purpose


def done(outcome="works"):
    print("CRASH-MATRIX:" + outcome, flush=True)


def raises(kind, call, *words):
    """call() must raise kind with each of words in its message; returns the error."""
    try:
        call()
    except kind as error:
        missing = [w for w in words if w not in str(error)]
        if missing:
            raise AssertionError(f"{kind.__name__} message lacks {missing}: {error}")
        return error
    raise AssertionError(f"{call} did not raise {kind.__name__}")


def host(array):
    """A numpy copy of a numpy / torch / JAX array (or a view), wherever it lives."""
    if isinstance(array, np.ndarray):
        return array.copy()
    if isinstance(array, jaxbuf.BufferView):
        return host(array.to_torch())
    if type(array).__module__.startswith("torch"):
        return array.detach().cpu().numpy().copy()
    return np.asarray(array).copy()


def write(view, values):
    """Copy values into view's memory through its owner's driver (CPU or CUDA)."""
    values = np.ascontiguousarray(values)
    driver = view.owner.driver
    driver.copy(view.ptr, values.ctypes.data, values.nbytes, view.device.index)
    driver.synchronize(view.device.index)


def import_as(consumer, view, **kwargs):
    """view imported through the standard protocol (from_dlpack) by consumer."""
    if consumer == "numpy":
        return np.from_dlpack(view, **kwargs)
    if consumer == "torch":
        import torch
        return torch.from_dlpack(view, **kwargs)
    import jax.numpy as jnp
    if kwargs:
        return jnp.from_dlpack(view, **kwargs)
    import jax.dlpack
    return jax.dlpack.from_dlpack(view)


def wait_released(owner, seconds=5.0):
    """JAX may drop an import from its own thread, a little later: poll."""
    deadline = time.monotonic() + seconds
    while not owner.released and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert owner.released, f"memory not released: live_exports={owner.live_exports}"
    assert owner.live_exports == 0, owner.live_exports
'''

# make(n) -> (owner, view, release): an owner of each kind, a float32 view of n elements
# holding PATTERN[:n], and the call that means "I am done" (free / close).
OWNERS = {
    "extensible": r"""
def make(n):
    owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
    owner.resize_per_segment_(2 * MiB, zero_new=True)
    view = owner.segment_view(0).view("float32", (n,))
    write(view, PATTERN[:n])
    return owner, view, owner.free
""",
    "uva": r"""
def make(n):
    owner = jaxbuf.UvaBuffer(n, "float32", device=DEVICE)
    owner.np[:] = PATTERN[:n]
    return owner, owner.view, owner.free
""",
    "staged": r"""
def make(n):
    owner = jaxbuf.StagedWriteTensor((n // 64, 64), "float32", device=DEVICE)
    for row in range(n // 64):
        owner.stage_write(row, 0, PATTERN[row * 64:(row + 1) * 64])
    owner.apply_write()
    return owner, owner.gpu.view("float32", (n,)), owner.free
""",
    "imported": r"""
from jaxbuf.sharing import ImportedBuffer, export_layout

def make(n):
    source = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
    source.resize_per_segment_(2 * MiB, zero_new=True)
    write(source.segment_view(0).view("float32", (n,)), PATTERN[:n])
    layout, fds = export_layout(source)
    owner = ImportedBuffer(layout, list(fds))
    KEEP.append(source)  # the exporter stays: the import is the owner under test
    return owner, owner.segment_view(0).view("float32", (n,)), owner.close
""",
}


def run_child(
    body: str, device: str, consumer: str = "", *extra_args: str, timeout: float = 120
) -> str:
    """Run PRELUDE + body in a fresh interpreter (argv: device, consumer, extra_args); it must
    exit 0 and print the marker. Returns the outcome the child reported (the text after the
    last marker)."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if device == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")  # the CPU driver's cases need no GPU backend
    # A script file rather than -c, so that a failing child's traceback shows its lines.
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="crash_case_") as script:
        script.write(PRELUDE + textwrap.dedent(body))
        script.flush()
        try:
            proc = _forkserver.run(
                [sys.executable, script.name, device, consumer, *extra_args],
                timeout=timeout,
                cwd=ROOT,
                env=env,
            )
        except subprocess.TimeoutExpired as error:
            pytest.fail(
                f"child hung for {timeout} s\nstdout:\n{error.stdout}\nstderr:\n{error.stderr}"
            )
    output = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"child killed by {name}\n{output}")
    assert proc.returncode == 0, f"child exited with status {proc.returncode}\n{output}"
    outcomes = [line[len(MARK) :] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert outcomes, f"child exited 0 without reaching its end\n{output}"
    return outcomes[-1]


def needs(consumer: str, device: str) -> None:
    """Skip where a consumer is absent or does not apply (numpy imports host memory only)."""
    if consumer in MISSING and MISSING[consumer]:
        pytest.skip(f"{consumer} is not installed")
    if consumer == "numpy" and device != "cpu":
        pytest.skip("numpy imports host memory only")


consumers = pytest.mark.parametrize("consumer", ["numpy", "torch", "jax"])
owners = pytest.mark.parametrize("owner", list(OWNERS))


# -- 1. imported arrays own their memory ------------------------------------------------------
@owners
@consumers
def test_import_then_drop_view_and_owner_then_read(device, owner, consumer):
    """np/torch/jax from_dlpack, drop the view and its owner (no free), then read."""
    needs(consumer, device)
    body = (
        OWNERS[owner]
        + r"""
owner, view, release = make(N)
array = import_as(CONSUMER, view)
del view, owner, release
KEEP.clear()
gc.collect()
assert (host(array) == PATTERN[:N]).all()
del array
gc.collect()
done()
"""
    )
    assert run_child(body, device, consumer) == "works"


@owners
@consumers
def test_free_with_a_live_export_reads_then_releases(device, owner, consumer):
    """free() while an imported array is alive: the array still reads the data; dropping it
    releases the memory (released True, live_exports 0)."""
    needs(consumer, device)
    body = (
        OWNERS[owner]
        + r"""
owner, view, release = make(N)
array = import_as(CONSUMER, view)
del view
release()
assert owner.live_exports == 1 and not owner.released, (owner.live_exports, owner.released)
assert (host(array) == PATTERN[:N]).all()
del array
wait_released(owner)
release()  # idempotent
done()
"""
    )
    assert run_child(body, device, consumer) == "works"


@owners
def test_view_taken_before_free_refuses_to_export(device, owner):
    """A view taken before free(): to_jax / to_torch / __dlpack__ raise RuntimeError."""
    body = (
        OWNERS[owner]
        + r"""
owner, view, release = make(N)
release()
assert owner.released and owner.live_exports == 0
raises(RuntimeError, view.__dlpack__)
raises(RuntimeError, lambda: view.__dlpack__(max_version=(1, 0)))
raises(RuntimeError, lambda: view.__dlpack__(copy=True))
if not view.device.is_cuda:
    raises(RuntimeError, view.to_numpy)
try:
    import torch
except ImportError:
    pass
else:
    raises(RuntimeError, view.to_torch)
    raises(RuntimeError, lambda: torch.from_dlpack(view))
try:
    import jax
except ImportError:
    pass
else:
    raises(RuntimeError, view.to_jax)
done()
"""
    )
    assert run_child(body, device) == "works"


# -- 2. JAX: the README example, asynchronous dispatch, donation ------------------------------
def _readme_jax_example(device: str) -> str:
    examples = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    first = "# Runs on the CPU" if device == "cpu" else "# Needs a CUDA GPU"
    found = [
        e
        for e in examples
        if e.startswith(first) and "import jax," in e and ".free()" in e and "donate" in e
    ]
    assert len(found) == 1, f"expected one JAX example starting {first!r}"
    return found[0]


def test_readme_jax_example(device):
    """The README's JAX example (donated step, then free()), with the deleter race at exit:
    run twice, since the race hit about one run in five."""
    if MISSING["jax"]:
        pytest.skip("jax is not installed")
    body = _readme_jax_example(device) + "\ndone()\n"
    for _ in range(2):
        assert run_child(body, device) == "works"


ASYNC = r"""
import jax, jax.numpy as jnp
DONATE = {donate}

def slow(x):  # long enough that free() comes while it runs
    return jax.lax.fori_loop(0, 200, lambda i, acc: acc + jnp.sin(x * i).sum(), 0.0)

step = jax.jit(lambda x: (x * 2, slow(x)), donate_argnums=0 if DONATE else ())
expected = [np.asarray(v) for v in step(jnp.array(PATTERN[:N]))]
owner, view, release = make(N)
x = view.to_jax()
y = step(x)
release()  # at once, with the step in flight
del x, view
got = [np.asarray(v) for v in y]
assert (got[0] == expected[0]).all() and np.allclose(got[1], expected[1], rtol=1e-4)
del y
wait_released(owner)
done()
"""


@owners
@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_free_under_jax_async_dispatch(device, owner, donate):
    """A long jitted computation over an imported array, then free() immediately: the
    computation reads the data (free waits for JAX when JAX gave the import up early, as it
    does for a donated argument)."""
    if MISSING["jax"]:
        pytest.skip("jax is not installed")
    body = OWNERS[owner] + ASYNC.replace("{donate}", str(donate))
    assert run_child(body, device) == "works"


def test_exit_while_jax_drops_imports(device):
    """Exit with JAX work in flight over many imports, donated and not: JAX drops them from
    its own threads while the interpreter shuts down (the deleter must not take the GIL then:
    that ended the process with "terminate called without an active exception")."""
    if MISSING["jax"]:
        pytest.skip("jax is not installed")
    body = r"""
import jax, jax.numpy as jnp
buf = jaxbuf.ExtensibleTensor(64 * MiB, device=DEVICE, num_segments=4)
buf.resize_per_segment_(4 * MiB, zero_new=True)
step = jax.jit(lambda x: (x * 2 + 1).sum(), donate_argnums=0)
donate = jax.jit(lambda x: x.at[0].set(1), donate_argnums=0)
out = []
for i in range(100):
    x = buf.segment_view(i % 4).to_jax(dtype=jnp.float32, shape=(1 << 20,))
    out.append(step(x) if i % 2 else donate(x))
del x
done()  # and exit with the work in flight
"""
    for _ in range(2):
        assert run_child(body, device) == "works"


# Drops consumed capsules from C++ threads Python never saw (noexcept destructors, as JAX
# does), with short random delays, so that some land while the interpreter shuts down.
FOREIGN_DROPPER = r"""
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
typedef void (*deleter_t)(void *);
struct Job { void **managed; long n; long offset; unsigned seed; };
struct Holder {
    void *managed; long offset;
    ~Holder() { (*(deleter_t *)((char *)managed + offset))(managed); }
};
static void *run(void *arg) {
    Job *job = (Job *)arg;
    for (long i = 0; i < job->n; i++) {
        usleep(rand_r(&job->seed) % 100);
        Holder holder{job->managed[i], job->offset};
    }
    return nullptr;
}
extern "C" int drop_later(void **managed, long n, long deleter_offset, unsigned seed) {
    Job *job = new Job{new void *[n], n, deleter_offset, seed};
    for (long i = 0; i < n; i++) job->managed[i] = managed[i];
    pthread_t t;
    if (pthread_create(&t, nullptr, run, job)) return -1;
    return pthread_detach(t);
}
"""


def test_exit_while_foreign_threads_drop_exports(tmp_path):
    """Four non-Python threads drop 8000 consumed capsules while the interpreter exits (and
    a finalizer releases the GIL during shutdown, as JAX's teardown does)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    source = tmp_path / "dropper.cc"
    source.write_text(FOREIGN_DROPPER)
    library = tmp_path / "libdropper.so"
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(library), str(source)],
        check=True,
    )
    body = r"""
import ctypes
from jaxbuf import _dlpack
lib = ctypes.CDLL(sys.argv[3])  # the dropper, compiled by the test
lib.drop_later.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_uint]
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
buf = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
buf.resize_per_segment_(2 * MiB)
view = buf.segment_view(0).view("float32")
n, threads = 8000, 4
managed = (ctypes.c_void_p * n)()
for i in range(n):
    capsule = view.__dlpack__()
    managed[i] = api.PyCapsule_GetPointer(capsule, b"dltensor")
    api.PyCapsule_SetName(capsule, b"used_dltensor")  # consumed: its deleter is ours to call
assert buf.live_exports == n
offset = ctypes.sizeof(_dlpack.DLManagedTensor) - ctypes.sizeof(ctypes.c_void_p)  # deleter
for t in range(threads):
    start = ctypes.addressof(managed) + t * (n // threads) * ctypes.sizeof(ctypes.c_void_p)
    lib.drop_later(start, n // threads, offset, int(sys.argv[4]) * threads + t)


class ReleasesTheGil:
    def __del__(self, _sleep=time.sleep):
        for _ in range(20):
            _sleep(0.002)


KEEP.append(ReleasesTheGil())
done()
"""
    for seed in range(4):
        assert run_child(body, "cpu", "", str(library), str(seed), timeout=60) == "works"


def test_after_exit_starts_deleters_leak_instead_of_taking_the_gil():
    """Once the atexit handler has run, a deleter frees its block and leaks the anchor
    reference (the process is exiting): nothing runs Python code any more."""
    body = r"""
from jaxbuf import _capsule
buf = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
buf.resize_per_segment_(2 * MiB)
array = np.from_dlpack(buf.segment_view(0))
assert not _capsule.is_exiting() and buf.live_exports == 1
_capsule.at_exit()
assert _capsule.is_exiting()
del array
gc.collect()
assert buf.live_exports == 1  # leaked on purpose
done()
"""
    assert run_child(body, "cpu") == "works"


# -- 3. UVA pools and tensors -----------------------------------------------------------------
POOL_CONSUMERS = pytest.mark.parametrize("framework", ["view", "torch", "jax"])


def _pool_needs(framework: str, device: str) -> None:
    needs("torch" if framework == "view" else framework, device)


@POOL_CONSUMERS
@pytest.mark.parametrize("what", ["pool", "uva_backed"])
def test_dropping_a_pool_keeps_its_arrays(device, framework, what):
    """Drop a UvaBufferPool (or UvaBackedTensor) while arrays it returned are alive, make
    another UvaBuffer, then read and write the old arrays: values intact, no corruption (a
    stale tensor read the other buffer's 1001, and its fill_(-7) overwrote it)."""
    _pool_needs(framework, device)
    body = r"""
if WHAT == "pool":
    pool = jaxbuf.UvaBufferPool(4, "int32", max_concurrency=2, device=DEVICE, framework=CONSUMER)
    a = pool.copy_to_uva(np.full(4, 5, np.int32))
else:
    pool = jaxbuf.UvaBackedTensor(4, "int32", device=DEVICE, framework=CONSUMER)
    pool.np[:] = 5
    a = pool.copy_to_uva()
if CONSUMER == "view":  # views are no arrays: import into torch while the pool lives
    a = a.to_torch()
del pool
gc.collect()
other = jaxbuf.UvaBuffer(4, "int32", device=DEVICE)
other.np[:] = 1001
assert (host(a) == 5).all(), host(a)
if CONSUMER != "jax":  # torch: write through the stale tensor
    a.fill_(-7)
    if a.is_cuda:
        import torch
        torch.cuda.synchronize()
    assert (host(a) == -7).all() and (other.np == 1001).all(), (host(a), other.np)
del a
other.free()
done()
""".replace("WHAT", repr(what))
    assert run_child(body, device, framework) == "works"


@POOL_CONSUMERS
def test_grown_or_closed_pool_keeps_replaced_slot_alive(device, framework):
    """A slot replaced by growth (and every slot, after close()) stays alive and intact while
    arrays over it live."""
    _pool_needs(framework, device)
    body = r"""
pool = jaxbuf.UvaBufferPool(4, "int32", max_concurrency=1, device=DEVICE, framework=CONSUMER)
a = pool.copy_to_uva(np.full(4, 5, np.int32))
a = a.to_torch() if CONSUMER == "view" else a
b = pool.copy_to_uva(np.full(16, 7, np.int32))  # grows: slot 0 is replaced
b = b.to_torch() if CONSUMER == "view" else b
gc.collect()
assert (host(a) == 5).all() and (host(b) == 7).all()
pool.close()
gc.collect()
other = jaxbuf.UvaBuffer(16, "int32", device=DEVICE)
other.np[:] = 1001
assert (host(a) == 5).all() and (host(b) == 7).all()
del a, b
other.free()
done()
"""
    assert run_child(body, device, framework) == "works"


def test_copy_to_uva_refuses_a_value_the_pool_dtype_cannot_hold(device):
    body = r"""
pool = jaxbuf.UvaBufferPool(4, "int32", device=DEVICE)
raises(ValueError, lambda: pool.copy_to_uva(np.array([2**31, 0, 0, 0], np.int64)), "2147483648")
raises(ValueError, lambda: pool.copy_to_uva([2**31, 0, 0, 0]), "2147483648")
raises(ValueError, lambda: pool.copy_to_uva([-2**31 - 1, 0, 0, 0]), "2147483649")
pool.close()
done()
"""
    assert run_child(body, device) == "works"


HUGE_COUNT = {
    "UvaBufferPool": 'jaxbuf.UvaBufferPool(4, "int32", max_concurrency=2**40, device=DEVICE)',
    "UvaBackedTensor": 'jaxbuf.UvaBackedTensor(4, "int32", max_concurrency=2**40, device=DEVICE)',
    "StagedWriteTensor": (
        'jaxbuf.StagedWriteTensor((4, 4), "int32", device=DEVICE, max_concurrency=2**40)'
    ),
}


@pytest.mark.parametrize(
    "kind",
    [
        "UvaBufferPool",
        "UvaBackedTensor",
        "StagedWriteTensor",
    ],
)
def test_huge_counts_are_refused_before_allocating(device, kind):
    """max_concurrency=2**40 raises ValueError at once (a pool allocated for minutes)."""
    body = r"""
start = time.monotonic()
raises(ValueError, lambda: MAKE, "max_concurrency", str(2**40))
assert time.monotonic() - start < 2.0, time.monotonic() - start
done()
""".replace("MAKE", HUGE_COUNT[kind])
    assert run_child(body, device) == "works"


# -- 4. staged writes -------------------------------------------------------------------------
@consumers
def test_staged_tensor_freed_with_an_array_alive(device, consumer):
    needs(consumer, device)
    body = r"""
owner = jaxbuf.StagedWriteTensor((4, 64), "float32", device=DEVICE)
for row in range(4):
    owner.stage_write(row, 0, PATTERN[row * 64:(row + 1) * 64])
owner.apply_write()
array = {"numpy": owner.to_numpy, "torch": owner.to_torch, "jax": owner.to_jax}[CONSUMER]()
owner.free()
assert owner.live_exports == 1 and not owner.released
assert (host(array).ravel() == PATTERN[:256]).all()
del array
wait_released(owner)
done()
"""
    assert run_child(body, device, consumer) == "works"


def test_apply_write_after_free_raises(device):
    body = r"""
owner = jaxbuf.StagedWriteTensor((4, 64), "float32", device=DEVICE)
owner.stage_write(0, 0, [1.0, 2.0])
owner.free()
raises(RuntimeError, owner.apply_write)
raises(RuntimeError, lambda: owner.stage_write(0, 0, [1.0]))
done()
"""
    assert run_child(body, device) == "works"


# -- 5. owners cannot be copied or pickled ----------------------------------------------------
MAKE_OWNER = {
    "ExtensibleTensor": "jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)",
    "UvaBuffer": 'jaxbuf.UvaBuffer(4, "int32", device=DEVICE)',
    "NonUvaBuffer": 'jaxbuf.NonUvaBuffer(4, "int32", device=DEVICE)',
    "UvaBufferPool": 'jaxbuf.UvaBufferPool(4, "int32", device=DEVICE)',
    "UvaBackedTensor": 'jaxbuf.UvaBackedTensor(4, "int32", device=DEVICE)',
    "StagedWriteTensor": 'jaxbuf.StagedWriteTensor((4, 4), "int32", device=DEVICE)',
    "ImportedBuffer": "make_imported()",
}


@pytest.mark.parametrize("kind", list(MAKE_OWNER))
def test_owners_refuse_copy_and_pickle(device, kind):
    """copy.copy, copy.deepcopy and pickle of an owner raise TypeError saying why (a copy of
    an ImportedBuffer freed its range twice)."""
    body = r"""
import copy, pickle
from jaxbuf.sharing import ImportedBuffer, export_layout

def make_imported():
    source = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
    source.resize_per_segment_(2 * MiB)
    KEEP.append(source)
    return ImportedBuffer(*export_layout(source))

owner = MAKE
for call in (copy.copy, copy.deepcopy, pickle.dumps):
    error = raises(TypeError, lambda: call(owner))
    assert "pickle" in str(error) or "cop" in str(error), error
    assert "_thread.lock" not in str(error), error
(owner.close if hasattr(owner, "close") else owner.free)()
done()
""".replace("MAKE", MAKE_OWNER[kind])
    assert run_child(body, device) == "works"


# -- 6. DLPack as the spec says ---------------------------------------------------------------
def test_non_native_byte_order_is_refused(device):
    body = r"""
owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB)
view = owner.segment_view(0)
raises(TypeError, lambda: view.view(">i4"), "byte order")
raises(TypeError, lambda: view.view(np.dtype(">f4")), "byte order")
raises(TypeError, lambda: jaxbuf.UvaBuffer(4, ">i4", device=DEVICE), "byte order")
owner.free()
done()
"""
    assert run_child(body, device) == "works"


@consumers
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_round_trip(device, consumer, dtype):
    needs(consumer, device)
    if consumer == "jax" and dtype == "complex128":
        pytest.skip("JAX without jax_enable_x64 has no complex128")
    body = r"""
DTYPE = "DT"
owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB)
values = (PATTERN[:1024] + 1j * PATTERN[1:1025]).astype(DTYPE)
view = owner.segment_view(0).view(DTYPE, (1024,))
write(view, values)
array = import_as(CONSUMER, view)
got = host(array)
assert got.dtype == np.dtype(DTYPE) and (got == values).all()
del array
owner.free()
done()
""".replace("DT", dtype)
    assert run_child(body, device, consumer) == "works"


@consumers
def test_dlpack_copy_true_is_an_independent_copy(device, consumer):
    """__dlpack__(copy=True): the consumer gets a copy the capsule owns; later writes to the
    original do not show, and the copy outlives the owner's free()."""
    needs(consumer, device)
    body = (
        OWNERS["extensible"]
        + r'''
class CopyRequest:
    """Asks for copy=True whatever the consumer passes: jnp.from_dlpack(view, copy=True)
    calls __dlpack__(stream=None) only, and aliases the memory."""

    def __init__(self, view):
        self.view = view

    def __dlpack__(self, **kwargs):
        return self.view.__dlpack__(**{**kwargs, "copy": True})

    def __dlpack_device__(self):
        return self.view.__dlpack_device__()


owner, view, release = make(N)
if CONSUMER == "jax":
    array = import_as(CONSUMER, CopyRequest(view))
else:
    array = import_as(CONSUMER, view, copy=True)
assert owner.live_exports == 0, owner.live_exports  # the copy holds its own memory
write(view, np.zeros(N, np.float32))
release()
assert owner.released
assert (host(array) == PATTERN[:N]).all()
capsule = view.__dlpack__  # the view itself now refuses
raises(RuntimeError, lambda: capsule(copy=True))
done()
'''
    )
    assert run_child(body, device, consumer) == "works"


@consumers
def test_size_zero_view_exports_a_null_pointer(device, consumer):
    needs(consumer, device)
    body = r"""
import ctypes
from jaxbuf import _dlpack
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB)
view = owner.segment_view(0).view("float32", (0,))
for versioned, name, struct in ((False, b"dltensor", _dlpack.DLManagedTensor),
                                (True, b"dltensor_versioned", _dlpack.DLManagedTensorVersioned)):
    capsule = view.__dlpack__(max_version=(1, 0) if versioned else None)
    managed = struct.from_address(api.PyCapsule_GetPointer(capsule, name))
    assert managed.dl_tensor.data is None, managed.dl_tensor.data
    del capsule, managed
array = import_as(CONSUMER, view)
assert tuple(array.shape) == (0,)
del array
owner.free()
done()
"""
    assert run_child(body, device, consumer) == "works"


def test_to_jax_of_an_unaligned_view_never_copies(device):
    """A view 1000 bytes into the memory (not 64-byte aligned): to_jax() is zero-copy or
    raises, never a silent copy."""
    if MISSING["jax"]:
        pytest.skip("jax is not installed")
    body = r"""
owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB)
full = owner.full_view()
view = jaxbuf.BufferView(full.ptr + 1000, 4096, "float32", device=full.device, owner=owner,
                         dlpack_device_type=full.dlpack_device_type)
try:
    array = view.to_jax()
except (BufferError, ValueError, RuntimeError) as error:
    assert "align" in str(error), error
    outcome = f"raised {type(error).__name__}"
else:
    assert array.unsafe_buffer_pointer() == view.ptr, "to_jax copied"
    del array
    outcome = "works"
del view, full
owner.free()
done(outcome)
"""
    assert run_child(body, device) in ("works", "raised BufferError", "raised ValueError")


def test_huge_extensible_tensor_message(device):
    """ExtensibleTensor(2**63 - 1): a ValueError whose stated bound the value exceeds."""
    body = r"""
import re
error = raises(ValueError, lambda: jaxbuf.ExtensibleTensor(2**63 - 1, device=DEVICE),
               str(2**63 - 1))
numbers = [int(n) for n in re.findall(r"\d{12,}", str(error))]
bounds = [n for n in numbers if n != 2**63 - 1]
assert bounds and all(b < 2**63 - 1 for b in bounds), error
done()
"""
    assert run_child(body, device) == "works"


# -- 7. what the README's Limits said -----------------------------------------------------------
@pytest.mark.parametrize("consumer", ["torch", "jax"])
def test_release_physical_with_live_arrays_then_grow(device, consumer):
    """release_physical() is the one call documented to invalidate live arrays: no read
    between it and the next grow (that read may fault, as documented); after the grow the
    arrays read the new memory, and free() with them alive is the normal deferred release."""
    needs(consumer, device)
    body = r"""
owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB, zero_new=True)
view = owner.segment_view(0).view("float32", (N,))
write(view, PATTERN[:N])
array = view.to_torch() if CONSUMER == "torch" else view.to_jax()
owner.release_physical()
owner.resize_per_segment_(2 * MiB, zero_new=True)
if CONSUMER == "torch":  # JAX caches nothing here, but its arrays are immutable: not re-read
    assert (host(array) == 0).all()
owner.free()
del array
wait_released(owner)
done()
"""
    assert run_child(body, device, consumer) == "works"


def test_cycle_through_a_numpy_export(device):
    """The README warned that a cycle through a to_numpy() array (owner.cache = array) is
    never collected: numpy arrays are invisible to the cycle collector, and the array held
    the owner. Now it holds the allocation only, so the owner is collected, and a freed
    owner's memory goes with the array."""
    if device != "cpu":
        pytest.skip("to_numpy needs host memory")
    body = r"""
import weakref
owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB)
owner.cache = owner.segment_view(0).to_numpy()
handle = weakref.ref(owner)
del owner
gc.collect()
assert handle() is None, gc.get_referrers(handle())

owner = jaxbuf.ExtensibleTensor(8 * MiB, device=DEVICE)
owner.resize_per_segment_(2 * MiB)
array = owner.segment_view(0).to_numpy()
owner.cache = array
owner.free()
assert owner.live_exports == 1 and not owner.released
del owner.cache, array
wait_released(owner)
done()
"""
    assert run_child(body, device) == "works"


@pytest.mark.gpu
def test_cuda_graph_capturing_a_copy_of_uncommitted_bytes(device):
    """Capturing a copy over bytes committed later raises (CUDA checks the addresses at
    capture) or works; it never kills the process."""
    if device != "cuda" or MISSING["torch"]:
        pytest.skip("a CUDA graph needs CUDA and torch")
    body = r"""
import torch
buf = jaxbuf.ExtensibleTensor(256 * MiB, device="cuda")
buf.resize_per_segment_(2 * MiB)
full = buf.full_view().to_torch()
out = torch.empty(16, dtype=torch.uint8, device="cuda")
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        out.copy_(full[100 * MiB : 100 * MiB + 16])
except RuntimeError as error:
    outcome = "raised RuntimeError"
else:
    buf.resize_per_segment_(128 * MiB, zero_new=True)
    graph.replay()
    torch.cuda.synchronize()
    outcome = "works"
done(outcome)
"""
    assert run_child(body, device) in ("works", "raised RuntimeError")


# -- 8. sharing, in one process (the two-process hostile peers: test_sharing_hostile.py) --------
def test_malformed_layouts_are_refused_before_mapping(device):
    """A chunk not in all_chunks, and overlapping chunks: ValueError naming the entry; the
    importer's own memory is untouched."""
    body = r"""
import copy
from jaxbuf.sharing import ImportedBuffer, export_layout
owner = jaxbuf.ExtensibleTensor(16 * MiB, device=DEVICE)
owner.resize_per_segment_(4 * MiB)
g = owner.granularity
good, fds = export_layout(owner)
for mutate in ("foreign", "overlap"):
    layout = copy.deepcopy(good)
    if mutate == "foreign":
        layout["chunks"][0][2] = 10**6  # an id all_chunks does not list
    else:  # a second chunk over the first one's second granule
        layout["chunks"].append([g, g, 10**6])
        layout["all_chunks"].append([g, g, 10**6])
    dup = [os.dup(fd) for fd in fds] + ([os.dup(fds[0])] if mutate == "overlap" else [])
    raises(ValueError, lambda: ImportedBuffer(layout, dup))
for fd in fds:
    os.close(fd)
own = owner.segment_view(0).view("uint8", (16,))
write(own, np.arange(16, dtype=np.uint8))
owner.free()
done()
"""
    assert run_child(body, device) == "works"


def test_a_peer_cannot_truncate_the_owners_memory():
    """CPU chunks are sealed memfds: ftruncate on a received descriptor fails, the owner
    keeps reading its memory (it died with SIGBUS)."""
    body = r"""
from jaxbuf.sharing import export_layout
owner = jaxbuf.ExtensibleTensor(8 * MiB, device="cpu")
owner.resize_per_segment_(2 * MiB)
array = owner.segment_view(0).to_numpy()
array[:] = 7
layout, fds = export_layout(owner)
for fd in fds:
    raises(PermissionError, lambda: os.ftruncate(fd, 0))
    os.close(fd)
assert (array == 7).all()
del array
owner.free()
done()
"""
    assert run_child(body, "cpu") == "works"


def test_send_to_a_peer_that_never_reads_times_out():
    """send_buffer to a peer that never reads returns or raises TimeoutError within its
    timeout; freeing the owner afterwards works."""
    body = r"""
import socket
from jaxbuf.sharing import send_buffer
owner = jaxbuf.ExtensibleTensor(2048 * MiB, device="cpu", num_segments=512)
owner.resize_per_segment_(2 * MiB)  # 512 chunks: more descriptors than one send carries
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
start = time.monotonic()
try:
    send_buffer(a, owner, timeout=0.5)
except TimeoutError:
    outcome = "raised TimeoutError"
else:
    outcome = "works"
assert time.monotonic() - start < 5, time.monotonic() - start
a.close()
b.close()
owner.free()
done(outcome)
"""
    assert run_child(body, "cpu") in ("works", "raised TimeoutError")
