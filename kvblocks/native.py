"""Which of kvblocks' hot modules run compiled, and the switch that turns the compiled ones off.

The hot paths (the manager's step and per-call bookkeeping, the block pool, the prefix tree, chained hashing and
the router's holder index) are ordinary Python modules. Where a C compiler exists, installing kvblocks also
compiles each of them with Cython into an extension module beside its source (``pool.py`` ->
``pool.cpython-312-x86_64-linux-gnu.so``); Python then imports the extension. The Python source stays the one
reference for behaviour: the extension is built from it unchanged, and :mod:`tests.native` drives both with the
same operations and compares every result.

The extension is not used (its module runs from source) when:

* ``KVBLOCKS_PURE_PYTHON=1`` is set when the module is imported (or when kvblocks is installed: nothing is
  compiled then);
* its source changed since it was built (an editable install edited in place): the build records each
  source's SHA-256 in ``_native_build.json``, and a module whose source no longer matches runs from source,
  until ``pip install -e .`` builds it again.

>>> from kvblocks import native
>>> native.status().implementation in ("compiled", "partly compiled", "pure Python")
True

This module imports only the standard library. Importing it (``import kvblocks`` does, before anything else)
installs :class:`HotModuleFinder`.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = [
    "BUILD_RECORD",
    "COMPILED_MODULES",
    "PURE_PYTHON_ENV",
    "HotModuleFinder",
    "NativeStatus",
    "describe",
    "install_finder",
    "pure_python_requested",
    "status",
]

PURE_PYTHON_ENV = "KVBLOCKS_PURE_PYTHON"
"""Set to ``1`` to run every hot module from its Python source (at install: build nothing)."""

BUILD_RECORD = "_native_build.json"
"""The file, in the package folder, in which the build records each compiled module's source digest."""

COMPILED_MODULES: tuple[str, ...] = (
    "kvblocks.accounting",
    "kvblocks.attention.step_metadata",
    "kvblocks.core.admission",
    "kvblocks.core.coordinator",
    "kvblocks.core.eviction",
    "kvblocks.core.groups.block_index",
    "kvblocks.core.groups.full_group",
    "kvblocks.core.groups.hits",
    "kvblocks.core.groups.local_group",
    "kvblocks.core.groups.rules",
    "kvblocks.core.groups.sliding_window",
    "kvblocks.core.groups.sources",
    "kvblocks.core.manager",
    "kvblocks.core.manager_tiers",
    "kvblocks.core.pool",
    "kvblocks.core.prefix_tree",
    "kvblocks.core.sequence",
    "kvblocks.core.step",
    "kvblocks.hashing.hasher",
    "kvblocks.hashing.schemes",
    "kvblocks.hashing.tokens",
    "kvblocks.routing.holder_index",
    "kvblocks.routing.holders",
    "kvblocks.routing.interned",
    "kvblocks.routing.router",
    "kvblocks.routing.table",
    "kvblocks.tiers.host",
    "kvblocks.tiers.pending",
    "kvblocks.tiers.stack",
    "kvblocks.tiers.tiering",
)
"""The modules the build compiles (setup.py reads this tuple), in no particular order.

Not ``kvblocks.routing.walk``: its probes are closures, which run slower compiled than in CPython (a route by
hashes with a 127-block hit took 1.3x as long), and its cost is a handful of probes per route."""

_PACKAGE_DIR = Path(__file__).resolve().parent


def pure_python_requested() -> bool:
    """Whether ``KVBLOCKS_PURE_PYTHON`` asks for pure Python (any value but empty, ``0``, ``false``, ``no``)."""
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() not in ("", "0", "false", "no")


def source_digest(path: Path) -> str:
    """SHA-256 of a module's source and of its Cython declarations (``.pxd`` beside it, if any), as the build
    records it: an edit of either makes the extension stale."""
    digest = hashlib.sha256(path.read_bytes())
    declarations = path.with_suffix(".pxd")
    if declarations.is_file():
        digest.update(b"\0")
        digest.update(declarations.read_bytes())
    return digest.hexdigest()


