"""A second copy of kvblocks in this process: another commit's, or today's with every hot module from source.

Two implementations run side by side only if each one's modules bind one another. :func:`import_aside` imports
``kvblocks`` (and ``preload``) with ``sys.modules`` swapped: today's kvblocks modules are set aside, the copy is
imported (from ``folder`` when given, else from where today's comes from), and today's are put back. The copy's
objects keep working afterwards: every module they use was imported while the swap lasted. Its classes are its
own (``copy["kvblocks.errors"].InvalidArgumentError`` is not today's), so compare errors by name and message.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from kvblocks import native

_pure: dict[tuple[str, ...], dict[str, ModuleType]] = {}


def import_aside(
    folder: str | None = None, *, pure: bool = False, preload: tuple[str, ...] = ()
) -> dict[str, ModuleType]:
    """``{module name: module}`` of a separate kvblocks: from ``folder`` (a directory holding ``kvblocks/``) or
    today's source, its hot modules pure Python when ``pure``."""
    today = {name: module for name, module in sys.modules.items() if _ours(name)}
    for name in today:
        del sys.modules[name]
    if folder is not None:
        sys.path.insert(0, folder)
    try:
        with _pure_python(pure):
            importlib.import_module("kvblocks")
            for name in preload:
                importlib.import_module(name)
            copy = {name: module for name, module in sys.modules.items() if _ours(name)}
    finally:
        if folder is not None:
            sys.path.remove(folder)
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(today)
        native.install_finder()  # today's finder first again (the copy's __init__ installed its own)
    return copy


def load_pure(preload: tuple[str, ...] = ()) -> dict[str, ModuleType]:
    """Today's kvblocks with every hot module running from its Python source (imported once per ``preload``)."""
    if preload not in _pure:
        copy = import_aside(pure=True, preload=preload)
        compiled = [n for n in native.COMPILED_MODULES if n in copy and not str(copy[n].__file__).endswith(".py")]
        if compiled:
            raise AssertionError(f"the pure copy loaded compiled modules: {compiled}")
        _pure[preload] = copy
    return _pure[preload]


@contextmanager
def _pure_python(on: bool) -> Iterator[None]:
    """``KVBLOCKS_PURE_PYTHON=1`` while the copy is imported (when ``on``), then as it was."""
    if not on:
        yield
        return
    before = os.environ.get(native.PURE_PYTHON_ENV)
    os.environ[native.PURE_PYTHON_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[native.PURE_PYTHON_ENV]
        else:
            os.environ[native.PURE_PYTHON_ENV] = before


def _ours(name: str) -> bool:
    return name == "kvblocks" or name.startswith("kvblocks.")


# hot modules that import an extra, loaded on first use (the step-metadata builder imports torch)
TORCH_MODULES = ("kvblocks.attention.step_metadata",)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call did, comparable across the two copies: its result's repr, or its error's class and message."""
    try:
        return "ok", normal(call())
    except Exception as error:
        return type(error).__name__, str(error)


def normal(value: Any) -> Any:
    """Plain data (lists, tuples, ints, strings) from what kvblocks returns, so two copies' results compare."""
    if isinstance(value, (list, tuple)):
        return [normal(v) for v in value]
    if isinstance(value, dict):
        return {repr(k): normal(v) for k, v in value.items()}
    if value is None or isinstance(value, (int, float, str, bytes, bool)):
        return value
    return repr(value)
