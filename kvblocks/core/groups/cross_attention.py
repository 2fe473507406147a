"""Cross-attention (encoder-decoder models): K/V of each sequence's encoder outputs, never prefix-cached.

A hit needs nothing from it: the engine runs the encoder for every admission. A sequence holds
``ceil(E / B)`` blocks for its ``E`` encoder tokens, whatever its own length.
"""

from __future__ import annotations

from kvblocks.core.groups.rules import Cached, KindRules, ceil_div

__all__ = ["CrossAttention"]


class CrossAttention(KindRules):
    """A cross-attention group (for memory planning, :meth:`held_blocks` takes the encoder token count as span)."""

    name = "cross_attention"
    prefix_cached = False

    def held_blocks(self, context: int, block_size: int, span: int | None) -> int:
        return ceil_div(span or 0, block_size)

    def needed_blocks(self, hit: int, block_size: int, span: int) -> range:
        return range(0)

    def longest_hit(self, top: int, step: int, block_size: int, span: int, cached: Cached) -> int:
        return top
