"""The KV cache as an engine uses it: vLLM's tests of ``ExtensibleKVCacheBuilder`` and
``ExtensibleKVCacheBuffers`` ported (one block after ``finish``, growth keeping pointers and
data, a non-growing commit touching nothing even with ``defragment``, release and
recommit, views trimmed to the committed blocks), on every device and through torch and
JAX; then what jaxbuf adds: defragment, bad input that changes nothing, failures part way.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxbuf
from jaxbuf import ClosedError, ExtensibleKVCacheBuffers, ExtensibleKVCacheBuilder
from jaxbuf.drivers import get_vmm_driver
from jaxbuf.drivers.base import DriverError
from jaxbuf.testing import FaultInjectingDriver

# vLLM's test sizes: 16-token blocks, 2 heads of 32, K and V in float16.
BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, HEAD_SIZE = 16, 8, 2, 32
PAGE_SHAPE = (2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)  # K/V, tokens, heads, head dim
PAGE_BYTES = 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * 2  # float16
LAYOUTS = ("layer_compact", "blocks_outermost")


def _allocate(device, layout, num_layers=2, framework=None):
    """One KV-cache tensor for ``num_layers`` layers, as an engine's allocator would reserve
    it: layer-compact (one segment per layer) or blocks outermost (one segment; a block holds
    every layer's page). Returns the builder's flat view, the buffers and the segment count."""
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, device, framework=framework)
    segments = num_layers if layout == "layer_compact" else 1
    flat = builder.reserve(PAGE_BYTES * NUM_BLOCKS * num_layers, segments)
    return flat, builder.finish(), segments


def _layer_block_shape(layout, num_layers):
    """A layer view's block: one page, or every layer's page where blocks are outermost."""
    return PAGE_SHAPE if layout == "layer_compact" else (num_layers, *PAGE_SHAPE)


class _Access:
    """Write a block and read views through one framework: torch in place on its tensors; JAX
    through a :class:`~jaxbuf.kv.KVCacheStep` (donated in place on a GPU, written back on
    the CPU) and reads of fresh imports."""

    def __init__(self, framework, kv, block_shape):
        self.framework, self.kv = framework, kv
        self.views = kv.layer_views("float16", block_shape)
        if framework == "torch":
            self.tensors = [view.to_torch() for view in self.views]
        else:
            from jaxbuf.kv import KVCacheStep

            self.step = KVCacheStep(
                kv,
                lambda caches, block, value: ([c.at[block].set(value) for c in caches], None),
                "float16",
                block_shape,
            )

    def fill(self, block, value):
        if self.framework == "torch":
            for tensor in self.tensors:
                tensor[block].fill_(value)
        else:
            self.step(block, np.float16(value))

    def read(self, index, blocks):
        """Blocks ``[0, blocks)`` of layer view ``index`` as numpy (a fresh import each time)."""
        view = self.kv.layer_views("float16", self.views[index].shape[1:], num_blocks=blocks)
        view = view[index]
        if self.framework == "torch":
            return view.to_torch().cpu().numpy()
        return np.asarray(view.to_jax())

    def close(self):
        if self.framework == "jax":
            self.step.close()
        self.tensors = []


def _sync(device):
    if device != "cpu":
        get_vmm_driver(device).synchronize(0)


# -- ported from vLLM ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_extensible_allocation_and_growth(device, framework, layout):
    """One block committed at first, at most one granule per segment; growth keeps base
    pointers and data and zeroes the new blocks."""
    flat, kv, segments = _allocate(device, layout)
    try:
        assert isinstance(kv, ExtensibleKVCacheBuffers)
        assert kv.num_blocks_committed == 1
        granule = jaxbuf.granule_size(device)
        assert 0 < kv.physical_bytes <= segments * granule
        assert flat.nbytes == PAGE_BYTES * NUM_BLOCKS * 2 and flat.ptr == kv.full_view(0).ptr
        block_shape = _layer_block_shape(layout, 2)
        access = _Access(framework, kv, block_shape)
        ptrs = [view.ptr for view in access.views]
        for view in access.views:
            assert view.shape[0] == NUM_BLOCKS  # views span the full capacity
        access.fill(0, 1.0)

        kv.commit(NUM_BLOCKS)
        assert kv.num_blocks_committed == NUM_BLOCKS
        assert [view.ptr for view in kv.layer_views("float16", block_shape)] == ptrs
        access.fill(NUM_BLOCKS - 1, 2.0)
        _sync(device)
        for i in range(len(ptrs)):
            data = access.read(i, NUM_BLOCKS)
            assert (data[0] == 1.0).all()  # earlier contents survive the grow
            assert (data[1 : NUM_BLOCKS - 1] == 0).all()  # new blocks were zeroed
            assert (data[NUM_BLOCKS - 1] == 2.0).all()
        access.close()
    finally:
        kv.free()


def test_commit_at_or_below_committed_preserves_data(device, framework):
    """A non-growing commit does not touch the mapping, even with defragment: an engine
    re-running warmup while the cache holds live data must not lose it."""
    _, kv, _ = _allocate(device, "layer_compact", num_layers=1)
    try:
        kv.commit(NUM_BLOCKS)
        access = _Access(framework, kv, PAGE_SHAPE)
        for block in range(NUM_BLOCKS):
            access.fill(block, 7.0)
        _sync(device)
        chunks = kv.tensors[0].mapped_chunks()

        kv.ensure_blocks(1)
        kv.commit(NUM_BLOCKS, defragment=True)
        kv.commit(3, defragment=True)
        assert kv.num_blocks_committed == NUM_BLOCKS
        assert kv.tensors[0].mapped_chunks() == chunks
        assert (access.read(0, NUM_BLOCKS) == 7.0).all()
        access.close()
    finally:
        kv.free()


def test_extensible_release_and_recommit(device, framework):
    """Sleep keeps the address and views; recommit maps the same count again, zeroed."""
    _, kv, _ = _allocate(device, "layer_compact", num_layers=1)
    try:
        kv.commit(NUM_BLOCKS)
        access = _Access(framework, kv, PAGE_SHAPE)
        access.fill(2, 3.0)
        _sync(device)
        ptr = access.views[0].ptr

        kv.release_physical()
        assert kv.num_blocks_committed == 0 and kv.physical_bytes == 0
        kv.release_physical()  # a second sleep keeps the count to wake up with
        kv.recommit()
        assert kv.num_blocks_committed == NUM_BLOCKS
        assert kv.layer_views("float16", PAGE_SHAPE)[0].ptr == ptr
        assert (access.read(0, NUM_BLOCKS) == 0).all()
        access.close()
    finally:
        kv.free()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_committed_views_are_trimmed_to_the_committed_blocks(device, layout):
    """What a connector registers: the committed blocks of each segment, at the segment's
    start."""
    _, kv, segments = _allocate(device, layout, num_layers=2)
    try:
        kv.commit(3)
        block_bytes = kv.bytes_per_block_per_segment[0]
        full = kv.segment_views(0)
        trimmed = kv.committed_views(0)
        assert len(trimmed) == segments
        for whole, part, offset in zip(full, trimmed, kv.tensors[0].segment_offsets):
            assert part.ptr == whole.ptr == kv.full_view(0).ptr + offset
            assert part.shape[0] == 3 and part.nbytes == 3 * block_bytes
            assert whole.shape[0] == NUM_BLOCKS
        typed = kv.committed_views(0, "float16", _layer_block_shape(layout, 2))
        assert typed[0].shape[0] == 3
        np.testing.assert_array_equal(_host(typed[0]), 0)
    finally:
        kv.free()


# -- what jaxbuf adds -----------------------------------------------------------------------
def _host(view):
    """The view's bytes on the host: in place on the CPU, a copy from a device."""
    return np.from_dlpack(view, device="cpu")


def _fill(view, value):
    """Write ``value`` over the view, on any device (a device through torch)."""
    if view.device.is_cuda:
        pytest.importorskip("torch")
        view.to_torch().fill_(value)
    else:
        view.to_numpy()[:] = value


def _big_blocks(device, num_segments=2):
    """Blocks of half a granule per segment, so a grow spans several granules."""
    granule = jaxbuf.granule_size(device)
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, device)
    builder.reserve(NUM_BLOCKS * num_segments * granule // 2, num_segments)
    return builder.finish()


def test_defragment_on_a_real_grow_remaps_each_segment_as_one_allocation(device):
    kv = _big_blocks(device)
    try:
        kv.commit(3)  # 1.5 granules per segment: two chunks each
        kv.commit(NUM_BLOCKS)
        tensor = kv.tensors[0]
        sizes = tensor.committed_sizes
        assert tensor.segments_backed_by_one_chunk(sizes) == [False, False]
    finally:
        kv.free()

    kv = _big_blocks(device)
    try:
        kv.commit(3)
        _fill(kv.committed_views(0)[0], 5)
        kv.commit(NUM_BLOCKS, defragment=True)
        tensor = kv.tensors[0]
        assert tensor.segments_backed_by_one_chunk(tensor.committed_sizes) == [True, True]
        assert kv.num_blocks_committed == NUM_BLOCKS
        # The blocks before are discarded: all zero again.
        assert not _host(kv.committed_views(0)[0]).any()
    finally:
        kv.free()


def test_defragment_refuses_segments_sharing_a_granule_and_changes_nothing():
    _, kv, _ = _allocate("cpu", "layer_compact", num_layers=2)  # both segments in one granule
    try:
        kv.committed_views(0)[0].to_numpy()[:] = 9
        chunks, physical = kv.tensors[0].mapped_chunks(), kv.physical_bytes
        with pytest.raises(ValueError, match="share the granule"):
            kv.commit(4, defragment=True)
        assert kv.num_blocks_committed == 1 and kv.physical_bytes == physical
        assert kv.tensors[0].mapped_chunks() == chunks
        assert (kv.committed_views(0)[0].to_numpy() == 9).all()
        kv.commit(4)  # without defragment it grows
        assert kv.num_blocks_committed == 4
    finally:
        kv.free()


def test_ensure_and_extend():
    _, kv, _ = _allocate("cpu", "blocks_outermost")
    try:
        kv.ensure_blocks(3)
        assert kv.num_blocks_committed == 3
        kv.ensure_blocks(2)  # never shrinks
        assert kv.num_blocks_committed == 3
        kv.ensure_blocks(10**9)  # capped at the capacity
        assert kv.num_blocks_committed == NUM_BLOCKS
    finally:
        kv.free()
    _, kv, _ = _allocate("cpu", "blocks_outermost")
    with kv:
        kv.extend(5)
        assert kv.num_blocks_committed == 5
    assert kv.freed and kv.physical_bytes == 0


def test_several_tensors_grow_in_lockstep():
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu")
    builder.reserve(NUM_BLOCKS * 4096, 1)
    builder.reserve(NUM_BLOCKS * 2048 * 4, 4)
    kv = builder.finish()
    try:
        assert kv.bytes_per_block_per_segment == [4096, 2048]
        assert len(kv.layer_views()) == 5
        kv.commit(6)
        assert [t.committed_sizes for t in kv.tensors] == [[6 * 4096], [6 * 2048] * 4]
        assert builder.finish() is kv  # finishing again hands back the same buffers
        with pytest.raises(RuntimeError, match="after finish"):
            builder.reserve(NUM_BLOCKS * 4096, 1)
    finally:
        kv.free()


def test_reserve_returns_the_framework_array(framework):
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu", framework=framework)
    flat = builder.reserve(NUM_BLOCKS * 4096, 1)
    kv = builder.finish()
    try:
        assert tuple(flat.shape) == (NUM_BLOCKS * 4096,)
        assert str(flat.dtype).endswith("uint8")
    finally:
        del flat
        kv.free()


def test_shareable_chooses_the_driver():
    # The CPU driver's chunks are memfds, always shareable: the default driver serves.
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu", shareable=True)
    assert builder.driver is get_vmm_driver("cpu")
    with pytest.raises(ValueError, match="shareable must be"):
        ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu", shareable="rdma")
    with pytest.raises(ValueError, match="not both"):
        ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu", shareable=True, driver=get_vmm_driver("cpu"))


@pytest.mark.gpu
def test_shareable_on_cuda_asks_for_fabric_and_rdma(cuda_device):
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, cuda_device, shareable=True)
    assert builder.driver is not get_vmm_driver(cuda_device)
    builder.reserve(NUM_BLOCKS * 4096, 1)
    kv = builder.finish()
    try:
        options = builder.driver.allocation_options(0)
        assert options["handle_type"] in ("fabric", "posix", "none")
        assert kv.num_blocks_committed == 1
    finally:
        kv.free()


