"""Packaging promises: a light import, a typed package, a public API, a runnable main example."""

from __future__ import annotations

import ast
import importlib.resources
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import kvblocks

ROOT = Path(__file__).resolve().parents[2]
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


def bash_blocks(markdown: str) -> list[list[str]]:
    """The commands of each ```bash block, comments and blank lines dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL)
    return [[c for c in (line.split("  #")[0].strip() for line in b.splitlines()) if c] for b in blocks]


def run_lines(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_readme_opens_with_the_light_install_and_ci_runs_the_readme_s_commands_in_order() -> None:
    """The first command installs numpy and xxhash only (no CUDA torch for the main job); the test install sits
    under Develop after the CPU-torch line; .ci/run runs the same lines, a local CPU torch standing for that line."""
    readme = (ROOT / "README.md").read_text()
    (first, *_) = bash_blocks(readme)
    assert first == ["pip install -e . && kvblocks replay mooncake-conversation"]
    develop = bash_blocks(readme[readme.index("\n## Develop\n") :])[0]
    cpu_torch, *tests = develop
    assert cpu_torch == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert tests == ['pip install -e ".[test]"', "python -m pytest"]
    ci = run_lines((ROOT / ".ci" / "run").read_text())
    steps = [ci.index(line) for line in [*first, *tests]]  # each a whole line of the script, not a comment
    assert steps == sorted(steps)
    torch_first = [i for i, line in enumerate(ci) if re.fullmatch(r"pip install (--quiet )?torch==[\d.]+", line)]
    assert torch_first and torch_first[0] < steps[0]


def test_the_readme_s_benchmark_commands_say_how_long_show_progress_and_offer_a_quick_selection() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Measure\n") : readme.index("\n## Develop\n")]
    commands = [c for block in bash_blocks(section) for c in block]
    assert commands and all("--benchmark-enable" in c and c.split()[-1] == "-v" for c in commands)  # -v: progress
    whole = [c for c in commands if c.split()[3] == "benchmarks"]
    quick = [c for c in commands if c not in whole]
    assert whole and quick, commands
    for command in quick:  # a selection of benchmark files that exist
        files = [w for w in command.split() if w.startswith("benchmarks/")]
        assert files and all((ROOT / f).is_file() for f in files), command
    assert re.search(r"about a minute", section) and re.search(r"more than 10 minutes", section)


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
    "plot": (("matplotlib",), "kvblocks.cli.plot._plotter('curve.png')"),
    "transformers": (("transformers",), "import_module('kvblocks.integrations.transformers')"),
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


def build_sdist(out: Path) -> Path:
    """Build the sdist from a copy of the checkout, so that nothing is written into the checkout (two runs at
    once used to share its kvblocks.egg-info) and the build never changes this process's directory."""
    source = out / "source"
    junk = shutil.ignore_patterns(".git", "*.egg-info", "build", "dist", "__pycache__", ".*cache", ".hypothesis")
    shutil.copytree(ROOT, source, ignore=junk, symlinks=True)
    code = "import sys, setuptools.build_meta as b\nprint(b.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=source)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def checkout_state() -> dict[str, int]:
    """What a build writes in a source tree: its build/, dist/ and *.egg-info entries (path -> mtime)."""
    found = [p for name in ("build", "dist", "*.egg-info") for p in ROOT.glob(name)]
    return {str(p): p.stat().st_mtime_ns for top in found for p in [top, *top.rglob("*")]}


def test_the_sdist_carries_what_its_tests_need(tmp_path: Path) -> None:
    """An unpacked sdist collects every test without an error (it shipped test files without conftest)."""
    pytest.importorskip("setuptools.build_meta")
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "tests" / "conftest.py").is_file():
        pytest.skip("not a source checkout")
    before = checkout_state()
    sdist = build_sdist(tmp_path)
    assert checkout_state() == before  # built elsewhere: overlapping runs cannot trip over each other
    with tarfile.open(sdist) as packed:
        packed.extractall(tmp_path, filter="data")
    unpacked = tmp_path / sdist.name.removesuffix(".tar.gz")
    for needed in (
        "tests/conftest.py",
        "tests/support/examples.py",
        "docs/index.md",
        "examples/quickstart.py",
        "LICENSE",
    ):
        assert (unpacked / needed).is_file(), needed
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "tests", "benchmarks"],
        capture_output=True,
        text=True,
        cwd=unpacked,
    )
    assert done.returncode == 0 and "ERROR" not in done.stdout, done.stdout[-3000:]
    assert re.search(r"^\d+ tests collected", done.stdout, re.MULTILINE), done.stdout[-3000:]


def test_the_vllm_environment_takes_torch_s_cpu_build_from_pytorch_s_cpu_index(tmp_path: Path) -> None:
    """.ci/vllm_env.sh said "CPU build first" and asked plain pip for torch, which is a CUDA build on PyPI. Run
    it with a stand-in python3 that records every pip command."""
    bin_dir, log = tmp_path / "bin", tmp_path / "pip.log"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi\n'
        'echo "$*" >> "$PIP_LOG"\n'
    )
    fake.chmod(0o755)
    script = str(ROOT / ".ci" / "vllm_env.sh")
    if not Path(script).is_file():
        pytest.skip("not a source checkout")
    installs = {}
    for name, index in (("default", None), ("ci", "")):
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_LOG": str(log)}
        env.pop("KVBLOCKS_TORCH_INDEX", None)
        if index is not None:
            env["KVBLOCKS_TORCH_INDEX"] = index
        log.unlink(missing_ok=True)
        subprocess.run(["bash", script, str(tmp_path / name)], env=env, check=True, stdin=subprocess.DEVNULL)
        installs[name] = [line for line in log.read_text().splitlines() if " install torch==" in line]
    assert installs["default"] == [
        "-m pip --quiet install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    ]
    assert installs["ci"] == ["-m pip --quiet install torch==2.13.0"]  # CI: its CPU build from local disk
    assert 'KVBLOCKS_TORCH_INDEX="" .ci/vllm_env.sh' in (ROOT / ".ci" / "run").read_text()


def test_coverage_data_is_not_tracked_and_is_ignored() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert ".coverage" not in tracked.split()
    ignored = subprocess.run(["git", "check-ignore", "-q", ".coverage"], cwd=ROOT)
    assert ignored.returncode == 0
