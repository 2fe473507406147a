"""vLLM's hybrid and Mamba prefix-caching scenarios, restated for :class:`kvblocks.hybrid.HybridKVCacheManager`.

Read from vllm-project/vllm ``tests/v1/core/test_prefix_caching.py`` at commit
003df2961dd8830c317a61f9745ccd557da9fa06 and ``tests/v1/core/test_single_type_kv_cache_manager.py`` at
commit 00b08dc44519a82cbdd9061d92d1226985094622 (the sliding-window and chunked-local hit tables of the
latter are in tests/core/groups/test_vllm_scenarios_hybrid.py). Each test names the vLLM test it translates; the
expectations are vLLM's except where a comment marked "kvblocks:" says which documented rule differs.

The differences met throughout (docs/hybrid.md, kvblocks/hybrid/recurrent.py):

* vLLM draws every group's blocks from one pool, ids from 1 (0 is the null block); kvblocks has one pool
  per group, ids from 0, and a window table shows PLACEHOLDER where vLLM shows the null block.
* vLLM caches full blocks when it allocates them; kvblocks when the engine commits them (so each
  scenario commits what vLLM's allocation computed), and a local group releases the blocks that left its
  window at that commit.
* vLLM keeps a Mamba state per block (or per aligned block in "align" mode, plus a "replay" state at the
  prompt's last boundary). kvblocks keeps one running slot per sequence and copies it into a cached
  checkpoint when a commit lands exactly on a multiple of ``checkpoint_every * block_size`` (vLLM's Mamba
  block size). The copy is a plan the engine runs; the checkpoint is findable from the next
  ``take_state_plan`` call on. So an engine that wants a prefix's state cached ends a prefill chunk there.
* kvblocks has exactly one full-attention group (group 0); vLLM's configs with several full groups map
  to it (same block size, same hits), configs without one have no kvblocks counterpart.

Per-group eviction of chosen hashes is mocked as vLLM does it (pop the hash from the group's map around a
pure lookup, then put it back).

Translated elsewhere: ``test_prefill_hybrid_model_eagle``, ``test_prefill_hybrid_model_combinations_eagle``,
``test_block_stored_event_group_idx`` (with its Mamba case), ``..._multiple_groups``,
``test_block_removed_event_group_idx`` and the window versions of ``test_different_block_size`` and
``test_hybrid_cache_blocks_clamped_to_lcm`` are in tests/core/groups/test_vllm_scenarios_hybrid_more.py (hybrid EAGLE,
tagged events per group and coarser local groups are supported now); its docstring lists what is still
not translated and why.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvblocks.hashing import BlockHash
from kvblocks.hybrid import PLACEHOLDER, HybridKVCacheManager, LocalGroup
from kvblocks.hybrid.recurrent import RecurrentGroup, StateCopy
from tests.support.group_index import evicted, index_of

B = 16
X = PLACEHOLDER


# ---------------------------------------------------------------------- helpers


def prompt(num_blocks: int, tail: list[int]) -> list[int]:
    """vLLM's ``[i for i in range(n) for _ in range(block_size)]`` prompts, plus a tail."""
    return [i for i in range(num_blocks) for _ in range(B)] + tail


def tables(m: HybridKVCacheManager, seq: str, groups: Sequence[int]) -> list[list[int]]:
    return [m.group_block_table(seq, g) for g in groups]


def plan(m: HybridKVCacheManager) -> list[StateCopy]:
    """One engine step's state plan (the previous one has run), with the manager checked after it."""
    ops = m.take_state_plan()
    m.check_integrity()
    return ops


def prefill(m: HybridKVCacheManager, seq: str, ends: Sequence[int]) -> list[list[StateCopy]]:
    """Commit ``seq`` chunk by chunk (one engine step per end); the plans each step hands out."""
    plans = []
    for end in ends:
        m.commit(seq, end)
        m.check_integrity()
        plans.append(plan(m))
    return plans


def checkpointed(m: HybridKVCacheManager, group: int, hashes: Sequence[BlockHash]) -> set[int]:
    """Block positions whose end has a findable checkpoint in recurrent group ``group``."""
    index = m._groups.recurrent(group).index
    return {i for i, h in enumerate(hashes) if h in index}


# ---------------------------------------------------------------------- full + sliding window (+ mamba)


