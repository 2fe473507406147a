"""FlatBlockIndex: the content index of a window group, against a model, under random interleavings."""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks.errors import InvalidArgumentError, InvalidBlockHashError, InvalidBlockIdError, SequenceStateError
from kvblocks.events import BlockRemoved, BlockStored, EventSink
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


# ---------------------------------------------------------------------- events

SW = (1, "sliding_window")


def stored(hashes: list[bytes], parent: bytes | None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, "device", None, *SW)


def tagged_index(num_blocks: int) -> tuple[BlockPool, FlatBlockIndex, EventSink]:
    pool, sink = BlockPool(num_blocks), EventSink()
    return pool, FlatBlockIndex(pool, events=sink, group=1, group_kind="sliding_window"), sink


def test_insert_run_emits_each_run_of_newly_indexed_hashes_with_its_chain_parent() -> None:
    pool, index, sink = tagged_index(8)
    hashes = [bytes([k]) * 4 for k in range(1, 7)]  # h1..h6, one chain
    other = pool.take_fresh(1)
    index.insert(hashes[2], other[0], parent_hash=hashes[1])  # another sequence cached position 2 already
    blocks = pool.take_fresh(6)
    index.insert_run(hashes, blocks, 1, 5)
    assert [r.event for r in sink.drain()] == [
        stored([hashes[2]], hashes[1]),
        stored([hashes[1]], hashes[0]),  # position 1's parent: h1, which this group never held
        stored([hashes[3], hashes[4]], hashes[2]),  # the run resumes after the cached position
    ]
    assert index.block_of(hashes[2]) == other[0] and index.block_of(hashes[0]) is None
    index.insert_run(hashes, blocks, 0, 6)
    assert [r.event for r in sink.drain()] == [stored([hashes[0]], None), stored([hashes[5]], hashes[4])]
    index.insert_run(hashes, blocks, 0, 6)  # nothing new: no event
    index.insert(hashes[0], blocks[0])
    assert sink.drain() == []
    index.check_integrity()


def test_evict_and_clear_emit_the_removed_hashes_in_eviction_order() -> None:
    pool, index, sink = tagged_index(4)
    hashes = [b"a", b"b", b"c", b"d"]
    blocks = pool.take_fresh(4)
    index.insert_run(hashes, blocks, 0, 4)
    sink.drain()
    pool.release([blocks[2]])
    pool.release([blocks[0]])
    pool.release([blocks[1]])
    assert index.evict(0) == [] and index.evict(1) == [blocks[2]]
    assert index.clear() == [blocks[0], blocks[1]]  # block 3 is in use: it stays indexed
    assert index.evict(2) == []  # nothing idle: no event
    assert [r.event for r in sink.drain()] == [
        BlockRemoved((b"c",), "device", *SW),
        BlockRemoved((b"a", b"b"), "device", *SW),
    ]
    assert list(index._block_of) == [b"d"]


def test_an_index_tags_its_events_with_its_tier_and_group_and_refuses_bad_tags() -> None:
    pool, sink = BlockPool(2), EventSink()
    index = FlatBlockIndex(pool, events=sink, group=2, group_kind="chunked_local", tier="host")
    assert (index.events, index.group, index.group_kind, index.tier) == (sink, 2, "chunked_local", "host")
    index.insert(b"h", pool.take_fresh(1)[0])
    assert [r.event for r in sink.drain()] == [BlockStored((b"h",), None, "host", None, 2, "chunked_local")]
    for group, kind in [(1, None), (None, "sliding_window"), (-1, "full"), (True, "full"), (1, "window")]:
        with pytest.raises(InvalidArgumentError):
            FlatBlockIndex(pool, events=sink, group=group, group_kind=kind)
    with pytest.raises(InvalidArgumentError):
        FlatBlockIndex(pool, events="sink")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        FlatBlockIndex(pool, tier=None)  # type: ignore[arg-type]
    (b,) = pool.take_fresh(1)
    with pytest.raises(InvalidBlockHashError):
        index.insert(b"g", b, parent_hash=b"")
    with pytest.raises(InvalidBlockHashError):
        index.insert(b"g", b, parent_hash=b"g")
    assert len(index) == 1 and sink.drain() == []


