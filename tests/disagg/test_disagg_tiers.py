"""Prefill and decode roles over host and storage tiers (TieredPrefillManager, TieredDecodeManager).

Every node runs under :class:`tests.support.tier_sim.SimEngine`, whose block "KV" is derived from the
block's hash, so a test can check that every block a node calls cached -- on device, in host
memory, in storage, or received through a handoff -- holds the KV of the prefix it names.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvblocks.presets
from kvblocks import (
    CacheConfig,
    CachedTokens,
    ConfigError,
    DecodeManager,
    DisaggConfig,
    PrefillHandoff,
    PrefillManager,
    SequenceStateError,
    TieredDecodeManager,
    TieredPrefillManager,
    manager_for_role,
)
from kvblocks.tiers import MemoryStorage, TierConfig, TieredKVCacheManager
from tests.support.tier_sim import FORMAT, GARBAGE, SimEngine, content_of

B = 4
SYSTEM = list(range(500, 512))  # 3 full blocks


def prompt(tail: int, length: int = 5) -> list[int]:
    return SYSTEM + [1000 * tail + i for i in range(length)]


def tiers(**kwargs) -> TierConfig:
    if kwargs.get("storage") is not None:
        kwargs.setdefault("entry_format", FORMAT)
    return TierConfig(**kwargs)


@pytest.fixture
def closing() -> Iterator[list[TieredKVCacheManager]]:
    """Managers to close (their storage threads) when the test ends."""
    managers: list[TieredKVCacheManager] = []
    yield managers
    for m in managers:
        m.close(timeout=5)


def prefill(engine: SimEngine, seq_id, tokens: list[int]) -> PrefillHandoff:
    """Admit on a prefill node, settle its copies, compute the rest, commit, hand off."""
    m = engine.m
    m.add_sequence(seq_id, tokens)
    if m.storage is not None:
        m.storage.wait_idle(5)  # the probe of what other nodes stored has answered
    assert m.allocate(seq_id, len(tokens) - m.lookup(seq_id).total) is not None
    engine.wait_ready(seq_id)
    if len(m.block_table(seq_id)) * B < len(tokens):  # a shorter load: the rest is computed
        assert m.allocate(seq_id, len(tokens) - m.num_computed_tokens(seq_id)) is not None
        engine.step()
    engine.check_sequence(seq_id)
    engine.compute(seq_id, len(tokens))
    m.commit(seq_id, len(tokens))
    return m.finish_prefill(seq_id)


def move(src: SimEngine, dst: SimEngine, transfers) -> None:
    """The engines' KV transfer: source block bytes into decode blocks."""
    for source, target in transfers:
        dst.device[target] = src.read_device(source)


# ------------------------------------------------------------------------------------------ roles


@pytest.mark.parametrize(
    ("role", "plain", "tiered"),
    [
        ("mixed", "KVCacheManager", "TieredKVCacheManager"),
        ("prefill", "PrefillManager", "TieredPrefillManager"),
        ("decode", "DecodeManager", "TieredDecodeManager"),
    ],
)
def test_manager_for_role_builds_the_role_s_class_over_tiers_when_tiers_are_given(
    role: str, plain: str, tiered: str
) -> None:
    """One class per role; the tiers are a part of the manager, and the previous release's tiered names
    answer isinstance for a manager with that role and tiers."""
    config = CacheConfig(16, B)
    disagg = DisaggConfig(role=role, reserve_blocks_per_sequence=2)
    untiered = manager_for_role(config, disagg)
    assert type(untiered).__name__ == plain and untiered.tiers is None and untiered.host is None
    m = manager_for_role(config, disagg, tiers=tiers(num_host_blocks=8))
    assert type(m).__name__ == plain and m.tiers is not None
    assert isinstance(m, getattr(kvblocks.presets, tiered)) and not isinstance(
        untiered, getattr(kvblocks.presets, tiered)
    )
    assert isinstance(m, TieredKVCacheManager) and m.role == role
    assert m.host is not None and m.host.pool.num_blocks == 8
    if role == "decode":
        assert m.reserve_blocks == 0 and m._decode.reserve_per_sequence == 2  # type: ignore[attr-defined]


