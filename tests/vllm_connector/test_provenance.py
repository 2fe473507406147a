"""No block whose context held a failed load is ever saved (issue 29), without vLLM.

The unit tests pin the provenance rules; the state machine runs a small vLLM -- its prefix cache filled at
allocation, loads before the forward pass, layer-wise "write before read" within a step, its recovery rule for
invalid blocks (the first request holding one recomputes from it, the others re-run their step) -- against the
real planner and the worker's guard resolution, with a shadow truth of what every block holds, and checks that
every save the worker lets through holds sound KV, whatever the store's damage and the report lag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblocks.integrations.vllm.planner import BlockRun, Scheduled, StepPlan, TransferPlanner
from kvblocks.integrations.vllm.provenance import BAD, BlockProvenance, merge_roots
from kvblocks.integrations.vllm.worker import LoadRecord, WorkerReport
from tests.support.vllm_planner import FakeIndex, chain

# ------------------------------------------------------------------ the rules


def test_a_load_run_is_its_blocks_root_until_its_step_is_confirmed() -> None:
    p = BlockProvenance()
    p.loaded(7, [[1, 2]])
    assert p.roots_of(1) == {(7, 0, 1)} and p.roots_of(2) == {(7, 0, 2)}  # block j needs the run's first j + 1
    p.wrote([9], merge_roots([p.roots_of(1), p.roots_of(2)]))
    assert p.roots_of(9) == {(7, 0, 2)} and not p.clean
    p.confirm(6, [0])  # another step's report changes nothing here
    assert p.roots_of(9) == {(7, 0, 2)}
    p.confirm(7, [2])
    assert p.clean


def test_what_depends_on_a_failed_load_is_bad_and_the_rest_clean() -> None:
    p = BlockProvenance()
    p.loaded(3, [[1, 2, 3], [4]])
    p.wrote([10, 11], merge_roots([p.roots_of(1), p.roots_of(2)]))
    p.wrote([12], p.roots_of(1))
    p.wrote([13], p.roots_of(4))
    p.confirm(3, [1, 1])  # run 0 stopped at its second block (2 and 3 reported failed); run 1 arrived whole
    assert [p.is_bad(b) for b in (1, 2, 3, 4, 10, 11, 12, 13)] == [False, True, True, False, True, True, False, False]
    assert p.roots_of(2) == {BAD} and p.roots_of(12) == frozenset()
    assert p.clean is False and len(p) == 4


def test_a_bad_block_is_clean_once_rewritten_over_a_clean_context_reloaded_or_handed_out_new() -> None:
    p = BlockProvenance()
    p.failed([1, 2, 3])
    p.wrote([1], frozenset())
    p.loaded(4, [[2]])
    p.fresh([3])
    assert not p.is_bad(1) and p.roots_of(2) == {(4, 0, 1)} and not p.is_bad(3)
    p.wrote([5], frozenset({BAD}))
    assert p.is_bad(5)


def test_the_scan_finds_only_tainted_positions() -> None:
    p = BlockProvenance()
    assert p.tainted_positions([1, 2, 3], 0, 3) == []
    p.loaded(1, [[2]])
    assert p.tainted_positions([1, 2, 3, 2], 0, 4) == [(1, frozenset({(1, 0, 1)})), (3, frozenset({(1, 0, 1)}))]
    assert p.tainted_positions([1, 2, 3, 2], 2, 3) == []


# ------------------------------------------------------------------ the issue's step, at the planner


def test_the_issues_step_withholds_every_save_computed_over_a_failed_load() -> None:
    """r0 loads blocks 0..5 and computes 6..9 in the step; r1 hits r0's blocks 0..7 in vLLM's prefix cache and
    computes its own 8..9. Block 1's load fails (another key's entry): nothing computed this step may be saved,
    and r0's recomputation a step later is."""
    shared = chain(8, "s")
    h0, h1 = shared + chain(2, "a"), shared + chain(2, "b")
    index = FakeIndex(stored=set(shared[:6]), known=set(shared[:6]), probe_room=0)
    planner = TransferPlanner(index, 4)
    assert planner.match("r0", h0, 41, 0) == 24
    planner.allocated("r0", list(range(1, 11)), 24)
    r0 = Scheduled("r0", 24, 17, block_ids=list(range(1, 11)))
    r1 = Scheduled("r1", 32, 9, block_ids=[*range(1, 9), 11, 12])
    plan = planner.plan_step([r0, r1], hashes={"r1": h1})
    loads = frozenset({(plan.step, 0, 6)})  # every block of the one load run
    assert plan.loads == (BlockRun("r0", tuple(h0[:6]), (1, 2, 3, 4, 5, 6)),)
    assert plan.saves == (
        BlockRun("r0", tuple(h0[6:10]), (7, 8, 9, 10), (loads,) * 4),
        BlockRun("r1", tuple(h1[8:10]), (11, 12), (loads,) * 2),
    )
    record = LoadRecord()
    record.note(plan.step, [1])  # the leading run stops at block 1: one block arrived
    assert record.failed_roots(loads) == loads  # the worker withholds all six saves
    planner.confirm({plan.step: {2, 3, 4, 5, 6}}, [("r0", h) for h in h0[6:10]] + [("r1", h) for h in h1[8:10]])
    assert all(planner.provenance.is_bad(b) for b in (2, 7, 10, 11, 12)) and not planner.provenance.is_bad(1)
    # vLLM: r0 recomputes from block 1, r1 re-runs its step beside it (the same forward pass writes first)
    plan = planner.plan_step([Scheduled("r0", 4, 37), Scheduled("r1", 32, 9)])
    assert plan.saves == (
        BlockRun("r0", tuple(h0[1:10]), tuple(range(2, 11))),
        BlockRun("r1", tuple(h1[8:10]), (11, 12)),
    )
    assert planner.provenance.clean