def test_prefill_hybrid_model() -> None:
    """vLLM ``test_prefill_hybrid_model``: full + two sliding-window groups (window 2 blocks), a shared
    3-block prefix, then per-group evictions and the hit each leaves."""
    m = HybridKVCacheManager(
        20, B, local_groups=[LocalGroup("sliding_window", 2 * B, 20), LocalGroup("sliding_window", 2 * B, 20)]
    )
    groups = range(3)
    tokens0 = prompt(3, [3] * 7)
    m.add_sequence("0", tokens0)
    assert m.lookup("0").device == 0
    assert m.allocate("0", 55) is not None
    assert tables(m, "0", groups) == [[0, 1, 2, 3]] * 3  # vLLM: [1-4], [5-8], [9-12] from one pool
    m.commit("0", 55)  # kvblocks: caching (and the window's release of block 0) happens at the commit
    m.check_integrity()
    assert tables(m, "0", groups) == [[0, 1, 2, 3], [X, 1, 2, 3], [X, 1, 2, 3]]

    tokens1 = prompt(3, [3] * 5)
    m.add_sequence("1", tokens1)
    assert m.lookup("1").device == 3 * B
    assert m.allocate("1", 53 - 3 * B, num_cached_tokens=3 * B) is not None
    m.check_integrity()
    # vLLM: hit ([1, 2, 3], [0, 6, 7], [0, 10, 11]), new ([13], [14], [15])
    assert tables(m, "1", groups) == [[0, 1, 2, 4], [X, 1, 2, 4], [X, 1, 2, 4]]
    for g, hit in ((0, [0, 1, 2]), (1, [1, 2]), (2, [1, 2])):
        assert [m.group_pool(g).ref_count(b) for b in hit] == [2] * len(hit)

    hashes = m.block_hashes("1")
    m.free("0")
    m.free("1")
    m.check_integrity()
    cases: list[tuple[list[tuple[int, int]], int]] = [
        ([(1, 0), (2, 0)], 3),  # blocks outside the window at the hit: no effect
        ([(0, 0)], 0),  # full attention's first block: total miss
        ([(0, 2), (1, 2), (2, 2)], 2),
        ([(0, 2)], 2),
        ([(1, 2)], 2),
        ([(2, 2)], 2),
        ([(0, 2), (1, 0), (2, 0)], 0),  # full serves 2 blocks, the windows 3 but not 2: no common hit
    ]
    for entries, expected in cases:
        with evicted(m, [(g, hashes[p]) for g, p in entries]):
            assert m.match(tokens1).device == expected * B, entries


