"""Packaging promises: a light import, a typed package, a public API, a runnable main example."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import kvblocks

ROOT = Path(__file__).resolve().parent.parent


def test_import_does_not_load_heavy_optional_modules() -> None:
    code = (
        "import sys, kvblocks, kvblocks.backends\n"
        "heavy = [m for m in ('torch', 'redis', 'prometheus_client') if m in sys.modules]\n"
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
