"""The direct launch of the compiled staged-write kernel (:mod:`jaxbuf.kernels.cuda_launch`).

On the CPU: the kernel is compiled for sm_90 without a GPU (Triton's compiler and ptxas need
none), so its argument layout is checked against the signature and the PTX's ``.param`` list,
and :class:`~jaxbuf.kernels.staged_write.CompiledLauncher` runs its whole direct path against a
recording driver (grid, block, stream, the values the driver would read). The reasons for
falling back to Triton's launcher are checked one by one. On CUDA (``gpu``): the direct launch
writes exactly what Triton's launcher writes, on random batches, and is not slower.
"""

from __future__ import annotations

import ctypes
import statistics
import struct
import time
import types

import numpy as np
import pytest

from jaxbuf.drivers import driver_for_platform, get_vmm_driver
from jaxbuf.drivers.base import DriverError, VmmDriver
from jaxbuf.kernels import StagedLaunch, make_group_table, make_write_table, pack_contents

triton = pytest.importorskip("triton", reason="triton is not installed")
from jaxbuf.kernels import staged_write  # noqa: E402
from jaxbuf.kernels.cuda_launch import (  # noqa: E402
    DirectLauncher,
    DirectLaunchUnavailable,
    PackedArguments,
    Parameter,
    argument_layout,
    kernel_parameters,
    ptx_parameter_sizes,
)
from jaxbuf.kernels.staged_write import CompiledLauncher  # noqa: E402

RUNTIME = CompiledLauncher.RUNTIME_ARGUMENTS
FAKE_FUNCTION = 0xF00D


# -- the kernel, compiled for sm_90 on any machine --------------------------------------------
def _compile_for_sm90(serial: bool):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = staged_write._apply_staged_writes_kernel
    # Under TRITON_INTERPRET (the CPU) triton.jit gave an interpreted function; compile its
    # source as a compiled-mode one.
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    # The types CompiledLauncher's warmup gets from its values: addresses past 2**32 are
    # int64, the count 2**20 int32 (nothing is specialised: do_not_specialize).
    signature = {name: "i64" for name in RUNTIME}
    signature["num_writes"] = "i32"
    signature.update(BLOCK_SIZE="constexpr", SERIAL="constexpr")
    source = ASTSource(jit, signature, constexprs={"BLOCK_SIZE": 1024, "SERIAL": serial})
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except Exception as error:  # noqa: BLE001 - a toolchain missing here is a skip, said why
        pytest.skip(f"cannot compile for sm_90 here: {type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def compiled():
    """``{serial: CompiledKernel}``, with a stand-in CUfunction (nothing is loaded)."""
    kernels = {}
    for serial in (False, True):
        kernel = _compile_for_sm90(serial)
        kernel.function = FAKE_FUNCTION
        kernels[serial] = kernel
    return kernels


def _like(kernel, **changes):
    """A stand-in of ``kernel`` with some metadata or attributes changed."""
    metadata = kernel.metadata._replace(**changes.pop("metadata", {}))
    fields = dict(src=kernel.src, metadata=metadata, function=kernel.function, asm=kernel.asm)
    fields.update(changes)
    return types.SimpleNamespace(**fields)


class RecordingDriver:
    """Stands in for the CUDA driver: records every ``launch_kernel`` with the values the
    driver would copy from ``args`` (decoded with the PTX's parameter sizes)."""

    platform = "cuda"

    def __init__(self, sizes):
        self.sizes = sizes
        self.launches = []
        self.steps = []  # every call, in order
        self.fail_launch = False

    def unavailable_reason(self):
        return None

    def launch_kernel(self, function, grid, block, shared, stream, args):
        if self.fail_launch:
            raise DriverError("cuLaunchKernel", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
        pointers = (ctypes.c_void_p * len(self.sizes)).from_address(args)
        values = tuple(
            int.from_bytes(ctypes.string_at(pointer, size), "little", signed=True)
            for pointer, size in zip(pointers, self.sizes)
        )
        self.launches.append((function, grid, block, shared, stream, args, values))
        self.steps.append("launch")

    def ensure_context(self, device_index):
        self.steps.append(("context", device_index))

    def copy_on_stream(self, dst, src, size, stream):
        self.steps.append(("copy", dst, src, size, stream))

    def synchronize(self, device_index):
        self.steps.append(("synchronize", device_index))

    # The seam's own composition of the three calls above.
    copy_and_launch = VmmDriver.copy_and_launch


def _launcher(compiled, driver, **kwargs):
    launcher = CompiledLauncher(0, driver=driver, **kwargs)
    launcher._compile = lambda: compiled[False]  # the launcher compiles the parallel kernel
    return launcher


# -- the layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("serial", [False, True])
def test_layout_matches_the_signature_and_the_ptx(compiled, serial):
    kernel = compiled[serial]
    parameters = kernel_parameters(kernel)
    hidden = [p.name for p in parameters if p.hidden]
    assert [p.name for p in parameters if not p.hidden] == list(RUNTIME)
    # Triton 3.9 declares both scratch sizes, so both hidden pointers are parameters.
    expected_hidden = [
        name
        for name, field in (
            ("global_scratch", "global_scratch_size"),
            ("profile_scratch", "profile_scratch_size"),
        )
        if hasattr(kernel.metadata, field)
    ]
    assert hidden == expected_hidden
    layout = argument_layout(parameters)
    assert layout.sizes == ptx_parameter_sizes(kernel.asm["ptx"])
    assert layout.sizes[:5] == (8, 8, 8, 4, 8)
    assert all(offset % size == 0 for offset, size in zip(layout.offsets, layout.sizes))
    ends = [o + s for o, s in zip(layout.offsets, layout.sizes)]
    assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:]))  # no two overlap
    assert layout.nbytes >= ends[-1] and layout.nbytes % 8 == 0
    assert layout.runtime_format == "<qqqi4xq"


