"""Shared test settings and helpers: a full snapshot of a manager's observable state."""

from __future__ import annotations

from typing import Any

from hypothesis import settings

from kvblocks import KVCacheManager

# No per-example deadline: CI machines are shared and slow at times; a slow example is not a failure.
settings.register_profile("kvblocks", deadline=None, print_blob=True)
settings.load_profile("kvblocks")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` skip, saying so, where no CUDA GPU is visible."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
