"""vLLM's hybrid EAGLE, per-group event and different-block-size scenarios, restated for
:class:`kvblocks.hybrid.HybridKVCacheManager`.

Read from vllm-project/vllm ``tests/v1/core/test_prefix_caching.py`` at commit
003df2961dd8830c317a61f9745ccd557da9fa06: the scenarios tests/core/groups/test_vllm_scenarios_mamba.py left out while
kvblocks refused ``drop_last_matched_block`` for hybrid groups, tagged only the full group's events and
had one block size. Each test names the vLLM test it translates; the expectations are vLLM's except where
a comment marked "kvblocks:" says which documented rule differs. The differences met throughout are those
of tests/core/groups/test_vllm_scenarios_mamba.py (one pool per group with ids from 0, PLACEHOLDER for vLLM's null
block, caching at the commit, where a window group also releases what left its window) and:

* EAGLE: vLLM drops the last block of the common hit. kvblocks' ``drop_last_matched_block`` takes the
  largest hit every group serves below the common hit (``_hit_blocks``), the same in these scenarios.
* Events: vLLM tags an event with ``group_idx`` and the group's spec (``kv_cache_spec_kind``, the window
  size) when ``take_events`` hands it out; kvblocks tags it when it is emitted, with ``group`` and
  ``group_kind`` ("full", "sliding_window", "chunked_local", "recurrent"), and no window size.
* Block sizes: kvblocks' group 0 (full attention) always has the manager's block size, the finest; a local
  group may have a multiple of it. vLLM's configs with a coarser full group are restated with the roles
  swapped (full attention fine, the window coarse): the hit rule (every group's boundary) is the same.

Not translated: ``test_block_stored_event_group_idx_out_of_bounds`` (vLLM annotates queued events with
their group's spec and warns on an unknown index; kvblocks has no annotation step, every event is tagged
by the group that emits it), ``test_hybrid_cache_blocks_swa_tail_window_only`` and the EAGLE + SWA
alignment tests (a window group finer than full attention, which kvblocks cannot configure), and
``test_eagle_with_sliding_window`` (no full-attention group).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvblocks.errors import InvalidArgumentError
from kvblocks.events import EventSink
from kvblocks.events.codec import BlockRemoved, BlockStored, KVEvent
from kvblocks.hybrid import PLACEHOLDER, HybridKVCacheManager, LocalGroup
from kvblocks.hybrid.recurrent import RecurrentGroup, StateCopy
from tests.support.group_index import evicted, index_of  # the same lookup mock, recurrent groups included

B = 16
X = PLACEHOLDER


# ---------------------------------------------------------------------- helpers


def prompt(num_blocks: int, tail: list[int], block_size: int = B) -> list[int]:
    """vLLM's ``[i for i in range(n) for _ in range(block_size)]`` prompts, plus a tail."""
    return [i for i in range(num_blocks) for _ in range(block_size)] + tail


def tables(m: HybridKVCacheManager, seq: str) -> list[list[int]]:
    """The block tables of every attention group (recurrent groups have none)."""
    return [m.group_block_table(seq, g) for g in range(m.num_groups) if m.group_kinds[g] != "recurrent"]


def events(sink: EventSink) -> list[KVEvent]:
    return [record.event for record in sink.drain()]


def of_group(evs: Sequence[KVEvent], group: int) -> list[KVEvent]:
    return [e for e in evs if e.group == group]


# ---------------------------------------------------------------------- EAGLE