def test_packed_values_are_what_the_driver_reads(compiled):
    layout = argument_layout(kernel_parameters(compiled[True]))
    arguments = PackedArguments(layout)
    values = (1 << 40, (1 << 40) + 64, (1 << 41) + 8, 4096, (1 << 42) + 16)
    arguments.pack(*values)
    hidden = (0,) * (len(layout.sizes) - 5)
    assert arguments.values() == values + hidden
    pointers = (ctypes.c_void_p * len(layout.sizes)).from_address(arguments.address)
    base = ctypes.addressof(arguments.buffer)
    assert [p - base for p in pointers] == list(layout.offsets)
    assert struct.unpack("<i", ctypes.string_at(pointers[3], 4))[0] == 4096
    # A value that does not fit its type raises (so nothing is launched); the next pack
    # rewrites every runtime value.
    with pytest.raises(struct.error):
        arguments.pack(1, 2, 3, 1 << 31, 5)
    arguments.pack(*values)
    assert arguments.values() == values + hidden


def test_layout_refuses_what_it_does_not_pack():
    with pytest.raises(DirectLaunchUnavailable, match="fp16"):
        argument_layout([Parameter("x", "fp16")])
    with pytest.raises(DirectLaunchUnavailable, match="follows a hidden"):
        argument_layout([Parameter("s", "*i8", hidden=True), Parameter("x", "i32")])
    mixed = argument_layout([Parameter("a", "i8"), Parameter("b", "i64"), Parameter("c", "i16")])
    assert mixed.offsets == (0, 8, 16) and mixed.runtime_format == "<b7xqh"


def test_ptx_parameter_sizes_reads_scalars_pointers_and_arrays():
    ptx = """
.visible .entry k(
	.param .u64 k_param_0,
	.param .u32 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .align 64 .b8 k_param_3[128],
	.param .f32 k_param_4
)
.reqntid 128
{ ret; }"""
    assert ptx_parameter_sizes(ptx) == (8, 4, 8, 128, 4)
    with pytest.raises(DirectLaunchUnavailable, match="entry"):
        ptx_parameter_sizes(".version 8.0")


