"""Recurrent groups in HybridKVCacheManager: running slots, checkpoints, the state plan and its commit rule."""

from __future__ import annotations

import pytest

from kvblocks import StaleLookupError
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hybrid import PLACEHOLDER, HybridKVCacheManager, LocalGroup, RecurrentGroup, StateCopy

B = 4


def manager(slots: int = 2, checkpoints: int = 4, every: int = 1, *, window: int | None = None) -> HybridKVCacheManager:
    locals_ = [LocalGroup("sliding_window", window, 16)] if window else []
    return HybridKVCacheManager(
        16, B, local_groups=locals_, recurrent_groups=[RecurrentGroup(slots, checkpoints, every)]
    )


def prefill(m: HybridKVCacheManager, seq: str, tokens: list[int], upto: int) -> None:
    """Admit ``seq`` and compute up to ``upto`` tokens in one chunk."""
    m.add_sequence(seq, tokens)
    hit = m.lookup(seq).total
    assert m.allocate(seq, upto - hit, num_cached_tokens=hit) is not None
    m.commit(seq, upto)


def test_an_admission_without_a_hit_zeroes_its_slot_and_a_boundary_commit_saves_a_checkpoint() -> None:
    m = manager()
    m.add_sequence("a", list(range(10)))
    m.allocate("a", 10)
    assert m.state_slot("a", 1) == 0
    m.commit("a", 6)  # not a block boundary: the running state is at 6, no checkpoint there
    assert m.take_state_plan() == [StateCopy(1, None, 0)]
    m.commit("a", 8)  # a boundary: slot 0 is saved into checkpoint 0 (state id 2 + 0)
    assert m.take_state_plan() == [StateCopy(1, 0, 2)]
    assert m.take_state_plan() == []


def test_a_checkpoint_is_findable_only_after_the_plan_saving_it_has_run() -> None:
    m = manager(slots=3)
    prefill(m, "a", list(range(10)), 8)
    m.add_sequence("b", list(range(12)))
    assert m.lookup("b").device == 0  # the save is planned, not handed out
    assert m.take_state_plan() == [StateCopy(1, None, 0), StateCopy(1, 0, 3 + 0)]
    assert m.lookup("b").device == 0  # handed out, not known to have run: same step, still no hit
    assert m.allocate("b", 12) is not None  # admitted now: computes everything
    assert m.take_state_plan() == [StateCopy(1, None, 1)]  # the previous plan ran: checkpoint findable
    m.add_sequence("c", list(range(12)))
    assert m.lookup("c").device == 8
    table = m.allocate("c", 4, num_cached_tokens=8)
    assert table is not None and table.num_cached_tokens == 8
    assert m.take_state_plan() == [StateCopy(1, 3 + 0, 2)]
    m.check_integrity()


def test_a_hit_restores_its_checkpoint_into_the_new_slot_and_holds_it_until_the_plan_ran() -> None:
    m = manager(slots=3)
    prefill(m, "a", list(range(10)), 8)
    m.take_state_plan()
    m.take_state_plan()
    m.free("a")
    m.add_sequence("b", list(range(9)))
    assert m.allocate("b", 1, num_cached_tokens=8) is not None
    slot = m.state_slot("b", 1)
    assert m.group_pool(1).ref_count(0) == 1  # the restore's source is held by the plan
    assert m.take_state_plan() == [StateCopy(1, 3 + 0, slot)]
    assert m.group_pool(1).ref_count(0) == 1  # handed out: held until the next plan says it ran
    m.take_state_plan()
    assert m.group_pool(1).ref_count(0) == 0 and m.group_pool(1).is_idle(0)
    m.check_integrity()


def test_the_hit_ends_at_the_last_checkpoint_even_when_attention_holds_more() -> None:
    m = manager()
    tokens = list(range(20))
    prefill(m, "a", tokens, 8)
    m.allocate("a", 8)
    m.commit("a", 16)  # 8 -> 16 in one chunk: a checkpoint at 16; 12 was passed inside the chunk
    m.take_state_plan()
    m.take_state_plan()
    m.add_sequence("b", tokens[:13])  # attention could serve 12 tokens; no checkpoint at 12
    assert m.lookup("b").device == 8
    m.add_sequence("c", tokens[:18])
    assert m.lookup("c").device == 16
    m.check_integrity()


def test_checkpoint_every_spaces_checkpoints_and_next_checkpoint_says_where() -> None:
    m = manager(every=2)  # a checkpoint every 8 tokens
    m.add_sequence("a", list(range(20)))
    m.allocate("a", 20)
    assert m.next_checkpoint("a") == 8
    m.commit("a", 4)  # a block boundary, not a checkpoint boundary
    assert [op for op in m.take_state_plan() if op.src is not None] == []
    m.commit("a", 8)
    assert m.take_state_plan() == [StateCopy(1, 0, 2)]
    assert m.next_checkpoint("a") == 16
    m.take_state_plan()
    m.add_sequence("b", list(range(12)))
    assert m.lookup("b").device == 8


def test_no_free_slot_refuses_the_admission_and_counts_as_one_block_short() -> None:
    m = manager(slots=1)
    prefill(m, "a", list(range(6)), 6)
    m.add_sequence("b", [9, 9, 9])
    assert m.blocks_short("b", 3) == 1
    assert m.allocate("b", 3) is None
    assert not m.is_admitted("b") and m.group_pool(0).num_in_use == 2
    m.preempt("a")  # frees the slot
    assert m.blocks_short("b", 3) == 0 and m.allocate("b", 3) is not None
    assert m.state_slot("b", 1) == 0
    m.check_integrity()