# -- bad input changes nothing ------------------------------------------------------------
def _state(kv):
    return (
        kv.num_blocks_committed,
        kv.physical_bytes,
        [t.committed_sizes for t in kv.tensors],
        [t.mapped_chunks() for t in kv.tensors],
    )


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda kv: kv.commit(-1), ValueError, "num_blocks"),
        (lambda kv: kv.commit(NUM_BLOCKS + 1), ValueError, "num_blocks"),
        (lambda kv: kv.commit(2**70), ValueError, "num_blocks"),
        (lambda kv: kv.commit(2.0), TypeError, "num_blocks"),
        (lambda kv: kv.commit(True), TypeError, "num_blocks"),
        (lambda kv: kv.commit(4, defragment="yes"), TypeError, "defragment"),
        (lambda kv: kv.ensure_blocks(-3), ValueError, "num_blocks"),
        (lambda kv: kv.extend(2**64), ValueError, "num_blocks"),
        (lambda kv: kv.segment_views(1), IndexError, "buffer index"),
        (lambda kv: kv.segment_views(0, 2**40), ValueError, "num_blocks"),
        (lambda kv: kv.segment_views(0, None, "float32", (3,)), ValueError, "block_shape"),
        (lambda kv: kv.segment_views(0, None, "complex999"), TypeError, "dtype"),
    ],
)
def test_bad_buffers_input_changes_nothing(call, error, match):
    _, kv, _ = _allocate("cpu", "layer_compact")
    try:
        before = _state(kv)
        with pytest.raises(error, match=match):
            call(kv)
        assert _state(kv) == before
    finally:
        kv.free()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((NUM_BLOCKS * 4096 + 1, 1), ValueError, "size .* does not divide into num_blocks"),
        ((NUM_BLOCKS * 4096, 3), ValueError, "num_segments \\(3\\) does not divide"),
        ((NUM_BLOCKS * 2 * 100, 2), ValueError, "not a multiple of 256"),
        ((0, 1), ValueError, "size"),
        ((-4096, 1), ValueError, "size"),
        ((NUM_BLOCKS * 4096, 0), ValueError, "num_segments"),
        ((2**80, 1), ValueError, "max_num_bytes"),
        (("4096", 1), TypeError, "size"),
    ],
)
def test_bad_reserve_changes_nothing(args, error, match):
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu")
    with pytest.raises(error, match=match):
        builder.reserve(*args)
    assert builder.buffers == []
    builder.free()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_blocks_capacity": 0}, ValueError, "num_blocks_capacity"),
        ({"num_blocks_capacity": -8}, ValueError, "num_blocks_capacity"),
        ({"num_blocks_capacity": 8.0}, TypeError, "num_blocks_capacity"),
        ({"num_blocks_capacity": 8, "device": "tpu"}, ValueError, "tpu"),
        ({"num_blocks_capacity": 8, "framework": "nope"}, ValueError, "nope"),
    ],
)
def test_bad_builder_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ExtensibleKVCacheBuilder(**{"device": "cpu", **kwargs})


