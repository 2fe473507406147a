"""TieredKVCacheManager: write-back / write-through to host and storage, swap-ins, loads, their failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblocks.accounting import CachedTokens
from kvblocks.errors import (
    ConfigError,
    InvalidArgumentError,
    SequenceStateError,
    StaleLookupError,
    UnknownSequenceError,
)
from kvblocks.tiers import AdmittedTable, MemoryStorage, TierConfig, TieredKVCacheManager
from tests.support.tier_sim import FORMAT, SimEngine, content_of

B = 4
A = list(range(17))  # 4 full blocks + 1 token
OTHER = list(range(100, 117))


@pytest.fixture
def managers() -> Iterator[list[TieredKVCacheManager]]:
    made: list[TieredKVCacheManager] = []
    yield made
    for m in made:
        m.close(timeout=1)


@pytest.fixture
def make(managers):
    def build(num_blocks: int = 5, **tiers) -> TieredKVCacheManager:
        if "storage" in tiers:
            tiers.setdefault("entry_format", FORMAT)
        m = TieredKVCacheManager(num_blocks, B, tiers=TierConfig(**tiers))
        managers.append(m)
        return m

    return build


def fill(m: TieredKVCacheManager, seq: str, tokens: list[int], commit: int | None = None) -> list[int]:
    """Admit ``seq`` with nothing cached, commit ``commit`` tokens (all by default), free it."""
    m.add_sequence(seq, tokens)
    table = m.allocate(seq, len(tokens) - m.lookup(seq).total)
    assert table is not None
    ids = list(table)
    m.commit(seq, len(tokens) if commit is None else commit)
    m.free(seq)
    return ids


# ---------------------------------------------------------------- host tier: write policies


def test_write_back_copies_evicted_committed_blocks_to_host_in_eviction_order(make) -> None:
    m = make(5, num_host_blocks=8)
    assert fill(m, "a", A) == [0, 1, 2, 3, 4]
    assert not m.take_transfers()  # committing alone copies nothing under write-back
    m.add_sequence("b", OTHER)
    assert list(m.allocate("b", 17)) == [4, 3, 2, 1, 0]  # fresh 4 first, then a's leaves tail first
    plan = m.take_transfers()
    assert plan.swap_outs == ((3, 0), (2, 1), (1, 2), (0, 3))
    assert plan.swap_ins == () and plan.saves == ()
    m.check_integrity()
    m.add_sequence("c", A)
    assert m.lookup("c").host == 0  # pending copies are not hits
    m.complete_transfers(plan)
    assert m.lookup("c") == CachedTokens(device=0, host=16, storage=0, num_prompt_tokens=17)
    assert m.tier_stats.swap_outs == 4
    m.check_integrity()


def test_uncommitted_blocks_never_reach_host(make) -> None:
    m = make(5, num_host_blocks=8)
    fill(m, "a", A, commit=9)  # blocks 0 and 1 are full and committed; 2.. never were
    m.add_sequence("b", OTHER)
    m.allocate("b", 17)
    plan = m.take_transfers()
    assert plan.swap_outs == ((1, 0), (0, 1))
    m.complete_transfers(plan)
    m.add_sequence("c", A)
    assert m.lookup("c").host == 8


def test_write_through_copies_on_commit(make) -> None:
    m = make(5, num_host_blocks=8, host_policy="write-through")
    fill(m, "a", A)
    plan = m.take_transfers()
    assert plan.swap_outs == ((0, 0), (1, 1), (2, 2), (3, 3))
    m.complete_transfers(plan)
    m.add_sequence("b", OTHER)
    m.allocate("b", 17)
    assert not m.take_transfers()  # evicting adds nothing: the host already has them
    m.add_sequence("c", A)
    assert m.lookup("c").host == 16


def test_host_policy_off_keeps_no_host_tier(make) -> None:
    m = make(5, num_host_blocks=8, host_policy="off")
    fill(m, "a", A)
    m.add_sequence("b", OTHER)
    m.allocate("b", 17)
    assert not m.take_transfers() and m.host is None


def test_a_full_host_evicts_its_least_recently_used_entry_never_a_pending_one(make) -> None:
    m = make(5, num_host_blocks=2)
    fill(m, "a", A)
    m.add_sequence("b", OTHER)
    m.allocate("b", 17)
    plan = m.take_transfers()
    assert plan.swap_outs == ((3, 0), (2, 1))  # a's blocks 1 and 0 find only pending host blocks
    assert m.tier_stats.write_backs_without_host_room == 2
    m.complete_transfers(plan)
    m.commit("b", 17)
    m.free("b")  # b's table is [4, 3, 2, 1, 0]: released tail first
    m.add_sequence("c", list(range(200, 217)))
    m.allocate("c", 17)
    plan = m.take_transfers()
    assert plan.swap_outs == ((1, 0), (2, 1))  # host 0 (written first) is the least recently used
    assert m.tier_stats.host_evicted == 2
    m.complete_transfers(plan)
    m.check_integrity()


# ---------------------------------------------------------------- swap-ins


def host_hit_setup(make, **tiers):
    m = make(5, num_host_blocks=8, **tiers)
    fill(m, "a", A)
    m.add_sequence("b", OTHER)
    m.allocate("b", 17)
    m.complete_transfers(m.take_transfers())
    m.commit("b", 17)
    m.free("b")
    m.add_sequence("c", A)
    return m


def test_allocate_with_host_hits_plans_exact_swap_ins_and_keeps_them_pending(make) -> None:
    m = host_hit_setup(make)
    host_blocks = [m.host.block_of(h) for h in m.block_hashes("c")]
    assert host_blocks == [3, 2, 1, 0]
    table = m.allocate("c", 1)
    assert table is not None and len(table) == 5
    plan = m.take_transfers()
    assert plan.swap_ins == tuple(zip(host_blocks, table[:4], strict=True))
    assert isinstance(table, AdmittedTable) and table.swap_ins == plan.swap_ins and table.loads == ()
    assert table.num_cached_tokens == 16  # the hit the admission took, over every tier
    # pending: not device-resident, not committable, host sources held
    assert not m.is_ready("c") and m.num_computed_tokens("c") == 0
    with pytest.raises(SequenceStateError):
        m.commit("c", 17)
    m.add_sequence("d", A)
    assert m.lookup("d") == CachedTokens(device=0, host=16, num_prompt_tokens=17)
    assert all(m.host.pool.ref_count(h) == 1 for h in host_blocks)
    m.check_integrity()
    m.complete_transfers(plan)
    assert m.is_ready("c") and m.num_computed_tokens("c") == 16
    assert m.lookup("d") == CachedTokens(device=16, num_prompt_tokens=17)
    assert all(m.host.pool.ref_count(h) == 0 for h in host_blocks)
    assert m.stats.hit_tokens_host == 16 and m.tier_stats.swap_ins == 4
    m.commit("c", 17)
    m.check_integrity()


def test_a_failed_swap_in_stays_a_host_hit_and_leaks_no_device_block(make) -> None:
    m = host_hit_setup(make)
    table = list(m.allocate("c", 1))
    plan = m.take_transfers()
    free_before = m.num_free_blocks
    m.complete_transfers(plan, failed_swap_ins={table[1]})
    assert m.num_computed_tokens("c") == 4  # only the block before the failure counts
    assert list(m.block_table("c")) == table[:1]
    assert m.num_free_blocks == free_before + 4  # positions 1.. returned to the pool
    assert m.tier_stats.swap_in_failures == 1
    assert m.stats.hit_tokens_host == 4
    m.add_sequence("d", A)
    assert m.lookup("d") == CachedTokens(device=4, host=12, num_prompt_tokens=17)
    m.check_integrity()
    assert list(m.allocate("c", 13)) is not None and m.num_computed_tokens("c") == 4


def test_a_failed_swap_in_drops_the_draft_slots_with_the_rest_of_the_table(make) -> None:
    m = host_hit_setup(make)
    table = list(m.allocate("c", 1, num_lookahead_tokens=3))
    assert len(table) == 5 and m.num_allocated_tokens("c") == 20
    m.complete_transfers(m.take_transfers(), failed_swap_ins={table[2]})
    assert list(m.block_table("c")) == table[:2]
    assert m.num_allocated_tokens("c") == 8  # no draft slot without its block
    m.check_integrity()


def test_blocks_being_copied_into_are_not_reused_when_their_sequence_is_freed(make) -> None:
    m = host_hit_setup(make)
    table = list(m.allocate("c", 1))
    plan = m.take_transfers()
    m.free("c")
    assert all(m.pool.ref_count(b) == 1 for b in table)  # still held for the copy in flight
    assert m.num_free_blocks == 0
    m.check_integrity()
    m.complete_transfers(plan)
    assert all(m.pool.ref_count(b) == 0 for b in table) and m.num_free_blocks == 5
    assert all(m.host.pool.ref_count(b) == 0 for b in range(8))
    m.check_integrity()


def test_freeing_before_the_plan_is_taken_drops_the_swap_ins(make) -> None:
    m = host_hit_setup(make)
    m.allocate("c", 1)
    m.free("c")
    plan = m.take_transfers()
    assert plan.swap_ins == () and len(plan.swap_outs) == 4  # b's evicted blocks still go to host
    assert m.num_free_blocks == 5
    m.check_integrity()


def test_can_allocate_counts_blocks_for_host_hits(make) -> None:
    m = host_hit_setup(make)
    assert m.blocks_short("c", 1) == 0
    assert m.blocks_short("c", 5) == 1  # 16 cached + 5 new = 6 blocks of a 5-block pool
    assert m.allocate("c", 5) is None
    m.check_integrity()


# ---------------------------------------------------------------- storage


def storage_setup(make, storage=None, **tiers):
    storage = storage if storage is not None else MemoryStorage()
    m = make(5, storage=storage, **tiers)
    sim = SimEngine(m)
    sim.serve("a", A)
    sim.serve("b", OTHER)  # evicts a: written back to storage (no host tier)
    sim.run_plan()
    assert m.flush(5)
    return m, sim, storage


def test_evicted_blocks_are_written_to_storage_and_loaded_back(make) -> None:
    m, sim, storage = storage_setup(make)
    assert len(storage) == 4
    m.add_sequence("c", A)
    assert m.lookup("c") == CachedTokens(storage=16, num_prompt_tokens=17)
    admitted = m.allocate("c", 1)
    table = list(admitted)
    assert admitted.swap_ins == () and admitted.loads == tuple(zip(table[:4], m.block_hashes("c"), strict=True))
    results = sim.wait_ready("c")
    assert [r.blocks for r in results] == [tuple(table[:4])]
    assert results[0].complete and m.num_computed_tokens("c") == 16
    sim.check_sequence("c")
    assert m.stats.hit_tokens_storage == 16
    assert m.tier_stats.storage.loads_hit == 4
    m.check_integrity()


def test_only_the_leading_run_of_a_load_counts(make) -> None:
    m, sim, storage = storage_setup(make)
    m.add_sequence("c", A)
    hashes = m.block_hashes("c")
    storage.delete(m.storage.keys_of(hashes[1]))
    assert m.lookup("c").storage == 16  # the index does not know yet
    table = list(m.allocate("c", 1))
    free_before = m.num_free_blocks
    (result,) = sim.wait_ready("c")
    assert result.blocks == (table[0],) and result.requested == 4 and not result.complete
    assert list(m.block_table("c")) == table[:1]
    assert m.num_free_blocks == free_before + 4
    assert m.num_computed_tokens("c") == 4 and m.stats.hit_tokens_storage == 4
    stats = m.tier_stats.storage
    assert (stats.loads_hit, stats.loads_missing, stats.loads_beyond_a_miss) == (1, 1, 2)
    m.add_sequence("d", A)
    assert m.lookup("d").storage == 0  # the missing block left the index
    m.allocate("c", 13)
    sim.compute("c", 17)
    m.commit("c", 17)
    sim.check_sequence("c")
    m.check_integrity()


def test_a_corrupt_entry_is_a_counted_miss_and_is_removed(make) -> None:
    m, sim, storage = storage_setup(make)
    m.add_sequence("c", A)
    key = m.storage.keys_of(m.block_hashes("c")[0])[0]
    raw = bytearray(storage.get([key])[0])
    raw[-1] ^= 0xFF
    storage.put([(key, bytes(raw))])
    m.allocate("c", 1)
    (result,) = sim.wait_ready("c")
    assert result.blocks == () and m.num_computed_tokens("c") == 0
    assert m.tier_stats.storage.loads_corrupt == 1
    assert storage.get([key]) == [None]
    m.check_integrity()


def test_a_sequence_freed_before_committing_writes_nothing(make) -> None:
    storage = MemoryStorage()
    m = make(5, storage=storage, storage_policy="write-through", save_on_preempt=True)
    m.add_sequence("a", A)
    m.allocate("a", 17)
    m.preempt("a")  # nothing committed: nothing to save, and the blocks are released at once
    assert m.num_free_blocks == 5
    m.allocate("a", 17)
    m.free("a")
    plan = m.take_transfers()
    assert plan.saves == ()
    assert m.flush(5) and len(storage) == 0


def test_writes_are_incremental(make) -> None:
    storage = MemoryStorage()
    m = make(8, storage=storage, storage_policy="write-through")
    sim = SimEngine(m)
    sim.serve("a", A)
    plan = sim.run_plan()
    assert len(plan.saves) == 4
    assert m.flush(5)
    sim.serve("a2", A + [1, 2, 3, 4])  # shares a's 4 blocks and adds one
    plan = sim.run_plan()
    assert len(plan.saves) == 1  # only the new fifth block: the other four are known stored
    assert m.flush(5)
    assert m.tier_stats.writer.written == 5 and len(storage) == 5


def test_save_on_preempt_holds_blocks_until_the_snapshot_is_taken(make) -> None:
    storage = MemoryStorage()
    m = make(5, storage=storage, save_on_preempt=True, storage_policy="off")
    sim = SimEngine(m)
    m.add_sequence("a", A)
    table = list(m.allocate("a", 17))
    sim.compute("a", 17)
    m.commit("a", 17)
    tokens = m.token_ids("a")
    m.preempt("a")
    assert m.token_ids("a") == tokens == tuple(A)
    assert [m.pool.ref_count(b) for b in table] == [1] * 5  # held (tail first on release) until saved
    m.add_sequence("b", OTHER)
    assert m.allocate("b", 17) is None  # the held blocks cannot be evicted
    plan = sim.run_plan()
    assert [s.block for s in plan.saves] == table[:4]
    assert [m.pool.ref_count(b) for b in table] == [0] * 5
    assert m.allocate("b", 17) is not None
    assert m.flush(5)
    for h in m.block_hashes("a"):
        (raw,) = storage.get(m.storage.keys_of(h))
        assert bytes(FORMAT.decode(raw)[0]) == content_of(h)
    m.check_integrity()


def test_tensor_parallel_loads_use_the_shortest_ranks_run(make) -> None:
    storage = MemoryStorage()
    m = make(8, storage=storage, ranks=(0, 1))
    m.add_sequence("c", A)
    hashes = m.block_hashes("c")
    m.storage.save(hashes, [(content_of(h), content_of(h)[::-1]) for h in hashes])
    assert m.flush(5)
    assert m.lookup("c").storage == 16
    storage.delete([m.storage.keys_of(hashes[2])[1]])  # rank 1 lacks block 2
    m.allocate("c", 1)
    (result,) = SimEngine(m).wait_ready("c")
    assert len(result.blocks) == 2
    assert [tuple(bytes(p) for p in parts) for parts in result.payloads] == [
        (content_of(h), content_of(h)[::-1]) for h in hashes[:2]
    ]
    assert m.num_computed_tokens("c") == 8


def test_a_load_that_outlives_its_timeout_is_a_miss(make) -> None:
    class Stuck(MemoryStorage):
        release = False

        def get(self, keys):
            deadline = time.monotonic() + 5
            while not self.release and time.monotonic() < deadline:
                time.sleep(0.005)
            return super().get(keys)

    m, sim, storage = storage_setup(make, storage=Stuck(), storage_timeout_s=0.2)
    m.add_sequence("c", A)
    table = list(m.allocate("c", 1))
    start = time.monotonic()
    (result,) = sim.wait_ready("c")
    assert result.timed_out and result.blocks == () and time.monotonic() - start < 2
    assert list(m.block_table("c")) == [] and m.num_free_blocks == 5 and len(table) == 5
    assert m.tier_stats.storage.load_timeouts == 4
    m.add_sequence("d", A)
    assert m.lookup("d").storage == 0  # no storage hits while the backend does not answer
    storage.release = True
    m.allocate("c", 17)
    sim.compute("c", 17)
    m.commit("c", 17)
    m.check_integrity()


# ---------------------------------------------------------------- bad input


def test_completing_an_unknown_or_finished_plan_raises(make) -> None:
    m = host_hit_setup(make)
    table = list(m.allocate("c", 1))
    plan = m.take_transfers()
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers(plan, failed_swap_ins={99})
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers(plan, failed_swap_outs={0})
    assert not m.is_ready("c")  # nothing changed
    m.check_integrity()
    m.complete_transfers(plan)
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers(plan)
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers("plan")  # type: ignore[arg-type]
    assert m.num_computed_tokens("c") == 16 and len(table) == 5


def test_a_wrong_payload_is_refused_and_the_plan_can_be_completed_again(make) -> None:
    storage = MemoryStorage()
    m = make(5, storage=storage, storage_policy="write-through")
    fill(m, "a", A)
    plan = m.take_transfers()
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers(plan, saved=[b"short"] * 4)
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers(plan, saved=[b"x" * 16] * 3)
    m.complete_transfers(plan, saved=[b"x" * 16] * 4)
    assert m.flush(5) and len(storage) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_host_blocks": -1},
        {"host_policy": "later"},
        {"storage_policy": "never"},
        {"storage": MemoryStorage()},  # no entry_format
        {"save_on_preempt": True},  # no storage
        {"storage": object(), "entry_format": FORMAT},
        {"storage": MemoryStorage(), "entry_format": FORMAT, "storage_timeout_s": 0},
        {"ranks": (0, 0)},
        {"ranks": (-1,)},
        {"max_pending_writes": 0},
    ],
)
def test_bad_tier_configuration(kwargs) -> None:
    with pytest.raises(ConfigError):
        TierConfig(**kwargs)


def test_reset_is_refused_while_copies_are_pending(make) -> None:
    m = host_hit_setup(make)
    m.allocate("c", 1)
    plan = m.take_transfers()
    assert not m.reset_prefix_cache()
    m.complete_transfers(plan)
    m.free("c")
    assert m.reset_prefix_cache()
    m.add_sequence("d", A)
    assert m.lookup("d").total == 0


# ---------------------------------------------------------------- state machine


PREFIXES = [list(range(1000 * p, 1000 * p + 12)) for p in range(5)]  # 15 blocks: more than the device holds


class TieredMachine(RuleBasedStateMachine):
    """Random traffic through device, host and storage with a simulated engine checking every block's KV."""

    @initialize(
        host=st.sampled_from([0, 3, 6]),
        host_policy=st.sampled_from(["write-back", "write-through"]),
        storage_policy=st.sampled_from(["write-back", "write-through", "off"]),
        budget=st.sampled_from([None, 6 * (FORMAT.payload_length + 100)]),
    )
    def setup(self, host: int, host_policy: str, storage_policy: str, budget: int | None) -> None:
        self.storage = MemoryStorage(byte_budget=budget)
        tiers = TierConfig(
            num_host_blocks=host,
            host_policy=host_policy,
            storage=self.storage,
            entry_format=FORMAT,
            storage_policy=storage_policy,
            save_on_preempt=True,
            storage_timeout_s=2.0,
        )
        self.m = TieredKVCacheManager(8, B, tiers=tiers)
        self.sim = SimEngine(self.m, settle=True)  # every step waits for the I/O threads: reproducible runs
        self.counter = 0
        self.live: dict[str, list[int]] = {}

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.m.close(timeout=1)

    @rule(prefix=st.integers(0, 4), extra=st.integers(1, 9))
    def add(self, prefix: int, extra: int) -> None:
        if len(self.live) >= 4:
            return
        seq = f"s{self.counter}"
        self.counter += 1
        tokens = PREFIXES[prefix] + [prefix * 7 + i for i in range(extra)]
        self.m.add_sequence(seq, tokens)
        self.live[seq] = tokens

    def _pick(self, data, admitted: bool | None = None, ready: bool = False) -> str | None:
        m = self.m
        names = [
            s for s in self.live if (admitted is None or m.is_admitted(s) == admitted) and (not ready or m.is_ready(s))
        ]
        choice = data.draw(st.integers(0, 7))  # drawn whatever the state: loads finish on their own thread
        return sorted(names)[choice % len(names)] if names else None

    @rule(prefix=st.integers(0, 4), extra=st.integers(1, 9), keep=st.booleans())
    def serve(self, prefix: int, extra: int, keep: bool) -> None:
        """A whole request in one go: admit, wait for its copies, compute, commit; maybe keep it admitted."""
        if len(self.live) >= 4:
            return
        seq = f"s{self.counter}"
        self.counter += 1
        tokens = PREFIXES[prefix] + [prefix * 7 + i for i in range(extra)]
        m = self.m
        m.add_sequence(seq, tokens)
        self.live[seq] = tokens
        self.sim.step()  # lets probes and earlier copies settle like a real step would
        if m.allocate(seq, len(tokens) - m.lookup(seq).total) is None:
            return
        self.sim.wait_ready(seq)
        if len(m.block_table(seq)) * B < len(tokens):
            if m.allocate(seq, len(tokens) - m.num_computed_tokens(seq)) is None:
                return
            self.sim.step()
        self.sim.check_sequence(seq)
        self.sim.compute(seq, len(tokens))
        m.commit(seq, len(tokens))
        if not keep:
            m.free(seq)
            del self.live[seq]

    @rule(data=st.data())
    def admit(self, data) -> None:
        seq = self._pick(data, admitted=False)
        if seq is None:
            return
        cached = self.m.lookup(seq)
        assert cached.total <= len(self.live[seq]) - 1
        self.m.allocate(seq, len(self.live[seq]) - cached.total)

    @rule()
    def step(self) -> None:
        self.sim.step()

    @rule(data=st.data())
    def compute(self, data) -> None:
        self.sim.step()  # the step's scheduling is over: its copies run before the forward pass
        seq = self._pick(data, admitted=True, ready=True)
        if seq is None:
            return
        tokens = self.live[seq]
        covered = len(self.m.block_table(seq)) * B
        short = covered < len(tokens)  # a load fell short: allocate the rest
        if short and self.m.allocate(seq, len(tokens) - self.m.num_computed_tokens(seq)) is None:
            return
        self.sim.check_sequence(seq)
        self.sim.compute(seq, len(tokens))
        self.m.commit(seq, len(tokens))

    @rule(data=st.data())
    def free(self, data) -> None:
        seq = self._pick(data)
        if seq is not None:
            self.m.free(seq)
            del self.live[seq]

    @rule(data=st.data())
    def preempt(self, data) -> None:
        seq = self._pick(data, admitted=True)
        if seq is not None:
            self.m.preempt(seq)

    @precondition(lambda self: hasattr(self, "m"))
    @rule()
    def settle(self) -> None:
        self.sim.step()
        self.m.flush(5)
        self.sim.step()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        self.sim.check_cached()
        for seq in self.live:
            if self.m.is_admitted(seq) and self.m.is_ready(seq):
                self.sim.check_sequence(seq)


TieredMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tiered_state_machine = TieredMachine.TestCase


def test_an_entry_of_another_spec_under_this_formats_keys_is_corrupt_and_removed(make) -> None:
    """Keys carry the format tag of this spec: an entry of another spec under them can only be damage (or one
    copied there), and left in place it would block writing the block forever."""
    from kvblocks.tiers import EntryFormat

    storage = MemoryStorage()
    other = EntryFormat("xxh3-128", "uint8", (FORMAT.payload_length,), 1, FORMAT.payload_length)
    m = make(5, storage=storage)
    m.add_sequence("c", A)
    hashes = m.block_hashes("c")
    storage.put([(m.storage.keys_of(h)[0], other.encode(content_of(h))) for h in hashes])
    assert m.storage.wait_idle(5)  # the probe from add_sequence found them
    assert m.lookup("c").storage == 16
    m.allocate("c", 1)
    (result,) = SimEngine(m).wait_ready("c")
    assert result.blocks == () and m.num_computed_tokens("c") == 0
    assert m.tier_stats.storage.loads_corrupt == 4
    assert len(storage) == 0


def test_reads_of_freed_admissions_are_skipped_not_queued_behind(make) -> None:
    class SlowGet(MemoryStorage):
        def get(self, keys):
            time.sleep(0.02)
            return super().get(keys)

    storage = SlowGet()
    m = make(16, storage=storage, storage_timeout_s=0.5)
    sim = SimEngine(m)
    tokens = list(range(100, 121))
    m.add_sequence("a", tokens)
    storage.put([(k, FORMAT.encode(content_of(h), k)) for h in m.block_hashes("a") for k in m.storage.keys_of(h)])
    assert m.storage.wait_idle(5) and m.lookup("a").storage == 20
    for _ in range(40):  # preemption churn: 40 reads queued, each admission gone before its read
        m.allocate("a", 1)
        sim.run_plan()
        m.preempt("a")
        sim.run_plan()
    m.free("a")
    m.add_sequence("b", tokens)
    m.allocate("b", 1)
    (*_, result) = sim.wait_ready("b")
    assert not result.timed_out and len(result.blocks) == 5  # 40 x 20 ms of stale reads would outlast 0.5 s
    assert m.tier_stats.storage.loads_cancelled >= 5 * 35 and m.tier_stats.storage.load_timeouts == 0


