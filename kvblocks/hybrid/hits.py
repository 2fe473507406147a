"""The previous path of :mod:`kvblocks.core.groups.hits` (kept for one release: import from there)."""

from kvblocks.core.groups.hits import GroupHitRule, hit_step, longest_common_hit, longest_group_hit, needed_blocks

__all__ = ["GroupHitRule", "hit_step", "longest_common_hit", "longest_group_hit", "needed_blocks"]
