"""The previous path of :mod:`kvblocks.core.groups.local_group` (kept for one release: import from there)."""

from kvblocks.core.groups.local_group import PLACEHOLDER, LocalGroup, LocalGroupManager

__all__ = ["PLACEHOLDER", "LocalGroup", "LocalGroupManager"]
