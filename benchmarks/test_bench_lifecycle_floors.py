"""The request lifecycle against floors that share no code with today's kvblocks (the compiled-hot-path issue).

* Through ``step``, on the multi-turn chat workload, evicting and not, with 32 and with 1 running sequence:
  kvblocks against :class:`~benchmarks.plain_floor.PlainFloor` (builtin ``hash``, dicts, an ``OrderedDict``
  LRU), the same scheduling loop for both. A slowdown in kvblocks' hashing or token packing shows up here.
* The per-call lifecycle (allocate, commit, append per token) of today's kvblocks against the same calls of
  kvblocks at commit :data:`~benchmarks.release.RELEASE`, loaded beside it in this process.

Each ratio is the subject's speed over its baseline's (above 1: the subject is faster); the targets are the
issue's: today's pure Python does not meet the floor targets yet (see docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from kvblocks import KVCacheManager

from .paired import paired_ratio
from .plain_floor import PlainFloor
from .release import RELEASE, load_commit
from .workloads import ChatWorkload, multi_turn_chat, serve_chat, serve_chat_step

BLOCK_SIZE = 16
WORKLOAD = multi_turn_chat(block_size=BLOCK_SIZE)


def pool_blocks(workload: ChatWorkload, running: int, evicting: bool) -> int:
    """Evicting: half the working set with 32 running (what they hold at once fits), 30% with one; else the
    working set beside room for ``running`` requests at their largest (nothing is ever evicted)."""
    if evicting:
        return int(workload.working_set_blocks * (0.5 if running > 1 else 0.3))
    return workload.working_set_blocks + running * workload.max_request_blocks + 1


CASES = [(running, evicting) for running in (32, 1) for evicting in (True, False)]
IDS = [f"{running}-{'evicting' if evicting else 'no-eviction'}" for running, evicting in CASES]


@pytest.mark.parametrize(("running", "evicting"), CASES, ids=IDS)
def test_step_lifecycle_against_the_plain_floor(benchmark, running: int, evicting: bool) -> None:
    pool = pool_blocks(WORKLOAD, running, evicting)
    ratio = paired_ratio(
        benchmark,
        f"lifecycle-step-plain-floor-{running}-{'evicting' if evicting else 'no-eviction'}",
        "kvblocks step",
        lambda: serve_chat_step(PlainFloor(pool, BLOCK_SIZE), WORKLOAD, running),
        lambda: serve_chat_step(KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running),
        baseline_name="plain floor (builtin hash, dict, OrderedDict LRU)",
        target=1.0 if running > 1 else 1 / 1.5,
        rounds=5,
    )
    assert ratio > 0


@pytest.mark.parametrize(("running", "evicting"), CASES, ids=IDS)
def test_per_call_lifecycle_against_the_release(benchmark, running: int, evicting: bool) -> None:
    old = load_commit(RELEASE)["kvblocks"]
    pool = pool_blocks(WORKLOAD, running, evicting)
    ratio = paired_ratio(
        benchmark,
        f"lifecycle-calls-vs-{RELEASE}-{running}-{'evicting' if evicting else 'no-eviction'}",
        "kvblocks today",
        lambda: serve_chat(old.KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running),
        lambda: serve_chat(KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running),
        baseline_name=f"kvblocks at {RELEASE}",
        target=1.0,
        rounds=5,
    )
    assert ratio > 0


def test_the_floors_do_the_managers_work() -> None:
    """Same workload, same loop: the plain floor and the release find the prompt tokens kvblocks finds, and
    the evicting pools evict."""
    old = load_commit(RELEASE)["kvblocks"]
    for running, evicting in CASES:
        pool = pool_blocks(WORKLOAD, running, evicting)
        ours = KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE)
        found = serve_chat_step(ours, WORKLOAD, running)
        assert found > 0
        assert serve_chat_step(PlainFloor(pool, BLOCK_SIZE), WORKLOAD, running) == found
        by_calls = serve_chat(KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running)
        assert serve_chat(old.KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running) == by_calls
        assert (ours.stats.evicted_blocks > 0) == evicting
        ours.check_integrity()