def test_prefill_hybrid_model_mamba() -> None:
    """vLLM ``test_prefill_hybrid_model`` with ``make_kv_cache_config_hybrid_model(second_spec_type="mamba")``:
    full + two Mamba groups, a shared 3-block prefix, per-group evictions, then real checkpoint eviction.

    kvblocks: the prefix's states are cached only because req0's prefill commits at 16, 32 and 48; a
    recurrent group serves any earlier checkpoint, so losing the full group's block 2 together with the
    checkpoint at 32 still leaves a 1-block hit (vLLM's window groups had 0 in the analogous case).
    """
    m = HybridKVCacheManager(20, B, recurrent_groups=[RecurrentGroup(2, 3), RecurrentGroup(2, 3)])
    tokens1 = prompt(3, [3] * 5)
    m.add_sequence("0", prompt(3, [3] * 7))
    assert m.allocate("0", 55) is not None
    assert m.group_block_table("0", 0) == [0, 1, 2, 3]
    assert (m.state_slot("0", 1), m.state_slot("0", 2)) == (0, 0)
    assert plan(m) == [StateCopy(1, None, 0), StateCopy(2, None, 0)]  # a new slot is zeroed
    # checkpoints 0, 1, 2 are states 2, 3, 4 (after the 2 running slots)
    assert prefill(m, "0", [16, 32, 48, 55]) == [
        [StateCopy(1, 0, 2), StateCopy(2, 0, 2)],
        [StateCopy(1, 0, 3), StateCopy(2, 0, 3)],
        [StateCopy(1, 0, 4), StateCopy(2, 0, 4)],
        [],  # 55 is no boundary; the plan saving 48 has run now
    ]

    m.add_sequence("1", tokens1)
    assert m.lookup("1").device == 3 * B
    assert m.allocate("1", 53 - 3 * B, num_cached_tokens=3 * B) is not None
    assert m.group_block_table("1", 0) == [0, 1, 2, 4]
    assert [m.group_pool(0).ref_count(b) for b in (0, 1, 2)] == [2, 2, 2]
    assert plan(m) == [StateCopy(1, 4, 1), StateCopy(2, 4, 1)]  # restore the state at 48 into slot 1

    hashes = m.block_hashes("1")
    m.free("0")
    m.free("1")
    assert plan(m) == []  # the restores have run: nothing holds a checkpoint any more
    assert [m.group_pool(g).ref_count(c) for g in (1, 2) for c in range(3)] == [0] * 6
    cases: list[tuple[list[tuple[int, int]], int]] = [
        ([(1, 0), (2, 0)], 3),  # earlier checkpoints are not needed for a hit at 48
        ([(0, 0)], 0),
        ([(0, 2), (1, 2), (2, 2)], 2),
        ([(0, 2)], 2),
        ([(1, 2)], 2),
        ([(2, 2)], 2),
        ([(0, 2), (1, 1), (2, 1)], 1),  # kvblocks: falls back to the checkpoint at 16
        ([(1, 1), (2, 2)], 1),  # the fixed point: 48 fails in group 2, 32 in group 1, 16 serves both
    ]
    for entries, expected in cases:
        with evicted(m, [(g, hashes[p]) for g, p in entries]):
            assert m.match(tokens1).device == expected * B, entries

    # Real eviction (vLLM test_prefill's "cache miss and eviction"): each checkpoint pool holds 3 states,
    # released in the order 16, 32, 48; a new prompt's checkpoints evict them least recently released first.
    m.add_sequence("3", [99] * (4 * B))
    assert m.allocate("3", 4 * B) is not None
    slot = m.state_slot("3", 1)
    assert plan(m) == [StateCopy(1, None, slot), StateCopy(2, None, slot)]
    for end, lost, hit in ((16, 0, 3), (32, 1, 3), (48, 2, 0)):
        m.commit("3", end)
        assert hashes[lost] not in index_of(m, 1) and hashes[lost] not in index_of(m, 2)
        assert plan(m) == [StateCopy(1, slot, 2 + lost), StateCopy(2, slot, 2 + lost)]
        assert m.match(tokens1).device == hit * B
    assert m.checkpoints_skipped == 0


# ---------------------------------------------------------------------- combinations

_COMBINATIONS = [
    # vLLM ids; every "full" maps to kvblocks' one full group (several full groups with one block size hit
    # alike). The cases without a full group (2g-sw+mamba, 2g-sw+sw_large, 4g-sw+mamba+sw_large+mamba) have
    # no kvblocks counterpart: group 0 is always full attention.
    pytest.param(["full", "sliding_window"], id="2g-full+sw"),
    pytest.param(["full", "mamba"], id="2g-full+mamba"),
    pytest.param(["full", "sliding_window", "sliding_window"], id="3g-full+2sw"),
    pytest.param(["full", "mamba", "mamba"], id="3g-full+2mamba"),
    pytest.param(["full", "sliding_window", "mamba"], id="3g-full+sw+mamba"),
    pytest.param(["full", "sliding_window", "sliding_window_large"], id="3g-full+sw+sw_large"),
    pytest.param(["full", "full", "sliding_window"], id="3g-2full+sw"),
    pytest.param(["full", "full", "mamba"], id="3g-2full+mamba"),
    pytest.param(["full", "sliding_window", "full", "sliding_window_large"], id="4g-interleaved-full+sw+sw_large"),
    pytest.param(["full", "mamba", "full", "mamba"], id="4g-interleaved-full+mamba"),
    pytest.param(["full", "full", "sliding_window", "mamba"], id="4g-2full+sw+mamba"),
]
_WINDOWS = {"sliding_window": 2 * B, "sliding_window_large": 4 * B}