class HotModuleFinder:
    """A ``sys.meta_path`` finder that sends a kvblocks module to its Python source when it must not run compiled.

    It looks at every ``kvblocks.*`` module that has an extension beside its source (a hot module, or one a
    previous build compiled and the list no longer names). For every other module, and for an extension that
    is current, it answers None and Python's own finders import as usual (an extension module wins over a
    source file of the same name).
    """

    kvblocks_hot_module_finder = True

    def __init__(self, package_dir: Path = _PACKAGE_DIR) -> None:
        self._package_dir = package_dir
        self._record: dict[str, str] | None = None

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("kvblocks."):
            return None
        source = self._package_dir.joinpath(*fullname.split(".")[1:]).with_suffix(".py")
        if path is not None and not _names_folder(path, source.parent):
            return None  # another kvblocks (another checkout, imported aside): not this package's module
        if not source.is_file() or not _has_extension(source):
            return None  # nothing compiled (or no source to fall back on): the usual import
        if pure_python_requested() or self.stale(fullname, source):
            return importlib.util.spec_from_file_location(fullname, source)
        return None

    def stale(self, fullname: str, source: Path) -> bool:
        """Whether ``source`` changed since its extension was built (no record: the build is trusted)."""
        record = self._build_record()
        built = record.get(fullname)
        if built is None:
            return bool(record)  # the last build did not compile it: a leftover of an earlier one
        try:
            return source_digest(source) != built
        except OSError:
            return True

    def _build_record(self) -> dict[str, str]:
        if self._record is None:
            try:
                loaded = json.loads((self._package_dir / BUILD_RECORD).read_text())
            except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON, nested too deep
                loaded = {}
            digests = loaded.get("sources") if isinstance(loaded, dict) else None
            self._record = (
                {k: v for k, v in digests.items() if isinstance(k, str) and isinstance(v, str)}
                if isinstance(digests, dict)
                else {}
            )
        return self._record


def _names_folder(path: object, folder: Path) -> bool:
    try:
        return any(Path(str(entry)).resolve() == folder for entry in path)  # type: ignore[attr-defined]
    except (TypeError, OSError):
        return False


def _has_extension(source: Path) -> bool:
    stem = source.with_suffix("")
    return any(Path(f"{stem}{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def install_finder() -> HotModuleFinder:
    """Put a :class:`HotModuleFinder` first in ``sys.meta_path`` (replacing one installed before)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "kvblocks_hot_module_finder", False)]
    finder = HotModuleFinder()
    sys.meta_path.insert(0, finder)
    return finder


@dataclass(frozen=True)
class NativeStatus:
    """Which hot modules this process runs compiled, and why the others are not.

    ``compiled``: loaded from an extension module. ``pure``: running from source, each with its reason
    (``"KVBLOCKS_PURE_PYTHON"``, ``"not built"`` or ``"source changed since the build"``).
    """

    compiled: tuple[str, ...]
    pure: dict[str, str]

    @property
    def implementation(self) -> str:
        """``"compiled"`` (every hot module), ``"partly compiled"`` or ``"pure Python"``."""
        if not self.compiled:
            return "pure Python"
        return "compiled" if not self.pure else "partly compiled"

    def __str__(self) -> str:
        total = len(self.compiled) + len(self.pure)
        if not self.pure:
            return f"compiled: {total} hot modules, Cython"
        reasons = ", ".join(sorted(set(self.pure.values())))
        if not self.compiled:
            return f"pure Python: {reasons}"
        return f"partly compiled: {len(self.compiled)} of {total} hot modules (the rest: {reasons})"


def status() -> NativeStatus:
    """Import the hot modules (kvblocks' core imports them anyway) and report how each one runs."""
    compiled: list[str] = []
    pure: dict[str, str] = {}
    finder = next((f for f in sys.meta_path if isinstance(f, HotModuleFinder)), HotModuleFinder())
    for name in COMPILED_MODULES:
        module = importlib.import_module(name)
        origin = str(getattr(module, "__file__", "") or "")
        if origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            compiled.append(name)
            continue
        source = Path(origin)
        if not _has_extension(source):
            pure[name] = "not built"
        elif finder.stale(name, source):
            pure[name] = "source changed since the build"
        else:
            pure[name] = PURE_PYTHON_ENV
    return NativeStatus(tuple(compiled), pure)


def describe() -> str:
    """One line for ``kvblocks --version``: how the hot modules run."""
    return str(status())


if __name__ == "kvblocks.native":  # setup.py loads this file on its own, to read the list: no finder there
    install_finder()  # before any hot module is imported: kvblocks/__init__.py imports this module first
