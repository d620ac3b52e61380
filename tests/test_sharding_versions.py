"""JAX version floors: ``require_jax`` and the checks at each feature's entry.

An older JAX is simulated by monkeypatching ``jax.__version__`` (and ``jaxlib``'s): every entry
must raise ImportError naming the feature, the JAX release it needs and the one installed,
before any framework array is made. The declared floor of the ``jax`` extra in pyproject.toml
must match the floor the code enforces for the features every platform uses.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jaxbuf import ExtensibleTensor  # noqa: E402
from jaxbuf.devices import Device  # noqa: E402
from jaxbuf.drivers.base import K_DL_CUDA_HOST  # noqa: E402
from jaxbuf.interop.jax import JAX_FLOORS, JaxAdapter, require_jax, version_tuple  # noqa: E402
from jaxbuf.sharding import sharded_jax_array  # noqa: E402
from jaxbuf.views import BufferView  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cpu_buffer():
    buf = ExtensibleTensor(2 << 20, device="cpu")
    buf.resize_per_segment_(64, zero_new=True)
    yield buf
    buf.free()


def test_version_tuple_reads_releases_and_prereleases():
    assert version_tuple("0.10.2") == (0, 10, 2)
    assert version_tuple("0.5") == (0, 5, 0)
    assert version_tuple("0.4.36.dev20241122+g1234") == (0, 4, 36)
    assert version_tuple("0.11.0rc1") == (0, 11, 0)
    assert version_tuple("0.10.2") < version_tuple("0.10.10")  # numeric, not lexical
    with pytest.raises(ValueError, match="'nightly'"):
        version_tuple("nightly")


def test_require_jax_passes_on_the_installed_jax():
    require_jax("anything", jax.__version__)
    require_jax("anything", "0.4.0", jaxlib=True)
    for feature in ("to_jax", "sharded_jax_array"):  # what the suite runs on every platform
        require_jax(feature, JAX_FLOORS[feature])


def test_require_jax_names_feature_and_versions(monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.4.14")
    with pytest.raises(ImportError) as info:
        require_jax("Frobnicating", "0.4.30")
    message = str(info.value)
    for part in ("Frobnicating", "JAX >= 0.4.30", "JAX 0.4.14 is installed", "pip install"):
        assert part in message, message
    require_jax("Frobnicating", "0.4.14")  # equal is enough


def test_require_jax_checks_jaxlib_when_asked(monkeypatch):
    import jaxlib.version

    monkeypatch.setattr(jaxlib.version, "__version__", "0.4.1")
    require_jax("A pure Python feature", "0.4.2")  # jaxlib not consulted
    with pytest.raises(ImportError, match=r"jaxlib >= 0\.4\.2, but jaxlib 0\.4\.1"):
        require_jax("A jaxlib feature", "0.4.2", jaxlib=True)


def _forbid_imports(monkeypatch):
    """Fail the test if JAX is asked to import anything (the check must come first)."""
    import jax.dlpack

    def forbidden(*args, **kwargs):
        raise AssertionError("jax.dlpack.from_dlpack was called despite the version check")

    monkeypatch.setattr(jax.dlpack, "from_dlpack", forbidden)


def test_to_jax_entry_refuses_an_old_jax(monkeypatch, cpu_buffer):
    _forbid_imports(monkeypatch)
    monkeypatch.setattr(jax, "__version__", "0.4.14")
    adapter = JaxAdapter()  # a fresh adapter: the registry's has bound from_dlpack already
    with pytest.raises(ImportError, match=rf"to_jax.*{re.escape(JAX_FLOORS['to_jax'])}.*0\.4\.14"):
        adapter.from_view(cpu_buffer.segment_view(0))


def test_pinned_host_entry_refuses_an_old_jax(monkeypatch, cpu_buffer):
    _forbid_imports(monkeypatch)
    monkeypatch.setattr(jax, "__version__", "0.10.1")
    view = BufferView(
        cpu_buffer.base_ptr, 64, "uint8", device=Device("cpu"), dlpack_device_type=K_DL_CUDA_HOST
    )
    with pytest.raises(ImportError, match=r"pinned host.*JAX >= 0\.10\.2, but JAX 0\.10\.1"):
        JaxAdapter().from_view(view)


def test_sharded_jax_array_entry_refuses_an_old_jax(monkeypatch, cpu_buffer):
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    _forbid_imports(monkeypatch)
    monkeypatch.setattr(jax, "__version__", "0.4.0")
    floor = re.escape(JAX_FLOORS["sharded_jax_array"])
    with pytest.raises(ImportError, match=rf"Sharded JAX arrays.*JAX >= {floor}, but JAX 0\.4\.0"):
        sharded_jax_array([cpu_buffer], mesh, PartitionSpec("x"), "float32", (4,))
    monkeypatch.undo()
    a = sharded_jax_array([cpu_buffer], mesh, PartitionSpec("x"), "float32", (4,))
    assert a.shape == (4,)
    del a


def test_jax_extra_declares_the_enforced_floor():
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^jax = \["jax>=([\d.]+)", "jaxlib>=([\d.]+)"\]', text, re.MULTILINE)
    assert match, 'the jax extra must read: jax = ["jax>=X", "jaxlib>=X"]'
    assert match[1] == match[2]
    # The extra's floor is the newest of the floors every platform needs (to_jax, sharding).
    assert match[1] == max(
        (JAX_FLOORS["to_jax"], JAX_FLOORS["sharded_jax_array"]), key=version_tuple
    )
