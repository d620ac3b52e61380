"""A model-based test of the public API: hypothesis drives ExtensibleTensor, UVA pools, staged
writes (``StagedWriteTensor`` and JAX's ``StagedWrites`` / ``PackRing``) and driver faults at
any call, and a pure-numpy model of bytes and live handles is the oracle.

Invariants checked after every step (by the worker, tests/_stateful_worker.py):

* no signal: each step runs in a persistent child process; a step that kills it fails the
  example with the signal's name, hypothesis shrinks it, and the next example starts a fresh
  child;
* every exception is a documented type (ValueError, TypeError, IndexError, BufferError,
  RuntimeError and its DriverError), with a message, naming the argument for bad input;
* after an exception the object is as the model says (unchanged) and usable;
* every live export reads what the model says, full views too (zeros beyond the committed
  bytes: a copy holds them, the CPU reservation reads them);
* a release that fails in a deleter or finalizer (faults armed in the drops and collections)
  never raises or goes unraisable: it is reported once as retried, never as a leak;
* a NonUvaBuffer whose ``np`` was rebound copies exactly what it holds, or refuses clearly;
* free() racing an export on another thread ends in ClosedError or success;
* a KeyboardInterrupt at an unmap, release or free_reserved of ``release_physical`` or of
  ``defragment``'s cleanup, or at an acquisition of its swap (reserve, create, map, a move),
  raised by the call or as it returned, leaves the tensor as a failed release, a rolled-back
  or a completed defragment would, and the driver's invariants hold;
* a KeyboardInterrupt at any driver call of any step is the failure of that one call: the
  model treats it as a DriverError there, and an interrupted free() or close() finishes on
  the next call (which must succeed);
* the timer signal (``SIGALRM``, its handler raising KeyboardInterrupt) interrupts a grow,
  release, defragment, free, copy or export of a tensor, a pool's copy or close, a staged
  apply or free, a UvaBuffer's construction, export or free at a random instant: the sizes
  are the op's before or after, committed bytes are kept, exports keep their memory, the
  object stays usable or closes on the next call (see ``_Timer`` in the worker for where
  the signal may land, and the one window CPython leaves to no code);
* a UvaBuffer's free(), an ImportedBuffer's close() or a tensor's free() racing a second
  thread's exports (zero-copy, ``np.from_dlpack(copy=True)``, ``__dlpack__(copy=True)``)
  ends in ClosedError or arrays that read the owner's bytes, never a signal;
* a mapping listener calling back into its buffer (release, grow, defragment, free, attach)
  is refused by name, and the change it was told of completes as without it;
* under an address-space limit the CPU driver's quarantine never makes a reservation fail
  (ENOMEM) and holds at most a quarter of the limit;
* the fault-injecting driver's VMM rules hold, and once every reference of an example is
  gone (and ``gc.collect()`` ran, and the driver was used once if a release was queued for
  a retry) it holds no handle, reservation, mapping or pinned memory.

Bounded: the default run takes well under a minute on a 2-core machine, with a fixed seed
and one random seed (printed, in the test id; ``JAXBUF_STATEFUL_SEED`` replays one).
``JAXBUF_STATEFUL_EXAMPLES`` raises the number of examples (the sanitizer job, the GPU
machine).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from _child import Worker
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    rule,
    run_state_machine_as_test,
)

from jaxbuf.testing import FAULT_KINDS

WORKER = Path(__file__).with_name("_stateful_worker.py")
EXAMPLES = int(os.environ.get("JAXBUF_STATEFUL_EXAMPLES", "8"))
STEPS = int(os.environ.get("JAXBUF_STATEFUL_STEPS", "30"))
FIXED_SEED = 20261201
# One random seed per pytest session: tests/conftest.py draws it in the controlling process and
# exports it, so every xdist worker collects the same tests and runs the same seed.
RANDOM_SEED = int(os.environ.get("JAXBUF_STATEFUL_SEED") or random.SystemRandom().randrange(2**32))
# A step that takes longer is a hang: the worker is killed and the example fails.
STEP_TIMEOUT_S = float(os.environ.get("JAXBUF_STATEFUL_STEP_TIMEOUT", "120"))

# A file each step and its reply are appended to (to see what the runs exercise).
STEP_LOG = os.environ.get("JAXBUF_STATEFUL_LOG")

MIB = 1 << 20
# Faults at any call a step may make, armed for the step that draws them only; in drop_export
# and collect they hit the releases deferred to deleters and finalizers.
# The calls that change state, most often; the others (events, launches) now and then.
STATEFUL_KINDS = ("reserve", "free_reserved", "create", "release", "map", "unmap", "set_access")
STATEFUL_KINDS += ("move_mapping", "memset", "copy", "synchronize", "host_alloc", "host_free")
OTHER_KINDS = tuple(k for k in FAULT_KINDS if k not in STATEFUL_KINDS)
faults = (
    st.none()
    | st.tuples(st.sampled_from(STATEFUL_KINDS), st.integers(1, 3))
    | st.tuples(st.sampled_from(OTHER_KINDS), st.integers(1, 2))
)
# A Ctrl-C (KeyboardInterrupt, or any exception a signal handler raises) at any driver call of
# a step: the failure of that one call, as a DriverError there would be, except that code
# catching Exception does not catch it.
faults |= st.tuples(st.sampled_from(FAULT_KINDS), st.integers(1, 3), st.just("interrupt"))
# The timer signal's delay: within a step's driver calls and Python, or past its end.
delays_us = st.integers(1, 400) | st.integers(400, 5000)
# A Ctrl-C (KeyboardInterrupt) at a call of a release or an acquisition: release_physical's
# unmaps and releases, defragment's swap (reserve, create, map, moves: rolled back, the bytes
# kept) and its cleanup after the swap; raised by the call (it failed) or as it returned
# ("after": the call done, the interrupt held back until the library recorded it).
interrupts = st.tuples(
    st.sampled_from(
        ("unmap", "release", "free_reserved", "reserve", "create", "map", "move_mapping")
    ),
    st.integers(1, 2),
    st.sampled_from(["interrupt", "after"]),
)
# The calls a release makes: drops and collections, which run the deferred releases of deleters
# and finalizers, arm these most.
RELEASE_KINDS = ("synchronize", "unmap", "release", "free_reserved", "host_free", "destroy_event")
release_faults = st.tuples(st.sampled_from(RELEASE_KINDS), st.integers(1, 2)) | faults
capacities = st.lists(
    st.sampled_from([4096, 100_000, 2 * MIB, 3 * MIB + 256, 5 * MIB]), min_size=1, max_size=3
)
sizes = st.sampled_from([0, 1, 255, 4096, 100_000, 2 * MIB, 2 * MIB + 1, 3 * MIB, 6 * MIB]) | (
    st.integers(-2, 6 * MIB)
)
DTYPES = ("uint8", "int8", "int16", "int32", "float32", "float16", "bfloat16", "int64")
STAGE_DTYPES = ("int32", "float32", "float16")
# Malformed layouts a peer may send (tests/_stateful_worker.py builds them).
HOSTILE = ("misaligned", "overlap", "outside", "huge", "missing", "wrong_type")
HOSTILE += ("committed_unbacked", "extra_fd")
# JAX compiles one apply per shape and dtype: a few shapes keep the run bounded. They are
# small for a second reason: a StagedWriteTensor's own writer sizes its first staging slot for
# num_rows writes (the invariant "a slot grows with the writes staged, not the rows" is being
# fixed); lift that with a (2**20, 1) shape.
STAGE_SHAPES = ((4, 8), (3, 5), (1, 1))


def make_machine(worker: Worker, framework: str):
    """The state machine class for one worker (a device) and one framework."""

    class PublicApi(RuleBasedStateMachine):
        tensors = Bundle("tensors")
        pools = Bundle("pools")
        swts = Bundle("swts")
        staged = Bundle("staged")
        nonuvas = Bundle("nonuvas")

        def __init__(self) -> None:
            super().__init__()
            worker.ensure()
            self.next_id = 0

        def create(self, op: str, **kwargs):
            """Run a creating step; its id joins the bundle when it made an object."""
            self.next_id += 1
            reply = self.step(op, slot=self.next_id, **kwargs)
            return self.next_id if reply[0] == "ok" else multiple()

        def step(self, op: str, **kwargs):
            reply = worker.call(op, **kwargs)
            if STEP_LOG:
                with open(STEP_LOG, "a") as log:
                    log.write(f"{op}({kwargs}) -> {reply}\n")
            if reply[0] == "violation":
                raise AssertionError(f"{op}({kwargs}): {reply[1]}")
            return reply

        def teardown(self) -> None:
            if not worker.alive:
                return  # died: the failing step already said so; the next example respawns
            reply = worker.call("reset")
            if reply[0] != "ok":
                raise AssertionError(f"at the end of the example: {reply[1]}")

        @initialize(target=tensors, capacities=capacities)
        def start_with_a_tensor(self, capacities):
            return self.create("et_create", capacities=capacities)

        # -- ExtensibleTensor --------------------------------------------------------------
        @rule(target=tensors, capacities=capacities, fault=faults)
        def et_create(self, capacities, fault):
            return self.create("et_create", capacities=capacities, fault=fault)

        @rule(
            slot=tensors,
            sizes=st.lists(sizes, min_size=1, max_size=3),
            zero_new=st.booleans(),
            per_segment=st.booleans(),
            fault=faults,
        )
        def et_grow(self, slot, sizes, zero_new, per_segment, fault):
            self.step(
                "et_grow",
                slot=slot,
                sizes=sizes,
                zero_new=zero_new,
                per_segment=per_segment,
                fault=fault,
            )

        @rule(
            slot=tensors,
            segment=st.integers(0, 2),
            offset=st.integers(0, 6 * MIB),
            data=st.binary(min_size=1, max_size=64),
        )
        def et_write(self, slot, segment, offset, data):
            self.step("et_write", slot=slot, segment=segment, offset=offset, data=data)

        @rule(
            slot=tensors,
            segment=st.integers(0, 2),
            kind=st.sampled_from(["numpy", framework]),
            dtype=st.sampled_from(DTYPES),
            shape_kind=st.sampled_from(["1d", "2d", "prefix"]),
            copy=st.booleans(),
            dl_device=st.booleans(),
        )
        def et_export(self, slot, segment, kind, dtype, shape_kind, copy, dl_device):
            self.step(
                "et_export",
                slot=slot,
                segment=segment,
                kind=kind,
                dtype=dtype,
                shape_kind=shape_kind,
                copy=copy and kind == "numpy",
                dl_device=dl_device,
            )

        @rule(
            slot=tensors,
            kind=st.sampled_from(["numpy", framework]),
            copy=st.booleans(),
        )
        def et_export_full(self, slot, kind, copy):
            self.step("et_export_full", slot=slot, kind=kind, copy=copy and kind != "jax")

        @rule(
            slot=tensors,
            segment=st.integers(0, 2),
            kind=st.sampled_from(["numpy", framework]),
            fault=faults,
        )
        def et_free_racing(self, slot, segment, kind, fault):
            self.step("et_free_racing", slot=slot, segment=segment, kind=kind, fault=fault)

        @rule(slot=tensors, fault=faults | interrupts)
        def et_release_physical(self, slot, fault):
            self.step("et_release_physical", slot=slot, fault=fault)

        @rule(slot=tensors, fault=faults | interrupts)
        def et_defragment(self, slot, fault):
            self.step("et_defragment", slot=slot, fault=fault)

        @rule(slot=tensors, fault=faults)
        def et_free(self, slot, fault):
            self.step("et_free", slot=slot, fault=fault)

        @rule(slot=consumes(tensors), fault=release_faults)
        def et_drop(self, slot, fault):
            self.step("et_drop", slot=slot, fault=fault)

        @rule(index=st.integers(0, 7), fault=release_faults)
        def drop_export(self, index, fault):
            self.step("drop_export", index=index, fault=fault)

        @rule(fault=release_faults)
        def collect(self, fault):
            self.step("collect", fault=fault)

        # -- interrupts at random instants, threads, re-entrant listeners --------------------
        @rule(
            slot=tensors,
            action=st.sampled_from(
                ["grow", "release_physical", "defragment", "free", "copy", "export"]
            ),
            delay_us=delays_us,
            fraction=st.sampled_from([0.0, 0.25, 1.0]),
            zero_new=st.booleans(),
            then_free=st.booleans(),
        )
        def et_timer(self, slot, action, delay_us, fraction, zero_new, then_free):
            self.step(
                "et_timer",
                slot=slot,
                action=action,
                delay_us=delay_us,
                fraction=fraction,
                zero_new=zero_new,
                then_free=then_free,
            )

        @rule(
            owner=st.sampled_from(["uva", "import", "et"]),
            how=st.sampled_from(
                ["numpy", framework, "np_copy"] + (["dlpack_copy"] if framework == "torch" else [])
            ),
            size_kib=st.sampled_from([4, 1024, 8192]),
        )
        def close_racing(self, owner, how, size_kib):
            self.step("close_racing", owner=owner, how=how, size_kib=size_kib)

        @rule(
            slot=tensors,
            call=st.sampled_from(["release_physical", "grow", "defragment", "free", "attach"]),
            trigger=st.sampled_from(["attach", "grow", "release_physical", "defragment"]),
            fraction=st.sampled_from([0.25, 1.0]),
        )
        def et_listener(self, slot, call, trigger, fraction):
            self.step("et_listener", slot=slot, call=call, trigger=trigger, fraction=fraction)

        @rule(
            action=st.sampled_from(["create", "export", "free"]),
            delay_us=delays_us,
            rows=st.integers(1, 64),
        )
        def uva_timer(self, action, delay_us, rows):
            self.step("uva_timer", action=action, delay_us=delay_us, rows=rows)

        # -- the CPU driver's quarantine under an address-space limit ------------------------
        @rule(
            size_mib=st.sampled_from([64, 1024, 3072]),
            count=st.integers(1, 12),
            headroom_mib=st.sampled_from([16, 512, 4096]),
            fault=faults,
        )
        def quarantine_cycle(self, size_mib, count, headroom_mib, fault):
            self.step(
                "quarantine_cycle",
                size_mib=size_mib,
                count=count,
                headroom_mib=headroom_mib,
                fault=fault,
            )

        # -- sharing with a second process ---------------------------------------------------
        @rule(slot=tensors, since=st.booleans())
        def share_send(self, slot, since):
            self.step("share_send", slot=slot, since=since)

        @rule(mutation=st.sampled_from(HOSTILE))
        def share_hostile(self, mutation):
            self.step("share_hostile", mutation=mutation)

        @rule()
        def share_read(self):
            self.step("share_read")

        @rule(
            segment=st.integers(0, 2),
            offset=st.integers(0, 6 * MIB),
            data=st.binary(min_size=1, max_size=64),
        )
        def share_write(self, segment, offset, data):
            self.step("share_write", segment=segment, offset=offset, data=data)

        @rule()
        def share_close(self):
            self.step("share_close")

        # -- UVA pools -----------------------------------------------------------------------
        @rule(
            target=pools,
            rows=st.integers(1, 4),
            cols=st.integers(1, 3),
            dtype=st.sampled_from(["int32", "float32", "int64"]),
            max_concurrency=st.integers(1, 3),
            uva=st.booleans(),
            framework_kind=st.sampled_from(["view", "fw"]),
        )
        def pool_create(self, rows, cols, dtype, max_concurrency, uva, framework_kind):
            return self.create(
                "pool_create",
                rows=rows,
                cols=cols,
                dtype=dtype,
                max_concurrency=max_concurrency,
                uva=uva,
                framework=framework_kind,
            )

        @rule(
            slot=pools,
            rows=st.integers(1, 9),
            seed=st.integers(0, 2**16),
            as_kind=st.sampled_from(["numpy", "list"]),
            fault=faults,
        )
        def pool_copy(self, slot, rows, seed, as_kind, fault):
            self.step("pool_copy", slot=slot, rows=rows, seed=seed, as_kind=as_kind, fault=fault)

        @rule(slot=pools, fault=faults)
        def pool_close(self, slot, fault):
            self.step("pool_close", slot=slot, fault=fault)

        @rule(
            slot=pools,
            action=st.sampled_from(["copy", "close"]),
            delay_us=delays_us,
            rows=st.integers(1, 9),
            seed=st.integers(0, 2**16),
        )
        def pool_timer(self, slot, action, delay_us, rows, seed):
            self.step(
                "pool_timer", slot=slot, action=action, delay_us=delay_us, rows=rows, seed=seed
            )

        @rule(slot=consumes(pools), fault=release_faults)
        def pool_drop(self, slot, fault):
            self.step("pool_drop", slot=slot, fault=fault)

        # -- NonUvaBuffer ---------------------------------------------------------------------
        @rule(
            target=nonuvas,
            rows=st.integers(1, 4),
            cols=st.integers(1, 3),
            dtype=st.sampled_from(["int32", "float32", "int64"]),
            fault=faults,
        )
        def nonuva_create(self, rows, cols, dtype, fault):
            return self.create("nonuva_create", rows=rows, cols=cols, dtype=dtype, fault=fault)

        @rule(
            slot=nonuvas,
            how=st.sampled_from(
                ["in_place", "same", "smaller", "larger", "dtype", "itemsize", "strided", "list"]
            ),
            seed=st.integers(0, 2**16),
        )
        def nonuva_rebind(self, slot, how, seed):
            self.step("nonuva_rebind", slot=slot, how=how, seed=seed)

        @rule(slot=nonuvas, n=st.integers(-1, 5), fault=faults)
        def nonuva_uva(self, slot, n, fault):
            self.step("nonuva_uva", slot=slot, n=n, fault=fault)

        @rule(slot=consumes(nonuvas), fault=release_faults)
        def nonuva_drop(self, slot, fault):
            self.step("nonuva_drop", slot=slot, fault=fault)

        # -- StagedWriteTensor ---------------------------------------------------------------
        @rule(
            target=swts,
            shape=st.sampled_from(STAGE_SHAPES),
            dtype=st.sampled_from(STAGE_DTYPES),
            uva=st.booleans(),
            fault=faults,
        )
        def swt_create(self, shape, dtype, uva, fault):
            rows, cols = shape
            return self.create(
                "swt_create", rows=rows, cols=cols, dtype=dtype, uva=uva, fault=fault
            )

        @rule(
            slot=swts,
            row=st.integers(-1, 4),
            start=st.integers(-1, 8),
            values=st.lists(st.integers(-1000, 1000), max_size=9),
            elem=st.booleans(),
            as_kind=st.sampled_from(["numpy", "list"]),
        )
        def swt_stage(self, slot, row, start, values, elem, as_kind):
            self.step(
                "swt_stage",
                slot=slot,
                row=row,
                start=start,
                values=values,
                elem=elem,
                as_kind=as_kind,
            )

        @rule(slot=swts, fault=faults)
        def swt_apply(self, slot, fault):
            self.step("swt_apply", slot=slot, fault=fault)

        @rule(slot=swts)
        def swt_clear(self, slot):
            self.step("swt_clear", slot=slot)

        @rule(slot=swts, fault=faults)
        def swt_free(self, slot, fault):
            self.step("swt_free", slot=slot, fault=fault)

        @rule(slot=swts, action=st.sampled_from(["apply", "free"]), delay_us=delays_us)
        def swt_timer(self, slot, action, delay_us):
            self.step("swt_timer", slot=slot, action=action, delay_us=delay_us)

        @rule(slot=consumes(swts), fault=release_faults)
        def swt_drop(self, slot, fault):
            self.step("swt_drop", slot=slot, fault=fault)

    if framework == "jax":

        class PublicApiWithJax(PublicApi):
            # -- JAX StagedWrites and PackRing ---------------------------------------------
            @rule(
                target=PublicApi.staged,
                shape=st.sampled_from(STAGE_SHAPES),
                dtype=st.sampled_from(STAGE_DTYPES),
            )
            def sw_create(self, shape, dtype):
                return self.create("sw_create", rows=shape[0], cols=shape[1], dtype=dtype)

            @rule(
                slot=PublicApi.staged,
                writes=st.lists(
                    st.tuples(
                        st.integers(-1, 4),
                        st.integers(-1, 8),
                        st.lists(st.integers(-1000, 1000), max_size=9),
                    ),
                    max_size=5,
                ),
                batch=st.booleans(),
            )
            def sw_stage(self, slot, writes, batch):
                self.step("sw_stage", slot=slot, writes=writes, batch=batch)

            @rule(
                slot=PublicApi.staged,
                how=st.sampled_from(["ring", "function"]),
                bad_table=st.booleans(),
                fault=faults,
            )
            def sw_apply(self, slot, how, bad_table, fault):
                self.step("sw_apply", slot=slot, how=how, bad_table=bad_table, fault=fault)

            @rule()
            def ring_close(self):
                self.step("ring_close")

        return PublicApiWithJax
    return PublicApi


_WORKERS: dict[tuple[str, str], Worker] = {}


@pytest.fixture(scope="module")
def workers():
    yield _WORKERS
    for worker in _WORKERS.values():
        worker.close()
    _WORKERS.clear()


# Ids name the kind of seed, not its value: xdist requires every worker to collect the same ids.
@pytest.mark.parametrize("run_seed", [FIXED_SEED, RANDOM_SEED], ids=["fixed-seed", "random-seed"])
def test_public_api_against_the_model(device, framework, run_seed, workers):
    if device == "cpu" and framework == "torch" and run_seed == RANDOM_SEED:
        print(f"random seed: {RANDOM_SEED} (JAXBUF_STATEFUL_SEED={RANDOM_SEED} replays it)")
    worker = workers.get((device, framework))
    if worker is None:
        worker = workers[(device, framework)] = Worker(
            WORKER, STEP_TIMEOUT_S, device=device, framework=framework
        )
    machine = seed(run_seed)(make_machine(worker, framework))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
