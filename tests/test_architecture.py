"""The architecture, pinned: which module may import what, and adding a framework is one file.

* The library proper (``jaxbuf/`` minus the framework adapters of ``jaxbuf/interop/``, the
  benchmarks, the demo and the CLI) imports no torch, JAX or Triton, except that the JAX wings
  of staged writes and of the KV cache (``jaxbuf/staged/_jax_*``, ``jaxbuf/kv/_jax_*``)
  import JAX and each face (``jaxbuf/torch.py``, ``jaxbuf/jax.py``) its own framework; the
  kernels of ``kernels/`` (installed as ``jaxbuf.kernels``) may, and only they may import
  Triton.
* The faces sit above the buffers, staged writes and KV cache: they import only those, the
  views and the adapters, and nothing but the front ends imports them. Their names do not
  shadow the frameworks inside the package.
* ``kernels/`` takes pointers and arrays: it imports no jaxbuf owner (buffers, views, staged
  writes, framework adapters).
* No module of ``jaxbuf/`` or ``kernels/`` is over 600 lines.
* jaxbuf's own import graph (module-level and function-level imports, read with ``ast``) has
  no cycle; devices do not import drivers; drivers reach nothing but leaves; the adapters
  import only the drivers' base; nothing of the library proper reaches the benchmarks, the
  demo or the CLI.
* A framework registered with :func:`jaxbuf.interop.register` (a fake one made of numpy
  arrays) gets pool arrays, view exports and input conversion with no other file changed.

Graph conventions: ``from a import b`` is an edge to module ``a.b`` when that module exists,
else to ``a``; imports under ``if TYPE_CHECKING:`` do not run and are skipped; importing a
submodule runs its parent packages' ``__init__`` too, which the graph does not add (every
submodule would otherwise "import" ``jaxbuf/__init__``, which re-exports them all). The
built-in adapters are loaded by name (``importlib``) from ``jaxbuf/interop/__init__.py``,
which is why the adapters must not import anything above the drivers' base.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxbuf import interop
from jaxbuf.extensible import ExtensibleTensor
from jaxbuf.staged import StagedWriteTensor
from jaxbuf.uva import UvaBufferPool

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "jax", "jaxlib", "triton")
# Not the library proper: front ends and measurement, outside the import path of the rest.
FRONT_ENDS = ("jaxbuf.bench", "jaxbuf.cli", "jaxbuf.demo", "jaxbuf.__main__")
#: The faces, each with the framework it alone (besides the adapters) may import.
FACES = {"jaxbuf.torch": ("torch",), "jaxbuf.jax": ("jax", "jaxlib")}


def _module_files() -> dict[str, pathlib.Path]:
    """Module name -> source file, for jaxbuf/ and kernels/ (as jaxbuf.kernels)."""
    modules = {}
    for base, package in ((ROOT / "jaxbuf", "jaxbuf"), (ROOT / "kernels", "jaxbuf.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _module_files()
# C extensions (jaxbuf._capsule, jaxbuf._staging, jaxbuf.drivers._cuda_calls,
# jaxbuf.drivers._host_calls): leaves, named by their sources.
EXTENSIONS = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "jaxbuf").rglob("*.c")
}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement that runs (module-level or
    inside functions), resolved to absolute names; ``importlib.import_module("x")`` and
    ``__import__("x")`` with a constant count as imports of ``x``."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                is_module = child in MODULES or child in EXTENSIONS
                found.append((child if is_module else module, node.lineno))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.append((first.value, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


IMPORTS = {name: _imports(name) for name in MODULES}


def _graph() -> dict[str, set[str]]:
    """jaxbuf's modules and the jaxbuf modules each imports (the nearest existing one)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, imports in IMPORTS.items():
        for module, _ in imports:
            if module in EXTENSIONS:
                continue  # a C leaf
            while module and module not in MODULES:
                module = module.rpartition(".")[0]
            if module and module != name:
                graph[name].add(module)
    return graph


GRAPH = _graph()