# -- the direct path, against a recording driver ----------------------------------------------
def test_compiled_launcher_launches_directly(compiled):
    sizes = ptx_parameter_sizes(compiled[False].asm["ptx"])
    driver = RecordingDriver(sizes)
    launcher = _launcher(compiled, driver)
    assert launcher.fallback_reason is None
    hidden = (0,) * (len(sizes) - 5)
    wt, gt, contents = 1 << 40, (1 << 40) + 4096, (1 << 41) + 8
    launcher(StagedLaunch(wt, gt, contents, 256), 0x5000, None, None)
    function, grid, block, shared, stream, args, values = driver.launches[-1]
    metadata = compiled[False].metadata
    assert function == FAKE_FUNCTION
    assert grid == (256, 1, 1)
    assert block == (metadata.num_warps * metadata.warp_size, 1, 1)
    assert shared == metadata.shared
    assert stream == 0x5000
    assert values == (wt, gt, contents, 256) + (0,) + hidden
    # The next launch rewrites the values in the same prepacked buffer.
    launcher(StagedLaunch(wt + 8, gt, contents, 4096), 0)
    assert driver.launches[-1][1] == (4096, 1, 1)
    assert driver.launches[-1][5] == args
    assert driver.launches[-1][6] == (wt + 8, gt, contents, 4096, 0) + hidden
    assert launcher.direct and launcher.fallback_reason is None
    # Nothing to launch: no call.
    count = len(driver.launches)
    launcher(StagedLaunch(wt, gt, contents, 0), 0)
    assert len(driver.launches) == count


def test_direct_launcher_call_and_bind_agree(compiled):
    sizes = ptx_parameter_sizes(compiled[True].asm["ptx"])
    driver = RecordingDriver(sizes)
    launcher = DirectLauncher(compiled[True], driver, RUNTIME)
    values = (1 << 40, 2 << 40, 3 << 40, 12, 4 << 40)
    launcher(3, 9, *values)
    driver.steps.clear()
    launcher.bind(2)(3, 9, *values, copy=(0xD000, 0xA000, 64))
    first, second = driver.launches
    assert first == second
    assert first[1:5] == ((3, 1, 1), launcher.block, launcher.shared, 9)
    assert first[6][:5] == values
    # Bound: the device's context made current and the copy enqueued first, on the stream.
    assert driver.steps == [("context", 2), ("copy", 0xD000, 0xA000, 64, 9), "launch"]


