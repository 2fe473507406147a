"""``route`` for a 2k-token prompt over 8 and 64 workers, against hashing the prompt alone.

Routing a prompt given as tokens hashes it (the same work as the baseline) and then scores
every worker; the ratio says what scoring adds. Each worker's index holds a different share
of the prompt's prefix, plus unrelated blocks, so the overlap walk does real work.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.paired import paired_ratio
from kvblocks import BlockHasher, HashedTokens, block_hashes
from kvblocks.events import BlockStored
from kvblocks.routing import Router, RouterConfig

BLOCK = 16
PROMPT = [random.Random(5).randrange(50_000) for _ in range(2048)]
HASHES = block_hashes(PROMPT, BLOCK)
HASHER = BlockHasher(BLOCK)


def make_router(workers: int) -> Router:
    rng = random.Random(workers)
    r = Router(range(workers), RouterConfig(block_size=BLOCK))
    for w in range(workers):
        unrelated = tuple(rng.randbytes(16) for _ in range(2000))
        r.apply_events(w, [BlockStored(tuple(HASHES[: rng.randrange(len(HASHES))]), None, "device")])
        r.apply_events(w, [BlockStored(unrelated, None, "device")])
    return r


ROUTERS = {n: make_router(n) for n in (8, 64)}


def hash_only() -> None:
    HashedTokens(HASHER, PROMPT)


@pytest.mark.parametrize("workers", [8, 64])
@pytest.mark.parametrize("subject", ["route", "hash only"])
def test_route_2k(benchmark, workers: int, subject: str) -> None:
    benchmark.group = f"route-2k-{workers}"
    benchmark.extra_info["subject"] = subject
    if subject == "hash only":
        benchmark(hash_only)
        return
    r = ROUTERS[workers]

    def route() -> None:
        r.route(PROMPT).release()

    benchmark(route)
    assert all(r.load(w).running == 0 for w in r.workers)


@pytest.mark.parametrize("workers", [8, 64])
def test_route_2k_paired(benchmark, workers: int) -> None:
    """The same ratio, paired: hashing alone, then a route, in each round (see :mod:`benchmarks.paired`)."""
    r = ROUTERS[workers]
    paired_ratio(
        benchmark,
        f"route-2k-{workers}-paired",
        "route",
        hash_only,
        lambda: r.route(PROMPT).release(),
        baseline_name="hash only",
        target=0.5,
        repeat=20,
    )
    assert all(r.load(w).running == 0 for w in r.workers)
