"""The manager for a node's role: :func:`manager_for_role`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from kvblocks.config import _ROLE_NAMES, ROLES, CacheConfig, DisaggConfig
from kvblocks.core.manager import KVCacheManager
from kvblocks.disagg.decode import DecodeManager
from kvblocks.disagg.prefill import PrefillManager
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink
from kvblocks.tiers.config import TierConfig

__all__ = ["ROLE_MANAGERS", "manager_for_role", "register_role", "unregister_role"]

_ROLE_MANAGERS: dict[str, type[KVCacheManager]] = {
    "mixed": KVCacheManager,
    "prefill": PrefillManager,
    "decode": DecodeManager,
}
ROLE_MANAGERS: Mapping[str, type[KVCacheManager]] = MappingProxyType(_ROLE_MANAGERS)
"""The manager class of each role, by name (read-only; :func:`register_role` adds one): the manager itself, or
a facade adding the role's calls."""


def register_role(facade: type[KVCacheManager]) -> None:
    """Make the role of ``facade`` known under ``facade.role``: a :class:`KVCacheManager` subclass that adds only
    its role's calls and names its role's component (``_role_component``, a :class:`~kvblocks.core.role.Role`
    built from the manager and its :class:`DisaggConfig`). A new name only: a role is never redefined."""
    if not (isinstance(facade, type) and issubclass(facade, KVCacheManager)) or facade is KVCacheManager:
        raise ConfigError(f"a role's manager is a KVCacheManager subclass, got {facade!r}")
    name = facade.role
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a role needs a name (the class's role), got {name!r}")
    if name in _ROLE_MANAGERS:
        raise ConfigError(f"role {name!r} is already registered")
    if facade._role_component is None:
        raise ConfigError(f"{facade.__name__} names no role component (_role_component)")
    _ROLE_MANAGERS[name] = facade
    _ROLE_NAMES.append(name)


def unregister_role(name: str) -> None:
    """Forget a role added by :func:`register_role` (the built-in roles stay)."""
    if name in ROLES:
        raise ConfigError(f"role {name!r} is built in")
    if _ROLE_MANAGERS.pop(name, None) is None:
        raise ConfigError(f"unknown role {name!r}")
    _ROLE_NAMES.remove(name)


def manager_for_role(
    config: CacheConfig,
    disagg: DisaggConfig | None = None,
    *,
    tiers: TierConfig | None = None,
    groups: Sequence[object] = (),
    event_sink: EventSink | None = None,
) -> KVCacheManager:
    """The manager for a node: its role, over host/storage tiers when ``tiers`` is given, with the layer
    ``groups`` beside full attention when the model is hybrid -- every combination, from one configuration.

    ``groups`` lists :class:`~kvblocks.hybrid.LocalGroup` s, then :class:`~kvblocks.hybrid.RecurrentGroup` s,
    then :class:`~kvblocks.hybrid.CrossAttentionGroup` s (their group numbers 1, 2, ... follow that order).
    The role picks the class (:data:`ROLE_MANAGERS`, which :func:`register_role` extends); tiers and groups are
    the manager's parts.

    >>> type(manager_for_role(CacheConfig(64, 16), DisaggConfig(role="prefill"))).__name__
    'PrefillManager'
    """
    disagg = disagg or DisaggConfig()
    if not isinstance(disagg, DisaggConfig):
        raise ConfigError(f"disagg must be a DisaggConfig, got {type(disagg).__name__}")
    if tiers is not None and not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers must be a TierConfig or None, got {type(tiers).__name__}")
    return ROLE_MANAGERS[disagg.role].from_config(
        config, tiers=tiers, groups=groups, disagg=disagg, event_sink=event_sink
    )