@pytest.mark.parametrize("spec_types", _COMBINATIONS)
def test_prefill_hybrid_model_combinations(spec_types: list[str]) -> None:
    """vLLM ``test_prefill_hybrid_model_combinations``: a 55-token prompt, then a prompt sharing its 3 full
    blocks hits all 48 tokens in every group.

    kvblocks: req0's prefill commits at 48 (a checkpoint boundary) before its last 7 tokens, else no
    recurrent group could serve the hit; vLLM's ``new_step_starts`` is the ``take_state_plan`` call.
    """
    windows = [_WINDOWS[t] for t in spec_types if t in _WINDOWS]
    num_recurrent = spec_types.count("mamba")
    m = HybridKVCacheManager(
        10,
        B,
        local_groups=[LocalGroup("sliding_window", w, 10) for w in windows],
        recurrent_groups=[RecurrentGroup(2, 2) for _ in range(num_recurrent)],
    )
    first_recurrent = 1 + len(windows)
    recurrent = range(first_recurrent, m.num_groups)
    m.add_sequence("0", prompt(3, [3] * 7))
    assert m.lookup("0").device == 0
    assert m.allocate("0", 55) is not None
    assert plan(m) == [StateCopy(g, None, 0) for g in recurrent]
    assert prefill(m, "0", [48, 55]) == [[StateCopy(g, 0, 2) for g in recurrent], []]

    m.add_sequence("1", prompt(3, [4] * 5))
    assert m.lookup("1").device == 3 * B
    assert m.allocate("1", 5, num_cached_tokens=3 * B) is not None
    assert m.group_block_table("1", 0) == [0, 1, 2, 4]
    for g, window in enumerate(windows, 1):  # a window of 2 blocks needs blocks 1-2 at 48, of 4 blocks all
        assert m.group_block_table("1", g) == ([X, 1, 2, 4] if window == 2 * B else [0, 1, 2, 4])
    assert plan(m) == [StateCopy(g, 2, 1) for g in recurrent]
    m.free("0")
    m.free("1")
    m.check_integrity()


# ---------------------------------------------------------------------- mamba "align" mode scenarios


def test_prefill_hybrid_model_mamba_align() -> None:
    """vLLM ``test_prefill_hybrid_model_mamba_align`` (a crash on null blocks in align mode, issue 34361):
    full + Mamba, a 55-token prompt allocated in one call.

    kvblocks has no per-block Mamba table, so no null blocks: the sequence gets a zeroed slot. A prefill
    committed in one 55-token chunk lands on no boundary, so it takes no checkpoint and a repeat misses.
    """
    m = HybridKVCacheManager(30, B, recurrent_groups=[RecurrentGroup(2, 4)])
    tokens = prompt(3, [3] * 7)
    m.add_sequence("0", tokens)
    assert m.lookup("0").device == 0
    assert m.allocate("0", 55) is not None
    assert m.group_block_table("0", 0) == [0, 1, 2, 3]
    assert plan(m) == [StateCopy(1, None, 0)]
    assert prefill(m, "0", [55, 55]) == [[], []]
    assert m.match(tokens).device == 0  # the full group holds 3 blocks, no state checkpoint does
    m.free("0")
    m.check_integrity()


def test_hybrid_cache_mamba_align_shared_prefix_detection() -> None:
    """vLLM ``test_hybrid_cache_mamba_align_shared_prefix_detection``: a 3-block prompt cached, one extending
    it hits 48, one sharing only 2 blocks misses because no state was kept at 32.

    kvblocks reports no "shared prefix boundary" (vLLM's Marconi hint); ``next_checkpoint`` tells the
    scheduler where a chunk may end to get a state cached, the continuation is
    ``test_mamba_shared_prefix_reuse_under_zero_retention``.
    """
    m = HybridKVCacheManager(30, B, recurrent_groups=[RecurrentGroup(3, 4)])
    prefix = prompt(3, [])
    m.add_sequence("0", prefix)
    assert m.lookup("0").device == 0
    assert m.allocate("0", 3 * B) is not None
    assert plan(m) == [StateCopy(1, None, 0)]
    assert prefill(m, "0", [3 * B, 3 * B]) == [[StateCopy(1, 0, 3)], []]

    m.add_sequence("1", prefix + [100] * 7)
    assert m.lookup("1").device == 3 * B
    assert m.allocate("1", 7, num_cached_tokens=3 * B) is not None
    assert plan(m) == [StateCopy(1, 3, 1)]

    m.add_sequence("2", prefix[:-1] + [101])
    assert m.lookup("2").device == 0  # full attention holds 2 blocks; no checkpoint at 32 or 16
    assert m.allocate("2", 3 * B) is not None
    assert m.next_checkpoint("2") == B
    assert plan(m) == [StateCopy(1, None, 2)]
    for seq in ("0", "1", "2"):
        m.free(seq)
    m.check_integrity()


