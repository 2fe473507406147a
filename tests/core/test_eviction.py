"""Eviction policies: each against a small reference model, and over a pool + prefix tree."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks import KVCacheManager
from kvblocks.config import CacheConfig
from kvblocks.errors import ConfigError, IntegrityError, InvalidBlockIdError
from kvblocks.eviction import EVICTION_POLICIES, LRU, S3FIFO, check_eviction, make_policy
from kvblocks.pool import BlockPool
from kvblocks.radix import PrefixTree
from kvblocks.tiers import TierConfig, TieredKVCacheManager

N = 8
KEYS = [f"k{i}" for i in range(5)]  # one object per content: identity and equality agree


# ------------------------------------------------------------------ reference models


class LRUModel:
    """A list, oldest first."""

    def __init__(self) -> None:
        self.idle: list[int] = []

    def became_idle(self, b: int, key: object) -> None:
        self.idle.append(b)

    def hit(self, b: int) -> None:
        self.idle.remove(b)

    def touch(self, b: int) -> None:
        self.idle.remove(b)
        self.idle.append(b)

    def remove(self, b: int) -> None:
        self.idle.remove(b)

    def victims(self, count: int) -> list[int]:
        out, self.idle = self.idle[:count], self.idle[count:]
        return out

    def order(self) -> list[int]:
        return list(self.idle)


class S3FIFOModel:
    """S3-FIFO as the paper states it, in plain lists (small share 10% of the idle blocks)."""

    def __init__(self, ghost_size: int) -> None:
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghost: list[object] = []
        self.ghost_size = ghost_size
        self.freq: dict[int, int] = {}
        self.queue: dict[int, str] = {}  # block -> "S" / "M", for the content it holds
        self.content: dict[int, object] = {}

    def became_idle(self, b: int, key: object) -> None:
        if self.content.get(b) is not key:
            self.content[b] = key
            self.freq[b] = 0
            if key in self.ghost:
                self.ghost.remove(key)
                self.queue[b] = "M"
            else:
                self.queue[b] = "S"
        (self.main if self.queue[b] == "M" else self.small).append(b)

    def hit(self, b: int) -> None:
        (self.main if self.queue[b] == "M" else self.small).remove(b)
        self.freq[b] = min(3, self.freq[b] + 1)

    def touch(self, b: int) -> None:
        self.freq[b] = min(3, self.freq[b] + 1)

    def remove(self, b: int) -> None:
        (self.main if self.queue[b] == "M" else self.small).remove(b)
        del self.content[b]

    def victims(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count and (self.small or self.main):
            idle = len(self.small) + len(self.main)
            if self.small and (not self.main or len(self.small) > 0.1 * idle):
                b = self.small.pop(0)
                if self.freq[b]:
                    self.main.append(b)
                    self.queue[b] = "M"
                    self.freq[b] = 0
                    continue
                key = self.content[b]
                if key in self.ghost:
                    self.ghost.remove(key)
                self.ghost.append(key)
                del self.ghost[: max(0, len(self.ghost) - self.ghost_size)]
            else:
                b = self.main.pop(0)
                if self.freq[b]:
                    self.freq[b] -= 1
                    self.main.append(b)
                    continue
            del self.content[b]
            out.append(b)
        return out

    def order(self) -> list[int]:
        return self.small + self.main


def _models(name: str) -> tuple[Any, Any, list[object]]:
    keys: list[object] = [None] * N
    if name == "lru":
        return LRU(N, keys), LRUModel(), keys
    return S3FIFO(N, keys, ghost_size=3), S3FIFOModel(ghost_size=3), keys


OPS = st.lists(
    st.tuples(st.sampled_from(["idle", "hit", "touch", "remove", "victims", "recache"]), st.integers(0, 50)),
    max_size=80,
)


@pytest.mark.parametrize("name", list(EVICTION_POLICIES))
@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_a_policy_does_what_its_reference_model_does(name: str, ops: list[tuple[str, int]]) -> None:
    policy, model, keys = _models(name)
    in_use = set(range(N))  # blocks not idle (held, or fresh: the policy does not tell them apart)
    for op, x in ops:
        idle = [b for b in range(N) if b not in in_use]
        if op == "recache":  # a held block now holds (other) content
            b = sorted(in_use)[x % len(in_use)] if in_use else None
            if b is not None:
                keys[b] = KEYS[x % len(KEYS)]
        elif op == "idle" and in_use:
            b = sorted(in_use)[x % len(in_use)]
            if keys[b] is None:
                keys[b] = KEYS[x % len(KEYS)]
            policy.became_idle(b)
            model.became_idle(b, keys[b])
            in_use.discard(b)
        elif op in ("hit", "touch", "remove") and idle:
            b = idle[x % len(idle)]
            getattr(policy, op)(b)
            getattr(model, op)(b)
            if op != "touch":
                in_use.add(b)
        elif op == "victims":
            count = x % (N + 2)
            got = policy.victims(count)
            assert got == model.victims(count)
            assert len(got) == min(count, len(idle))
            in_use.update(got)
        assert list(policy.idle) == model.order()
        assert len(policy) == N - len(in_use)
        assert all((b in policy) == (b not in in_use) for b in range(N))
        policy.check_integrity()
        if name == "s3fifo":
            assert list(policy.ghost) == model.ghost


def test_s3fifo_promotes_a_hit_block_and_recalls_a_ghost_into_main() -> None:
    keys: list[object] = ["a", "b", "c", None]
    s3 = S3FIFO(4, keys, small_share=0.5)
    for b in (0, 1, 2):
        s3.became_idle(b)
    s3.touch(0)  # 0 was used while idle: at the small queue's head it goes to main instead of out
    assert s3.victims(1) == [1] and s3.queue_of(0) == "main" and list(s3.ghost) == ["b"]
    keys[3] = "b"  # the evicted content comes back in another block
    s3.became_idle(3)
    assert s3.queue_of(3) == "main" and "b" not in s3.ghost


def test_a_blocked_candidate_is_kept_and_its_parent_may_follow_its_child() -> None:
    for name in EVICTION_POLICIES:
        keys: list[object] = list("abcd")
        policy = make_policy(name, 4, keys)
        for b in (2, 3, 1, 0):  # 2 (a root) first, then 3, its child; 1 has child 0
            policy.became_idle(b)
        blockers = [0, 1, 1, 0, 2]  # 2 has child 3; 1 has child 0; the virtual root (4) has 2 and 1
        parent = [1, 4, 4, 2]
        out = policy.victims(4, blockers, parent)
        assert sorted(out) == [0, 1, 2, 3], name
        assert out.index(3) < out.index(2) and out.index(0) < out.index(1), name  # a child before its parent
        assert blockers == [0, 0, 0, 0, 0]


def test_every_idle_block_blocked_is_an_integrity_error() -> None:
    for name in EVICTION_POLICIES:
        policy = make_policy(name, 2, ["a", "b"])
        policy.became_idle(0)
        with pytest.raises(IntegrityError):
            policy.victims(1, [1, 0, 1], [2, 0])  # 0's child 1 is not idle


def test_names_and_config_errors() -> None:
    assert check_eviction("s3fifo") == "s3fifo"
    for bad in ("LRU", "mru", None, 3):
        with pytest.raises(ConfigError, match=r"unknown eviction policy .*; known: lru, s3fifo"):
            check_eviction(bad)
        with pytest.raises(ConfigError):
            BlockPool(4, eviction=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            CacheConfig(num_blocks=4, block_size=2, eviction=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="host_eviction"):
            TierConfig(num_host_blocks=4, host_eviction=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        S3FIFO(4, [None] * 4, small_share=1.0)
    with pytest.raises(ConfigError):
        S3FIFO(4, [None] * 4, ghost_size=-1)
    assert BlockPool(4).eviction == "lru" and BlockPool(4, eviction="s3fifo").eviction == "s3fifo"
    assert KVCacheManager(8, 4, eviction="s3fifo").pool.eviction == "s3fifo"


def test_the_pool_refuses_to_evict_a_block_that_is_not_idle_with_either_policy() -> None:
    for name in EVICTION_POLICIES:
        pool = BlockPool(4, eviction=name)
        (b,) = pool.take_fresh(1)
        pool.mark_cached(b, "x")
        for bad in (b, 3, 99, -1):
            with pytest.raises(InvalidBlockIdError):
                pool.evict(bad)
        pool.release([b])
        assert pool.is_idle(b) and pool.idle_since(b) >= 0
        pool.evict(b)
        pool.check_integrity()
        assert list(pool.fresh_order()) == [1, 2, 3, 0]


# ------------------------------------------------------------------ pool + prefix tree, each policy


class PolicyTreeMachine(RuleBasedStateMachine):
    """Holders insert chains over a tiny alphabet, hit cached prefixes, release (tail first or shuffled);
    the tree evicts. After each step: integrity; evictions took idle leaves only; held blocks stay cached."""

    EVICTION = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, eviction=self.EVICTION)
        self.tree = PrefixTree(self.pool)
        self.held: list[list[int]] = []

    def checked_evict(self, count: int) -> list[int]:
        idle = {b for b in range(N) if self.pool.is_idle(b)}
        held = {b for blocks in self.held for b in blocks}
        children = [self.tree.num_children(b) for b in range(N)]
        parent = [self.tree.parent_of(b) for b in range(N)]
        hashes = [self.tree.hash_of(b) for b in range(N)]
        out = self.tree.evict(count)
        assert len(out) == min(count, len(idle))  # an idle subtree is idle to its leaves: all can go
        assert len(set(out)) == len(out)
        for b in out:
            assert b in idle and b not in held
            assert children[b] == 0, f"block {b} evicted with a cached child"
            if parent[b] is not None:
                children[parent[b]] -= 1  # type: ignore[index]
            assert hashes[b] not in self.tree and not self.pool.is_cached(b) and b in self.pool.fresh_order()
        return out

    @rule(letters=st.text(alphabet="abc", min_size=1, max_size=4))
    def compute(self, letters: str) -> None:
        hashes = [letters[: i + 1] for i in range(len(letters))]
        hits = self.tree.matched_blocks(hashes)
        need = len(hashes) - len(hits)
        if need > self.pool.num_free - self.pool.count_idle(hits):
            return
        self.pool.acquire(hits)
        short = need - self.pool.num_fresh
        if short > 0:
            self.checked_evict(short)
        blocks = hits + self.pool.take_fresh(need)
        assert self.tree.insert(hashes, blocks, len(hits)) == []
        self.held.append(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), shuffle=st.booleans())
    def release(self, data: st.DataObject, shuffle: bool) -> None:
        blocks = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.release(data.draw(st.permutations(blocks)) if shuffle else blocks[::-1])

    @rule(count=st.integers(0, N + 1))
    def evict(self, count: int) -> None:
        self.checked_evict(count)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        self.tree.check_integrity()
        for blocks in self.held:
            for b in blocks:
                assert self.pool.ref_count(b) > 0 and self.pool.is_cached(b), "a held block lost its content"
        for b in range(N):
            h = self.tree.hash_of(b)
            if h is not None and len(h) > 1:
                assert self.tree.block_of(h[:-1]) is not None, "a cached suffix outlived its prefix"


class S3FIFOTreeMachine(PolicyTreeMachine):
    EVICTION = "s3fifo"


_MACHINE_SETTINGS = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
PolicyTreeMachine.TestCase.settings = _MACHINE_SETTINGS
S3FIFOTreeMachine.TestCase.settings = _MACHINE_SETTINGS
TestLRUTree = PolicyTreeMachine.TestCase
TestS3FIFOTree = S3FIFOTreeMachine.TestCase


# ------------------------------------------------------------------ managers and tiers


def _serve(m: KVCacheManager, seq: str, tokens: list[int]) -> int:
    m.add_sequence(seq, tokens)
    hit = m.lookup(seq).device
    assert m.allocate(seq, len(tokens) - hit) is not None
    m.commit(seq, len(tokens))
    m.free(seq)
    m.check_integrity()
    return hit


def test_s3fifo_keeps_a_reused_prefix_through_a_scan_that_flushes_lru() -> None:
    """One prompt reused between bursts of one-off prompts that together exceed the pool."""
    hot = list(range(1000, 1017))  # 4 full blocks + 1 token
    hits = {}
    for name in EVICTION_POLICIES:
        m = KVCacheManager(num_blocks=24, block_size=4, eviction=name)
        hits[name] = 0
        for burst in range(6):
            hits[name] += _serve(m, f"hot{burst}", hot)
            for i in range(8):  # 8 x 3 blocks of one-off content: more than the pool
                base = 10_000 * (burst + 1) + 100 * i
                _serve(m, f"scan{burst}-{i}", list(range(base, base + 13)))
    assert hits["lru"] == 0  # every burst flushed the hot prefix
    # the 2nd request misses but its content is a ghost: it goes straight to main, where it stays
    assert hits["s3fifo"] == 4 * 16


def test_a_tiered_manager_with_s3fifo_on_both_tiers_serves_from_host() -> None:
    m = TieredKVCacheManager(5, 4, tiers=TierConfig(num_host_blocks=8, host_eviction="s3fifo"), eviction="s3fifo")
    assert m.pool.eviction == "s3fifo" and m.host is not None and m.host.pool.eviction == "s3fifo"
    m.add_sequence("a", list(range(17)))
    m.allocate("a", 17)
    m.commit("a", 17)
    m.free("a")
    m.add_sequence("b", list(range(100, 117)))
    m.allocate("b", 17)  # evicts a's blocks, which are copied to host
    plan = m.take_transfers()
    assert len(plan.swap_outs) == 4
    m.complete_transfers(plan)
    m.free("b")
    for i in range(3):  # more one-off content than the host holds: host blocks are evicted by s3fifo
        seq = f"x{i}"
        m.add_sequence(seq, list(range(1000 * (i + 1), 1000 * (i + 1) + 17)))
        assert m.allocate(seq, 17 - m.lookup(seq).total) is not None
        m.complete_transfers(m.take_transfers())
        m.commit(seq, 17)
        m.free(seq)
    m.complete_transfers(m.take_transfers())
    m.check_integrity()
    m.host.check_integrity()
    assert m.host.pool.num_idle <= 8


@pytest.mark.parametrize("name", list(EVICTION_POLICIES))
def test_victims_hand_over_their_idle_stamps(name: str) -> None:
    keys: list[object] = list("abcd")
    for tree in (False, True):
        policy = make_policy(name, 4, keys)
        for b, t in ((2, 20.0), (0, 5.0), (3, 7.5)):
            policy.idle[b] = t
        assert policy.idle[0] == 5.0 and sorted(policy.idle) == [0, 2, 3]
        stamps: list[float] = []
        blockers = [0, 0, 0, 0, 3] if tree else None
        out = policy.victims(2, blockers, [4, 4, 4, 4] if tree else None, stamps)
        assert stamps == [{2: 20.0, 0: 5.0, 3: 7.5}[b] for b in out] and len(out) == 2


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("lru:3", "takes no parameter"),
        ("s3fifo:x", "is not a number"),
        ("s3fifo:", "is not a number"),
        ("s3fifo:1.5", "small_share must be a number in"),
        ("s3fifo:0", "small_share must be a number in"),
        ("s3fifo:nan", "small_share must be a number in"),
        (":0.5", "unknown eviction policy"),
        ("s3fifo:0.5:1", "is not a number"),
    ],
)
def test_a_bad_policy_spec_is_a_config_error_saying_why(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_eviction(spec)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        KVCacheManager(8, 4, eviction=spec)
    with pytest.raises(ConfigError, match="host_eviction"):
        TierConfig(num_host_blocks=4, host_eviction=spec)


def test_a_policy_spec_sets_the_policys_one_parameter() -> None:
    assert check_eviction("s3fifo:0.75") == "s3fifo:0.75"
    manager = KVCacheManager(8, 4, eviction="s3fifo:0.75")
    assert manager.pool.eviction == "s3fifo:0.75"
    policy = manager.pool.policy
    assert isinstance(policy, S3FIFO) and policy.small_share == 0.75
    default = KVCacheManager(8, 4, eviction="s3fifo").pool.policy
    assert isinstance(default, S3FIFO) and default.small_share == 0.1
    assert CacheConfig(num_blocks=4, block_size=2, eviction="s3fifo:0.5").eviction == "s3fifo:0.5"


def test_the_small_share_decides_which_queue_gives_the_next_victim() -> None:
    """The rule of S3FIFO's docstring: take from the small queue while it holds more than ``small_share`` of
    the idle blocks; a small-queue block with a hit moves to main (its frequency spent), one without goes.

    Four idle blocks in small, 0 and 1 used while idle. At 10%: 0 and 1 move to main, 2 goes (small still
    holds 2 of 4, above 10%). At 75%: 0 moves to main, and small then holds 3 of 4 = 75%, not above: main
    gives its head, 0, whose second chance is spent."""
    victims = {}
    for spec in ("s3fifo:0.1", "s3fifo:0.75"):
        policy = make_policy(spec, 4, ["a", "b", "c", "d"])
        for b in range(4):
            policy.became_idle(b)  # type: ignore[attr-defined]
        policy.touch(0)
        policy.touch(1)
        victims[spec] = policy.victims(1)
        policy.check_integrity()
    assert victims == {"s3fifo:0.1": [2], "s3fifo:0.75": [0]}


def test_the_policies_are_public_names() -> None:
    import kvblocks

    assert kvblocks.EVICTION_POLICIES is EVICTION_POLICIES and kvblocks.S3FIFO is S3FIFO and kvblocks.LRU is LRU
    assert {"EVICTION_POLICIES", "EvictionPolicy", "LRU", "S3FIFO"} <= set(kvblocks.__all__)
