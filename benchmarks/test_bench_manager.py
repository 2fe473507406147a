"""The request lifecycle on a multi-turn chat workload: kvblocks against the dict+deque floor."""

from __future__ import annotations

import random

import pytest

from kvblocks import KVCacheManager, block_hashes

from .baselines import FloorManager
from .paired import paired_ratio
from .workloads import multi_turn_chat, pool_size_for, serve_chat, serve_chat_step, serve_prefill_by_hashes

BLOCK_SIZE = 16
CONCURRENCY = 8
WORKLOAD = multi_turn_chat(block_size=BLOCK_SIZE)
POOL = pool_size_for(WORKLOAD, CONCURRENCY)
MANAGERS = {
    "kvblocks": lambda n: KVCacheManager(num_blocks=n, block_size=BLOCK_SIZE),
    "floor": lambda n: FloorManager(n, BLOCK_SIZE),
}
HASHED = [
    (r.request_id, block_hashes(r.prompt + r.output, BLOCK_SIZE), len(r.prompt) + len(r.output))
    for r in WORKLOAD.requests
]


def _record(benchmark, group: str, subject: str) -> None:
    benchmark.group = group
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["requests"] = len(WORKLOAD.requests)
    benchmark.extra_info["pool_blocks"] = POOL
    benchmark.extra_info["working_set_blocks"] = WORKLOAD.working_set_blocks


@pytest.mark.parametrize("subject", list(MANAGERS))
def test_chat_lifecycle(benchmark, subject: str) -> None:
    """add, lookup, allocate, commit the prompt; then append/allocate/commit per decoded token; free."""
    _record(benchmark, "lifecycle-chat", subject)
    benchmark.extra_info["blocks"] = WORKLOAD.total_tokens // BLOCK_SIZE  # block slots the requests' contexts fill
    cached = benchmark.pedantic(
        serve_chat,
        setup=lambda: ((MANAGERS[subject](POOL), WORKLOAD, CONCURRENCY), {}),
        rounds=5,
        iterations=1,
    )
    assert 0 < cached < sum(len(r.prompt) for r in WORKLOAD.requests)  # some hits, not all: eviction happened


@pytest.mark.parametrize("subject", list(MANAGERS))
def test_prefill_by_hashes(benchmark, subject: str) -> None:
    """The same requests as precomputed hashes (a trace replay): pure bookkeeping, no hashing."""
    _record(benchmark, "lifecycle-hashes", subject)
    benchmark.extra_info["blocks"] = sum(len(hashes) for _, hashes, _ in HASHED)
    pool = max(int(WORKLOAD.working_set_blocks * 0.3), WORKLOAD.max_request_blocks + 1)
    benchmark.extra_info["pool_blocks"] = pool
    cached = benchmark.pedantic(
        serve_prefill_by_hashes,
        setup=lambda: ((MANAGERS[subject](pool), HASHED, BLOCK_SIZE), {}),
        rounds=5,
        iterations=1,
    )
    assert cached > 0


def test_kvblocks_evicts_on_this_workload() -> None:
    """The benchmark is only meaningful if the pool is small enough to evict; the same hit counts either way."""
    m = KVCacheManager(num_blocks=POOL, block_size=BLOCK_SIZE)
    serve_chat(m, WORKLOAD, CONCURRENCY)
    assert m.stats.evicted_blocks > 0
    assert WORKLOAD.working_set_blocks > POOL
    m.check_integrity()


# ---------------------------------------------------------------- single hot calls

PROMPT_2K = [random.Random(7).randrange(50_000) for _ in range(2048)]


def _warm(subject: str):
    """A manager whose cache holds PROMPT_2K, plus a registered sequence sharing it."""
    m = MANAGERS[subject](4096)
    m.add_sequence("warm", PROMPT_2K)
    m.allocate("warm", len(PROMPT_2K))
    m.commit("warm", len(PROMPT_2K))
    m.free("warm")
    m.add_sequence("probe", PROMPT_2K + [1])
    return m


@pytest.mark.parametrize("subject", list(MANAGERS))
def test_lookup_2k(benchmark, subject: str) -> None:
    """``lookup`` of a 2k-token prompt whose 128 blocks are all cached."""
    m = _warm(subject)
    benchmark.group = "lookup-2k"
    benchmark.extra_info["subject"] = subject
    assert benchmark(m.lookup, "probe").device == 2048


