"""Hybrid models: a cache of groups of layers of different kinds (full attention, sliding window,
chunked local attention, recurrent state, cross-attention). Plain Python; imports no torch.

See docs/hybrid.md.
"""

from __future__ import annotations

from kvblocks.hybrid.layout import (
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
from kvblocks.hybrid.presets import HYBRID_PRESETS, hybrid_preset

__all__ = [
    "ATTENTION_KINDS",
    "GROUP_KINDS",
    "HYBRID_PRESETS",
    "CacheGroup",
    "GroupKind",
    "GroupPlan",
    "HybridLayout",
    "MemoryPlan",
    "RecurrentState",
    "StateTensor",
    "held_blocks",
    "hybrid_preset",
]
