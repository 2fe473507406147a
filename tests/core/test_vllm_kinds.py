"""vLLM's newer group kinds (circular buffer, retained-prefix window, capped sliding window): each one module
plus its registry entry. Their formulas are checked against a brute-force model of what tokens attend to,
and a manager's admissions, commits and releases against those formulas, block id by block id."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks.core.groups import GROUP_KIND_RULES, kind_rules
from kvblocks.core.groups.rules import covers, minus, union
from kvblocks.errors import ConfigError, HandoffError
from kvblocks.hybrid import (
    PLACEHOLDER,
    GroupHitRule,
    HybridDecodeManager,
    HybridKVCacheManager,
    HybridPrefillManager,
    LocalGroup,
    TieredHybridKVCacheManager,
    held_blocks,
    longest_common_hit,
    needed_blocks,
)
from kvblocks.tiers import TierConfig

P = PLACEHOLDER


def attended(kind: str, token: int, span: int, prompt: int) -> set[int]:
    """The tokens ``token`` attends to, straight from each kind's definition."""
    window = set(range(max(0, token - span + 1), token + 1))  # itself and the span - 1 tokens before it
    if kind == "retained_prefix_window":
        return window | set(range(min(prompt, token + 1)))  # and every prompt token up to itself
    if kind in ("sliding_window", "capped_sliding_window"):
        return window
    if kind == "chunked_local":
        return set(range(token - token % span, token + 1))
    raise AssertionError(kind)


def flat(positions: tuple[range, ...]) -> set[int]:
    return {p for r in positions for p in r}


def blocks_of(tokens: set[int], size: int) -> set[int]:
    return {t // size for t in tokens}


WINDOWED = st.sampled_from(["retained_prefix_window", "capped_sliding_window", "sliding_window", "chunked_local"])


# ---------------------------------------------------------------------- position sets


RANGES = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=4).map(
    lambda pairs: tuple(range(a, b) for a, b in pairs)
)


@given(a=RANGES, b=RANGES)
def test_position_sets_agree_with_python_sets(a: tuple[range, ...], b: tuple[range, ...]) -> None:
    u = union(*a, *b)
    assert flat(u) == flat(a) | flat(b)
    assert all(r and r.step == 1 for r in u)
    assert all(x.stop < y.start for x, y in pairwise(u))  # sorted, disjoint, merged
    assert flat(minus(union(*a), union(*b))) == flat(a) - flat(b)
    assert covers(union(*a), union(*b)) == (flat(b) <= flat(a))


# ---------------------------------------------------------------------- the formulas, against the model


