"""A model's cache layout: its groups of layers (full attention, sliding window, chunked local, recurrent state,
cross-attention), what one sequence holds in each, how a memory budget splits between them, and the layouts
of published models (Gemma 3, gpt-oss, Qwen3-Next, ...). Plain Python; imports no torch.

The groups' tensors are :class:`kvblocks.backends.group_caches.HybridCaches` (the ``torch`` extra); a
manager of such a model is a :class:`~kvblocks.KVCacheManager` given the layout's ``groups``.
"""

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
