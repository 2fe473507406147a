"""A hypothesis state machine over the manager, with a shadow copy of the KV every block holds.

Many sequences with shared prefixes run add / lookup / allocate / commit / append /
free / preempt in random interleavings against a pool that is far too small. The
test plays the engine: when a sequence commits tokens, it writes their "KV" -- the
sequence's prefix up to that token -- into a shadow of each block. After every
step it checks that

* ref counts equal the holders (tables and pins of live sequences) of each block;
* fresh + idle + in use = N with no block in two states;
* every cached node's parent is cached;
* every cached node's shadow holds exactly the prefix its hash names -- so a block
  whose KV was never written can never be findable;
* every block a sequence gets from the cache at admission holds exactly that
  sequence's tokens;
* the hit counters equal the model's, and ``lookup`` / ``can_allocate`` changed nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks import BlockExtras, KVCacheManager, block_hashes

from .conftest import manager_snapshot

BLOCK = 2
POOL = 10
SYSTEM_PROMPTS = [(), (9, 8, 7, 6, 5, 4), (9, 8, 7, 1)]
suffixes = st.lists(st.integers(0, 3), max_size=7)
Content = tuple  # (lora, prefix tokens): what a block's KV depends on


@dataclass
class ModelSeq:
    tokens: list[int]
    lora: str | None
    by_hashes: bool = False
    admitted: bool = False
    preempted: bool = False
    committed: int = 0
    covered: int = 0
    table: list[int] = field(default_factory=list)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(num_blocks=POOL, block_size=BLOCK)
        self.seqs: dict[int, ModelSeq] = {}
        self.next_id = 0
        self.shadow: dict[int, Content | None] = {}  # block -> the KV written into it
        self.content_of: dict[object, Content] = {}  # block hash -> the KV that hash names
        self.admissions = self.queried = self.hits = 0
        self.readmissions = self.re_queried = self.re_hits = 0

    # ---------------------------------------------------------------- helpers

    def learn_hashes(self, seq: ModelSeq) -> None:
        extras = BlockExtras(lora=seq.lora) if seq.lora else None
        hashes = block_hashes(seq.tokens, BLOCK, extras=extras)
        for i, h in enumerate(hashes):
            self.content_of[h] = (seq.lora, tuple(seq.tokens[: (i + 1) * BLOCK]))

    def live(self) -> list[int]:
        return sorted(self.seqs)

    def admitted(self) -> list[int]:
        return [i for i in self.live() if self.seqs[i].admitted]

    # ---------------------------------------------------------------- rules

    @rule(system=st.sampled_from(SYSTEM_PROMPTS), suffix=suffixes, lora=st.sampled_from([None, None, None, "L"]))
    def add(self, system: tuple[int, ...], suffix: list[int], lora: str | None) -> None:
        tokens = list(system) + suffix
        if not tokens:
            tokens = [0]
        seq_id = self.next_id
        self.next_id += 1
        self.m.add_sequence(seq_id, tokens, extras=BlockExtras(lora=lora) if lora else None)
        self.seqs[seq_id] = ModelSeq(tokens, lora)
        self.learn_hashes(self.seqs[seq_id])

    @rule(system=st.sampled_from(SYSTEM_PROMPTS[1:]), suffix=suffixes)
    def add_by_hashes(self, system: tuple[int, ...], suffix: list[int]) -> None:
        """A router-style sequence: the same key space, but only hashes and a length."""
        tokens = list(system) + suffix
        seq_id = self.next_id
        self.next_id += 1
        self.m.add_sequence(seq_id, block_hashes=block_hashes(tokens, BLOCK), num_tokens=len(tokens))
        self.seqs[seq_id] = ModelSeq(tokens, None, by_hashes=True)
        self.learn_hashes(self.seqs[seq_id])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        seq = self.seqs[seq_id]
        before = manager_snapshot(self.m)
        cached = self.m.lookup(seq_id)
        self.m.can_allocate(seq_id, data.draw(st.integers(0, 8)))
        assert manager_snapshot(self.m) == before, "lookup or can_allocate changed something"
        assert cached.device % BLOCK == 0 and cached.device <= len(seq.tokens) - 1
        assert cached.host == cached.storage == 0

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        seq = self.seqs[seq_id]
        if not seq.admitted:
            cached = self.m.lookup(seq_id).device
            n = data.draw(st.integers(0, len(seq.tokens) - cached + 2))
        else:
            n = data.draw(st.integers(0, 3))
        expected_ok = self.m.can_allocate(seq_id, n)
        before = manager_snapshot(self.m)
        table = self.m.allocate(seq_id, n)
        if table is None:
            assert not expected_ok
            assert manager_snapshot(self.m) == before, "a refused allocate changed something"
            return
        assert expected_ok
        table = list(table)
        if not seq.admitted:
            hits = cached // BLOCK
            for i in range(hits):
                assert self.shadow.get(table[i]) == (seq.lora, tuple(seq.tokens[: (i + 1) * BLOCK])), (
                    f"sequence {seq_id} was handed block {table[i]} holding {self.shadow.get(table[i])}"
                )
            new_blocks = table[hits:]
            self.record_admission(seq, cached)
            seq.admitted, seq.committed, seq.covered = True, cached, cached + n
        else:
            new_blocks = table[len(seq.table) :]
            assert table[: len(seq.table)] == seq.table, "allocate moved existing blocks"
            seq.covered += n
        for b in new_blocks:
            self.shadow[b] = None  # a new block holds nothing until the engine writes it
        seq.table = table
        assert len(table) == -(-seq.covered // BLOCK)

    def record_admission(self, seq: ModelSeq, cached: int) -> None:
        if seq.preempted:
            self.readmissions += 1
            self.re_queried += len(seq.tokens)
            self.re_hits += cached
        else:
            self.admissions += 1
            self.queried += len(seq.tokens)
            self.hits += cached

    @precondition(lambda self: any(s.admitted for s in self.seqs.values()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.admitted()))
        seq = self.seqs[seq_id]
        top = min(seq.covered, len(seq.tokens))
        n = data.draw(st.integers(seq.committed, top))
        # The engine writes KV for tokens [committed, n) into the sequence's own blocks.
        for i in range(seq.committed // BLOCK, -(-n // BLOCK)):
            self.shadow[seq.table[i]] = (seq.lora, tuple(seq.tokens[: min(n, (i + 1) * BLOCK)]))
        self.m.commit(seq_id, n)
        seq.committed = n

    @precondition(lambda self: any(not s.by_hashes for s in self.seqs.values()))
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from([i for i in self.live() if not self.seqs[i].by_hashes]))
        seq = self.seqs[seq_id]
        self.m.append_tokens(seq_id, tokens)
        seq.tokens.extend(tokens)
        self.learn_hashes(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.m.free(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: any(s.admitted for s in self.seqs.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.admitted()))
        seq = self.seqs[seq_id]
        self.m.preempt(seq_id)
        seq.admitted, seq.preempted, seq.committed, seq.covered, seq.table = False, True, 0, 0, []

    @rule()
    def reset(self) -> None:
        in_use = any(s.table for s in self.seqs.values())  # refused while any block is held
        assert self.m.reset_prefix_cache() is (not in_use)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()

    @invariant()
    def pool_partition(self) -> None:
        pool = self.m.pool
        fresh, idle = set(pool.fresh_order()), set(pool.idle_lru())
        in_use = {b for b in range(POOL) if pool.ref_count(b) > 0}
        assert not (fresh & idle) and not (fresh & in_use) and not (idle & in_use)
        assert len(fresh) + len(idle) + len(in_use) == POOL

    @invariant()
    def refs_equal_holders(self) -> None:
        holders = [0] * POOL
        for seq_id in self.admitted():
            for b in self.m.block_table(seq_id):
                holders[b] += 1
        for s in self.m._seqs.values():  # pins: the one holding a block table does not show
            for b in (s.pins or {}).values():
                holders[b] += 1
        assert [self.m.pool.ref_count(b) for b in range(POOL)] == holders

    @invariant()
    def tables_match_model(self) -> None:
        for seq_id in self.live():
            assert list(self.m.block_table(seq_id)) == self.seqs[seq_id].table

    @invariant()
    def every_cached_block_holds_what_its_hash_names(self) -> None:
        tree = self.m.tree
        for b in range(POOL):
            h = tree.hash_of(b)
            if h is None:
                continue
            assert self.shadow.get(b) == self.content_of[h], f"cached block {b} holds {self.shadow.get(b)}"
            parent = tree.parent_of(b)
            if parent is not None:
                assert tree.hash_of(parent) is not None

    @invariant()
    def counters_match_model(self) -> None:
        stats = self.m.stats
        assert (stats.admissions, stats.queried_tokens, stats.hit_tokens) == (self.admissions, self.queried, self.hits)
        assert (stats.readmissions, stats.readmission_queried_tokens, stats.readmission_hit_tokens) == (
            self.readmissions,
            self.re_queried,
            self.re_hits,
        )


ManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerMachine = ManagerMachine.TestCase
