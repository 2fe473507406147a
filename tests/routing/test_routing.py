"""Cache-aware routing: scoring by overlap and load, leak-proof leases, worker lifecycle, a cluster simulation."""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvblocks import (
    ConfigError,
    EventSink,
    InvalidArgumentError,
    InvalidBlockHashError,
    KVCacheManager,
    block_hashes,
)
from kvblocks.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvblocks.routing import Lease, NoWorkerError, Router, RouterConfig

B = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def router(workers=("w0", "w1", "w2"), clock=None, **config) -> Router:
    return Router(workers, RouterConfig(block_size=B, **config), clock=clock or Clock())


def pick(r: Router, *args, **kwargs):
    """The worker ``route`` chooses (its lease released at once)."""
    with r.route(*args, **kwargs) as lease:
        return lease.worker


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * B + 1))  # n full blocks and one more token


def hashes(toks: list[int]) -> list:
    return block_hashes(toks, B)


# ---------------------------------------------------------------- scoring


def test_the_worker_holding_the_prompt_wins() -> None:
    r = router()
    prompt = tokens(6)
    r.apply_events("w2", [BlockStored(tuple(hashes(prompt)[:5]), None, "device")])
    assert r.overlaps(hashes(prompt)) == {"w2": 5.0}  # only workers holding part of it
    with r.route(prompt) as lease:
        assert lease.worker == "w2" and lease.overlap_blocks == 5.0
        assert lease.prefill_tokens == len(prompt) - 5 * B
    # another prompt overlaps nowhere: the least loaded, earliest worker
    assert pick(r, tokens(6, start=1000)) == "w0"


def test_overlap_is_a_leading_run() -> None:
    r = router()
    h = hashes(tokens(6))
    r.apply_events("w0", [BlockStored((h[0], h[1], h[3], h[4]), None, "device")])  # h2 missing
    r.apply_events("w1", [BlockStored(tuple(h[:3]), None, "device")])
    assert r.overlaps(h) == {"w0": 2.0, "w1": 3.0}


def expected_cost(
    cfg: RouterConfig, prompt_blocks: int, overlap: float, inflight: int, running: int, evicted: float = 0.0
) -> float:
    new = max(0.0, prompt_blocks - cfg.overlap_credit * overlap)
    load = cfg.prefill_weight * (new + inflight / cfg.block_size) + cfg.decode_weight * running / cfg.block_size
    return load + cfg.eviction_weight * evicted * max(0.0, prompt_blocks - overlap) / prompt_blocks


@pytest.mark.parametrize("seed", range(40))
def test_route_minimises_the_documented_cost(seed: int) -> None:
    import random

    rng = random.Random(seed)
    cfg = dict(
        prefill_weight=rng.choice([0.5, 1.0, 2.0]),
        decode_weight=rng.choice([0.0, 4.0, 12.0]),
        eviction_weight=rng.choice([0.0, 0.2, 1.0]),
        overlap_credit=rng.choice([0.5, 1.0, 2.0]),
    )
    names = [f"w{i}" for i in range(rng.choice([2, 4, 12]))]
    r = router(workers=names, **cfg)
    prompt = tokens(8, start=seed * 100)
    h = hashes(prompt)
    leases = []
    for w in names:
        tier = rng.choice(["device", "device", "host", "storage"])
        r.apply_events(w, [BlockStored(tuple(h[: rng.randrange(9)]), None, tier)])
        evicted = tuple(hashes(tokens(rng.randrange(4), start=90_000 + 100 * rng.randrange(100))))
        r.apply_events(w, [BlockRemoved(evicted, "device")])  # a thrashing cache, or not
    for _ in range(rng.randrange(12)):  # some load, some of it still prefilling
        lease = r.route(tokens(rng.randrange(1, 6), start=5000 + rng.randrange(10**6)))
        if rng.random() < 0.5:
            lease.prefill_done()
        leases.append(lease)
    overlaps = r.overlaps(h)
    costs = {
        w: expected_cost(
            r.config,
            8,
            overlaps.get(w, 0.0),
            r.load(w).inflight_prefill_tokens,
            r.load(w).running,
            r.load(w).evicted_recently,
        )
        for w in r.workers
    }
    best = min(costs.values())
    ties = [w for w in r.workers if costs[w] == best]
    key = {w: (r.load(w).running + r.load(w).inflight_prefill_tokens, i) for i, w in enumerate(r.workers)}
    assert pick(r, prompt) == min(ties, key=key.__getitem__)
    for lease in leases:
        lease.release()


