"""kvblocks' Router side by side with NVIDIA Dynamo's Rust KV-router index (``RadixTree``, ai-dynamo-runtime).

Skipped unless ``ai-dynamo-runtime`` is installed (never a kvblocks dependency; e.g. a throwaway venv with
``ai-dynamo-runtime==1.6.1``, numpy, xxhash, pytest, pytest-benchmark and kvblocks editable). Both indexes
get the same stored-block events of :mod:`benchmarks.router_fleet` (512 workers, 1M (block, worker)
entries): kvblocks ``BlockStored`` objects, Dynamo the same events as its ``KvCacheEvent`` JSON (block hash
and token hash per block, parent hash), encoded before timing. Dynamo's ``find_matches`` walks the prompt's
token hashes, kvblocks' ``route`` its block hashes; on sampled queries both must give the same
worker -> matched blocks, and equal the brute-force count from the fleet's holdings.

Memory: each index is built in a fresh interpreter and measured as its RSS delta; the ratio (Dynamo's bytes
/ kvblocks' bytes, target >= 1.0: kvblocks no bigger) is recorded as this benchmark's ``paired_ratio`` so
the ratio table shows it. Smoke run (benchmarks disabled): 16 workers, ~50k entries, 256-block long prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from benchmarks.paired import paired_ratio
from benchmarks.router_fleet import (
    Fleet,
    FleetSpec,
    Query,
    build_dynamo,
    build_router,
    dynamo_overlaps,
    find_all,
    long_queries,
    make_fleet,
    nonzero,
    probe_in_subprocess,
    route_all,
    typical_queries,
)
from kvblocks.routing import Router

pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime (Dynamo's RadixTree) is not installed")

FULL = FleetSpec(workers=512, blocks=1_000_000)
SMOKE = FleetSpec(workers=16, blocks=20_000, long_blocks=256)


@dataclass
class Pair:
    fleet: Fleet
    router: Router
    tree: object
    typical: list[Query]
    longs: list[Query]


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest) -> Pair:
    disabled = request.config._benchmarksession.disabled  # type: ignore[attr-defined]
    fleet = make_fleet(SMOKE if disabled else FULL)
    router, _ = build_router(fleet)
    tree, _ = build_dynamo(fleet)
    return Pair(fleet, router, tree, typical_queries(fleet, 20 if disabled else 200), long_queries(fleet))


def test_dynamo_same_overlaps(pair: Pair) -> None:
    """Dynamo, kvblocks and the brute-force count agree (worker -> matched blocks) on sampled queries."""
    sample = pair.typical[:50] + pair.longs
    for q in sample:
        expected = pair.fleet.expected_overlaps(q.ids)
        assert nonzero(pair.router.overlaps(q.hashes)) == expected
        assert dynamo_overlaps(pair.tree, q) == expected
    assert any(len(q.hashes) in pair.fleet.expected_overlaps(q.ids).values() for q in pair.longs)


def _side_by_side(benchmark, pair: Pair, group: str, subject: str, queries: list[Query]) -> None:
    benchmark.group = group
    benchmark.extra_info["subject"] = subject
    run = route_all(pair.router, queries) if subject.startswith("kvblocks") else find_all(pair.tree, queries)
    benchmark.extra_info["queries_per_call"] = len(queries)
    benchmark(run)


@pytest.mark.parametrize("subject", ["kvblocks route", "Dynamo find_matches"])
def test_dynamo_route_32k(benchmark, pair: Pair, subject: str) -> None:
    """The fully cached 32k prompts (2,048 blocks, held whole by 4 workers), all of them per call."""
    _side_by_side(benchmark, pair, "dynamo-route-32k", subject, pair.longs)


@pytest.mark.parametrize("subject", ["kvblocks route", "Dynamo find_matches"])
def test_dynamo_route_2k(benchmark, pair: Pair, subject: str) -> None:
    """Typical conversation prompts (~2k tokens, partially cached), 20 per call."""
    _side_by_side(benchmark, pair, "dynamo-route-2k", subject, pair.typical[:20])


def test_dynamo_route_32k_paired(benchmark, pair: Pair) -> None:
    """The 32k ratio, paired round by round (see :mod:`benchmarks.paired`)."""
    paired_ratio(
        benchmark,
        "dynamo-route-32k-paired",
        "kvblocks route",
        find_all(pair.tree, pair.longs),
        route_all(pair.router, pair.longs),
        baseline_name="Dynamo find_matches",
        target=1.0,
        repeat=5,
    )


@pytest.mark.parametrize("subject", ["kvblocks apply_events", "Dynamo apply_event"])
def test_dynamo_apply(benchmark, pair: Pair, subject: str) -> None:
    """The whole fleet's events into an empty index (Dynamo's: apply_event of JSON bytes, then a sync)."""
    benchmark.group = "dynamo-apply"
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["entries"] = pair.fleet.entries
    build = build_router if subject.startswith("kvblocks") else build_dynamo
    seconds = []

    def run() -> None:
        seconds.append(build(pair.fleet)[1])

    benchmark.pedantic(run, rounds=1 if benchmark.disabled else 3, iterations=1)
    benchmark.extra_info["apply_seconds_median"] = sorted(seconds)[len(seconds) // 2]


def test_dynamo_memory(benchmark, pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    """RSS delta of each index built in a fresh interpreter; per (block, worker) entry and per distinct block."""
    benchmark.group = "dynamo-memory"
    spec = pair.fleet.spec

    def both() -> tuple[dict[str, float], dict[str, float]]:
        return probe_in_subprocess(spec, "kvblocks"), probe_in_subprocess(spec, "dynamo")

    mine, theirs = benchmark.pedantic(both, rounds=1, iterations=1)
    assert mine["entries"] == theirs["entries"] == pair.fleet.entries
    benchmark.extra_info.update(subject="kvblocks RSS", baseline="Dynamo RSS", target=1.0)
    benchmark.extra_info["paired_ratio"] = theirs["rss"] / mine["rss"]
    for name, mem in (("kvblocks", mine), ("dynamo", theirs)):
        benchmark.extra_info[f"{name}_rss_bytes"] = mem["rss"]
        benchmark.extra_info[f"{name}_bytes_per_entry"] = mem["rss"] / mem["entries"]
        benchmark.extra_info[f"{name}_bytes_per_distinct"] = mem["rss"] / mem["distinct"]
    with capsys.disabled():
        for name, mem in (("kvblocks Router", mine), ("Dynamo RadixTree", theirs)):
            print(
                f"\n{name}: {spec.workers} workers, {mem['entries']:,.0f} entries, {mem['distinct']:,.0f} distinct: "
                f"RSS {mem['rss'] / 1e6:.1f} MB, {mem['rss'] / mem['entries']:.0f} B/entry, "
                f"{mem['rss'] / mem['distinct']:.0f} B/distinct block"
            )