def test_hybrid_model_mamba_align_with_dynamic_draft_tokens() -> None:
    """vLLM ``test_hybrid_model_mamba_align_with_dynamic_draft_tokens`` (issue 39271): full + Mamba, 16
    draft slots one step, 1 the next; the smaller lookahead must not fail and adds no block.

    kvblocks counts the 16 proposed tokens as 1 new + 15 lookahead. A smaller lookahead gives the surplus
    tail block back (vLLM keeps it), and the state slot is unaffected by drafts.
    """
    m = HybridKVCacheManager(30, B, recurrent_groups=[RecurrentGroup(2, 4)])
    tokens = prompt(3, [3] * 7)
    m.add_sequence("0", tokens)
    assert m.allocate("0", len(tokens)) is not None
    assert plan(m) == [StateCopy(1, None, 0)]
    assert prefill(m, "0", [len(tokens)]) == [[]]
    m.append_tokens("0", [1])

    table = m.allocate("0", 1, num_lookahead_tokens=15)  # round 1: 16 proposed tokens
    assert table is not None and list(table) == [0, 1, 2, 3, 4]  # 56 + 15 tokens: 5 blocks
    m.commit("0", 56)  # one accepted
    m.append_tokens("0", [4])
    m.check_integrity()

    table = m.allocate("0", 1, num_lookahead_tokens=0)  # round 2: one proposed token
    assert table is not None and list(table) == [0, 1, 2, 3]
    assert m.group_pool(0).num_free == 30 - 4
    assert m.state_slot("0", 1) == 0 and plan(m) == []
    m.free("0")
    m.check_integrity()


def test_eagle_hybrid_mamba_hits_partial_prompt_boundary() -> None:
    """vLLM ``test_eagle_hybrid_mamba_hits_partial_prompt_boundary``: full attention of block 16, Mamba of
    block 544 (checkpoint_every 34), a 1249-token prompt computed to 1248 then 1249; a repeat hits 1248.

    kvblocks: translated without EAGLE (hybrid EAGLE, drop_last_matched_block, is covered in
    tests/core/groups/test_vllm_scenarios_hybrid_more.py), and no "replay"
    state at the prompt's last block boundary: checkpoints exist only at multiples of 544, so the engine's
    chunks end at 544 and 1088 (``next_checkpoint``) and the repeat hits 1088, the last one under 1248.
    """
    m = HybridKVCacheManager(200, B, recurrent_groups=[RecurrentGroup(2, 4, checkpoint_every=34)])
    tokens = list(range(1249))
    m.add_sequence("first", tokens)
    assert m.allocate("first", 1248) is not None
    assert plan(m) == [StateCopy(1, None, 0)]
    ends = []
    while (end := m.next_checkpoint("first")) is not None and end <= 1248:
        ends.append(end)
        m.commit("first", end)
        plan(m)
    assert ends == [544, 1088]
    m.commit("first", 1248)
    assert plan(m) == []
    m.append_tokens("first", [7])
    assert m.allocate("first", 1) is not None
    assert prefill(m, "first", [1249]) == [[]]
    m.free("first")

    m.add_sequence("second", tokens)
    assert m.lookup("second").device == 1088
    m.check_integrity()


# ---------------------------------------------------------------------- retention (which states are kept)


def prefill_in_blocks(m: HybridKVCacheManager, seq: str, tokens: list[int]) -> None:
    """Admit ``seq`` and prefill it one block per step (vLLM's dense default caches a state per block)."""
    m.add_sequence(seq, tokens)
    assert m.allocate(seq, len(tokens)) is not None
    plan(m)
    prefill(m, seq, range(B, len(tokens) + 1, B))
    plan(m)


