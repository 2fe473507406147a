"""The router at fleet scale: 1,000 workers, 10M indexed (block, worker) entries (:mod:`benchmarks.router_fleet`).

Events applied (vs a plain-dict floor of the same inverted index), routes of typical ~2k-token conversation
prompts (vs hashing a 2k prompt), the fully cached 32k prompt vs its own 2k head (a walk sublinear in the
matched run costs far less than 16x), ``overlaps`` with 992 idle workers beside the 8 holding the prompt vs
without them (idle workers cost nothing), and memory per entry and per
distinct block in a fresh subprocess. With benchmarks disabled (CI's smoke run) the fleet is 16 workers
and ~50k entries, the long prompt 256 blocks.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from benchmarks.paired import paired_ratio
from benchmarks.router_fleet import (
    Fleet,
    FleetSpec,
    Query,
    long_queries,
    make_fleet,
    nonzero,
    prefix_query,
    probe_in_subprocess,
    typical_queries,
)
from kvblocks import BlockHasher, HashedTokens
from kvblocks.events import BlockStored
from kvblocks.routing import Router, RouterConfig

FULL = FleetSpec(workers=1000, blocks=10_000_000)
SMOKE = FleetSpec(workers=16, blocks=20_000, long_blocks=256)
HEAD = 128  # blocks of the 32k prompt's 2k head
PROMPT_2K = [random.Random(5).randrange(50_000) for _ in range(2048)]


@dataclass
class Setup:
    fleet: Fleet
    events: list[list[BlockStored]]
    router: Router
    typical: list[Query]
    longs: list[Query]
    heads: list[Query]


@pytest.fixture(scope="module")
def setup(request: pytest.FixtureRequest) -> Setup:
    disabled = request.config._benchmarksession.disabled  # type: ignore[attr-defined]
    fleet = make_fleet(SMOKE if disabled else FULL)
    events = [fleet.events(w) for w in range(fleet.spec.workers)]
    router = fresh_router(fleet)
    for w, batch in enumerate(events):
        router.apply_events(w, batch)
    longs = long_queries(fleet)
    typical = typical_queries(fleet, 20 if disabled else 500)
    return Setup(fleet, events, router, typical, longs, [prefix_query(fleet, q, HEAD) for q in longs])


def fresh_router(fleet: Fleet) -> Router:
    return Router(range(fleet.spec.workers), RouterConfig(block_size=fleet.spec.block_size))


def cycling(queries: list[Query], call: Callable[[Query], object]) -> Callable[[], None]:
    """One call per benchmark iteration, each on the next query."""
    nxt = itertools.cycle(queries).__next__

    def run() -> None:
        call(nxt())

    return run


def routed(router: Router) -> Callable[[Query], None]:
    def call(q: Query) -> None:
        router.route(block_hashes=q.hashes, num_tokens=q.num_tokens).release()

    return call


def test_fleet_indexed_as_generated(setup: Setup) -> None:
    """The index holds every generated entry, and its overlaps equal the brute-force count from the holdings."""
    fleet, router = setup.fleet, setup.router
    assert sum(router.load(w).cached_blocks for w in router.workers) == fleet.entries
    for q in setup.typical[:10] + setup.longs:
        assert nonzero(router.overlaps(q.hashes)) == fleet.expected_overlaps(q.ids)
    for q in setup.longs:  # an idle fleet sends a fully cached prompt to a worker holding all of it
        lease = router.route(block_hashes=q.hashes, num_tokens=q.num_tokens)
        lease.release()
        assert fleet.expected_overlaps(q.ids)[lease.worker] == len(q.hashes)


@pytest.mark.parametrize("subject", ["kvblocks", "dict floor"])
def test_fleet_apply_events(benchmark, setup: Setup, subject: str) -> None:
    """Every worker's events into an empty index: the Router, or a bare dict of worker bitmasks (the floor)."""
    benchmark.group = "fleet-apply"
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["entries"] = setup.fleet.entries

    def floor() -> dict[int, int]:
        masks: dict[int, int] = {}
        get = masks.get
        for w, batch in enumerate(setup.events):
            bit = 1 << w
            for event in batch:
                for h in event.block_hashes:
                    masks[h] = get(h, 0) | bit
        return masks

    def apply() -> Router:
        router = fresh_router(setup.fleet)
        for w, batch in enumerate(setup.events):
            router.apply_events(w, batch)
        return router

    if subject == "dict floor":
        assert len(benchmark.pedantic(floor, rounds=1, iterations=1)) == setup.fleet.distinct
    else:
        router = benchmark.pedantic(apply, rounds=1, iterations=1)
        assert sum(router.load(w).cached_blocks for w in router.workers) == setup.fleet.entries


