"""The invariant checks of :meth:`kvblocks.manager.KVCacheManager.check_integrity`.

``manager`` is a KVCacheManager, typed Any: core never imports the manager (no import cycle).

The manager's hooks (``_count_other_holders``, ``_count_other_local_holders``, ``_window_tokens``,
``_check_release_order``) are called through the manager, so a subclass's overrides apply.
"""

from __future__ import annotations

from typing import Any

from kvblocks.errors import IntegrityError

__all__ = ["check_manager_integrity", "check_release_order"]


def check_manager_integrity(manager: Any) -> None:
    """:meth:`KVCacheManager.check_integrity`'s body."""
    pool = manager._pool
    tree = manager._tree
    pool.check_integrity()
    tree.check_integrity()
    size = manager._block_size
    expected = [0] * pool.num_blocks
    for seq_id, s in manager._seqs.items():
        table = s.table
        if table is None:
            if s.pins or s.num_covered or s.num_committed or s.lookahead:
                raise IntegrityError(f"sequence {seq_id!r} is not admitted but carries table state")
            continue
        hashes = s.content.hashes
        if len(table) != -(-(s.num_covered + s.lookahead) // size):
            raise IntegrityError(
                f"sequence {seq_id!r}: {len(table)} blocks for {s.num_covered} tokens + {s.lookahead} lookahead"
            )
        if len(set(table)) != len(table):
            raise IntegrityError(f"sequence {seq_id!r} holds a block twice: {table}")
        if not s.num_committed <= min(s.num_covered, s.content.num_tokens):
            raise IntegrityError(f"sequence {seq_id!r} committed {s.num_committed} beyond its tokens or slots")
        registered = s.num_committed // size if manager._caching else 0  # blocks the tree must hold for it
        pins = s.pins or {}
        for position, block in enumerate(table):
            expected[block] += 1
            pinned = pins.get(position)
            if pinned is not None:
                expected[pinned] += 1
            if position < registered:
                node = tree.block_of(hashes[position])
                if node is None or node != (block if pinned is None else pinned):
                    raise IntegrityError(f"sequence {seq_id!r} position {position}: cached node is {node}")
        if any(p >= registered for p in pins):
            raise IntegrityError(f"sequence {seq_id!r} pins a position beyond its registered blocks")
    manager._count_other_holders(expected)
    for block in range(pool.num_blocks):
        if pool.ref_count(block) != expected[block]:
            raise IntegrityError(f"block {block} has ref count {pool.ref_count(block)} but {expected[block]} holders")
    manager._check_release_order()
    groups = manager._coordinator
    if groups is not None:
        live = {
            id(s): (seq_id, len(s.table), manager._window_tokens(s))
            for seq_id, s in manager._seqs.items()
            if s.table is not None
        }
        known = {id(s) for s in manager._seqs.values()}
        groups.check_integrity(live, manager._count_other_local_holders, known)


def check_release_order(manager: Any) -> None:
    """:meth:`KVCacheManager._check_release_order`'s body."""
    pool = manager._pool
    tree = manager._tree
    position = {b: i for i, b in enumerate(pool.idle_order())} if pool.eviction == "lru" else {}
    for b in range(pool.num_blocks):
        parent = tree.parent_of(b) if tree.hash_of(b) is not None else None
        if parent is None:
            continue
        if pool.ref_count(b) and not pool.ref_count(parent):
            raise IntegrityError(f"cached block {b} is in use but its parent {parent} is not")
        if b in position and parent in position and position[parent] < position[b]:
            raise IntegrityError(f"idle block {parent} was released before its idle child {b}")