@given(
    holdings=st.lists(st.integers(0, 64), min_size=1, max_size=24),
    loads=st.lists(st.integers(0, 40), min_size=24, max_size=24),
    decode_weight=st.sampled_from([0.0, 16.0, 128.0]),
    eviction_weight=st.sampled_from([0.0, 0.2]),
    tail=st.integers(0, 1),
)
@settings(max_examples=150, deadline=None)
def test_a_long_prompt_goes_where_the_documented_cost_is_lowest(
    holdings: list[int], loads: list[int], decode_weight: float, eviction_weight: float, tail: int
) -> None:
    """A 64-block prompt held to various depths by up to 24 loaded workers: the pruned walk (workers
    holding all of it first, then only runs long enough to win) picks what the brute-force cost picks."""
    names = [f"w{i}" for i in range(len(holdings))]
    r = router(workers=names, decode_weight=decode_weight, eviction_weight=eviction_weight)
    prompt = tokens(64, start=7_000)[: 64 * B - 1 + tail]
    h = hashes(prompt)
    leases = []
    for w, held, load in zip(names, holdings, loads, strict=False):
        r.apply_events(w, [BlockStored(tuple(h[:held]), None, "device")])
        for i in range(load % 5):
            leases.append(r.route(tokens(1, start=90_000 + 1000 * load + 10 * i + names.index(w))))
    cacheable = (len(prompt) - 1) // B
    costs = {
        w: expected_cost(
            r.config,
            cacheable,
            min(held, cacheable),
            r.load(w).inflight_prefill_tokens,
            r.load(w).running,
            r.load(w).evicted_recently,
        )
        for w, held in zip(names, holdings, strict=False)
    }
    best = min(costs.values())
    ties = [w for w in names if costs[w] == best]
    key = {w: (r.load(w).running + r.load(w).inflight_prefill_tokens, i) for i, w in enumerate(names)}
    assert pick(r, prompt) == min(ties, key=key.__getitem__)
    for lease in leases:
        lease.release()


def test_ties_go_to_the_less_loaded_then_the_earlier_worker() -> None:
    r = router(decode_weight=0.0)
    first = r.route(tokens(2, start=100))  # w0 now runs one sequence: same cost (no decode weight), more load
    first.prefill_done()
    assert first.worker == "w0"
    assert pick(r, tokens(2, start=200)) == "w1"


def test_device_hits_outweigh_host_and_storage_hits() -> None:
    r = router()
    h = hashes(tokens(4))
    r.apply_events("w0", [BlockStored(tuple(h), None, "storage")])
    r.apply_events("w1", [BlockStored(tuple(h), None, "host")])
    r.apply_events("w2", [BlockStored(tuple(h[:2]), None, "device"), BlockStored(tuple(h[2:]), None, "host")])
    assert r.overlaps(h) == {"w0": 1.0, "w1": 2.0, "w2": 3.0}
    assert pick(r, tokens(4)) == "w2"


def test_new_prompts_avoid_a_thrashing_cache_and_continuations_stay() -> None:
    r = router(workers=("w0", "w1"), decode_weight=0.0, eviction_weight=0.5)
    held = hashes(tokens(6, start=700))
    r.apply_events("w0", [BlockStored(tuple(held), None, "device")])
    r.apply_events("w0", [BlockRemoved(tuple(hashes(tokens(8, start=900))), "device")])  # w0 evicted 8 blocks
    assert r.load("w0").evicted_recently == 8
    assert pick(r, tokens(6, start=100)) == "w1"  # all new: 0.5 x 8 blocks of pressure on w0
    assert pick(r, tokens(6, start=700)) == "w0"  # its whole prefix is on w0: nothing new to add there
    for _ in range(64):  # a half-life of routes later the pressure counts half
        pick(r, tokens(1, start=5000))
    assert r.load("w0").evicted_recently == 4
    r.check_integrity()


def test_events_remove_and_clear() -> None:
    r = router()
    h = hashes(tokens(4))
    r.apply_events("w1", [BlockStored(tuple(h), None, "device")])
    r.apply_events("w1", [BlockRemoved((h[3],), "device")])
    assert r.overlaps(h)["w1"] == 3.0
    r.apply_events("w1", [AllBlocksCleared("device")])
    assert "w1" not in r.overlaps(h) and r.load("w1").cached_blocks == 0
    r.check_integrity()


