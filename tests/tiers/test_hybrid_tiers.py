"""TieredHybridKVCacheManager: host tiers under a hybrid manager's local groups.

Exact scenarios (a window group's evicted blocks come back from its host tier; a hit served from host in
one group and device in another; refusals change nothing; a failed copy cuts the hit back), then a
state machine whose shadow caches hold, per group, the hash each device and host block was filled for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator, Sequence

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvblocks.accounting import CachedTokens
from kvblocks.errors import ConfigError, InvalidArgumentError, StaleLookupError
from kvblocks.hybrid import PLACEHOLDER, LocalGroup, RecurrentGroup, TieredHybridKVCacheManager
from kvblocks.tiers import BlockSave, EntryFormat, FileStorage, LoadResult, MemoryStorage, TierConfig, TransferPlan

B = 4
A = list(range(17))
OTHER = list(range(100, 117))
P = PLACEHOLDER


def make(
    full: int = 20, local: int = 5, *, host: int = 8, group_host: int = 8, span: int = 6, policy: str = "write-back"
) -> TieredHybridKVCacheManager:
    return TieredHybridKVCacheManager(
        full,
        B,
        tiers=TierConfig(num_host_blocks=host, host_policy=policy, group_host_blocks=(group_host,)),
        local_groups=[LocalGroup("sliding_window", span=span, num_blocks=local)],
    )


def hashes_of(m: TieredHybridKVCacheManager, tokens: list[int]) -> tuple[object, ...]:
    m.add_sequence("_probe", tokens)
    hashes = m.block_hashes("_probe")
    m.free("_probe")
    return hashes


def run(m: TieredHybridKVCacheManager, seq_id: Hashable, tokens: list[int], *, keep: bool = False) -> None:
    """Compute and commit a whole prompt (then free it unless ``keep``); the plan it made is completed."""
    m.add_sequence(seq_id, tokens)
    assert m.allocate(seq_id, len(tokens)) is not None
    m.complete_transfers(m.take_transfers())
    m.commit(seq_id, len(tokens))
    if not keep:
        m.free(seq_id)


def flood(m: TieredHybridKVCacheManager, seq_id: Hashable = "b") -> None:
    """An uncommitted 17-token sequence that takes 5 blocks of each group, then leaves (its blocks go fresh)."""
    m.add_sequence(seq_id, OTHER)
    assert m.allocate(seq_id, 17) is not None
    m.complete_transfers(m.take_transfers())
    m.free(seq_id)


def test_a_window_groups_evicted_blocks_swap_out_and_come_back_on_a_hit_that_needs_them() -> None:
    m = make(full=5, local=5)
    run(m, "a", A)
    local = m.group_pool(1)
    ha = hashes_of(m, A)
    window_blocks = [m._locals[0].index.block_of(h) for h in ha[2:4]]  # the window at 16 needs positions 2, 3
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None
    plan = m.take_transfers()
    host1 = m.group_host(1)
    assert host1 is not None
    # positions 0..2 left the window at a's commit, 3 at its free: every one of them was evicted and written back
    assert len(plan.groups[0].swap_outs) == 4 and len(plan.swap_outs) == 4
    outs = dict(plan.groups[0].swap_outs)
    m.complete_transfers(plan)
    m.free("b")
    host_of = [host1.block_of(h) for h in ha[2:4]]
    assert host_of == [outs[window_blocks[0]], outs[window_blocks[1]]]  # each hash where its block was copied
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(host=16, num_prompt_tokens=17)
    table = m.allocate("c", 1, num_cached_tokens=16)
    assert table is not None and not m.is_ready("c")
    plan = m.take_transfers()
    local_table = m.group_block_table("c", 1)
    assert local_table[:2] == [P, P] and len(local_table) == 5
    assert plan.groups[0].swap_ins == ((host_of[0], local_table[2]), (host_of[1], local_table[3]))
    assert all(host1.pool.ref_count(h) == 1 for h in host_of)  # held by the swap-ins
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.is_ready("c") and m.num_computed_tokens("c") == 16
    assert [m._locals[0].index.block_of(h) for h in ha[2:4]] == local_table[2:4]  # findable once landed
    assert local.ref_count(local_table[2]) == 1 and all(host1.pool.ref_count(h) == 0 for h in host_of)
    m.commit("c", 17)
    m.check_integrity()


def test_a_hit_from_host_in_the_window_group_and_device_in_the_full_group() -> None:
    m = make(full=20, local=5)  # only the local group is short of blocks
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(device=16, num_prompt_tokens=17)  # group 0's split of the common hit
    table = m.allocate("c", 1)
    plan = m.take_transfers()
    assert table is not None and table.num_cached_tokens == 16
    assert plan.swap_ins == () and len(plan.groups[0].swap_ins) == 2
    assert not m.is_ready("c") and m.num_computed_tokens("c") == 16  # group 0's prefix is on device already
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.is_ready("c") and m.stats.hit_tokens_device >= 16
    m.commit("c", 17)
    m.check_integrity()


def test_a_hit_from_host_in_the_full_group_and_device_in_the_window_group() -> None:
    m = make(full=5, local=20)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(host=16, num_prompt_tokens=17)
    assert m.allocate("c", 1) is not None
    plan = m.take_transfers()
    assert len(plan.swap_ins) == 4 and plan.groups[0].swap_ins == ()
    m.complete_transfers(plan)
    assert m.num_computed_tokens("c") == 16
    m.check_integrity()


def snapshot(m: TieredHybridKVCacheManager) -> object:
    groups = []
    for g in range(m.num_groups):
        pool = m.group_pool(g)
        host = m.group_host(g)
        groups.append(
            (
                [pool.ref_count(b) for b in range(pool.num_blocks)],
                pool.num_free,
                [host.pool.ref_count(b) for b in range(host.pool.num_blocks)] if host else None,
                len(host) if host else 0,
            )
        )
    return groups, m.num_pending_admissions


def test_a_refusal_in_any_group_changes_nothing_in_any_group() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("hog", OTHER[:9])
    assert m.allocate("hog", 9) is not None  # holds 3 of the 5 local blocks
    m.complete_transfers(m.take_transfers())
    m.add_sequence("c", A)
    assert m.blocks_short("c", 1) == 1  # two swap-in targets and one new block, two free
    before = snapshot(m)
    assert m.allocate("c", 1) is None
    assert snapshot(m) == before and not m.take_transfers()
    # a named hit a group no longer serves: refused before anything changes
    m.add_sequence("d", A[:13])
    m.group_host(1).clear()  # the window blocks are gone from the local group everywhere
    assert m.lookup("d").total == 0
    before = snapshot(m)
    with pytest.raises(StaleLookupError):
        m.allocate("d", 1, num_cached_tokens=12)
    assert snapshot(m) == before
    m.check_integrity()


def test_a_failed_swap_in_in_the_window_group_cuts_the_hit_back_to_what_every_group_got() -> None:
    m = make(full=20, local=5, span=64)  # the window covers the whole prompt: every position is needed
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(device=16, num_prompt_tokens=17)
    full_table = m.allocate("c", 1)
    assert full_table is not None
    full_table = list(full_table)
    plan = m.take_transfers()
    local_table = m.group_block_table("c", 1)
    ins = {d for _, d in plan.groups[0].swap_ins}
    failed = local_table[2]  # position 2's copy fails: a hit at 8 still has positions 0, 1
    assert failed in ins
    m.complete_transfers(plan, failed_group_swap_ins={1: [failed]})
    assert m.is_ready("c") and m.num_computed_tokens("c") == 8
    assert list(m.block_table("c")) == full_table[:2]
    assert m.group_block_table("c", 1) == local_table[:2]
    assert m.group_pool(1).ref_count(failed) == 0 and m.group_pool(1).ref_count(local_table[3]) == 0
    assert m.stats.hit_tokens_device == 8  # what the admission took, counted once
    m.check_integrity()
    assert m.allocate("c", 9) is not None  # the rest is computed
    m.commit("c", 17)
    m.check_integrity()


def test_a_failed_swap_in_of_a_sliding_window_can_cut_the_hit_to_nothing() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.allocate("c", 1) is not None
    plan = m.take_transfers()
    free0 = m.num_free_blocks
    m.complete_transfers(plan, failed_group_swap_ins={1: [m.group_block_table("c", 1)[3]]})
    assert m.num_computed_tokens("c") == 0 and list(m.block_table("c")) == [] and m.group_block_table("c", 1) == []
    assert m.num_free_blocks == free0 + 5
    m.check_integrity()
    m.add_sequence("d", A)
    assert m.lookup("d").total == 16  # group 0 still holds the run; the local group's position 2 is on host


def test_bad_completions_are_refused_before_anything_changes() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.allocate("c", 1) is not None
    plan = m.take_transfers()
    before = snapshot(m)
    for bad in ({2: [0]}, {1: [99]}, {True: [0]}, [1]):
        with pytest.raises(InvalidArgumentError):
            m.complete_transfers(plan, failed_group_swap_ins=bad)  # type: ignore[arg-type]
    for bad in ({2: [0]}, {1: [99]}, {True: [0]}, {0: [99]}, {-1: []}):  # the per-group form, group 0 included
        with pytest.raises(InvalidArgumentError):
            m.complete_transfers(plan, failed_swap_ins=bad)  # type: ignore[arg-type]
    ins = {d for _, d in plan.group_transfers[1].swap_ins}
    with pytest.raises(InvalidArgumentError, match="in one mapping"):  # both forms at once: which one holds?
        m.complete_transfers(plan, failed_swap_ins={1: ins}, failed_group_swap_ins={1: ins})
    assert snapshot(m) == before
    m.complete_transfers(plan)
    assert m.is_ready("c")


def test_freeing_a_sequence_whose_window_copies_are_in_flight_holds_their_blocks_until_the_plan_completes() -> None:
    m = make(full=20, local=5)
    run(m, "a", A)
    flood(m)
    m.add_sequence("c", A)
    assert m.allocate("c", 1) is not None
    local_table = m.group_block_table("c", 1)
    plan = m.take_transfers()
    m.free("c")
    assert all(m.group_pool(1).ref_count(b) == 1 for b in local_table[2:])
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.group_pool(1).num_free == 5
    m.check_integrity()
    # freed before the plan was taken: its swap-ins leave the plan
    m.add_sequence("d", A)
    assert m.allocate("d", 1) is not None
    m.free("d")
    assert not m.take_transfers().groups[0]
    m.check_integrity()


def test_write_through_copies_a_window_groups_blocks_to_host_on_commit() -> None:
    m = make(full=20, local=5, policy="write-through")
    run(m, "a", A, keep=True)
    plan = m.take_transfers()
    assert len(plan.groups[0].swap_outs) == 4 and len(plan.swap_outs) == 4
    m.complete_transfers(plan)
    host = m.group_host(1)
    assert host is not None and all(host.block_of(h) is not None for h in hashes_of(m, A))


def test_the_single_cache_executor_refuses_a_hybrid_manager() -> None:
    pytest.importorskip("torch")
    from kvblocks.tiers.executor import TransferExecutor

    with pytest.raises(ConfigError):
        TransferExecutor(make(), None, None)  # type: ignore[arg-type]


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        TierConfig(group_host_blocks=(4, -1))
    with pytest.raises(ConfigError):
        TierConfig(group_host_blocks="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TieredHybridKVCacheManager(
            8, B, tiers=TierConfig(group_host_blocks=(4, 4)), local_groups=[LocalGroup("sliding_window", 6, 8)]
        )
    with pytest.raises(ConfigError):
        TieredHybridKVCacheManager(
            8,
            B,
            tiers=TierConfig(num_host_blocks=4),
            local_groups=[LocalGroup("sliding_window", 6, 8)],
            recurrent_groups=[RecurrentGroup(num_slots=2, num_checkpoints=2)],
        )


# ---------------------------------------------------------------- the state machine

BASES = [list(range(1000 * i, 1000 * i + 40)) for i in range(2)]
SIZES = (4, 4, 8)  # group block sizes: full, sliding window 6, chunked local 16 of 8-token blocks
GARBAGE = "garbage"


class HybridTiersMachine(RuleBasedStateMachine):
    """Scheduling calls, plans run in order (with failed copies), commits; a shadow of every block's content."""

    HOSTS = (8, 6, 4)  # host blocks per group

    def tiers(self) -> TierConfig:
        return TierConfig(num_host_blocks=self.HOSTS[0], group_host_blocks=self.HOSTS[1:])

    def __init__(self) -> None:
        super().__init__()
        self.m = TieredHybridKVCacheManager(
            14,
            B,
            tiers=self.tiers(),
            local_groups=[
                LocalGroup("sliding_window", span=6, num_blocks=10),
                LocalGroup("chunked_local", span=16, num_blocks=6, block_size=8),
            ],
        )
        self.device: list[list[object]] = [[None] * n for n in (14, 10, 6)]
        self.host: list[list[object]] = [[None] * n for n in self.HOSTS]
        self.plan: object = None
        self.scheduled = False  # scheduling calls since the last plan was taken: a forward pass waits for it
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.all_keys = [set(), set(), set()]  # type: ignore[var-annotated]
        for base in BASES:
            hashes = hashes_of(self.m, base)
            for g in range(3):
                self.all_keys[g].update(self.keys(g, hashes))

    @staticmethod
    def keys(g: int, hashes: Sequence[object]) -> list[object]:
        r = SIZES[g] // B
        return [hashes[(p + 1) * r - 1] for p in range(len(hashes) // r)]

    def admitted(self, ready: bool) -> list[int]:
        m = self.m
        return sorted(s for s in self.tokens if m.is_admitted(s) and (m.is_ready(s) or not ready))

    def _admit(self, seq: int, lookahead: int) -> None:
        m = self.m
        self.scheduled = True
        cached = m.lookup(seq)
        length = len(self.tokens[seq])
        table = m.allocate(seq, length - cached.total, num_lookahead_tokens=lookahead, num_cached_tokens=cached.total)
        if table is not None:
            assert table.num_cached_tokens == cached.total and m.num_computed_tokens(seq) == cached.device

    @rule(base=st.integers(0, 1), length=st.sampled_from([9, 17, 21, 25, 33]), lookahead=st.integers(0, 2))
    def add(self, base: int, length: int, lookahead: int) -> None:
        seq = self.next_id
        self.next_id += 1
        self.tokens[seq] = BASES[base][:length]
        self.m.add_sequence(seq, self.tokens[seq])
        self._admit(seq, lookahead)

    @rule(base=st.integers(0, 1), length=st.sampled_from([9, 17, 21, 25, 33]), data=st.data())
    def request(self, base: int, length: int, data: st.DataObject) -> None:
        """A whole request: admitted, its plan run, computed to its end in up to three steps, freed."""
        self.add(base, length, 0)
        seq = self.next_id - 1
        for _ in range(3):
            if not self.m.is_admitted(seq):
                break
            self.step(data, 1)
        if self.m.is_admitted(seq) and self.plan is None:
            self.m.free(seq)
            del self.tokens[seq]

    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        waiting = sorted(s for s in self.tokens if not self.m.is_admitted(s))
        if waiting:
            self._admit(data.draw(st.sampled_from(waiting)), 0)

    @rule(data=st.data(), preempt=st.booleans())
    def leave(self, data: st.DataObject, preempt: bool) -> None:
        seqs = self.admitted(ready=False)
        if not seqs:
            return
        seq = data.draw(st.sampled_from(seqs))
        self.scheduled = True
        if preempt:
            self.m.preempt(seq)
        else:
            self.m.free(seq)
            del self.tokens[seq]

    @rule(data=st.data(), in_flight=st.integers(0, 3))
    def step(self, data: st.DataObject, in_flight: int) -> None:
        """Finish the plan in flight, take this step's plan; run it now (then forward passes) or leave it in flight."""
        if self.plan is not None:
            self._complete(data)
        self.plan = self.m.take_transfers()
        self.scheduled = False
        if in_flight == 0:
            return  # in flight while the next scheduling calls come
        self._complete(data)
        for seq in self.admitted(ready=True):
            if not self.scheduled:
                self._compute(seq, data)

    def _complete(self, data: st.DataObject) -> None:
        plan, self.plan = self.plan, None
        moves = [(t.group, t.swap_outs, t.swap_ins) for t in plan.group_transfers]  # type: ignore[attr-defined]
        assert [g for g, _, _ in moves] == [0, 1, 2]
        failed_in: dict[int, set[int]] = {}
        failed_out: dict[int, set[int]] = {}
        for g, outs, ins in moves:
            failing = data.draw(st.integers(0, 4)) == 0
            failed_out[g] = data.draw(st.sets(st.sampled_from([h for _, h in outs]))) if outs and failing else set()
            failed_in[g] = data.draw(st.sets(st.sampled_from([d for _, d in ins]))) if ins and failing else set()
            for d, h in outs:
                self.host[g][h] = GARBAGE if h in failed_out[g] else self.device[g][d]
        for g, _, ins in moves:
            for h, d in ins:
                self.device[g][d] = GARBAGE if d in failed_in[g] else self.host[g][h]
        self.m.complete_transfers(
            plan,  # type: ignore[arg-type]
            failed_swap_ins=failed_in,  # per group, group 0 included
            failed_swap_outs=failed_out,
        )

    def _compute(self, seq: int, data: st.DataObject) -> None:
        """A forward pass of a ready sequence (after the step's plan ran), then its commit."""
        m = self.m
        length = len(self.tokens[seq])
        if m.num_allocated_tokens(seq) < length:  # cut back by a failed copy: allocate the rest again
            m.allocate(seq, length - m.num_allocated_tokens(seq))
            self.scheduled = True  # computed in a later step, after the plan this growth added to
            return
        done = m.num_computed_tokens(seq)
        top = min(length, m.num_allocated_tokens(seq))
        if top <= done:
            return
        n = top if data.draw(st.integers(0, 3)) else data.draw(st.integers(done + 1, top))
        hashes = m.block_hashes(seq)
        for g in range(3):
            size = SIZES[g]
            table = m.group_block_table(seq, g)
            keys = self.keys(g, hashes)
            for p in range(done // size, -(-n // size)):
                assert table[p] != PLACEHOLDER  # every block a computed token writes is held
                self.device[g][table[p]] = keys[p] if (p + 1) * size <= n else ("partial", seq)
        m.commit(seq, n)

    @invariant()
    def consistent(self) -> None:
        m = self.m
        m.check_integrity()
        for seq in self.admitted(ready=True):
            hashes = m.block_hashes(seq)
            done = m.num_computed_tokens(seq)
            for g in range(3):
                keys = self.keys(g, hashes)
                for p, b in enumerate(m.group_block_table(seq, g)[: done // SIZES[g]]):
                    if b != PLACEHOLDER:
                        assert self.device[g][b] == keys[p], (seq, g, p)
        for g in range(3):
            host = m.group_host(g) if self.HOSTS[g] else None
            for key in self.all_keys[g]:
                b = m.tree.block_of(key) if g == 0 else m._locals[g - 1].index.block_of(key)  # type: ignore[arg-type]
                if b is not None:
                    assert self.device[g][b] == key, ("device", g, b)
                h = host.block_of(key) if host is not None else None  # type: ignore[arg-type]
                if h is not None:
                    assert self.host[g][h] == key, ("host", g, h)


TestHybridTiersMachine = HybridTiersMachine.TestCase
TestHybridTiersMachine.settings = settings(max_examples=180, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- storage for the local groups

PAYLOAD = 16
FORMATS = tuple(EntryFormat("xxh3-128", "uint8", (PAYLOAD,), g, PAYLOAD) for g in range(3))  # one spec per group
TWO_LOCALS = (LocalGroup("sliding_window", span=6, num_blocks=5), LocalGroup("chunked_local", 16, 3, block_size=8))


def kv(group: int, key: object) -> bytes:
    """The KV a block of ``group`` ending at chain hash ``key`` holds: another group's differs."""
    raw = key if isinstance(key, bytes) else str(key).encode()
    return xxhash.xxh3_128_digest(bytes([group]) + raw)[:PAYLOAD]


class HybridSim:
    """Runs a tiered hybrid manager as an engine does, with every group's device and host memories."""

    def __init__(self, m: TieredHybridKVCacheManager) -> None:
        self.m = m
        self.device: list[dict[int, bytes]] = [{} for _ in range(m.num_groups)]
        self.host: list[dict[int, bytes]] = [{} for _ in range(m.num_groups)]
        self.results: list[LoadResult] = []

    def _read(self, g: int, save: BlockSave) -> bytes:
        return self.device[g].get(save.block, b"?" * PAYLOAD) if save.tier == "device" else self.host[g][save.block]

    def run_plan(self, *, payloads: bool = True) -> TransferPlan:
        m = self.m
        plan = m.take_transfers()
        moves = [(0, plan.saves, plan.swap_outs, plan.swap_ins)]
        moves += [(t.group, t.saves, t.swap_outs, t.swap_ins) for t in plan.groups]
        saved = {g: [self._read(g, s) for s in saves] for g, saves, _, _ in moves}
        for g, _, outs, ins in moves:
            for d, h in outs:
                self.host[g][h] = self.device[g].get(d, b"?")
            for h, d in ins:
                self.device[g][d] = self.host[g][h]
        m.complete_transfers(
            plan,
            saved=saved[0] if payloads and plan.saves else None,
            saved_groups={g: saved[g] for g in saved if g} if payloads else None,
        )
        return plan

    def poll(self) -> list[LoadResult]:
        results = self.m.poll_loads()
        for r in results:
            for block, parts in zip(r.blocks, r.payloads, strict=True):
                self.device[r.group][block] = bytes(parts[0])
        self.results += results
        return results

    def wait_ready(self, seq_id: Hashable) -> None:
        deadline = time.monotonic() + 5
        while not self.m.is_ready(seq_id):
            self.run_plan()
            self.poll()
            assert time.monotonic() < deadline, f"{seq_id!r} never became ready"
            time.sleep(0.001)

    def compute(self, seq_id: Hashable, upto: int) -> None:
        """The forward pass: every group writes the KV of its held positions from the computed line to ``upto``."""
        m = self.m
        hashes = m.block_hashes(seq_id)
        done = m.num_computed_tokens(seq_id)
        for g in range(m.num_groups):
            size = SIZES[g] if g < len(SIZES) else B
            table = m.group_block_table(seq_id, g)
            keys = keys_of(size, hashes)
            for p in range(done // size, upto // size):
                if table[p] != PLACEHOLDER:
                    self.device[g][table[p]] = kv(g, keys[p])
        m.commit(seq_id, upto)

    def serve(self, seq_id: Hashable, tokens: list[int]) -> None:
        """Admit (loading what is cached), compute and commit a whole prompt, run the plan, free it."""
        m = self.m
        m.add_sequence(seq_id, tokens)
        cached = m.lookup(seq_id)
        assert m.allocate(seq_id, len(tokens) - cached.total) is not None
        self.wait_ready(seq_id)
        if m.num_allocated_tokens(seq_id) < len(tokens):
            assert m.allocate(seq_id, len(tokens) - m.num_allocated_tokens(seq_id)) is not None
            self.run_plan()
        self.check(seq_id)
        self.compute(seq_id, len(tokens))
        m.free(seq_id)
        self.run_plan()

    def check(self, seq_id: Hashable) -> None:
        """Every held block below the computed line holds its own group's KV of its own prefix."""
        m = self.m
        hashes = m.block_hashes(seq_id)
        done = m.num_computed_tokens(seq_id)
        for g in range(m.num_groups):
            size = SIZES[g] if g < len(SIZES) else B
            keys = keys_of(size, hashes)
            for p, b in enumerate(m.group_block_table(seq_id, g)[: done // size]):
                if b != PLACEHOLDER:
                    assert self.device[g].get(b) == kv(g, keys[p]), (seq_id, g, p)


def keys_of(size: int, hashes: Sequence[object]) -> list[object]:
    r = size // B
    return [hashes[(p + 1) * r - 1] for p in range(len(hashes) // r)]


def make_stored(
    storage: object, *, locals_: Sequence[LocalGroup] = TWO_LOCALS, policy: str = "write-back", full: int = 5
) -> TieredHybridKVCacheManager:
    return TieredHybridKVCacheManager(
        full,
        B,
        tiers=TierConfig(
            storage=storage,  # type: ignore[arg-type]
            entry_format=FORMATS[0],
            group_entry_formats=FORMATS[1 : 1 + len(locals_)],
            storage_policy=policy,
        ),
        local_groups=locals_,
    )


@pytest.fixture
def closing() -> Iterator[list[TieredHybridKVCacheManager]]:
    made: list[TieredHybridKVCacheManager] = []
    yield made
    for m in made:
        m.close(timeout=1)


def test_evicted_local_blocks_are_saved_under_their_groups_own_keys_and_loaded_back(closing) -> None:
    storage = MemoryStorage()
    m = make_stored(storage)
    closing.append(m)
    sim = HybridSim(m)
    sim.serve("a", A)
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None  # evicts a's blocks in every group: write-back to storage
    plan = sim.run_plan()
    assert [len(plan.saves)] + [len(t.saves) for t in plan.groups] == [4, 4, 2]
    assert all(s.tier == "device" for t in plan.groups for s in t.saves)
    m.free("b")
    assert m.flush(5) and len(storage) == 10
    ha = hashes_of(m, A)
    key0, key1, key2 = (m.group_storage(g).keys_of(ha[3]) for g in range(3))  # type: ignore[union-attr]
    assert len({key0[0], key1[0], key2[0]}) == 3  # one key space per group
    assert storage.get(key1) == [FORMATS[1].encode(kv(1, ha[3]), key1[0])]  # group 1's KV, header and key
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(storage=16, num_prompt_tokens=17)
    assert m.allocate("c", 1) is not None and not m.is_ready("c")
    tables = [m.group_block_table("c", g) for g in range(3)]
    sim.wait_ready("c")
    by_group = {r.group: r for r in sim.results}
    assert by_group[0].blocks == tuple(tables[0][:4])
    assert by_group[1].blocks == tuple(tables[1][2:4]) and by_group[1].complete  # the window at 16: positions 2, 3
    assert 2 not in by_group and tables[2][:2] == [P, P]  # a chunk starts at 16: group 2 needs none of its blocks
    assert m.num_computed_tokens("c") == 16 and m.stats.hit_tokens_storage == 16
    sim.check("c")
    m.check_integrity()
    sim.compute("c", 17)
    m.check_integrity()


def test_a_new_manager_on_the_same_directory_gets_storage_hits_in_every_group(tmp_path, closing) -> None:
    prompt = list(range(25))  # a hit at 24: the window needs positions 4, 5; the chunk from 16 group block 2
    roomy = (LocalGroup("sliding_window", span=6, num_blocks=10), LocalGroup("chunked_local", 16, 6, block_size=8))
    first = make_stored(FileStorage(tmp_path), locals_=roomy, policy="write-through", full=20)
    sim = HybridSim(first)
    sim.serve("a", prompt)
    assert first.flush(5)
    first.close()
    m = make_stored(FileStorage(tmp_path), locals_=roomy, policy="write-through", full=20)
    closing.append(m)
    m.add_sequence("c", prompt)
    deadline = time.monotonic() + 5
    while m.is_storage_check_pending("c"):  # the probes of every group's storage, off-thread
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert m.lookup("c") == CachedTokens(storage=24, num_prompt_tokens=25)
    assert m.allocate("c", 1) is not None
    sim = HybridSim(m)
    sim.wait_ready("c")
    assert sorted((r.group, len(r.blocks), r.requested) for r in sim.results) == [(0, 6, 6), (1, 2, 2), (2, 1, 1)]
    assert m.num_computed_tokens("c") == 24
    sim.check("c")
    m.check_integrity()


def test_a_storage_hit_stops_where_a_local_groups_own_storage_lacks_its_window(closing) -> None:
    storage = MemoryStorage()
    m = make_stored(storage, policy="write-through", full=20)
    closing.append(m)
    sim = HybridSim(m)
    sim.serve("a", A)
    assert m.flush(5)
    storage.delete(m.group_storage(1).keys_of(hashes_of(m, A)[3]))  # type: ignore[union-attr]  # 4-token blocks
    m2 = make_stored(storage, policy="off", full=20)  # a fresh index, the same store
    closing.append(m2)
    m2.add_sequence("c", A)
    deadline = time.monotonic() + 5
    while m2.is_storage_check_pending("c"):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert m2.lookup("c") == CachedTokens(storage=8, num_prompt_tokens=17)  # the window at 16 needs position 3


def test_a_short_local_load_cuts_the_hit_back_to_what_every_group_got(closing) -> None:
    storage = MemoryStorage()
    wide = (LocalGroup("sliding_window", span=64, num_blocks=5),)  # every position is in the window
    m = make_stored(storage, locals_=wide)
    closing.append(m)
    sim = HybridSim(m)
    sim.serve("a", A)
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None
    sim.run_plan()
    m.free("b")
    assert m.flush(5)
    m.add_sequence("c", A)
    key = m.group_storage(1).keys_of(m.block_hashes("c")[2])  # type: ignore[union-attr]
    storage.delete(key)  # the index does not know yet: position 2 of group 1 is a miss when read
    assert m.lookup("c") == CachedTokens(storage=16, num_prompt_tokens=17)
    assert m.allocate("c", 1) is not None
    tables = [m.group_block_table("c", g) for g in range(2)]
    sim.wait_ready("c")
    (local,) = [r for r in sim.results if r.group == 1]
    assert local.blocks == tuple(tables[1][:2]) and local.requested == 4 and not local.complete
    assert m.num_computed_tokens("c") == 8
    assert list(m.block_table("c")) == tables[0][:2] and m.group_block_table("c", 1) == tables[1][:2]
    assert m.group_pool(1).num_free == 3 and m.stats.hit_tokens_storage == 8
    m.check_integrity()
    assert m.allocate("c", 9) is not None
    sim.run_plan()
    sim.compute("c", 17)
    sim.check("c")
    m.check_integrity()


def test_a_freed_sequences_local_loads_are_dropped_and_its_blocks_go_back(closing) -> None:
    storage = MemoryStorage()
    m = make_stored(storage, full=20)
    closing.append(m)
    sim = HybridSim(m)
    sim.serve("a", A)
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None  # evicts the local groups' blocks only
    sim.run_plan()
    m.free("b")
    assert m.flush(5)
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(device=16, num_prompt_tokens=17)  # group 0 on device, group 1 stored
    assert m.allocate("c", 1) is not None and not m.is_ready("c") and m.num_pending_loads == 1
    m.check_integrity()
    m.free("c")
    assert m.num_pending_loads == 0 and m.group_pool(1).num_free == 5 and m.group_pool(2).num_free == 3
    sim.run_plan()
    m.group_storage(1).wait_idle(5)  # type: ignore[union-attr]
    m.group_storage(2).wait_idle(5)  # type: ignore[union-attr]
    assert sim.poll() == []
    m.check_integrity()


class StuckStorage(MemoryStorage):
    """Reads of keys under ``stuck_tag`` wait until ``gate`` opens (a backend that stopped answering)."""

    stuck_tag = ""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if any(key.split(".")[1] == self.stuck_tag for key in keys):
            self.gate.wait(5)
        return super().get(keys)


def test_a_local_load_that_outlives_its_timeout_is_a_miss_and_stops_that_groups_storage_hits(closing) -> None:
    storage = StuckStorage()
    m = TieredHybridKVCacheManager(
        20,
        B,
        tiers=TierConfig(
            storage=storage, entry_format=FORMATS[0], group_entry_formats=FORMATS[1:], storage_timeout_s=0.05
        ),
        local_groups=TWO_LOCALS,
    )
    closing.append(m)
    sim = HybridSim(m)
    sim.serve("a", A)
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is not None  # evicts the local groups' blocks only
    sim.run_plan()
    m.free("b")
    assert m.flush(5)
    storage.stuck_tag = m.group_storage(1).keys_of(0)[0].split(".")[1]  # type: ignore[union-attr]
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(device=16, num_prompt_tokens=17)
    assert m.allocate("c", 1) is not None
    sim.wait_ready("c")
    (result,) = sim.results
    assert result.group == 1 and result.timed_out and result.blocks == () and result.requested == 2
    assert m.num_computed_tokens("c") == 0 and m.group_block_table("c", 1) == []  # the window had nothing else
    assert not m.group_storage(1).healthy and m.group_storage(0).healthy  # type: ignore[union-attr]
    assert m.tier_stats.storage.load_timeouts == 0  # type: ignore[union-attr]  # group 0's tier
    assert m.group_storage(1).stats.load_timeouts == 2  # type: ignore[union-attr]
    m.add_sequence("d", A)
    assert m.lookup("d").total == 0  # no storage hits from group 1 until it answers again
    m.check_integrity()
    storage.gate.set()
    assert m.group_storage(1).wait_idle(5)  # type: ignore[union-attr]
    assert m.lookup("d") == CachedTokens(device=16, num_prompt_tokens=17)
    assert sim.poll() == []  # the late answer of the timed-out read is dropped


def test_local_saves_without_payloads_are_dropped_and_counted_and_bad_payloads_change_nothing(closing) -> None:
    storage = MemoryStorage()
    m = make_stored(storage, policy="write-through", full=20)
    closing.append(m)
    m.add_sequence("a", A)
    assert m.allocate("a", 17) is not None
    m.commit("a", 17)
    plan = m.take_transfers()
    assert [len(plan.saves)] + [len(t.saves) for t in plan.groups] == [4, 4, 2]
    good = {t.group: [kv(t.group, s.block_hash) for s in t.saves] for t in plan.groups}
    before = m.tier_stats
    bad_inputs: list[dict[str, object]] = [
        {"saved_groups": {1: [b"short"] * 4}},
        {"saved_groups": {1: good[1][:3]}},
        {"saved_groups": {3: good[1]}},
        {"saved_groups": {True: good[1]}},
        {"saved_groups": {1: b"x" * 64}},
        {"saved_groups": good, "saved": [b"short"] * 4},  # group 0's payload is checked before any group queues
    ]
    for bad in bad_inputs:
        with pytest.raises(InvalidArgumentError):
            m.complete_transfers(plan, **bad)  # type: ignore[arg-type]
    assert m.flush(5) and len(storage) == 0 and m.tier_stats == before
    m.complete_transfers(plan, saved_groups={1: good[1]})  # group 0's and group 2's saves without payloads
    assert m.flush(5) and len(storage) == 4
    assert m.tier_stats.saves_without_payload == before.saves_without_payload + 6
    m.check_integrity()


def test_close_stops_every_groups_storage_threads(tmp_path) -> None:
    def threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kvblocks-") and t.is_alive()}

    before = threads()
    with make_stored(FileStorage(tmp_path), policy="write-through", full=20) as m:
        assert len(threads() - before) == 6  # a writer and a reader per group
        HybridSim(m).serve("a", A)
    assert not threads() - before
    assert len(list(tmp_path.rglob("*.*"))) >= 4 + 4 + 2  # every group's queued writes finished within close


def test_group_entry_formats_are_checked() -> None:
    with pytest.raises(ConfigError):
        TierConfig(group_entry_formats=("fmt",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TierConfig(group_entry_formats=FORMATS[0])  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        make_stored(MemoryStorage(), locals_=TWO_LOCALS[:1] * 3)  # 3 local groups, 2 formats
    assert TierConfig(group_entry_formats=[FORMATS[1]]).group_entry_formats == (FORMATS[1],)


class HybridStorageMachine(HybridTiersMachine):
    """The machine above with every group's storage (small host tiers: saves are frequent), entries lost at
    random (short reads), and a shadow of what every stored entry must hold."""

    HOSTS = (3, 2, 0)

    def tiers(self) -> TierConfig:
        self.storage = MemoryStorage()
        return TierConfig(
            num_host_blocks=self.HOSTS[0],
            group_host_blocks=self.HOSTS[1:],
            storage=self.storage,
            entry_format=FORMATS[0],
            group_entry_formats=FORMATS[1:],
        )

    def __init__(self) -> None:
        super().__init__()
        self.owner: dict[str, tuple[int, object]] = {}  # storage key -> (group, chain hash)
        self.payload_of: dict[bytes, object] = {}  # a stored payload -> the key whose KV it is
        for g in range(3):
            storage = self.m.group_storage(g)
            for key in self.all_keys[g]:
                self.owner[storage.keys_of(key)[0]] = (g, key)  # type: ignore[union-attr]
                self.payload_of[kv(g, key)] = key

    def teardown(self) -> None:
        self.m.close(timeout=1)

    def settle(self) -> None:
        """Every queued write and read is done, so what the manager sees no longer depends on thread timing."""
        for g in range(3):
            storage = self.m.group_storage(g)
            assert storage is not None and storage.flush(5) and storage.wait_idle(5)

    def _admit(self, seq: int, lookahead: int) -> None:
        self.settle()
        super()._admit(seq, lookahead)

    def _payload(self, g: int, content: object) -> bytes:
        return kv(g, content) if content in self.all_keys[g] else b"\xee" * PAYLOAD

    def _complete(self, data: st.DataObject) -> None:
        """Saves read every group's memories first (the plan's order), then the copies run, then loads land."""
        plan: TransferPlan = self.plan  # type: ignore[assignment]
        saves = [(0, plan.saves), *((t.group, t.saves) for t in plan.groups)]
        payloads = {
            g: [self._payload(g, (self.device if s.tier == "device" else self.host)[g][s.block]) for s in group]
            for g, group in saves
        }
        real = self.m.complete_transfers

        def with_payloads(plan: TransferPlan, **kwargs: object) -> None:
            dropped = data.draw(st.integers(0, 9)) == 0  # sometimes the engine hands back no payloads
            real(
                plan,
                saved=None if dropped else payloads[0],
                saved_groups=None if dropped else {g: payloads[g] for g in (1, 2)},
                **kwargs,  # type: ignore[arg-type]
            )

        self.m.complete_transfers = with_payloads  # type: ignore[method-assign]
        try:
            super()._complete(data)
        finally:
            del self.m.complete_transfers
        self.settle()
        for result in self.m.poll_loads():
            for block, parts in zip(result.blocks, result.payloads, strict=True):
                self.device[result.group][block] = self.payload_of.get(bytes(parts[0]), GARBAGE)

    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        """Another node's budget evicts a stored entry: the index still promises it, the read is short."""
        self.settle()
        keys = sorted(self.storage._entries)
        if keys:
            self.storage.delete([data.draw(st.sampled_from(keys))])

    @invariant()
    def stored_entries_hold_their_keys_kv(self) -> None:
        for key, value in list(self.storage._entries.items()):
            g, block_hash = self.owner[key]
            assert FORMATS[g].decode(value) == (kv(g, block_hash), ""), (g, block_hash)


TestHybridStorageMachine = HybridStorageMachine.TestCase
TestHybridStorageMachine.settings = settings(max_examples=180, stateful_step_count=40, deadline=None)
