"""Retained-prefix sliding window (vLLM ``RSWASpec``, reference sliding-window attention).

Every token attends to the whole prompt and to itself and the ``W - 1`` tokens before it; the prompt's
``P`` tokens stay visible for the sequence's life. Blocks between the prompt and the window are
released while it runs (the block holding the prompt's last token is the prompt's)::

    W = 6, block size 4, P = 10, next token 26 (attends to tokens 0..9 and 21..26)
    block             |  0  |  1  |  2  |  3  |  4  |  5  |  6  |
    held                 x     x     x                 x     x
    released                               x     x                  tokens 12..19: the gap

Within the prompt every token sees every earlier one, so a hit at ``h`` (always inside the new
sequence's prompt) needs every block before it, as full attention does. A token past the prompt was
computed seeing only the prompt and its window, so its K/V (and every later layer's) depends on where
that sequence's prompt ended: a commit caches the blocks wholly inside the prompt only, and no hit ever
reaches past a prompt that computed it. vLLM frees a gap block one token later (its window start is
``n - W``; the attention mask's is ``n - W + 1``, used here) and caches every full block.
"""

from __future__ import annotations

from kvblocks.core.groups.rules import KindRules, Positions, ceil_div
from kvblocks.core.groups.sliding_window import window_next_move, window_start

__all__ = ["RetainedPrefixWindow"]


class RetainedPrefixWindow(KindRules):
    """The prompt plus a sliding window of ``span`` tokens."""

    name = "retained_prefix_window"
    event_kind = "full"  # a hit is a leading run of cached blocks, as full attention's
    spanned = True
    releases = True
    local = True
    leading = False  # the gap between the prompt and the window

    def next_move(self, next_token: int, block_size: int, span: int) -> int:
        # the window's first block moves here (the sliding window's token); whether it leaves the prompt
        # depends on the prompt, so this is the earliest the gap may grow
        return window_next_move(next_token, block_size, span)

    def released(self, next_token: int, block_size: int, span: int, prompt: int | None) -> Positions:
        if prompt is None:
            return ()  # the prompt unknown: nothing is known to be outside it
        gap = range(ceil_div(prompt, block_size), window_start(next_token, span) // block_size)
        return (gap,) if gap else ()

    def cached_stop(self, committed: int, block_size: int, prompt: int | None) -> int:
        return (committed if prompt is None else min(committed, prompt)) // block_size