def test_a_lying_worker_does_not_change_another_workers_overlap() -> None:
    """Issue 30: a liar stores h2 under h0 first; an honest worker stores h0..h3 and evicts h1. Its leading
    run is 1 block: the liar's link kept on h2's row must not make it 4."""
    r = router(("liar", "good"))
    h = hashes(tokens(4))
    r.apply_events("liar", [BlockStored((h[2],), h[0], "device")])
    r.apply_events("good", [BlockStored(tuple(h), None, "device")])
    r.apply_events("good", [BlockRemoved((h[1],), "device")])
    r.check_integrity()
    assert r.overlaps(h) == {"good": 1.0}
    with r.route(tokens(4)) as lease:
        assert (lease.worker, lease.overlap_blocks) == ("good", 1.0)


CHAINS = [hashes(tokens(6, start=1000 * c)) for c in range(2)]
POOL = [h for chain in CHAINS for h in chain]


def honest_store(chain: int, start: int, end: int) -> tuple[str, BlockStored]:
    """A segment of one chain under its true parent: from the root, or skipping its start (out of order)."""
    blocks = CHAINS[chain][start : max(start, end) + 1]
    return "honest", BlockStored(tuple(blocks), CHAINS[chain][start - 1] if start else None, "device")


def honest_eviction(chain: int, block: int) -> tuple[str, BlockRemoved]:
    """One block of a chain (a hole, where the worker holds blocks below it)."""
    return "honest", BlockRemoved((CHAINS[chain][block],), "device")


def skipping_lie(chain: int, block: int, skip: int) -> tuple[str, BlockStored]:
    """A chain's block stored under an ancestor further up than its parent (h2 under h0), or as a root."""
    up = block - 1 - skip
    return "liar", BlockStored((CHAINS[chain][block],), CHAINS[chain][up] if up >= 0 else None, "device")


def any_lie(blocks: list, parent: object) -> tuple[str, BlockStored]:
    return "liar", BlockStored(tuple(blocks), parent, "device")


chains, blocks = st.integers(0, len(CHAINS) - 1), st.integers(0, 5)
honest_stores = st.builds(honest_store, chains, st.just(0) | blocks, st.just(5) | blocks)
honest_evictions = st.builds(honest_eviction, chains, blocks)
lies = st.one_of(
    st.builds(skipping_lie, chains, st.integers(1, 5), st.integers(1, 3)),
    st.builds(any_lie, st.lists(st.sampled_from(POOL), min_size=1, max_size=4), st.none() | st.sampled_from(POOL)),
    st.lists(st.sampled_from(POOL), max_size=3).map(lambda gone: ("liar", BlockRemoved(tuple(gone), "device"))),
)


@given(
    st.lists(lies, min_size=1, max_size=4),
    st.lists(honest_stores, min_size=1, max_size=3),
    st.lists(honest_evictions, min_size=1, max_size=3),
    st.lists(st.one_of(honest_stores, honest_evictions, lies), max_size=20),
)
@settings(max_examples=200, deadline=None)
def test_a_liars_events_never_change_an_honest_workers_overlap(
    first: list, stores: list, evictions: list, mixed: list
) -> None:
    """Whatever a liar sends (blocks under false parents, in any order, removals), the honest worker's
    overlap of every prompt equals its overlap in a router that never heard from the liar. The liar may
    speak first (its links are then the rows' own), before the honest worker stores and evicts."""
    with_liar, without = router(("honest", "liar")), router(("honest", "liar"))
    for worker, event in first + stores + evictions + mixed:
        with_liar.apply_events(worker, [event])
        if worker == "honest":
            without.apply_events(worker, [event])
    with_liar.check_integrity()
    for chain in CHAINS:
        for n in range(1, len(chain) + 1):
            assert with_liar.overlaps(chain[:n]).get("honest") == without.overlaps(chain[:n]).get("honest")


def test_only_the_full_groups_events_feed_the_prefix_index() -> None:
    """A hybrid worker's sliding-window group drops hashes its full group still holds: the prefix stays."""
    r = router()
    h = hashes(tokens(4))
    r.apply_events("w1", [BlockStored(tuple(h), None, "device", None, 0, "full")])
    r.apply_events("w1", [BlockStored(tuple(h), None, "device", None, 1, "sliding_window")])
    r.apply_events("w1", [BlockRemoved(tuple(h[:3]), "device", 1, "sliding_window")])  # left the window
    r.apply_events("w1", [AllBlocksCleared("device", 2, "chunked_local")])
    r.apply_events("w2", [BlockStored(tuple(h), None, "device", None, 1, "sliding_window")])  # no full copy
    assert r.overlaps(h) == {"w1": 4.0}
    assert r.load("w1").cached_blocks == 4 and r.load("w1").evicted_recently == 0
    r.apply_events("w1", [BlockRemoved((h[3],), "device", 0, "full")])  # the full group's own removal counts
    assert r.overlaps(h)["w1"] == 3.0 and r.load("w1").evicted_recently == 1
    r.check_integrity()