def test_preempted_blocks_stay_held_when_their_save_was_already_planned(make) -> None:
    storage = MemoryStorage()
    m = make(5, storage=storage, storage_policy="write-through", save_on_preempt=True)
    m.add_sequence("a", A)
    table = list(m.allocate("a", 17))
    m.commit("a", 17)  # write-through: the 4 full blocks are queued in the open plan already
    m.preempt("a")
    assert [m.pool.ref_count(b) for b in table] == [1] * 5  # held until that plan has saved them
    plan = m.take_transfers()
    assert [s.block for s in plan.saves] == table[:4]
    m.complete_transfers(plan, saved=[content_of(h) for h in m.block_hashes("a")])
    assert [m.pool.ref_count(b) for b in table] == [0] * 5
    m.check_integrity()


# ---------------------------------------------------------------- lifetime


def _storage_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvblocks-") and t.is_alive()}


@pytest.mark.parametrize("leave_by_error", [False, True])
def test_a_with_block_stops_the_storage_threads_and_keeps_queued_writes(leave_by_error: bool) -> None:
    before = _storage_threads()
    storage = MemoryStorage()
    try:
        with TieredKVCacheManager(
            5, B, tiers=TierConfig(storage=storage, storage_policy="write-through", entry_format=FORMAT)
        ) as m:
            assert isinstance(m, TieredKVCacheManager)
            assert len(_storage_threads() - before) == 2  # the writer and the reader
            fill(m, "a", A)
            engine = SimEngine(m)
            engine.step()
            if leave_by_error:
                raise KeyError("the engine failed")
    except KeyError:
        assert leave_by_error
    assert not (_storage_threads() - before)  # both stopped on leaving the block
    assert m.tier_stats.writer.written == len(A) // B  # queued write-throughs finished within close's wait