def _reachable(start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in GRAPH[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _library_proper() -> list[str]:
    return [
        name
        for name in MODULES
        if not _under(name, ("jaxbuf.interop", "jaxbuf.kernels", *FRONT_ENDS))
    ]


def _is_jax_wing(name: str) -> bool:
    """The JAX wings of staged writes and of the KV cache: the only places outside the
    adapters that import JAX."""
    return name.startswith(("jaxbuf.staged._jax_", "jaxbuf.kv._jax_"))


#: What kernels/ must not import: every owner of memory or arrays, and the adapters.
OWNERS = (
    "jaxbuf.extensible",
    "jaxbuf.uva",
    "jaxbuf.views",
    "jaxbuf.staged",
    "jaxbuf.interop",
    "jaxbuf.sharing",
    "jaxbuf.sharding",
    "jaxbuf.transfer",
    "jaxbuf.jax_ops",
    "jaxbuf._reservation",
    "jaxbuf._segments",
    "jaxbuf._owner",
)


# -- (a) no framework imports outside the adapters and the launchers ---------------------------
def test_the_module_walk_sees_the_layout():
    for name in (
        "jaxbuf.views",
        "jaxbuf.interop.torch",
        "jaxbuf.drivers.cuda",
        "jaxbuf.kernels.staged_write",
        "jaxbuf.kernels.packed_write",
        "jaxbuf.staged._jax_apply",
    ):
        assert name in MODULES, sorted(MODULES)
    assert "jaxbuf.uva" in _library_proper()
    assert "jaxbuf.interop.jax" not in _library_proper()


@pytest.mark.parametrize("name", _library_proper())
def test_library_proper_imports_no_framework(name):
    allowed = ("jax", "jaxlib") if _is_jax_wing(name) else FACES.get(name, ())
    bad = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {module}"
        for module, line in IMPORTS[name]
        if module.split(".")[0] in FRAMEWORKS and module.split(".")[0] not in allowed
    ]
    assert not bad, "framework code belongs in jaxbuf/interop/ (or a kernel launcher):\n" + (
        "\n".join(bad)
    )


def test_the_jax_wing_is_seen():
    wing = [name for name in MODULES if _is_jax_wing(name)]
    assert {"jaxbuf.staged._jax_apply", "jaxbuf.staged._jax_ring"} <= set(wing), wing
    assert any(m.startswith("jax") for m, _ in IMPORTS["jaxbuf.staged._jax_apply"])


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, ("jaxbuf.kernels",))])
def test_kernels_import_no_owner(name):
    reached = sorted(m for m in _reachable(name) if _under(m, OWNERS))
    assert not reached, f"{name} (kernels take pointers and arrays) reaches {reached}"


def test_only_kernel_launchers_import_triton():
    bad = [
        f"{name}:{line}"
        for name, imports in IMPORTS.items()
        for module, line in imports
        if module.split(".")[0] == "triton" and not _under(name, ("jaxbuf.kernels",))
    ]
    assert not bad, f"Triton imported outside kernels/: {bad}"


