"""Recurrent state (Mamba, linear attention): one state per sequence, checkpointed at hit points.

A hit at ``h`` needs a state checkpoint taken exactly at token ``h``; there are no blocks.
"""

from __future__ import annotations

from kvblocks.core.groups.rules import Cached, KindRules
from kvblocks.errors import ConfigError

__all__ = ["RecurrentState"]


class RecurrentState(KindRules):
    """A recurrent state group."""

    name = "recurrent"
    has_blocks = False

    def held_blocks(self, context: int, block_size: int, span: int | None) -> int:
        raise ConfigError(
            "kind 'recurrent' holds no blocks; block kinds: full, sliding_window, chunked_local, cross_attention"
        )

    def needed_blocks(self, hit: int, block_size: int, span: int) -> range:
        return range(0)

    def longest_hit(self, top: int, step: int, block_size: int, span: int, cached: Cached) -> int:
        """The highest checkpoint at or below ``top`` (``cached`` answers token positions)."""
        h = top
        while h > 0 and not cached(h):
            h -= step
        return h
