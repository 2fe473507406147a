"""kvblocks.native: which hot modules run compiled, the switch that turns them off, and the stale-build guard."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvblocks import native

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def fake_package(tmp_path: Path, *, built: bool = True, record: bool = True) -> Path:
    """A package folder holding core/pool.py, a stand-in extension beside it and the build's record."""
    source = tmp_path / "core" / "pool.py"
    source.parent.mkdir(parents=True)
    source.write_text("X = 1\n")
    if built:
        (tmp_path / "core" / f"pool{SUFFIX}").write_bytes(b"not really an extension")
    if record:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        (tmp_path / native.BUILD_RECORD).write_text(json.dumps({"sources": {"kvblocks.core.pool": digest}}))
    return source


def test_a_current_extension_is_left_to_pythons_own_finders(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.PURE_PYTHON_ENV, raising=False)
    fake_package(tmp_path)
    assert native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool") is None


def test_an_edited_source_runs_from_source_until_rebuilt(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.PURE_PYTHON_ENV, raising=False)
    source = fake_package(tmp_path)
    source.write_text("X = 2\n")
    spec = native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool")
    assert spec is not None and spec.origin == str(source)
    assert isinstance(spec.loader, importlib.machinery.SourceFileLoader)


@pytest.mark.parametrize("value", ["1", "yes", "true"])
def test_the_switch_sends_a_built_module_to_its_source(tmp_path, monkeypatch, value: str) -> None:
    monkeypatch.setenv(native.PURE_PYTHON_ENV, value)
    source = fake_package(tmp_path)
    spec = native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool")
    assert spec is not None and spec.origin == str(source)


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_the_switch_off(monkeypatch, value: str) -> None:
    monkeypatch.setenv(native.PURE_PYTHON_ENV, value)
    assert not native.pure_python_requested()