@pytest.mark.parametrize("direct", [True, False])
def test_a_failed_launch_after_a_copy_waits_for_the_copy(compiled, direct):
    """copy_and_launch's contract, on both paths (direct, and Triton's launcher): when the
    launch fails, nothing was launched and the copy it follows has completed (the device
    synchronized), so the writer may rewrite the copy's source at once."""
    sizes = ptx_parameter_sizes(compiled[False].asm["ptx"])
    driver = RecordingDriver(sizes)

    def failing_run(*args):
        raise DriverError("cuLaunchKernel", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    kernels = compiled
    if not direct:
        fake = _like(
            compiled[False],
            metadata=dict(global_scratch_size=128),
            run=failing_run,
            packed_metadata=(4, 1, 0),
        )
        kernels = {False: fake, True: fake}
    launcher = _launcher(kernels, driver)
    driver.fail_launch = True
    with pytest.raises(DriverError, match="OUT_OF_RESOURCES"):
        launcher(StagedLaunch(1 << 40, 2 << 40, 3 << 40, 8), 0x77, copy=(0xD000, 0xA000, 64))
    assert launcher.direct is direct
    assert driver.steps == [("context", 0), ("copy", 0xD000, 0xA000, 64, 0x77), ("synchronize", 0)]
    assert not driver.launches


def test_too_many_writes_is_refused_before_anything(compiled):
    driver = RecordingDriver(ptx_parameter_sizes(compiled[False].asm["ptx"]))
    launcher = _launcher(compiled, driver)
    with pytest.raises(ValueError, match="2147483648 writes"):
        launcher(StagedLaunch(1, 2, 8, 1 << 31), 0)
    assert not driver.launches and launcher._launch is None


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(metadata=dict(num_ctas=2)), "2 CTAs"),
        (dict(metadata=dict(global_scratch_size=256)), "global_scratch_size=256"),
        (dict(metadata=dict(profile_scratch_size=64)), "profile_scratch_size=64"),
        (dict(metadata=dict(launch_pdl=True)), "launch_pdl"),
        (dict(metadata=dict(launch_cooperative_grid=True)), "launch_cooperative_grid"),
        (dict(metadata=dict(shared=300 * 1024)), "shared memory"),
        (dict(function=None), "CUfunction"),
        (dict(asm={}), "no PTX"),
        (dict(src=None), "no signature"),
    ],
)
def test_direct_launcher_refuses_with_a_reason(compiled, change, reason):
    kernel = _like(compiled[False], **change)
    driver = RecordingDriver(())
    with pytest.raises(DirectLaunchUnavailable, match=reason):
        DirectLauncher(kernel, driver, RUNTIME)


def test_direct_launcher_checks_names_and_the_ptx(compiled):
    kernel = compiled[False]
    driver = RecordingDriver(())
    with pytest.raises(DirectLaunchUnavailable, match="the launcher passes"):
        DirectLauncher(kernel, driver, RUNTIME[:4])
    # A PTX that declares the count as 8 bytes: the layout no longer matches it.
    ptx = kernel.asm["ptx"].replace(".param .u32", ".param .u64", 1)
    with pytest.raises(DirectLaunchUnavailable, match="PTX declares"):
        DirectLauncher(_like(kernel, asm={"ptx": ptx}), driver, RUNTIME)


def test_falls_back_to_tritons_launcher_with_the_reason(compiled):
    calls = []
    fake = _like(
        compiled[False],
        metadata=dict(global_scratch_size=128),
        run=lambda *args: calls.append(args),
        packed_metadata=(4, 1, 0),
    )
    driver = RecordingDriver(())
    launcher = _launcher({False: fake, True: fake}, driver)
    launcher(StagedLaunch(10, 20, 32, 5), 0x77, copy=(0xD000, 0xA000, 64))
    assert not driver.launches
    assert driver.steps == [("context", 0), ("copy", 0xD000, 0xA000, 64, 0x77)]
    assert "global_scratch_size=128" in launcher.fallback_reason and not launcher.direct
    assert calls == [
        (
            5,
            1,
            1,
            0x77,
            FAKE_FUNCTION,
            (4, 1, 0),
            None,
            None,
            None,
            10,
            20,
            32,
            5,
            0,
            launcher.block_size,
            False,
        )
    ]


class _NoKernels:
    platform = "cuda"

    def unavailable_reason(self):
        return None


def test_reasons_known_before_any_compile(monkeypatch, compiled):
    driver = RecordingDriver(())
    assert "direct=False" in CompiledLauncher(0, driver=driver, direct=False).fallback_reason
    assert "_NoKernels" in CompiledLauncher(0, driver=_NoKernels()).fallback_reason
    cpu = get_vmm_driver("cpu")  # the base class's launch_kernel: no kernels
    assert "HostVmmDriver" in CompiledLauncher(0, driver=cpu).fallback_reason
    monkeypatch.setenv("JAXBUF_DIRECT_LAUNCH", "0")
    assert "JAXBUF_DIRECT_LAUNCH=0" in CompiledLauncher(0, driver=driver).fallback_reason
    monkeypatch.delenv("JAXBUF_DIRECT_LAUNCH")
    monkeypatch.setattr(staged_write.triton, "__version__", "3.2.0")
    old = CompiledLauncher(0, driver=driver)
    assert "3.2.0" in old.fallback_reason and old._legacy


