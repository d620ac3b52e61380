"""``ExtensibleKVCacheBuffers`` as rules over a numpy model (hypothesis stateful testing):
random sequences of commit / ensure_blocks / extend / release_physical / recommit /
defragmenting commits, block writes and bad counts, on the CPU driver; after every step the
committed count, every committed block's bytes and the physical memory agree with the model.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jaxbuf
from jaxbuf import ExtensibleKVCacheBuilder

CAPACITY = 12
GRANULE = jaxbuf.granule_size("cpu")
# Two tensors: blocks outermost (one segment, blocks of a quarter granule) and layer-compact
# (two layers, blocks of half a granule per segment, segments granule multiples).
TENSORS = ((CAPACITY * GRANULE // 4, 1), (CAPACITY * GRANULE, 2))


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        builder = ExtensibleKVCacheBuilder(CAPACITY, "cpu")
        for size, segments in TENSORS:
            builder.reserve(size, segments)
        self.kv = builder.finish()
        self.committed = 1
        self.to_recommit = 0
        self.marks = np.zeros(CAPACITY, np.uint8)  # the byte each block starts and ends with

    def teardown(self) -> None:
        self.kv.free()

    # -- the model's transitions ------------------------------------------------------------
    def _grow(self, n: int, discard: bool = False) -> None:
        if n > self.committed:
            if discard:
                self.marks[:] = 0
            self.marks[self.committed : n] = 0
            self.committed = n

    @rule(n=st.integers(0, CAPACITY))
    def commit(self, n):
        self.kv.commit(n)
        self._grow(n)

    @rule(n=st.integers(0, CAPACITY))
    def commit_defragment(self, n):
        self.kv.commit(n, defragment=True)
        if n > self.committed:
            for tensor in self.kv.tensors:
                assert all(tensor.segments_backed_by_one_chunk(tensor.committed_sizes))
        self._grow(n, discard=True)

    @rule(n=st.integers(0, 3 * CAPACITY))
    def ensure_blocks(self, n):
        self.kv.ensure_blocks(n)
        self._grow(min(n, CAPACITY))

    @rule(n=st.integers(0, CAPACITY))
    def extend(self, n):
        self.kv.extend(n)
        self._grow(n)

    @rule()
    def release_physical(self):
        self.kv.release_physical()
        if self.committed:
            self.to_recommit = self.committed
        self.committed = 0
        self.marks[:] = 0

    @rule()
    def recommit(self):
        self.kv.recommit()
        self._grow(self.to_recommit)

    @precondition(lambda self: self.committed > 0)
    @rule(data=st.data(), mark=st.integers(1, 255))
    def write_block(self, data, mark):
        block = data.draw(st.integers(0, self.committed - 1))
        for index in range(len(self.kv)):
            for view in self.kv.committed_views(index):
                array = view.to_numpy()
                array[block, 0] = array[block, -1] = mark
        self.marks[block] = mark

    @rule(
        call=st.sampled_from(["commit", "ensure_blocks", "extend"]),
        n=st.one_of(st.integers(-(2**70), -1), st.integers(CAPACITY + 1, 2**70)),
    )
    def bad_count(self, call, n):
        if call == "ensure_blocks" and n > 0:
            return  # capped at the capacity: not an error
        before = [t.committed_sizes for t in self.kv.tensors], self.kv.physical_bytes
        with pytest.raises(ValueError, match="num_blocks"):
            getattr(self.kv, call)(n)
        assert ([t.committed_sizes for t in self.kv.tensors], self.kv.physical_bytes) == before

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def committed_count_matches(self):
        assert self.kv.num_blocks_committed == self.committed

    @invariant()
    def committed_blocks_hold_the_model(self):
        n = self.committed
        for index in range(len(self.kv)):
            for view in self.kv.committed_views(index):
                array = view.to_numpy()
                assert array.shape[0] == n
                np.testing.assert_array_equal(array[:, 0], self.marks[:n])
                np.testing.assert_array_equal(array[:, -1], self.marks[:n])

    @invariant()
    def physical_memory_is_the_committed_blocks_rounded_to_granules(self):
        low = high = 0
        for tensor, block_bytes in self.kv.buffers:
            for offset in tensor.segment_offsets:
                size = self.committed * block_bytes
                low += size
                if size:
                    high += (-(-(offset + size) // GRANULE) - offset // GRANULE) * GRANULE
        assert low <= self.kv.physical_bytes <= high


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=50,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
