"""Chunked local attention (Llama 4): each token attends within its own ``C``-token chunk only.

::

    C = 8, block size 4, a hit at h = 12 (token 12's chunk is tokens 8..15)
    block            |  0  |  1  |  2  |
    the hit needs                   x        tokens 8..11
"""

from __future__ import annotations

from kvblocks.core.groups.rules import WindowedRules, ceil_div

__all__ = ["ChunkedLocal"]


class ChunkedLocal(WindowedRules):
    """Chunks of ``span`` tokens."""

    name = "chunked_local"

    def first_needed_token(self, next_token: int, span: int) -> int:
        return next_token - next_token % span

    def next_move(self, next_token: int, block_size: int, span: int) -> int:
        return (next_token // span + 1) * span  # the chunk start moves at the next chunk

    def held_blocks(self, context: int, block_size: int, span: int | None) -> int:
        """The current chunk: C/B blocks when B divides C (chunks start on block boundaries), else ceil(C/B) + 1."""
        width = span or 0
        bound = width // block_size if width % block_size == 0 else ceil_div(width, block_size) + 1
        return min(ceil_div(context, block_size), bound)
