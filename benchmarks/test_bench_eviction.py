"""The eviction path with each policy: S3-FIFO against LRU on the same evicting replay, timed back to back."""

from __future__ import annotations

from kvblocks import KVCacheManager, block_hashes

from .paired import paired_ratio
from .workloads import multi_turn_chat, serve_prefill_by_hashes

BLOCK_SIZE = 16
WORKLOAD = multi_turn_chat(block_size=BLOCK_SIZE)
HASHED = [
    (r.request_id, block_hashes(r.prompt + r.output, BLOCK_SIZE), len(r.prompt) + len(r.output))
    for r in WORKLOAD.requests
]
POOL = max(int(WORKLOAD.working_set_blocks * 0.3), WORKLOAD.max_request_blocks + 1)  # as lifecycle-hashes


def _replay(eviction: str) -> KVCacheManager:
    m = KVCacheManager(num_blocks=POOL, block_size=BLOCK_SIZE, eviction=eviction)
    serve_prefill_by_hashes(m, HASHED, BLOCK_SIZE)
    return m


def test_evict_s3fifo_vs_lru_paired(benchmark) -> None:
    """A trace replay (prefill by hashes, then free) in a pool of 30% of the working set: most admissions evict."""
    ratio = paired_ratio(
        benchmark,
        "evict-replay-paired",
        "s3fifo",
        lambda: _replay("lru"),
        lambda: _replay("s3fifo"),
        baseline_name="lru",
        target=None,
        rounds=9,
    )
    assert ratio > 0


def test_both_policies_evict_on_this_workload() -> None:
    for eviction in ("lru", "s3fifo"):
        m = _replay(eviction)
        assert m.stats.evicted_blocks > POOL
        m.check_integrity()