@pytest.mark.parametrize(
    "checkpoint_every, expected",
    [(1, set(range(16))), (4, {3, 7, 11, 15})],
    ids=["interval-16", "interval-64"],
)
def test_mamba_reachable_block_mask_sparsifies_retention(checkpoint_every: int, expected: set[int]) -> None:
    """vLLM ``test_mamba_reachable_block_mask_sparsifies_retention``: a retention interval of one block keeps
    a state per block, one of 4 blocks keeps the segment tails {3, 7, 11, 15}.

    kvblocks: the interval is ``checkpoint_every``, set per group. vLLM also keeps the replay boundary
    (block 14, token 240) and has an interval 0 ("replay only"); kvblocks keeps neither, so a repeat of the
    256-token prompt hits 192 with interval 64 where vLLM's would hit 240.
    """
    m = HybridKVCacheManager(40, B, recurrent_groups=[RecurrentGroup(2, 16, checkpoint_every=checkpoint_every)])
    tokens = prompt(16, [])
    prefill_in_blocks(m, "r", tokens)
    assert checkpointed(m, 1, m.block_hashes("r")) == expected
    assert m.match(tokens).device == (240 if checkpoint_every == 1 else 192)


@pytest.mark.parametrize("chunks, expected", [([256], {15}), ([96, 256], {5, 15})], ids=["unpinned", "pinned-96"])
def test_mamba_shared_prefix_survives_zero_retention(chunks: list[int], expected: set[int]) -> None:
    """vLLM ``test_mamba_shared_prefix_survives_zero_retention``: without a pin only the end of the prompt
    keeps a state; pinning the shared prefix at token 96 keeps block 5's state too.

    kvblocks: a "pin" is a prefill chunk ending at 96; the end-of-prompt state is the one at 256 (block
    15), where vLLM keeps the replay boundary 240 (block 14).
    """
    m = HybridKVCacheManager(100, B, recurrent_groups=[RecurrentGroup(2, 8)])
    tokens = prompt(16, [])
    m.add_sequence("r", tokens)
    assert m.allocate("r", len(tokens)) is not None
    plan(m)
    prefill(m, "r", chunks)
    plan(m)
    assert checkpointed(m, 1, m.block_hashes("r")) == expected


def test_mamba_shared_prefix_reuse_under_zero_retention() -> None:
    """vLLM ``test_mamba_shared_prefix_reuse_under_zero_retention`` (its dense / pinned outcome): req0 primes
    a 2-block shared prefix, req1 sees full attention hit it but Mamba not, computes a chunk ending at the
    junction (32), and req2 then reuses 32 tokens.

    kvblocks needs no pin: the chunk that ends at 32 takes the checkpoint (``checkpoint_every`` 1).
    """
    m = HybridKVCacheManager(200, B, recurrent_groups=[RecurrentGroup(3, 8)])
    shared = [7] * (2 * B)

    m.add_sequence("0", shared + [50] * (2 * B))
    assert m.allocate("0", 4 * B) is not None
    assert plan(m) == [StateCopy(1, None, 0)]
    assert prefill(m, "0", [4 * B, 4 * B]) == [[StateCopy(1, 0, 3)], []]  # one chunk: a state at 64 only

    m.add_sequence("1", shared + [60] * (2 * B))
    assert m.tree.match_length(m.block_hashes("1")) == 2  # the attention hit exists ...
    assert m.lookup("1").device == 0  # ... but no state at 32: Mamba lags
    assert m.allocate("1", 2 * B) is not None  # the Marconi chunk: up to the junction
    assert plan(m) == [StateCopy(1, None, 1)]
    assert prefill(m, "1", [2 * B, 2 * B]) == [[StateCopy(1, 1, 4)], []]

    m.add_sequence("2", shared + [70] * (2 * B))
    assert m.lookup("2").device == 2 * B
    assert m.allocate("2", 2 * B, num_cached_tokens=2 * B) is not None
    assert plan(m) == [StateCopy(1, 4, 2)]


# ---------------------------------------------------------------------- a coarser group than full attention