def test_no_cuda_is_a_fallback_reason():
    cuda = driver_for_platform("cuda")
    if cuda.unavailable_reason() is None:
        pytest.skip("CUDA works here")
    launcher = CompiledLauncher(0)
    assert launcher.fallback_reason.startswith("the driver is unavailable")
    assert cuda.unavailable_reason() in launcher.fallback_reason


def test_the_driver_seam():
    with pytest.raises(NotImplementedError, match="HostVmmDriver"):
        get_vmm_driver("cpu").launch_kernel(1, (1, 1, 1), (32, 1, 1), 0, 0, 0)
    real = pytest.importorskip("cuda.bindings.driver")
    from jaxbuf.drivers.cuda import CudaVmmDriver

    calls = []
    binding = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if k[0] != "_"})
    results = [(real.CUresult.CUDA_SUCCESS,), (real.CUresult.CUDA_ERROR_INVALID_VALUE,)]
    binding.cuLaunchKernel = lambda *args: (calls.append(args), results.pop(0))[1]
    driver = CudaVmmDriver(binding)
    driver.launch_kernel(0xF00D, (256, 1, 1), (128, 1, 1), 0, 0x5000, 0x1234)
    assert calls == [(0xF00D, 256, 1, 1, 128, 1, 1, 0, 0x5000, 0x1234, 0)]
    with pytest.raises(DriverError, match=r"cuLaunchKernel\(grid=\(3, 1, 1\).*INVALID_VALUE"):
        driver.launch_kernel(0xF00D, (3, 1, 1), (128, 1, 1), 0, 0, 0x1234)


# -- on the GPU ---------------------------------------------------------------------------------
def _random_batch(rng, serial):
    """One launch's worth of random writes over targets of four element sizes: ``(initial,
    models, table, contents, segments)``; the models are the initial arrays after the writes
    in staging order (later wins). Parallel batches write each row once (disjoint writes);
    serial ones repeat rows, and their table is grouped by row (stable: order kept) with the
    segment bounds."""
    dtypes = [np.int8, np.int16, np.int32, np.int64]
    shapes = [(64, 96), (32, 200), (128, 64), (16, 300)]
    initial = [rng.integers(-100, 100, shape).astype(dtype) for shape, dtype in zip(shapes, dtypes)]
    models = [a.copy() for a in initial]
    writes, used = [], set()
    for _ in range(int(rng.integers(1, 300))):
        group = int(rng.integers(len(shapes)))
        num_rows, row_len = shapes[group]
        row = int(rng.integers(num_rows))
        if not serial and (group, row) in used:
            continue
        used.add((group, row))
        length = int(rng.integers(1, 40))
        start = int(rng.integers(0, row_len - length + 1))
        value = rng.integers(-100, 100, length).astype(dtypes[group])
        models[group][row, start : start + length] = value
        writes.append((group, row, start, value))
    contents, offsets = pack_contents([w[3] for w in writes])
    columns = list(zip(*writes))
    table = make_write_table(
        columns[0], columns[1], columns[2], offsets, [len(v) for v in columns[3]]
    )
    segments = None
    if serial:
        table = np.ascontiguousarray(table[np.lexsort((table[:, 1], table[:, 0]))])
        keys = table[:, :2]
        bounds = np.flatnonzero(np.any(keys[1:] != keys[:-1], axis=1)) + 1
        segments = np.concatenate(([0], bounds, [len(table)])).astype(np.int64)
    return initial, models, table, contents, segments


