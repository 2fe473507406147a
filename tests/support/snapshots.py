"""Snapshots of a manager's observable state: what an error path must leave untouched."""

from __future__ import annotations

from typing import Any

from kvblocks import KVCacheManager


def assert_unchanged(m: KVCacheManager, before: dict[str, Any]) -> None:
    """An error path left everything as it was, statistics included, and every invariant holds."""
    assert manager_snapshot(m) == before
    m.check_integrity()


def manager_snapshot(m: KVCacheManager) -> dict[str, Any]:
    """Everything an error path must leave untouched: pool states and orders, tree, sequences, stats."""
    pool, tree = m.pool, m.tree
    seqs = {}
    for seq_id, s in m._seqs.items():
        seqs[seq_id] = (
            s.content.num_tokens,
            tuple(s.content.hashes),
            None if s.table is None else tuple(s.table),
            dict(s.pins or {}),
            s.num_covered,
            s.num_committed,
            s.preempted,
        )
    return {
        "refs": [pool.ref_count(b) for b in range(pool.num_blocks)],
        "fresh": list(pool.fresh_order()),
        "idle": list(pool.idle_lru()),
        "tree": {
            b: (tree.hash_of(b), tree.parent_of(b)) for b in range(pool.num_blocks) if tree.hash_of(b) is not None
        },
        "seqs": seqs,
        "stats": m.stats,
    }


def full_snapshot(m: KVCacheManager) -> dict[str, Any]:
    """Everything observable, lookahead slots and free blocks included."""
    snap = manager_snapshot(m)
    snap["lookahead"] = {i: s.lookahead for i, s in m._seqs.items()}
    snap["allocated"] = {i: m.num_allocated_tokens(i) for i in m._seqs}
    snap["free"] = m.num_free_blocks
    return snap
