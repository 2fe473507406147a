"""``PrefixTree.insert`` of one block after a cached parent (a decode's commit) takes a short path unless the tree
keeps token ids: every outcome -- the blocks it returns, the error it raises, the tree it leaves, the event it
records -- must be the general path's, which a tree that keeps token ids always takes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.core.pool import BlockPool
from kvblocks.core.prefix_tree import PrefixTree
from kvblocks.errors import InvalidBlockIdError
from kvblocks.events import BlockStored, EventSink

N = 8
CHAIN = [bytes([i]) * 16 for i in range(6)]


def _tree(events: bool, general: bool = False) -> tuple[PrefixTree, list[int]]:
    """``general``: a tree that keeps token ids, so that every insert takes the general path."""
    pool = BlockPool(N)
    tree = PrefixTree(pool, events=EventSink() if events else None, block_size=4)
    if general:
        tree.keep_token_ids()
    blocks = pool.take_fresh(4)
    tree.insert(CHAIN, blocks, 0, 3)  # blocks 0..2 cached under CHAIN[0..2]; block 3 held, not cached
    return tree, blocks


def _nodes(tree: PrefixTree) -> tuple[object, ...]:
    """What the tree holds: its nodes, each node's parent, the child counts (a block that is no node keeps a stale
    parent entry that nothing reads)."""
    nodes = dict(tree._block_of)
    return nodes, {b: tree._parent_of[b] for b in nodes.values()}, list(tree._hash_of), list(tree._num_children)


def _recorded(tree: PrefixTree) -> list[object]:
    sink = tree.events
    return [] if sink is None else [record.event for record in sink.drain()]


def _state(tree: PrefixTree) -> tuple[object, ...]:
    return (dict(tree._block_of), list(tree._hash_of), list(tree._parent_of), list(tree._num_children))


def _outcome(tree: PrefixTree, hashes: list[object], blocks: list[object], start: int) -> object:
    try:
        return ("ok", tree.insert(hashes, blocks, start, start + 1))  # type: ignore[arg-type]
    except Exception as error:  # the class and the message must match
        return (type(error).__name__, str(error))


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(1, 5),
    block=st.one_of(st.integers(-2, N + 1), st.booleans(), st.just(2.0), st.none()),
    hash_kind=st.sampled_from(["new", "cached", "parent-missing", "unhashable", "str"]),
)
def test_one_block_inserts_end_as_the_general_path_ends(start: int, block: object, hash_kind: str) -> None:
    results = []
    for events, general in ((False, False), (True, False), (False, True), (True, True)):
        tree, held = _tree(events, general)
        _recorded(tree)  # the set-up's event
        hashes: list[object] = list(CHAIN)
        if hash_kind == "cached":
            hashes[start] = CHAIN[1]
        elif hash_kind == "parent-missing":
            hashes[start - 1] = b"\xee" * 16
        elif hash_kind == "unhashable":
            hashes[start] = [1, 2]
        elif hash_kind == "str":
            hashes[start] = "h"
        blocks: list[object] = [*held, 4, 5][: len(hashes)]
        blocks[start] = block
        outcome = _outcome(tree, hashes, blocks, start)
        results.append((outcome, _state(tree)))
        tree.check_integrity()
        if events:
            results.append(_recorded(tree))
    short, short_events, general_path, general_events = results[0], results[1:3], results[3], results[4:]
    assert short == short_events[0] == general_path == general_events[0]
    assert short_events[1] == general_events[1]  # the same event, or none


@pytest.mark.parametrize("stable", [False, True])
def test_a_decode_commit_records_the_event_the_general_path_records(stable: bool) -> None:
    tokens = list(range(100, 120))
    recorded = []
    for general in (False, True):
        tree, held = _tree(True, general)
        _recorded(tree)
        assert tree.insert(CHAIN, held, 3, 4, tokens=tokens, lora_name="a", lora_id=7, stable=stable) == []
        recorded.append(_recorded(tree))
    assert recorded[0] == recorded[1]
    (event,) = recorded[0]
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (CHAIN[3],) and event.parent_hash == CHAIN[2]
    assert event.token_ids is not None and list(event.token_ids) == tokens[12:16]
    assert (event.lora_name, event.lora_id) == ("a", 7)


def test_a_decode_commit_links_the_block_under_its_parent() -> None:
    tree, held = _tree(False)
    assert tree.insert(CHAIN, held, 3, 4) == []
    assert tree.match(CHAIN).block_ids == tuple(held)
    assert tree.insert(CHAIN, [9, 9, 9, 5], 3, 4) == [held[3]]  # cached already: the cached block comes back
    with pytest.raises(Exception, match="not cached"):
        tree.insert([b"\xee" * 16, b"\xef" * 16], [0, 1], 1, 2)


@pytest.mark.parametrize("bad", [True, 2.0, 2**63, 2**70, None, N])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_an_insert_of_several_blocks_refuses_an_id_that_is_not_a_block_and_changes_nothing(
    bad: object, position: int
) -> None:
    pool = BlockPool(N)
    tree = PrefixTree(pool, block_size=4)
    held = pool.take_fresh(3)
    blocks: list[object] = list(held)
    blocks[position] = bad
    before = _nodes(tree)
    with pytest.raises(InvalidBlockIdError, match="is not an int"):
        tree.insert(CHAIN[:3], blocks, 0, 3)  # type: ignore[arg-type]
    assert _nodes(tree) == before
    tree.check_integrity()
    assert tree.insert(CHAIN[:3], held, 0, 3) == []  # the sound insert still goes in whole