def test_bad_buffers_construction():
    tensor = jaxbuf.ExtensibleTensor(NUM_BLOCKS * 4096, "cpu", num_segments=2)
    try:
        with pytest.raises(ValueError, match="bytes_per_block_per_segment"):
            ExtensibleKVCacheBuffers([(tensor, 0)], NUM_BLOCKS)
        with pytest.raises(ValueError, match="a segment holds"):
            ExtensibleKVCacheBuffers([(tensor, 4096)], NUM_BLOCKS)
        with pytest.raises(ValueError, match="repeats a tensor"):
            ExtensibleKVCacheBuffers([(tensor, 2048), (tensor, 2048)], NUM_BLOCKS)
        with pytest.raises(TypeError, match="ExtensibleTensor"):
            ExtensibleKVCacheBuffers([(object(), 2048)], NUM_BLOCKS)
        with pytest.raises(TypeError, match="pairs"):
            ExtensibleKVCacheBuffers(tensor, NUM_BLOCKS)
        with pytest.raises(ValueError, match="num_blocks_capacity"):
            ExtensibleKVCacheBuffers([(tensor, 2048)], 0)
        assert tensor.committed_sizes == [0, 0]
    finally:
        tensor.free()


def test_the_package_examples_run():
    import doctest

    import jaxbuf.kv

    assert doctest.testmod(jaxbuf.kv).failed == 0