@given(
    kind=WINDOWED,
    n=st.integers(0, 120),
    size=st.integers(1, 8),
    span=st.integers(1, 24),
    prompt=st.integers(1, 60),
)
def test_released_positions_are_exactly_those_no_later_token_attends_to(
    kind: str, n: int, size: int, span: int, prompt: int
) -> None:
    rules = kind_rules(kind)
    horizon = n + span + prompt + 3 * size  # far enough: later tokens attend to nothing earlier than these do
    later = set().union(*(attended(kind, t, span, prompt) for t in range(n, horizon)))
    positions = range(n // size + 2)
    expected = {p for p in positions if not any(t // size == p for t in later)}
    assert flat(rules.released(n, size, span, prompt)) == expected


@given(
    kind=st.sampled_from(sorted(GROUP_KIND_RULES)),
    n=st.integers(0, 120),
    size=st.integers(1, 8),
    span=st.integers(1, 24),
    prompt=st.integers(1, 60),
)
def test_a_kind_that_says_it_is_leading_releases_the_positions_before_the_first_needed(
    kind: str, n: int, size: int, span: int, prompt: int
) -> None:
    """A manager keeps a ``leading`` kind's released positions as one count: the kind must mean it."""
    rules = kind_rules(kind)
    if rules.leading:
        first = rules.first_needed(n, size, span)
        assert flat(rules.released(n, size, span, prompt)) == set(range(first))
        assert rules.cached_stop(n, size, prompt) == n // size  # and a commit caches every full block
    elif rules.releases:  # a kind that says otherwise releases something that is not a leading run, somewhere
        runs = [rules.released(m, size, span, m // 2) for m in range(0, 200, 7)]
        assert any(r and r[0].start > 0 for r in runs)


@given(
    kind=st.sampled_from(sorted(GROUP_KIND_RULES)),
    hit=st.integers(0, 120),
    extra=st.integers(0, 80),
    size=st.integers(1, 8),
    span=st.integers(1, 24),
    prompt=st.integers(1, 60),
)
def test_a_kind_that_says_it_is_not_one_pass_leaves_what_it_releases_at_the_hit(
    kind: str, hit: int, extra: int, size: int, span: int, prompt: int
) -> None:
    """A manager admits a kind that is not ``one_pass`` without asking it for an admission's own release: the
    kind must mean it."""
    rules = kind_rules(kind)
    at_hit = flat(rules.released(hit, size, span, prompt))
    admitted = flat(rules.admission_released(hit, hit + extra, size, span, prompt))
    if not rules.one_pass:
        assert admitted == at_hit
    else:
        assert admitted >= at_hit


@given(
    kind=WINDOWED,
    n=st.integers(0, 120),
    size=st.integers(1, 8),
    span=st.integers(1, 24),
    prompt=st.integers(1, 60),
)
def test_released_positions_only_grow_and_next_move_misses_no_release(
    kind: str, n: int, size: int, span: int, prompt: int
) -> None:
    rules = kind_rules(kind)
    now = flat(rules.released(n, size, span, prompt))
    move = rules.next_move(n, size, span)
    assert move > n
    for m in range(n, min(move, n + 4 * (span + size))):
        assert flat(rules.released(m, size, span, prompt)) == now
    assert now <= flat(rules.released(move, size, span, prompt))


@given(
    kind=WINDOWED,
    hit=st.integers(0, 100),
    size=st.integers(1, 8),
    span=st.integers(1, 24),
    extra=st.integers(1, 40),
)
def test_a_hit_needs_the_blocks_of_what_the_first_computed_token_attends_to(
    kind: str, hit: int, size: int, span: int, extra: int
) -> None:
    prompt = hit + extra  # a hit lies inside the new sequence's prompt
    cached = {t for t in attended(kind, hit, span, prompt) if t < hit}  # token `hit` is computed, not cached
    assert set(needed_blocks(GroupHitRule(kind, size, span), hit)) == blocks_of(cached, size)  # type: ignore[arg-type]


@given(
    kind=WINDOWED,
    size=st.sampled_from([1, 2, 4]),
    span=st.integers(1, 24),
    cached=st.sets(st.integers(0, 20)),
    limit=st.integers(0, 80),
    mult=st.integers(1, 3),
)
def test_the_longest_hit_is_the_largest_served_one(
    kind: str, size: int, span: int, cached: set[int], limit: int, mult: int
) -> None:
    rule = GroupHitRule(kind, size, span)  # type: ignore[arg-type]
    step = size * mult
    prompt = limit + 1
    served = [
        h
        for h in range(0, limit + 1, step)
        if all(t // size in cached for t in attended(kind, h, span, prompt) if t < h)
    ]
    assert longest_common_hit([rule], limit, [cached.__contains__], step) == max(served)


@given(n=st.integers(0, 120), size=st.integers(1, 8), prompt=st.integers(1, 60))
def test_a_retained_prefix_window_caches_only_blocks_wholly_inside_the_prompt(n: int, size: int, prompt: int) -> None:
    """A token past the prompt was computed seeing the prompt and its window only: its K/V depends on where
    this sequence's prompt ended, so no other sequence may reuse it."""
    stop = kind_rules("retained_prefix_window").cached_stop(n, size, prompt)
    full_inside = [p for p in range(n // size) if (p + 1) * size <= prompt]
    assert list(range(stop)) == full_inside
    assert kind_rules("capped_sliding_window").cached_stop(n, size, prompt) == n // size


@given(
    size=st.integers(1, 8),
    span=st.integers(1, 24),
    hit_blocks=st.integers(0, 12),
    pass_tokens=st.integers(0, 60),
    lookahead=st.integers(0, 10),
)
def test_a_capped_admission_holds_the_hits_window_and_the_window_after_its_pass(
    size: int, span: int, hit_blocks: int, pass_tokens: int, lookahead: int
) -> None:
    """The pass ``[hit, end)`` reads the hit's window from the cache and its own K/V from itself; after it,
    every token reads the cache. So the admission holds the blocks token ``hit`` attends to below the hit
    and every block a token from ``end`` on attends to, and nothing else."""
    hit = hit_blocks * size
    end = hit + pass_tokens
    length = -(-(end + lookahead) // size)
    kind = "capped_sliding_window"
    horizon = end + lookahead + span + 3 * size  # past every position of the table
    after = set().union(*(attended(kind, t, span, end) for t in range(end, horizon)))
    expected = (blocks_of({t for t in attended(kind, hit, span, end) if t < hit}, size) | blocks_of(after, size)) & set(
        range(length)
    )
    released = kind_rules(kind).admission_released(hit, end, size, span, end)
    assert set(range(length)) - flat(released) == expected
    # without a known pass end it admits as a plain sliding window: everything from the hit's window on
    plain = kind_rules("sliding_window")
    assert kind_rules(kind).admission_released(hit, None, size, span, None) == plain.released(hit, size, span, None)
    assert plain.admission_released(hit, end, size, span, end) == plain.released(hit, size, span, end)


def test_a_circular_buffer_holds_one_block_for_life_and_needs_nothing_for_a_hit() -> None:
    ring = kind_rules("circular_buffer")
    assert (ring.local, ring.releases, ring.prefix_cached) == (True, False, False)
    assert [ring.table_length(k) for k in (0, 1, 7, 10_000)] == [1, 1, 1, 1]
    assert [ring.released(n, 4, 8, 5) for n in (0, 9, 10_000)] == [(), (), ()]
    assert [held_blocks("circular_buffer", context, 4, 8) for context in (0, 1, 4096, 10**6)] == [1, 1, 1, 1]
    rule = GroupHitRule("circular_buffer", 4, 8)  # type: ignore[arg-type]
    assert list(needed_blocks(rule, 400)) == []
    assert longest_common_hit([rule], 403, [lambda p: False], 4) == 400


def test_the_kinds_are_registered_with_their_event_kinds_and_memory_bounds() -> None:
    assert {"circular_buffer", "retained_prefix_window", "capped_sliding_window"} <= set(GROUP_KIND_RULES)
    names = {name: kind_rules(name).event_name for name in GROUP_KIND_RULES}
    assert names["circular_buffer"] == "cross_attention"
    assert names["retained_prefix_window"] == "full"
    assert names["capped_sliding_window"] == "sliding_window"
    # a retained-prefix window is sized as full attention (the prompt is not known ahead), a capped one as a window
    assert held_blocks("retained_prefix_window", 1000, 16, 128) == 63
    assert held_blocks("capped_sliding_window", 1000, 16, 128) == held_blocks("sliding_window", 1000, 16, 128) == 9
    with pytest.raises(ConfigError, match="span must be a positive int"):
        LocalGroup("circular_buffer", 0, 4)


# ---------------------------------------------------------------------- a manager follows the formulas


def test_a_retained_prefix_window_releases_the_gap_and_keeps_the_prompt() -> None:
    """Block size 4, window 8, a 10-token prompt: token n attends to 0..9 and n-7..n. The gap is blocks 3.. (the
    block of tokens 8..11 holds the prompt's end) up to the window's first block."""
    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("retained_prefix_window", span=8, num_blocks=64)])
    m.add_sequence("a", list(range(10)))
    m.allocate("a", 10)
    assert m.group_block_table("a", 1) == [0, 1, 2]
    for n in range(10, 27):  # decode: commit n, append the token sampled there, a slot for it
        assert m.step(["a"], [n], [[100 + n]]) == []
    # committed 26: token 26 attends to 0..9 and 19..26 -> position 3 (tokens 12..15) is the gap
    assert m.group_block_table("a", 1) == [0, 1, 2, P, 4, 5, 6]
    assert m.group_pool(1).num_idle == 0  # past the prompt: never cached, so back to the fresh queue
    assert list(m.group_pool(1).fresh_order())[-1] == 3
    m.check_integrity()
    assert m.step(["a"], [27], [[127]]) == []  # token 27 attends to 20..27: position 4 (16..19) joins the gap
    assert m.group_block_table("a", 1) == [0, 1, 2, P, P, 5, 6]
    assert list(m.group_pool(1).fresh_order())[-2:] == [3, 4]
    m.check_integrity()
    # only the prompt's two full blocks (0..7) are findable in the group: a hit never reaches past a prompt
    m.add_sequence("b", [*range(10), *range(110, 127)])  # a's first 27 tokens: group 0 caches 6 blocks of them
    assert m.lookup("b").device == 8
    m.free("a")
    m.check_integrity()


def test_a_retained_prefix_window_hit_keeps_every_block_before_it() -> None:
    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("retained_prefix_window", span=4, num_blocks=64)])
    m.add_sequence("a", list(range(17)))
    m.allocate("a", 17)
    m.commit("a", 17)
    m.free("a")  # tail first: block 4 (tokens 16..) back to the fresh queue's end; 3, 2, 1, 0 idle
    m.add_sequence("b", [*range(16), 99, 98])
    assert m.lookup("b").device == 16
    m.allocate("b", 2)
    assert m.group_block_table("b", 1) == [0, 1, 2, 3, 5]  # the hit keeps 0..3; position 4 takes the next fresh
    m.check_integrity()


def test_a_capped_window_admits_a_long_prompt_in_one_pass_into_a_window_sized_pool() -> None:
    """Window 8, block size 4: ceil(8 / 4) + 1 = 3 blocks hold a running sequence. A 30-token prompt needs 8
    positions; the capped kind takes only the three its window needs after the pass."""
    plain = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("sliding_window", span=8, num_blocks=3)])
    plain.add_sequence("a", list(range(30)))
    assert plain.blocks_short("a", 30) == 5 and plain.allocate("a", 30) is None

    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("capped_sliding_window", span=8, num_blocks=3)])
    m.add_sequence("a", list(range(30)))
    assert m.blocks_short("a", 30) == 0
    m.allocate("a", 30)
    assert m.group_block_table("a", 1) == [P, P, P, P, P, 0, 1, 2]  # token 30 attends to 23..30: positions 5..7
    assert m.group_pool(1).num_free == 0
    m.check_integrity()
    m.commit("a", 30)  # the pass's end: blocks 0 and 1 (tokens 20..27) are full and cached
    assert m.group_pool(1).num_idle == 0
    assert m.step(["a"], [30], [[30]]) == []  # token 31's slot is in block 2
    m.commit("a", 31)  # token 31 attends to 24..31: position 5 (block 0) leaves, cached and idle
    assert m.group_block_table("a", 1) == [P, P, P, P, P, P, 1, 2]
    assert list(m.group_pool(1).idle_order()) == [0]
    m.append_tokens("a", [31, 32])
    assert m.allocate("a", 2) is not None  # slots for 32 and 33: position 8 takes the idle block 0 back
    assert m.group_block_table("a", 1) == [P, P, P, P, P, P, 1, 2, 0]
    m.check_integrity()


def test_a_capped_admission_with_a_hit_holds_the_hits_window_until_the_pass_commits() -> None:
    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("capped_sliding_window", span=8, num_blocks=5)])
    m.add_sequence("a", list(range(30)))
    m.allocate("a", 30)
    assert m.group_block_table("a", 1) == [P, P, P, P, P, 0, 1, 2]
    m.commit("a", 30)  # positions 5 and 6 (blocks 0, 1) cached; block 2 holds tokens 28..29
    m.free("a")  # tail first: 2 fresh (queue 3, 4, 2); 1 then 0 idle
    # b shares a's first 28 tokens, then 22 of its own: a hit at 28 needs the window 21..27 (positions 5, 6)
    m.add_sequence("b", [*range(28), *range(200, 222)])
    assert m.lookup("b").device == 28
    assert m.blocks_short("b", 22) == 0  # kept 0, 1 (idle: they count) + 3 fresh for positions 10..12 = 5
    m.allocate("b", 22)
    # the pass computes 28..49 from itself; token 50 attends to 43..50: positions 10..12
    assert m.group_block_table("b", 1) == [P, P, P, P, P, 0, 1, P, P, P, 3, 4, 2]
    assert m.group_pool(1).num_free == 0
    m.check_integrity()  # positions 7..9 were never taken: allowed until the pass commits
    m.commit("b", 50)
    assert m.group_block_table("b", 1) == [P] * 10 + [3, 4, 2]
    assert list(m.group_pool(1).idle_order()) == [0, 1]  # the hit's window, released at the pass's end
    m.check_integrity()