def test_an_index_without_a_sink_emits_nothing_and_has_no_snapshot() -> None:
    pool = BlockPool(2)
    index = FlatBlockIndex(pool)
    assert index.events is None
    with pytest.raises(SequenceStateError):
        index.snapshot_events()


def _replay(events: list) -> dict[bytes, bytes | None]:
    """hash -> chain parent, from BlockStored / BlockRemoved events."""
    view: dict[bytes, bytes | None] = {}
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_hash
            for h in e.block_hashes:
                assert h not in view, f"{h!r} stored twice"
                view[h] = parent
                parent = h
        else:
            for h in e.block_hashes:
                del view[h]
    return view


class EmittingFlatIndexMachine(FlatIndexMachine):
    """The same machine with a sink, plus runs of one chain: the events replayed equal the index (every hash
    with its chain parent), a run's events are exactly its newly indexed positions, and a snapshot rebuilds
    the same view."""

    CHAIN: ClassVar[list[bytes]] = [bytes([k + 1]) for k in range(12)]  # the machine's keys, as one chain

    def __init__(self) -> None:
        super().__init__()
        self.sink = EventSink()
        self.index = FlatBlockIndex(self.pool, events=self.sink, group=1, group_kind="sliding_window")
        self.parents: dict[bytes, bytes | None] = {}
        self.events: list = []

    @rule(data=st.data(), h=st.integers(0, 11))
    def insert(self, data: st.DataObject, h: int) -> None:
        key = self.CHAIN[h]
        new = key not in self.cached
        super().insert(data, h)  # inserts without a parent: the chain's first block as far as it knows
        if new and key in self.cached:
            self.parents[key] = None

    @precondition(lambda self: self.pool.num_fresh > 1)
    @rule(count=st.integers(2, 4))
    def take_many(self, count: int) -> None:
        for b in self.pool.take_fresh(min(count, self.pool.num_fresh)):
            self.refs[b] = 1

    @rule(data=st.data(), start=st.integers(0, 11), length=st.integers(1, 6), around_cached=st.booleans())
    def insert_run(self, data: st.DataObject, start: int, length: int, around_cached: bool) -> None:
        cached = [p for p, h in enumerate(self.CHAIN) if h in self.cached]
        if around_cached and cached:  # a run across a position another sequence cached: split in two
            start = max(0, data.draw(st.sampled_from(cached)) - data.draw(st.integers(1, 2)))
        stop = min(12, start + length)
        new = [p for p in range(start, stop) if self.CHAIN[p] not in self.cached]
        held = sorted(b for b in self.refs if b not in self.cached.values())
        if len(held) < len(new):
            return
        picked = iter(data.draw(st.permutations(held)))
        blocks = [next(picked) if p in new else -1 for p in range(stop)]  # a cached position's block is unused
        event(f"run: {len(new)} new of {stop - start}, gap {bool(new) and new[-1] - new[0] + 1 != len(new)}")
        self.sink.drain()
        self.index.insert_run(self.CHAIN, blocks, start, stop)
        emitted = [r.event for r in self.sink.drain()]
        assert [h for e in emitted for h in e.block_hashes] == [self.CHAIN[p] for p in new]
        for e in emitted:
            first = self.CHAIN.index(e.block_hashes[0])
            assert e.parent_hash == (self.CHAIN[first - 1] if first else None)
            assert list(e.block_hashes) == self.CHAIN[first : first + len(e.block_hashes)]
            assert (e.group, e.group_kind) == SW
        for p in new:
            self.cached[self.CHAIN[p]] = blocks[p]
            self.parents[self.CHAIN[p]] = self.CHAIN[p - 1] if p else None
        self.events.extend(emitted)

    @rule(count=st.integers(0, N))
    def evict(self, count: int) -> None:
        super().evict(count)
        self.parents = {h: p for h, p in self.parents.items() if h in self.cached}

    @invariant()
    def events_replay_to_the_index(self) -> None:
        self.events.extend(r.event for r in self.sink.drain())
        assert _replay(self.events) == self.parents
        snapshot = self.index.snapshot_events()
        assert _replay(snapshot) == self.parents
        assert all((e.group, e.group_kind, e.tier) == (*SW, "device") for e in snapshot)


EmittingFlatIndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestEmittingFlatIndexMachine = EmittingFlatIndexMachine.TestCase