def test_tiered_roles_are_both_roles() -> None:
    d = TieredDecodeManager(8, B, tiers=tiers(num_host_blocks=2), reserve_blocks_per_sequence=3)
    assert isinstance(d, DecodeManager) and isinstance(d, TieredKVCacheManager) and isinstance(d, TieredDecodeManager)
    assert not isinstance(d, PrefillManager) and not isinstance(d, TieredPrefillManager)
    assert d.role == "decode" and d._decode.reserve_per_sequence == 3 and d.host is not None
    p = TieredPrefillManager(8, B, tiers=tiers(num_host_blocks=2))
    assert isinstance(p, PrefillManager) and isinstance(p, TieredKVCacheManager) and not isinstance(p, DecodeManager)


def test_manager_for_role_refuses_tiers_that_are_not_a_tier_config() -> None:
    with pytest.raises(ConfigError, match="TierConfig"):
        manager_for_role(CacheConfig(16, B), DisaggConfig(role="prefill"), tiers={"num_host_blocks": 8})  # type: ignore[arg-type]


def test_a_tiered_decode_from_config_must_be_in_the_decode_role() -> None:
    with pytest.raises(ConfigError, match="decode role"):
        TieredDecodeManager.from_config(CacheConfig(16, B), tiers=tiers(), disagg=DisaggConfig(role="prefill"))


# ------------------------------------------------------------------------------------------ prefill


def test_the_handoff_reports_host_hits_of_a_tiered_prefill_node(closing) -> None:
    p = TieredPrefillManager(5, B, tiers=tiers(num_host_blocks=8))
    closing.append(p)
    ep = SimEngine(p)
    first = prefill(ep, "a", prompt(1))  # 17 tokens: 4 full blocks + 1
    assert first.cached == CachedTokens(num_prompt_tokens=17)
    p.transfer_done("a")
    prefill(ep, "b", list(range(100, 117)))  # evicts a's 4 cached blocks: written back to host
    p.transfer_done("b")
    ep.step()
    assert p.host is not None and all(h in p.host for h in first.block_hashes)
    again = prefill(ep, "c", prompt(1))
    assert again.cached == CachedTokens(device=0, host=16, storage=0, num_prompt_tokens=17)
    assert (p.stats.hit_tokens_host, p.stats.hit_tokens) == (16, 16) and p.tier_stats.swap_ins == 4
    p.check_integrity()
    ep.check_cached()


def test_the_handoff_reports_the_settled_storage_run_not_the_index(closing) -> None:
    """The index promised 4 stored blocks; one is gone when read: the handoff says 1, the rest is computed."""
    storage = MemoryStorage()
    writer = TieredPrefillManager(5, B, tiers=tiers(storage=storage, storage_policy="write-through"))
    closing.append(writer)
    ew = SimEngine(writer, settle=True)
    prefill(ew, "a", prompt(1))
    writer.transfer_done("a")
    ew.step()  # the plan carrying the write-through saves
    writer.flush(5)
    p = TieredPrefillManager(5, B, tiers=tiers(storage=storage))
    closing.append(p)
    ep = SimEngine(p, settle=True)
    p.add_sequence("probe", prompt(1))
    p.storage.wait_idle(5)  # type: ignore[union-attr]
    assert p.lookup("probe") == CachedTokens(storage=16, num_prompt_tokens=17)
    stored = p.block_hashes("probe")
    p.free("probe")
    assert storage.delete(p.storage.keys_of(stored[1])) == 1  # type: ignore[union-attr]  # evicted by a budget
    handoff = prefill(ep, "r", prompt(1))
    assert handoff.cached == CachedTokens(storage=4, num_prompt_tokens=17)  # only b0: the leading run
    assert (p.stats.hit_tokens_storage, p.stats.hit_tokens) == (4, 4)
    ep.check_sequence("r")


def test_a_prefill_freed_before_its_copies_settle_reports_nothing_later(closing) -> None:
    """A re-registered request id gets its own admission's figure, not the abandoned one's."""
    p = TieredPrefillManager(5, B, tiers=tiers(num_host_blocks=8))
    closing.append(p)
    ep = SimEngine(p)
    prefill(ep, "a", prompt(1))
    p.transfer_done("a")
    prefill(ep, "b", prompt(2))  # shares the 3 system blocks; evicts a's block 3 to host
    p.transfer_done("b")
    ep.step()
    p.add_sequence("r", prompt(1))
    assert p.lookup("r") == CachedTokens(device=12, host=4, num_prompt_tokens=17)
    assert p.allocate("r", 1) is not None and not p.is_ready("r")  # the host hit is pending
    p.free("r")  # before the plan ran: the admission is abandoned (counted with its device hits)
    ep.step()
    handoff = prefill(ep, "r", list(range(300, 317)))  # the same id, a cold prompt
    assert handoff.cached == CachedTokens(num_prompt_tokens=17)
    p.check_integrity()


