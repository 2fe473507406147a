"""Backends by name: ``get_backend("auto" | "cpu" | "cuda" | "cuda:1" | "xpu" | <registered name>)``.

``auto`` picks CUDA, then XPU, then CPU. Third-party backends register in process with
:func:`register_backend`, or from an installed package through the ``kvblocks.backends``
entry-point group (``name = "package.module:BackendClass"``), loaded on first lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from kvblocks.backends.base import Backend
from kvblocks.errors import BackendUnavailableError, ConfigError

__all__ = ["ENTRY_POINT_GROUP", "available_backends", "get_backend", "register_backend"]

ENTRY_POINT_GROUP = "kvblocks.backends"

BackendFactory = type[Backend] | Callable[..., Backend]

_registered: dict[str, BackendFactory] = {}
_entry_points_loaded = False


def _builtin() -> dict[str, BackendFactory]:
    from kvblocks.backends.cpu import CPUBackend
    from kvblocks.backends.cuda import CUDABackend
    from kvblocks.backends.xpu import XPUBackend

    return {"cpu": CPUBackend, "cuda": CUDABackend, "xpu": XPUBackend}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``get_backend(name)`` build a backend with ``factory()``, and ``name:N`` with ``factory("name:N")``."""
    if not isinstance(name, str) or not name or ":" in name or name == "auto":
        raise ConfigError(f"a backend name must be a non-empty str without ':' and not 'auto', got {name!r}")
    if not callable(factory):
        raise ConfigError(f"backend factory for {name!r} is not callable")
    if not replace and (name in _registered or name in _builtin()):
        raise ConfigError(f"backend {name!r} is already registered (pass replace=True to override)")
    _registered[name] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registered and ep.name not in _builtin():
            _registered[ep.name] = _LazyEntryPoint(ep)


class _LazyEntryPoint:
    """Imports an entry point's backend only when it is asked for."""

    def __init__(self, ep: object) -> None:
        self._ep = ep

    def __call__(self, *args: object) -> Backend:
        try:
            factory = self._ep.load()  # type: ignore[attr-defined]
        except Exception as error:  # a broken plugin must say which one it is
            raise BackendUnavailableError(f"backend entry point {self._ep!r} failed to load: {error}") from error
        return factory(*args)  # type: ignore[no-any-return]


def _factories() -> dict[str, BackendFactory]:
    _load_entry_points()
    return {**_builtin(), **_registered}


def available_backends() -> dict[str, bool]:
    """Every known backend name and whether it can run here (entry points are checked by loading them)."""
    out = {}
    for name, factory in _factories().items():
        check = getattr(factory, "is_available", None)
        out[name] = bool(check()) if callable(check) else True
    return out


def get_backend(name: str = "auto") -> Backend:
    """The backend for ``name``: ``auto``, a device string such as ``cuda:1``, or a registered name.

    Raises :class:`~kvblocks.errors.BackendUnavailableError` (saying what is missing) for a
    known backend that cannot run here, and :class:`~kvblocks.errors.ConfigError` for an
    unknown name.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"backend name must be a non-empty str, got {name!r}")
    factories = _factories()
    if name == "auto":
        for candidate in ("cuda", "xpu"):
            factory = factories[candidate]
            if factory.is_available():  # type: ignore[union-attr]
                return factory()
        return factories["cpu"]()
    base, _, index = name.partition(":")
    if base not in factories:
        raise ConfigError(f"unknown backend {name!r}; known: {', '.join(sorted(factories))}")
    factory = factories[base]
    check = getattr(factory, "is_available", None)
    if callable(check) and not check():
        reason = getattr(factory, "unavailable_reason", None)
        raise BackendUnavailableError(reason() if callable(reason) else f"backend {base!r} is not available here")
    if not index:
        return factory()
    if not index.isdigit():
        raise ConfigError(f"device index in {name!r} must be a non-negative int")
    return factory(f"{base}:{index}")  # type: ignore[call-arg]
