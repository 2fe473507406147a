"""Sliding window with an admission cap (vLLM ``max_admission_blocks_per_request``).

The attention is a sliding window of ``W`` tokens; what differs is the admission. An admission whose
one pass computes tokens ``[h, e)`` (``e``: the end of the allocation, or of the prompt if sooner) takes
only the blocks the window still needs after the pass, beside the hit's window: the tokens between are
computed from the pass's own K/V and never stored, so a prompt longer than the window enters a pool
sized for the window::

    W = 8, block size 4, a 30-token prompt admitted in one pass (no hit): e = 30 attends to tokens 23..30
    block             |  0  |  1  |  2  |  3  |  4  |  5  |  6  |  7  |
    plain sliding        x     x     x     x     x     x     x     x      8 blocks until the commit
    capped                                               x     x     x      3 blocks: ceil(W / B) + 1

The engine's contract: it computes the pass at once (a kernel reading the pass's K and V, and the hit's
window from the cache; the positions not held have slot -1, so nothing is written there) and commits
its end before it computes anything else. vLLM caps the blocks an admission reserves at
``ceil((W - 1 + in-flight tokens) / B) + 1`` and fills them chunk by chunk.
"""

from __future__ import annotations

from kvblocks.core.groups.rules import Positions, ceil_div, union
from kvblocks.core.groups.sliding_window import SlidingWindow

__all__ = ["CappedSlidingWindow"]


class CappedSlidingWindow(SlidingWindow):
    """A sliding window of ``span`` tokens whose admissions take only the window at the pass's end."""

    name = "capped_sliding_window"
    event_kind = "sliding_window"
    one_pass = True  # an admission skips what its one pass computes from its own K/V

    def admission_released(
        self, hit: int, pass_end: int | None, block_size: int, span: int, prompt: int | None
    ) -> Positions:
        before = self.released(hit, block_size, span, prompt)
        if pass_end is None:
            return before
        return union(before, range(ceil_div(hit, block_size), self.first_needed(pass_end, block_size, span)))