def test_a_hybrid_workers_events_through_the_wire_keep_the_router_equal_to_its_full_tree() -> None:
    """A full-attention tree and a sliding-window index share a sink, as in a hybrid manager; their tagged
    events go through a publisher, bytes, a consumer and a snapshot into the router."""
    from kvblocks import BlockPool, PrefixTree
    from kvblocks.events import EventConsumer, EventPublisher
    from kvblocks.events.transport import InProcessTransport, pump
    from kvblocks.hybrid.block_index import FlatBlockIndex

    sink = EventSink()
    full_pool, window_pool = BlockPool(8), BlockPool(8)
    tree = PrefixTree(full_pool, events=sink, group=0, group_kind="full")
    window = FlatBlockIndex(window_pool, events=sink, group=1, group_kind="sliding_window")
    transport = InProcessTransport()
    publisher = EventPublisher(
        "w1", sink, transport, snapshot=lambda: [*tree.snapshot_events(), *window.snapshot_events()]
    )
    r = router()
    consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)

    h = hashes(tokens(6))
    full_blocks, window_blocks = full_pool.take_fresh(6), window_pool.take_fresh(6)
    tree.insert(h, full_blocks)
    window.insert_run(h, window_blocks, 0, 6)
    window_pool.release(window_blocks[:4])  # blocks 0-3 left the window; the full group keeps them
    assert window.evict(3) == window_blocks[:3]
    publisher.publish()
    pump(transport, consumer)
    assert r.overlaps(h)["w1"] == tree.match_length(h) == 6
    publisher.publish_snapshot()
    pump(transport, consumer)
    assert consumer.batches == 2 and not consumer.needs_resync
    assert r.overlaps(h)["w1"] == 6 and r.load("w1").cached_blocks == 6
    full_pool.release(full_blocks[::-1])
    tree.evict(2)
    publisher.publish()
    pump(transport, consumer)
    assert r.overlaps(h)["w1"] == tree.match_length(h) == 4
    r.check_integrity()


def test_routing_by_hashes_matches_routing_by_tokens() -> None:
    r = router()
    prompt = tokens(5)
    r.apply_events("w1", [BlockStored(tuple(hashes(prompt)), None, "device")])
    by_hashes = r.route(block_hashes=hashes(prompt), num_tokens=len(prompt))
    assert by_hashes.worker == "w1" and by_hashes.prefill_tokens == 1
    with pytest.raises(InvalidArgumentError):
        r.route(block_hashes=hashes(prompt))  # no length
    with pytest.raises(InvalidArgumentError):
        r.route(block_hashes=hashes(prompt), num_tokens=4)  # more blocks than tokens
    with pytest.raises(InvalidArgumentError):
        r.route()


@pytest.mark.parametrize(
    "bad",
    [[-1], [1.5], [[1, 2]], [True], [b""], [{"h": 1}], [None], [5, -1], [5, 1 << 70, b""], [b"x", 2.0]],
    ids=[
        "negative",
        "float",
        "unhashable",
        "bool",
        "empty-bytes",
        "dict",
        "none",
        "late-negative",
        "mixed",
        "bytes-float",
    ],
)
def test_route_refuses_the_block_hashes_a_manager_refuses(bad: list) -> None:
    """Where the route reads them: the whole prompt when the workers hold all of its valid part (the walk
    reads up to the bad hash), and always in approximate mode (which remembers every hash)."""
    m = KVCacheManager(num_blocks=8, block_size=B)
    with pytest.raises(InvalidBlockHashError):
        m.add_sequence("s", block_hashes=bad, num_tokens=len(bad) * B + 1)
    exact, approximate = router(), router(mode="approximate")
    first_bad = next(i for i, h in enumerate(bad) if not ((type(h) is int and h >= 0) or (type(h) is bytes and h)))
    if first_bad:  # the prefix before it is held, so the walk goes on to read it
        exact.apply_events("w1", [BlockStored(tuple(bad[:first_bad]), None, "device")])
    for r in (exact, approximate):
        with pytest.raises(InvalidBlockHashError):
            r.route(block_hashes=bad, num_tokens=len(bad) * B + 1)
        assert r.routed == 0
        assert all(r.load(w).running == 0 and r.load(w).inflight_prefill_tokens == 0 for w in r.workers)


