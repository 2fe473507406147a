"""The batched step and the admission rules of issue 13: lookahead, reserve, skip-read, match, EAGLE."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import (
    CommitOutOfRangeError,
    InvalidArgumentError,
    InvalidTokenError,
    KVCacheManager,
    SequenceStateError,
    StaleLookupError,
    UnknownSequenceError,
)
from kvblocks.disagg import DecodeManager, PrefillManager

B = 4


def snapshot(m: KVCacheManager) -> tuple:
    """Everything a step could change."""
    seqs = tuple(
        (sid, tuple(m.block_table(sid)), m.num_tokens(sid), m.num_computed_tokens(sid), m.num_allocated_tokens(sid))
        for sid in sorted(m._seqs, key=str)
    )
    pool = m.pool
    return seqs, pool.num_free, pool.num_fresh, tuple(pool.idle_lru()), len(m.tree), m.stats


def running(m: KVCacheManager, seq_id: str, tokens: list[int]) -> None:
    """Admit ``seq_id`` for its whole prompt and commit it: a sequence ready to decode."""
    m.add_sequence(seq_id, tokens)
    assert m.allocate(seq_id, len(tokens) - m.lookup(seq_id).total) is not None
    m.commit(seq_id, len(tokens))


# ---------------------------------------------------------------- the step


def test_the_docstring_example_one_draft_slot() -> None:
    m = KVCacheManager(num_blocks=8, block_size=B)
    m.add_sequence("r", list(range(6)))
    m.allocate("r", 6)
    m.commit("r", 6)
    assert m.step(["r"], [6], [[106]], 1, 1) == []
    assert m.num_tokens("r") == 7 and m.num_computed_tokens("r") == 6
    assert m.num_allocated_tokens("r") == 8 and list(m.block_table("r")) == [0, 1]
    m.check_integrity()


def test_a_decode_step_equals_the_three_per_sequence_calls() -> None:
    a, b = KVCacheManager(num_blocks=32, block_size=B), KVCacheManager(num_blocks=32, block_size=B)
    prompts = {f"s{i}": list(range(100 * i, 100 * i + 5 + i)) for i in range(4)}
    for m in (a, b):
        for sid, tokens in prompts.items():
            running(m, sid, tokens)
    for t in range(9):
        ids = list(prompts)
        assert a.step(ids, [a.num_tokens(s) for s in ids], [[t + i] for i in range(4)]) == []
        for i, sid in enumerate(ids):
            b.commit(sid, b.num_tokens(sid))
            b.append_tokens(sid, [t + i])
            assert b.allocate(sid, 1) is not None
        assert snapshot(a) == snapshot(b)
    a.check_integrity()


def test_chunked_prefill_through_step() -> None:
    m = KVCacheManager(num_blocks=16, block_size=B)
    m.add_sequence("p", list(range(22)))
    assert list(m.allocate("p", 8)) == [0, 1]  # the first chunk
    assert m.step(["p"], [8], None, 8) == []  # chunk 1 written, room for chunk 2
    assert list(m.block_table("p")) == [0, 1, 2, 3] and m.num_allocated_tokens("p") == 16
    assert m.step(["p"], [16], None, 6) == []  # the last chunk: 22 tokens
    assert m.num_allocated_tokens("p") == 22 and len(m.block_table("p")) == 6
    assert m.step(["p"], [22], [[7]]) == []  # prefill done, first decode token appended
    assert m.num_computed_tokens("p") == 22 and m.num_allocated_tokens("p") == 23
    assert len(m.tree) == 5  # the full blocks of the prompt are cached
    m.check_integrity()


@pytest.mark.parametrize(
    "bad",
    [
        lambda m: m.step(["a", "zz"], [5, 5], [[1], [2]]),  # unknown id
        lambda m: m.step(["a", "b", "a"], [5, 5, 5], [[1], [2], [3]]),  # twice
        lambda m: m.step(["a", "b"], [5, 99], [[1], [2]]),  # commit past the slots
        lambda m: m.step(["a", "b"], [5, 3], [[1], [2]]),  # commit below the last one
        lambda m: m.step(["a", "b"], [5, 5], [[1], [2**32]]),  # token out of range
        lambda m: m.step(["a", "b"], [5, 5], [[1], ["x"]]),  # not a token
        lambda m: m.step(["a", "b"], [5, 5], [[1]]),  # a short column
        lambda m: m.step(["a", "b"], [5, 5], [[1], [2]], [1, -1]),  # negative new tokens
        lambda m: m.step(["a", "b"], [5, 5], [[1], [2]], 1, [0, 1.5]),  # not an int
        lambda m: m.step(["a", "w"], [5, 5], [[1], [2]]),  # not admitted
    ],
)
def test_bad_input_anywhere_raises_before_anything_changes(bad) -> None:
    m, untouched = two_running(), two_running()
    before = snapshot(m)
    with pytest.raises(
        (
            InvalidArgumentError,
            UnknownSequenceError,
            CommitOutOfRangeError,
            InvalidTokenError,
            SequenceStateError,
        )
    ):
        bad(m)
    assert snapshot(m) == before
    # nothing of the refused batch lingers (its per-step plan and marks): a sound batch steps as it would have
    assert m.step(["a", "b"], [5, 5], [[1], [2]]) == untouched.step(["a", "b"], [5, 5], [[1], [2]]) == []
    assert snapshot(m) == snapshot(untouched)


def two_running() -> KVCacheManager:
    """Sequences "a" and "b" decoding (5 tokens each, committed), "w" registered but not admitted."""
    m = KVCacheManager(num_blocks=16, block_size=B)
    running(m, "a", list(range(5)))
    running(m, "b", list(range(50, 55)))
    m.add_sequence("w", [9, 9])
    return m


def test_a_sequence_that_cannot_get_its_slots_is_returned_with_nothing_changed() -> None:
    m = KVCacheManager(num_blocks=4, block_size=B)
    running(m, "a", list(range(8)))  # 2 full blocks, the table full
    running(m, "b", list(range(100, 107)))  # 2 blocks, one slot left
    a_before = (tuple(m.block_table("a")), m.num_tokens("a"), m.num_computed_tokens("a"))
    # b fits its next token in its own block; a needs a new block and none is left
    assert m.step(["a", "b"], [8, 7], [[1], [2]]) == ["a"]
    assert (tuple(m.block_table("a")), m.num_tokens("a"), m.num_computed_tokens("a")) == a_before
    assert m.num_tokens("b") == 8 and m.num_allocated_tokens("b") == 8
    m.preempt("b")  # the engine preempts b and sends a's entry again: it goes through
    assert m.step(["a"], [8], [[1]]) == []
    assert m.num_tokens("a") == 9 and len(m.block_table("a")) == 3
    m.check_integrity()


def test_roles_refuse_in_a_step_before_anything_changes() -> None:
    p = PrefillManager(num_blocks=16, block_size=B)
    running(p, "a", list(range(5)))
    running(p, "h", list(range(50, 58)))
    p.finish_prefill("h")  # handed off: it cannot grow or commit here
    before = snapshot(p)
    with pytest.raises(SequenceStateError, match="handed off"):
        p.step(["a", "h"], [5, 8], [[1], [2]])
    assert snapshot(p) == before
    d = DecodeManager(num_blocks=16, block_size=B)
    running(d, "a", list(range(5)))
    assert d.step(["a"], [5], [[1]]) == [] and d.num_tokens("a") == 6


# ---------------------------------------------------------------- lookahead


def test_drafts_do_not_pile_up_the_issue_example() -> None:
    """4 draft slots per step, 1 token accepted: 18 tokens need ceil(22 / 4) = 6 blocks, not 12."""
    for path in ("step", "allocate"):
        m = KVCacheManager(num_blocks=64, block_size=B)
        m.add_sequence("s", list(range(6)))
        m.allocate("s", 6, num_lookahead_tokens=4)
        m.commit("s", 6)
        while m.num_tokens("s") < 18:
            n = m.num_tokens("s")
            if path == "step":
                assert m.step(["s"], [n], [[n]], 1, 4) == []
            else:
                m.commit("s", n)
                m.append_tokens("s", [n])
                assert m.allocate("s", 1, num_lookahead_tokens=4) is not None
            assert len(m.block_table("s")) <= math.ceil((m.num_tokens("s") + 4) / B)
        assert len(m.block_table("s")) == math.ceil((18 + 4) / B) == 6
        m.check_integrity()


def test_accepted_drafts_commit_in_lookahead_slots_and_a_smaller_lookahead_returns_blocks() -> None:
    m = KVCacheManager(num_blocks=16, block_size=B)
    running(m, "s", list(range(5)))
    assert m.step(["s"], [5], [[5]], 1, 6) == []  # 6 tokens + 6 drafts: 12 slots, 3 blocks
    assert m.num_allocated_tokens("s") == 12 and len(m.block_table("s")) == 3
    free = m.num_free_blocks
    # the forward pass wrote token 5 and 3 accepted drafts; the bonus token is appended
    m.append_tokens("s", [6, 7, 8])
    assert m.step(["s"], [9], [[9]], 1, 0) == []  # no drafts any more: 10 slots, 3 blocks
    assert m.num_computed_tokens("s") == 9 and m.num_allocated_tokens("s") == 10
    assert len(m.block_table("s")) == 3 and m.num_free_blocks == free
    assert m.step(["s"], [9], None, 1, 0) == [] and len(m.block_table("s")) == 3
    m.commit("s", 10)
    m.check_integrity()
    shrink = KVCacheManager(num_blocks=16, block_size=B)
    running(shrink, "s", list(range(5)))
    assert shrink.step(["s"], [5], [[5]], 1, 10) == []  # 16 slots: 4 blocks
    assert len(shrink.block_table("s")) == 4
    assert shrink.step(["s"], [5], None, 1, 0) == []  # back to 6 slots: 2 blocks, 2 returned fresh
    assert len(shrink.block_table("s")) == 2 and shrink.pool.num_fresh == 14
    shrink.check_integrity()


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=40), st.integers(1, 6))
@settings(max_examples=150, deadline=None)
def test_a_table_never_exceeds_tokens_plus_lookahead(steps: list[tuple[int, int]], block_size: int) -> None:
    """Random drafts per step (k) and accepted counts: the table is exactly ceil((tokens + k) / B)."""
    m = KVCacheManager(num_blocks=512, block_size=block_size)
    running(m, "s", [1, 2, 3])
    k = 0
    for accepted, new_k in steps:
        n = m.num_tokens("s")
        accepted = min(accepted, k)  # only drafted tokens can be accepted
        m.append_tokens("s", list(range(accepted)))
        # the KV of the last known token and of the accepted drafts is written; the bonus token follows
        assert m.step(["s"], [n + accepted], [[7]], 1, new_k) == []
        k = new_k
        assert len(m.block_table("s")) == math.ceil((m.num_tokens("s") + k) / block_size)
        assert m.num_allocated_tokens("s") == m.num_tokens("s") + k
    m.check_integrity()


# ---------------------------------------------------------------- admission: stale, reserve, skip-read, EAGLE


def test_an_admission_given_the_hit_it_saw_cannot_cover_less() -> None:
    m = KVCacheManager(num_blocks=3, block_size=B)
    running(m, "r1", list(range(10)))
    m.free("r1")  # blocks 0 and 1 cached, idle
    m.add_sequence("r2", list(range(8)) + [50, 51])
    seen = m.lookup("r2").total
    assert seen == 8
    running(m, "r3", list(range(200, 210)))  # another admission evicts r1's blocks
    m.free("r3")
    before = snapshot(m)
    with pytest.raises(StaleLookupError, match="saw 8 cached tokens"):
        m.allocate("r2", 10 - seen, num_cached_tokens=seen)
    assert snapshot(m) == before and not m.is_admitted("r2")
    seen = m.lookup("r2").total  # the engine looks again
    table = m.allocate("r2", 10 - seen, num_cached_tokens=seen)
    assert table is not None and m.num_allocated_tokens("r2") == 10 == len(table) * B - 2
    with pytest.raises(InvalidArgumentError):
        m.allocate("r2", 1, num_cached_tokens=0)  # admitted: not an admission any more


def test_an_admission_takes_only_the_hit_the_caller_saw() -> None:
    m = KVCacheManager(num_blocks=16, block_size=B)
    running(m, "r1", list(range(13)))
    m.add_sequence("r2", list(range(13)))
    assert m.lookup("r2").device == 12
    table = m.allocate("r2", 9, num_cached_tokens=4)  # the engine saw one block, computes the rest
    assert table is not None and m.num_computed_tokens("r2") == 4 and m.num_allocated_tokens("r2") == 13
    assert m.stats.hit_tokens_device == 4
    m.add_sequence("r3", list(range(13)))
    with pytest.raises(InvalidArgumentError, match="multiple of the block size"):
        m.allocate("r3", 1, num_cached_tokens=5)


def test_a_reserve_keeps_blocks_for_running_sequences() -> None:
    m = KVCacheManager(num_blocks=8, block_size=B, reserved_blocks=2)
    running(m, "a", list(range(16)))  # 4 blocks, 4 free
    m.add_sequence("b", list(range(100, 112)))  # 3 blocks: would leave 1 < 2
    assert m.blocks_short("b", 12) == 1 and not m.can_allocate("b", 12)
    assert m.allocate("b", 12) is None and not m.is_admitted("b")
    m.add_sequence("c", list(range(200, 208)))  # 2 blocks: leaves exactly the reserve
    assert m.can_allocate("c", 8) and m.allocate("c", 8) is not None
    # running sequences grow into the reserve
    assert m.step(["a", "c"], [16, 8], [[1], [2]]) == [] and m.num_free_blocks == 0
    m.check_integrity()


def test_skip_cache_read_computes_everything_and_still_writes() -> None:
    m = KVCacheManager(num_blocks=16, block_size=B)
    running(m, "warm", list(range(13)))
    m.add_sequence("logprobs", list(range(13)), skip_cache_read=True)
    assert m.lookup("logprobs").total == 0
    assert m.allocate("logprobs", 13) is not None and m.num_computed_tokens("logprobs") == 0
    m.commit("logprobs", 13)  # its duplicates of warm's blocks pin the cached ones
    m.free("warm")
    m.free("logprobs")
    m.add_sequence("later", list(range(13)))
    assert m.lookup("later").device == 12
    fresh = KVCacheManager(num_blocks=16, block_size=B)
    fresh.add_sequence("first", list(range(13)), skip_cache_read=True)
    fresh.allocate("first", 13)
    fresh.commit("first", 13)  # nothing was cached before: its blocks are written
    assert fresh.match(list(range(13))).device == 12
    with pytest.raises(InvalidArgumentError):
        m.add_sequence("x", [1], skip_cache_read=1)
    m.check_integrity()


def test_drop_last_matched_block_for_eagle() -> None:
    m = KVCacheManager(num_blocks=16, block_size=B, drop_last_matched_block=True)
    running(m, "warm", list(range(13)))
    m.add_sequence("r", list(range(13)))
    assert m.lookup("r").device == 8  # 3 blocks match, the last one is given up
    assert list(m.allocate("r", 5)) == [0, 1, 4, 5]
    assert m.match(list(range(5))).device == 0  # one block matches, none is kept
    plain = KVCacheManager(num_blocks=16, block_size=B)
    running(plain, "warm", list(range(13)))
    assert plain.match(list(range(13))).device == 12


def test_match_is_pure_and_agrees_with_lookup() -> None:
    m = KVCacheManager(num_blocks=16, block_size=B)
    running(m, "warm", list(range(13)))
    before = snapshot(m)
    assert m.match(list(range(9))).device == 8
    assert m.match(list(range(8))).device == 4  # the last token's block is never a hit
    hashes = m.block_hashes("warm")
    assert m.match(block_hashes=hashes[:2], num_tokens=9).device == 8
    assert snapshot(m) == before and m.num_sequences == 1
    m.add_sequence("r", list(range(9)))
    assert m.lookup("r") == m.match(list(range(9)))
    with pytest.raises(InvalidArgumentError):
        m.match()


def test_an_admission_without_the_seen_hit_returns_the_hit_it_took() -> None:
    """The other way to be safe from a stale lookup: the table says where computing starts."""
    m = KVCacheManager(num_blocks=3, block_size=B)
    running(m, "r1", list(range(10)))
    m.free("r1")
    m.add_sequence("r2", list(range(8)) + [50, 51])
    assert m.lookup("r2").total == 8
    running(m, "r3", list(range(200, 210)))  # evicts r1's blocks
    m.free("r3")
    table = m.allocate("r2", 2)  # counts from the hit it takes, and returns it
    assert table is not None and table.num_cached_tokens == m.num_computed_tokens("r2") < 8
    assert m.num_allocated_tokens("r2") == table.num_cached_tokens + 2
    m2 = KVCacheManager(num_blocks=8, block_size=B)
    running(m2, "warm", list(range(13)))
    m2.add_sequence("hit", list(range(13)))
    assert m2.allocate("hit", 1).num_cached_tokens == 12
