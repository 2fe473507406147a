"""BlockPool: exact ids and orders, state transitions, errors that change nothing, and a state machine."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks import BlockPool
from kvblocks.errors import ConfigError, DoubleFreeError, InvalidArgumentError, InvalidBlockIdError


def state(pool: BlockPool) -> tuple:
    return (
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        list(pool.fresh_order()),
        list(pool.idle_lru()),
        [pool.is_cached(b) for b in range(pool.num_blocks)],
    )


def test_fresh_blocks_are_handed_out_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.take_fresh(3) == [0, 1, 2]
    assert pool.take_fresh(2) == [3, 4]
    assert pool.num_fresh == 0 and pool.num_in_use == 5
    assert pool.take_fresh(0) == []


def test_released_uncached_blocks_rejoin_the_back_of_the_fresh_queue_in_release_order() -> None:
    pool = BlockPool(6)
    taken = pool.take_fresh(4)
    pool.release(taken[::-1])  # tail first
    assert list(pool.fresh_order()) == [4, 5, 3, 2, 1, 0]
    assert pool.take_fresh(3) == [4, 5, 3]


def test_cached_blocks_become_idle_in_release_order_and_hits_take_them_out() -> None:
    pool = BlockPool(4)
    a, b, c = pool.take_fresh(3)
    for x in (a, b, c):
        pool.mark_cached(x)
    pool.release([c, b, a])
    assert list(pool.idle_lru()) == [2, 1, 0]
    assert pool.num_free == 4 and pool.num_idle == 3
    pool.acquire([1])  # a cache hit
    assert list(pool.idle_lru()) == [2, 0] and pool.ref_count(1) == 1
    pool.release([1])  # back to the MRU end
    assert list(pool.idle_lru()) == [2, 0, 1]


def test_shared_block_becomes_idle_only_when_the_last_holder_releases() -> None:
    pool = BlockPool(2)
    (b,) = pool.take_fresh(1)
    pool.mark_cached(b)
    pool.acquire([b, b])
    assert pool.ref_count(b) == 3
    pool.release([b])
    pool.release([b])
    assert pool.num_idle == 0
    pool.release([b])
    assert list(pool.idle_lru()) == [b]


def test_evict_moves_idle_to_the_back_of_fresh_and_forgets_cached() -> None:
    pool = BlockPool(3)
    x, y = pool.take_fresh(2)
    pool.mark_cached(x)
    pool.release([x, y])
    assert list(pool.fresh_order()) == [2, 1]
    pool.evict(x)
    assert list(pool.fresh_order()) == [2, 1, 0] and not pool.is_cached(x) and pool.num_idle == 0
    pool.check_integrity()


def test_count_idle() -> None:
    pool = BlockPool(4)
    blocks = pool.take_fresh(3)
    for b in blocks:
        pool.mark_cached(b)
    pool.release([blocks[0], blocks[2]])
    assert pool.count_idle([0, 1, 2]) == 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_bad_size_is_refused(bad) -> None:
    with pytest.raises(ConfigError):
        BlockPool(bad)


def test_double_release_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a, b = pool.take_fresh(2)
    pool.mark_cached(a)
    before = state(pool)
    with pytest.raises(DoubleFreeError, match="block 1"):
        pool.release([a, b, b])  # b's second release has nothing to drop
    assert state(pool) == before
    pool.check_integrity()


@pytest.mark.parametrize("bad", [-1, 4, 1.0, "0", None])
def test_release_of_bad_id_raises_and_changes_nothing(bad) -> None:
    pool = BlockPool(4)
    a, b = pool.take_fresh(2)
    pool.mark_cached(b)
    before = state(pool)
    with pytest.raises(InvalidBlockIdError):
        pool.release([b, a, bad])
    assert state(pool) == before


def test_acquire_of_fresh_or_bad_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a, _ = pool.take_fresh(2)
    pool.mark_cached(a)
    pool.release([a])
    before = state(pool)
    with pytest.raises(InvalidBlockIdError, match="fresh"):
        pool.acquire([a, 3])  # a is idle (fine), 3 is fresh (not acquirable)
    with pytest.raises(InvalidBlockIdError, match="not an int"):
        pool.acquire([a, 17])
    assert state(pool) == before


def test_other_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(InvalidArgumentError):
        pool.take_fresh(3)
    with pytest.raises(InvalidArgumentError):
        pool.take_fresh(-1)
    with pytest.raises(InvalidBlockIdError, match="not in use"):
        pool.mark_cached(0)
    with pytest.raises(InvalidBlockIdError, match="not idle"):
        pool.evict(0)
    with pytest.raises(InvalidBlockIdError):
        pool.ref_count(2)
    pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random takes, hits, releases, evictions against a model of the three states and two orders."""

    N = 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.N)
        self.refs = [0] * self.N
        self.cached = [False] * self.N
        self.fresh = list(range(self.N))
        self.idle: OrderedDict[int, None] = OrderedDict()

    @rule(count=st.integers(0, 3))
    def take(self, count: int) -> None:
        if count > len(self.fresh):
            with pytest.raises(InvalidArgumentError):
                self.pool.take_fresh(count)
            return
        got = self.pool.take_fresh(count)
        assert got == self.fresh[:count]
        del self.fresh[:count]
        for b in got:
            self.refs[b] = 1

    @rule(block=st.integers(0, N - 1))
    def hit(self, block: int) -> None:
        if self.refs[block] == 0 and block not in self.idle:
            with pytest.raises(InvalidBlockIdError):
                self.pool.acquire([block])
            return
        self.pool.acquire([block])
        self.idle.pop(block, None)
        self.refs[block] += 1

    @rule(blocks=st.lists(st.integers(0, N - 1), max_size=4))
    def release(self, blocks: list[int]) -> None:
        refs = list(self.refs)
        ok = True
        for b in blocks:
            if refs[b] == 0:
                ok = False
                break
            refs[b] -= 1
        if not ok:
            with pytest.raises(DoubleFreeError):
                self.pool.release(blocks)
            return
        self.pool.release(blocks)
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.cached[b]:
                    self.idle[b] = None
                else:
                    self.fresh.append(b)

    @rule(block=st.integers(0, N - 1))
    def mark(self, block: int) -> None:
        if self.refs[block] == 0:
            with pytest.raises(InvalidBlockIdError):
                self.pool.mark_cached(block)
            return
        self.pool.mark_cached(block)
        self.cached[block] = True

    @precondition(lambda self: self.idle)
    @rule(data=st.data())
    def evict(self, data) -> None:
        block = data.draw(st.sampled_from(list(self.idle)))
        self.pool.evict(block)
        del self.idle[block]
        self.cached[block] = False
        self.fresh.append(block)

    @invariant()
    def matches_model(self) -> None:
        assert [self.pool.ref_count(b) for b in range(self.N)] == self.refs
        assert list(self.pool.fresh_order()) == self.fresh
        assert list(self.pool.idle_lru()) == list(self.idle)
        assert self.pool.num_free + self.pool.num_in_use == self.N
        self.pool.check_integrity()


TestPoolMachine = PoolMachine.TestCase