def test_a_route_reads_the_hashes_of_its_matched_run_only() -> None:
    """A miss reads the first hash; a hit reads its run and the hash after it. What lies past them is not read
    (and not refused): a route costs its matched prefix, not the prompt's length."""
    r = router()
    h = hashes(tokens(4))
    assert pick(r, block_hashes=[h[0], -1], num_tokens=2 * B + 1) in r.workers  # nobody holds h0: -1 is not read
    with pytest.raises(InvalidBlockHashError, match="position 0"):
        r.route(block_hashes=[-1, h[0]], num_tokens=2 * B + 1)
    r.apply_events("w1", [BlockStored(tuple(h[:2]), None, "device")])
    with pytest.raises(InvalidBlockHashError, match="position 2 is negative"):
        r.route(block_hashes=[h[0], h[1], -1], num_tokens=3 * B + 1)
    assert r.routed == 1


def test_a_repeated_hash_ends_the_prompts_chain_where_it_repeats() -> None:
    """A chain never repeats a hash, so the router takes a prompt that does as it is (it builds no tree
    from it): here the overlap is the leading run the worker holds, as a brute-force count has it (a repeat
    whose next hash is stated under it can be counted further: docs/routing.md)."""
    r = router()
    h = hashes(tokens(4))
    r.apply_events("w1", [BlockStored(tuple(h[:3]), None, "device")])
    assert r.overlaps([h[0], h[1], h[0], h[2]]) == {"w1": 4.0}  # h0 again: held, so the run goes on
    assert r.overlaps([h[0], h[3], h[0]]) == {"w1": 1.0}
    assert pick(r, block_hashes=[h[0], h[1], h[0], h[1]], num_tokens=4 * B + 1) == "w1"


@given(st.integers(1, 6), st.booleans())
@settings(max_examples=60, deadline=None)
def test_a_cached_prompt_still_computes_its_last_token(n_blocks: int, aligned: bool) -> None:
    """The router charges what the worker will compute: ``lookup``'s count, never the last token."""
    prompt = list(range(n_blocks * B + (0 if aligned else 1)))
    h = hashes(prompt)
    m = KVCacheManager(num_blocks=32, block_size=B)
    m.add_sequence("warm", prompt)
    m.allocate("warm", len(prompt))
    m.commit("warm", len(prompt))
    m.free("warm")
    m.add_sequence("again", prompt)
    computed = len(prompt) - m.lookup("again").device
    for by_hashes in (False, True):
        r = router(workers=("w1",))
        r.apply_events("w1", [BlockStored(tuple(h), None, "device")])
        lease = r.route(block_hashes=h, num_tokens=len(prompt)) if by_hashes else r.route(prompt)
        assert lease.prefill_tokens == computed >= 1
        assert r.load("w1").inflight_prefill_tokens == computed
        lease.release()


def test_a_warm_temperature_samples_but_prefers_the_cheap_worker() -> None:
    r = router(temperature=0.5, seed=7)
    prompt = tokens(8)
    r.apply_events("w1", [BlockStored(tuple(hashes(prompt)), None, "device")])
    picks = []
    for _ in range(200):
        with r.route(prompt) as lease:
            picks.append(lease.worker)
    assert picks.count("w1") > 150 and len(set(picks)) >= 1
    again = router(temperature=0.5, seed=7)
    again.apply_events("w1", [BlockStored(tuple(hashes(prompt)), None, "device")])
    replay = []
    for _ in range(200):
        with again.route(prompt) as lease:
            replay.append(lease.worker)
    assert replay == picks  # the router's own seeded generator: reproducible


# ---------------------------------------------------------------- leases


def test_a_lease_releases_every_counter_exactly_once() -> None:
    r = router()
    lease = r.route(tokens(3))
    load = r.load(lease.worker)
    assert (load.running, load.inflight_prefill_tokens) == (1, 13)
    lease.prefill_done()
    lease.prefill_done()
    assert (r.load(lease.worker).running, r.load(lease.worker).inflight_prefill_tokens) == (1, 0)
    lease.release()
    lease.release()
    assert (r.load(lease.worker).running, r.load(lease.worker).inflight_prefill_tokens) == (0, 0)
    assert lease.closed


def test_leaving_the_block_by_an_exception_releases() -> None:
    r = router()
    with pytest.raises(RuntimeError), r.route(tokens(3)) as lease:
        raise RuntimeError("the engine failed")
    assert lease.closed and r.load(lease.worker).running == 0 and r.load(lease.worker).inflight_prefill_tokens == 0


