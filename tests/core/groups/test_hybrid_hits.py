"""Prefix hits across hybrid groups: each kind's rule and the fixed point, against a brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.errors import ConfigError
from kvblocks.hybrid.hits import (
    GroupHitRule,
    hit_step,
    longest_common_hit,
    longest_group_hit,
    needed_blocks,
)


def serves(rule: GroupHitRule, hit: int, cached) -> bool:
    """By definition, token by token: the KV positions token ``hit`` attends to, or the checkpoint."""
    if hit == 0 or rule.kind == "cross_attention":
        return True
    if rule.kind == "recurrent":
        return cached(hit)
    if rule.kind == "full":
        positions = range(hit)
    elif rule.kind == "sliding_window":
        positions = range(max(0, hit - rule.span + 1), hit)
    else:
        positions = range(hit - hit % rule.span, hit)
    return all(cached(t // rule.block_size) for t in positions)


@st.composite
def groups(draw):
    kind = draw(st.sampled_from(["full", "sliding_window", "chunked_local", "recurrent", "cross_attention"]))
    if kind == "recurrent":
        rule = GroupHitRule(kind)
        cached = draw(st.frozensets(st.integers(0, 96)))  # checkpoint token positions
    else:
        span = draw(st.integers(1, 24)) if kind in ("sliding_window", "chunked_local") else None
        rule = GroupHitRule(kind, draw(st.sampled_from([1, 2, 4, 8])), span)
        cached = draw(st.frozensets(st.integers(0, 96)))  # cached block positions
    return rule, cached


@given(st.lists(groups(), min_size=1, max_size=4), st.integers(0, 96))
@settings(max_examples=1500, deadline=None)
def test_the_fixed_point_is_the_largest_hit_every_group_serves(members, limit: int) -> None:
    rules = [r for r, _ in members]
    answers = [c.__contains__ for _, c in members]
    step = hit_step(rules)
    expected = max(
        h for h in range(0, limit + 1, step) if all(serves(r, h, a) for r, a in zip(rules, answers, strict=True))
    )
    assert longest_common_hit(rules, limit, answers) == expected


@given(groups(), st.integers(0, 96), st.sampled_from([1, 2, 4, 8, 16]))
@settings(max_examples=1500, deadline=None)
def test_each_group_gives_its_largest_hit_at_or_below_the_limit(member, limit: int, factor: int) -> None:
    rule, cached = member
    step = (rule.block_size or 1) * factor
    expected = max(h for h in range(0, limit + 1, step) if serves(rule, h, cached.__contains__))
    assert longest_group_hit(rule, limit, step, cached.__contains__) == expected


def test_the_docstring_example() -> None:
    window = GroupHitRule("sliding_window", 4, 6)
    assert list(needed_blocks(window, 12)) == [1, 2]  # tokens 7..11
    assert list(needed_blocks(GroupHitRule("full", 4), 12)) == [0, 1, 2]
    assert list(needed_blocks(GroupHitRule("chunked_local", 4, 8), 12)) == [2]  # chunk 1 starts at token 8
    assert list(needed_blocks(GroupHitRule("chunked_local", 4, 8), 16)) == []  # a chunk boundary needs nothing


def test_a_gemma_like_pair_drops_to_where_both_serve() -> None:
    """Full attention holds blocks 0-5; the window group lost block 4: the hit drops below it."""
    full = GroupHitRule("full", 4)
    window = GroupHitRule("sliding_window", 4, 8)  # a hit at h needs tokens h-7 .. h-1
    full_cached = {0, 1, 2, 3, 4, 5}.__contains__
    window_cached = {0, 1, 2, 3, 5}.__contains__
    assert longest_group_hit(full, 24, 4, full_cached) == 24
    assert longest_group_hit(window, 24, 4, window_cached) == 16  # 24 and 20 need block 4
    assert longest_common_hit([full, window], 24, [full_cached, window_cached]) == 16


def test_a_recurrent_group_needs_a_checkpoint_exactly_at_the_hit() -> None:
    rules = [GroupHitRule("full", 4), GroupHitRule("recurrent")]
    blocks = set(range(8)).__contains__
    assert longest_common_hit(rules, 32, [blocks, {8, 20, 24}.__contains__]) == 24
    assert longest_common_hit(rules, 23, [blocks, {8, 20, 24}.__contains__]) == 20
    assert longest_common_hit(rules, 32, [blocks, {6}.__contains__]) == 0  # not on a block boundary


def test_different_block_sizes_align_to_their_least_common_multiple() -> None:
    rules = [GroupHitRule("full", 4), GroupHitRule("full", 6)]
    assert hit_step(rules) == 12
    everything = (lambda _: True, lambda _: True)
    assert longest_common_hit(rules, 30, everything) == 24


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "mamba"},
        {"kind": "full"},
        {"kind": "full", "block_size": 0},
        {"kind": "full", "block_size": True},
        {"kind": "full", "block_size": 4, "span": 8},
        {"kind": "sliding_window", "block_size": 4},
        {"kind": "chunked_local", "block_size": 4, "span": 0},
        {"kind": "recurrent", "block_size": 4},
    ],
)
def test_bad_rules_raise_config_error(bad) -> None:
    with pytest.raises(ConfigError):
        GroupHitRule(**bad)


def test_bad_arguments_raise_config_error() -> None:
    with pytest.raises(ConfigError):
        longest_common_hit([GroupHitRule("full", 4)], 8, [])
    with pytest.raises(ConfigError):
        longest_common_hit([GroupHitRule("full", 4)], -1, [lambda _: True])


def test_a_recurrent_rule_alone_is_searched_at_the_step_given_not_token_by_token() -> None:
    asked: list[int] = []

    def checkpoint(hit: int) -> bool:
        asked.append(hit)
        return hit == 64

    recurrent = GroupHitRule("recurrent")
    assert longest_common_hit([recurrent], 32768, [checkpoint], step=16) == 64
    assert all(h % 16 == 0 for h in asked) and len(asked) <= 32768 // 16 + 1  # one pass, then the fixed point
    for bad in (0, -16, 6, True, 2.0):
        with pytest.raises(ConfigError):
            longest_common_hit([GroupHitRule("full", 4)], 64, [checkpoint], step=bad)  # type: ignore[arg-type]