def test_transfer_executor_is_exported_from_the_tiers_package() -> None:
    import kvblocks.tiers
    from kvblocks.tiers.executor import TransferExecutor

    assert kvblocks.tiers.TransferExecutor is TransferExecutor
    assert "TransferExecutor" in kvblocks.tiers.__all__


# ---------------------------------------------------------------- storage checks an engine may wait for


class GatedStorage(MemoryStorage):
    """A MemoryStorage whose ``exists`` (the storage check) waits until the test opens the gate."""

    def __init__(self, shared: MemoryStorage) -> None:
        super().__init__()
        self._entries = shared._entries  # the same entries as the writer's store
        self.gate = threading.Event()

    def exists(self, keys):
        assert self.gate.wait(10)
        return super().exists(keys)


def test_an_engine_can_tell_that_a_storage_check_is_still_pending() -> None:
    shared = MemoryStorage()
    config = TierConfig(storage=shared, storage_policy="write-through", entry_format=FORMAT)
    writer = TieredKVCacheManager(8, B, tiers=config)  # not closed here: closing a MemoryStorage empties it
    sim = SimEngine(writer)
    sim.serve("w", A)
    sim.run_plan()
    assert writer.flush(5) and len(shared) == 4
    gated = GatedStorage(shared)
    assert len(gated) == 4
    with TieredKVCacheManager(8, B, tiers=TierConfig(storage=gated, entry_format=FORMAT)) as m:
        m.add_sequence("r", A)
        assert m.is_storage_check_pending("r")  # the reader is waiting on the backend
        assert m.lookup("r").storage == 0  # lookup never waits: a same-step admission would see no storage hit
        gated.gate.set()
        assert m.storage.wait_idle(5)
        assert not m.is_storage_check_pending("r")
        assert m.lookup("r").storage == 16
        m.add_sequence("nothing-to-check", [1])  # no full block: no check queued
        assert not m.is_storage_check_pending("nothing-to-check")
        m.add_sequence("skip", A, skip_cache_read=True)
        assert not m.is_storage_check_pending("skip") and m.lookup("skip").total == 0
        m.free("r")
        with pytest.raises(UnknownSequenceError):
            m.is_storage_check_pending("r")
    writer.close()


def test_an_admission_given_the_hit_it_saw_over_the_tiers(make) -> None:
    m = host_hit_setup(make)  # "c": 16 host-cached tokens
    assert m.lookup("c").total == 16
    with pytest.raises(StaleLookupError):
        m.allocate("c", 1, num_cached_tokens=20)  # more than the tiers hold now: refused, nothing changed
    assert not m.is_admitted("c") and not m.take_transfers()
    table = m.allocate("c", 9, num_cached_tokens=8)  # takes two host blocks of the four
    assert table is not None and table.num_cached_tokens == 8 and len(table.swap_ins) == 2
    assert m.num_allocated_tokens("c") == 17
    m.check_integrity()