# -- (b) the import graph ---------------------------------------------------------------------
def _cycle() -> list[str] | None:
    """One import cycle of the graph, as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    # Guards the walk itself: views imports interop at module level, devices imports it
    # inside Device.torch, the staged-write launchers import the kernels relatively.
    assert "jaxbuf.interop" in GRAPH["jaxbuf.views"]
    assert "jaxbuf.interop" in GRAPH["jaxbuf.devices"]
    assert "jaxbuf.kernels" in GRAPH["jaxbuf.staged._launch"]


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_devices_do_not_import_drivers():
    assert not [m for m in GRAPH["jaxbuf.devices"] if _under(m, ("jaxbuf.drivers",))]


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, ("jaxbuf.drivers",))])
def test_drivers_reach_only_leaves(name):
    # Drivers are the bottom layer: nothing they import (transitively) may be devices, views,
    # the adapters or any buffer module; only leaf helpers.
    forbidden = (
        "jaxbuf.devices",
        "jaxbuf.views",
        "jaxbuf.interop",
        "jaxbuf.dtypes",
        "jaxbuf.extensible",
        "jaxbuf.uva",
        "jaxbuf.staged",
        "jaxbuf.sharing",
    )
    reached = sorted(m for m in _reachable(name) if _under(m, forbidden))
    assert not reached, f"{name} reaches {reached}"


@pytest.mark.parametrize("name", [n for n in MODULES if _under(n, ("jaxbuf.interop",))])
def test_adapters_import_only_the_drivers_base(name):
    # The drivers' base and the leaf modules it uses (they import nothing of jaxbuf), and
    # _dlpack, a leaf too: the torch adapter imports views through its C exchange consumer.
    allowed = (
        "jaxbuf.interop",
        "jaxbuf.drivers.base",
        "jaxbuf._errors",
        "jaxbuf._lifetime",
        "jaxbuf._interrupts",
        "jaxbuf._dlpack",
    )
    reached = sorted(m for m in _reachable(name) if not _under(m, allowed))
    assert not reached, f"{name} reaches {reached}"


@pytest.mark.parametrize("name", _library_proper() + ["jaxbuf.interop", "jaxbuf.kernels"])
def test_library_proper_stays_out_of_front_ends(name):
    reached = sorted(m for m in _reachable(name) if _under(m, FRONT_ENDS))
    assert not reached, f"{name} reaches {reached}"


# -- the faces: the seeds' names with each framework's types, one layer below the front ends --
#: What a face may import: the layers it converts the results of, and the adapters.
FACE_IMPORTS = (
    "jaxbuf.extensible",
    "jaxbuf.uva",
    "jaxbuf.staged",
    "jaxbuf.kv",
    "jaxbuf.views",
    "jaxbuf.interop",
)


def test_the_faces_are_seen():
    assert set(FACES) <= set(MODULES), sorted(MODULES)
    assert set(FACES) <= set(_library_proper())


@pytest.mark.parametrize("name", sorted(FACES))
def test_faces_import_only_the_layers_they_convert(name):
    direct = sorted(m for m in GRAPH[name] if not _under(m, FACE_IMPORTS))
    assert not direct, f"{name} imports {direct}: a face converts, it has no logic of its own"


@pytest.mark.parametrize("name", sorted(set(MODULES) - set(FACES)))
def test_only_front_ends_reach_the_faces(name):
    if _under(name, FRONT_ENDS):
        return
    reached = sorted(m for m in _reachable(name) if m in FACES)
    assert not reached, f"{name} reaches {reached}: the faces sit above the library"


def test_no_module_reaches_a_face_where_it_means_the_framework():
    # ``from . import torch`` (or ``jax``) in jaxbuf/ is the face, not the framework: the
    # package's modules name the frameworks absolutely only.
    bad = [
        f"{name}:{line} imports {module}"
        for name, imports in IMPORTS.items()
        for module, line in imports
        if module in FACES and not _under(name, FRONT_ENDS)
    ]
    assert not bad, bad


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_face_without_its_framework_names_the_extra(framework):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{framework!r}] = None  # as if not installed
        try:
            import jaxbuf.{framework}
        except ImportError as error:
            assert "jaxbuf[{framework}]" in str(error), error
            print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_faces_do_not_shadow_the_frameworks():
    """Importing both faces first, the frameworks (and the adapters' imports of them) are
    still the installed packages."""
    code = textwrap.dedent(
        """
        import importlib, importlib.util
        for name in ("torch", "jax"):
            if importlib.util.find_spec(name) is None:
                continue
            face = importlib.import_module("jaxbuf." + name)  # the face first
            assert face.__name__ == "jaxbuf." + name, face
            module = importlib.import_module(name)
            assert module.__name__ == name and "jaxbuf" not in module.__file__, module
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# The modules that own memory through the public API: views sit below them (no upward arrow).
BUFFER_MODULES = (
    "jaxbuf.extensible",
    "jaxbuf.uva",
    "jaxbuf.staged",
    "jaxbuf.jax_ops",
    "jaxbuf.sharing",
    "jaxbuf.sharding",
)


@pytest.mark.parametrize("name", ["jaxbuf.views", "jaxbuf._segments", "jaxbuf._reservation"])
def test_views_and_the_virtual_buffer_reach_no_buffer_module(name):
    reached = sorted(m for m in _reachable(name) if _under(m, BUFFER_MODULES))
    assert not reached, f"{name} reaches {reached}"


# -- (d) modules a newcomer can hold in their head ----------------------------------------------
MAX_MODULE_LINES = 600


def test_the_size_rule_sees_kernels():
    assert "jaxbuf.kernels.staged_write" in MODULES and "jaxbuf.staged._fused" in MODULES


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_600_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{MODULES[name].relative_to(ROOT)} has {lines} lines (at most {MAX_MODULE_LINES}): "
        "split it by concept"
    )