def test_modules_that_are_not_built_or_not_ours_are_not_touched(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(native.PURE_PYTHON_ENV, "1")
    fake_package(tmp_path, built=False)
    (tmp_path / "config.py").write_text("")
    finder = native.HotModuleFinder(tmp_path)
    assert finder.find_spec("kvblocks.core.pool") is None
    assert finder.find_spec("kvblocks.config") is None
    assert finder.find_spec("json") is None


def test_another_checkouts_module_is_not_touched(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(native.PURE_PYTHON_ENV, "1")
    fake_package(tmp_path)
    finder = native.HotModuleFinder(tmp_path)
    assert finder.find_spec("kvblocks.core.pool", [str(tmp_path / "elsewhere" / "core")]) is None
    assert finder.find_spec("kvblocks.core.pool", [str(tmp_path / "core")]) is not None


def test_a_leftover_extension_the_last_build_did_not_compile_runs_from_source(tmp_path, monkeypatch) -> None:
    """A module dropped from the compiled list keeps its old extension in an editable checkout: not used."""
    monkeypatch.delenv(native.PURE_PYTHON_ENV, raising=False)
    fake_package(tmp_path)
    walk = tmp_path / "routing" / "walk.py"
    walk.parent.mkdir()
    walk.write_text("")
    (tmp_path / "routing" / f"walk{SUFFIX}").write_bytes(b"left over")
    spec = native.HotModuleFinder(tmp_path).find_spec("kvblocks.routing.walk")
    assert spec is not None and spec.origin == str(walk)


def test_a_missing_or_damaged_record_trusts_the_build(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.PURE_PYTHON_ENV, raising=False)
    fake_package(tmp_path, record=False)
    assert native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool") is None
    damaged_records = ("{", "[1]", '{"sources": 3}', '{"sources": {"kvblocks.core.pool": 7}}', "[" * 100_000)
    for damaged in damaged_records:
        (tmp_path / native.BUILD_RECORD).write_text(damaged)
        assert native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool") is None, damaged


def test_a_record_that_does_not_name_a_built_module_is_a_stale_build(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.PURE_PYTHON_ENV, raising=False)
    fake_package(tmp_path, record=False)
    (tmp_path / native.BUILD_RECORD).write_text(json.dumps({"sources": {"kvblocks.core.step": "00"}}))
    assert native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool") is not None


def test_installing_the_finder_twice_keeps_one() -> None:
    native.install_finder()
    native.install_finder()
    ours = [f for f in sys.meta_path if getattr(f, "kvblocks_hot_module_finder", False)]
    assert len(ours) == 1 and sys.meta_path[0] is ours[0]


def test_status_accounts_for_every_hot_module() -> None:
    state = native.status()
    assert sorted([*state.compiled, *state.pure]) == sorted(native.COMPILED_MODULES)
    for name in state.compiled:
        assert not sys.modules[name].__file__.endswith(".py")
    for name, reason in state.pure.items():
        assert sys.modules[name].__file__.endswith(".py")
        assert reason in ("not built", "source changed since the build", native.PURE_PYTHON_ENV)


def test_status_lines() -> None:
    every = native.NativeStatus(("a", "b"), {})
    assert (every.implementation, str(every)) == ("compiled", "compiled: 2 hot modules, Cython")
    none = native.NativeStatus((), {"a": "not built", "b": "not built"})
    assert (none.implementation, str(none)) == ("pure Python", "pure Python: not built")
    some = native.NativeStatus(("a",), {"b": "source changed since the build"})
    assert some.implementation == "partly compiled"
    assert str(some) == "partly compiled: 1 of 2 hot modules (the rest: source changed since the build)"


def test_the_pure_switch_reaches_a_fresh_process() -> None:
    env = {**os.environ, native.PURE_PYTHON_ENV: "1"}
    code = "from kvblocks import native; s = native.status(); print(s.implementation, len(s.compiled))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["pure", "Python", "0"]


def test_every_listed_hot_module_exists_and_imports_nothing_heavy() -> None:
    for name in native.COMPILED_MODULES:
        assert ROOT.joinpath(*name.split(".")).with_suffix(".py").is_file(), name
    code = "import kvblocks, sys; print(sorted({'torch', 'redis', 'zmq', 'msgpack', 'Cython'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def run_build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """setup.py's build_ext into a scratch folder (the checkout's in-place extensions untouched)."""
    return subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "tmp"),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="no setup.py: not a source checkout")
def test_a_pure_build_compiles_nothing(tmp_path) -> None:
    done = run_build(tmp_path, KVBLOCKS_PURE_PYTHON="1")
    assert done.returncode == 0, done.stderr
    assert "installing pure Python" in done.stderr
    assert not list(tmp_path.rglob(f"*{SUFFIX}"))


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="no setup.py: not a source checkout")
def test_a_build_without_a_working_compiler_falls_back_to_pure_python(tmp_path) -> None:
    pytest.importorskip("Cython")
    done = run_build(tmp_path, CC=str(tmp_path / "no-such-compiler"), KVBLOCKS_PURE_PYTHON="")
    assert done.returncode == 0, done.stderr
    assert "could not compile the hot modules" in done.stderr and "installing pure Python" in done.stderr
    assert not (tmp_path / "lib" / "kvblocks" / native.BUILD_RECORD).exists()


def test_an_edited_declaration_file_makes_the_extension_stale(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.PURE_PYTHON_ENV, raising=False)
    source = fake_package(tmp_path)
    (tmp_path / native.BUILD_RECORD).write_text(
        json.dumps({"sources": {"kvblocks.core.pool": native.source_digest(source)}})
    )
    assert native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool") is None
    source.with_suffix(".pxd").write_text("cdef class BlockPool:\n    pass\n")
    assert native.HotModuleFinder(tmp_path).find_spec("kvblocks.core.pool") is not None


def test_the_builds_record_is_what_the_finder_computes() -> None:
    """The record setup.py wrote holds what the finder computes for today's sources (a current build)."""
    record_path = ROOT / "kvblocks" / native.BUILD_RECORD
    state = native.status()
    if not record_path.is_file() or state.pure:
        pytest.skip("no current compiled build in this checkout")
    record = json.loads(record_path.read_text())["sources"]
    for name in native.COMPILED_MODULES:
        source = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        assert record[name] == native.source_digest(source), name