# ------------------------------------------------------------------ a small vLLM against the planner

BS = 2
CHAIN = chain(40, "c")


@dataclass
class Request:
    rid: str
    tokens: int
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # grows with the tokens, as vLLM's request.block_hashes
    computed: int = 0
    scheduled: bool = False


class ConnectorMachine(RuleBasedStateMachine):
    """The invariant: every block the worker saves holds sound KV for its hash (see the module docstring)."""

    @initialize(stored=st.sets(st.integers(0, 15)), lag=st.integers(0, 1))
    def setup(self, stored: set[int], lag: int) -> None:
        self.sound = {p: True for p in stored}  # position -> the store's entry is sound
        index = FakeIndex(stored={CHAIN[p] for p in stored}, known={CHAIN[p] for p in stored}, probe_room=0)
        self.index = index
        self.planner = TransferPlanner(index, BS)
        self.record = LoadRecord()
        self.lag = lag  # 1: the next step is planned before this one's outcome arrives (async scheduling)
        self.cache: dict[int, int] = {}  # vLLM's prefix cache: position -> block id
        self.truth: dict[int, bool] = {}  # block id -> holds the sound KV of the position it serves
        self.requests: dict[str, Request] = {}
        self.waiting: list[str] = []
        self.next_id = 1
        self.outcomes: list[tuple[StepPlan, list[int], list[tuple[str, bytes]], dict[str, int]]] = []
        self.saved = 0

    def _fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(blocks=st.integers(1, 12))
    def arrive(self, blocks: int) -> None:
        rid = f"r{len(self.requests) + len(self.waiting) + self.next_id}"
        self.requests[rid] = Request(rid, blocks * BS + 1)
        self.waiting.append(rid)

    @rule(position=st.integers(0, 15))
    def damage(self, position: int) -> None:
        if position in self.sound:
            self.sound[position] = False

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        records: list[Scheduled] = []
        before: dict[str, int] = {}
        writes: list[tuple[Request, int, int]] = []  # request, first and last+1 token computed
        for r in self.requests.values():  # running first: decode a token, or re-run what vLLM rewound
            if not r.scheduled:
                continue
            before[r.rid] = r.computed
            if r.computed >= r.tokens - 1:
                r.tokens += 1
                r.hashes[:] = CHAIN[: r.tokens // BS]
            new = [self._fresh() for _ in range(len(r.table), -(-r.tokens // BS))]
            r.table += new
            for p in range(r.tokens // BS):
                self.cache.setdefault(p, r.table[p])
            records.append(Scheduled(r.rid, r.computed, r.tokens - r.computed, new_block_ids=new))
            writes.append((r, r.computed, r.tokens))
        for rid in self.waiting:  # then new ones, in order, each seeing the cache the earlier ones filled
            r = self.requests[rid]
            limit = (r.tokens - 1) // BS
            local = 0
            while local < limit and local in self.cache:
                local += 1
            r.hashes = CHAIN[: r.tokens // BS]
            got = self.planner.match(rid, r.hashes, r.tokens, local * BS)
            external = (got or 0) // BS
            r.table = [self.cache[p] for p in range(local)] + [self._fresh() for _ in range(local, -(-r.tokens // BS))]
            self.planner.allocated(rid, r.table, external * BS)
            r.computed = (local + external) * BS
            for p in range(local, r.tokens // BS):  # vLLM caches the blocks this step fills, at allocation
                self.cache.setdefault(p, r.table[p])
            before[rid] = r.computed
            records.append(Scheduled(rid, r.computed, r.tokens - r.computed, block_ids=list(r.table)))
            writes.append((r, r.computed, r.tokens))
            r.scheduled = True
        self.waiting = []
        plan = self.planner.plan_step(records)
        failed = self._load(plan)
        self._forward(writes)
        withheld = self._save(plan)
        for r, _, end in writes:
            r.computed = end
        self.outcomes.append((plan, failed, withheld, before))
        while len(self.outcomes) > self.lag:
            self._outcome(*self.outcomes.pop(0))

    def _load(self, plan: StepPlan) -> list[int]:
        failed: list[int] = list(plan.failed)
        arrived = []
        for run in plan.loads:
            ok, count = True, 0
            for h, b in zip(run.hashes, run.block_ids, strict=True):
                ok = ok and self.sound.get(CHAIN.index(h), False)
                self.truth[b] = ok  # a failed load is poisoned: never sound
                count += ok
                if not ok:
                    failed.append(b)
            arrived.append(count)
        self.record.note(plan.step, arrived)
        self.record.forget_before(plan.oldest_pending)
        return failed

    def _forward(self, writes: Sequence[tuple[Request, int, int]]) -> None:
        """Each block written takes the truth of its whole context, every layer written before it is read: in
        position order across the requests of the step."""
        top = max((-(-end // BS) for _, _, end in writes), default=0)
        for position in range(top):
            for r, start, end in writes:
                if start // BS <= position < -(-end // BS):
                    context = [self.truth.get(r.table[q], False) for q in range(position)]
                    if start % BS and position == start // BS:  # a part-filled block keeps what it held
                        context.append(self.truth.get(r.table[position], False))
                    self.truth[r.table[position]] = all(context)

    def _save(self, plan: StepPlan) -> list[tuple[str, bytes]]:
        roots = [root for run in plan.saves for guard in run.guards for root in guard]
        failed = self.record.failed_roots(roots)
        withheld: list[tuple[str, bytes]] = []
        for run in plan.saves:
            keep = len(run.block_ids)
            if run.guards:
                keep = next((i for i, g in enumerate(run.guards) if not failed.isdisjoint(g)), keep)
            for h, b in zip(run.hashes[:keep], run.block_ids[:keep], strict=True):
                assert self.truth.get(b, False), f"saved block {b} ({h!r}) holds KV computed over a failed load"
                self.sound[CHAIN.index(h)] = True
                self.index.stored.add(h)
                self.saved += 1
            withheld += [(run.request_id, h) for h in run.hashes[keep:]]
        return withheld

    def _outcome(self, plan: StepPlan, failed: list[int], withheld: list[tuple[str, bytes]], before: dict) -> None:
        """vLLM's recovery (``_update_requests_with_invalid_blocks``), then the connector's report."""
        invalid = set(failed)
        marked: set[int] = set()
        for r in self.requests.values():
            if r.rid not in before or not invalid:
                continue
            pre = before[r.rid]
            affected = first = False
            for position in range(-(-pre // BS)):
                b = r.table[position]
                if b not in invalid:
                    continue
                affected = True
                if b in marked:
                    continue
                marked.add(b)
                if not first:
                    first = True
                    r.computed = min(r.computed, position * BS)
            if affected and not first:
                r.computed = min(r.computed, pre)
        self.planner.load_failed(invalid)
        report = WorkerReport({plan.step: frozenset(failed)} if plan.loads or plan.failed else {}, tuple(withheld))
        self.planner.confirm(report.failed, report.withheld)

    @precondition(lambda self: any(r.scheduled for r in self.requests.values()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(r.rid for r in self.requests.values() if r.scheduled)))
        del self.requests[rid]
        self.planner.finished(rid)

    @invariant()
    def follows_live_requests_only(self) -> None:
        if hasattr(self, "planner"):
            assert len(self.planner) <= len(self.requests) + len(self.waiting)


ConnectorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_no_save_holds_kv_computed_over_a_failed_load = ConnectorMachine.TestCase
