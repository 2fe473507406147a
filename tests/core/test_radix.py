"""PrefixTree: matching, insertion and duplicates, leaf-only LRU eviction, events, and a state machine."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, EventSink, PrefixMatch, PrefixTree
from kvblocks.errors import InvalidArgumentError, InvalidBlockHashError, InvalidBlockIdError, SequenceStateError


def chain(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def build(
    num_blocks: int = 8, events: EventSink | None = None, group: int | None = None, group_kind: str | None = None
) -> tuple[BlockPool, PrefixTree]:
    pool = BlockPool(num_blocks)
    return pool, PrefixTree(pool, events=events, group=group, group_kind=group_kind)


def tree_state(pool: BlockPool, tree: PrefixTree) -> tuple:
    return (
        {b: (tree.hash_of(b), tree.parent_of(b), tree.num_children(b)) for b in range(pool.num_blocks)},
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        list(pool.fresh_order()),
        list(pool.idle_lru()),
        len(tree),
    )


def test_match_returns_longest_cached_prefix_immutably() -> None:
    pool, tree = build()
    blocks = pool.take_fresh(3)
    assert tree.insert(chain("a", "b", "c"), blocks) == []
    m = tree.match(chain("a", "b", "x", "c"))
    assert m == PrefixMatch((0, 1), (b"a", b"b")) and m.num_blocks == 2
    with pytest.raises(AttributeError):
        m.block_ids = (9,)  # type: ignore[misc]
    assert tree.match(chain("a", "b", "c"), limit=2).block_ids == (0, 1)
    assert tree.match_length(chain("a", "b", "c"), 5) == 3
    assert tree.match(chain("z")).num_blocks == 0
    assert tree.parent_of(2) == 1 and tree.parent_of(0) is None and tree.num_children(0) == 1


def test_match_is_pure() -> None:
    pool, tree = build()
    blocks = pool.take_fresh(2)
    tree.insert(chain("a", "b"), blocks)
    pool.release(blocks[::-1])
    before = tree_state(pool, tree)
    tree.match(chain("a", "b"))
    tree.match_length(chain("a", "b"))
    assert tree_state(pool, tree) == before


def test_insert_reports_what_was_already_cached() -> None:
    pool, tree = build()
    first = pool.take_fresh(2)
    tree.insert(chain("a", "b"), first)
    second = pool.take_fresh(3)  # another sequence computed a, b again, plus c
    existing = tree.insert(chain("a", "b", "c"), second)
    assert existing == [0, 1]  # the tree keeps the first blocks
    assert tree.block_of(b"c") == 4 and tree.parent_of(4) == 1  # c hangs off the cached b, not the duplicate
    assert tree.hash_of(2) is None and tree.hash_of(3) is None  # duplicates stay private
    assert not pool.is_cached(2)
    tree.check_integrity()


def test_insert_with_start_needs_a_cached_parent() -> None:
    pool, tree = build()
    blocks = pool.take_fresh(3)
    before = tree_state(pool, tree)
    with pytest.raises(InvalidBlockHashError, match="parent"):
        tree.insert(chain("a", "b", "c"), blocks, start=1)
    assert tree_state(pool, tree) == before
    tree.insert(chain("a", "b", "c"), blocks, 0, 1)
    assert tree.insert(chain("a", "b", "c"), blocks, 1) == []
    assert len(tree) == 3


@pytest.mark.parametrize(
    "case",
    ["not-one-chain", "idle-block", "fresh-block", "block-twice", "hash-twice", "already-node", "bad-range", "bad-id"],
)
def test_bad_inserts_raise_and_change_nothing(case: str) -> None:
    pool, tree = build()
    held = pool.take_fresh(3)
    tree.insert(chain("a"), held[:1])
    idle = pool.take_fresh(1)
    tree.insert(chain("q"), idle)
    pool.release(idle)
    before = tree_state(pool, tree)
    args = {
        "not-one-chain": (chain("x", "a"), [held[1], held[2]]),
        "idle-block": (chain("x"), idle),
        "fresh-block": (chain("x"), [7]),
        "block-twice": (chain("x", "y"), [held[1], held[1]]),
        "hash-twice": (chain("x", "x"), [held[1], held[2]]),
        "already-node": (chain("x"), [held[0]]),
        "bad-range": (chain("x"), []),
        "bad-id": (chain("x"), [99]),
    }[case]
    error = (InvalidBlockHashError, InvalidBlockIdError, InvalidArgumentError)
    with pytest.raises(error):
        tree.insert(*args)
    assert tree_state(pool, tree) == before
    tree.check_integrity()


def test_eviction_takes_leaves_least_recently_released_first() -> None:
    pool, tree = build(8)
    s1 = pool.take_fresh(3)
    tree.insert(chain("a", "b", "c"), s1)
    s2 = pool.take_fresh(2)
    tree.insert(chain("x", "y"), s2)
    pool.release(s1[::-1])  # c, b, a become idle in that order
    pool.release(s2[::-1])  # then y, x
    assert list(pool.idle_lru()) == [2, 1, 0, 4, 3]
    assert tree.evict(2) == [2, 1]
    assert tree.match(chain("a", "b", "c")).block_ids == (0,)
    assert list(pool.fresh_order()) == [5, 6, 7, 2, 1]
    assert tree.evict(10) == [0, 4, 3]  # fewer than asked: nothing idle is left
    assert len(tree) == 0 and tree.num_evicted == 5
    tree.check_integrity()
    pool.check_integrity()


def test_eviction_never_takes_an_idle_parent_before_its_children() -> None:
    """Driven directly, a parent can be released before its child; eviction still skips to the oldest leaf."""
    pool, tree = build(6)
    blocks = pool.take_fresh(3)
    tree.insert(chain("a", "b", "c"), blocks)
    pool.release([0])  # head released first: the LRU order is now parent before child
    pool.release([1])
    other = pool.take_fresh(1)
    tree.insert(chain("z"), other)
    pool.release(other)  # z: a leaf, released after a and b
    pool.release([2])
    assert list(pool.idle_lru()) == [0, 1, 3, 2]
    assert tree.evict(1) == [3]  # a and b are not leaves; z is the oldest leaf
    assert tree.evict(3) == [2, 1, 0]  # then c, which frees b, which frees a
    tree.check_integrity()


def test_in_use_blocks_are_never_evicted() -> None:
    pool, tree = build(4)
    blocks = pool.take_fresh(2)
    tree.insert(chain("a", "b"), blocks)
    assert tree.evict(2) == []
    pool.release([blocks[1]])
    assert tree.evict(2) == [1]
    assert tree.block_of(b"a") == 0


def test_events_are_numbered_and_carry_hashes() -> None:
    sink = EventSink()
    pool, tree = build(6, events=sink)
    blocks = pool.take_fresh(3)
    tree.insert(chain("a", "b"), blocks[:2])
    tree.insert(chain("a", "b", "c"), blocks, 2)
    tree.insert(chain("a"), [blocks[0]])  # nothing new: no event
    pool.release(blocks[::-1])
    tree.evict(2)
    tree.clear()
    records = sink.drain()
    assert [r.seq for r in records] == [0, 1, 2, 3]
    assert [r.event for r in records] == [
        BlockStored((b"a", b"b"), None, "device"),
        BlockStored((b"c",), b"b", "device"),
        BlockRemoved((b"c", b"b"), "device"),
        AllBlocksCleared("device"),
    ]
    assert sink.drain() == []


def test_a_tagged_tree_tags_every_event_it_emits_and_its_snapshot() -> None:
    sink = EventSink()
    pool, tree = build(6, events=sink, group=0, group_kind="full")
    assert tree.events is sink and (tree.group, tree.group_kind) == (0, "full")
    blocks = pool.take_fresh(3)
    tree.insert(chain("a", "b", "c"), blocks)
    assert tree.snapshot_events() == [BlockStored((b"a", b"b", b"c"), None, "device", None, 0, "full")]
    pool.release(blocks[::-1])
    tree.evict(1)
    tree.clear()
    assert [r.event for r in sink.drain()] == [
        BlockStored((b"a", b"b", b"c"), None, "device", None, 0, "full"),
        BlockRemoved((b"c",), "device", 0, "full"),
        AllBlocksCleared("device", 0, "full"),
    ]


@pytest.mark.parametrize(
    "group, kind",
    [(0, None), (None, "full"), (-1, "full"), (True, "full"), (1.0, "full"), (1, "window"), (1, 5), (2**63, "full")],
)
def test_a_group_tag_is_both_or_neither_a_valid_index_and_a_known_kind(group, kind) -> None:
    with pytest.raises(InvalidArgumentError):
        PrefixTree(BlockPool(2), group=group, group_kind=kind)


def test_clear_drops_everything_idle_and_refuses_while_in_use() -> None:
    pool, tree = build(4)
    blocks = pool.take_fresh(2)
    tree.insert(chain("a", "b"), blocks)
    with pytest.raises(SequenceStateError, match="in use"):
        tree.clear()
    pool.release(blocks[::-1])
    assert sorted(tree.clear()) == [0, 1]
    assert len(tree) == 0 and pool.num_fresh == 4
    tree.check_integrity()
    pool.check_integrity()


def test_evict_refuses_negative_counts() -> None:
    _, tree = build()
    with pytest.raises(InvalidArgumentError):
        tree.evict(-1)


class TreeMachine(RuleBasedStateMachine):
    """Sequences over a tiny alphabet insert chains, release (tail first or in any order), get evicted.

    A model keeps the set of cached chains; eviction must take the least recently
    released idle leaf, and every cached chain's prefix must stay cached.
    """

    N = 7

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.N)
        self.tree = PrefixTree(self.pool)
        self.held: list[list[int]] = []  # per holder: blocks it holds (taken or hit)
        self.release_clock = 0
        self.released_at: dict[int, int] = {}

    def chain_hashes(self, letters: str) -> list[str]:
        return [letters[: i + 1] for i in range(len(letters))]

    @rule(letters=st.text(alphabet="ab", min_size=1, max_size=4))
    def compute(self, letters: str) -> None:
        hashes = self.chain_hashes(letters)
        hits = self.tree.matched_blocks(hashes)
        need = len(hashes) - len(hits)
        if need > self.pool.num_free - self.pool.count_idle(hits):
            return
        self.pool.acquire(hits)
        short = need - self.pool.num_fresh
        if short > 0:
            expected = self.expected_victims(short)
            assert self.tree.evict(short) == expected
        new = self.pool.take_fresh(need)
        blocks = hits + new
        assert self.tree.insert(hashes, blocks, len(hits)) == []
        self.held.append(blocks)

    def expected_victims(self, count: int) -> list[int]:
        """Simulate: repeatedly the least recently released idle block with no cached children."""
        idle = [b for b in range(self.N) if self.pool.is_idle(b)]
        children = {b: self.tree.num_children(b) for b in range(self.N)}
        victims = []
        for _ in range(count):
            leaves = [b for b in idle if children[b] == 0]
            victim = min(leaves, key=lambda b: self.released_at[b])
            victims.append(victim)
            idle.remove(victim)
            parent = self.tree.parent_of(victim)
            if parent is not None:
                children[parent] -= 1
        return victims

    @precondition(lambda self: self.held)
    @rule(data=st.data(), shuffle=st.booleans())
    def release(self, data, shuffle: bool) -> None:
        index = data.draw(st.integers(0, len(self.held) - 1))
        blocks = self.held.pop(index)
        order = data.draw(st.permutations(blocks)) if shuffle else blocks[::-1]
        self.pool.release(order)
        for b in order:
            if self.pool.is_idle(b):
                self.release_clock += 1
                self.released_at[b] = self.release_clock

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        self.pool.check_integrity()
        for b in range(self.N):
            h = self.tree.hash_of(b)
            if h is not None and len(h) > 1:
                assert self.tree.block_of(h[:-1]) is not None, "a cached suffix outlived its prefix"


TestTreeMachine = TreeMachine.TestCase
