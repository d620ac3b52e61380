"""Capability fixtures: every skip says why.

``device`` runs a test on the CPU driver and, where a CUDA GPU with VMM support is present,
on CUDA; ``framework`` runs it through torch and through JAX.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import os
import random
import signal

# JAX would otherwise take most of the GPU at its first use, starving VMM allocations.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Triton 3.9 warns at every compile that leaves FP fusion to this variable (its default flips
# in 3.10). The staged-write kernels only load and store, so fusion changes nothing in them:
# take 3.10's default now, here and in every child process (they inherit the environment).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")

import pytest  # noqa: E402

from jaxbuf.drivers import cuda_unavailable_reason  # noqa: E402

CUDA_REASON = cuda_unavailable_reason()
if CUDA_REASON is not None:
    # No GPU: Triton kernels run under Triton's interpreter. Set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _missing(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    return None


def pytest_configure(config):
    # The state machine's random seed, drawn once in the controlling process (xdist workers
    # inherit the environment), so that every worker runs the same seed; the header prints it.
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ.setdefault("JAXBUF_STATEFUL_SEED", str(random.SystemRandom().randrange(2**32)))


def pytest_collection_finish(session):
    """Freeze what collection created (modules, frameworks, test items: some 300,000 objects)
    into the collector's permanent generation. A test's ``gc.collect()`` then walks only what
    tests made since, about 5 us instead of 150 ms; the suite calls it thousands of times.
    Only objects alive now are frozen, so nothing a test creates escapes collection."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Give the frozen objects back to the collector before the interpreter exits. Shutdown
    never collects the permanent generation: the module cycles frozen above would outlive
    finalization, and nanobind would report every Triton function and type as leaked
    (``nanobind: leaked 514 functions!``, once per worker and per child that imports Triton)."""
    gc.unfreeze()


def pytest_report_header(config):
    seed = os.environ.get("JAXBUF_STATEFUL_SEED")
    return f"state machine random seed: {seed} (JAXBUF_STATEFUL_SEED={seed} replays it)"


# Set by tools/gpu_check.sh: a run on the GPU machine may be cut off before pytest's summary,
# so each failure is written as it happens, and SIGUSR1 dumps every thread's Python stack.
_REPORT_DIR = os.environ.get("JAXBUF_REPORT_DIR")
if _REPORT_DIR:
    _process = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
    _stacks = open(os.path.join(_REPORT_DIR, f"stacks-{_process}.log"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)

    def pytest_runtest_logreport(report):
        if report.failed:
            with open(os.path.join(_REPORT_DIR, f"failures-{_process}.log"), "a") as log:
                log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skips grouped by reason, one line per reason with its count, instead of pytest's one
    line per skip location (most skips here share a reason: no GPU, a missing framework).

    Runs before pytest's short summary, where ``-rs`` (or ``-ra``) would list skips; they are
    taken out of it, so each reason shows once."""
    skipped = terminalreporter.stats.get("skipped", [])
    if "s" not in terminalreporter.reportchars or not skipped:
        return
    terminalreporter.reportchars = terminalreporter.reportchars.replace("s", "")
    by_reason: dict[str, list[str]] = {}
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
        reason = str(reason).removeprefix("Skipped: ")
        by_reason.setdefault(reason, []).append(report.nodeid.split("::", 1)[0])
    terminalreporter.section(f"skips by reason ({len(skipped)} tests, {len(by_reason)} reasons)")
    for reason, files in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        where = len(set(files))
        places = files[0] if where == 1 else f"{where} files"
        terminalreporter.line(f"SKIPPED {len(files):>4} ({places}): {reason}")


TORCH_REASON = _missing("torch")
JAX_REASON = _missing("jax")
TRITON_REASON = _missing("triton")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason=f"no usable CUDA GPU: {CUDA_REASON}")
    for item in items:
        if "gpu" in item.keywords and CUDA_REASON is not None:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("xdist_group") is not None:
            raise pytest.UsageError(
                f"{item.nodeid}: an xdist_group mark groups nothing with pytest 9.2 or later; "
                "name the module in ONE_WORKER (tests/conftest.py) instead"
            )


# Modules whose tests share one xdist worker under `--dist loadgroup` (the README's test
# command), by file name: each has a module fixture that builds or runs something for minutes
# (the wheel, the JAX bench run), made once rather than once per worker. The scheduler below
# groups them from the node id's file name alone. xdist's own `xdist_group` mark works by
# rewriting each test's node id on the worker, which pytest 9.2's structured node ids ignore:
# the marked tests then spread over every worker without a word.
# tests/test_xdist_groups.py runs a grouped module on two workers and fails if it is split.
ONE_WORKER = {"test_packaging.py": "packaging", "test_bench_jax.py": "bench_jax"}


def one_worker_group(nodeid: str) -> str | None:
    """The ONE_WORKER group of the test ``nodeid`` names, or None."""
    return ONE_WORKER.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may not be installed
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``, xdist's group scheduler with each ONE_WORKER module as one
    unit of work; every other test is its own unit, as before."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = one_worker_group(nodeid)
            return f"one worker: {group}" if group else super()._split_scope(nodeid)

    return OneWorkerScheduling(config, log)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """A device string with a working VMM driver."""
    return request.param


@pytest.fixture(params=["torch", "jax"])
def framework(request) -> str:
    """A consumer framework that is installed."""
    reason = TORCH_REASON if request.param == "torch" else JAX_REASON
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def cuda_device() -> str:
    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    return "cuda:0"


def row_writes_model(array, rows, starts, values_list):
    """``array`` with row writes applied one after another (later writes win); what falls
    outside it is dropped. The numpy model the staged-write tests check against."""
    import numpy as np

    out = np.array(array)
    for row, start, values in zip(rows, starts, values_list):
        if row < out.shape[0] and start < out.shape[1]:
            span = values[: out.shape[1] - start]
            out[row, start : start + len(span)] = span
    return out


@pytest.fixture
def gpu_triton():
    """A JAX GPU backend with a working jax_triton, or a skip saying which is missing."""
    if CUDA_REASON is not None:
        pytest.skip(f"no usable CUDA GPU: {CUDA_REASON}")
    if JAX_REASON is not None:
        pytest.skip(JAX_REASON)
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (default backend {jax.default_backend()})")
    from jaxbuf.staged import _jax_triton as jax_triton_apply

    reason = jax_triton_apply.jax_triton_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
