"""Counts no engine sends (negative, or past any pool) get the same answer from the step in every build.

The compiled build counts in 64-bit integers (kvblocks/core/step.pxd); these cases pin what both builds do
with counts beyond that, so it is never an OverflowError.
"""

from __future__ import annotations

import pytest

from kvblocks import KVCacheManager
from kvblocks.errors import CommitOutOfRangeError


def admitted() -> KVCacheManager:
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence("r", list(range(10)))
    m.allocate("r", 10)
    m.commit("r", 10)
    return m


def state(m: KVCacheManager) -> tuple[object, ...]:
    return (m.block_tables("r"), m.num_computed_tokens("r"), m.num_allocated_tokens("r"), m.num_free_blocks)


@pytest.mark.parametrize("computed", [-1, 2**63, 2**70])
def test_a_commit_out_of_every_range_is_refused(computed: int) -> None:
    m = admitted()
    before = state(m)
    with pytest.raises(CommitOutOfRangeError):
        m.step(["r"], [computed], [None])
    assert state(m) == before


@pytest.mark.parametrize(("new", "lookahead"), [(2**62, 0), (2**70, 0), (1, 2**64), (2**63, 2**63)])
def test_more_slots_than_any_pool_holds_fail_to_grow_and_change_nothing(new: int, lookahead: int) -> None:
    m = admitted()
    before = state(m)
    assert m.step(["r"], [10], [[7]], new, lookahead) == ["r"]
    assert state(m) == before and m.num_tokens("r") == 10  # the sampled token was not kept either
