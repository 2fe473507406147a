"""vLLM's sliding-window and chunked-local hit scenarios (tests/v1/core/test_single_type_kv_cache_manager.py,
``test_sliding_window_possible_cached_prefix`` and ``test_chunked_local_attention_possible_cached_prefix``),
restated for kvblocks' hit rule (:func:`kvblocks.hybrid.longest_group_hit`).

vLLM's ``find_longest_cache_hit`` returns the hit as a list of blocks with null blocks where the window
needs none; kvblocks returns the hit in tokens. Both take the longest prefix length the cached blocks can
serve up to ``max_length`` (no last-token rule at this level: the manager applies it). Expectations are
vLLM's, converted from blocks to tokens (block size 2).
"""

from __future__ import annotations

import random

import pytest

from kvblocks.hybrid import GroupHitRule, longest_group_hit

B = 2


def hit_blocks(rule: GroupHitRule, block_is_cached: list[bool], tail_tokens: int = 0) -> int:
    cached = {i for i, c in enumerate(block_is_cached) if c}
    return longest_group_hit(rule, len(block_is_cached) * B + tail_tokens, B, cached.__contains__) // B


@pytest.mark.parametrize(
    "block_is_cached, expected_blocks",
    [
        ([False] * 10, 0),
        ([True], 1),
        ([True, False], 1),
        ([True, True], 2),
        ([True, True, False], 2),
        ([True, True, True], 3),
        ([True, True, True, False], 3),
        ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
        ([True, True, False, True, False, False, True, True, False, False, False], 8),
        ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
    ],
)
def test_sliding_window_possible_cached_prefix(block_is_cached: list[bool], expected_blocks: int) -> None:
    """Window 4 tokens: a hit at h needs the blocks of tokens h-3..h-1 (the last two blocks here)."""
    assert hit_blocks(GroupHitRule("sliding_window", B, 4), block_is_cached) == expected_blocks


def _rand(n: int) -> list[bool]:
    return [random.choice([True, False])] * n


@pytest.mark.parametrize(
    "block_is_cached, tail_tokens, expected_blocks",
    [
        ([True], 0, 1),
        ([True], 1, 1),
        ([True, False], 0, 2),  # a chunk boundary (token 4) needs nothing
        ([True, False], 1, 2),
        ([True, True], 0, 2),
        ([True, True], 1, 2),
        ([True, True, False], 0, 2),
        ([True, True, False], 1, 2),
        ([True, True, True], 0, 3),
        ([True, True, True], 1, 3),
        ([True, True, True, False], 0, 4),
        ([True, True, True, False], 1, 4),
        ([*_rand(8), True], 1, 9),
        ([*_rand(8), False], 1, 8),
        ([*_rand(8), True, True], 1, 10),
        ([*_rand(8), True, False], 0, 10),
        ([*_rand(8), True, False], 1, 10),
        ([*_rand(8), False, True], 0, 10),
        ([*_rand(8), False, True], 1, 10),
        ([*_rand(8), False, False], 0, 10),
        ([*_rand(8), False, False], 1, 10),
    ],
)
def test_chunked_local_attention_possible_cached_prefix(
    block_is_cached: list[bool], tail_tokens: int, expected_blocks: int
) -> None:
    """Chunk 4 tokens: a hit at h needs only the blocks of h's own chunk before h."""
    rule = GroupHitRule("chunked_local", B, 4)
    assert hit_blocks(rule, block_is_cached, tail_tokens) == expected_blocks