def test_prefill_hybrid_model_eagle() -> None:
    """vLLM ``test_prefill_hybrid_model_eagle``: full + two sliding-window groups (window 3 blocks) with EAGLE;
    a 6-block + 7-token prompt, then one sharing its 6 blocks hits 5, and per-group evictions."""
    m = HybridKVCacheManager(
        31,
        B,
        local_groups=[LocalGroup("sliding_window", 3 * B, 31), LocalGroup("sliding_window", 3 * B, 31)],
        drop_last_matched_block=True,
    )
    tokens0 = prompt(6, [6] * 7)
    m.add_sequence("0", tokens0)
    assert len(m.block_hashes("0")) == 6
    assert m.lookup("0").device == 0
    assert m.allocate("0", len(tokens0)) is not None
    assert tables(m, "0") == [list(range(7))] * 3  # vLLM: [1-7], [8-14], [15-21] from one pool
    m.commit("0", len(tokens0))  # kvblocks: caching, and the windows' release of blocks 0-2 (token 103
    m.check_integrity()  # attends to 56..103), happen at the commit
    assert tables(m, "0") == [list(range(7)), [X, X, X, 3, 4, 5, 6], [X, X, X, 3, 4, 5, 6]]

    tokens1 = prompt(6, [6] * 5)
    m.add_sequence("1", tokens1)
    assert m.lookup("1").device == 5 * B
    assert m.allocate("1", len(tokens1) - 5 * B, num_cached_tokens=5 * B) is not None
    m.check_integrity()
    # vLLM: hit ([1-5], [0, 0, 10, 11, 12], [0, 0, 17, 18, 19]), new ([22, 23], [24, 25], [26, 27])
    assert tables(m, "1") == [[0, 1, 2, 3, 4, 7, 8], [X, X, 2, 3, 4, 7, 8], [X, X, 2, 3, 4, 7, 8]]
    assert [m.group_pool(0).ref_count(b) for b in range(5)] == [2] * 5
    for g in (1, 2):  # kvblocks: req0 released block 2 at its commit, so req1 alone holds it
        assert [m.group_pool(g).ref_count(b) for b in (2, 3, 4)] == [1, 2, 2]

    hashes = m.block_hashes("1")
    m.free("0")
    m.free("1")
    m.check_integrity()
    cases: list[tuple[list[tuple[int, int]], int]] = [
        ([(1, 0), (2, 0)], 5),  # blocks outside the window at the hit: no effect
        ([(0, 0)], 0),  # full attention's first block: total miss
        ([(0, 5), (1, 5), (2, 5)], 4),  # the common hit is 5 blocks, EAGLE keeps 4
        ([(0, 5)], 4),
        ([(1, 4)], 3),  # the windows lack block 4: common hit 4, EAGLE keeps 3
        ([(2, 4)], 3),
        ([(0, 5), (1, 0), (2, 0)], 4),  # full serves 5, the windows need blocks 1-3 at 4: served
    ]
    for entries, expected in cases:
        with evicted(m, [(g, hashes[p]) for g, p in entries]):
            assert m.match(tokens1).device == expected * B, entries


@pytest.mark.parametrize("spec_types, expected_hit", [pytest.param(["full", "sliding_window"], 3, id="2g-full+sw")])
def test_prefill_hybrid_model_combinations_eagle(spec_types: list[str], expected_hit: int) -> None:
    """vLLM ``test_prefill_hybrid_model_combinations_eagle``: full + sliding window (2 blocks) with EAGLE; a
    4-block + 7-token prompt, then one sharing its 4 blocks hits 3 (the common hit 4 less EAGLE's block)."""
    assert spec_types == ["full", "sliding_window"]
    m = HybridKVCacheManager(
        20, B, local_groups=[LocalGroup("sliding_window", 2 * B, 20)], drop_last_matched_block=True
    )
    tokens0 = prompt(4, [4] * 7)
    m.add_sequence("0", tokens0)
    assert len(m.block_hashes("0")) == 4
    assert m.lookup("0").device == 0
    assert m.allocate("0", len(tokens0)) is not None
    assert len(tables(m, "0")) == 2
    m.commit("0", len(tokens0))  # kvblocks: vLLM caches at the allocation; token 71 attends to 40..71
    m.check_integrity()
    assert tables(m, "0") == [[0, 1, 2, 3, 4], [X, X, 2, 3, 4]]

    tokens1 = prompt(4, [6] * 5)
    m.add_sequence("1", tokens1)
    assert m.lookup("1").device == expected_hit * B
    assert m.allocate("1", len(tokens1) - expected_hit * B, num_cached_tokens=expected_hit * B) is not None
    m.check_integrity()
    # the hit's blocks: full 0-2; the window at 48 needs blocks 1-2 (block 1 released by req0, still cached)
    assert tables(m, "1") == [[0, 1, 2, 5, 6], [X, 1, 2, 5, 6]]
    assert [m.group_pool(1).ref_count(b) for b in (1, 2)] == [1, 2]
    m.free("0")
    m.free("1")
    m.check_integrity()


# ---------------------------------------------------------------------- events tagged by group