def test_different_block_size() -> None:
    """vLLM ``test_different_block_size``: a hit must be a multiple of the coarser group's block. There full
    attention has block 32 beside a window of block 16; here the coarser group is Mamba with a 32-token
    block (checkpoint_every 2) beside full attention of block 16 (a coarser local group's version is in
    tests/core/groups/test_vllm_scenarios_hybrid_more.py: kvblocks' full-attention group has the finest block size).

    req0 computes 7 blocks one block per step; prompts of 7 and 6 blocks + 1 token hit 6 blocks; losing the
    state at 96 (vLLM: the window's blocks 5 and 6, a window hit of 80) leaves 64, not 80.
    """
    m = HybridKVCacheManager(100, B, recurrent_groups=[RecurrentGroup(2, 8, checkpoint_every=2)])
    common = prompt(10, [])
    m.add_sequence("0", common)
    assert m.lookup("0").device == 0
    assert m.allocate("0", 7 * B) is not None
    assert m.group_block_table("0", 0) == list(range(7))
    plan(m)
    plans = prefill(m, "0", range(B, 7 * B + 1, B))
    assert [len(p) for p in plans] == [0, 1, 0, 1, 0, 1, 0]  # saves at 32, 64 and 96 only

    tokens1 = common[: 7 * B + 1]
    assert m.match(tokens1).device == 6 * B
    assert m.match(common[: 6 * B + 1]).device == 6 * B
    with evicted(m, [(1, m.block_hashes("0")[5])]):
        assert m.match(tokens1).device == 4 * B


def test_hybrid_cache_blocks_clamped_to_lcm() -> None:
    """vLLM ``test_hybrid_cache_blocks_clamped_to_lcm``: what lies past the last aligned boundary can serve
    no hit, so it is not cached. vLLM clamps the finer window group's caching to the 32-token alignment
    (hashes 0-5 of 7); the kvblocks counterpart is a Mamba group of 32-token checkpoints, which keeps states
    at 32, 64 and 96 and none at 112.

    kvblocks: the full group caches all 7 blocks (its hits need no alignment of their own).
    """
    m = HybridKVCacheManager(100, B, recurrent_groups=[RecurrentGroup(2, 8, checkpoint_every=2)])
    tokens = prompt(7, [])
    prefill_in_blocks(m, "0", tokens)
    hashes = m.block_hashes("0")
    assert len(hashes) == 7
    assert checkpointed(m, 1, hashes) == {1, 3, 5}
    assert all(h in m.tree for h in hashes)


# ---------------------------------------------------------------------- test_single_type_kv_cache_manager.py


def test_replayssm_queues_live_copy_for_new_state_block() -> None:
    """vLLM ``test_replayssm_queues_live_copy_for_new_state_block`` (block size 4): allocating 3 tokens
    queues no copy; reaching the next state block queues a copy of the live state (source -> destination),
    and both stay referenced until the copy is taken and run.

    kvblocks: the copy is planned when the commit lands on the block boundary (4), from the running slot
    into a checkpoint; the checkpoint is held (reference 1) until the next ``take_state_plan`` says the
    plan ran, then it is idle and findable. A new slot's first op is a zero, not a copy.
    """
    m = HybridKVCacheManager(6, 4, recurrent_groups=[RecurrentGroup(1, 2)])
    m.add_sequence("request", list(range(9)))
    assert m.allocate("request", 3) is not None
    assert plan(m) == [StateCopy(1, None, 0)]
    m.commit("request", 3)
    assert plan(m) == []

    assert m.allocate("request", 2) is not None
    m.commit("request", 4)
    checkpoints = m.group_pool(1)
    assert checkpoints.ref_count(0) == 1  # being written: held, not findable
    assert m._groups.recurrent(1).index.block_of(m.block_hashes("request")[0]) is None
    m.check_integrity()
    assert plan(m) == [StateCopy(1, 0, 1)]  # slot 0 -> checkpoint 0 (state 1)
    m.commit("request", 5)
    assert plan(m) == []  # the copy ran
    assert checkpoints.ref_count(0) == 0
    assert m._groups.recurrent(1).index.block_of(m.block_hashes("request")[0]) == 0
    m.free("request")
    m.check_integrity()


# ---------------------------------------------------------------------- admission failure and reset


