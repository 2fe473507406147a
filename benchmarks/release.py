"""An earlier commit's kvblocks, loaded beside today's in the same process, to time the two back to back.

A floor that shares code with kvblocks (its hashing, its packing) cannot see that code slow down; the
previous code can. :func:`load_commit` extracts ``kvblocks/`` of a commit (``git archive``) into a temporary
folder and imports it with ``sys.modules`` swapped, so that the old package's modules bind one another, then
puts today's back (:func:`tests.support.side_by_side.import_aside`). The old objects keep working afterwards:
every module they use was imported while the swap lasted (the package and the modules named in ``preload``).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.side_by_side import import_aside

ROOT = Path(__file__).resolve().parent.parent

RELEASE = "1b4e385"
"""The commit the per-call lifecycle is compared against (the issue that asks for it names it)."""

_loaded: dict[str, dict[str, ModuleType]] = {}
_folders: list[tempfile.TemporaryDirectory[str]] = []


def load_commit(commit: str, preload: tuple[str, ...] = ()) -> dict[str, ModuleType]:
    """``{module name: module}`` of kvblocks at ``commit`` (the package and ``preload``); skips the calling
    test when the commit is not in this checkout's history (a shallow clone)."""
    key = f"{commit}:{','.join(preload)}"
    if key in _loaded:
        return _loaded[key]
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "kvblocks"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"commit {commit} is not in this checkout's history: {e}")
    folder = tempfile.TemporaryDirectory(prefix=f"kvblocks-{commit}-")
    _folders.append(folder)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder.name, filter="data")
    old = import_aside(folder.name, preload=preload)
    if not str(Path(old["kvblocks"].__file__ or "")).startswith(folder.name):
        raise AssertionError(f"kvblocks at {commit} was not imported from its checkout")
    _loaded[key] = old
    return old
