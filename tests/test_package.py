"""Packaging promises: a light import, a typed package, a public API, a runnable main example."""

from __future__ import annotations

import ast
import importlib.resources
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import kvblocks

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "redis", "prometheus_client", "zmq", "msgpack", "msgspec", "transformers", "tqdm", "matplotlib")


def test_import_does_not_load_heavy_optional_modules() -> None:
    code = (
        "import sys, kvblocks, kvblocks.backends, kvblocks.tiers, kvblocks.cli\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_package_ships_py_typed() -> None:
    assert importlib.resources.files("kvblocks").joinpath("py.typed").is_file()


def test_all_lists_exactly_the_public_names() -> None:
    assert len(set(kvblocks.__all__)) == len(kvblocks.__all__)
    for name in kvblocks.__all__:
        assert getattr(kvblocks, name) is not None
    for contract in ("KVCacheManager", "CachedTokens", "block_hashes", "BlockPool", "PrefixTree", "EventSink"):
        assert contract in kvblocks.__all__


def test_readme_starts_with_the_two_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    block = readme[readme.index("```bash") + 1 : readme.index("```bash") + 3]
    install, tests = (line.split("#")[0].strip() for line in block)
    ci = (ROOT / ".ci" / "run").read_text()
    assert install in ci and tests in ci
    assert ci.index(install) < ci.index(tests)


def test_main_example_runs_and_reports_shared_prefix_hits() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, check=True
    ).stdout
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if ":" in line}
    assert "cached    0" in lines["alice-1"]  # the first request finds nothing
    assert "cached    0" not in lines["bob-1"]  # the second shares the system prompt
    assert "admitted 3 requests" in out