def test_a_cancelled_task_releases_its_lease() -> None:
    r = router()
    started = asyncio.Event()

    async def request() -> None:
        async with r.route(tokens(3)):
            started.set()
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(request())
        await started.wait()
        assert r.load("w0").running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert r.load("w0").running == 0 and r.load("w0").inflight_prefill_tokens == 0


def test_a_forgotten_lease_is_released_with_a_warning() -> None:
    r = router()
    with pytest.warns(ResourceWarning, match="garbage collected unreleased"):
        r.route(tokens(3))  # dropped on the floor
        gc.collect()
    assert r.load("w0").running == 0 and r.leaked_leases == 1


def test_workers_drain_and_are_removed() -> None:
    r = router()
    h = hashes(tokens(4))
    r.apply_events("w0", [BlockStored(tuple(h), None, "device")])
    r.drain_worker("w0")
    assert pick(r, tokens(4)) != "w0"
    r.undrain_worker("w0")
    lease = r.route(tokens(4))
    assert lease.worker == "w0"
    r.remove_worker("w0")
    assert "w0" not in r.workers and "w0" not in r.overlaps(h)
    lease.release()  # into the removed worker's counters: no error, nothing negative
    r.check_integrity()
    r.add_worker("w3")  # reuses the freed slot with an empty index
    assert "w3" not in r.overlaps(h) and "w3" in r.workers
    with pytest.raises(InvalidArgumentError):
        r.add_worker("w3")
    with pytest.raises(InvalidArgumentError):
        r.drain_worker("nobody")
    for w in list(r.workers):
        r.drain_worker(w)
    with pytest.raises(NoWorkerError):
        r.route(tokens(2))


def test_approximate_mode_remembers_routes_until_they_expire() -> None:
    clock = Clock()
    r = router(clock=clock, mode="approximate", approx_ttl_s=10.0)
    prompt = tokens(6)
    first = r.route(prompt)
    first.release()
    clock.now = 5.0
    assert pick(r, prompt) == first.worker  # its blocks are believed cached there
    clock.now = 16.0
    r.route(tokens(1, start=999)).release()  # any route expires old entries
    assert r.overlaps(hashes(prompt)) == {}
    r.check_integrity()


def test_a_silent_event_stream_is_reported_not_ignored() -> None:
    clock = Clock()
    r = router(clock=clock, silent_after_s=30.0)
    r.apply_events("w1", [BlockStored((b"x" * 16,), None, "device")])
    assert r.silent_workers() == []
    lease = r.route(tokens(2))
    clock.now = 20.0
    assert r.silent_workers() == []
    clock.now = 31.0
    assert r.silent_workers() == [lease.worker] and r.silent_reports == 1
    assert r.silent_workers() == [lease.worker] and r.silent_reports == 1  # reported once
    r.apply_events(lease.worker, [])
    assert r.silent_workers() == [] and not r.load(lease.worker).silent


def test_bad_configuration() -> None:
    for bad in (
        {"block_size": 0},
        {"block_size": 4, "mode": "psychic"},
        {"block_size": 4, "temperature": -1},
        {"block_size": 4, "approx_ttl_s": 0},
        {"block_size": 4, "tier_weights": (("gpu", 1.0),)},
        {"block_size": 4, "tier_weights": 5},
        {"block_size": 4, "tier_weights": (("device", True),)},
        {"block_size": 4, "tier_weights": (("device", float("inf")),)},
        {"block_size": 4, "hash_scheme": "md5"},
        {"block_size": 4, "seed": 1.5},
        {"block_size": 4, "seed": True},
        {"block_size": 4, "eviction_half_life": 0},
        {"block_size": 4, "eviction_weight": -0.1},
    ):
        with pytest.raises(ConfigError):
            RouterConfig(**bad)
    with pytest.raises(ConfigError):
        Router(["w"])


# ---------------------------------------------------------------- state machine


