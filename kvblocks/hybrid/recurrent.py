"""The previous path of :mod:`kvblocks.core.groups.recurrent_group` (kept for one release: import from there)."""

from kvblocks.core.groups.recurrent_group import RecurrentGroup, StateCopy

__all__ = ["RecurrentGroup", "StateCopy"]
