"""The old path of :mod:`kvblocks.routing.holder_index` (the router's inverted index of which workers hold which
blocks). Kept so that code importing ``kvblocks.holder_index`` goes on working."""

from kvblocks.routing.holder_index import M64, PROBE_LIMIT, HolderIndex

__all__ = ["M64", "PROBE_LIMIT", "HolderIndex"]