def test_freed_buffers_refuse_everything():
    flat, kv, _ = _allocate("cpu", "layer_compact")
    kv.free()
    kv.free()  # twice is fine
    for call in (
        lambda: kv.commit(2),
        kv.release_physical,
        kv.recommit,
        lambda: kv.segment_views(0),
        lambda: kv.full_view(0),
    ):
        with pytest.raises(ClosedError):
            call()
    assert kv.num_blocks_committed == 0 and kv.physical_bytes == 0
    with pytest.raises(RuntimeError):
        flat.to_numpy()
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(kv)


def test_a_failed_commit_keeps_the_count_and_a_retry_continues():
    driver = FaultInjectingDriver(get_vmm_driver("cpu"))
    granule = jaxbuf.granule_size("cpu")
    builder = ExtensibleKVCacheBuilder(NUM_BLOCKS, "cpu", driver=driver)
    builder.reserve(NUM_BLOCKS * granule, 1)
    builder.reserve(NUM_BLOCKS * granule, 1)
    kv = builder.finish()
    try:
        kv.committed_views(0)[0].to_numpy()[:] = 4
        driver.fail_on("create", nth=2)  # the second tensor's new chunk
        with pytest.raises(DriverError):
            kv.commit(4)
        assert kv.num_blocks_committed == 1
        assert [t.committed_sizes[0] for t in kv.tensors] == [4 * granule, granule]
        kv.commit(4)
        assert kv.num_blocks_committed == 4
        assert (kv.committed_views(0)[0].to_numpy()[0] == 4).all()
        assert not kv.committed_views(1)[0].to_numpy()[1:].any()
    finally:
        kv.free()


def test_a_refused_release_keeps_the_count_to_recommit():
    _, kv, _ = _allocate("cpu", "blocks_outermost")

    class Refusing:
        refuse = True

        def mapped(self, chunks):
            pass

        def unmapping(self, chunks):
            if self.refuse:
                raise RuntimeError("a transfer is in flight")

    listener = Refusing()
    try:
        kv.commit(5)
        kv.tensors[0].add_mapping_listener(listener)
        with pytest.raises(RuntimeError, match="in flight"):
            kv.release_physical()
        assert kv.num_blocks_committed == 5
        listener.refuse = False
        kv.release_physical()
        assert kv.num_blocks_committed == 0
        kv.recommit()
        assert kv.num_blocks_committed == 5
    finally:
        kv.free()
