"""Hybrid models: a cache of groups of layers of different kinds (full attention, sliding window,
chunked local attention, recurrent state, cross-attention). Plain Python; imports no torch:
:class:`HybridCaches` and :class:`StatePool`, which allocate the groups' tensors, are loaded on
first use (and need the ``torch`` extra).

See docs/hybrid.md.
"""

from __future__ import annotations

from typing import Any

from kvblocks.core.groups.block_index import FlatBlockIndex
from kvblocks.core.groups.cross_group import CrossAttentionGroup
from kvblocks.core.groups.hits import GroupHitRule, hit_step, longest_common_hit, longest_group_hit, needed_blocks
from kvblocks.core.groups.local_group import PLACEHOLDER, LocalGroup
from kvblocks.core.groups.recurrent_group import RecurrentGroup, StateCopy
from kvblocks.layouts.plan import (
    ATTENTION_KINDS,
    GROUP_KINDS,
    CacheGroup,
    GroupKind,
    GroupPlan,
    HybridLayout,
    MemoryPlan,
    RecurrentState,
    StateTensor,
    held_blocks,
)
from kvblocks.layouts.presets import HYBRID_PRESETS, hybrid_preset
from kvblocks.presets import (  # the previous release's names: KVCacheManager / the role facades with groups
    HybridDecodeManager,
    HybridKVCacheManager,
    HybridPrefillManager,
    TieredHybridDecodeManager,
    TieredHybridKVCacheManager,
    TieredHybridPrefillManager,
)

__all__ = [
    "ATTENTION_KINDS",
    "PLACEHOLDER",
    "GROUP_KINDS",
    "HYBRID_PRESETS",
    "CacheGroup",
    "CrossAttentionGroup",
    "FlatBlockIndex",
    "GroupHitRule",
    "GroupKind",
    "GroupPlan",
    "HybridCaches",
    "HybridDecodeManager",
    "HybridKVCacheManager",
    "HybridLayout",
    "HybridPrefillManager",
    "LocalGroup",
    "MemoryPlan",
    "RecurrentGroup",
    "RecurrentState",
    "StateCopy",
    "StatePool",
    "StateTensor",
    "TieredHybridDecodeManager",
    "TieredHybridKVCacheManager",
    "TieredHybridPrefillManager",
    "apply_state_plan",
    "held_blocks",
    "hit_step",
    "hybrid_preset",
    "longest_common_hit",
    "longest_group_hit",
    "needed_blocks",
]


_TORCH_BACKED = frozenset({"HybridCaches", "StatePool", "apply_state_plan"})


def __getattr__(name: str) -> Any:
    if name in _TORCH_BACKED:  # torch-backed: imported only when asked for
        from kvblocks.backends import group_caches

        value = getattr(group_caches, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvblocks.hybrid' has no attribute {name!r}")
