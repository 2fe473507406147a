"""The compiled hot modules against the same modules from source, in one process (the compiled-hot-path issue).

:func:`tests.support.side_by_side.load_pure` imports a second kvblocks whose hot modules run as Python. Each
ratio is the compiled build's speed over the pure one's (above 1: compiled is faster), both doing the same work:

* one decode ``step`` of 256 running sequences (the issue asks for 3x);
* the multi-turn chat lifecycle through ``step``, 32 and 1 running sequences;
* applying a fleet's ``BlockStored`` events to a router, and routing a 2,048-block prompt;
* and the pure fallback's per-call lifecycle against kvblocks at :data:`~benchmarks.release.RELEASE` (the pure
  Python must not have got slower than that release).

Where nothing is compiled the two sides are the same code (ratios near 1) and the targets are not checked.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import kvblocks
import kvblocks.events
import kvblocks.routing
from kvblocks import native
from tests.support.side_by_side import load_pure

from .paired import paired_ratio
from .release import RELEASE, load_commit
from .test_bench_lifecycle_floors import BLOCK_SIZE, WORKLOAD, pool_blocks
from .workloads import serve_chat, serve_chat_step

PRELOAD = ("kvblocks.routing", "kvblocks.events")
COMPILED = native.status().implementation == "compiled"


def target(value: float) -> float | None:
    """An issue's target, checked only where the compiled build is in use."""
    return value if COMPILED else None


def sides() -> tuple[dict[str, ModuleType], dict[str, ModuleType]]:
    """(pure, compiled): module maps of the two kvblocks."""
    compiled = {"kvblocks": kvblocks, "kvblocks.events": kvblocks.events, "kvblocks.routing": kvblocks.routing}
    return load_pure(PRELOAD), compiled


def against_pure(
    benchmark: Any, group: str, make: Callable[[dict[str, ModuleType]], Callable[[], object]], **kwargs: Any
) -> float:
    """The paired ratio of ``make(compiled)`` against ``make(pure)``: the same work built on each side."""
    pure, compiled = sides()
    return paired_ratio(
        benchmark,
        group,
        "kvblocks compiled",
        make(pure),
        make(compiled),
        baseline_name="kvblocks pure Python (same process)",
        **kwargs,
    )


def decode_step_256(mods: dict[str, ModuleType]) -> Callable[[], None]:
    """One decode step of 256 running sequences (513-token prompts, committed): commit, append, one slot each."""
    running = 256
    m = mods["kvblocks"].KVCacheManager(num_blocks=1 << 15, block_size=16)
    for i in range(running):
        m.add_sequence(i, [i, *range(512)])
        m.allocate(i, 513)
        m.commit(i, 513)
    ids = list(range(running))
    state = {"computed": [513] * running}
    sampled = [(7,)] * running

    def step() -> None:
        computed = state["computed"]
        if m.step(ids, computed, sampled):
            raise AssertionError("the pool is large enough for every step")
        state["computed"] = [n + 1 for n in computed]

    return step


def test_decode_step_256_compiled_against_pure(benchmark) -> None:
    ratio = against_pure(benchmark, "decode-step-256-compiled", decode_step_256, target=target(3.0), repeat=20)
    assert ratio > 0


@pytest.mark.parametrize("running", [32, 1])
def test_step_lifecycle_compiled_against_pure(benchmark, running: int) -> None:
    pool = pool_blocks(WORKLOAD, running, True)

    def lifecycle(mods: dict[str, ModuleType]) -> Callable[[], Any]:
        manager = mods["kvblocks"].KVCacheManager
        return lambda: serve_chat_step(manager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running)

    ratio = against_pure(benchmark, f"lifecycle-step-compiled-{running}-evicting", lifecycle, target=None, rounds=5)
    assert ratio > 0


@pytest.mark.parametrize("running", [32, 1])
def test_pure_fallback_per_call_lifecycle_against_the_release(benchmark, running: int) -> None:
    """The pure Python of today (hot modules from source) against the release's, the per-call lifecycle."""
    old = load_commit(RELEASE)["kvblocks"]
    pure, _ = sides()
    pool = pool_blocks(WORKLOAD, running, True)
    ratio = paired_ratio(
        benchmark,
        f"lifecycle-calls-pure-vs-{RELEASE}-{running}-evicting",
        "kvblocks today, pure Python",
        lambda: serve_chat(old.KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running),
        lambda: serve_chat(pure["kvblocks"].KVCacheManager(num_blocks=pool, block_size=BLOCK_SIZE), WORKLOAD, running),
        baseline_name=f"kvblocks at {RELEASE}",
        target=1.0,
        rounds=5,
    )
    assert ratio > 0


FLEET_WORKERS = 64
FLEET_BLOCKS = 2000


def fleet_events(mods: dict[str, ModuleType]) -> list[list[Any]]:
    """Each worker's one ``BlockStored`` of 2,000 unrelated blocks, in the side's own event class."""
    rng = random.Random(11)
    stored = mods["kvblocks.events"].BlockStored
    return [
        [stored(tuple(rng.getrandbits(63) for _ in range(FLEET_BLOCKS)), None, "device")] for _ in range(FLEET_WORKERS)
    ]


def test_router_apply_events_compiled_against_pure(benchmark) -> None:

    def apply(mods: dict[str, ModuleType]) -> Callable[[], None]:
        routing = mods["kvblocks.routing"]
        events = fleet_events(mods)

        def run() -> None:
            router = routing.Router(range(FLEET_WORKERS), routing.RouterConfig(block_size=16))
            for w, batch in enumerate(events):
                router.apply_events(w, batch)

        return run

    ratio = against_pure(benchmark, "router-apply-events-compiled", apply, target=None, rounds=5)
    assert ratio > 0


def test_route_2k_hit_compiled_against_pure(benchmark) -> None:
    rng = random.Random(5)
    prompt = [rng.getrandbits(63) for _ in range(2048)]

    def route(mods: dict[str, ModuleType]) -> Callable[[], None]:
        routing = mods["kvblocks.routing"]
        router = routing.Router(range(FLEET_WORKERS), routing.RouterConfig(block_size=16))
        for w, batch in enumerate(fleet_events(mods)):
            router.apply_events(w, batch)
        router.apply_events(3, [mods["kvblocks.events"].BlockStored(tuple(prompt[:127]), None, "device")])
        return lambda: router.route(block_hashes=prompt, num_tokens=2048 * 16).release()

    ratio = against_pure(benchmark, "route-2k-hit-127-compiled", route, target=None, repeat=200)
    assert ratio > 0
