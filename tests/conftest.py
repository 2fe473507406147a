"""Shared test settings and helpers: a full snapshot of a manager's observable state."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings

from kvblocks import KVCacheManager

# No per-example deadline: CI machines are shared and slow at times; a slow example is not a failure.
settings.register_profile("kvblocks", deadline=None, print_blob=True)
settings.load_profile("kvblocks")


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis server: $KVBLOCKS_TEST_REDIS_URL, else one started here. Under CI=true it must exist."""
    url = os.environ.get("KVBLOCKS_TEST_REDIS_URL")
    if url:
        yield url
        return
    from .redis_server import RedisServer

    try:
        server = RedisServer().start()
    except (FileNotFoundError, RuntimeError) as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but no Redis server is available: {error}")
        pytest.skip(f"no Redis server ({error}); install redis-server or set KVBLOCKS_TEST_REDIS_URL")
    yield server.url
    server.stop()


@pytest.fixture
def private_redis():
    """A Redis server of the test's own, which it may kill and restart."""
    from .redis_server import RedisServer

    try:
        server = RedisServer().start()
    except (FileNotFoundError, RuntimeError) as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but redis-server cannot be started: {error}")
        pytest.skip(f"no redis-server to start ({error})")
    yield server
    server.stop()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` skip, saying so, where no CUDA GPU is visible."""
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
