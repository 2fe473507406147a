"""vLLM's lookahead / EAGLE / prompt-logprobs scenarios, translated to kvblocks, and the stale lookup of issue 13.

Learned from vLLM's ``tests/v1/core/test_prefix_caching.py`` (``test_prefill_plp``,
``test_eagle_enabled_removes_last_block``, ``test_eagle_with_partial_blocks``) and
``tests/v1/core/test_kv_cache_utils.py`` (``test_allocate_with_lookahead``); the code is ours.
Semantic differences, which change some expected ids:

* vLLM's block 0 is its null block; kvblocks' ids start at 0, so vLLM's ``[1, 2, 3, 4]`` is ``[0, 1, 2, 3]``.
* Fresh blocks are handed out in id order; uncommitted blocks a sequence releases rejoin the fresh list at
  its end (vLLM puts them at the head of its single free queue), and cached blocks wait in a separate idle
  LRU that is used only after the fresh list is empty.
* kvblocks never counts the last prompt token as cached: the cacheable prefix is ``(len - 1) // B`` blocks,
  the rule vLLM applies by popping the last block hash when the prompt is block-aligned.
* A request that computes a block already cached (prompt logprobs, EAGLE's dropped block) keeps its private
  copy and *pins* the cached node; vLLM keeps a second block carrying the same hash.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvblocks import KVCacheManager, block_hashes
from kvblocks.errors import StaleLookupError
from tests.support.snapshots import full_snapshot

COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16


def computed(m: KVCacheManager, seq_id: str, tokens: list[int], **kwargs: Any) -> list[int]:
    """Register, admit with every uncached token, and commit the whole prompt: a finished prefill."""
    m.add_sequence(seq_id, tokens, **kwargs)
    hit = m.lookup(seq_id).device
    table = m.allocate(seq_id, len(tokens) - hit, num_cached_tokens=hit)
    assert table is not None
    m.commit(seq_id, len(tokens))
    return list(table)


# ---------------------------------------------------------------- lookahead (speculative decoding)


@pytest.mark.parametrize(("lookahead", "blocks"), [(2, [0, 1]), (4, [0, 1]), (6, [0, 1, 2])])
def test_allocate_with_lookahead(lookahead: int, blocks: list[int]) -> None:
    """vLLM test_allocate_with_lookahead: 3 new tokens + k draft slots take ceil((3 + k) / 4) blocks."""
    m = KVCacheManager(num_blocks=10, block_size=4)
    m.add_sequence("0", [7, 8, 9])
    assert list(m.allocate("0", 3, num_lookahead_tokens=lookahead)) == blocks  # type: ignore[arg-type]
    assert m.num_allocated_tokens("0") == 3 + lookahead
    assert m.num_computed_tokens("0") == 0


def test_lookahead_is_not_cumulative_and_rejected_slots_go_back() -> None:
    """Each call says how many draft slots it wants now; slots past that return to the fresh list's end."""
    m = KVCacheManager(num_blocks=10, block_size=4)
    m.add_sequence("0", [1, 2, 3])
    assert list(m.allocate("0", 3, num_lookahead_tokens=6)) == [0, 1, 2]  # type: ignore[arg-type]
    assert list(m.allocate("0", 0, num_lookahead_tokens=1)) == [0]  # type: ignore[arg-type]
    assert m.num_allocated_tokens("0") == 4
    assert list(m.pool.fresh_order()) == [3, 4, 5, 6, 7, 8, 9, 2, 1]  # surplus released tail first
    assert list(m.allocate("0", 0, num_lookahead_tokens=6)) == [0, 3, 4]  # type: ignore[arg-type]
    m.check_integrity()


