"""The previous path of :mod:`kvblocks.core.groups.cross_group` (kept for one release: import from there)."""

from kvblocks.core.groups.cross_group import CrossAttentionGroup

__all__ = ["CrossAttentionGroup"]
