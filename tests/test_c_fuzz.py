"""Random raw arguments for the C entry points: the stager and packer (``jaxbuf._staging``:
``Stager(...)``, ``stage``, ``stage_many``, ``stage_columns``, ``resolve``,
``write_columns``, ``reset``, ``close``, ``pack``, ``clear``, ``expand_elements``) and the
capsule module (``new_capsule``, ``anchor_for``, ``anchor_of``, ``ExportAnchor``).

Malformed arrays (wrong dtype, rank, byte order, strides, read-only), negative and huge sizes,
None, wrong arity, uninitialized stagers, and a stager's own buffers edited behind its back
(the Python paths append to them). The invariant: every call returns or raises a Python
exception of an expected type; none crashes. The calls run in a child process
(tests/_c_fuzz_worker.py), so a crash fails the example with its signal, shrunk.

Under tools/sanitize.sh the same calls run with AddressSanitizer and UBSan, which turn an
out-of-bounds read or an overflow into a crash. ``JAXBUF_C_FUZZ_EXAMPLES`` raises the count.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _child import Worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("jaxbuf._staging", reason="the C stager is not built")

WORKER = Path(__file__).with_name("_c_fuzz_worker.py")
EXAMPLES = int(os.environ.get("JAXBUF_C_FUZZ_EXAMPLES", "150"))
RECORD_BYTES = 40

huge_ints = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 2**64, 2**100])
ints = st.integers(-3, 12) | huge_ints
int_recipe = st.builds(lambda v: ("int", v), ints)
scalar_recipe = st.one_of(
    int_recipe,
    st.just(("none",)),
    st.builds(lambda v: ("float", v), st.floats(allow_nan=True, width=32)),
    st.builds(lambda v: ("bool", v), st.booleans()),
    st.just(("object",)),
    st.builds(lambda v: ("str", v), st.sampled_from(["", "i", "q", "f", "e", "<i", "x" * 20])),
)
array_recipe = st.builds(
    lambda dtype, shape, layout, values: ("array", dtype, shape, layout, values),
    st.sampled_from(["int32", "int64", "float32", "float16", "uint8", "float64", "bool", ">i4"]),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.sampled_from(["contiguous", "strided", "fortran", "readonly"]),
    st.lists(st.integers(-(2**33), 2**33), max_size=8),
)
bytes_recipe = st.builds(lambda b: ("bytes", b), st.binary(max_size=96))
buffer_recipe = st.one_of(
    st.builds(lambda b: ("bytearray", b), st.binary(max_size=96)),
    st.builds(lambda i: ("buffer", i), st.integers(0, 3)),
)
value_recipe = st.one_of(
    scalar_recipe,
    array_recipe,
    bytes_recipe,
    buffer_recipe,
    st.builds(lambda a: ("memoryview", a), array_recipe),
)
stager_recipe = st.one_of(
    st.builds(lambda i: ("stager", i), st.integers(0, 3)), st.just(("raw_stager",))
)
any_recipe = st.one_of(value_recipe, stager_recipe)
sequence_recipe = st.one_of(
    st.builds(lambda items: ("list", items), st.lists(value_recipe, max_size=4)),
    st.builds(lambda items: ("tuple", items), st.lists(value_recipe, max_size=4)),
)


def _stager_args():
    """Stager(records, contents, num_rows, row_len, format, itemsize), mostly well formed."""
    good = st.tuples(
        buffer_recipe,
        buffer_recipe,
        st.builds(lambda v: ("int", v), st.integers(0, 6) | huge_ints),
        st.builds(lambda v: ("int", v), st.integers(0, 9) | huge_ints),
        st.sampled_from([("str", "i"), ("str", "q"), ("str", "e"), ("str", "f"), ("str", "")]),
        st.builds(lambda v: ("int", v), st.sampled_from([4, 8, 2, 1, 0, -1, 3, 2**62])),
    ).map(list)
    return good | st.lists(any_recipe, max_size=7)


def _record(row, start, length):
    return (0).to_bytes(8, "little", signed=True) + b"".join(
        v.to_bytes(8, "little", signed=True) for v in (row, start, 0, length)
    )


records_bytes = st.lists(
    st.builds(
        _record,
        st.integers(-2, 6),
        st.integers(-2, 9),
        st.integers(-2, 9) | huge_ints.filter(lambda v: -(2**63) <= v < 2**63),
    ),
    max_size=3,
).map(b"".join)

call = st.one_of(
    st.tuples(st.just("Stager"), _stager_args()),
    st.tuples(st.just("Stager.__init__"), _stager_args()),
    st.tuples(
        st.just("stager.stage"),
        st.tuples(stager_recipe, int_recipe, int_recipe, value_recipe).map(list)
        | st.lists(any_recipe, min_size=1, max_size=5).map(lambda a: [("stager", 0), *a]),
    ),
    st.tuples(
        st.just("stager.stage_many"),
        st.tuples(stager_recipe, sequence_recipe, sequence_recipe, sequence_recipe).map(list),
    ),
    st.tuples(
        st.just("stager.stage_columns"),
        st.tuples(stager_recipe, array_recipe, array_recipe, array_recipe, value_recipe).map(list),
    ),
    st.tuples(st.just("stager.resolve"), st.tuples(stager_recipe).map(list)),
    st.tuples(st.just("stager.reset"), st.tuples(stager_recipe).map(list)),
    st.tuples(st.just("stager.close"), st.tuples(stager_recipe).map(list)),
    st.tuples(
        st.just("stager.write_columns"),
        st.tuples(stager_recipe, *[array_recipe] * 4, value_recipe).map(list),
    ),
    st.tuples(
        st.just("buffer.extend"),
        st.tuples(
            st.builds(lambda i: ("buffer", i), st.integers(0, 3)),
            st.one_of(bytes_recipe, records_bytes.map(lambda b: ("bytes", b))),
        ).map(list),
    ),
    st.tuples(
        st.just("buffer.truncate"),
        st.tuples(st.builds(lambda i: ("buffer", i), st.integers(0, 3)), int_recipe).map(list),
    ),
    st.tuples(
        st.just("pack"),
        st.tuples(
            st.builds(lambda items: ("list", items), st.lists(stager_recipe, max_size=3))
            | any_recipe,
            bytes_recipe | buffer_recipe | array_recipe,
            int_recipe,
        ).map(list),
    ),
    st.tuples(st.just("pack_raw"), st.lists(scalar_recipe, max_size=5)),
    st.tuples(
        st.just("clear"),
        st.lists(
            st.builds(lambda items: ("list", items), st.lists(stager_recipe, max_size=3))
            | any_recipe,
            max_size=2,
        ),
    ),
    st.tuples(st.just("expand_elements"), st.lists(array_recipe | value_recipe, max_size=7)),
    st.tuples(st.just("new_capsule"), st.lists(any_recipe, max_size=6)),
    st.tuples(
        st.just("new_capsule_payload"),
        st.tuples(
            st.builds(lambda v: ("bool", v), st.booleans()),
            st.builds(lambda v: ("int", v), st.integers(0, 4)),
            st.sampled_from([("none",), ("anchor", ("object",)), ("object",)]),
        ).map(list),
    ),
    st.tuples(
        st.just("anchor_for"),
        st.lists(
            st.sampled_from(
                [("none",), ("object",), ("owner", "raises"), ("owner", "none"), ("owner", "int")]
                + [("owner", "freed"), ("owner", "plain"), ("anchor", ("object",))]
            ),
            max_size=2,
        ),
    ),
    st.tuples(st.just("anchor_of"), st.lists(any_recipe, max_size=2)),
    st.tuples(st.just("ExportAnchor"), st.lists(any_recipe, max_size=2)),
)

# Every example starts with one well-formed stager, so the calls reach past argument parsing.
WELL_FORMED = (
    "Stager",
    [("bytearray", b""), ("bytearray", b""), ("int", 4), ("int", 8), ("str", "i"), ("int", 4)],
)


@pytest.fixture(scope="module")
def worker():
    worker = Worker(WORKER, 60.0)
    yield worker
    worker.close()


def test_raw_arguments_never_crash(worker):
    outcomes = {"ok": 0, "raised": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(calls=st.lists(call, min_size=1, max_size=12))
    def run(calls):
        worker.ensure()
        calls = [WELL_FORMED, *calls]
        reply = worker.call("run", calls=calls)
        for (target, args), outcome in zip(calls, reply[1]):
            if outcome[0] == "undocumented":
                raise AssertionError(f"{target}{args} raised an unexpected type:\n{outcome[1]}")
            outcomes[outcome[0]] += 1

    run()
    # The fuzz reached past argument checks: some calls succeeded, some were refused.
    assert outcomes["ok"] > EXAMPLES and outcomes["raised"] > EXAMPLES // 10, outcomes


def test_bad_records_raise_instead_of_reading_past_the_contents(worker):
    """A record out of the stager's bounds, or records that cover more values than the
    contents hold (both buffers are Python's too), raise ValueError at resolve."""
    worker.ensure()
    good = WELL_FORMED
    out_of_bounds = [
        good,
        ("buffer.extend", [("buffer", 0), ("bytes", _record(1, 0, 2**40))]),
        ("stager.resolve", [("stager", 0)]),
        (
            "stager.write_columns",
            [("stager", 0)] + [("array", "int32", (8,), "contiguous", [])] * 5,
        ),
    ]
    reply = worker.call("run", calls=out_of_bounds)[1]
    assert reply[0][0] == "ok"
    assert reply[2][0] == "raised" and reply[2][1] == "ValueError", reply[2]
    assert "out of bounds" in reply[2][2]
    assert reply[3][0] == "raised", reply[3]
    more_records_than_contents = [
        good,
        ("buffer.extend", [("buffer", 0), ("bytes", _record(1, 0, 4))]),
        ("stager.resolve", [("stager", 0)]),
    ]
    reply = worker.call("run", calls=more_records_than_contents)[1]
    assert reply[2][:2] == ("raised", "ValueError") and "contents hold 0 bytes" in reply[2][2]
    uninitialized = [
        good,
        ("stager.resolve", [("raw_stager",)]),
        ("clear", [("list", [("raw_stager",)])]),
    ]
    reply = worker.call("run", calls=uninitialized)[1]
    assert reply[1][:2] == ("raised", "TypeError") and "not initialized" in reply[1][2]
    assert reply[2][:2] == ("raised", "TypeError")


# A consumer's managed tensor as a C caller may fill it: every field random, consistent or not.
exchange_tensor = st.fixed_dictionaries(
    {
        "version": st.tuples(st.sampled_from([1, 1, 1, 0, 2, 2**32 - 1]), st.integers(0, 5)),
        "flags": st.sampled_from([0, 1, 2, 3, 4, 2**63]),
        "deleter": st.booleans(),
        "data": st.booleans(),
        "ndim": st.sampled_from([0, 1, 2, 3, 4, -1, 64, 65, 2**31 - 1]),
        "shape_set": st.booleans(),
        "shape": st.lists(
            st.sampled_from([0, 1, 2, 3, 4, -1, -(2**63), 2**62, 2**63 - 1]), max_size=4
        ),
        "strides_set": st.booleans(),
        "strides": st.lists(st.sampled_from([0, 1, 2, 4, -1, 2**63 - 1]), max_size=4),
        "byte_offset": st.sampled_from([0, 4, 64, 2**64 - 16]),
        "device": st.tuples(st.sampled_from([1, 2, 13, 16, 0]), st.sampled_from([0, 1, -1])),
        "dtype": st.tuples(
            st.integers(0, 6), st.sampled_from([0, 1, 8, 16, 32, 64]), st.sampled_from([1, 0, 2])
        ),
    }
)


def test_the_exchange_api_takes_any_consumer_tensor(worker):
    """``managed_tensor_to_py_object_no_sync`` with random, often inconsistent consumer
    tensors (NULL data, shape or strides, bad versions, ranks, extents, offsets, flags, no
    deleter): each is imported or refused with a documented error, never crashes, never
    gives a view at address 0 over bytes, and its deleter runs exactly once, with no
    exception pending."""
    outcomes = {"ok": 0, "raised": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(tensors=st.lists(exchange_tensor, min_size=1, max_size=8))
    def run(tensors):
        worker.ensure()
        for tensor, outcome in zip(tensors, worker.call("exchange", tensors=tensors)[1]):
            if outcome[0] == "undocumented":
                raise AssertionError(f"{tensor}:\n{outcome[1]}")
            outcomes[outcome[0]] += 1

    run()
    # Random fields are rarely all consistent (none may be, at some example counts): one
    # consistent tensor is imported every time, so "ok" is reached whatever was drawn.
    consistent = {
        "version": (1, 3),
        "flags": 0,
        "deleter": True,
        "data": True,
        "ndim": 1,
        "shape_set": True,
        "shape": [4],
        "strides_set": False,
        "strides": [],
        "byte_offset": 0,
        "device": (1, 0),
        "dtype": (1, 8, 1),
    }
    worker.ensure()
    outcome = worker.call("exchange", tensors=[consistent])[1][0]
    assert outcome[0] == "ok", outcome
    assert outcomes["raised"], outcomes
