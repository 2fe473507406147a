"""The per-group public shapes: one entry per layer group, group 0 included, with the old names as aliases."""

from __future__ import annotations

import pytest

from kvblocks import KVCacheManager
from kvblocks.disagg import PrefillManager
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hybrid import (
    PLACEHOLDER,
    HybridDecodeManager,
    HybridKVCacheManager,
    HybridPrefillManager,
    LocalGroup,
    RecurrentGroup,
    TieredHybridKVCacheManager,
)
from kvblocks.tiers import EntryFormat, MemoryStorage, TierConfig, TieredKVCacheManager
from kvblocks.tiers.transfers import GroupTransfers, TransferPlan

PROMPT = list(range(17))
OTHER = list(range(100, 117))
FULL_FORMAT = EntryFormat("xxh3-128", "uint8", (16,), 1, 16)
WINDOW_FORMAT = EntryFormat("xxh3-128", "uint8", (16,), 2, 16)


def evicting_plan(m: KVCacheManager) -> TransferPlan:
    """Cache PROMPT, then evict it with OTHER: the step's plan moves the evicted blocks down."""
    m.add_sequence("a", PROMPT)
    m.allocate("a", 17)
    m.commit("a", 17)
    m.free("a")
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None
    return m.take_transfers()  # type: ignore[attr-defined, no-any-return]


def test_a_plain_plans_copies_are_one_group_and_the_old_names_read_it() -> None:
    m = TieredKVCacheManager(5, 4, tiers=TierConfig(num_host_blocks=8))
    plan = evicting_plan(m)
    (group,) = plan.group_transfers
    assert group.group == 0 and len(group.swap_outs) == 4
    assert (plan.saves, plan.swap_outs, plan.swap_ins, plan.groups) == (group.saves, group.swap_outs, (), ())
    with pytest.raises(AttributeError):
        plan.swap_outs = ()  # type: ignore[misc]  # a read-only alias
    assert not TransferPlan(7) and TransferPlan(7).swap_outs == ()


def tiered_hybrid() -> TieredHybridKVCacheManager:
    tiers = TierConfig(
        storage=MemoryStorage(),
        entry_format=FULL_FORMAT,
        group_entry_formats=(WINDOW_FORMAT,),
    )
    return TieredHybridKVCacheManager(5, 4, tiers=tiers, local_groups=[LocalGroup("sliding_window", 6, 5)])


def test_per_group_payloads_and_the_previous_keywords_store_the_same() -> None:
    """Two managers, one step: payloads given per group (group 0 included) or in the previous form
    (group 0 bare, the others in ``saved_groups``) reach the same storage entries."""
    results = []
    for form in ("per group", "previous"):
        with tiered_hybrid() as m:
            plan = evicting_plan(m)
            counts = [len(g.saves) for g in plan.group_transfers]
            assert [g.group for g in plan.group_transfers] == [0, 1] and counts == [4, 4]
            payloads = {g.group: [bytes([g.group + 1]) * 16] * len(g.saves) for g in plan.group_transfers}
            if form == "per group":
                m.complete_transfers(plan, saved=payloads)
            else:
                m.complete_transfers(plan, saved=payloads[0], saved_groups={1: payloads[1]})
            assert m.flush(5)
            m.free("b")
            m.add_sequence("c", PROMPT)
            results.append((m.lookup("c"), m.tier_stats.saves_without_payload))
    assert results[0] == results[1]
    assert results[0][0].storage == 16 and results[0][1] == 0


def test_a_group_the_manager_lacks_is_refused_and_the_plan_stays_completable() -> None:
    m = TieredKVCacheManager(5, 4, tiers=TierConfig(num_host_blocks=8))
    plan = evicting_plan(m)
    for bad in ({1: ()}, {"0": ()}, {True: ()}):
        with pytest.raises(InvalidArgumentError, match="not a group of this manager"):
            m.complete_transfers(plan, failed_swap_outs=bad)  # type: ignore[arg-type]
    host = plan.group_transfers[0].swap_outs[0][1]
    m.complete_transfers(plan, failed_swap_outs={0: {host}})  # group 0's failure, per group
    assert m.tier_stats.swap_out_failures == 1 and m.tier_stats.swap_outs == 3
    m.check_integrity()


def test_block_tables_hold_one_table_per_group() -> None:
    plain = KVCacheManager(8, 4)
    plain.add_sequence("a", PROMPT)
    assert plain.block_tables("a") == ([],)
    plain.allocate("a", 17)
    assert plain.block_tables("a") == (list(plain.block_table("a")),) == ([0, 1, 2, 3, 4],)
    assert (plain.num_groups, plain.group_kinds) == (1, ("full",))
    with pytest.raises(ConfigError):
        plain.group_block_table("a", 1)
    m = HybridKVCacheManager(
        16,
        4,
        local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)],
        recurrent_groups=[RecurrentGroup(num_slots=2, num_checkpoints=4, checkpoint_every=2)],
    )
    m.add_sequence("a", PROMPT)
    assert m.block_tables("a") == ([], [], [])
    m.allocate("a", 17)
    m.commit("a", 17)
    tables = m.block_tables("a")
    assert tables[0] == list(m.block_table("a")) and tables[1] == m.group_block_table("a", 1)
    assert tables[1][:3] == [PLACEHOLDER] * 3 and tables[2] == [m.state_slot("a", 2)]


def test_a_handoff_names_each_groups_blocks_group_0_first() -> None:
    p = PrefillManager(8, 4)
    p.add_sequence("a", PROMPT)
    p.allocate("a", 17)
    p.commit("a", 17)
    handoff = p.finish_prefill("a")
    assert handoff.group_blocks == (handoff.source_blocks,)
    hp = HybridPrefillManager(16, 4, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)])
    hp.add_sequence("a", PROMPT)
    hp.allocate("a", 17)
    hp.commit("a", 17)
    handoff = hp.finish_prefill("a")
    assert handoff.group_blocks == (handoff.source_blocks, handoff.groups[0].blocks)
    assert handoff.group_blocks[1] == tuple(hp.group_block_table("a", 1))
    d = HybridDecodeManager(16, 4, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)])
    admission = d.accept_handoff(handoff, PROMPT)
    assert admission is not None
    # the admission's per-group copies pair each group's source blocks with its own decode blocks
    for g, moves in enumerate(admission.group_transfers):
        assert all(src in handoff.group_blocks[g] for src, _ in moves)
        assert [dst for _, dst in moves] == [b for b in d.group_block_table("a", g) if b != PLACEHOLDER][-len(moves) :]


def test_group_transfers_is_false_when_no_group_moves_anything() -> None:
    assert not TransferPlan(1, (GroupTransfers(0), GroupTransfers(1)))
    assert TransferPlan(1, (GroupTransfers(0), GroupTransfers(1, swap_ins=((0, 1),))))