def test_a_tiered_prefill_refuses_every_call_while_transferring(closing) -> None:
    p = TieredPrefillManager(8, B, tiers=tiers(num_host_blocks=4))
    closing.append(p)
    handoff = prefill(SimEngine(p), "a", prompt(1))
    for call in (lambda: p.free("a"), lambda: p.preempt("a"), lambda: p.allocate("a", 1), lambda: p.commit("a", 17)):
        with pytest.raises(SequenceStateError):
            call()
    assert all(p.pool.ref_count(b) == 1 for b in handoff.source_blocks)
    p.transfer_done("a")
    assert p.pool.num_free == 8 and len(p.tree) == 4


# ------------------------------------------------------------------------------------------ decode


def test_the_next_turn_is_prefilled_from_what_the_decode_node_stored(closing) -> None:
    """Multi-turn over shared storage: decode writes the conversation through; the next turn's
    prefill (another node) loads it instead of recomputing it."""
    storage = MemoryStorage()
    p = TieredPrefillManager(16, B, tiers=tiers(storage=storage))
    d = TieredDecodeManager(16, B, tiers=tiers(storage=storage, storage_policy="write-through"))
    closing.extend([p, d])
    ep, ed = SimEngine(p, settle=True), SimEngine(d, settle=True)
    turn1 = prompt(1, 4)  # 16 tokens
    handoff = prefill(ep, "t1", turn1)
    admission = d.accept_handoff(PrefillHandoff.from_bytes(handoff.to_bytes()), turn1)
    assert admission is not None
    ed.step()
    move(ep, ed, admission.transfers)
    d.receive_done("t1")
    p.transfer_done("t1")
    answer = [9000 + i for i in range(8)]
    for token in answer:  # decode 8 tokens, one step each
        d.append_tokens("t1", [token])
        assert d.allocate("t1", 1) is not None
        ed.step()
        ed.compute("t1", d.num_tokens("t1"))
        d.commit("t1", d.num_tokens("t1"))
    ed.step()
    d.flush(5)
    assert (
        d.tier_stats.writer is not None and d.tier_stats.writer.written == 6
    )  # 24 tokens: 6 full blocks, each written once
    d.free("t1")
    turn2 = turn1 + answer + [7777, 7778, 7779]  # history + the next user message: 27 tokens
    second = prefill(ep, "t2", turn2)
    assert second.cached.device == 16 and second.cached.storage == 8  # P still caches turn 1; loads the answer
    ep.check_sequence("t2")


def test_decode_evictions_are_written_back_to_host_and_readmitted_from_there(closing) -> None:
    p = PrefillManager(16, B)
    d = TieredDecodeManager(6, B, tiers=tiers(num_host_blocks=8), reserve_blocks_per_sequence=0)
    closing.append(d)
    ed = SimEngine(d)
    p.add_sequence("a", prompt(1, 4))
    p.allocate("a", 16)
    p.commit("a", 16)
    handoff = p.finish_prefill("a")
    admission = d.accept_handoff(handoff, prompt(1, 4))
    assert admission is not None and len(admission.transfers) == 4
    ed.step()
    for (_, target), block_hash in zip(admission.transfers, handoff.block_hashes, strict=True):
        ed.device[target] = content_of(block_hash)  # what the transfer writes: the prefix's own KV
    d.receive_done("a")
    p.transfer_done("a")
    d.preempt("a")  # its 4 committed blocks stay on device, evictable
    other = list(range(2000, 2016))  # nothing in common with a
    p.add_sequence("b", other)
    p.allocate("b", 16)
    p.commit("b", 16)
    assert d.accept_handoff(p.finish_prefill("b"), other) is not None
    plan = ed.run_plan()  # 2 fresh blocks + a's two tail blocks, copied to host before b's KV lands
    assert [d_block for d_block, _ in plan.swap_outs] == [admission.transfers[3][1], admission.transfers[2][1]]
    d.receive_done("b", ok=False)
    assert d.lookup("a") == CachedTokens(device=8, host=4, num_prompt_tokens=16)  # last block: recomputed
    table = d.allocate("a", 4)
    assert table is not None and [h for h, _ in table.swap_ins] == [plan.swap_outs[1][1]]
    ed.wait_ready("a")
    ed.check_sequence("a")
    assert d.num_computed_tokens("a") == 12
    assert (d.stats.readmission_hit_tokens_device, d.stats.readmission_hit_tokens_host) == (8, 4)
    d.check_integrity()
    ed.check_cached()