def three_types(sink: EventSink, num_blocks: int = 4) -> HybridKVCacheManager:
    """vLLM's ``make_kv_cache_config_three_types(4, ...)``: full, a sliding window of 2 blocks, Mamba."""
    return HybridKVCacheManager(
        num_blocks,
        4,
        local_groups=[LocalGroup("sliding_window", 8, num_blocks)],
        recurrent_groups=[RecurrentGroup(1, 2)],
        event_sink=sink,
    )


@pytest.mark.parametrize("group", [0, 1, 2])
def test_block_stored_event_group_idx(group: int) -> None:
    """vLLM ``test_block_stored_event_group_idx``: caching two blocks of an 8-token prompt emits one
    BlockStored tagged with the group's index and kind (vLLM's Mamba case is ``group`` 2).

    kvblocks: every group caches at the same commit, so each emits its own event. The recurrent group
    checkpoints only where the commit lands (token 8, block 1: parent block 0), and its event comes when
    the plan that saves the state has run (the second ``take_state_plan``), when the checkpoint is findable.
    """
    sink = EventSink()
    m = three_types(sink)
    m.add_sequence("r", list(range(8)))
    assert m.allocate("r", 8) is not None
    assert m.take_state_plan() == [StateCopy(2, None, 0)]
    m.commit("r", 8)
    m.check_integrity()
    assert m.take_state_plan() == [StateCopy(2, 0, 1)]
    h0, h1 = m.block_hashes("r")
    stored = of_group(events(sink), group)
    if group == 0:  # the full group's events name the tokens and block size, as vLLM's do
        assert stored == [BlockStored((h0, h1), None, "device", tuple(range(8)), 0, "full", block_size=4)]
    elif group == 1:
        assert stored == [BlockStored((h0, h1), None, "device", group=group, group_kind=m.group_kinds[group])]
    else:
        assert stored == []  # the save has not run yet
        assert m.take_state_plan() == []
        assert events(sink) == [BlockStored((h1,), h0, "device", group=2, group_kind="recurrent")]
    assert m.group_kinds == ("full", "sliding_window", "recurrent")
    m.check_integrity()


def test_block_stored_event_group_idx_multiple_groups() -> None:
    """vLLM ``test_block_stored_event_group_idx_multiple_groups``: full attention (group 0) and a sliding
    window of 128 tokens (group 1) cache the same two blocks; the two events are told apart by their group.

    kvblocks: no window size in the event (vLLM's ``kv_cache_spec_sliding_window``), and only the full
    group's events name the tokens and the block size (its snapshot: the block size; the tree keeps no tokens).
    """
    sink = EventSink()
    m = HybridKVCacheManager(4, 4, local_groups=[LocalGroup("sliding_window", 128, 4)], event_sink=sink)
    m.add_sequence("r", list(range(8)))
    assert m.allocate("r", 8) is not None
    m.commit("r", 8)
    m.check_integrity()
    hashes = tuple(m.block_hashes("r"))
    assert events(sink) == [
        BlockStored(hashes, None, "device", tuple(range(8)), 0, "full", block_size=4),
        BlockStored(hashes, None, "device", group=1, group_kind="sliding_window"),
    ]
    assert m.snapshot_events() == [
        BlockStored(hashes, None, "device", group=0, group_kind="full", block_size=4),
        BlockStored(hashes, None, "device", group=1, group_kind="sliding_window"),
    ]


@pytest.mark.parametrize("group", [0, 1, 2])
def test_block_removed_event_group_idx(group: int) -> None:
    """vLLM ``test_block_removed_event_group_idx``: two cached blocks of a group, freed, then evicted by a
    request needing every block: the BlockRemoved events carry the group.

    kvblocks: one BlockRemoved per eviction call, tail first; an attention group evicts at the admission
    that needs the blocks, the recurrent group (2 checkpoints) one checkpoint per new checkpoint planned.
    """
    sink = EventSink()
    m = three_types(sink)
    m.add_sequence("a", list(range(8)))
    assert m.allocate("a", 8) is not None
    m.take_state_plan()
    for end in (4, 8):  # one block per step: the recurrent group checkpoints both blocks
        m.commit("a", end)
        m.take_state_plan()
    m.take_state_plan()
    a0, a1 = m.block_hashes("a")
    m.free("a")
    m.check_integrity()
    events(sink)

    m.add_sequence("b", list(range(100, 116)))
    assert m.allocate("b", 16) is not None  # 4 blocks of 4 in each attention group
    m.check_integrity()
    m.take_state_plan()
    admitted = of_group(events(sink), group)
    for end in (4, 8):
        m.commit("b", end)
        m.check_integrity()
        m.take_state_plan()
    removed = [e for e in admitted + of_group(events(sink), group) if isinstance(e, BlockRemoved)]
    kind = m.group_kinds[group]
    if group < 2:
        assert removed == [BlockRemoved((a1, a0), "device", group=group, group_kind=kind)]
    else:
        assert removed == [
            BlockRemoved((a0,), "device", group=2, group_kind="recurrent"),
            BlockRemoved((a1,), "device", group=2, group_kind="recurrent"),
        ]


