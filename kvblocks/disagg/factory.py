"""The manager for a node's role: :func:`manager_for_role`."""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.config import CacheConfig
from kvblocks.disagg.config import DisaggConfig
from kvblocks.disagg.decode import DecodeManager, TieredDecodeManager
from kvblocks.disagg.prefill import PrefillManager, TieredPrefillManager
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink
from kvblocks.manager import KVCacheManager
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.manager import TieredKVCacheManager

__all__ = ["manager_for_role"]


def manager_for_role(
    config: CacheConfig,
    disagg: DisaggConfig | None = None,
    *,
    tiers: TierConfig | None = None,
    groups: Sequence[object] = (),
    event_sink: EventSink | None = None,
) -> KVCacheManager:
    """The manager for a node: its role, over host/storage tiers when ``tiers`` is given, with the layer
    ``groups`` beside full attention when the model is hybrid.

    ``groups`` lists :class:`~kvblocks.hybrid.LocalGroup` s, then :class:`~kvblocks.hybrid.RecurrentGroup` s,
    then :class:`~kvblocks.hybrid.CrossAttentionGroup` s (their group numbers 1, 2, ... follow that order).

    ========  ===================  ===========================  ================================
    role      one group            one group, tiers             hybrid (no tiers / tiers)
    ========  ===================  ===========================  ================================
    mixed     ``KVCacheManager``   ``TieredKVCacheManager``     ``HybridKVCacheManager`` /
                                                                ``TieredHybridKVCacheManager``
    prefill   ``PrefillManager``   ``TieredPrefillManager``     ``HybridPrefillManager`` /
                                                                ``TieredHybridPrefillManager``
    decode    ``DecodeManager``    ``TieredDecodeManager``      ``HybridDecodeManager`` /
                                                                ``TieredHybridDecodeManager``
    ========  ===================  ===========================  ================================

    >>> type(manager_for_role(CacheConfig(64, 16), DisaggConfig(role="prefill"))).__name__
    'PrefillManager'
    """
    disagg = disagg or DisaggConfig()
    if not isinstance(disagg, DisaggConfig):
        raise ConfigError(f"disagg must be a DisaggConfig, got {type(disagg).__name__}")
    if tiers is not None and not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers must be a TierConfig or None, got {type(tiers).__name__}")
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ConfigError(f"groups must be a sequence of layer groups, got {type(groups).__name__}")
    if groups:
        # the hybrid wing is loaded only for a hybrid model: `import kvblocks` stays light
        from kvblocks.hybrid.roles import hybrid_manager_for_role

        return hybrid_manager_for_role(config, disagg, tiers=tiers, groups=groups, event_sink=event_sink)
    if disagg.role == "decode":
        if tiers is not None:
            return TieredDecodeManager.from_config(config, tiers=tiers, disagg=disagg, event_sink=event_sink)
        return DecodeManager.from_config(config, disagg=disagg, event_sink=event_sink)
    if disagg.role == "prefill":
        if tiers is not None:
            return TieredPrefillManager.from_config(config, tiers=tiers, event_sink=event_sink)
        return PrefillManager.from_config(config, event_sink=event_sink)
    if tiers is not None:
        return TieredKVCacheManager.from_config(config, tiers=tiers, event_sink=event_sink)
    return KVCacheManager.from_config(config, event_sink=event_sink)
