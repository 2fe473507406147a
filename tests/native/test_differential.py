"""The compiled hot modules against their Python source: the same operations, the same results, block for block.

:func:`tests.support.side_by_side.load_pure` imports a second kvblocks in this process whose hot modules run
from source. Hypothesis drives both with one operation sequence (manager lifecycles with ``step``, chunked
prefill, drafts, preemption and eviction, on a plain and a hybrid cache; router event streams and routes), and
every return value, raised error (class name and message), block table, free count and event must agree.

Where nothing is compiled (no C compiler, or ``KVBLOCKS_PURE_PYTHON=1``) both sides are the same code and the
tests skip, except under ``KVBLOCKS_REQUIRE_COMPILED=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvblocks
import kvblocks.core.pool
import kvblocks.core.prefix_tree
import kvblocks.events
import kvblocks.hashing
import kvblocks.hybrid
import kvblocks.routing
import kvblocks.tiers
from kvblocks import native
from tests.support.side_by_side import TORCH_MODULES, load_pure, outcome

PRELOAD = ("kvblocks.routing", "kvblocks.events", "kvblocks.hybrid")
COMPILED = native.status().compiled

pytestmark = pytest.mark.skipif(
    not COMPILED and os.environ.get("KVBLOCKS_REQUIRE_COMPILED") != "1",
    reason="nothing compiled: the pure and the compiled kvblocks are the same code",
)


def test_the_build_is_compiled_where_ci_requires_it() -> None:
    """CI sets KVBLOCKS_REQUIRE_COMPILED=1: there, every hot module must run compiled."""
    state = native.status()
    assert state.implementation == "compiled", str(state)


HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_the_pure_copy_runs_every_hot_module_from_source() -> None:
    pure = load_pure(PRELOAD + (TORCH_MODULES if HAS_TORCH else ()))
    for name in native.COMPILED_MODULES:
        if name in TORCH_MODULES and not HAS_TORCH:
            continue
        assert str(pure[name].__file__).endswith(".py"), name
        assert pure[name] is not kvblocks.__dict__.get(name)
    assert pure["kvblocks"].KVCacheManager is not kvblocks.KVCacheManager


SEQ_IDS = [f"r{i}" for i in range(5)]
PROMPTS = [[1, 2, 3, 4] * 6, [1, 2, 3, 4] * 3 + [9, 9, 9], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
tokens = st.lists(st.integers(0, 9), max_size=6)


class TwinManagers(RuleBasedStateMachine):
    """One compiled and one pure manager, the same call on both, every result compared."""

    hybrid = False
    eviction = "lru"
    tiered = False

    def __init__(self) -> None:
        super().__init__()
        self.pure = load_pure(PRELOAD)
        self.sides: list[Any] = []
        self.sinks: list[Any] = []
        self.active: set[str] = set()

    @initialize()
    def build(self) -> None:
        for mods in (
            {
                "kvblocks": kvblocks,
                "kvblocks.events": kvblocks.events,
                "kvblocks.hybrid": kvblocks.hybrid,
                "kvblocks.tiers": kvblocks.tiers,
            },
            self.pure,
        ):
            sink = mods["kvblocks.events"].EventSink()
            groups = (mods["kvblocks.hybrid"].LocalGroup("sliding_window", 6, 8),) if self.hybrid else ()
            tiers = mods["kvblocks.tiers"].TierConfig(num_host_blocks=6) if self.tiered else None
            manager = mods["kvblocks"].KVCacheManager(
                num_blocks=10, block_size=4, event_sink=sink, eviction=self.eviction, groups=groups, tiers=tiers
            )
            self.sides.append(manager)
            self.sinks.append(sink)

    def both(self, call: Callable[[Any], Any]) -> tuple[str, Any]:
        compiled, pure = (outcome(lambda m=m: call(m)) for m in self.sides)
        assert compiled == pure
        return compiled

    @rule(seq=st.sampled_from(SEQ_IDS), prompt=st.sampled_from(PROMPTS), extra=tokens)
    def add(self, seq: str, prompt: list[int], extra: list[int]) -> None:
        if self.both(lambda m: m.add_sequence(seq, prompt + extra))[0] == "ok":
            self.active.add(seq)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.active)))
        self.both(lambda m: m.lookup(seq))

    @precondition(lambda self: self.active)
    @rule(data=st.data(), n=st.integers(0, 30), k=st.integers(0, 3), use_cached=st.booleans())
    def allocate(self, data: st.DataObject, n: int, k: int, use_cached: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.active)))
        cached = self.both(lambda m: m.lookup(seq).device)
        kwargs = {"num_lookahead_tokens": k}
        if use_cached and cached[0] == "ok":
            kwargs["num_cached_tokens"] = cached[1]
        self.both(lambda m: m.allocate(seq, n, **kwargs))

    def sound_commit(self, seq: str, appended: int = 0) -> st.SearchStrategy[int]:
        """A commit the compiled side would take (when the sequence is admitted), or any count."""
        manager = self.sides[0]
        if seq not in manager or not manager.is_admitted(seq):
            return st.integers(0, 40)
        low = manager.num_computed_tokens(seq)
        high = min(manager.num_allocated_tokens(seq), manager.num_tokens(seq) + appended)
        return st.integers(low, high) | st.integers(0, 40) if low <= high else st.integers(0, 40)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """An engine's admission: the whole prompt after the hit, then its commit (what fills the cache, so that
        later admissions evict, and a tiered cache writes back and swaps in)."""
        seq = data.draw(st.sampled_from(sorted(self.active)))
        cached = self.both(lambda m: m.lookup(seq).total)
        if cached[0] == "ok":
            self.both(lambda m: m.allocate(seq, m.num_tokens(seq) - cached[1], num_cached_tokens=cached[1]))
        self.both(lambda m: m.commit(seq, m.num_tokens(seq)))

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.active)))
        n = data.draw(self.sound_commit(seq))
        self.both(lambda m: m.commit(seq, n))

    @precondition(lambda self: self.active)
    @rule(data=st.data(), new=tokens)
    def append(self, data: st.DataObject, new: list[int]) -> None:
        seq = data.draw(st.sampled_from(sorted(self.active)))
        self.both(lambda m: m.append_tokens(seq, new))

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Decode (one token), chunked prefill (a chunk), drafts (lookahead slots), or a bad entry."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.active)), min_size=1, max_size=4, unique=True))
        huge = st.sampled_from([-1, 2**63, 2**70])  # past the compiled step's 64-bit counts
        sampled = [data.draw(st.one_of(st.none(), tokens)) for _ in ids]
        computed = [
            data.draw(st.one_of(st.none(), self.sound_commit(i, len(t or ())), huge)) for i, t in zip(ids, sampled)
        ]
        news = [data.draw(st.one_of(st.integers(0, 9), huge)) for _ in ids]
        drafts = [data.draw(st.one_of(st.integers(0, 3), huge)) for _ in ids]
        self.both(lambda m: m.step(ids, computed, sampled, news, drafts))

    @precondition(lambda self: self.active)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.active)))
        if preempt:
            self.both(lambda m: m.preempt(seq))
        elif self.both(lambda m: m.free(seq))[0] == "ok":
            self.active.discard(seq)

    @rule()
    def reset(self) -> None:
        self.both(lambda m: m.reset_prefix_cache())

    @invariant()
    def same_state(self) -> None:
        if not self.sides:
            return
        self.both(lambda m: m.num_free_blocks)
        for seq in sorted(self.active):
            self.both(lambda m, seq=seq: m.block_tables(seq))
            self.both(lambda m, seq=seq: (m.num_computed_tokens(seq), m.num_allocated_tokens(seq), m.block_hashes(seq)))
        self.both(lambda m: m.stats)
        compiled, pure = ([(r.event.__class__.__name__, repr(r.event)) for r in s.drain()] for s in self.sinks)
        assert compiled == pure
        for manager in self.sides:
            manager.check_integrity()


class TwinHybridManagers(TwinManagers):
    hybrid = True


class TwinS3FifoManagers(TwinManagers):
    eviction = "s3fifo"


class TwinTieredManagers(TwinManagers):
    """A host tier under the device (and under the window group's): evictions plan swap-outs, host hits plan
    swap-ins, and each plan is completed, some copies failing."""

    tiered = True

    @rule(data=st.data())
    def transfers(self, data: st.DataObject) -> None:
        plans = [manager.take_transfers() for manager in self.sides]
        assert outcome(lambda: plans[0]) == outcome(lambda: plans[1])
        entries = plans[0].group_transfers
        failed_in = {g.group: [d for _, d in g.swap_ins if data.draw(st.booleans())] for g in entries}
        failed_out = {g.group: [h for _, h in g.swap_outs if data.draw(st.booleans())] for g in entries}
        calls = iter(plans)
        self.both(lambda m: m.complete_transfers(next(calls), failed_swap_ins=failed_in, failed_swap_outs=failed_out))

    @rule(first=st.sampled_from(PROMPTS), second=st.sampled_from(PROMPTS), extra=tokens)
    def churn(self, first: list[int], second: list[int], extra: list[int]) -> None:
        """Cache a prompt, push it out with another (write-backs to host), bring the first back (host hits, swap-ins
        completed before its commit): the moves the random rules above rarely reach in a 10-block pool."""
        for number, prompt in enumerate((first, second + extra, first)):
            seq = f"churn{number}"
            if self.both(lambda m, seq=seq, prompt=prompt: m.add_sequence(seq, prompt))[0] != "ok":
                continue
            cached = self.both(lambda m, seq=seq: m.lookup(seq).total)
            self.both(lambda m, seq=seq, c=cached[1]: m.allocate(seq, m.num_tokens(seq) - c, num_cached_tokens=c))
            plans = iter([manager.take_transfers() for manager in self.sides])
            self.both(lambda m, plans=plans: m.complete_transfers(next(plans)))
            self.both(lambda m, seq=seq: m.commit(seq, m.num_tokens(seq)))
            self.both(lambda m, seq=seq: m.free(seq))

    @invariant()
    def same_tiers(self) -> None:
        if self.sides:
            self.both(lambda m: m.tier_stats)
            for seq in sorted(self.active):
                self.both(lambda m, seq=seq: m.is_ready(seq))


class TwinTieredHybridManagers(TwinTieredManagers):
    hybrid = True


SETTINGS = settings(
    max_examples=200 if os.environ.get("CI") else 50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTwinManagers = TwinManagers.TestCase
TestTwinManagers.settings = SETTINGS
TestTwinHybridManagers = TwinHybridManagers.TestCase
TestTwinHybridManagers.settings = SETTINGS
TestTwinS3FifoManagers = TwinS3FifoManagers.TestCase
TestTwinS3FifoManagers.settings = SETTINGS
TestTwinTieredManagers = TwinTieredManagers.TestCase
TestTwinTieredManagers.settings = SETTINGS
TestTwinTieredHybridManagers = TwinTieredHybridManagers.TestCase
TestTwinTieredHybridManagers.settings = SETTINGS


def router_pair(pure: dict[str, ModuleType], **config: Any) -> list[Any]:
    out = []
    for mods in ({"kvblocks.routing": kvblocks.routing}, pure):
        routing = mods["kvblocks.routing"]
        out.append(routing.Router(["w0", "w1", "w2"], routing.RouterConfig(block_size=4, **config)))
    return out


class TwinRouters(RuleBasedStateMachine):
    """One compiled and one pure router fed the same event stream; routes and overlaps compared."""

    chains = Bundle("chains")

    def __init__(self) -> None:
        super().__init__()
        self.pure = load_pure(PRELOAD)
        self.routers = router_pair(self.pure)
        self.leases: list[list[Any]] = []

    def both(self, call: Callable[[Any, dict[str, ModuleType]], Any]) -> tuple[str, Any]:
        mods = ({"kvblocks.events": kvblocks.events, "kvblocks.routing": kvblocks.routing}, self.pure)
        compiled, pure = (outcome(lambda r=r, m=m: call(r, m)) for r, m in zip(self.routers, mods))
        assert compiled == pure
        return compiled

    @rule(target=chains, prompt=st.sampled_from(PROMPTS), extra=st.lists(st.integers(0, 9), max_size=12))
    def prompt(self, prompt: list[int], extra: list[int]) -> list[int]:
        return prompt + extra

    @rule(
        tokens=chains,
        worker=st.sampled_from(["w0", "w1", "w2"]),
        start=st.integers(0, 3),
        length=st.integers(0, 6),
        tier=st.sampled_from(["device", "host", "storage"]),
    )
    def stored(self, tokens: list[int], worker: str, start: int, length: int, tier: str) -> None:
        hashes = self.routers[0].prompt_hashes(tokens)
        run = tuple(hashes[start : start + length])
        parent = hashes[start - 1] if 0 < start <= len(hashes) else None
        self.both(lambda r, m: r.apply_events(worker, [m["kvblocks.events"].BlockStored(run, parent, tier)]))

    @rule(tokens=chains, worker=st.sampled_from(["w0", "w1", "w2"]), picks=st.lists(st.integers(0, 8), max_size=4))
    def removed(self, tokens: list[int], worker: str, picks: list[int]) -> None:
        hashes = self.routers[0].prompt_hashes(tokens)
        gone = tuple(hashes[i] for i in picks if i < len(hashes))
        self.both(lambda r, m: r.apply_events(worker, [m["kvblocks.events"].BlockRemoved(gone, "device")]))

    @rule(worker=st.sampled_from(["w0", "w1", "w2"]))
    def cleared(self, worker: str) -> None:
        self.both(lambda r, m: r.apply_events(worker, [m["kvblocks.events"].AllBlocksCleared()]))

    @rule(tokens=chains, by_hash=st.booleans())
    def route(self, tokens: list[int], by_hash: bool) -> None:
        def call(router: Any, _: object) -> Any:
            if by_hash:
                lease = router.route(block_hashes=router.prompt_hashes(tokens), num_tokens=len(tokens))
            else:
                lease = router.route(tokens)
            lease.release()
            return lease.worker, lease.overlap_blocks, lease.prefill_tokens

        self.both(call)

    @rule(tokens=chains)
    def overlaps(self, tokens: list[int]) -> None:
        self.both(lambda r, m: r.overlaps(r.prompt_hashes(tokens)))

    @rule(bad=st.sampled_from([[-1], ["x"], [2**64], [None], [1.5]]))
    def bad_hashes(self, bad: list[Any]) -> None:
        self.both(lambda r, m: r.route(block_hashes=bad, num_tokens=64))

    @invariant()
    def sound(self) -> None:
        for router in self.routers:
            router.check_integrity()
        self.both(lambda r, m: [(w, str(r.load(w))) for w in r.workers()])


TestTwinRouters = TwinRouters.TestCase
TestTwinRouters.settings = SETTINGS


def test_hashing_agrees_on_long_prompts() -> None:
    """Chained hashing of long token runs, every scheme kvblocks registers, compiled against pure."""
    pure = load_pure(PRELOAD)
    tokens_ = list(range(5000))
    for scheme in sorted(kvblocks.hashing.HASH_SCHEMES):
        compiled = outcome(lambda scheme=scheme: kvblocks.block_hashes(tokens_, 16, scheme=scheme))
        pure_ = outcome(lambda scheme=scheme: pure["kvblocks"].block_hashes(tokens_, 16, scheme=scheme))
        assert compiled == pure_, scheme


BLOCK_IDS = st.one_of(
    st.integers(-2, 9), st.booleans(), st.just(2.0), st.sampled_from([2**63 - 1, 2**63, 2**70]), st.none()
)


@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(BLOCK_IDS, min_size=1, max_size=5), start=st.integers(0, 2))
def test_prefix_tree_inserts_agree_on_any_block_ids(blocks: list[object], start: int) -> None:
    """The compiled insert loop indexes with C integers: whatever the ids, it links, refuses and names the problem
    exactly as the source does."""
    pure = load_pure(PRELOAD)
    chain = [bytes([i + 1]) * 16 for i in range(len(blocks))]
    results = []
    for tree_module, pool_module in (
        (kvblocks.core.prefix_tree, kvblocks.core.pool),
        (pure["kvblocks.core.prefix_tree"], pure["kvblocks.core.pool"]),
    ):
        pool = pool_module.BlockPool(8)
        tree = tree_module.PrefixTree(pool, block_size=4)
        held = pool.take_fresh(len(blocks))
        tree.insert(chain, held, 0, min(start, len(blocks)))  # a cached parent run
        given = [*held[:start], *blocks[start:]]
        result = outcome(lambda tree=tree, given=given: tree.insert(chain, given))
        tree.check_integrity()
        results.append((result, {repr(h): b for h, b in tree._block_of.items()}))
    assert results[0] == results[1]


def test_the_twins_catch_a_pure_copy_that_differs() -> None:
    """Not vacuous: a pure copy whose pool hands out its fresh blocks last-in-first-out fails the comparison."""
    from hypothesis.stateful import run_state_machine_as_test

    faulty = load_pure(("kvblocks.routing", "kvblocks.events", "kvblocks.hybrid", "kvblocks.core.pool"))
    pool_class = faulty["kvblocks.core.pool"].BlockPool
    original = pool_class.take_fresh

    def take_newest(self: Any, count: int) -> list[int]:
        self._fresh.reverse()
        try:
            return original(self, count)
        finally:
            self._fresh.reverse()

    class Faulty(TwinManagers):
        def __init__(self) -> None:
            super().__init__()
            self.pure = faulty

    pool_class.take_fresh = take_newest
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Faulty, settings=settings(SETTINGS, max_examples=200, database=None))