# ---------------------------------------------------------------- install and packaging


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _imported_top_level_modules() -> set[str]:
    """Every top-level module some file of the package imports (lazily or not)."""
    found: set[str] = set()
    for path in (ROOT / "kvblocks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
            elif (  # importlib.import_module("matplotlib"), as the CLI loads its plot backend
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(str(node.args[0].value).split(".")[0])
    return found


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def test_every_declared_dependency_is_imported_and_torch_is_an_extra() -> None:
    project = _pyproject()["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    imported = {name.lower() for name in _imported_top_level_modules()}
    assert core <= imported, f"declared but never imported: {core - imported}"
    assert not core & {"torch", "tqdm", "redis", "prometheus_client", "matplotlib"}, "heavy packages are extras"
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    assert extras["torch"] == {"torch"} and extras["progress"] == {"tqdm"}
    test_extra = " ".join(project["optional-dependencies"]["test"])
    assert "torch" in test_extra and "progress" in test_extra  # the tests exercise both
    for name in ("torch", "tqdm", "redis", "prometheus_client", "matplotlib"):
        assert name in imported and any(name in reqs for reqs in extras.values()), name


def test_license_classifiers_and_urls_use_the_current_metadata_forms() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table form
    assert project["license-files"] == ["LICENSE"]
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]  # superseded by the expression
    lowest = int(project["requires-python"].removeprefix(">=3."))
    versions = {c.rsplit(" ", 1)[1] for c in project["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)}
    assert f"3.{lowest}" in versions and f"3.{sys.version_info.minor}" in versions
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(project["urls"])


def test_backends_without_torch_raise_one_error_naming_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if PyTorch were not installed\n"
        "import kvblocks, kvblocks.backends, kvblocks.tiers\n"
        "from kvblocks.backends import KVCacheSpec  # plain Python: no torch needed\n"
        "KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype='float16', block_size=4).bytes_per_block\n"
        "from importlib import import_module as load_module\n"
        "for load in (lambda: kvblocks.backends.get_backend, lambda: load_module('kvblocks.backends.cpu'),\n"
        "             lambda: kvblocks.tiers.TransferExecutor):\n"
        "    try:\n"
        "        load()\n"
        "    except kvblocks.BackendUnavailableError as error:\n"
        "        print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 3 and all('"kvblocks[torch]"' in line for line in lines), out


MISSING_EXTRAS = {  # extra -> (modules it installs, a call that needs them)
    "torch": (("torch",), "import_module('kvblocks.backends.cpu')"),
    "prometheus": (("prometheus_client",), "kvblocks.metrics.KVBlocksCollector()"),
    "redis": (("redis",), "kvblocks.tiers.redis_storage.RedisStorage('redis://127.0.0.1:9/0')"),
    "zmq": (("zmq", "msgspec"), "kvblocks.interop.zmq_events.ZmqEventPublisher('tcp://127.0.0.1:0')"),
    "vllm": (("vllm",), "kvblocks.integrations.vllm.KVBlocksConnector"),
    "plot": (("matplotlib",), "kvblocks.cli._plotter('curve.png')"),
}


@pytest.mark.parametrize("extra", sorted(MISSING_EXTRAS))
def test_a_missing_extra_raises_one_error_class_naming_the_extra(extra: str) -> None:
    """Every "install kvblocks[X]" is a MissingExtraError, which is a ConfigError and a BackendUnavailableError."""
    modules, call = MISSING_EXTRAS[extra]
    code = (
        "import sys\n"
        f"for name in {modules!r}:\n"
        "    sys.modules[name] = None  # as if it were not installed\n"
        "from importlib import import_module\n"
        "import kvblocks, kvblocks.cli, kvblocks.metrics, kvblocks.interop.zmq_events, kvblocks.tiers.redis_storage\n"
        "import kvblocks.integrations.vllm\n"
        "try:\n"
        f"    {call}\n"
        "except kvblocks.MissingExtraError as error:\n"
        "    assert isinstance(error, kvblocks.ConfigError) and isinstance(error, kvblocks.BackendUnavailableError)\n"
        "    print(type(error).__name__, error.extra, error, sep='|')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    name, named, message = done.stdout.strip().split("|")
    assert (name, named) == ("MissingExtraError", extra)
    assert f'pip install "kvblocks[{extra}]"' in message
    assert "MissingExtraError" in kvblocks.__all__


def test_the_main_job_runs_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from kvblocks.cli import main\n"
        "sys.exit(main(['replay', sys.argv[1]]))\n"
    )
    trace = ROOT / "tests" / "data" / "mooncake_conversation_head1000.jsonl"
    done = subprocess.run([sys.executable, "-c", code, str(trace)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "hit rate" in done.stdout.lower()


def test_the_sdist_carries_what_its_tests_need(tmp_path: Path) -> None:
    """An unpacked sdist collects every test without an error (it shipped test files without conftest)."""
    build_meta = pytest.importorskip("setuptools.build_meta")
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "tests" / "conftest.py").is_file():
        pytest.skip("not a source checkout")
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)
        name = build_meta.build_sdist(str(tmp_path))
    finally:
        os.chdir(cwd)
    with tarfile.open(tmp_path / name) as sdist:
        sdist.extractall(tmp_path, filter="data")
    unpacked = tmp_path / name.removesuffix(".tar.gz")
    for needed in ("tests/conftest.py", "tests/examples.py", "docs/index.md", "examples/quickstart.py", "LICENSE"):
        assert (unpacked / needed).is_file(), needed
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "tests", "benchmarks"],
        capture_output=True,
        text=True,
        cwd=unpacked,
    )
    assert done.returncode == 0 and "ERROR" not in done.stdout, done.stdout[-3000:]
    assert re.search(r"^\d+ tests collected", done.stdout, re.MULTILINE), done.stdout[-3000:]


def test_coverage_data_is_not_tracked_and_is_ignored() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert ".coverage" not in tracked.split()
    ignored = subprocess.run(["git", "check-ignore", "-q", ".coverage"], cwd=ROOT)
    assert ignored.returncode == 0
