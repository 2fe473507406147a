"""The previous path of :mod:`kvblocks.core.groups.block_index` (kept for one release: import from there)."""

from kvblocks.core.groups.block_index import FlatBlockIndex

__all__ = ["FlatBlockIndex"]
