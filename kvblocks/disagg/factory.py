"""The manager for a node's role: :func:`manager_for_role`."""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.config import CacheConfig, DisaggConfig
from kvblocks.core.manager import KVCacheManager
from kvblocks.disagg.decode import DecodeManager
from kvblocks.disagg.prefill import PrefillManager
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink
from kvblocks.tiers.config import TierConfig

__all__ = ["ROLE_MANAGERS", "manager_for_role"]

ROLE_MANAGERS: dict[str, type[KVCacheManager]] = {
    "mixed": KVCacheManager,
    "prefill": PrefillManager,
    "decode": DecodeManager,
}
"""The manager class of each role: the manager itself, or a facade adding the role's calls."""


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
    The role picks the class (:data:`ROLE_MANAGERS`); tiers and groups are the manager's parts.

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