def test_a_stale_hit_whose_checkpoint_was_evicted_raises_and_changes_nothing() -> None:
    m = manager(checkpoints=1)
    prefill(m, "a", list(range(10)), 8)
    m.take_state_plan()
    m.take_state_plan()
    m.free("a")
    m.add_sequence("b", list(range(10)))
    seen = m.lookup("b").total
    assert seen == 8
    prefill(m, "x", [7] * 10, 8)  # the only checkpoint is idle: evicted for x's save
    with pytest.raises(StaleLookupError):
        m.allocate("b", 2, num_cached_tokens=seen)
    assert not m.is_admitted("b")
    m.check_integrity()
    assert m.lookup("b").device == 0


def test_when_every_checkpoint_is_held_a_checkpoint_is_skipped_and_counted() -> None:
    m = manager(checkpoints=1)
    prefill(m, "a", list(range(10)), 8)
    prefill(m, "b", [5] * 10, 8)  # a's save still holds the only checkpoint
    assert m.checkpoints_skipped == 1
    assert m.take_state_plan() == [StateCopy(1, None, 0), StateCopy(1, 0, 2), StateCopy(1, None, 1)]
    m.check_integrity()


def test_freeing_after_a_save_keeps_the_save_before_the_slot_is_reused() -> None:
    m = manager(slots=1)
    prefill(m, "a", list(range(10)), 8)
    m.free("a")
    prefill(m, "b", [3] * 6, 6)  # gets slot 0 again, in the same plan
    assert m.take_state_plan() == [StateCopy(1, None, 0), StateCopy(1, 0, 1), StateCopy(1, None, 0)]


def test_a_window_and_a_recurrent_group_together_take_the_common_hit() -> None:
    m = manager(window=4)
    tokens = list(range(14))
    prefill(m, "a", tokens, 12)
    assert m.group_block_table("a", 1) == [PLACEHOLDER, PLACEHOLDER, 2]  # next token 12 attends 9..12
    m.take_state_plan()
    m.take_state_plan()
    m.add_sequence("b", tokens)
    assert m.lookup("b").device == 12
    table = m.allocate("b", 2, num_cached_tokens=12)
    assert table is not None
    assert m.group_block_table("b", 1)[:3] == [PLACEHOLDER, PLACEHOLDER, 2]
    assert m.take_state_plan() == [StateCopy(2, 2 + 0, 1)]
    m.check_integrity()


def test_reset_is_refused_while_a_plan_has_not_run_then_drops_checkpoints() -> None:
    m = manager()
    prefill(m, "a", list(range(10)), 8)
    m.free("a")
    assert not m.reset_prefix_cache()
    m.take_state_plan()
    assert not m.reset_prefix_cache()  # handed out, not known to have run
    m.take_state_plan()
    assert m.reset_prefix_cache()
    m.add_sequence("b", list(range(10)))
    assert m.lookup("b").device == 0
    m.check_integrity()


def test_no_checkpoint_is_taken_without_prefix_caching() -> None:
    m = HybridKVCacheManager(16, B, enable_prefix_caching=False, recurrent_groups=[RecurrentGroup(2, 4)])
    prefill(m, "a", list(range(10)), 8)
    assert m.take_state_plan() == [StateCopy(1, None, 0)]


def test_recurrent_queries_and_configuration_errors() -> None:
    m = manager(window=4)
    assert m.group_kinds == ("full", "sliding_window", "recurrent")
    assert m.num_state_slots(2) == 2
    m.add_sequence("a", [1, 2, 3])
    with pytest.raises(InvalidArgumentError):
        m.state_slot("a", 2)  # not admitted
    m.allocate("a", 3)
    with pytest.raises(InvalidArgumentError):
        m.group_block_table("a", 2)  # recurrent: no table
    with pytest.raises(InvalidArgumentError):
        m.state_slot("a", 1)  # a window group has no slot
    assert m.next_checkpoint("a") == 4
    assert HybridKVCacheManager(8, B, local_groups=[LocalGroup("sliding_window", 4, 8)]).take_state_plan() == []
    for bad in (0, -1, True, 1.5):
        for field in ("num_slots", "num_checkpoints", "checkpoint_every"):
            values = {"num_slots": 1, "num_checkpoints": 1, "checkpoint_every": 1, field: bad}
            with pytest.raises(ConfigError):
                RecurrentGroup(**values)
    for groups in ({}, {"recurrent_groups": [LocalGroup("sliding_window", 4, 8)]}, {"recurrent_groups": "ab"}):
        with pytest.raises(ConfigError):
            HybridKVCacheManager(8, B, **groups)
    assert RecurrentGroup(3, 5).num_states == 8


def test_state_plan_done_makes_the_checkpoints_findable_at_once() -> None:
    m = manager(slots=3)
    prefill(m, "a", list(range(10)), 8)
    assert m.take_state_plan() == [StateCopy(1, None, 0), StateCopy(1, 0, 3)]
    m.add_sequence("b", list(range(10)))
    assert m.lookup("b").device == 0  # handed out, not said to have run
    m.state_plan_done()
    assert m.lookup("b").device == 8
    assert m.group_pool(1).is_idle(0)
    m.state_plan_done()  # harmless twice, and before the next take
    assert m.take_state_plan() == []
    assert m.lookup("b").device == 8
    m.check_integrity()