def test_a_capped_admission_that_does_not_reach_the_prompts_end_takes_its_whole_window() -> None:
    """A chunk of a longer prompt is not one pass over it: the next chunk reads this chunk's window."""
    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("capped_sliding_window", span=8, num_blocks=8)])
    m.add_sequence("a", list(range(30)))
    m.allocate("a", 12)  # the pass ends at 12: token 12 attends to 5..12, positions 1..2
    assert m.group_block_table("a", 1) == [P, 0, 1]
    m.commit("a", 12)
    assert m.group_block_table("a", 1) == [P, 0, 1]
    m.allocate("a", 12)  # growth takes every new position, as a sliding window's does
    assert m.group_block_table("a", 1) == [P, 0, 1, 2, 3, 4]
    m.check_integrity()


def test_a_circular_buffer_takes_one_block_per_sequence_whatever_its_length_or_hit() -> None:
    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("circular_buffer", span=8, num_blocks=2)])
    for seq in ("a", "b", "c"):
        m.add_sequence(seq, list(range(40)))
    m.allocate("a", 40)
    m.allocate("b", 5)
    assert (m.group_block_table("a", 1), m.group_block_table("b", 1)) == ([0], [1])
    assert m.blocks_short("c", 40) == 1 and m.allocate("c", 40) is None  # the ring pool is full
    m.commit("a", 40)
    m.append_tokens("a", range(40, 60))
    m.allocate("a", 20)  # growth takes nothing in the ring group
    assert m.group_block_table("a", 1) == [0] and m.group_pool(1).num_free == 0
    assert len(m.group_block_table("a", 0)) == 15
    m.check_integrity()
    m.free("a")
    assert list(m.group_pool(1).fresh_order()) == [0] and m.group_pool(1).num_idle == 0  # never cached
    assert m.lookup("c").device == 36  # a's committed blocks serve c: the ring needs nothing for a hit
    m.allocate("c", 4, num_cached_tokens=36)
    assert m.group_block_table("c", 1) == [0]
    m.check_integrity()


