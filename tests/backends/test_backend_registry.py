"""Backend selection: auto order, device strings, unavailable backends, XPU detection, plugins."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvblocks.backends import (
    CPUBackend,
    CUDABackend,
    XPUBackend,
    available_backends,
    get_backend,
    register_backend,
    registry,
    xpu,
)
from kvblocks.backends.base import TorchBackend
from kvblocks.errors import BackendUnavailableError, ConfigError

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    return registry


class FakeXPU(types.ModuleType):
    """A stand-in for ``torch.xpu`` that reports a device."""

    def __init__(self, available: bool) -> None:
        super().__init__("torch.xpu")
        self._available = available

    def is_available(self) -> bool:
        return self._available


@needs_no_gpu
def test_auto_falls_back_to_cpu_without_accelerators(monkeypatch) -> None:
    monkeypatch.setattr(xpu, "xpu_status", lambda: (False, "simulated"))
    assert isinstance(get_backend("auto"), CPUBackend)
    assert isinstance(get_backend(), CPUBackend)


def test_auto_prefers_cuda_then_xpu(monkeypatch, clean_registry) -> None:
    picked = []

    def fake(name: str, available: bool) -> type:
        class Fake(TorchBackend):
            @classmethod
            def is_available(cls) -> bool:
                return available

            def __init__(self, device: str = "cpu") -> None:
                picked.append(name)
                super().__init__("cpu")

        return Fake

    monkeypatch.setattr(
        registry, "_builtin", lambda: {"cpu": fake("cpu", True), "cuda": fake("cuda", True), "xpu": fake("xpu", True)}
    )
    get_backend("auto")
    monkeypatch.setattr(
        registry, "_builtin", lambda: {"cpu": fake("cpu", True), "cuda": fake("cuda", False), "xpu": fake("xpu", True)}
    )
    get_backend("auto")
    monkeypatch.setattr(
        registry, "_builtin", lambda: {"cpu": fake("cpu", True), "cuda": fake("cuda", False), "xpu": fake("xpu", False)}
    )
    get_backend("auto")
    assert picked == ["cuda", "xpu", "cpu"]


@needs_no_gpu
def test_cuda_without_a_gpu_says_why() -> None:
    assert CUDABackend.is_available() is False
    with pytest.raises(BackendUnavailableError, match="CUDA is unavailable"):
        get_backend("cuda")
    with pytest.raises(BackendUnavailableError):
        get_backend("cuda:1")
    with pytest.raises(BackendUnavailableError):
        CUDABackend()


def test_unknown_names_and_bad_indexes(clean_registry) -> None:
    with pytest.raises(ConfigError, match="unknown backend 'tpu'"):
        get_backend("tpu")
    with pytest.raises(ConfigError, match="device index"):
        get_backend("cpu:x")
    for bad in ("", None, 3):
        with pytest.raises(ConfigError):
            get_backend(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- XPU: every way it can be present or not


def test_xpu_native(monkeypatch) -> None:
    monkeypatch.setattr(torch, "xpu", FakeXPU(True), raising=False)
    assert xpu.xpu_status() == (True, "native torch.xpu")
    assert XPUBackend.is_available()


def test_xpu_provided_by_ipex(monkeypatch) -> None:
    monkeypatch.delattr(torch, "xpu", raising=False)
    ipex = types.ModuleType(xpu.IPEX_MODULE)
    monkeypatch.setitem(sys.modules, xpu.IPEX_MODULE, ipex)

    def import_module(name: str):
        assert name == xpu.IPEX_MODULE
        torch.xpu = FakeXPU(True)  # importing ipex installs torch.xpu
        return ipex

    monkeypatch.setattr(xpu.importlib, "import_module", import_module)
    available, how = xpu.xpu_status()
    monkeypatch.delattr(torch, "xpu", raising=False)
    assert available and how == "torch.xpu provided by intel_extension_for_pytorch"


def test_xpu_missing_everything_names_what_is_missing(monkeypatch) -> None:
    monkeypatch.delattr(torch, "xpu", raising=False)

    def import_module(name: str):
        raise ImportError(name)

    monkeypatch.setattr(xpu.importlib, "import_module", import_module)
    assert xpu.xpu_status() == (
        False,
        f"torch {torch.__version__} has no torch.xpu and intel_extension_for_pytorch is not installed",
    )
    with pytest.raises(BackendUnavailableError, match="intel_extension_for_pytorch is not installed"):
        get_backend("xpu")


def test_xpu_present_but_no_device(monkeypatch) -> None:
    monkeypatch.setattr(torch, "xpu", FakeXPU(False), raising=False)
    monkeypatch.setattr(xpu.importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError(name)))
    assert xpu.xpu_status() == (False, "torch.xpu sees no XPU device and intel_extension_for_pytorch is not installed")

    monkeypatch.setattr(xpu.importlib, "import_module", lambda name: types.ModuleType(name))
    assert xpu.xpu_status() == (False, "intel_extension_for_pytorch is installed but no XPU device is visible")


# ---------------------------------------------------------------- third parties


def test_register_backend_in_process(clean_registry) -> None:
    class Custom(CPUBackend):
        name = "custom"

        def __init__(self, device: str = "custom:0") -> None:  # the factory receives the device string
            self.requested = device
            super().__init__("cpu")

    register_backend("custom", Custom)
    assert isinstance(get_backend("custom"), Custom)
    assert get_backend("custom:2").requested == "custom:2"
    assert available_backends()["custom"] is True
    with pytest.raises(ConfigError, match="already registered"):
        register_backend("custom", Custom)
    register_backend("custom", Custom, replace=True)
    for name in ("", "a:b", "auto", 5):
        with pytest.raises(ConfigError):
            register_backend(name, Custom)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not callable"):
        register_backend("other", 5)  # type: ignore[arg-type]


class _EntryPoint:
    def __init__(self, name: str, target) -> None:
        self.name = name
        self._target = target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target

    def __repr__(self) -> str:
        return f"EntryPoint({self.name!r})"


def test_entry_point_backends_load_lazily(monkeypatch, clean_registry) -> None:
    class Plugin(CPUBackend):
        name = "plugin"

    loads = []

    class Counting(_EntryPoint):
        def load(self):
            loads.append(self.name)
            return super().load()

    monkeypatch.setattr(
        registry,
        "entry_points",
        lambda group: (
            [Counting("plugin", Plugin), Counting("broken", ImportError("no module named acme"))]
            if group == registry.ENTRY_POINT_GROUP
            else []
        ),
    )
    assert isinstance(get_backend("plugin"), Plugin)
    assert loads == ["plugin"]  # 'broken' was never imported
    with pytest.raises(BackendUnavailableError, match=r"'broken'.*no module named acme"):
        get_backend("broken")