def test_a_refused_handoff_changes_nothing_on_a_tiered_decode_node(closing) -> None:
    p = PrefillManager(32, B)
    d = TieredDecodeManager(5, B, tiers=tiers(num_host_blocks=4), reserve_blocks_per_sequence=2)
    closing.append(d)
    p.add_sequence("a", prompt(1))
    p.allocate("a", 17)
    p.commit("a", 17)
    handoff = p.finish_prefill("a")
    before = (d.pool.num_free, d.take_transfers().swap_outs, d.decode_counters.handoffs_refused)
    assert d.accept_handoff(handoff, prompt(1)) is None  # 5 blocks + a reserve of 2 > 5 free
    assert (d.pool.num_free, d.decode_counters.handoffs_refused) == (before[0], before[2] + 1)
    assert d.take_transfers().swap_outs == ()
    d.check_integrity()


# ------------------------------------------------------------------------------------------ state machine


class TieredDisaggMachine(RuleBasedStateMachine):
    """A tiered prefill node and a tiered decode node sharing one storage, under random interleavings.

    After every step: both nodes pass check_integrity; every block either calls cached (device
    tree, host entries) holds its prefix's KV; every sequence decoding on D holds correct KV
    in its committed blocks; no prefill block is released before its transfer is done; every
    request's cached-token figure stays within its prompt.
    """

    @initialize(
        p_host=st.sampled_from([4, 0]),
        d_host=st.sampled_from([4, 0]),
        with_storage=st.booleans(),
        p_policy=st.sampled_from(["write-back", "write-through"]),
        d_policy=st.sampled_from(["write-back", "write-through"]),
        save_on_preempt=st.booleans(),
        decode_cache=st.booleans(),
        reserve=st.integers(0, 1),
    )
    def setup(self, p_host, d_host, with_storage, p_policy, d_policy, save_on_preempt, decode_cache, reserve) -> None:
        self.storage = MemoryStorage() if with_storage else None
        p_tiers = tiers(num_host_blocks=p_host, storage=self.storage, storage_policy=p_policy)
        d_tiers = tiers(
            num_host_blocks=d_host,
            storage=self.storage,
            storage_policy=d_policy,
            save_on_preempt=save_on_preempt and with_storage,
        )
        self.p = TieredPrefillManager(8, B, tiers=p_tiers)
        self.d = TieredDecodeManager(
            7, B, tiers=d_tiers, reserve_blocks_per_sequence=reserve, enable_prefix_caching=decode_cache
        )
        self.ep, self.ed = SimEngine(self.p, settle=True), SimEngine(self.d, settle=True)
        self.tokens: dict[int, list[int]] = {}
        self.handoffs: dict[int, PrefillHandoff] = {}
        self.moving: dict[int, tuple[tuple[int, int], ...]] = {}
        self.decoding: set[int] = set()
        self.reported: dict[int, int] = {}
        self.next = 0

    def teardown(self) -> None:
        if hasattr(self, "p"):
            self.p.close(timeout=5)
            self.d.close(timeout=5)

    def _pick(self, data, pool) -> int | None:
        items = sorted(pool)
        return items[data.draw(st.integers(0, 7)) % len(items)] if items else None

    def _admit(self, engine: SimEngine, r: int) -> None:
        m = engine.m
        if m.storage is not None:
            m.storage.wait_idle(5)
        if m.allocate(r, m.num_tokens(r) - m.lookup(r).total) is not None:
            engine.wait_ready(r)

    def _register(self, family: bool, tail: int, length: int) -> int | None:
        if len(self.p._seqs) >= 3:
            return None
        r = self.next
        self.next += 1
        self.tokens[r] = (SYSTEM if family else []) + [1000 * tail + i for i in range(length)]
        self.p.add_sequence(r, self.tokens[r])
        self._admit(self.ep, r)
        return r

    @rule(family=st.booleans(), tail=st.integers(0, 3), length=st.integers(1, 12))
    def admit_on_prefill(self, family: bool, tail: int, length: int) -> None:
        self._register(family, tail, length)

    @rule(family=st.booleans(), tail=st.integers(0, 3), length=st.integers(1, 12))
    def serve_on_prefill(self, family: bool, tail: int, length: int) -> None:
        """A whole prefill in one go: admit, settle the copies, compute, commit, hand off."""
        r = self._register(family, tail, length)
        if r is None:
            return
        p, n = self.p, len(self.tokens[r])
        if not p.is_admitted(r) or (
            len(p.block_table(r)) * B < n and p.allocate(r, n - p.num_computed_tokens(r)) is None
        ):
            p.free(r)
            self.ep.step()
            return
        self.ep.step()
        self.ep.check_sequence(r)
        self.ep.compute(r, n)
        p.commit(r, n)
        self.handoffs[r] = p.finish_prefill(r)

    @rule(data=st.data())
    def abandon_handoff(self, data) -> None:
        """The decode side gave up before accepting: the prefill node frees the blocks into its cache."""
        r = self._pick(data, self.handoffs)
        if r is not None:
            del self.handoffs[r]
            self.p.transfer_done(r)
            self.ep.step()

    @rule(data=st.data())
    def prefill_step(self, data) -> None:
        p, ep = self.p, self.ep
        r = self._pick(data, [r for r in p._seqs if not p.is_transferring(r)])
        if r is None:
            return
        n = len(self.tokens[r])
        if not p.is_admitted(r):
            self._admit(ep, r)
        elif data.draw(st.booleans()):
            p.preempt(r)
            ep.step()
        else:
            if len(p.block_table(r)) * B < n and p.allocate(r, n - p.num_computed_tokens(r)) is None:
                return
            ep.step()
            ep.compute(r, n)
            p.commit(r, n)
            self.handoffs[r] = p.finish_prefill(r)

    @rule(data=st.data())
    def accept(self, data) -> None:
        r = self._pick(data, self.handoffs)
        if r is None:
            return
        admission = self.d.accept_handoff(PrefillHandoff.from_bytes(self.handoffs[r].to_bytes()), self.tokens[r])
        if admission is None and self.decoding and data.draw(st.booleans()):
            self._finish(min(self.decoding))  # the decode node makes room, as an engine would, and retries
            admission = self.d.accept_handoff(self.handoffs[r], self.tokens[r])
        if admission is None:
            return
        del self.handoffs[r]
        self.ed.step()  # evictions for the new blocks are copied out before the KV lands in them
        self.moving[r] = admission.transfers
        self.reported[r] = admission.cached.total

    @rule(data=st.data())
    def transfer(self, data) -> None:
        r = self._pick(data, self.moving)
        if r is None:
            return
        ok = data.draw(st.booleans()) or data.draw(st.booleans())
        if ok:
            move(self.ep, self.ed, self.moving.pop(r))
        else:
            for _, target in self.moving.pop(r):
                self.ed.device[target] = GARBAGE
        self.d.receive_done(r, ok=ok)
        self.p.transfer_done(r)
        self.ep.step()
        if ok:
            self.decoding.add(r)
            self.ed.check_sequence(r)
        else:
            del self.reported[r]

    @rule(data=st.data())
    def decode_step(self, data) -> None:
        """One decode step of a running sequence, or its re-admission after a preemption."""
        r = self._pick(data, self.decoding)
        if r is None:
            return
        d, ed = self.d, self.ed
        if not d.is_admitted(r):
            if not self._resume(r):
                return
        else:
            d.append_tokens(r, [7])
            if d.allocate(r, 1) is None:
                d.preempt(r)
                ed.step()
                return
        ed.step()
        ed.compute(r, d.num_tokens(r))
        d.commit(r, d.num_tokens(r))

    def _resume(self, r: int) -> bool:
        """Re-admit a preempted decoding sequence (its cached prefix may come back from host or storage)."""
        d, ed = self.d, self.ed
        self._admit(ed, r)
        if not d.is_admitted(r):
            return False
        n = d.num_tokens(r)
        if len(d.block_table(r)) * B < n and d.allocate(r, n - d.num_computed_tokens(r)) is None:
            d.preempt(r)
            ed.step()
            return False
        return True

    @rule(data=st.data())
    def decode_preempt_evict_resume(self, data) -> None:
        """Preempt, let other work take every free block (evicting the sequence's), then resume it."""
        d, ed = self.d, self.ed
        r = self._pick(data, [r for r in self.decoding if d.is_admitted(r)])
        if r is None:
            return
        d.preempt(r)
        ed.step()
        filler = f"filler-{self.next}"
        self.next += 1
        d.add_sequence(filler, [90_000 + 100 * self.next + i for i in range(B * d.pool.num_free)])
        if d.pool.num_free:
            assert d.allocate(filler, B * d.pool.num_free) is not None
            ed.step()  # write-backs / saves of what the filler evicted
        d.free(filler)
        ed.step()
        if self._resume(r):
            ed.step()
            ed.compute(r, d.num_tokens(r))
            d.commit(r, d.num_tokens(r))

    @rule(data=st.data())
    def decode_preempt(self, data) -> None:
        r = self._pick(data, [r for r in self.decoding if self.d.is_admitted(r)])
        if r is not None:
            self.d.preempt(r)
            self.ed.step()

    def _finish(self, r: int) -> None:
        assert self.d.usage(r).cached_tokens == self.reported.pop(r)  # frozen since the handoff
        self.d.free(r)
        self.decoding.discard(r)
        self.ed.step()

    @rule(data=st.data())
    def decode_finish(self, data) -> None:
        r = self._pick(data, self.decoding)
        if r is not None:
            self._finish(r)

    @precondition(lambda self: hasattr(self, "p"))
    @invariant()
    def consistent(self) -> None:
        for m, engine in ((self.p, self.ep), (self.d, self.ed)):
            m.check_integrity()
            engine.check_cached()
        for r, handoff in self.handoffs.items():
            assert self.p.is_transferring(r)
            assert all(self.p.pool.ref_count(b) >= 1 for b in handoff.source_blocks)
            assert 0 <= handoff.cached.total < len(self.tokens[r])
        for r in self.moving:
            assert self.p.is_transferring(r) and self.d.is_receiving(r)
        for r in self.decoding:
            if self.d.is_admitted(r) and self.d.is_ready(r):
                self.ed.check_sequence(r)
        for r in self.reported:
            assert 0 <= self.d.usage(r).cached_tokens <= len(self.tokens[r])


TieredDisaggMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tiered_disagg_state_machine = TieredDisaggMachine.TestCase


@pytest.mark.parametrize("save_on_preempt", [False, True])
def test_a_preempted_decode_sequence_comes_back_from_storage(closing, save_on_preempt: bool) -> None:
    """Decode node without a host tier: evicted (or, with save_on_preempt, snapshotted) blocks reload."""
    p = PrefillManager(16, B)
    d = TieredDecodeManager(
        5, B, tiers=tiers(storage=MemoryStorage(), save_on_preempt=save_on_preempt), reserve_blocks_per_sequence=0
    )
    closing.append(d)
    ed = SimEngine(d, settle=True)
    tokens = prompt(1, 4)  # 16 tokens: 4 full blocks
    p.add_sequence("a", tokens)
    p.allocate("a", 16)
    p.commit("a", 16)
    handoff = p.finish_prefill("a")
    admission = d.accept_handoff(handoff, tokens)
    assert admission is not None
    ed.step()
    for (_, target), block_hash in zip(admission.transfers, handoff.block_hashes, strict=True):
        ed.device[target] = content_of(block_hash)
    d.receive_done("a")
    d.preempt("a")
    ed.step()
    d.add_sequence("filler", list(range(7000, 7000 + 4 * d.pool.num_free)))
    assert d.allocate("filler", 4 * d.pool.num_free) is not None  # takes every block, a's included
    ed.step()
    d.free("filler")
    ed.step()
    assert d.lookup("a") == CachedTokens(storage=12, num_prompt_tokens=16)  # the last block: recomputed
    assert d.allocate("a", 4) is not None
    ed.wait_ready("a")
    ed.check_sequence("a")
    assert d.num_computed_tokens("a") == 12 and d.stats.readmission_hit_tokens_storage == 12
    d.check_integrity()
