"""The group kinds by name: the one place a kind is looked up.

Adding a kind is one module with a :class:`~kvblocks.core.groups.rules.KindRules` subclass and one
entry here (or :func:`register_kind` from outside the package, e.g. a test's toy kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvblocks.core.groups.capped_sliding_window import CappedSlidingWindow
from kvblocks.core.groups.chunked_local import ChunkedLocal
from kvblocks.core.groups.circular_buffer import CircularBuffer
from kvblocks.core.groups.cross_attention import CrossAttention
from kvblocks.core.groups.full import FullAttention
from kvblocks.core.groups.recurrent import RecurrentState
from kvblocks.core.groups.retained_prefix_window import RetainedPrefixWindow
from kvblocks.core.groups.rules import KindRules
from kvblocks.core.groups.sliding_window import SlidingWindow
from kvblocks.errors import ConfigError

__all__ = ["GROUP_KIND_RULES", "kind_rules", "register_kind", "unregister_kind"]

_KINDS: dict[str, KindRules] = {
    rules.name: rules
    for rules in (
        FullAttention(),
        SlidingWindow(),
        ChunkedLocal(),
        RecurrentState(),
        CrossAttention(),
        CircularBuffer(),
        RetainedPrefixWindow(),
        CappedSlidingWindow(),
    )
}
_BUILT_IN = frozenset(_KINDS)

GROUP_KIND_RULES: Mapping[str, KindRules] = MappingProxyType(_KINDS)
"""Every known kind's rules, by name (read-only; :func:`register_kind` adds one)."""


def kind_rules(name: object) -> KindRules:
    """The rules of kind ``name``; :class:`ConfigError` naming the known kinds for anything else."""
    rules = _KINDS.get(name) if isinstance(name, str) else None
    if rules is None:
        raise ConfigError(f"unknown group kind {name!r}; known: {', '.join(_KINDS)}")
    return rules


def register_kind(rules: KindRules) -> None:
    """Make ``rules`` known under ``rules.name`` (a new name only: a kind is never redefined)."""
    if not isinstance(rules, KindRules):
        raise ConfigError(f"a group kind is a KindRules instance, got {type(rules).__name__}")
    name = rules.name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a group kind needs a name, got {name!r}")
    if name in _KINDS:
        raise ConfigError(f"group kind {name!r} is already registered")
    _KINDS[name] = rules


def unregister_kind(name: str) -> None:
    """Forget a kind added by :func:`register_kind` (the built-in kinds stay)."""
    if name in _BUILT_IN:
        raise ConfigError(f"group kind {name!r} is built in")
    if _KINDS.pop(name, None) is None:
        raise ConfigError(f"unknown group kind {name!r}")
