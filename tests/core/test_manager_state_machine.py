"""A hypothesis state machine over the manager, with a shadow copy of the KV every block holds.

Many sequences with shared prefixes run add / lookup / allocate / commit / append /
step / free / preempt in random interleavings against a pool that is far too small,
with a reserve of free blocks that admissions must leave. Two managers run in
lockstep: one is driven by the batched :meth:`KVCacheManager.step`, the other by the
per-sequence calls an engine would make instead (``can_allocate``, ``commit``,
``append_tokens``, ``allocate`` with the cumulative count and the lookahead); every
other rule goes to both. The test plays the engine: when a sequence commits tokens,
it writes their "KV" -- the sequence's prefix up to that token -- into a shadow of
each block. Steps carry chunked prefill (admit with a first chunk, later chunks as
``num_new_tokens``), draft slots that are accepted (committed into) or rejected
(the next step asks for fewer), and skip-read sequences. After every step it checks

* both managers are identical: tables, pins, pool orders, tree, committed and
  allocated tokens, lookahead, statistics -- and the step's failed list equals the
  per-sequence path's;
* ref counts equal the holders (tables and pins of live sequences) of each block;
* fresh + idle + in use = N with no block in two states;
* every cached node's parent is cached (eviction takes leaves only);
* every cached node's shadow holds exactly the prefix its hash names -- so a block
  whose KV was never written can never be findable;
* every block a sequence gets from the cache at admission holds exactly that
  sequence's tokens;
* a table has exactly ceil((covered + lookahead) / B) blocks, an admission leaves the
  reserve free while growth may use it, an admission told a stale hit raises
  ``StaleLookupError`` and changes nothing;
* the hit counters equal the model's, and ``lookup`` / ``can_allocate`` / ``match``
  changed nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblocks import BlockExtras, KVCacheManager, block_hashes
from kvblocks.errors import (
    CommitOutOfRangeError,
    InvalidArgumentError,
    SequenceStateError,
    StaleLookupError,
    UnknownSequenceError,
)
from tests.support.snapshots import full_snapshot

BLOCK = 2
POOL = 10
RESERVE = 1
SYSTEM_PROMPTS = [(), (9, 8, 7, 6, 5, 4), (9, 8, 7, 1)]
suffixes = st.lists(st.integers(0, 3), max_size=7)
Content = tuple  # (lora, prefix tokens): what a block's KV depends on


@dataclass
class ModelSeq:
    tokens: list[int]
    lora: str | None
    by_hashes: bool = False
    skip_read: bool = False
    admitted: bool = False
    preempted: bool = False
    committed: int = 0
    covered: int = 0
    lookahead: int = 0
    table: list[int] = field(default_factory=list)


@dataclass
class StepEntry:
    seq_id: int
    commit: int | None
    tokens: list[int]
    new: int
    lookahead: int


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(num_blocks=POOL, block_size=BLOCK, reserved_blocks=RESERVE)  # driven by step
        self.p = KVCacheManager(num_blocks=POOL, block_size=BLOCK, reserved_blocks=RESERVE)  # per-sequence calls
        self.ms = (self.m, self.p)
        self.seqs: dict[int, ModelSeq] = {}
        self.seen: dict[int, int] = {}  # the hit an earlier lookup reported (may have gone stale since)
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

    def write_kv(self, seq: ModelSeq, n: int) -> None:
        """The engine writes KV for tokens [committed, n) into the sequence's own blocks."""
        for i in range(seq.committed // BLOCK, blocks_for(n)):
            self.shadow[seq.table[i]] = (seq.lora, tuple(seq.tokens[: min(n, (i + 1) * BLOCK)]))

    def take_table(self, seq: ModelSeq, table: list[int], keep: int) -> None:
        """Adopt the manager's table: the first ``keep`` blocks are the old ones, the rest hold nothing yet."""
        assert table[:keep] == seq.table[:keep], "a table moved blocks it kept"
        for b in table[len(seq.table) :] if keep == len(seq.table) else ():
            self.shadow[b] = None
        seq.table = table
        assert len(table) == blocks_for(seq.covered + seq.lookahead), "a table is not ceil((covered + k) / B)"

    def record_admission(self, seq: ModelSeq, cached: int) -> None:
        if seq.preempted:
            self.readmissions += 1
            self.re_queried += len(seq.tokens)
            self.re_hits += cached
        else:
            self.admissions += 1
            self.queried += len(seq.tokens)
            self.hits += cached

    def growth_fits(self, seq: ModelSeq, target: int, k: int) -> bool:
        """Growth of a running sequence may use the reserve: only the free blocks bound it."""
        return blocks_for(target + k) - len(seq.table) <= self.m.num_free_blocks

    # ---------------------------------------------------------------- rules

    @rule(
        system=st.sampled_from(SYSTEM_PROMPTS),
        suffix=suffixes,
        lora=st.sampled_from([None, None, None, "L"]),
        skip_read=st.sampled_from([False, False, False, True]),
    )
    def add(self, system: tuple[int, ...], suffix: list[int], lora: str | None, skip_read: bool) -> None:
        tokens = list(system) + suffix
        if not tokens:
            tokens = [0]
        seq_id = self.next_id
        self.next_id += 1
        extras = BlockExtras(lora=lora) if lora else None
        for m in self.ms:
            m.add_sequence(seq_id, tokens, extras=extras, skip_cache_read=skip_read)
        self.seqs[seq_id] = ModelSeq(tokens, lora, skip_read=skip_read)
        self.learn_hashes(self.seqs[seq_id])

    @rule(system=st.sampled_from(SYSTEM_PROMPTS[1:]), suffix=suffixes)
    def add_by_hashes(self, system: tuple[int, ...], suffix: list[int]) -> None:
        """A router-style sequence: the same key space, but only hashes and a length."""
        tokens = list(system) + suffix
        seq_id = self.next_id
        self.next_id += 1
        for m in self.ms:
            m.add_sequence(seq_id, block_hashes=block_hashes(tokens, BLOCK), num_tokens=len(tokens))
        self.seqs[seq_id] = ModelSeq(tokens, None, by_hashes=True)
        self.learn_hashes(self.seqs[seq_id])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        seq = self.seqs[seq_id]
        n, k = data.draw(st.integers(0, 8)), data.draw(st.integers(0, 3))
        for m in self.ms:
            before = full_snapshot(m)
            cached = m.lookup(seq_id)
            m.can_allocate(seq_id, n, num_lookahead_tokens=k)
            probe = m.match(block_hashes=block_hashes(seq.tokens, BLOCK), num_tokens=len(seq.tokens))
            assert full_snapshot(m) == before, "lookup, can_allocate or match changed something"
            assert cached.device % BLOCK == 0 and cached.device <= len(seq.tokens) - 1
            assert cached.host == cached.storage == 0
            if seq.skip_read:
                assert cached.device == 0, "a skip-read sequence was offered a hit"
            elif seq.lora is None:
                assert probe.device == cached.device, "match and lookup disagree"
        if not seq.admitted:
            self.seen[seq_id] = cached.device

    @rule()
    def scan_waiting(self) -> None:
        """A scheduler looks up its whole waiting queue, and admits later: those hits may go stale."""
        for seq_id in self.live():
            if not self.seqs[seq_id].admitted:
                self.seen[seq_id] = self.m.lookup(seq_id).device

    @rule()
    def flood(self) -> None:
        """Another admission takes every block it may (the reserve aside), evicting idle prefixes; then it leaves."""
        blocks = self.m.num_free_blocks - RESERVE
        if blocks <= 0:
            return
        seq_id = self.next_id
        self.next_id += 1
        tokens = [100 + seq_id] * (blocks * BLOCK)  # shares nothing with anyone
        for m in self.ms:
            m.add_sequence(seq_id, tokens)
            table = m.allocate(seq_id, len(tokens))
            assert table is not None and len(table) == blocks
            for b in table:
                self.shadow[b] = None
            m.free(seq_id)
        self.record_admission(ModelSeq(tokens, None), 0)

    def waiting_with_hits(self) -> list[int]:
        return [i for i in self.live() if not self.seqs[i].admitted and self.m.lookup(i).device]

    @precondition(lambda self: self.waiting_with_hits())
    @rule(data=st.data())
    def admit_after_flood(self, data: st.DataObject) -> None:
        """The issue's stale lookup: look up, another admission evicts, admit with the hit seen."""
        seq_id = data.draw(st.sampled_from(self.waiting_with_hits()))
        self.seen[seq_id] = self.m.lookup(seq_id).device
        self.flood()
        self.admit_or_grow(data, seq_id, use_seen=True)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.admit_or_grow(data, seq_id, use_seen=data.draw(st.booleans()))

    def admit_or_grow(self, data: st.DataObject, seq_id: int, *, use_seen: bool) -> None:
        seq = self.seqs[seq_id]
        k = data.draw(st.sampled_from([0, 0, 1, 2, 3]))
        kwargs: dict[str, int] = {}
        check_can = True
        if not seq.admitted:
            cached = self.m.lookup(seq_id).device
            seen = self.seen.get(seq_id)
            if seen is not None and use_seen:
                if seen > cached:
                    self.stale_admission(seq_id, seen, data.draw(st.integers(0, 3)), k)
                    return
                check_can = seen == cached  # can_allocate answers for the hit there is now
                cached = seen
                kwargs["num_cached_tokens"] = seen
                event("admission told the hit it saw" + (", a smaller one than now" if not check_can else ""))
            n = data.draw(st.integers(0, len(seq.tokens) - cached + 2))  # a first chunk, the prompt, or more
        else:
            n = data.draw(st.integers(0, 3))
            assert self.m.can_allocate(seq_id, n, num_lookahead_tokens=k) == self.growth_fits(seq, seq.covered + n, k)
        expected_ok = self.m.can_allocate(seq_id, n, num_lookahead_tokens=k)
        befores = [full_snapshot(m) for m in self.ms]
        tables = [m.allocate(seq_id, n, num_lookahead_tokens=k, **kwargs) for m in self.ms]
        assert tables[0] == tables[1]
        if tables[0] is None:
            assert not check_can or not expected_ok
            for m, before in zip(self.ms, befores, strict=True):
                assert full_snapshot(m) == before, "a refused allocate changed something"
            return
        assert not check_can or expected_ok
        table = list(tables[0])
        if not seq.admitted:
            for i in range(cached // BLOCK):
                assert self.shadow.get(table[i]) == (seq.lora, tuple(seq.tokens[: (i + 1) * BLOCK])), (
                    f"sequence {seq_id} was handed block {table[i]} holding {self.shadow.get(table[i])}"
                )
            for m in self.ms:
                assert m.num_free_blocks >= RESERVE, "an admission ate into the reserve"
                assert m.num_computed_tokens(seq_id) == cached
            self.record_admission(seq, cached)
            seq.admitted, seq.committed, seq.covered, seq.lookahead = True, cached, cached + n, k
            seq.table = table[: cached // BLOCK]
            self.take_table(seq, table, cached // BLOCK)
            self.seen.pop(seq_id, None)
        else:
            seq.covered += n
            seq.lookahead = k
            self.take_table(seq, table, min(len(seq.table), len(table)))
        for m in self.ms:
            assert m.num_allocated_tokens(seq_id) == seq.covered + seq.lookahead

    def stale_admission(self, seq_id: int, seen: int, n: int, k: int) -> None:
        """The cache lost the hit a lookup saw: the admission refuses and changes nothing."""
        event("stale admission")
        for m in self.ms:
            before = full_snapshot(m)
            with pytest.raises(StaleLookupError):
                m.allocate(seq_id, n, num_lookahead_tokens=k, num_cached_tokens=seen)
            assert full_snapshot(m) == before, "a stale admission changed something"

    @precondition(lambda self: any(s.admitted for s in self.seqs.values()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.admitted()))
        seq = self.seqs[seq_id]
        top = min(seq.covered + seq.lookahead, len(seq.tokens))  # accepted drafts commit into lookahead slots
        n = data.draw(st.integers(seq.committed, top))
        self.write_kv(seq, n)
        for m in self.ms:
            m.commit(seq_id, n)
        self.committed(seq, n)

    @staticmethod
    def committed(seq: ModelSeq, n: int) -> None:
        seq.committed = n
        if n > seq.covered:
            seq.lookahead -= n - seq.covered
            seq.covered = n

    @precondition(lambda self: any(not s.by_hashes for s in self.seqs.values()))
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from([i for i in self.live() if not self.seqs[i].by_hashes]))
        seq = self.seqs[seq_id]
        for m in self.ms:
            m.append_tokens(seq_id, tokens)
        seq.tokens.extend(tokens)
        self.learn_hashes(seq)

    # ---------------------------------------------------------------- the batched step

    def draw_entry(self, data: st.DataObject, seq_id: int) -> StepEntry:
        seq = self.seqs[seq_id]
        commit = None
        if data.draw(st.integers(0, 3)):  # mostly a commit: what the forward pass wrote
            commit = data.draw(st.integers(seq.committed, min(seq.covered + seq.lookahead, len(seq.tokens))))
        tokens = [] if seq.by_hashes else data.draw(st.lists(st.integers(0, 3), max_size=3))
        new = data.draw(st.sampled_from([0, 1, 1, 1, 2, 4]))  # decode, or the next prefill chunk
        k = data.draw(st.sampled_from([0, 0, 1, 2, 3]))  # fewer drafts than last time: rejected slots come back
        return StepEntry(seq_id, commit, tokens, new, k)

    @precondition(lambda self: any(s.admitted for s in self.seqs.values()))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        ids = data.draw(st.permutations(self.admitted()))
        ids = ids[: data.draw(st.integers(1, len(ids)))]
        entries = [self.draw_entry(data, i) for i in ids]
        for e in entries:
            if e.commit is not None:
                self.write_kv(self.seqs[e.seq_id], e.commit)
        before = {e.seq_id: self.seq_state(self.m, e.seq_id) for e in entries}
        failed = self.m.step(ids, *self.step_args(data, entries))
        event(f"step: {len(entries)} entries, {len(failed)} failed")
        assert failed == self.per_sequence(entries), "step and the per-sequence calls disagree"
        for e in entries:
            seq = self.seqs[e.seq_id]
            if e.seq_id in failed and self.seq_state(self.m, e.seq_id) == before[e.seq_id]:
                continue  # nothing changed for it; the per-sequence path said when it could not grow
            self.stepped(seq, e, failed=e.seq_id in failed)

    @staticmethod
    def seq_state(m: KVCacheManager, seq_id: int) -> tuple[Any, ...]:
        s = m._seqs[seq_id]
        return (tuple(m.block_table(seq_id)), dict(s.pins or {}), s.num_committed, s.num_covered, s.lookahead)

    @staticmethod
    def effective(seq: ModelSeq, e: StepEntry) -> int:
        return seq.committed if e.commit is None else e.commit

    @staticmethod
    def step_args(data: st.DataObject, entries: list[StepEntry]) -> tuple[Any, ...]:
        """The step's columns, as lists or -- where one value serves all -- as scalars or None."""
        commits: list[int | None] | None = [e.commit for e in entries]
        if all(c is None for c in commits) and data.draw(st.booleans()):  # type: ignore[union-attr]
            commits = None
        tokens: list[list[int]] | None = [e.tokens for e in entries]
        if not any(tokens) and data.draw(st.booleans()):  # type: ignore[arg-type]
            tokens = None
        news: Any = [e.new for e in entries]
        if len(set(news)) == 1 and data.draw(st.booleans()):
            news = news[0]
        ks: Any = [e.lookahead for e in entries]
        if len(set(ks)) == 1 and data.draw(st.booleans()):
            ks = ks[0]
        return commits, tokens, news, ks

    def per_sequence(self, entries: list[StepEntry]) -> list[int]:
        """The same step through the per-sequence calls, on the other manager."""
        p = self.p
        failed = []
        for e in entries:
            seq = self.seqs[e.seq_id]
            n = self.effective(seq, e)
            target = max(seq.covered, n + e.new)
            short = p.blocks_short(e.seq_id, target - seq.covered, num_lookahead_tokens=e.lookahead)
            if short:
                failed.append(e.seq_id)
                continue
            content = p._seqs[e.seq_id].content
            known = p.num_tokens(e.seq_id)
            if e.tokens:
                p.append_tokens(e.seq_id, e.tokens)
            # A commit that pins idle cached duplicates takes that many free blocks; the step counts them
            # before committing, and an entry they would leave without room changes nothing.
            size = p.block_size
            need = max(0, -(-(target + e.lookahead) // size) - len(p.block_table(e.seq_id)))
            pinned = p._full.idle_duplicates(p._seqs[e.seq_id], p.num_computed_tokens(e.seq_id) // size, n // size)
            if pinned and need + pinned > p.num_free_blocks:
                content.truncate(known)  # type: ignore[union-attr]
                failed.append(e.seq_id)
                continue
            p.commit(e.seq_id, n)
            covered = max(seq.covered, n)
            assert p.allocate(e.seq_id, target - covered, num_lookahead_tokens=e.lookahead) is not None
        return failed

    def stepped(self, seq: ModelSeq, e: StepEntry, *, failed: bool) -> None:
        """Follow a step entry in the model: commit, append, then the slots (unless it failed)."""
        if failed:  # nothing changed for it (the snapshots of both managers are compared after the rule)
            assert self.m.num_tokens(e.seq_id) == len(seq.tokens)
            return
        n = self.effective(seq, e)
        target = max(seq.covered, n + e.new)
        self.committed(seq, n)
        seq.tokens.extend(e.tokens)
        self.learn_hashes(seq)
        seq.covered, seq.lookahead = target, e.lookahead
        table = list(self.m.block_table(e.seq_id))
        self.take_table(seq, table, min(len(seq.table), len(table)))
        assert self.m.num_allocated_tokens(e.seq_id) >= n + e.new + e.lookahead

    @precondition(lambda self: any(s.admitted for s in self.seqs.values()))
    @rule(data=st.data(), kind=st.sampled_from(["unknown", "twice", "below", "above", "waiting", "negative", "hashes"]))
    def step_bad_input(self, data: st.DataObject, kind: str) -> None:
        """One bad entry anywhere in the batch: the step raises before anything changes."""
        ids: list[Any] = list(data.draw(st.permutations(self.admitted())))
        commits: list[int | None] = [None] * len(ids)
        tokens: list[list[int]] = [[] for _ in ids]
        news = [1] * len(ids)
        at = data.draw(st.integers(0, len(ids) - 1))
        seq = self.seqs[ids[at]]
        error: type[Exception] = InvalidArgumentError
        if kind == "unknown":
            ids[at], error = "nobody", UnknownSequenceError
        elif kind == "twice":
            ids.append(ids[at])
            commits.append(None)
            tokens.append([])
            news.append(1)
        elif kind == "below" and seq.committed:
            commits[at], error = seq.committed - 1, CommitOutOfRangeError
        elif kind == "above":
            commits[at], error = min(seq.covered + seq.lookahead, len(seq.tokens)) + 1, CommitOutOfRangeError
        elif kind == "waiting" and len(self.admitted()) < len(self.seqs):
            waiting = [i for i in self.live() if not self.seqs[i].admitted]
            ids[at], error = data.draw(st.sampled_from(waiting)), SequenceStateError
        elif kind == "hashes" and seq.by_hashes:
            tokens[at], error = [1], SequenceStateError
        else:
            news[at] = -1
        before = full_snapshot(self.m)
        with pytest.raises(error):
            self.m.step(ids, commits, tokens, news, 0)
        assert full_snapshot(self.m) == before, "a refused step changed something"

    # ---------------------------------------------------------------- the rest of the lifecycle

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        for m in self.ms:
            m.free(seq_id)
        del self.seqs[seq_id]
        self.seen.pop(seq_id, None)

    @precondition(lambda self: any(s.admitted for s in self.seqs.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.admitted()))
        seq = self.seqs[seq_id]
        for m in self.ms:
            m.preempt(seq_id)
        seq.admitted, seq.preempted, seq.committed, seq.covered, seq.lookahead, seq.table = (
            False,
            True,
            0,
            0,
            0,
            [],
        )

    @rule()
    def reset(self) -> None:
        in_use = any(s.table for s in self.seqs.values())  # refused while any block is held
        for m in self.ms:
            assert m.reset_prefix_cache() is (not in_use)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def lockstep(self) -> None:
        assert full_snapshot(self.m) == full_snapshot(self.p), "the step-driven and per-sequence managers differ"

    @invariant()
    def integrity(self) -> None:
        for m in self.ms:
            m.check_integrity()

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
            seq = self.seqs[seq_id]
            assert list(self.m.block_table(seq_id)) == seq.table
            assert self.m.num_computed_tokens(seq_id) == seq.committed
            assert self.m.num_allocated_tokens(seq_id) == seq.covered + seq.lookahead
            assert self.m.num_tokens(seq_id) == len(seq.tokens)

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
    max_examples=200, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerMachine = ManagerMachine.TestCase