def test_a_circular_buffer_takes_no_block_size_and_tiers_refuse_it() -> None:
    with pytest.raises(ConfigError, match="takes no block_size"):
        HybridKVCacheManager(16, 4, local_groups=[LocalGroup("circular_buffer", span=8, num_blocks=4, block_size=8)])
    with pytest.raises(ConfigError, match="a tiered manager does not serve circular_buffer groups"):
        TieredHybridKVCacheManager(
            16, 4, tiers=TierConfig(num_host_blocks=8), local_groups=[LocalGroup("circular_buffer", 8, 4)]
        )


def test_a_tiered_manager_serves_a_retained_prefix_window() -> None:
    tiers = TierConfig(num_host_blocks=16)
    m = TieredHybridKVCacheManager(8, 4, tiers=tiers, local_groups=[LocalGroup("retained_prefix_window", 6, 8)])
    m.add_sequence("a", list(range(30)))
    m.allocate("a", 30)
    m.commit("a", 30)
    assert m.group_block_table("a", 1) == list(range(8))  # the prompt's 30 tokens all stay
    m.free("a")  # tail first: block 7 (tokens 28..29) fresh again, 6..0 idle
    m.add_sequence("c", list(range(30)))
    assert m.lookup("c").device == 28
    m.allocate("c", 2, num_cached_tokens=28)
    assert m.group_block_table("c", 1) == list(range(8))  # keeps 0..6; position 7 takes the fresh block 7
    m.complete_transfers(m.take_transfers())
    m.check_integrity()


