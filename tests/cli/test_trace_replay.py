"""Replaying real request hashes (Mooncake's conversation trace) through the manager.

The trace gives block hashes, not tokens, which is exactly what ``add_sequence(block_hashes=...)``
is for. With room for everything the manager must find exactly the hits an independent
infinite-cache model finds under the same rules; with a small pool it must stay consistent.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import KVCacheManager
from tests.support.mooncake import BLOCK, load


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


# ---------------------------------------------------------------- "unlimited" evicts nothing


def _token_trace(prompts: list[list[int]]) -> Any:
    from kvblocks.traces import Trace, TraceRequest

    return Trace("t", "token_ids", tuple(TraceRequest(len(p), token_ids=tuple(p)) for p in prompts))


def _hash_trace(prompts: list[list[int]], block: int) -> Any:
    from kvblocks.traces import Trace, TraceRequest

    requests = (TraceRequest(len(ids) * block - tail, hash_ids=tuple(ids)) for ids, tail in _tails(prompts, block))
    return Trace("h", "hash_ids", tuple(requests), block)


def _tails(prompts: list[list[int]], block: int) -> list[tuple[list[int], int]]:
    """Each prompt's ids (prefix-chained, so that repeated ids only ever appear as shared prefixes) and a
    partial last block of every length, exactly full included."""
    out = []
    for k, ids in enumerate(prompts):
        chained = [hash((tuple(ids[: i + 1]),)) & 0xFFFF_FFFF for i in range(len(ids))]
        out.append((chained, k % block))
    return out


# prompts over a small alphabet share prefixes; lengths cover exact multiples of the block size
prompts_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    prompts=prompts_strategy,
    block=st.integers(1, 4),
    concurrency=st.integers(1, 8),
    workers=st.integers(1, 4),
    kind=st.sampled_from(["tokens", "hashes", "reference"]),
)
def test_an_unlimited_cache_evicts_nothing_whatever_the_workers_and_concurrency(
    prompts: list[list[int]], block: int, concurrency: int, workers: int, kind: str
) -> None:
    """The capacity replay uses without ``blocks`` (and a sweep's 100%) never evicts; it used to with
    several workers (each got a share of the working set) or with requests running beside the cached ones."""
    from kvblocks.replay import replay, unlimited_blocks

    if kind != "tokens":
        block = max(block, 2)  # a hash-id trace's blocks are Mooncake's 512 tokens, never one
    trace = _token_trace(prompts) if kind == "tokens" else _hash_trace(prompts, block)
    options = {"block_size": block, "concurrency": concurrency, "workers": workers}
    result = replay(trace, reference=kind == "reference", check=True, **options)
    assert result.evicted_blocks == 0
    assert result.capacity_blocks == unlimited_blocks(trace, **options)


def test_the_final_integrity_check_is_optional_and_timed() -> None:
    from kvblocks.replay import replay
    from kvblocks.traces import synthetic_chat

    trace = synthetic_chat(conversations=5)
    plain, checked = replay(trace), replay(trace, check=True)
    assert plain.check_seconds is None and checked.check_seconds is not None and checked.check_seconds >= 0
    assert plain.setup_seconds > 0 and checked.as_dict()["check_seconds"] == checked.check_seconds
    assert plain.hit_tokens == checked.hit_tokens