@pytest.mark.parametrize("subject", ["route", "hash only"])
def test_fleet_route_2k(benchmark, setup: Setup, subject: str) -> None:
    """Typical conversation prompts (~2k tokens, given as block hashes) vs hashing a 2k-token prompt."""
    benchmark.group = "fleet-route-2k"
    benchmark.extra_info["subject"] = subject
    if subject == "hash only":
        hasher = BlockHasher(setup.fleet.spec.block_size)
        benchmark(HashedTokens, hasher, PROMPT_2K)
        return
    benchmark(cycling(setup.typical, routed(setup.router)))
    assert all(setup.router.load(w).running == 0 for w in setup.router.workers)


@pytest.mark.parametrize("subject", ["route 32k", "route 2k head"])
def test_fleet_route_32k(benchmark, setup: Setup, subject: str) -> None:
    """The fully cached 32k prompt vs its first 128 blocks: a linear walk makes the ratio 1/16."""
    benchmark.group = "fleet-route-32k"
    benchmark.extra_info["subject"] = subject
    benchmark(cycling(setup.longs if subject == "route 32k" else setup.heads, routed(setup.router)))


def test_fleet_walk_32k_paired(benchmark, setup: Setup) -> None:
    """The walk alone (``overlaps``: no hash check, no costs) on the fully cached 32k prompt vs its 2k
    head: galloping and bisection make 16x the matched run cost a few more probes, not 16x."""
    overlaps = setup.router.overlaps
    paired_ratio(
        benchmark,
        "fleet-walk-32k",
        "overlaps 32k",
        lambda: [overlaps(q.hashes) for q in setup.heads],
        lambda: [overlaps(q.hashes) for q in setup.longs],
        baseline_name="overlaps 2k head",
        target=0.5,
        repeat=5,
    )


def test_fleet_route_32k_paired(benchmark, setup: Setup) -> None:
    """The same ratio, paired round by round (see :mod:`benchmarks.paired`)."""
    route = routed(setup.router)
    paired_ratio(
        benchmark,
        "fleet-route-32k-paired",
        "route 32k",
        lambda: [route(q) for q in setup.heads],
        lambda: [route(q) for q in setup.longs],
        baseline_name="route 2k head",
        target=None,  # the hash check in route is linear (in C): the walk's own ratio is fleet-walk-32k
        repeat=5,
    )


def test_overlaps_cost_nothing_per_idle_worker(benchmark) -> None:
    """``overlaps`` of a 2k prompt that 8 workers hold to various depths: beside 992 idle workers vs alone.
    Listing only the workers with a nonzero overlap makes the idle ones free (an overlaps that lists every
    worker pays O(workers) here: the ratio falls towards 8/1000)."""
    hashes = BlockHasher(16).hash_tokens(PROMPT_2K)
    holders = [Router(range(8), RouterConfig(block_size=16)), Router(range(1000), RouterConfig(block_size=16))]
    for router in holders:
        for w in range(8):
            router.apply_events(w, [BlockStored(tuple(hashes[: 16 * (w + 1)]), None, "device")])
    alone, crowded = holders
    assert crowded.overlaps(hashes) == alone.overlaps(hashes) == {w: 16.0 * (w + 1) for w in range(8)}
    paired_ratio(
        benchmark,
        "overlaps-idle",
        "1,000 workers",
        lambda: [alone.overlaps(hashes) for _ in range(20)],
        lambda: [crowded.overlaps(hashes) for _ in range(20)],
        baseline_name="8 workers",
        target=0.8,
        repeat=5,
    )


def test_fleet_memory(benchmark, setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    """The index built in a fresh interpreter: RSS delta and tracemalloc, per entry and per distinct block."""
    benchmark.group = "fleet-memory"
    spec = setup.fleet.spec

    def both() -> dict[str, float]:  # RSS untraced (tracemalloc's own records are resident too), then traced
        traced = probe_in_subprocess(spec, "kvblocks", True)["traced"]
        return {**probe_in_subprocess(spec, "kvblocks"), "traced": traced}

    mem = benchmark.pedantic(both, rounds=1, iterations=1)
    assert mem["entries"] == setup.fleet.entries and mem["distinct"] == setup.fleet.distinct
    for key in ("rss", "traced"):
        benchmark.extra_info[f"{key}_bytes"] = mem[key]
        benchmark.extra_info[f"{key}_per_entry"] = mem[key] / mem["entries"]
        benchmark.extra_info[f"{key}_per_distinct"] = mem[key] / mem["distinct"]
    with capsys.disabled():
        print(
            f"\nrouter memory, {spec.workers} workers, {mem['entries']:,.0f} entries, {mem['distinct']:,.0f} distinct: "
            f"RSS {mem['rss'] / 1e6:.1f} MB ({mem['rss'] / mem['entries']:.0f} B/entry, "
            f"{mem['rss'] / mem['distinct']:.0f} B/distinct), traced {mem['traced'] / 1e6:.1f} MB "
            f"({mem['traced'] / mem['entries']:.0f} B/entry, {mem['traced'] / mem['distinct']:.0f} B/distinct)"
        )