@pytest.mark.parametrize("subject", list(MANAGERS))
def test_admit_and_free_2k(benchmark, subject: str) -> None:
    """Admission of a 2k-token prompt with 128 cached blocks (touch them, one new block), then free."""
    m = _warm(subject)
    benchmark.group = "admit-free-2k"
    benchmark.extra_info["subject"] = subject

    def cycle() -> int:
        table = m.allocate("probe", 1)
        m.free("probe")
        m.add_sequence("probe", PROMPT_2K + [1])
        return len(table)

    assert benchmark(cycle) == 129


@pytest.mark.parametrize("subject", list(MANAGERS))
def test_decode_step(benchmark, subject: str) -> None:
    """One decode step of a running sequence: append the sampled token, allocate, commit."""
    m = MANAGERS[subject](1 << 16)
    m.add_sequence("d", PROMPT_2K)
    m.allocate("d", len(PROMPT_2K))
    m.commit("d", len(PROMPT_2K))
    state = {"n": len(PROMPT_2K)}
    benchmark.group = "decode-step"
    benchmark.extra_info["subject"] = subject

    def step() -> None:
        m.append_tokens("d", (7,))
        m.allocate("d", 1)
        state["n"] += 1
        m.commit("d", state["n"])

    benchmark.pedantic(step, rounds=20_000, iterations=1, warmup_rounds=100)
    assert state["n"] > len(PROMPT_2K)


# ---------------------------------------------------------------- the batched step (issue 13)

RUNNING = 32


def _running_batch(make):
    """``RUNNING`` sequences with 513-token prompts, admitted and committed: ready to decode."""
    m = make(1 << 15)
    for i in range(RUNNING):
        m.add_sequence(i, [i, *PROMPT_2K[:512]])
        m.allocate(i, 513)
        m.commit(i, 513)
    return m


def _floor_decode_step():
    m = _running_batch(MANAGERS["floor"])
    lengths = [513] * RUNNING

    def step() -> None:  # the floor's three calls per sequence, its hashing included
        for i in range(RUNNING):
            m.append_tokens(i, (7,))
            m.allocate(i, 1)
            lengths[i] += 1
            m.commit(i, lengths[i])

    return step


def _kvblocks_decode_step():
    m = _running_batch(MANAGERS["kvblocks"])
    ids = list(range(RUNNING))
    state = {"computed": [513] * RUNNING}
    sampled = [(7,)] * RUNNING

    def step() -> None:  # one call: commit what the pass wrote, append the sampled token, one slot each
        computed = state["computed"]
        if m.step(ids, computed, sampled):
            raise AssertionError("the pool is large enough for every step")
        state["computed"] = [n + 1 for n in computed]

    return step


def test_decode_step_32_paired(benchmark) -> None:
    """One decode step of 32 running sequences: one batched ``step`` vs the floor's 96 calls."""
    ratio = paired_ratio(
        benchmark,
        "decode-step-32-paired",
        "kvblocks step",
        _floor_decode_step(),
        _kvblocks_decode_step(),
        baseline_name="floor, 3 calls per sequence",
        target=1 / 1.3,
        repeat=50,
    )
    assert ratio > 0


@pytest.mark.parametrize("eviction", [True, False], ids=["evicting", "no-eviction"])
def test_chat_lifecycle_step_paired(benchmark, eviction: bool) -> None:
    """The multi-turn lifecycle (admissions, then one batched step per decode iteration) vs the floor."""
    pool = POOL if eviction else WORKLOAD.working_set_blocks + CONCURRENCY * WORKLOAD.max_request_blocks
    ratio = paired_ratio(
        benchmark,
        f"lifecycle-step-{'evicting' if eviction else 'no-eviction'}-paired",
        "kvblocks step",
        lambda: serve_chat(FloorManager(pool, BLOCK_SIZE), WORKLOAD, CONCURRENCY),
        lambda: serve_chat_step(KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, CONCURRENCY),
        baseline_name="floor",
        target=1 / 1.5,
        rounds=7,
    )
    assert ratio > 0


def test_the_step_lifecycle_does_the_floors_work() -> None:
    """Same workload, same admissions: the step path finds the cached prompt tokens the per-call path finds."""
    for pool in (POOL, WORKLOAD.working_set_blocks + CONCURRENCY * WORKLOAD.max_request_blocks):
        by_step = KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE)
        cached = serve_chat_step(by_step, WORKLOAD, CONCURRENCY)
        by_calls = serve_chat(KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, CONCURRENCY)
        # serve_chat commits each sampled token at once, step one pass later: a block may be found a turn later
        assert by_calls > 0 and abs(cached - by_calls) <= 0.01 * by_calls
        by_step.check_integrity()
        assert (by_step.stats.evicted_blocks > 0) == (pool == POOL)
