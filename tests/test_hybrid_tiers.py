"""TieredHybridKVCacheManager: host tiers under a hybrid manager's local groups.

Exact scenarios (a window group's evicted blocks come back from its host tier; a hit served from host in
one group and device in another; refusals change nothing; a failed copy cuts the hit back), then a
state machine whose shadow caches hold, per group, the hash each device and host block was filled for.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks.accounting import CachedTokens
from kvblocks.errors import ConfigError, InvalidArgumentError, StaleLookupError
from kvblocks.hybrid import LocalGroup, RecurrentGroup
from kvblocks.hybrid.manager import PLACEHOLDER
from kvblocks.hybrid.tiers import TieredHybridKVCacheManager
from kvblocks.tiers import TierConfig

B = 4
A = list(range(17))
OTHER = list(range(100, 117))
P = PLACEHOLDER


def make(
    full: int = 20, local: int = 5, *, host: int = 8, group_host: int = 8, span: int = 6, policy: str = "write-back"
) -> TieredHybridKVCacheManager:
    return TieredHybridKVCacheManager(
        full,
        B,
        tiers=TierConfig(num_host_blocks=host, host_policy=policy, group_host_blocks=(group_host,)),
        local_groups=[LocalGroup("sliding_window", span=span, num_blocks=local)],
    )


def hashes_of(m: TieredHybridKVCacheManager, tokens: list[int]) -> tuple[object, ...]:
    m.add_sequence("_probe", tokens)
    hashes = m.block_hashes("_probe")
    m.free("_probe")
    return hashes


def run(m: TieredHybridKVCacheManager, seq_id: Hashable, tokens: list[int], *, keep: bool = False) -> None:
    """Compute and commit a whole prompt (then free it unless ``keep``); the plan it made is completed."""
    m.add_sequence(seq_id, tokens)
    assert m.allocate(seq_id, len(tokens)) is not None
    m.complete_transfers(m.take_transfers())
    m.commit(seq_id, len(tokens))
    if not keep:
        m.free(seq_id)


def flood(m: TieredHybridKVCacheManager, seq_id: Hashable = "b") -> None:
    """An uncommitted 17-token sequence that takes 5 blocks of each group, then leaves (its blocks go fresh)."""
    m.add_sequence(seq_id, OTHER)
    assert m.allocate(seq_id, 17) is not None
    m.complete_transfers(m.take_transfers())
    m.free(seq_id)


def test_a_window_groups_evicted_blocks_swap_out_and_come_back_on_a_hit_that_needs_them() -> None:
    m = make(full=5, local=5)
    run(m, "a", A)
    local = m.group_pool(1)
    ha = hashes_of(m, A)
    window_blocks = [m._locals[0].index.block_of(h) for h in ha[2:4]]  # the window at 16 needs positions 2, 3
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None
    plan = m.take_transfers()
    host1 = m.group_host(1)
    assert host1 is not None
    # positions 0..2 left the window at a's commit, 3 at its free: every one of them was evicted and written back
    assert len(plan.groups[0].swap_outs) == 4 and len(plan.swap_outs) == 4
    outs = dict(plan.groups[0].swap_outs)
    m.complete_transfers(plan)
    m.free("b")
    host_of = [host1.block_of(h) for h in ha[2:4]]
    assert host_of == [outs[window_blocks[0]], outs[window_blocks[1]]]  # each hash where its block was copied
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(host=16, num_prompt_tokens=17)
    table = m.allocate("c", 1, num_cached_tokens=16)
    assert table is not None and not m.is_ready("c")
    plan = m.take_transfers()
    local_table = m.group_block_table("c", 1)
    assert local_table[:2] == [P, P] and len(local_table) == 5
    assert plan.groups[0].swap_ins == ((host_of[0], local_table[2]), (host_of[1], local_table[3]))
    assert all(host1.pool.ref_count(h) == 1 for h in host_of)  # held by the swap-ins
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.is_ready("c") and m.num_computed_tokens("c") == 16
    assert [m._locals[0].index.block_of(h) for h in ha[2:4]] == local_table[2:4]  # findable once landed
    assert local.ref_count(local_table[2]) == 1 and all(host1.pool.ref_count(h) == 0 for h in host_of)
    m.commit("c", 17)
    m.check_integrity()


def test_a_hit_from_host_in_the_window_group_and_device_in_the_full_group() -> None:
    m = make(full=20, local=5)  # only the local group is short of blocks
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(device=16, num_prompt_tokens=17)  # group 0's split of the common hit
    table = m.allocate("c", 1)
    plan = m.take_transfers()
    assert table is not None and table.num_cached_tokens == 16
    assert plan.swap_ins == () and len(plan.groups[0].swap_ins) == 2
    assert not m.is_ready("c") and m.num_computed_tokens("c") == 16  # group 0's prefix is on device already
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.is_ready("c") and m.stats.hit_tokens_device >= 16
    m.commit("c", 17)
    m.check_integrity()


def test_a_hit_from_host_in_the_full_group_and_device_in_the_window_group() -> None:
    m = make(full=5, local=20)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(host=16, num_prompt_tokens=17)
    assert m.allocate("c", 1) is not None
    plan = m.take_transfers()
    assert len(plan.swap_ins) == 4 and plan.groups[0].swap_ins == ()
    m.complete_transfers(plan)
    assert m.num_computed_tokens("c") == 16
    m.check_integrity()


def snapshot(m: TieredHybridKVCacheManager) -> object:
    groups = []
    for g in range(m.num_groups):
        pool = m.group_pool(g)
        host = m.group_host(g)
        groups.append(
            (
                [pool.ref_count(b) for b in range(pool.num_blocks)],
                pool.num_free,
                [host.pool.ref_count(b) for b in range(host.pool.num_blocks)] if host else None,
                len(host) if host else 0,
            )
        )
    return groups, m.num_pending_admissions


def test_a_refusal_in_any_group_changes_nothing_in_any_group() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("hog", OTHER[:9])
    assert m.allocate("hog", 9) is not None  # holds 3 of the 5 local blocks
    m.complete_transfers(m.take_transfers())
    m.add_sequence("c", A)
    assert m.blocks_short("c", 1) == 1  # two swap-in targets and one new block, two free
    before = snapshot(m)
    assert m.allocate("c", 1) is None
    assert snapshot(m) == before and not m.take_transfers()
    # a named hit a group no longer serves: refused before anything changes
    m.add_sequence("d", A[:13])
    m.group_host(1).clear()  # the window blocks are gone from the local group everywhere
    assert m.lookup("d").total == 0
    before = snapshot(m)
    with pytest.raises(StaleLookupError):
        m.allocate("d", 1, num_cached_tokens=12)
    assert snapshot(m) == before
    m.check_integrity()


def test_a_failed_swap_in_in_the_window_group_cuts_the_hit_back_to_what_every_group_got() -> None:
    m = make(full=20, local=5, span=64)  # the window covers the whole prompt: every position is needed
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(device=16, num_prompt_tokens=17)
    full_table = m.allocate("c", 1)
    assert full_table is not None
    full_table = list(full_table)
    plan = m.take_transfers()
    local_table = m.group_block_table("c", 1)
    ins = {d for _, d in plan.groups[0].swap_ins}
    failed = local_table[2]  # position 2's copy fails: a hit at 8 still has positions 0, 1
    assert failed in ins
    m.complete_transfers(plan, failed_group_swap_ins={1: [failed]})
    assert m.is_ready("c") and m.num_computed_tokens("c") == 8
    assert list(m.block_table("c")) == full_table[:2]
    assert m.group_block_table("c", 1) == local_table[:2]
    assert m.group_pool(1).ref_count(failed) == 0 and m.group_pool(1).ref_count(local_table[3]) == 0
    assert m.stats.hit_tokens_device == 8  # what the admission took, counted once
    m.check_integrity()
    assert m.allocate("c", 9) is not None  # the rest is computed
    m.commit("c", 17)
    m.check_integrity()


def test_a_failed_swap_in_of_a_sliding_window_can_cut_the_hit_to_nothing() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.allocate("c", 1) is not None
    plan = m.take_transfers()
    free0 = m.num_free_blocks
    m.complete_transfers(plan, failed_group_swap_ins={1: [m.group_block_table("c", 1)[3]]})
    assert m.num_computed_tokens("c") == 0 and list(m.block_table("c")) == [] and m.group_block_table("c", 1) == []
    assert m.num_free_blocks == free0 + 5
    m.check_integrity()
    m.add_sequence("d", A)
    assert m.lookup("d").total == 16  # group 0 still holds the run; the local group's position 2 is on host


def test_bad_completions_are_refused_before_anything_changes() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.allocate("c", 1) is not None
    plan = m.take_transfers()
    before = snapshot(m)
    for bad in ({2: [0]}, {1: [99]}, {True: [0]}, [1]):
        with pytest.raises(InvalidArgumentError):
            m.complete_transfers(plan, failed_group_swap_ins=bad)  # type: ignore[arg-type]
    assert snapshot(m) == before
    m.complete_transfers(plan)
    assert m.is_ready("c")


def test_freeing_a_sequence_whose_window_copies_are_in_flight_holds_their_blocks_until_the_plan_completes() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.allocate("c", 1) is not None
    local_table = m.group_block_table("c", 1)
    plan = m.take_transfers()
    m.free("c")
    assert all(m.group_pool(1).ref_count(b) == 1 for b in local_table[2:])
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.group_pool(1).num_free == 5
    m.check_integrity()
    # freed before the plan was taken: its swap-ins leave the plan
    m.add_sequence("d", A)
    assert m.allocate("d", 1) is not None
    m.free("d")
    assert not m.take_transfers().groups[0]
    m.check_integrity()


def test_write_through_copies_a_window_groups_blocks_to_host_on_commit() -> None:
    m = make(full=20, local=5, policy="write-through")
    run(m, "a", A, keep=True)
    plan = m.take_transfers()
    assert len(plan.groups[0].swap_outs) == 4 and len(plan.swap_outs) == 4
    m.complete_transfers(plan)
    host = m.group_host(1)
    assert host is not None and all(host.block_of(h) is not None for h in hashes_of(m, A))


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        TierConfig(group_host_blocks=(4, -1))
    with pytest.raises(ConfigError):
        TierConfig(group_host_blocks="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TieredHybridKVCacheManager(
            8, B, tiers=TierConfig(group_host_blocks=(4, 4)), local_groups=[LocalGroup("sliding_window", 6, 8)]
        )
    with pytest.raises(ConfigError):
        TieredHybridKVCacheManager(
            8,
            B,
            tiers=TierConfig(num_host_blocks=4),
            local_groups=[LocalGroup("sliding_window", 6, 8)],
            recurrent_groups=[RecurrentGroup(num_slots=2, num_checkpoints=2)],
        )