def _on_device(torch, initial, table, contents):
    """Targets (copies of ``initial``), group table, write table and contents on the GPU."""
    targets = [torch.from_numpy(a.copy()).cuda() for a in initial]
    group_table = make_group_table(
        [t.data_ptr() for t in targets],
        [a.shape[1] for a in initial],
        [a.itemsize for a in initial],
    )
    return (
        targets,
        torch.from_numpy(group_table).cuda(),
        torch.from_numpy(table).cuda(),
        torch.from_numpy(contents).cuda(),
    )


@pytest.mark.gpu
def test_direct_launch_writes_what_tritons_launcher_writes():
    # Disjoint writes: the launcher's one mode (the kernel's SERIAL mode is
    # apply_staged_writes', tested in test_kernels.py).
    torch = pytest.importorskip("torch")
    driver = get_vmm_driver("cuda:0")
    direct = CompiledLauncher(0, driver=driver)
    through_triton = CompiledLauncher(0, driver=driver, direct=False)
    rng = np.random.default_rng(11)
    stream = torch.cuda.current_stream().cuda_stream
    for trial in range(20):
        initial, models, table, contents, _ = _random_batch(rng, serial=False)
        results = []
        for launcher in (direct, through_triton):
            targets, group_table, write_table, device_contents = _on_device(
                torch, initial, table, contents
            )
            torch.cuda.synchronize()
            driver.ensure_context(0)
            launch = StagedLaunch(
                write_table.data_ptr(),
                group_table.data_ptr(),
                device_contents.data_ptr(),
                len(table),
            )
            launcher(launch, stream)
            torch.cuda.synchronize()
            results.append([t.cpu().numpy() for t in targets])
        assert direct.fallback_reason is None, direct.fallback_reason
        for got_direct, got_triton, model in zip(*results, models):
            np.testing.assert_array_equal(got_direct, got_triton, err_msg=f"trial {trial}")
            np.testing.assert_array_equal(got_direct, model, err_msg=f"trial {trial}")


@pytest.mark.gpu
def test_direct_launch_is_not_slower_than_tritons():
    torch = pytest.importorskip("torch")
    driver = get_vmm_driver("cuda:0")
    rng = np.random.default_rng(3)
    initial, _, table, contents, _ = _random_batch(rng, serial=False)
    targets, group_table, write_table, device_contents = _on_device(torch, initial, table, contents)
    stream = torch.cuda.current_stream().cuda_stream
    args = (
        StagedLaunch(
            write_table.data_ptr(),
            group_table.data_ptr(),
            device_contents.data_ptr(),
            len(table),
        ),
        stream,
    )
    medians = {}
    for direct in (True, False):
        launcher = CompiledLauncher(0, driver=driver, direct=direct)
        driver.ensure_context(0)
        launcher(*args)  # compile
        samples = []
        for _ in range(300):
            torch.cuda.synchronize()
            start = time.perf_counter_ns()
            launcher(*args)
            samples.append(time.perf_counter_ns() - start)
        medians[direct] = statistics.median(samples) * 1e-3
        if direct:
            assert launcher.fallback_reason is None, launcher.fallback_reason
    torch.cuda.synchronize()
    print(f"host time per launch: direct {medians[True]:.2f} µs, Triton {medians[False]:.2f} µs")
    assert medians[True] <= 1.1 * medians[False] + 0.5, medians
    assert medians[True] < 20, medians


@pytest.mark.gpu
def test_staged_apply_launches_directly():
    pytest.importorskip("torch")
    from jaxbuf.staged import StagedWriteTensor

    swt = StagedWriteTensor((8, 16), "int32", "cuda:0")
    try:
        swt.stage_write(3, 2, np.arange(5, dtype=np.int32))
        swt.apply_write()
        launch = swt._writer._launch
        assert getattr(launch, "fallback_reason", "not a CompiledLauncher") is None
        expected = np.zeros((8, 16), np.int32)
        expected[3, 2:7] = np.arange(5)
        np.testing.assert_array_equal(swt.to_torch().cpu().numpy(), expected)
    finally:
        swt.close()