def test_issue_13_four_drafts_per_step_accepting_one_token_keeps_the_table_tight() -> None:
    """The issue: k=4 draft slots per step, one token accepted per step, block 4: 18 tokens need 6 blocks, not 12."""
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence("r", [5] * 6)
    m.allocate("r", 6, num_lookahead_tokens=4)
    known = 6
    while known < 18:
        # The forward pass wrote the KV of every known token; all drafts were rejected; one token was sampled.
        assert m.step(["r"], [known], [[known]], 1, 4) == []
        known += 1
        assert m.num_allocated_tokens("r") == known + 4
        assert len(m.block_table("r")) == -(-(known + 4) // 4)
    assert list(m.block_table("r")) == [0, 1, 2, 3, 4, 5]
    m.check_integrity()


def test_accepted_drafts_commit_into_lookahead_slots_per_sequence() -> None:
    """Accepted drafts are appended, then committed in their lookahead slots; the table does not grow for them."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("r", [1, 2, 3, 4, 5, 6])
    assert list(m.allocate("r", 6, num_lookahead_tokens=3)) == [0, 1, 2]  # type: ignore[arg-type]
    m.append_tokens("r", [7, 8, 9])  # sampled 7 for the last prompt position; drafts 8, 9 verified
    m.commit("r", 8)  # prompt + 7 + the accepted draft 8 (9 was the bonus token, not yet computed)
    assert (m.num_computed_tokens("r"), m.num_allocated_tokens("r")) == (8, 9)
    assert list(m.block_table("r")) == [0, 1, 2]
    assert m.tree.hash_of(1) is not None  # block 1 (tokens 4..7) is full and written: cached
    m.check_integrity()


def test_step_commits_the_accepted_drafts_it_appends() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("r", [1, 2, 3, 4, 5, 6])
    m.allocate("r", 6, num_lookahead_tokens=2)
    assert m.step(["r"], [6], [[7]], 1, 2) == []  # prefill done, 7 sampled; slots for 7 + drafts d1, d2
    # The forward pass wrote KV for 7, d1, d2; d1 = 8 accepted, d2 rejected, bonus 10 sampled.
    assert m.step(["r"], [8], [[8, 10]], 1, 2) == []
    assert (m.num_computed_tokens("r"), m.num_tokens("r"), m.num_allocated_tokens("r")) == (8, 9, 11)


# ---------------------------------------------------------------- EAGLE / MTP: drop the last matched block


def test_eagle_block_aligned_prompt_keeps_one_block() -> None:
    """vLLM test_eagle_enabled_removes_last_block: 48 tokens, 3 cached blocks -> 2 matchable -> EAGLE keeps 1."""
    m = KVCacheManager(num_blocks=10, block_size=16, drop_last_matched_block=True)
    assert computed(m, "prime", COMMON) == [0, 1, 2]
    m.free("prime")
    assert len(m.tree) == 3
    assert m.match(COMMON).device == 16
    m.add_sequence("eagle", COMMON)
    assert m.lookup("eagle").device == 16
    table = m.allocate("eagle", 48 - 16, num_cached_tokens=16)
    assert table is not None and list(table) == [0, 3, 4]  # the hit, then two fresh blocks
    assert m.num_computed_tokens("eagle") == 16


def test_eagle_partial_last_block_keeps_one_block() -> None:
    """vLLM test_eagle_with_partial_blocks: 2 full blocks + 5 tokens -> 2 matched -> EAGLE keeps 1."""
    m = KVCacheManager(num_blocks=10, block_size=16, drop_last_matched_block=True)
    tokens = [0] * (2 * 16 + 5)
    assert computed(m, "prime", tokens) == [0, 1, 2]
    m.free("prime")
    assert m.match(tokens).device == 16
    assert KVCacheManager(num_blocks=10, block_size=16).match(tokens).device == 0  # nothing cached there


def test_eagle_single_block_hit_becomes_a_miss_and_recomputing_pins_the_cached_copy() -> None:
    """One matched block, dropped: a miss; recomputing it keeps the cached node (pinned), not a second copy."""
    m = KVCacheManager(num_blocks=6, block_size=4, drop_last_matched_block=True)
    assert computed(m, "prime", [1, 2, 3, 4, 5]) == [0, 1]
    m.free("prime")
    m.add_sequence("r", [1, 2, 3, 4, 9])
    assert m.lookup("r").device == 0
    assert list(m.allocate("r", 5, num_cached_tokens=0)) == [2, 3]  # type: ignore[arg-type]
    m.commit("r", 5)
    assert m._seqs["r"].pins == {0: 0} and m.pool.ref_count(0) == 1
    assert m.tree.hash_of(2) is None  # the private copy never enters the tree
    m.check_integrity()


# ---------------------------------------------------------------- prompt logprobs: skip reading, still write


def test_prefill_plp() -> None:
    """vLLM test_prefill_plp: a prompt-logprobs request never hits, yet its blocks are cached for others."""
    m = KVCacheManager(num_blocks=10, block_size=16)
    # Request 0 wants prompt logprobs: no hit, four fresh blocks; its three full blocks enter the tree.
    assert computed(m, "0", COMMON + [3] * 7, skip_cache_read=True) == [0, 1, 2, 3]
    assert [m.tree.hash_of(b) is not None for b in range(4)] == [True, True, True, False]
    # Request 1 (no logprobs) hits the common prefix while request 0 still holds it.
    m.add_sequence("1", COMMON + [3] * 5)
    assert m.lookup("1").device == 48
    assert list(m.allocate("1", 53 - 48, num_cached_tokens=48)) == [0, 1, 2, 4]  # type: ignore[arg-type]
    assert [m.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 2]
    assert m.num_free_blocks == 5
    m.free("0")
    m.free("1")
    assert list(m.pool.fresh_order()) == [5, 6, 7, 8, 9, 3, 4]
    assert list(m.pool.idle_lru()) == [2, 1, 0]  # tail blocks evicted first
    # Request 2 wants prompt logprobs again: no hit although 48 tokens are cached; fresh blocks only.
    m.add_sequence("2", COMMON + [3] * 6, skip_cache_read=True)
    assert m.lookup("2").device == 0
    assert m.match(COMMON + [3] * 6).device == 48  # what a reading request would get
    assert list(m.allocate("2", 54)) == [5, 6, 7, 8]  # type: ignore[arg-type]
    m.commit("2", 54)
    # Same hashes as request 0's blocks: the cached nodes stay, pinned; the private copies stay out of the tree.
    assert list(m.block_hashes("2")[:3]) == list(block_hashes(COMMON + [3] * 7, 16)[:3])
    assert m._seqs["2"].pins == {0: 0, 1: 1, 2: 2}
    assert [m.pool.ref_count(b) for b in range(10)] == [1, 1, 1, 0, 0, 1, 1, 1, 1, 0]
    assert all(m.tree.hash_of(b) is None for b in (5, 6, 7, 8))
    stats = m.stats
    assert (stats.admissions, stats.queried_tokens, stats.hit_tokens) == (3, 55 + 53 + 54, 48)
    m.free("2")
    m.check_integrity()


# ---------------------------------------------------------------- step: a failed entry changes nothing


def test_step_failed_entry_changes_nothing_even_when_its_commit_pins_an_idle_block() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    computed(m, "a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached; 2 partial
    m.free("a")
    m.add_sequence("s", [1, 2, 3, 4, 5], skip_cache_read=True)
    assert list(m.allocate("s", 5)) == [3, 2, 1]  # type: ignore[arg-type]  # block 1 evicted; 0 idle, free
    before = full_snapshot(m)
    # Commit 2 tokens (s's block 0 duplicates the idle cached block 0) and ask for 2 draft slots: one more block.
    failed = m.step(["s"], [2], None, 1, 2)
    assert failed == ["s"]
    assert full_snapshot(m) == before, "a failed step entry kept its commit"


# ---------------------------------------------------------------- admissions that cannot go stale


def test_issue_13_stale_lookup_raises_and_changes_nothing() -> None:
    """lookup(r2) sees 8 cached tokens; another admission evicts them; the admission told 8 refuses."""
    m = KVCacheManager(num_blocks=4, block_size=4)
    assert computed(m, "r1", list(range(10))) == [0, 1, 2]  # blocks 0, 1 (8 tokens) cached
    m.free("r1")
    m.add_sequence("r2", list(range(8)) + [50, 51])
    assert m.lookup("r2").device == 8
    m.add_sequence("r3", [90] * 16)
    assert list(m.allocate("r3", 16)) == [3, 2, 1, 0]  # type: ignore[arg-type]  # fresh, then idle leaves
    m.free("r3")
    before = full_snapshot(m)
    with pytest.raises(StaleLookupError):
        m.allocate("r2", 10 - 8, num_cached_tokens=8)
    assert full_snapshot(m) == before
    # Looked up again: no hit, and the admission covers every token the engine computes.
    assert m.lookup("r2").device == 0
    table = m.allocate("r2", 10, num_cached_tokens=0)
    assert table is not None and m.num_allocated_tokens("r2") == 10 and m.num_computed_tokens("r2") == 0


def test_admission_without_the_seen_hit_reports_the_hit_it_took() -> None:
    """Without num_cached_tokens the admission counts from the hit there is now and says which one it took."""
    m = KVCacheManager(num_blocks=4, block_size=4)
    computed(m, "r1", list(range(10)))
    m.free("r1")
    m.add_sequence("r2", list(range(8)) + [50, 51])
    m.add_sequence("r3", [90] * 16)
    m.allocate("r3", 16)
    m.free("r3")
    assert m.allocate("r2", 2) is not None
    assert m.num_computed_tokens("r2") == 0 and m.num_allocated_tokens("r2") == 2  # no silent short table


PREFIXES = [list(range(8)), list(range(4)) + [7, 7, 7, 7], [6] * 8]


@st.composite
def interleavings(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Sequences admitted, committed and freed (or left running) before the admission of ``target``."""
    ops = []
    for _ in range(draw(st.integers(0, 5))):
        ops.append((draw(st.sampled_from(["run", "done"])), draw(st.integers(0, 2)), draw(st.integers(1, 12))))
    return ops


@settings(max_examples=400, deadline=None)
@given(
    block_size=st.sampled_from([2, 4]),
    num_blocks=st.integers(3, 8),
    first=st.integers(0, 2),
    middle=interleavings(),
    target=st.integers(0, 2),
    tail=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    n=st.integers(0, 6),
    k=st.integers(0, 3),
)
def test_admission_told_the_seen_hit_never_covers_less(
    block_size: int,
    num_blocks: int,
    first: int,
    middle: list[tuple[str, int, int]],
    target: int,
    tail: list[int],
    n: int,
    k: int,
) -> None:
    """For any interleaving between a lookup and the admission told its hit: StaleLookupError with nothing
    changed, or a table covering at least seen + n tokens, n of them to compute after the seen hit."""
    m = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    if computed_or_none(m, "warm", PREFIXES[first] + [99]):
        m.free("warm")  # its prefix stays cached, idle: the others may evict it
    m.add_sequence("t", PREFIXES[target] + tail)
    seen = m.lookup("t").device
    for i, (kind, prefix, extra) in enumerate(middle):
        seq_id = f"o{i}"
        if computed_or_none(m, seq_id, PREFIXES[prefix] + [100 + i] * extra) and kind == "done":
            m.free(seq_id)
    before = full_snapshot(m)
    still = m.match(PREFIXES[target] + tail).device
    try:
        table = m.allocate("t", n, num_lookahead_tokens=k, num_cached_tokens=seen)
    except StaleLookupError:
        event("stale")
        assert still < seen, "the cache still held the hit it was told"
        assert full_snapshot(m) == before
        return
    assert still >= seen
    event(f"seen {'0' if not seen else '> 0'}, {'refused' if table is None else 'admitted'}")
    if table is None:  # short of blocks: refused, nothing changed
        assert full_snapshot(m) == before
        return
    assert m.num_computed_tokens("t") == seen
    assert m.num_allocated_tokens("t") == seen + n + k
    assert len(table) * block_size >= seen + n
    m.check_integrity()


def computed_or_none(m: KVCacheManager, seq_id: str, tokens: list[int]) -> bool:
    """A finished prefill when the pool allows it (True); else the sequence waits, registered (False)."""
    m.add_sequence(seq_id, tokens)
    hit = m.lookup(seq_id).device
    if m.allocate(seq_id, len(tokens) - hit, num_cached_tokens=hit) is None:
        return False
    m.commit(seq_id, len(tokens))
    return True
