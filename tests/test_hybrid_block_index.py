"""FlatBlockIndex: the content index of a window group, against a model, under random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks.errors import InvalidArgumentError, InvalidBlockHashError, InvalidBlockIdError
from kvblocks.hybrid.block_index import FlatBlockIndex
from kvblocks.pool import BlockPool

N = 8


class FlatIndexMachine(RuleBasedStateMachine):
    """Blocks are taken, indexed (committed), hit, released in any order, evicted: the index and the pool
    always agree with a model in which eviction takes the least recently released idle block."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N)
        self.index = FlatBlockIndex(self.pool)
        self.refs: dict[int, int] = {}  # block -> references held
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.idle: list[int] = []  # least recently released first

    @precondition(lambda self: self.pool.num_fresh > 0)
    @rule()
    def take(self) -> None:
        (b,) = self.pool.take_fresh(1)
        assert b not in self.refs and b not in self.cached.values()
        self.refs[b] = 1

    @rule(data=st.data(), h=st.integers(0, 11))
    def insert(self, data: st.DataObject, h: int) -> None:
        held = sorted(b for b in self.refs if b not in self.cached.values())
        if not held:
            return
        b = data.draw(st.sampled_from(held))
        key = bytes([h + 1])
        got = self.index.insert(key, b)
        expected = self.cached.setdefault(key, b)
        assert got == expected

    @rule(h=st.integers(0, 11))
    def hit(self, h: int) -> None:
        key = bytes([h + 1])
        b = self.index.block_of(key)
        assert b == self.cached.get(key)
        if b is not None:
            self.pool.acquire([b])
            self.refs[b] = self.refs.get(b, 0) + 1
            if b in self.idle:
                self.idle.remove(b)

    @precondition(lambda self: bool(self.refs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.release([b])
        self.refs[b] -= 1
        if not self.refs[b]:
            del self.refs[b]
            if b in self.cached.values():
                self.idle.append(b)

    @rule(count=st.integers(0, N))
    def evict(self, count: int) -> None:
        removed: list = []
        evicted = self.index.evict(count, removed)
        expected, self.idle = self.idle[:count], self.idle[count:]
        assert evicted == expected
        for b, h in zip(evicted, removed, strict=True):
            assert self.cached.pop(h) == b

    @invariant()
    def agrees(self) -> None:
        self.index.check_integrity()
        self.pool.check_integrity()
        assert len(self.index) == len(self.cached)
        assert list(self.pool.idle_lru()) == self.idle
        for h, b in self.cached.items():
            assert self.index.block_of(h) == b and self.index.hash_of(b) == h


FlatIndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestFlatIndexMachine = FlatIndexMachine.TestCase


def test_blocks_leaving_the_window_stay_findable_until_evicted_oldest_first() -> None:
    pool = BlockPool(6)
    index = FlatBlockIndex(pool)
    blocks = pool.take_fresh(6)
    for i, b in enumerate(blocks):
        index.insert(bytes([i + 1]), b)
    pool.release([blocks[0]])  # a running sequence's window moved past block 0, then 1, then 2
    pool.release([blocks[1]])
    pool.release([blocks[2]])
    assert [index.block_of(bytes([i + 1])) for i in range(3)] == [0, 1, 2]  # unlike a tree: no leaf needed
    assert index.evict(2) == [0, 1] and index.block_of(b"\x01") is None and index.block_of(b"\x03") == 2
    assert pool.num_fresh == 2 and index.num_evicted == 2


def test_a_duplicate_keeps_the_first_copy_cached() -> None:
    pool = BlockPool(4)
    index = FlatBlockIndex(pool)
    a, b = pool.take_fresh(2)
    assert index.insert(b"h", a) == a
    assert index.insert(b"h", b) == a  # b stays private to its sequence
    pool.release([b])
    assert pool.num_fresh == 3  # the private copy went back fresh, not idle


@pytest.mark.parametrize("bad", [b"", -1, 1.5, True, None, "h"])
def test_bad_hashes_are_refused_and_change_nothing(bad) -> None:
    pool = BlockPool(2)
    index = FlatBlockIndex(pool)
    (b,) = pool.take_fresh(1)
    with pytest.raises(InvalidBlockHashError):
        index.insert(bad, b)
    assert len(index) == 0 and pool.content_key(b) is None


def test_bad_blocks_and_counts_are_refused() -> None:
    pool = BlockPool(2)
    index = FlatBlockIndex(pool)
    with pytest.raises(InvalidBlockIdError):
        index.insert(b"h", 1)  # not held
    with pytest.raises(InvalidBlockIdError):
        index.insert(b"h", 7)
    (b,) = pool.take_fresh(1)
    index.insert(b"h", b)
    with pytest.raises(InvalidBlockIdError):
        index.insert(b"g", b)  # already caches another hash
    with pytest.raises(InvalidArgumentError):
        index.evict(-1)
    with pytest.raises(InvalidArgumentError):
        FlatBlockIndex("pool")  # type: ignore[arg-type]
    assert len(index) == 1
