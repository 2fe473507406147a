"""The group kinds' formulas, each checked against a brute-force model of what its tokens attend to."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks.core.groups import (
    GROUP_KIND_RULES,
    NEVER,
    KindRules,
    WindowedRules,
    kind_rules,
    register_kind,
    unregister_kind,
)
from kvblocks.errors import ConfigError
from kvblocks.hybrid import GroupHitRule, HybridKVCacheManager, LocalGroup, longest_common_hit, needed_blocks


def attended(kind: str, token: int, span: int) -> range:
    """The tokens ``token`` attends to, straight from each kind's definition."""
    if kind == "full":
        return range(0, token + 1)
    if kind == "sliding_window":  # itself and the W - 1 tokens before it
        return range(max(0, token - span + 1), token + 1)
    if kind == "chunked_local":  # its own chunk, up to itself
        chunk = token // span
        return range(chunk * span, token + 1)
    raise AssertionError(kind)


ATTENTION = st.sampled_from(["full", "sliding_window", "chunked_local"])


@given(kind=ATTENTION, n=st.integers(0, 200), size=st.integers(1, 16), span=st.integers(1, 40))
def test_first_needed_is_the_first_block_any_later_token_attends_to(kind: str, n: int, size: int, span: int) -> None:
    rules = kind_rules(kind)
    later = range(n, n + 3 * (span + size))  # far enough: the attended start only grows
    first_token = min(attended(kind, t, span).start for t in later)
    assert rules.first_needed(n, size, span) == first_token // size


@given(kind=ATTENTION, n=st.integers(0, 200), size=st.integers(1, 16), span=st.integers(1, 40))
def test_next_move_never_misses_a_release(kind: str, n: int, size: int, span: int) -> None:
    """Below ``next_move(n)`` the first needed block stays put, so a manager that looks again only there
    releases every block as soon as it may; sliding windows name the exact token where it moves."""
    rules = kind_rules(kind)
    first = rules.first_needed(n, size, span)
    move = rules.next_move(n, size, span)
    assert move > n
    if move == NEVER:
        assert kind == "full"
        return
    assert all(rules.first_needed(m, size, span) == first for m in range(n, move))
    if kind == "sliding_window":
        assert rules.first_needed(move, size, span) == first + 1


@given(kind=ATTENTION, hit=st.integers(0, 200), size=st.integers(1, 16), span=st.integers(1, 40))
def test_a_hit_needs_the_blocks_of_what_the_first_computed_token_attends_to(
    kind: str, hit: int, size: int, span: int
) -> None:
    cached_tokens = [t for t in attended(kind, hit, span) if t < hit]  # token `hit` is computed, not cached
    expected = sorted({t // size for t in cached_tokens})
    rule = GroupHitRule(kind, size, None if kind == "full" else span)  # type: ignore[arg-type]
    assert list(needed_blocks(rule, hit)) == expected


@given(
    kind=ATTENTION,
    size=st.sampled_from([1, 2, 4]),
    span=st.integers(1, 24),
    cached=st.sets(st.integers(0, 20)),
    limit=st.integers(0, 80),
    mult=st.integers(1, 3),
)
def test_the_longest_hit_is_the_largest_served_one(
    kind: str, size: int, span: int, cached: set[int], limit: int, mult: int
) -> None:
    rule = GroupHitRule(kind, size, None if kind == "full" else span)  # type: ignore[arg-type]
    step = size * mult
    served = [
        h for h in range(0, limit + 1, step) if all(t // size in cached for t in attended(kind, h, span) if t < h)
    ]
    assert longest_common_hit([rule], limit, [cached.__contains__], step) == max(served)


@given(checkpoints=st.sets(st.integers(1, 30)), limit=st.integers(0, 40))
def test_a_recurrent_hit_needs_a_checkpoint_exactly_there(checkpoints: set[int], limit: int) -> None:
    rule = GroupHitRule("recurrent")
    tokens = {4 * c for c in checkpoints}
    expected = max((h for h in range(0, limit + 1, 4) if h == 0 or h in tokens), default=0)
    assert longest_common_hit([rule], limit, [tokens.__contains__], 4) == expected


def test_cross_attention_needs_nothing_for_a_hit() -> None:
    rule = GroupHitRule("cross_attention", 4)
    assert list(needed_blocks(rule, 40)) == []
    assert longest_common_hit([rule], 41, [lambda p: False], 4) == 40


def test_unknown_kinds_and_bad_spans_are_config_errors_naming_the_known_kinds() -> None:
    with pytest.raises(ConfigError, match="unknown group kind 'diagonal'; known: full, sliding_window"):
        kind_rules("diagonal")
    with pytest.raises(ConfigError, match="unknown group kind"):
        GroupHitRule("diagonal", 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a positive int span"):
        GroupHitRule("sliding_window", 4)
    with pytest.raises(ConfigError, match="takes no span"):
        GroupHitRule("full", 4, 8)
    with pytest.raises(ConfigError, match="has no block size"):
        GroupHitRule("recurrent", 4)
    with pytest.raises(ConfigError, match="a local group is one of 'sliding_window', 'chunked_local'"):
        LocalGroup("full", 8, 4)
    assert set(GROUP_KIND_RULES) == {
        "full",
        "sliding_window",
        "chunked_local",
        "recurrent",
        "cross_attention",
        "circular_buffer",
        "retained_prefix_window",
        "capped_sliding_window",
    }


class StrideWindow(WindowedRules):
    """A toy kind, defined here only: a token attends to the previous whole stride of ``span`` tokens and
    its own, up to itself."""

    name = "toy_stride_window"
    event_kind = "sliding_window"  # what a router reading its events should treat it as

    def first_needed_token(self, next_token: int, span: int) -> int:
        return max(0, next_token - next_token % span - span)

    def next_move(self, next_token: int, block_size: int, span: int) -> int:
        return (next_token // span + 1) * span


@pytest.fixture
def toy_kind():
    register_kind(StrideWindow())
    try:
        yield "toy_stride_window"
    finally:
        unregister_kind("toy_stride_window")


def test_a_kind_added_from_a_test_file_serves_hits_and_releases_in_a_manager(toy_kind: str) -> None:
    """One class plus one registry entry is a new local kind: the manager's hit search, admission, commit
    and release follow its formulas, with no other change."""
    m = HybridKVCacheManager(32, 4, local_groups=[LocalGroup(toy_kind, span=8, num_blocks=32)])
    prompt = list(range(30))
    m.add_sequence("a", prompt)
    m.allocate("a", 30)
    m.commit("a", 30)  # token 30 attends to 16..30: blocks 0..3 leave the window
    assert m.group_block_table("a", 1)[:4] == [-1, -1, -1, -1]
    assert -1 not in m.group_block_table("a", 1)[4:]
    m.check_integrity()
    m.free("a")
    m.add_sequence("b", prompt[:25] + [999] * 5)
    # a hit at 24 needs the toy window's blocks 4..5 (tokens 16..23): still cached, full attention's 0..5 too
    assert m.lookup("b").device == 24
    m.allocate("b", 6, num_cached_tokens=24)
    m.check_integrity()


def test_registering_is_for_new_names_only(toy_kind: str) -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_kind(StrideWindow())
    with pytest.raises(ConfigError, match="built in"):
        unregister_kind("sliding_window")
    with pytest.raises(ConfigError, match="a group kind is a KindRules instance"):
        register_kind(object())  # type: ignore[arg-type]
    assert isinstance(kind_rules(toy_kind), KindRules)
