"""The manager of a hybrid model for a node's role and tiers (what :func:`kvblocks.manager_for_role` builds)."""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.config import CacheConfig
from kvblocks.core.coordinator import split_groups
from kvblocks.disagg.config import DisaggConfig
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink
from kvblocks.hybrid.disagg import (
    HybridDecodeManager,
    HybridPrefillManager,
    TieredHybridDecodeManager,
    TieredHybridPrefillManager,
)
from kvblocks.hybrid.manager import HybridKVCacheManager
from kvblocks.hybrid.tiers import TieredHybridKVCacheManager
from kvblocks.manager import KVCacheManager
from kvblocks.tiers.config import TierConfig

__all__ = ["hybrid_manager_for_role"]


def hybrid_manager_for_role(
    config: CacheConfig,
    disagg: DisaggConfig,
    *,
    tiers: TierConfig | None,
    groups: Sequence[object],
    event_sink: EventSink | None,
) -> KVCacheManager:
    """See :func:`kvblocks.manager_for_role`."""
    local, recurrent, cross = split_groups(groups)
    if disagg.role != "mixed" and cross:
        raise ConfigError("a handoff does not carry cross-attention groups (the decode node runs the encoder)")
    if tiers is not None and cross:
        raise ConfigError("tiers serve sliding-window and chunked-local groups; cross-attention groups have none")
    if disagg.role == "decode":
        if tiers is not None:
            return TieredHybridDecodeManager.from_config(
                config,
                tiers=tiers,
                local_groups=local,
                recurrent_groups=recurrent,
                disagg=disagg,
                event_sink=event_sink,
            )
        return HybridDecodeManager.from_config(
            config, local_groups=local, recurrent_groups=recurrent, disagg=disagg, event_sink=event_sink
        )
    role: type[HybridKVCacheManager] = HybridPrefillManager if disagg.role == "prefill" else HybridKVCacheManager
    if tiers is not None:
        tiered = TieredHybridPrefillManager if disagg.role == "prefill" else TieredHybridKVCacheManager
        return tiered.from_config(
            config, tiers=tiers, local_groups=local, recurrent_groups=recurrent, event_sink=event_sink
        )
    return role.from_config(
        config, local_groups=local, recurrent_groups=recurrent, cross_groups=cross, event_sink=event_sink
    )
