"""The tiered manager's bookkeeping: a host tier under the device pool, against the device-only manager.

Same request stream (precomputed hashes, prefill then free), same device pool. The tiered
manager also plans write-backs and swap-ins and completes one plan per request, so it
does more work per request -- and serves more tokens from cache. The ratio bounds what the
host tier's bookkeeping costs; the hit rates show what it buys.
"""

from __future__ import annotations

import pytest

from benchmarks.paired import paired_ratio
from kvblocks import KVCacheManager
from kvblocks.tiers import TierConfig, TieredKVCacheManager

from .test_bench_manager import BLOCK_SIZE, HASHED, WORKLOAD

POOL = max(int(WORKLOAD.working_set_blocks * 0.15), WORKLOAD.max_request_blocks + 1)
HOST = WORKLOAD.working_set_blocks // 2


def serve(manager, tiered: bool) -> int:
    """Admit each request's prompt, run its plan (tiered), commit, free. Returns the cached tokens."""
    cached_total = 0
    for request_id, hashes, num_tokens in HASHED:
        manager.add_sequence(request_id, block_hashes=hashes, num_tokens=num_tokens)
        cached = manager.lookup(request_id).total
        if manager.allocate(request_id, num_tokens - cached) is None:
            raise RuntimeError("pool too small")
        if tiered:
            manager.complete_transfers(manager.take_transfers())
        manager.commit(request_id, num_tokens)
        manager.free(request_id)
        cached_total += cached
    return cached_total


SUBJECTS = {
    "device only": (lambda: KVCacheManager(POOL, BLOCK_SIZE), False),
    "host tier": (lambda: TieredKVCacheManager(POOL, BLOCK_SIZE, tiers=TierConfig(num_host_blocks=HOST)), True),
}


@pytest.mark.parametrize("subject", list(SUBJECTS))
def test_tiered_lifecycle(benchmark, subject: str) -> None:
    make, tiered = SUBJECTS[subject]
    benchmark.group = "lifecycle-tiers"
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["requests"] = len(HASHED)
    benchmark.extra_info["blocks"] = sum(len(hashes) for _, hashes, _ in HASHED)
    benchmark.extra_info["pool_blocks"] = POOL
    benchmark.extra_info["working_set_blocks"] = WORKLOAD.working_set_blocks
    cached = benchmark.pedantic(serve, setup=lambda: ((make(), tiered), {}), rounds=5, iterations=1)
    assert cached > 0


LAYER = {
    "device only": (lambda: KVCacheManager(POOL, BLOCK_SIZE), False),
    "tiered, no tiers": (lambda: TieredKVCacheManager(POOL, BLOCK_SIZE, tiers=TierConfig()), True),
}


@pytest.mark.parametrize("subject", list(LAYER))
def test_tier_layer_overhead(benchmark, subject: str) -> None:
    """The tiered manager with nothing below the device: what its hooks and per-step plan cost."""
    make, tiered = LAYER[subject]
    benchmark.group = "tier-layer"
    benchmark.extra_info["subject"] = subject
    cached = benchmark.pedantic(serve, setup=lambda: ((make(), tiered), {}), rounds=5, iterations=1)
    assert cached > 0


def test_the_host_tier_serves_what_the_device_evicted() -> None:
    """The comparison is only meaningful if the host tier adds hits on this stream."""
    device_only = KVCacheManager(POOL, BLOCK_SIZE)
    tiered = TieredKVCacheManager(POOL, BLOCK_SIZE, tiers=TierConfig(num_host_blocks=HOST))
    plain, more = serve(device_only, False), serve(tiered, True)
    assert device_only.stats.evicted_blocks > 0
    assert more > plain and tiered.stats.hit_tokens_host > 0
    tiered.check_integrity()


def test_tier_layer_overhead_paired(benchmark) -> None:
    """The same ratio, paired (see :mod:`benchmarks.paired`): a device-only run, then a tiered one with no tiers."""
    plain, layered = LAYER["device only"][0], LAYER["tiered, no tiers"][0]
    paired_ratio(
        benchmark,
        "tier-layer-paired",
        "tiered, no tiers",
        lambda: serve(plain(), False),
        lambda: serve(layered(), True),
        baseline_name="device only",
        target=0.8,
        rounds=15,
    )
