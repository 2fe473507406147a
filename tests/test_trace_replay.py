"""Replaying real request hashes (Mooncake's conversation trace) through the manager.

The trace gives block hashes, not tokens, which is exactly what ``add_sequence(block_hashes=...)``
is for. With room for everything the manager must find exactly the hits an independent
infinite-cache model finds under the same rules; with a small pool it must stay consistent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvblocks import KVCacheManager

TRACE = Path(__file__).parent / "data" / "mooncake_conversation_head1000.jsonl"
BLOCK = 512  # the trace's block size


def load() -> list[tuple[list[int], int]]:
    """(hashes of the full blocks, prompt length) per request; the trailing partial block has no hash."""
    requests = []
    for line in TRACE.read_text().splitlines():
        record = json.loads(line)
        length = record["input_length"]
        requests.append((record["hash_ids"][: length // BLOCK], length))
    return requests


def replay(m: KVCacheManager, requests: list[tuple[list[int], int]]) -> None:
    for i, (hashes, length) in enumerate(requests):
        m.add_sequence(i, block_hashes=hashes, num_tokens=length)
        cached = m.lookup(i).device
        assert m.allocate(i, length - cached) is not None
        m.commit(i, length)
        m.free(i)


def model_hits(requests: list[tuple[list[int], int]]) -> int:
    """Infinite cache, full blocks only, never the last prompt token: hit tokens at admission."""
    cached: set[int] = set()
    hits = 0
    for hashes, length in requests:
        limit = (length - 1) // BLOCK
        n = 0
        while n < min(limit, len(hashes)) and hashes[n] in cached:
            n += 1
        hits += n * BLOCK
        cached.update(hashes)
    return hits


def test_unlimited_capacity_matches_an_independent_model() -> None:
    requests = load()
    assert len(requests) == 1000
    m = KVCacheManager(num_blocks=sum(len(h) for h, _ in requests) + 1, block_size=BLOCK)
    replay(m, requests)
    expected = model_hits(requests)
    assert expected > 0
    stats = m.stats
    assert stats.hit_tokens == expected
    assert stats.queried_tokens == sum(length for _, length in requests)
    assert stats.evicted_blocks == 0
    m.check_integrity()


@pytest.mark.parametrize("fraction", [0.05, 0.25])
def test_small_pool_evicts_and_stays_consistent(fraction: float) -> None:
    requests = load()
    distinct = len({h for hashes, _ in requests for h in hashes})
    pool = max(int(distinct * fraction), max(len(h) for h, _ in requests) + 1)
    m = KVCacheManager(num_blocks=pool, block_size=BLOCK)
    replay(m, requests)
    stats = m.stats
    assert stats.evicted_blocks > 0
    assert 0 < stats.hit_tokens < model_hits(requests)
    assert stats.blocks_in_use == 0 and stats.blocks_cached + stats.blocks_fresh == pool
    m.check_integrity()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"blocks": 100_000_000_000}, "blocks must be <= 16,777,216"),
        ({"blocks": 10**20}, "blocks must be <= 16,777,216"),
        ({"blocks": 0}, "blocks must be >= 1"),
        ({"host_blocks": 10**11}, "host_blocks must be <= 16,777,216"),
        ({"workers": 10**6}, "workers must be <= 1,024"),
        ({"concurrency": 0}, "concurrency must be >= 1"),
    ],
)
def test_replay_refuses_sizes_beyond_its_bounds_before_allocating(settings: dict[str, int], message: str) -> None:
    import time

    from kvblocks.errors import ConfigError
    from kvblocks.replay import replay
    from kvblocks.traces import synthetic_chat

    started = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        replay(synthetic_chat(conversations=5), **settings)
    assert time.perf_counter() - started < 2  # refused, not attempted (it used to allocate until MemoryError)


def test_an_unlimited_cache_does_not_grow_with_concurrency_beyond_the_trace() -> None:
    from kvblocks.replay import replay
    from kvblocks.traces import synthetic_chat

    trace = synthetic_chat(conversations=5)
    assert replay(trace, concurrency=10**6).capacity_blocks == replay(trace, concurrency=len(trace)).capacity_blocks