def test_a_tiered_manager_admits_a_capped_window_in_one_pass() -> None:
    tiers = TierConfig(num_host_blocks=16)
    m = TieredHybridKVCacheManager(8, 4, tiers=tiers, local_groups=[LocalGroup("capped_sliding_window", 8, 3)])
    m.add_sequence("a", list(range(30)))
    m.allocate("a", 30)
    assert m.group_block_table("a", 1) == [P] * 5 + [0, 1, 2]
    m.commit("a", 30)
    m.free("a")  # tail first: block 2 fresh again; 1 and 0 (positions 6, 5) idle, cached
    m.add_sequence("c", list(range(30)))
    assert m.lookup("c").device == 28  # the window at 28 reads 21..27: positions 5 and 6
    m.allocate("c", 2, num_cached_tokens=28)
    assert m.group_block_table("c", 1) == [P] * 5 + [0, 1, 2]
    m.complete_transfers(m.take_transfers())
    m.check_integrity()


@pytest.mark.parametrize("kind", ["circular_buffer", "retained_prefix_window", "capped_sliding_window"])
def test_a_handoff_does_not_carry_the_new_kinds(kind: str) -> None:
    """Both roles refuse such a layout when they are set up; a handoff naming the kind (another node's bytes)
    is refused by the decode node's validation."""
    groups = [LocalGroup(kind, span=6, num_blocks=16)]
    for role in (HybridPrefillManager, HybridDecodeManager):
        with pytest.raises(ConfigError, match=f"a handoff does not carry {kind} groups"):
            role(16, 4, local_groups=groups)
    window = [LocalGroup("sliding_window", span=6, num_blocks=16)]
    p = HybridPrefillManager(16, 4, local_groups=window)
    p.add_sequence("r", list(range(17)))
    p.allocate("r", 17)
    p.commit("r", 17)
    sound = p.finish_prefill("r")
    forged = dataclasses.replace(sound, groups=(dataclasses.replace(sound.groups[0], kind=kind),))
    with pytest.raises(HandoffError, match="handoff group kind must be one of sliding_window, chunked_local"):
        forged.validate()


def test_step_metadata_pads_a_gap_released_after_its_rows_were_built() -> None:
    """The engine's block table of a retained-prefix window shows -1 in the gap, as the group's table does,
    though the gap opens behind positions the builder already copied."""
    pytest.importorskip("torch")
    from kvblocks.attention import StepMetadataBuilder

    m = HybridKVCacheManager(64, 4, local_groups=[LocalGroup("retained_prefix_window", span=8, num_blocks=64)])
    m.add_sequence("a", list(range(10)))
    m.allocate("a", 10)
    builder = StepMetadataBuilder(m)
    builder.build(["a"], [10])
    for n in range(10, 28):
        m.step(["a"], [n], [[100 + n]])
        meta = builder.build(["a"], [1])
        assert meta.block_tables[1][0].tolist() == m.group_block_table("a", 1), n
    assert meta.block_tables[1][0].tolist() == [0, 1, 2, P, P, 5, 6]
