"""KVCacheManager: exact block ids through the lifecycle, duplicates, preemption, purity, and every error path."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvblocks import (
    AllBlocksCleared,
    BlockExtras,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    EventSink,
    KVCacheManager,
    Namespace,
    block_hashes,
)
from kvblocks.errors import (
    CommitOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    DuplicateSequenceError,
    IntegrityError,
    InvalidArgumentError,
    InvalidBlockHashError,
    InvalidTokenError,
    SequenceStateError,
    UnknownSequenceError,
)
from tests.support.snapshots import assert_unchanged, manager_snapshot


def prefill(m: KVCacheManager, seq_id: str, tokens: list[int]) -> list[int]:
    """add + lookup + allocate + commit, as an engine does for a prompt; returns the table."""
    m.add_sequence(seq_id, tokens)
    cached = m.lookup(seq_id)
    table = m.allocate(seq_id, len(tokens) - cached.device)
    assert table is not None
    m.commit(seq_id, len(tokens))
    return list(table)


# ------------------------------------------------------------------ the lifecycle, with exact ids


def test_lifecycle_exact_block_ids_and_orders() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(10)))
    assert m.lookup("a").device == 0
    assert list(m.allocate("a", 10)) == [0, 1, 2]
    m.commit("a", 10)  # blocks 0 and 1 are full and written; block 2 is partial
    assert len(m.tree) == 2
    m.free("a")
    # Tail first: the partial block 2 goes back to the fresh queue, then 1 and 0 become idle.
    assert list(m.pool.fresh_order()) == [3, 4, 5, 6, 7, 2]
    assert list(m.pool.idle_lru()) == [1, 0]

    m.add_sequence("b", list(range(10)) + [99])
    cached = m.lookup("b")
    assert (cached.device, cached.host, cached.storage, cached.total) == (8, 0, 0, 8)
    assert list(m.allocate("b", 3)) == [0, 1, 3]  # hits 0, 1; one fresh block
    assert m.num_computed_tokens("b") == 8
    stats = m.stats
    assert (stats.admissions, stats.queried_tokens, stats.hit_tokens_device) == (2, 21, 8)
    assert stats.blocks_in_use == 3 and stats.blocks_cached == 2
    m.check_integrity()


def test_lookup_never_counts_the_last_prompt_token() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "a", list(range(8)) + [50])
    m.free("a")
    m.add_sequence("exact", list(range(8)))  # both blocks are cached, but token 7 must be computed
    assert m.lookup("exact").device == 4
    m.add_sequence("one-more", list(range(9)))
    assert m.lookup("one-more").device == 8
    m.add_sequence("tiny", [0])
    assert m.lookup("tiny").device == 0


def test_lookup_and_can_allocate_are_pure() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4)
    prefill(m, "a", list(range(13)))
    m.free("a")
    m.add_sequence("b", list(range(12)) + [7, 7, 7])
    before = manager_snapshot(m)
    for _ in range(3):
        assert m.lookup("b").device == 12
        assert m.can_allocate("b", 3)
        assert not m.can_allocate("b", 100)
        assert m.blocks_short("b", 100) > 0
    assert_unchanged(m, before)


def test_fresh_blocks_first_then_lru_leaves_tail_first() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4)
    assert prefill(m, "a", list(range(13))) == [0, 1, 2, 3]
    m.free("a")
    assert list(m.pool.fresh_order()) == [4, 5, 3] and list(m.pool.idle_lru()) == [2, 1, 0]
    assert prefill(m, "c", [100 + i for i in range(9)]) == [4, 5, 3]  # fresh first: no eviction yet
    assert m.stats.evicted_blocks == 0
    assert prefill(m, "d", [200 + i for i in range(5)]) == [2, 1]  # then a's tail, then its middle
    assert m.stats.evicted_blocks == 2
    m.add_sequence("a2", list(range(13)))
    assert m.lookup("a2").device == 4  # a's head block survived; the tail went first
    m.check_integrity()


def test_allocate_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    prefill(m, "a", list(range(13)))  # blocks 0..3; 0, 1, 2 cached
    m.free("a")  # idle [2, 1, 0], fresh [3]
    # b hits blocks 0 and 1 (idle): they stop being evictable, so only fresh 3 + idle 2 remain.
    m.add_sequence("b", list(range(8)) + [9] * 9)
    assert m.lookup("b").device == 8
    assert m.blocks_short("b", 9) == 1
    before = manager_snapshot(m)
    assert m.allocate("b", 9) is None
    assert_unchanged(m, before)
    assert list(m.allocate("b", 8)) == [0, 1, 3, 2]
    m.check_integrity()


def test_later_allocations_extend_coverage() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.add_sequence("a", list(range(5)))
    assert list(m.allocate("a", 5)) == [0, 1]
    assert list(m.allocate("a", 3)) == [0, 1]  # 8 slots fit in 2 blocks
    assert list(m.allocate("a", 1)) == [0, 1, 2]
    before = manager_snapshot(m)
    assert m.allocate("a", 9) is None  # needs 3 more blocks, 1 is free
    assert_unchanged(m, before)
    assert list(m.allocate("a", 0)) == [0, 1, 2]


def test_block_table_view_follows_the_sequence() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    m.add_sequence("a", [1, 2, 3])
    assert list(m.block_table("a")) == []
    view = m.allocate("a", 3)
    assert view == [0, 1] and view == m.block_table("a") and len(view) == 2 and view[-1] == 1
    m.allocate("a", 2)
    assert list(view) == [0, 1, 2]  # the view shows the extension
    assert repr(view) == "BlockTable([0, 1, 2])"


# ------------------------------------------------------------------ commit


def test_only_committed_full_blocks_become_findable() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(12)) + [5])
    m.allocate("a", 13)
    m.add_sequence("b", list(range(12)) + [6])
    assert m.lookup("b").device == 0  # allocated is not written
    m.commit("a", 6)
    assert m.lookup("b").device == 4  # one full block below the line
    m.commit("a", 6)  # the same line again is a no-op
    m.commit("a", 12)
    assert m.lookup("b").device == 12
    m.check_integrity()


@pytest.mark.parametrize(
    "value, error",
    [
        (3, CommitOutOfRangeError),  # below the previous commit (4)
        (9, CommitOutOfRangeError),  # beyond the 8 allocated slots
        (-1, CommitOutOfRangeError),
        (5.0, InvalidArgumentError),
        ("5", InvalidArgumentError),
    ],
)
def test_commit_out_of_range_raises_and_changes_nothing(value, error) -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(10)))
    m.allocate("a", 8)
    m.commit("a", 4)
    before = manager_snapshot(m)
    with pytest.raises(error):
        m.commit("a", value)
    assert_unchanged(m, before)
    m.check_integrity()


def test_commit_cannot_pass_the_known_tokens_even_with_lookahead_slots() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(6)))
    m.allocate("a", 12)  # speculative slots beyond the known tokens are allowed
    with pytest.raises(CommitOutOfRangeError, match="6 tokens known"):
        m.commit("a", 7)
    m.append_tokens("a", [6, 7])
    m.commit("a", 8)
    assert len(m.tree) == 2


def test_commit_before_allocate_is_a_state_error() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(6)))
    before = manager_snapshot(m)
    with pytest.raises(SequenceStateError, match="allocate before commit"):
        m.commit("a", 4)
    assert_unchanged(m, before)


def test_commit_np_integer_is_accepted() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(6)))
    m.allocate("a", np.int64(6))
    m.commit("a", np.int32(6))
    assert m.num_computed_tokens("a") == 6


# ------------------------------------------------------------------ decode


def test_decode_appends_extend_hashes_and_cache_the_generated_blocks() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(6))
    prefill(m, "a", prompt)
    for token in (60, 61, 62):
        m.append_tokens("a", [token])
        m.allocate("a", 1)
        m.commit("a", m.num_tokens("a"))
    assert m.num_tokens("a") == 9 and len(m.block_table("a")) == 3
    assert m.block_hashes("a") == tuple(block_hashes(prompt + [60, 61, 62], 4))
    assert len(m.tree) == 2  # tokens 0..7 are two full blocks
    m.free("a")
    m.add_sequence("next-turn", prompt + [60, 61, 62, 1, 2])
    assert m.lookup("next-turn").device == 8


def test_appending_bad_tokens_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(6)))
    before = manager_snapshot(m)
    with pytest.raises(InvalidTokenError, match="position 1"):
        m.append_tokens("a", [1, -2])
    assert_unchanged(m, before)


# ------------------------------------------------------------------ duplicates


def test_concurrent_duplicate_blocks_stay_private_and_nothing_is_lost() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12)) + [1]
    m.add_sequence("a", prompt)
    m.add_sequence("b", prompt)
    assert list(m.allocate("a", 13)) == [0, 1, 2, 3]
    assert list(m.allocate("b", 13)) == [4, 5, 6, 7]  # b allocated before a committed: no hits
    m.commit("a", 13)
    m.commit("b", 13)  # b computed the same three blocks: no error
    assert [m.tree.block_of(h) for h in block_hashes(prompt, 4)] == [0, 1, 2]  # the first commit wins
    assert [m.pool.ref_count(b) for b in range(8)] == [2, 2, 2, 1, 1, 1, 1, 1]  # b pins a's nodes
    m.check_integrity()
    m.free("a")
    assert list(m.pool.fresh_order()) == [3]  # a's nodes are still pinned by b
    m.free("b")
    assert list(m.pool.fresh_order()) == [3, 7, 6, 5, 4]  # b's private copies come back fresh
    assert list(m.pool.idle_lru()) == [2, 1, 0]
    assert m.pool.num_free == 8
    m.check_integrity()


def test_duplicate_holder_keeps_the_prefix_it_builds_on() -> None:
    """b duplicates a's first block; a leaves; eviction pressure must not orphan b's later blocks."""
    m = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(8)) + [1]
    m.add_sequence("a", prompt)
    m.add_sequence("b", prompt)
    assert list(m.allocate("a", 9)) == [0, 1, 2]
    assert list(m.allocate("b", 9)) == [3, 4, 5]
    m.commit("a", 9)  # nodes 0, 1
    m.commit("b", 4)  # b's block 3 duplicates node 0: b pins 0
    m.free("a")  # node 1 goes idle; node 0 stays pinned
    prefill(m, "c", [90, 91, 92])  # takes fresh block 2
    prefill(m, "d", [80, 81, 82])  # must evict: only node 1 is evictable
    assert m.tree.block_of(block_hashes(prompt, 4)[1]) is None
    assert m.tree.block_of(block_hashes(prompt, 4)[0]) == 0
    m.commit("b", 9)  # b's own block 4 becomes the node for block 1, under the pinned node 0
    assert m.tree.block_of(block_hashes(prompt, 4)[1]) == 4 and m.tree.parent_of(4) == 0
    m.check_integrity()


# ------------------------------------------------------------------ free and preempt


def test_free_twice_is_a_double_free_and_unknown_is_unknown() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    prefill(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    before = manager_snapshot(m)
    with pytest.raises(DoubleFreeError, match="already freed"):
        m.free("a")
    with pytest.raises(UnknownSequenceError, match="'never'"):
        m.free("never")
    with pytest.raises(UnknownSequenceError, match="it was freed"):
        m.lookup("a")
    assert_unchanged(m, before)
    m.add_sequence("a", [1, 2])  # an id may be reused once freed
    m.free("a")


def test_free_of_a_sequence_never_admitted() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.add_sequence("a", [1, 2, 3])
    m.free("a")
    assert m.num_sequences == 0 and m.pool.num_fresh == 4


def test_preempt_releases_blocks_and_counts_readmission_apart() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    prefill(m, "a", prompt)
    stats = m.stats
    assert (stats.admissions, stats.readmissions) == (1, 0)
    m.preempt("a")
    assert "a" in m and not m.is_admitted("a") and m.pool.num_in_use == 0
    assert list(m.pool.idle_lru()) == [1, 0]
    assert m.lookup("a").device == 8
    assert list(m.allocate("a", 1)) == [0, 1, 3]  # hits, then the fresh queue (2 went to its back)
    stats = m.stats
    assert (stats.admissions, stats.queried_tokens, stats.hit_tokens) == (1, 9, 0)  # untouched
    assert (stats.readmissions, stats.readmission_queried_tokens, stats.readmission_hit_tokens) == (1, 9, 8)
    assert stats.hit_rate == 0.0
    m.check_integrity()


def test_preempt_of_a_sequence_not_admitted_is_refused() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.add_sequence("a", [1, 2, 3])
    before = manager_snapshot(m)
    with pytest.raises(SequenceStateError):
        m.preempt("a")
    assert_unchanged(m, before)


# ------------------------------------------------------------------ registration


def test_tokens_are_copied_and_caller_mutation_has_no_effect() -> None:
    m = KVCacheManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    m.add_sequence("a", tokens)
    hashes = m.block_hashes("a")
    tokens[0] = 77
    tokens.append(9)
    assert m.token_ids("a") == (1, 2, 3, 4, 5) and m.block_hashes("a") == hashes and m.num_tokens("a") == 5
    prefill(m, "b", [1, 2, 3])
    m.free("b")
    assert tokens == [77, 2, 3, 4, 5, 9]  # and the library never touches the caller's list


def test_sequences_given_by_block_hashes() -> None:
    m = KVCacheManager(num_blocks=8, block_size=512)
    m.add_sequence("r1", block_hashes=[10, 11, 12], num_tokens=1600)
    assert m.token_ids("r1") is None
    m.allocate("r1", 1600)
    m.commit("r1", 1600)
    m.free("r1")
    m.add_sequence("r2", block_hashes=[10, 11, 13], num_tokens=1536)
    assert m.lookup("r2").device == 1024
    with pytest.raises(SequenceStateError):
        m.append_tokens("r2", [1])
    m.check_integrity()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"token_ids": None}, InvalidArgumentError),
        ({"token_ids": []}, InvalidTokenError),
        ({"token_ids": [1, -1]}, InvalidTokenError),
        ({"token_ids": [1, 2.5]}, InvalidTokenError),
        ({"token_ids": [1], "extras": "lora"}, InvalidArgumentError),
        ({"token_ids": [1], "num_tokens": 1}, InvalidArgumentError),
        ({"token_ids": [1], "block_hashes": [1]}, InvalidArgumentError),
        ({"block_hashes": [1]}, InvalidArgumentError),
        ({"block_hashes": [1], "num_tokens": 9}, InvalidBlockHashError),
        ({"block_hashes": [-1], "num_tokens": 4}, InvalidBlockHashError),
        ({"block_hashes": [], "num_tokens": 0}, InvalidTokenError),
    ],
)
def test_bad_registrations_raise_and_change_nothing(kwargs, error) -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "x", list(range(9)))
    before = manager_snapshot(m)
    with pytest.raises(error):
        m.add_sequence("new", **kwargs)
    assert "new" not in m
    assert_unchanged(m, before)


def test_duplicate_and_unhashable_ids_are_refused() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", [1, 2, 3])
    before = manager_snapshot(m)
    with pytest.raises(DuplicateSequenceError):
        m.add_sequence("a", [4, 5])
    with pytest.raises(InvalidArgumentError, match="hashable"):
        m.add_sequence(["a"], [4, 5])
    with pytest.raises(InvalidArgumentError, match="hashable"):
        m.lookup(["a"])
    assert_unchanged(m, before)
    assert m.token_ids("a") == (1, 2, 3)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.lookup("nope"),
        lambda m: m.allocate("nope", 1),
        lambda m: m.can_allocate("nope", 1),
        lambda m: m.commit("nope", 1),
        lambda m: m.append_tokens("nope", [1]),
        lambda m: m.free("nope"),
        lambda m: m.preempt("nope"),
        lambda m: m.block_table("nope"),
        lambda m: m.num_tokens("nope"),
    ],
)
def test_unknown_sequence_everywhere(call) -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "a", list(range(5)))
    before = manager_snapshot(m)
    with pytest.raises(UnknownSequenceError, match="'nope'"):
        call(m)
    assert_unchanged(m, before)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_bad_token_counts_are_refused(bad) -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(5)))
    before = manager_snapshot(m)
    for call in (m.allocate, m.can_allocate, m.blocks_short):
        with pytest.raises(InvalidArgumentError):
            call("a", bad)
    assert_unchanged(m, before)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0, "block_size": 4},
        {"num_blocks": 4, "block_size": 0},
        {"num_blocks": 4.0, "block_size": 4},
        {"num_blocks": 4, "block_size": True},
        {"num_blocks": 4, "block_size": 4, "hash_scheme": "md5"},
        {"num_blocks": 4, "block_size": 4, "namespace": ""},
        {"num_blocks": 4, "block_size": 4, "namespace": 7},
        {"num_blocks": 4, "block_size": 4, "enable_prefix_caching": 1},
    ],
)
def test_bad_config_is_refused(kwargs) -> None:
    with pytest.raises(ConfigError):
        KVCacheManager(**kwargs)


def test_from_config() -> None:
    config = CacheConfig(num_blocks=16, block_size=8, hash_scheme="sha256", namespace="m")
    m = KVCacheManager.from_config(config)
    assert (m.num_blocks, m.block_size, m.config.namespace) == (16, 8, Namespace("m"))
    with pytest.raises(InvalidArgumentError):
        KVCacheManager.from_config({"num_blocks": 16})  # type: ignore[arg-type]


# ------------------------------------------------------------------ identity through the manager


def test_different_lora_or_namespace_never_hits() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    m.add_sequence("base", tokens)
    m.allocate("base", 9)
    m.commit("base", 9)
    m.add_sequence("lora", tokens, extras=BlockExtras(lora="adapter"))
    m.add_sequence("salted", tokens, extras=BlockExtras(cache_salt="tenant"))
    m.add_sequence("same", tokens)
    assert (m.lookup("lora").device, m.lookup("salted").device, m.lookup("same").device) == (0, 0, 8)
    other_model = KVCacheManager(num_blocks=16, block_size=4, namespace="other")
    other_model.add_sequence("x", tokens)
    assert not set(other_model.block_hashes("x")) & set(m.block_hashes("base"))


def test_interop_scheme_hashes_are_the_standards() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, hash_scheme="xxh3-64-1337")
    m.add_sequence("a", list(range(9)))
    local = [xxhash.xxh3_64_intdigest(struct.pack("<4I", *range(i, i + 4)), seed=1337) for i in (0, 4)]
    seq1 = xxhash.xxh3_64_intdigest(struct.pack("<QQ", local[0], local[1]), seed=1337)
    assert m.block_hashes("a") == (local[0], seq1)


def test_prefix_caching_disabled_never_hits() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(m, "a", list(range(9)))
    m.free("a")
    assert m.pool.num_fresh == 8 and len(m.tree) == 0
    m.add_sequence("b", list(range(9)))
    assert m.lookup("b").device == 0
    assert list(m.allocate("b", 9)) == [3, 4, 5]
    m.check_integrity()


def test_events_follow_commits_and_evictions() -> None:
    sink = EventSink()
    m = KVCacheManager(num_blocks=3, block_size=2, event_sink=sink)
    prefill(m, "a", [1, 2, 3, 4, 5])
    hashes = block_hashes([1, 2, 3, 4], 2)
    m.free("a")
    prefill(m, "b", [7, 8, 9, 10, 11])  # needs 3 blocks: one fresh, two evicted
    records = sink.drain()
    assert [r.seq for r in records] == [0, 1, 2]
    # vLLM's fields: the stored blocks' tokens (not the partial fifth) and the block size
    assert records[0].event == BlockStored(tuple(hashes), None, "device", (1, 2, 3, 4), block_size=2)
    assert records[1].event == BlockRemoved((hashes[1], hashes[0]), "device")
    assert isinstance(records[2].event, BlockStored) and records[2].event.parent_hash is None


def test_stored_events_name_each_commit_s_new_tokens_and_the_sequence_s_lora() -> None:
    sink = EventSink()
    m = KVCacheManager(num_blocks=8, block_size=2, event_sink=sink)
    tokens = [5, 6, 7, 8, 9]
    m.add_sequence("a", tokens, extras=BlockExtras(lora="sql"))
    m.allocate("a", 5)
    m.commit("a", 3)  # block 0
    m.commit("a", 5)  # block 1 (token 9 is a partial block)
    hashes = block_hashes(tokens, 2, extras=BlockExtras(lora="sql"))
    assert [r.event for r in sink.drain()] == [
        BlockStored((hashes[0],), None, "device", (5, 6), block_size=2, lora_name="sql"),
        BlockStored((hashes[1],), hashes[0], "device", (7, 8), block_size=2, lora_name="sql"),
    ]
    m.add_sequence("b", block_hashes=[11, 12], num_tokens=4)  # no tokens known: the event says so
    m.allocate("b", 4)
    m.commit("b", 4)
    assert [r.event for r in sink.drain()] == [BlockStored((11, 12), None, "device", None, block_size=2)]


def test_reset_prefix_cache() -> None:
    sink = EventSink()
    m = KVCacheManager(num_blocks=8, block_size=4, event_sink=sink)
    prefill(m, "a", list(range(9)))
    assert m.reset_prefix_cache() is False  # a holds cached blocks
    assert len(m.tree) == 2
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert len(m.tree) == 0 and m.pool.num_fresh == 8
    assert sink.drain()[-1].event == AllBlocksCleared("device")
    m.add_sequence("b", list(range(9)))
    assert m.lookup("b").device == 0
    m.check_integrity()


# ------------------------------------------------------------------ the integrity check can fail


def test_check_integrity_catches_a_leaked_reference() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "a", list(range(9)))
    m.pool.acquire([0])  # a reference nobody holds
    with pytest.raises(IntegrityError, match="ref count"):
        m.check_integrity()


def test_check_integrity_catches_a_table_too_short() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "a", list(range(9)))
    m._seqs["a"].num_covered = 20
    with pytest.raises(IntegrityError, match="blocks for 20 tokens"):
        m.check_integrity()


def test_check_integrity_catches_a_cached_block_outliving_its_holder_order() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "a", list(range(9)))
    m.free("a")
    m.pool._idle.move_to_end(1)
    with pytest.raises(IntegrityError, match="released before its idle child"):
        m.check_integrity()


def test_check_integrity_catches_an_orphaned_node() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    prefill(m, "a", list(range(9)))
    m.tree._parent_of[1] = 5
    with pytest.raises(IntegrityError):
        m.check_integrity()
