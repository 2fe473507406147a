"""Circular buffer (vLLM ``CircularBufferSpec``): one block per sequence for its whole life, never cached.

A compressing attention layer (DeepSeek-V4-style compressed sparse attention) keeps the raw keys of the
token group it is still compressing in a ring of ``span`` token slots: token ``t`` is written to slot
``t % span`` of the sequence's one block, which later tokens overwrite. The ring's content depends on
where the sequence is, not only on its token prefix, so it is never prefix-cached: a hit needs nothing
from it (it lands where the other groups' block sizes put it, at a compression boundary), and an
admission takes one fresh block whatever the hit::

    span 8 (the ring's capacity), a sequence of any length
    table        [ 5 ]        one entry, held from admission to release; growth takes nothing

``span`` is the ring's capacity in tokens (vLLM's ``CircularBufferSpec.block_size``); the group's block
size is the manager's and takes no part (a ring is never hashed, so it never constrains a hit).
"""

from __future__ import annotations

from kvblocks.core.groups.rules import Cached, KindRules, Positions

__all__ = ["CircularBuffer"]


class CircularBuffer(KindRules):
    """A ring of ``span`` token slots per sequence: one block, held for the sequence's life."""

    name = "circular_buffer"
    event_kind = "cross_attention"  # never cached, so it never emits; a consumer would treat it as per-request
    spanned = True
    prefix_cached = False
    local = True
    leading = False  # nothing, ever
    table_entries = 1

    def held_blocks(self, context: int, block_size: int, span: int | None) -> int:
        return 1

    def released(self, next_token: int, block_size: int, span: int, prompt: int | None) -> Positions:
        return ()

    def needed_blocks(self, hit: int, block_size: int, span: int) -> range:
        return range(0)

    def longest_hit(self, top: int, step: int, block_size: int, span: int, cached: Cached) -> int:
        return top