# -- (c) a new framework is one adapter ---------------------------------------------------------
class FakeArray:
    """The whole "framework": an array is a wrapper over a numpy array."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype


class FakeAdapter(interop.Adapter):
    name = "fake"
    device_arrays = True  # its arrays may live where pools put them (here: the CPU)
    mutable_arrays = True

    def __init__(self) -> None:
        self.imports = 0

    def is_array(self, x):
        return isinstance(x, FakeArray)

    def to_numpy(self, x, *, device_copy=True):
        return x.data

    def from_view(self, view):
        self.imports += 1
        return FakeArray(np.from_dlpack(view))  # through DLPack, as a real framework would

    def host_array(self, array):
        return FakeArray(array)

    def array_device(self, x):
        return "cpu"

    def copy_into(self, out, source):
        np.copyto(out.data, source.data)
        return out

    def clone(self, array):
        return FakeArray(array.data.copy())


@pytest.fixture
def fake():
    adapter = interop.register(FakeAdapter())
    try:
        yield adapter
    finally:
        interop.unregister("fake")
    assert "fake" not in interop.names()


def test_a_pool_returns_the_registered_frameworks_arrays(fake):
    pool = UvaBufferPool((8, 2), "int32", device="cpu", framework="fake")
    try:
        rows = np.arange(6, dtype=np.int32).reshape(3, 2)
        out = pool.copy_to_uva(rows)
        assert isinstance(out, FakeArray) and out.shape == (3, 2)
        np.testing.assert_array_equal(out.data, rows)
        pool.slots[pool.current_slot].np[0, 0] = 42  # zero-copy: the array is the slot
        assert out.data[0, 0] == 42
        # Its arrays are inputs too, and copy_to_gpu clones and fills through the adapter.
        again = pool.copy_to_uva(FakeArray(np.full((2, 2), 7, np.int32)))
        np.testing.assert_array_equal(again.data, np.full((2, 2), 7))
        copy = pool.copy_to_gpu(rows)
        assert isinstance(copy, FakeArray)
        np.testing.assert_array_equal(copy.data, rows)
        target = FakeArray(np.zeros((3, 2), np.int32))
        assert pool.copy_to_gpu(rows + 1, out=target) is target
        np.testing.assert_array_equal(target.data, rows + 1)
        assert fake.imports >= 1
    finally:
        pool.close()


def test_a_view_exports_to_the_registered_framework(fake):
    buffer = ExtensibleTensor(2 << 20, device="cpu")
    try:
        buffer.resize_per_segment_(64, zero_new=True)
        view = buffer.segment_view(0).view("int32", (4, 4))
        array = fake.from_view(view)
        array.data[1, 2] = 5
        assert view.to_numpy()[1, 2] == 5  # the same bytes
        assert interop.adapter_for(array) is fake
        assert interop.get("fake") is fake
    finally:
        del view
        buffer.free()


def test_staged_writes_take_the_registered_frameworks_arrays(fake):
    swt = StagedWriteTensor((2, 4), "int32", device="cpu", backend="numpy")
    try:
        swt.stage_write(1, 1, FakeArray(np.array([1, 2, 3], np.int32)))
        swt.apply_write()
        np.testing.assert_array_equal(swt.to_numpy(), [[0, 0, 0, 0], [0, 1, 2, 3]])
    finally:
        swt.free()


def test_the_registry_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="taken"):
        interop.register(type("Torch", (FakeAdapter,), {"name": "torch"})())
    with pytest.raises(ValueError, match="taken"):
        interop.register(type("View", (FakeAdapter,), {"name": "view"})())
    with pytest.raises(TypeError, match="not a FrameworkAdapter"):
        interop.register(object())
    with pytest.raises(ValueError, match="no framework adapter named 'cupy'"):
        interop.get("cupy")
    with pytest.raises(ValueError, match="torch"):
        interop.unregister("torch")
    with pytest.raises(ValueError, match="framework"):
        UvaBufferPool(4, "int32", device="cpu", framework="numpy")  # no device arrays


def test_a_missing_framework_is_named_with_its_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # torch "not installed"
        import jaxbuf
        from jaxbuf import interop
        assert interop.adapter_for(object()) is None  # looking never needs torch
        try:
            interop.get("torch")
        except ImportError as error:
            print(error)
        try:
            jaxbuf.UvaBufferPool(4, "int32", device="cpu", framework="torch")
        except ImportError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("pip install jaxbuf[torch]" in line for line in lines), lines


# -- the owner contract ---------------------------------------------------------------------
def _owners():
    from jaxbuf.uva import NonUvaBuffer, UvaBuffer

    buffer = ExtensibleTensor(2 << 20, device="cpu")
    buffer.resize_per_segment_(64, zero_new=True)
    pool = UvaBufferPool((4, 2), "int32", device="cpu", buffer_cls=NonUvaBuffer)
    view = pool.copy_to_uva([[1, 2]])
    swt = StagedWriteTensor((2, 2), "int32", device="cpu", backend="numpy")
    return pool, [
        (buffer, buffer.segment_view(0)),
        (UvaBuffer(4, "int32", device="cpu"), None),
        (pool.slots[pool.current_slot], view),  # a pool slot (a NonUvaBuffer)
        (swt, swt.gpu),
    ]


def test_owners_implement_the_contract_views_use():
    from jaxbuf._owner import MemoryOwner

    pool, owners = _owners()
    for owner, view in owners:
        view = owner.view if view is None else view
        assert isinstance(view.owner, MemoryOwner), type(view.owner)
        assert isinstance(owner, MemoryOwner), type(owner)
        assert view.owner.driver is owner.driver
        assert owner.ready_event is None or owner.device.is_cuda  # CPU work is synchronous
        owner.check_exportable()
        assert owner.export_anchor is not None
        owner.free()
        with pytest.raises(RuntimeError, match="freed"):
            owner.check_exportable()
    pool.close()