def test_prefill_not_enough_free_blocks_with_computed_blocks_mamba() -> None:
    """vLLM ``test_prefill_not_enough_free_blocks_with_computed_blocks``: an admission that cannot be served
    leaves its cached prefix untouched. kvblocks: the shortage here is a Mamba running slot (full + Mamba,
    one slot); the failed admission holds neither the full blocks nor the checkpoint it would restore.
    """
    m = HybridKVCacheManager(11, B, recurrent_groups=[RecurrentGroup(1, 2)])
    m.add_sequence("0", prompt(3, [3] * 7))
    assert m.allocate("0", 55) is not None
    assert plan(m) == [StateCopy(1, None, 0)]
    assert prefill(m, "0", [32, 48, 55]) == [[StateCopy(1, 0, 1)], [StateCopy(1, 0, 2)], []]

    m.add_sequence("1", prompt(3, [3] * 5))
    assert m.lookup("1").device == 3 * B
    assert m.blocks_short("1", 5) == 1  # no free slot counts as one block short
    assert m.allocate("1", 5, num_cached_tokens=3 * B) is None
    m.check_integrity()
    assert [m.group_pool(0).ref_count(b) for b in range(5)] == [1, 1, 1, 1, 0]
    assert [m.group_pool(1).ref_count(c) for c in range(2)] == [0, 0]
    assert plan(m) == []

    m.free("0")
    assert m.allocate("1", 5, num_cached_tokens=3 * B) is not None
    assert plan(m) == [StateCopy(1, 2, 0)]


def test_reset_prefix_cache_mamba() -> None:
    """vLLM ``test_reset_prefix_cache`` over full + Mamba: refused while a sequence holds blocks, then (all
    freed, the plans run) it empties every group, checkpoints included.

    kvblocks: also refused while a plan that saves a checkpoint has not run (it would come back after).
    """
    m = HybridKVCacheManager(11, B, recurrent_groups=[RecurrentGroup(2, 4)])
    m.add_sequence("0", prompt(3, [3] * 7))
    assert m.allocate("0", 55) is not None
    plan(m)
    assert prefill(m, "0", [48, 55]) == [[StateCopy(1, 0, 2)], []]
    m.add_sequence("1", prompt(3, [4] * 7))
    assert m.lookup("1").device == 3 * B
    assert m.allocate("1", 7, num_cached_tokens=3 * B) is not None
    assert m.group_block_table("1", 0) == [0, 1, 2, 4]
    assert plan(m) == [StateCopy(1, 2, 1)]
    assert not m.reset_prefix_cache()
    assert len(m.tree) == 3

    m.free("0")
    m.free("1")
    assert plan(m) == []  # the restore into slot 1 has run
    m.add_sequence("2", prompt(4, []))
    assert m.allocate("2", B, num_cached_tokens=3 * B) is not None
    assert plan(m) == [StateCopy(1, 2, 1)]
    m.commit("2", 4 * B)  # a save is planned ...
    m.free("2")
    assert not m.reset_prefix_cache()  # ... so a reset waits until it is handed out
    assert plan(m) == [StateCopy(1, 1, 3)]
    assert not m.reset_prefix_cache()  # ... and has run
    assert plan(m) == []
    assert m.reset_prefix_cache()
    m.check_integrity()
    assert len(m.tree) == 0 and len(m._groups.recurrent(1).index) == 0
    assert m.match(prompt(4, [1])).device == 0


def test_reset_prefix_cache_mamba_restore_in_flight() -> None:
    """vLLM ``test_reset_prefix_cache``'s contract (a reset that succeeds leaves nothing cached) when the last
    handed-out plan restores a checkpoint: after the reset, recomputing the prompt must save a new state at
    48 and a later hit must restore that one, never the state from before the reset (e.g. old weights)."""
    m = HybridKVCacheManager(20, B, recurrent_groups=[RecurrentGroup(2, 4)])
    m.add_sequence("0", prompt(3, [3]))
    assert m.allocate("0", 49) is not None
    plan(m)
    assert prefill(m, "0", [48, 49]) == [[StateCopy(1, 0, 2)], []]
    m.free("0")
    m.add_sequence("1", prompt(3, [4]))
    assert m.allocate("1", 1, num_cached_tokens=3 * B) is not None
    assert plan(m) == [StateCopy(1, 2, 0)]  # handed out; the engine has not run it yet
    m.free("1")
    if not m.reset_prefix_cache():
        return  # refusing (as the base does while a block is in use) is a correct answer too
    m.check_integrity()
    assert len(m._groups.recurrent(1).index) == 0  # fails: checkpoint 0 (state 2) is still cached
    plan(m)
    m.add_sequence("2", prompt(3, [3]))
    assert m.allocate("2", 49) is not None
    assert prefill(m, "2", [48, 49])[0] == [StateCopy(1, 0, 3)]