class LeaseMachine(RuleBasedStateMachine):
    """Whatever the interleaving of routes, prefill completions, finishes, failures, cancellations and
    worker removals, every counter returns to exactly zero once every lease is closed."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.r = Router(["a", "b", "c"], RouterConfig(block_size=B, decode_weight=0.5))
        self.workers = {"a": None, "b": None, "c": None}  # every worker ever added, removed ones included
        self.open: list[Lease] = []
        self.extra = itertools.count()

    @rule(target=leases, n=st.integers(1, 6), start=st.integers(0, 50))
    def route(self, n: int, start: int):
        if not self.r._healthy:
            self.r.add_worker(f"x{next(self.extra)}")
        lease = self.r.route(tokens(n, start=start * 10))
        self.open.append(lease)
        return lease

    @rule(lease=leases)
    def prefill_done(self, lease: Lease) -> None:
        lease.prefill_done()

    @rule(lease=consumes(leases), how=st.sampled_from(["finish", "fail", "cancel", "twice"]))
    def close(self, lease: Lease, how: str) -> None:
        if how == "fail":
            with pytest.raises(ValueError), lease:
                raise ValueError
        elif how == "cancel":
            try:
                with lease:
                    raise asyncio.CancelledError
            except asyncio.CancelledError:
                pass
        else:
            lease.release()
            if how == "twice":
                lease.release()

    @rule(data=st.data())
    def remove_worker(self, data) -> None:
        if len(self.r.workers) > 1:
            self.r.remove_worker(data.draw(st.sampled_from(sorted(self.r.workers))))

    @rule()
    def add_worker(self) -> None:
        name = f"x{next(self.extra)}"
        self.r.add_worker(name)

    @rule(w=st.sampled_from(["a", "b", "c"]), blocks=st.integers(0, 6), start=st.integers(0, 50))
    def event(self, w: str, blocks: int, start: int) -> None:
        if w in self.r.workers:
            self.r.apply_events(w, [BlockStored(tuple(hashes(tokens(blocks, start=start * 10))), None, "device")])

    @invariant()
    def counters_match_open_leases(self) -> None:
        self.r.check_integrity()
        live = [lease for lease in self.open if not lease.closed]
        for w in self.r.workers:
            mine = [lease for lease in live if lease.worker == w]
            load = self.r.load(w)
            assert load.running == len(mine)
            assert load.inflight_prefill_tokens == sum(lease.prefill_tokens for lease in mine if lease._prefill_open)

    def teardown(self) -> None:
        for lease in self.open:
            lease.release()
        for w in self.r.workers:
            load = self.r.load(w)
            assert (load.running, load.inflight_prefill_tokens) == (0, 0)
        for lease in self.open:  # removed workers too: their counters are the leases' own
            assert lease._worker.running == 0 and lease._worker.inflight == 0


LeaseMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_lease_state_machine = LeaseMachine.TestCase


# ---------------------------------------------------------------- cluster simulation


def simulate(
    policy: str, requests, *, workers: int = 8, pool: int, window: int = 32, util: float = 0.7, **config
) -> tuple[float, float]:
    """Route a request stream over ``workers`` real managers; each worker computes prefill at a fixed rate.

    Returns (hit rate in tokens, max/min of per-worker prefill tokens computed).
    """
    size = requests[0][2]
    rate = sum(n for _, n, _ in requests) / len(requests) / workers / util
    sinks = [EventSink() for _ in range(workers)]
    managers = [KVCacheManager(pool, size, event_sink=sinks[i]) for i in range(workers)]
    r = Router(range(workers), RouterConfig(block_size=size, **config))
    for i, sink in enumerate(sinks):
        sink.subscribe(lambda record, i=i: r.apply_events(i, (record.event,)))
    queues: list[deque] = [deque() for _ in range(workers)]  # [lease or None, tokens left to prefill]
    running: deque = deque()
    rr = itertools.cycle(range(workers))
    computed = [0] * workers
    hits = total = 0
    for k, (hs, n, _) in enumerate(requests):
        for q in queues:  # one arrival interval of prefill work on every worker
            budget = rate
            while q and budget > 0:
                step = min(budget, q[0][1])
                q[0][1] -= step
                budget -= step
                if q[0][1] <= 0:
                    done = q.popleft()[0]
                    if done is not None:
                        done.prefill_done()
        lease = None
        if policy == "cache-aware":
            lease = r.route(block_hashes=hs, num_tokens=n)
            w = lease.worker
        elif policy == "round-robin":
            w = next(rr)
        else:  # least loaded: fewest prefill tokens queued, then fewest running, then round robin
            busy = [sum(x[1] for x in queues[i]) for i in range(workers)]
            runs = [sum(1 for x in running if x[1] == i) for i in range(workers)]
            w = min(range(workers), key=lambda i: (busy[i], runs[i], (i - k) % workers))
        m = managers[w]
        m.add_sequence(k, block_hashes=hs, num_tokens=n)
        cached = m.lookup(k).device
        while m.allocate(k, n - cached) is None:
            old, ow, ol = running.popleft()
            managers[ow].free(old)
            if ol is not None:
                ol.release()
        m.commit(k, n)
        hits += cached
        total += n
        computed[w] += n - cached
        queues[w].append([lease, n - cached])
        running.append((k, w, lease))
        if len(running) > window:
            old, ow, ol = running.popleft()
            managers[ow].free(old)
            if ol is not None:
                ol.release()
    for old, ow, ol in running:
        managers[ow].free(old)
        if ol is not None:
            ol.release()
    for w in range(workers):
        assert r.load(w).running == 0  # every lease released
        managers[w].check_integrity()
    return hits / total, max(computed) / max(1, min(computed))


def single_cache(requests, *, blocks: int, window: int = 32) -> float:
    m = KVCacheManager(blocks, requests[0][2])
    running: deque = deque()
    hits = total = 0
    for k, (hs, n, _) in enumerate(requests):
        m.add_sequence(k, block_hashes=hs, num_tokens=n)
        cached = m.lookup(k).device
        while m.allocate(k, n - cached) is None:
            m.free(running.popleft())
        m.commit(k, n)
        hits += cached
        total += n
        running.append(k)
        if len(running) > window:
            m.free(running.popleft())
    return hits / total


@pytest.fixture(scope="module")
def chat_requests():
    from benchmarks.workloads import multi_turn_chat

    size = 16
    workload = multi_turn_chat(block_size=size, conversations=400, seed=3)
    requests = [(block_hashes(r.prompt, size), len(r.prompt), size) for r in workload.requests]
    working_set = len({h for hs, _, _ in requests for h in hs})
    return requests, working_set


@pytest.mark.parametrize("capacity", [0.25, 0.5, 1.0])
def test_cache_aware_routing_keeps_the_hit_rate_of_one_big_cache_and_balances_load(
    chat_requests, capacity: float
) -> None:
    """8 workers holding together ``capacity`` of the working set, default router settings."""
    requests, working_set = chat_requests
    pool = int(working_set * capacity) // 8
    reference = single_cache(requests, blocks=pool * 8)
    hit, balance = simulate("cache-aware", requests, pool=pool)
    assert hit >= 0.9 * reference, (hit, reference)
    assert balance <= 1.5, balance
    if capacity == 0.25:
        for baseline in ("round-robin", "least-loaded"):
            assert hit > simulate(baseline, requests, pool=pool)[0]


_HELD = [10 + i for i in range(12)]  # w1's chain; w2 holds its first 5 blocks
_BAD = st.sampled_from([-1, -(1 << 70), 1.5, None, True, "h", b"", [1], float("nan")])
_UNHELD = st.integers(0, (1 << 64) - 1).filter(lambda h: h not in _HELD)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    tail=st.lists(
        st.one_of(
            st.integers(0, (1 << 64) - 1).filter(lambda h: h not in _HELD), st.binary(min_size=1, max_size=4), _BAD
        ),
        max_size=14,
    ),
    keep=st.integers(0, 12),
)
def test_a_route_over_any_hashes_is_the_walks_answer_or_a_clear_refusal_that_changes_nothing(
    tail: list, keep: int
) -> None:
    """``keep`` blocks of the held chain, then anything else: the route either picks the worker with the
    longest held run (every hash it read was valid), or raises ``InvalidBlockHashError`` naming a bad hash it
    read, with every load as before.

    Past the held part the prompt never returns to the held chain: the walk's bisection trusts that a hash
    names its whole prefix (one probe with its stated parent stands for the blocks before it), which ids
    that are not chained hashes can break -- ``[10, 0, 11, 12]`` over a worker holding the chain ``10, 11,
    12`` counts 4 blocks, not 1 (docs/routing.md)."""
    prompt = _HELD[:keep] + tail
    r = router()
    r.apply_events("w1", [BlockStored(tuple(_HELD), None, "device")])
    r.apply_events("w2", [BlockStored(tuple(_HELD[:5]), None, "device")])
    before = {w: r.load(w) for w in r.workers}
    try:
        lease = r.route(block_hashes=prompt, num_tokens=len(prompt) * B + 1)
    except InvalidBlockHashError as e:
        assert "position" in str(e)
        assert {w: r.load(w) for w in r.workers} == before and r.routed == 0
        return
    runs = {"w1": keep, "w2": min(keep, 5), "w0": 0}  # each worker's leading run of the prompt
    assert lease.overlap_blocks == runs[lease.worker]
    assert lease.overlap_blocks == max(runs.values())  # all idle: the longest run wins
    lease.release()
    r.check_integrity()
