"""Sliding-window attention: each token attends to itself and the ``W - 1`` tokens before it.

::

    W = 6, block size 4, a hit at h = 12 (token 12 attends to tokens 7..12)
    block            |  0  |  1  |  2  |
    the hit needs             x     x        tokens 7..11
"""

from __future__ import annotations

from kvblocks.core.groups.rules import WindowedRules, ceil_div

__all__ = ["SlidingWindow", "window_next_move", "window_start"]


def window_start(next_token: int, span: int) -> int:
    """The first token ``next_token`` attends to in a window of ``span`` tokens (itself and ``span - 1`` before)."""
    return max(0, next_token - span + 1)


def window_next_move(next_token: int, block_size: int, span: int) -> int:
    """The smallest token count from which the window's first block lies past its block at ``next_token``: the
    window start reaches the next block's start."""
    return (window_start(next_token, span) // block_size + 1) * block_size + span - 1


class SlidingWindow(WindowedRules):
    """Sliding window of ``span`` tokens (Gemma, Mistral, gpt-oss)."""

    name = "sliding_window"

    def first_needed_token(self, next_token: int, span: int) -> int:
        return window_start(next_token, span)

    def first_needed(self, next_token: int, block_size: int, span: int) -> int:
        # the base's formula, without its call to first_needed_token: a decoding sequence asks once per block
        return window_start(next_token, span) // block_size

    def next_move(self, next_token: int, block_size: int, span: int) -> int:
        return window_next_move(next_token, block_size, span)

    def held_blocks(self, context: int, block_size: int, span: int | None) -> int:
        """At most ceil(W/B) + 1: the window rarely starts on a block boundary, and the block being
        written is held too."""
        return min(ceil_div(context, block_size), ceil_div(span or 0, block_size) + 1)

    def below_missing(self, hit: int, missing: int, block_size: int, step: int) -> int:
        # every hit above block `missing`'s start whose window still reaches it fails too: go below it
        return (missing * block_size // step) * step