# ---------------------------------------------------------------------- a coarser group


def coarse_window() -> HybridKVCacheManager:
    """vLLM's full attention of block 32 beside a window (32 tokens) of block 16, roles swapped: full
    attention of block 16 beside a window of 32 tokens in blocks of 32."""
    m = HybridKVCacheManager(100, B, local_groups=[LocalGroup("sliding_window", 2 * B, 100, block_size=2 * B)])
    assert m.hit_step == 2 * B
    return m


def test_different_block_size() -> None:
    """vLLM ``test_different_block_size``: a hit must be a multiple of the coarser group's block (32).
    req0 computes 7 blocks; prompts of 7 and 6 blocks + 1 token hit 6 fine blocks (3 coarse); when the
    fine group's hit falls to 5 blocks, the common hit is 4, not 5.

    kvblocks: roles swapped (module docstring), so the losses that make the fine group's hit 80 are full
    attention's block 5 (vLLM: the window's blocks 5 and 6).
    """
    m = coarse_window()
    common = prompt(10, [])
    m.add_sequence("0", common)
    assert m.lookup("0").device == 0
    assert m.allocate("0", 7 * B) is not None
    assert tables(m, "0") == [list(range(7)), [0, 1, 2, 3]]  # vLLM: ([1-4], [5-11]), the other way round
    m.commit("0", 7 * B)  # token 112 attends to 81..112: window blocks 0-1 (tokens 0-63) released
    m.check_integrity()
    assert tables(m, "0") == [list(range(7)), [X, X, 2, 3]]

    tokens1 = common[: 7 * B + 1]
    m.add_sequence("1", tokens1)
    assert m.lookup("1").device == 6 * B
    assert len(m.tree.matched_blocks(m.block_hashes("1"), 7)) == 7  # full attention alone would serve 7
    m.add_sequence("2", common[: 6 * B + 1])
    assert m.lookup("2").device == 6 * B

    hashes = m.block_hashes("1")
    with evicted(m, [(0, hashes[5])]):
        assert m.match(tokens1).device == 4 * B
    with evicted(m, [(1, hashes[5])]):  # the window group's block 2 (tokens 64-95) is keyed by hash 5
        assert m.match(tokens1).device == 4 * B
    assert m.allocate("1", 1, num_cached_tokens=6 * B) is not None
    m.check_integrity()
    assert tables(m, "1") == [[0, 1, 2, 3, 4, 5, 7], [X, X, 2, 4]]
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        m.allocate("2", 1 + 16, num_cached_tokens=5 * B)
    m.check_integrity()


def test_hybrid_cache_blocks_clamped_to_lcm() -> None:
    """vLLM ``test_hybrid_cache_blocks_clamped_to_lcm``: what lies past the last 32-token boundary is not
    cached by the coarse group. 7 blocks of 16 committed: the fine group caches 7, the coarse one 3
    (tokens 0-95; its block 3 holds 16 of 32 tokens and is not full).

    kvblocks: roles swapped (module docstring); vLLM's fine window caches 6 of 7, kvblocks' fine full
    attention all 7 (its blocks need no alignment of their own).
    """
    m = coarse_window()
    tokens = prompt(7, [])
    m.add_sequence("0", tokens)
    assert m.allocate("0", 7 * B) is not None
    m.commit("0", 7 * B)
    m.check_integrity()
    hashes = m.block_hashes("0")
    assert len(hashes) == 7
    assert all(h in index_of(m, 0) for h in hashes)
    assert {i for i, h in enumerate(hashes) if h in index_of(m, 1)} == {1, 3, 5}  # the keys of blocks 0-2
